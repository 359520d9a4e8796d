"""``trainrun export``: an inference ONNX model from a checkpoint (offline, no MPI).

The run's ``graphs/forward.onnx`` (dropout off, no training ops) gets the
checkpoint's parameters as initializers. With ``--with-loss`` the eval graph is
used instead (loss and logits; takes labels). The result is checked against
the eval graph on a sample batch and the max difference of the logits printed.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper

from . import checkpoint as K
from . import graphs as G
from .engine import FlatLayout
from .errors import TrainrunError, UsageError

_EXTERNAL_DATA_BYTES = 1_800_000_000   # protobuf's 2 GB limit: larger models keep weights beside the .onnx


def with_weights(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Turn the parameter inputs of ``model`` into initializers holding ``weights``."""
    inputs = [i for i in model.graph.input if i.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.extend(numpy_helper.from_array(w, name) for name, w in weights.items())
    return model


def save_model(model: onnx.ModelProto, path: str) -> None:
    tmp = path + ".tmp"
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size > _EXTERNAL_DATA_BYTES:
        onnx.save(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=os.path.basename(path) + ".data")
    else:
        onnx.save(model, tmp)
    os.replace(tmp, path)


def sample_batch(graphs_dir: str, manifest: dict, rng_seed: int = 0) -> dict[str, np.ndarray]:
    """A small random batch for the data inputs and the labels of the eval graph (ids below the vocab)."""
    model = onnx.load(os.path.join(graphs_dir, "eval.onnx"), load_external_data=False)
    if manifest["model"].get("builtin") == "bert":      # positions, types and labels have their own ranges
        from .config import BertConfig
        from .models.bert import sample_inputs
        return sample_inputs(BertConfig(**manifest["model"]["bert"]), 4, 16, 3, np.random.default_rng(rng_seed))
    vocab = manifest["model"]["gpt2"]["vocab_size"] if manifest["model"].get("builtin") == "gpt2" else 2
    rng = np.random.default_rng(rng_seed)
    batch = {}
    for i in model.graph.input:
        if i.name not in manifest["inputs"] and i.name != manifest["labels"]:
            continue
        dims = [d.dim_value if d.dim_value > 0 else 4 for d in i.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        batch[i.name] = rng.integers(0, vocab, dims).astype(dtype) if np.issubdtype(dtype, np.integer) \
            else rng.standard_normal(dims).astype(dtype)
    return batch


def export_checkpoint(checkpoint: str, output: str, *, opset: int | None = None, with_loss: bool = False,
                      verify: bool = True, echo=print) -> float:
    """Write the inference model; return the max |logits difference| against the eval graph."""
    import onnxruntime as ort

    ckpt = K.resolve_checkpoint(checkpoint)
    run_dir = K.run_dir_of(ckpt)
    graphs_dir = os.path.join(run_dir, "graphs")
    manifest = G.load_manifest(graphs_dir)
    K.verify(ckpt)
    layout = FlatLayout.from_manifest(manifest)
    flat = np.empty(layout.total, np.float32)
    K.load_tensors_into(os.path.join(ckpt, "model.safetensors"), layout.names, layout.shapes, flat)
    weights = layout.unflatten(flat)
    states = FlatLayout.from_manifest({"params": manifest.get("states", [])})
    if states.names:          # the model's non-parameter state (BatchNorm running stats), after the parameters
        held = np.empty(states.total, np.float32)
        K.load_tensors_into(os.path.join(ckpt, "model.safetensors"), states.names, states.shapes, held)
        weights.update(states.unflatten(held))

    base = "eval.onnx" if with_loss else "forward.onnx"
    model = with_weights(onnx.load(os.path.join(graphs_dir, base)), weights)
    if opset is not None:
        current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        if opset != current:
            from onnx import version_converter
            try:
                model = version_converter.convert_version(model, opset)
            except Exception as exc:  # noqa: BLE001
                raise UsageError(f"--opset {opset}: cannot convert the model from opset {current}: {exc}") from None
    model.ir_version = min(model.ir_version, G.IR_VERSION)
    os.makedirs(os.path.dirname(os.path.abspath(output)) or ".", exist_ok=True)
    save_model(model, output)
    if not verify:
        return 0.0

    batch = sample_batch(graphs_dir, manifest)          # data inputs and labels
    so = ort.SessionOptions()
    so.log_severity_level = 3
    exported = ort.InferenceSession(output, so, providers=["CPUExecutionProvider"])
    # the logits, or for a graph with its own loss that loss (the eval graph's ``loss``)
    logits_name = manifest["logits"] or manifest.get("loss_output") or G.LOSS
    ref_name = manifest["logits"] or G.LOSS
    if with_loss:
        logits_name = ref_name
    ours = exported.run([logits_name], {n: v for n, v in batch.items() if with_loss or n != manifest["labels"]})[0]
    ref_sess = ort.InferenceSession(os.path.join(graphs_dir, "eval.onnx"), so, providers=["CPUExecutionProvider"])
    ref = ref_sess.run([ref_name], {**batch, **weights})[0]
    diff = float(np.abs(ours - ref).max())
    echo(f"exported {output} from {ckpt}: max |logits - eval graph| = {diff:.3g} on a "
         f"{'x'.join(map(str, batch[manifest['inputs'][0]].shape))} sample")
    if not diff <= 1e-4:
        raise TrainrunError(f"{output}: the exported model differs from the eval graph by {diff}")
    return diff
