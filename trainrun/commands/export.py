"""``trainrun export``: an inference ONNX model from a checkpoint (offline, no MPI).

The inference model (:func:`inference_model`: the model's inputs only, its logits
only, dropout off, no training ops) gets the checkpoint's parameters as
initializers: the run's ``graphs/forward.onnx``, or the inference graph its model family builds
(a BERT's: masked positions optional); for a graph with its own loss that graph without the
loss, its metrics and the inputs only they read. With ``--with-loss`` the eval
graph is used instead (loss and logits; takes labels). The result is checked
against the eval graph on a sample batch and the max difference of its outputs
printed.

``--format transformers`` and ``--format peft`` write Hugging Face's folders instead (:mod:`trainrun.hf.export`).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx
from onnx import numpy_helper

from .. import checkpoint as K
from .. import faults
from ..graphs import frozen as frozen_weights
from ..graphs.gradients import add_outputs, keep_outputs, reads
from ..graphs.lora import merged
from ..graphs.manifest import FROZEN_FILE, load_manifest
from ..graphs.names import METRIC_PREFIX
from ..graphs.onnx_edit import IR_VERSION
from .. import config as C
from ..run import rundir
from ..hf import tokenizer as T
from ..errors import TrainrunError, UsageError
from ..step.flat import FlatLayout
from ..models import registry
from ..step.sessions import session_options

_EXTERNAL_DATA_BYTES = 1_800_000_000   # protobuf's 2 GB limit: larger models keep weights beside the .onnx
_COPY_CHUNK = 16 << 20                 # bytes copied at a time from a checkpoint into the model file


@dataclasses.dataclass
class Weight:
    """One initializer to write: float32 ``nbytes`` at ``offset`` of the file ``file`` of the checkpoint
    ``src`` (its safetensors, held open), copied into the model file chunk by chunk, never held whole."""
    name: str
    dims: tuple[int, ...]
    src: K.Pinned
    file: str
    offset: int
    nbytes: int

    def tensor(self, location: str | None = None, offset: int = 0) -> onnx.TensorProto:
        """The TensorProto without its data; with ``location``: its data at ``offset`` of that file."""
        t = onnx.TensorProto(name=self.name, data_type=onnx.TensorProto.FLOAT, dims=self.dims)
        if location is not None:
            for k, v in (("location", location), ("offset", offset), ("length", self.nbytes)):
                t.external_data.add(key=k, value=str(v))
            t.data_location = onnx.TensorProto.EXTERNAL
        return t

    def copy_to(self, out) -> None:
        buf = memoryview(bytearray(min(self.nbytes, _COPY_CHUNK) or 1))
        for pos in range(0, self.nbytes, len(buf)):
            part = buf[:min(len(buf), self.nbytes - pos)]
            self.src.readinto(self.file, part, self.offset + pos)
            out.write(part)


def _model_tensors(ckpt: K.Pinned, manifest: dict) -> tuple[FlatLayout, FlatLayout]:
    """The layouts of the parameters and of the non-parameter state of the run's graphs (``manifest``),
    once ``ckpt`` is checked against those graphs (:func:`checkpoint.check_checkpoint`)."""
    layout = FlatLayout.from_manifest(manifest)
    states = FlatLayout.from_manifest({"params": manifest.get("states", [])})
    K.check_checkpoint(ckpt, layout.names + states.names,
                       (os.path.join(rundir.run_dir_of(ckpt.dir), "graphs"), manifest))
    return layout, states


GLOBAL_WEIGHTS = "DiLoCo's global weights (checkpoint taken mid-round; its parameters are replica 0's)"


def parameters_of(ckpt: K.Pinned) -> tuple[str, str, str | None]:
    """Where the model's parameters of a checkpoint lie: (file, key prefix, what they are where not plain).
    A ``distributed.sync: diloco`` checkpoint taken mid-round holds replica 0's weights as its parameters and
    the global weights, the ones the run evaluates, whole in optimizer.safetensors ``outer_weights/``: those."""
    if (K.read_state(ckpt).get("diloco") or {}).get("mid_round"):
        return "optimizer.safetensors", "outer_weights/", GLOBAL_WEIGHTS
    return "model.safetensors", "", None


def weight_files(ckpt: K.Pinned) -> list[str]:
    """The files of a checkpoint its model's weights are read from (:func:`parameters_of`): what a reader of
    the weights verifies, and no more (a damaged optimizer.safetensors does not stop an export)."""
    return ["state.json", "model.safetensors", parameters_of(ckpt)[0]]


def checkpoint_tensors(ckpt: K.Pinned, manifest: dict) -> list[Weight]:
    """Where the parameters (:func:`parameters_of`), then the non-parameter state (model.safetensors), of a
    checkpoint lie."""
    layout, states = _model_tensors(ckpt, manifest)
    out = []
    for (file, prefix, _), names, shapes in ((parameters_of(ckpt), layout.names, layout.shapes),
                                             (("model.safetensors", "", None), states.names, states.shapes)):
        start, spans = K.tensor_spans(ckpt, file, [prefix + n for n in names], shapes)
        out += [Weight(n, tuple(s), ckpt, file, start + off, size) for n, s, (off, size) in zip(names, shapes, spans)]
    return out


def frozen_tensors(graphs: K.Held, manifest: dict) -> list[Weight]:
    """Where the frozen weights (the manifest's ``frozen``: model.frozen's, model.lora's base) lie in the
    graphs' frozen.safetensors (``graphs``: the graphs folder with it held open, :func:`graphs.frozen.held`)."""
    return [Weight(n, s, graphs, FROZEN_FILE, offset, size)
            for n, s, offset, size in frozen_weights.spans(graphs, manifest)]


def mapped_weights(weights: list[Weight]) -> dict[str, np.ndarray]:
    """The tensors as read-only arrays mapped from their files (pages read on use, no copy made)."""
    return {w.name: np.memmap(w.src.file(w.file), np.float32, "r", w.offset, w.dims) for w in weights}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, size: int) -> bytes:
    """The key and length of a length-delimited protobuf field ``number`` of ``size`` bytes."""
    return _varint(number << 3 | 2) + _varint(size)


def _fields(msg, keep) -> bytes:
    """``msg`` serialized with only the fields whose number passes ``keep`` (protobuf writes fields in
    number order, so these parts concatenate to the whole message)."""
    part = type(msg)()
    part.CopyFrom(msg)
    for fd, _ in part.ListFields():
        if not keep(fd.number):
            part.ClearField(fd.name)
    return part.SerializeToString()


_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9      # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data


def save_with_weights(model: onnx.ModelProto, path: str, weights: list[Weight]) -> None:
    """Write ``model`` to ``path`` with ``weights`` as initializers after its own (and no longer graph
    inputs): the bytes of ``onnx.save`` of that model, streamed tensor by tensor from the weights' files.
    Above protobuf's 2 GB limit the tensors go to ``<path>.data`` beside it (onnx's external data layout:
    one file, in order, tensors under 1 KB kept inline). Both files are written under temporary names
    and moved into place."""
    names = {w.name for w in weights}
    model_ = onnx.ModelProto()
    model_.CopyFrom(model)
    inputs = [i for i in model_.graph.input if i.name not in names]
    del model_.graph.input[:]
    model_.graph.input.extend(inputs)
    graph = model_.graph
    external = sum(w.nbytes for w in weights) + sum(t.ByteSize() for t in graph.initializer) > _EXTERNAL_DATA_BYTES
    location = os.path.basename(path) + ".data"
    entries, data_off = [], 0         # (bytes before the data, data follows inline)
    for w in weights:
        if external and w.nbytes >= 1024:
            head = w.tensor(location, data_off).SerializeToString()
            data_off += w.nbytes
            entries.append((w, _field(_INITIALIZER, len(head)) + head, False))
        else:
            head = w.tensor().SerializeToString() + _field(_RAW_DATA, w.nbytes)
            entries.append((w, _field(_INITIALIZER, len(head) + w.nbytes) + head, True))
    g_lo = _fields(graph, lambda n: n <= _INITIALIZER)        # nodes, name, the model's own initializers
    g_hi = _fields(graph, lambda n: n > _INITIALIZER)
    size = len(g_lo) + len(g_hi) + sum(len(h) + (w.nbytes if inline else 0) for w, h, inline in entries)
    tmp, data_tmp = path + ".tmp", os.path.join(os.path.dirname(os.path.abspath(path)), location + ".tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(_fields(model_, lambda n: n < _GRAPH) + _field(_GRAPH, size) + g_lo)
            for w, head, inline in entries:
                out.write(head)
                if inline:
                    w.copy_to(out)
            out.write(g_hi + _fields(model_, lambda n: n > _GRAPH))
        if external:
            with open(data_tmp, "wb") as data:
                for w, _, inline in entries:
                    if not inline:
                        w.copy_to(data)
        faults.wait_until("WAIT_SIGNAL", 0, "export", lambda: False)     # until a stop signal abandons it
        if external:
            os.replace(data_tmp, os.path.join(os.path.dirname(os.path.abspath(path)), location))
        os.replace(tmp, path)
    except BaseException:
        for p in (tmp, data_tmp):
            if os.path.exists(p):
                os.remove(p)
        raise


def sample_batch(graphs_dir: str, manifest: dict, rng_seed: int = 0) -> dict[str, np.ndarray]:
    """A small random batch for the data inputs and the labels of the eval graph (ids below the vocab)."""
    model = onnx.load(os.path.join(graphs_dir, "eval.onnx"), load_external_data=False)
    family = registry.of_manifest(manifest)
    rng = np.random.default_rng(rng_seed)
    if family is not None and family.sample_batch is not None:     # inputs with ranges of their own
        return family.sample_batch(family.shape_of(manifest), rng)
    vocab = family.shape_of(manifest).vocab_size if family is not None else 2
    batch = {}
    for i in model.graph.input:
        if i.name not in manifest["inputs"] and i.name != manifest["labels"]:
            continue
        dims = [d.dim_value if d.dim_value > 0 else 4 for d in i.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        batch[i.name] = rng.integers(0, vocab, dims).astype(dtype) if np.issubdtype(dtype, np.integer) \
            else rng.standard_normal(dims).astype(dtype)
    return batch


def labels_for(logits: np.ndarray, labels: np.ndarray, loss: dict) -> np.ndarray:
    """``labels`` (a sample's), drawn again of the shape ``logits`` need where the eval graph left their dims
    open (a user graph whose output dims its exporter did not know: :func:`sample_batch` guessed them)."""
    shape = list(logits.shape)
    if loss["type"] == "cross_entropy" and shape:
        del shape[loss["class_axis"] % len(shape)]
    if list(labels.shape) == shape:
        return labels
    rng = np.random.default_rng(0)
    return rng.integers(0, 2, shape).astype(labels.dtype) if labels.dtype.kind in "iu" \
        else rng.standard_normal(shape).astype(labels.dtype)


def checkpoint_weights(ckpt, manifest: dict, retry=None) -> dict[str, np.ndarray]:
    """The parameters (:func:`parameters_of`) and the non-parameter state of a checkpoint (a path or a
    :class:`checkpoint.Pinned` one), by name, the files read verified (:func:`weight_files`; ``retry``: the
    command reading another checkpoint, named where one is corrupt, :func:`checkpoint.verify`)."""
    with K.reading(ckpt) as ckpt:
        K.verify(ckpt, weight_files(ckpt), retry=retry)
        layout, states = _model_tensors(ckpt, manifest)
        flat = np.empty(layout.total, np.float32)
        file, prefix, _ = parameters_of(ckpt)
        K.load_tensors_into(ckpt, file, layout.names, layout.shapes, flat, prefix=prefix)
        weights = layout.unflatten(flat)
        if states.names:          # the model's non-parameter state (BatchNorm running stats), after the parameters
            held = np.empty(states.total, np.float32)
            K.load_tensors_into(ckpt, "model.safetensors", states.names, states.shapes, held)
            weights.update(states.unflatten(held))
    return weights


def full_weights(graphs_dir: str, manifest: dict, weights: dict) -> dict[str, np.ndarray]:
    """``weights`` (a checkpoint's) as the full model: with the frozen weights (the graphs'
    frozen.safetensors, mapped from the file), and for a LoRA run (``model.lora``) the adapters merged into
    the base (W + B A alpha / r)."""
    with frozen_weights.held(graphs_dir, manifest) as graphs:
        frozen = mapped_weights(frozen_tensors(graphs, manifest))
    lora = manifest.get("lora")
    if not lora:
        return {**frozen, **weights}
    return merged({**frozen, **weights}, manifest["model"]["lora"], lora["in_out"])


def kv_cache_model(manifest: dict, weights, where: str):
    """The model family's inference graph with the attention cache (dropout off) holding ``weights()``."""
    family = registry.of_manifest(manifest)
    if family is None or family.kv_cache is None:
        raise UsageError(f"{where}: the attention-cache graph is built for model.builtin "
                         f"{' or '.join(registry.generating())} only (this run: "
                         f"{manifest['model'].get('builtin') or 'a user graph'}); export it and pass the .onnx file")
    return family.kv_cache(family.without_dropout(family.shape_of(manifest)), weights())


def inference_model(graphs_dir: str, manifest: dict, where: str, loss_only_ok: bool = False) -> onnx.ModelProto | None:
    """The model's inputs only and its logits only (the weights follow): ``forward.onnx``; the inference
    graph of a model family that builds one (BERT's: ``masked_lm_positions`` optional, without them the
    MLM logits at every position); a graph with its own loss (``model.loss.output``) without that loss,
    its metrics and the inputs only they read. A graph whose outputs are its loss and metrics only:
    None with ``loss_only_ok``, else a UsageError."""
    family = registry.of_manifest(manifest)
    if family is not None and family.inference is not None:
        return family.inference(family.without_dropout(family.shape_of(manifest)))
    model = onnx.load(os.path.join(graphs_dir, "forward.onnx"))
    loss = manifest.get("loss_output")
    if not loss:
        return model
    keep = [o.name for o in model.graph.output if o.name != loss and not o.name.startswith(METRIC_PREFIX)]
    if not keep:
        if loss_only_ok:
            return None
        raise UsageError(f"{where}: the model's outputs are its loss '{loss}' and metrics only: nothing to "
                         f"export without them (--with-loss exports the loss)")
    return keep_outputs(model, keep)


def _logits_in_two_passes(session, ids: np.ndarray) -> np.ndarray:
    """An attention-cache graph's logits for ``ids``: the first half with no past, the rest after it."""
    past = [i for i in session.get_inputs() if i.name.startswith("past.")]
    empty = {i.name: np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32) for i in past}
    present = [i.name.replace("past.", "present.", 1) for i in past]
    half = ids.shape[1] // 2
    first = session.run(["logits", *present], {"input_ids": ids[:, :half], **empty})
    cache = dict(zip([i.name for i in past], first[1:]))
    second = session.run(["logits"], {"input_ids": ids[:, half:], **cache})[0]
    return np.concatenate([first[0], second], axis=1)


def export_checkpoint(checkpoint: str, output: str, *, opset: int | None = None, with_loss: bool | None = None,
                      kv_cache: bool = False,
                      verify: bool = True, echo=print, retry=None) -> float:
    """Write the inference model; return the max |logits difference| against the eval graph.
    ``with_loss`` True: the eval graph (loss and logits); None (the end of a run): the inference model, or
    the eval graph, said, when the model outputs nothing but its loss and metrics (a user graph that
    returns its loss only); False: the inference model or a UsageError. The checkpoint's files read are
    verified first (``retry``: the command exporting another checkpoint, named where one is corrupt)."""
    with K.pin(checkpoint) as held:       # its files stay readable if the run training on prunes it
        graphs_dir = os.path.join(rundir.run_dir_of(held.dir), "graphs")
        with frozen_weights.held(graphs_dir, load_manifest(graphs_dir)) as graphs:
            return _export(held, graphs, output, opset, with_loss, kv_cache, verify, echo, retry)


def _export(held: K.Pinned, graphs: K.Held, output: str, opset, with_loss, kv_cache, verify, echo, retry) -> float:
    import onnxruntime as ort

    ckpt = held.dir
    graphs_dir = graphs.dir
    manifest = load_manifest(graphs_dir)
    K.verify(held, weight_files(held), retry=retry)
    # streamed from the files into the model: no copy held; the frozen weights from the graphs folder
    tensors = checkpoint_tensors(held, manifest) + frozen_tensors(graphs, manifest)

    full = None
    if manifest.get("lora") and not with_loss:       # a LoRA run: the full model, the adapters merged
        full = full_weights(graphs_dir, manifest, checkpoint_weights(held, manifest, retry))
        family = registry.of_manifest(manifest)
        section = family.without_dropout(family.shape_of(manifest))
        if kv_cache:
            model = kv_cache_model(manifest, lambda: full, where=ckpt)
        elif family.inference is not None:
            model = family.inference(section)
            used = reads(model.graph.node)
            model.graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in full.items() if n in used)
            kept = [i for i in model.graph.input if i.name not in full]
            del model.graph.input[:]
            model.graph.input.extend(kept)
        else:
            model = family.build(section, full)
    elif kv_cache:
        model = kv_cache_model(manifest, dict, where=ckpt)      # the graph alone; the weights follow
    else:
        model = None if with_loss else inference_model(graphs_dir, manifest, ckpt, loss_only_ok=with_loss is None)
        if model is None:
            if not with_loss:
                echo(f"note: the model's outputs are its loss '{manifest['loss_output']}' and metrics only: "
                     f"{output} is the graph with its loss (as export --with-loss), which takes the labels too")
            model = onnx.load(os.path.join(graphs_dir, "eval.onnx"))
    read = reads(model.graph.node)
    written = [t for t in tensors if t.name in read and full is None]   # what a graph without its loss still reads
    if opset is not None:
        current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        if opset != current:
            from onnx import version_converter
            try:
                model = version_converter.convert_version(model, opset)
            except Exception as exc:  # noqa: BLE001
                raise UsageError(f"--opset {opset}: cannot convert the model from opset {current}: {exc}") from None
    model.ir_version = min(model.ir_version, IR_VERSION)
    os.makedirs(os.path.dirname(os.path.abspath(output)) or ".", exist_ok=True)
    save_with_weights(model, output, written)
    del model
    if not verify:
        return 0.0

    batch = sample_batch(graphs_dir, manifest)          # data inputs and labels
    so = session_options(prepacking=False)      # no packed second copy of the weights
    exported = ort.InferenceSession(output, so, providers=["CPUExecutionProvider"])
    names = ["logits"] if kv_cache else [o.name for o in exported.get_outputs()]
    if kv_cache:
        ours = [_logits_in_two_passes(exported, batch["input_ids"])]
    else:       # what the model takes of the sample (optional inputs included: BERT's masked positions)
        takes = {i.name for i in exported.get_inputs() + exported.get_overridable_initializers()}
        ours = exported.run(names, {n: v for n, v in batch.items() if n in takes})
        optional = {i.name for i in exported.get_overridable_initializers()} & set(batch)
        if optional == {"masked_lm_positions"}:     # BERT without them: every position, compared at them
            every = exported.run([names[0]], {n: v for n, v in batch.items() if n in takes - optional})[0]
            ours.append(np.take_along_axis(every, batch["masked_lm_positions"][:, :, None], axis=1))
            names.append(names[0])
    del exported                # one session at a time
    if manifest["logits"] in names and manifest["labels"] in batch and registry.of_manifest(manifest) is None:
        batch[manifest["labels"]] = labels_for(ours[names.index(manifest["logits"])], batch[manifest["labels"]],
                                               manifest["model"]["loss"])
    ref_model = onnx.load(os.path.join(graphs_dir, "eval.onnx"))     # every exported output is one of its tensors
    add_outputs(ref_model, sorted(set(names) - {o.name for o in ref_model.graph.output}))
    ref_sess = ort.InferenceSession(ref_model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del ref_model
    unique = list(dict.fromkeys(names))
    ref = dict(zip(unique, ref_sess.run(unique, {**batch, **mapped_weights(tensors)})))
    # per output: max |difference| and its bound, relative to the eval graph's largest finite |value| there
    checked = [(float(np.abs(np.asarray(o, np.float64) - ref[n]).max()), _bound(ref[n]), n)
               for n, o in zip(names, ours)]
    diff = float(np.max([d for d, _, _ in checked]))     # NaN where any is
    what = parameters_of(held)[2]
    echo(f"exported {output} from {ckpt}{f': {what};' if what else ':'} max |logits - eval graph| = {diff:.3g} on a "
         f"{'x'.join(map(str, batch[manifest['inputs'][0]].shape))} sample ({', '.join(unique)}"
         f"{'; also without the masked positions, at them' if len(names) > len(unique) else ''})"
         f"{' (attention cache: half the sample, then the rest after it)' if kv_cache else ''}")
    for d, bound, n in checked:
        if not d <= bound:
            raise TrainrunError(f"{output}: the exported model differs from the eval graph by {d:.3g} in '{n}' "
                                f"(allowed: {bound:.3g}, {EXPORT_ATOL:g} + {EXPORT_RTOL:g} x its largest |value|)")
    return diff


# float32 rounding (kernels fused or weights folded in one graph and not the other, an attention cache's two
# passes) grows with the outputs' magnitude: 4e-7 of it seen; a wrong weight moves them by far more
EXPORT_ATOL, EXPORT_RTOL = 1e-4, 1e-5


def _bound(ref: np.ndarray) -> float:
    """The largest difference allowed from the eval graph's output ``ref``: EXPORT_ATOL + EXPORT_RTOL x
    its largest finite |value|."""
    finite = np.abs(np.asarray(ref, np.float64))
    finite = finite[np.isfinite(finite)]
    return EXPORT_ATOL + EXPORT_RTOL * (float(finite.max()) if finite.size else 0.0)
