"""``prepare``: the graphs, initial weights and manifest written to a run's ``graphs/`` folder; the
manifest read back (:func:`load_manifest`) and compared with a config (:func:`up_to_date`)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper
from safetensors.numpy import save_file

from ..step import cuda_kernels
from ..config import Config, to_dict
from ..errors import UsageError
from ..models import registry
from ..step.optim import build_optimizer_graph, check_groups
from .recompute import recompute_blocks
from ..run.rundir import as_created, sha256_file
from .casts import cast_pass, restore_fp32, scale_loss
from .dropout_nodes import dropout_masks, dropout_off
from .lora import digest as lora_digest
from .fusion import fuse
from .forward import Forward, batchnorm_inference, drop_outputs, forward_from_config, num_classes
from .gradients import add_outputs, build_train_graph, builder, select_outputs
from .losses import SPLIT_MIN_CLASSES, metric_outputs, split_cross_entropy, with_loss
from .names import LOSS, LOSS_SCALE, metric_names
from .onnx_edit import params_to_inputs
from .strides import pad_contractions, wanted

FORMAT_VERSION = 1


# what trainrun's graph surgery produces from the same config; graphs prepared by an older version
# (a manifest with a lower or no ``graph_version``) are prepared again. 2: the cross-entropy split into
# LogSoftmax + NegativeLogLikelihoodLoss, tied embedding gradients added by ScatterElements; 3: weight
# gradients by MatMul over an explicitly transposed input (no Gemm transA); 4: the cross-entropy's gradient
# from Exp(log_prob) (_cross_entropy_grad_by_exp); 5: a tied head's gradient scattered into before its
# Transpose; 6: products over a multiple of 1024 float32 padded (graphs/strides.py, engine.pad_products);
# 7: the frozen weights (model.frozen, model.lora's base) graph inputs, their values in frozen.safetensors;
# 8: a graph of torch's dynamo exporter read as torch trained it (graphs/exporters.py: training-mode
# BatchNorm, buffers frozen, transposed Linear weights under torch's names)
GRAPH_VERSION = 8
FROZEN_FILE = "frozen.safetensors"


def build_options(cfg: Config) -> dict:
    """What besides the model and optimizer shapes the graphs: recorded in the manifest."""
    stats = list(cfg.debug.tensors) if cfg.debug.stats_every > 0 else []
    return {"deterministic": cfg.run.deterministic, "stats_tensors": stats, "precision": cfg.train.precision,
            "static_shape": [cfg.train.micro_batch_size, cfg.data.seq_len] if cfg.engine.static_shapes else None,
            "recompute": cfg.train.recompute,
            "pad_products": wanted(cfg.engine.pad_products, cfg.device) and bool(cfg.engine.static_shapes),
            "fuse": bool(cfg.graphs.fuse) and builder(cfg.graphs.builder)[0] == "trainrun"}


# manifests written before a build option existed
DEFAULT_BUILD = {"deterministic": False, "stats_tensors": [], "static_shape": None, "precision": "fp32",
                 "recompute": "none", "pad_products": False, "fuse": False}


def fix_dims(model: onnx.ModelProto, inputs: list[str], micro_batch: int, seq_len: int | None,
             sequences=True) -> onnx.ModelProto:
    """Fix, in place, the symbolic dims of ``model``'s data ``inputs``: dim 0 (the batch) to
    ``micro_batch``, dim 1 to ``seq_len`` when given, of every input (``sequences`` True) or of those
    named in ``sequences``; dims of the same names elsewhere (labels, outputs) too. Returns ``model``."""
    sizes: dict[str, int] = {}
    for vi in model.graph.input:
        if vi.name in inputs:
            dims = vi.type.tensor_type.shape.dim
            along = seq_len if sequences is True or vi.name in (sequences or ()) else None
            for i, size in ((0, micro_batch), (1, along)):
                if size is not None and len(dims) > i and dims[i].dim_param:
                    sizes.setdefault(dims[i].dim_param, size)
    for vi in list(model.graph.input) + list(model.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in sizes:
                d.dim_value = sizes[d.dim_param]     # (clears dim_param: a oneof)
    return model


def _save(model: onnx.ModelProto, path: str) -> None:
    tmp = path + ".tmp"
    onnx.save(model, tmp)
    os.replace(tmp, path)


def loss_graph(cfg: Config, fwd, build: dict) -> tuple[onnx.ModelProto, dict | None]:
    """The graph the train graph's gradients are taken of: the forward (``fwd``, from
    :func:`forward_from_config`) with its loss, parameters and state as inputs, the state's updates as
    outputs, dropout masks as inputs, the precision's casts and loss scale, the micro-batch's dims fixed
    under ``build``'s static_shape (eval and forward stay symbolic). Returns (the graph, the dropout masks'
    spec)."""
    source = cfg.model.onnx or cfg.model.builtin
    inits = {t.name: t for t in fwd.model.graph.initializer}
    states = dict(fwd.states or {})
    loss_model = params_to_inputs(with_loss(fwd, cfg.model.loss.ignore_index, keep_logits=False,
                                            label_smoothing=cfg.model.loss.label_smoothing),
                                  fwd.params + list(states) + fwd.frozen)
    loss_model.graph.output.extend(helper.make_tensor_value_info(out, inits[st].data_type, list(inits[st].dims))
                                   for st, out in states.items())     # the state's updates
    loss_model, dropout = dropout_masks(loss_model, fwd.inputs, source)
    loss_model = scale_loss(cast_pass(loss_model, build["precision"]), build["precision"])
    static = build["static_shape"]
    if static:
        family = registry.of(cfg.model)
        fix_dims(loss_model, fwd.inputs, static[0], static[1], family.sequence_inputs if family else False)
    return loss_model, dropout


def prepare(cfg: Config, out_dir: str | None = None, fwd: Forward | None = None) -> str:
    """Write the three graphs, the forward graph, the initial weights and the manifest. ``fwd``: the forward
    graph of :func:`forward_from_config` (``cfg``) where already built (:func:`trainrun.run.validity.check`'s),
    used up here; else it is built here."""
    made_by, _ = builder(cfg.graphs.builder)       # a builder not installed: nothing written
    out_dir = out_dir or os.path.join(cfg.run.output_dir, "graphs")
    fwd = fwd if fwd is not None else forward_from_config(cfg)
    check_groups(cfg.optimizer, fwd.params)
    os.makedirs(out_dir, exist_ok=True)     # after the model's own checks: a refused model writes nothing
    source = cfg.model.onnx or cfg.model.builtin
    inits = {t.name: t for t in fwd.model.graph.initializer}
    states = dict(fwd.states or {})
    fwd.frozen = [n for n in fwd.frozen if n in inits]
    weights = {p: numpy_helper.to_array(inits[p]) for p in fwd.params + list(states)}
    shapes = [(p, tuple(int(d) for d in inits[p].dims)) for p in fwd.params]
    # parameters, then state, then the frozen weights: inputs of every graph (the frozen ones bound to one
    # buffer filled from frozen.safetensors, as the parameters are: never constants of a session)
    graph_inputs = fwd.params + list(states) + fwd.frozen

    build = build_options(cfg)
    loss_model, dropout = loss_graph(cfg, fwd, build)
    classes = num_classes(fwd) if fwd.loss is None and fwd.loss_type == "cross_entropy" else None
    # the built-in models' losses are over vocabularies; a user model's when its classes are that many
    split = split_cross_entropy if cfg.model.builtin or (classes or 0) >= SPLIT_MIN_CLASSES else (lambda m: m)
    train = split(restore_fp32(build_train_graph(loss_model, fwd.params, source, keep=list(states.values()),
                                                 builder=made_by), build["precision"]))
    if build["fuse"]:       # debug.tensors' tensors keep their names
        train = fuse(train, select_outputs(train, cfg.debug.tensors) if build["stats_tensors"] else ())
    if build["recompute"] == "blocks":
        train = recompute_blocks(train, fwd.params, LOSS, source, outputs_kept=list(states.values()))
    if build["pad_products"]:
        pad_contractions(train)
    stats_outputs = []
    if build["stats_tensors"]:      # debug.stats_every > 0: chosen tensors become outputs
        stats_outputs = select_outputs(train, cfg.debug.tensors)
        add_outputs(train, stats_outputs)
    evalg = split(batchnorm_inference(dropout_off(params_to_inputs(
        with_loss(fwd, cfg.model.loss.ignore_index, keep_logits=True, metrics=True,
                  label_smoothing=cfg.model.loss.label_smoothing), graph_inputs), source)))
    forward = batchnorm_inference(dropout_off(params_to_inputs(fwd.model, graph_inputs), source))
    drop_outputs(forward, set(states.values()))
    optimizer = build_optimizer_graph(cfg.optimizer, shapes, registry.layer_depths(cfg.model, fwd.params))
    if cfg.device == "cuda":
        cuda_kernels.check({"train": train, "eval": evalg}, source)

    files = {"train": train, "eval": evalg, "forward": forward, "optimizer": optimizer}
    for name, model in files.items():
        _save(model, os.path.join(out_dir, f"{name}.onnx"))
    tensors = {"weights.safetensors": weights}
    frozen = {n: numpy_helper.to_array(inits[n]) for n in fwd.frozen}
    if frozen:
        tensors[FROZEN_FILE] = frozen
    for name, values in tensors.items():
        tmp = os.path.join(out_dir, name + ".tmp")
        save_file(values, tmp)
        os.replace(as_created(tmp), os.path.join(out_dir, name))

    import onnxruntime
    manifest = {
        "format_version": FORMAT_VERSION,
        "graph_version": GRAPH_VERSION,
        # who wrote the train graph's gradients (graphs.builder): onnxruntime = accumulators in the graph,
        # trainrun = the gradients as outputs (graphs.gradients.direct_gradients' form)
        "builder": made_by,
        "params": [{"name": n, "shape": list(s)} for n, s in shapes],
        "num_params": int(sum(int(np.prod(s)) for _, s in shapes)),
        "inputs": fwd.inputs,
        "labels": fwd.labels,
        "logits": fwd.logits,
        "loss": LOSS,
        "loss_output": fwd.loss,
        # cross_entropy: labels must be below C (or ignore_index), checked per batch by the engine
        "classes": classes,
        "ignore_index": cfg.model.loss.ignore_index,
        # a task head's labels: the eval logits go to observe.task_metrics (accuracy, F1 / Pearson, Spearman)
        "task_labels": registry.task_labels(cfg.model),
        "states": [{"name": n, "shape": [int(d) for d in inits[n].dims], "output": o} for n, o in states.items()],
        "metrics": metric_names(metric_outputs(evalg)),
        "model": to_dict(cfg.model),
        # model.lora: the frozen base weights (their sha256 checked on resume), the adapted modules whose
        # weight is stored [in, out] (export merges the adapters into them)
        "lora": {**fwd.lora, "base_sha256": lora_digest({n: frozen[n] for n in fwd.lora["base"]})}
        if fwd.lora else None,
        # the frozen weights: graph inputs, their values in frozen.safetensors (the engine's frozen buffer)
        "frozen": [{"name": n, "shape": list(frozen[n].shape), "why": fwd.why.get(n, "model.frozen")}
                   for n in fwd.frozen],
        "optimizer": to_dict(cfg.optimizer),
        "build": build,
        "stats_outputs": stats_outputs,
        "dropout": dropout,
        "loss_scale": LOSS_SCALE if build["precision"] == "fp16" else None,
        "files": {f"{n}.onnx": sha256_file(os.path.join(out_dir, f"{n}.onnx")) for n in files}
                 | {f: sha256_file(os.path.join(out_dir, f)) for f in tensors},
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
    }
    tmp = os.path.join(out_dir, "manifest.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(tmp, os.path.join(out_dir, "manifest.json"))
    return out_dir


def load_manifest(graphs_dir: str) -> dict:
    path = os.path.join(graphs_dir, "manifest.json")
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise UsageError(f"{path}: not found (run `trainrun prepare` first)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path}: format_version {manifest.get('format_version')} "
                         f"(this trainrun reads {FORMAT_VERSION})")
    return manifest


# optimizer fields that are inputs of the optimizer graph (or the runner's), not baked into it
_NOT_BAKED = ("lr", "max_grad_norm")


def up_to_date(graphs_dir: str, cfg: Config) -> bool:
    """Whether ``graphs_dir`` holds the graphs ``cfg`` would prepare (same graph version, gradient builder
    and model, baked optimizer fields and build options, every file present). UsageError when
    ``graphs.builder`` names a builder that is not installed."""
    try:
        manifest = load_manifest(graphs_dir)
    except UsageError:
        return False

    def baked(d):
        return {k: v for k, v in d.items() if k not in _NOT_BAKED}
    # "dropout" (masks as inputs) is in every manifest since dropout became trainrun's own stream; graphs
    # from before it ran Dropout in onnxruntime (ratio 0 under run.deterministic): prepare them again
    return "dropout" in manifest and manifest.get("graph_version") == GRAPH_VERSION \
        and manifest.get("builder", "onnxruntime") == builder(cfg.graphs.builder)[0] \
        and manifest["model"] == to_dict(cfg.model) \
        and baked(manifest["optimizer"]) == baked(to_dict(cfg.optimizer)) \
        and {**DEFAULT_BUILD, **manifest.get("build", {})} == build_options(cfg) \
        and all(os.path.exists(os.path.join(graphs_dir, f)) for f in manifest["files"])
