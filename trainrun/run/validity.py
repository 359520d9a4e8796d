"""Whether a configuration can run: the one owner of every check across keys, of keys against the files
they name, and of what a launch cannot do.

:mod:`trainrun.config` checks one key at a time (its type, range, choices). Everything else is decided
here, in three stages, each listing every problem it finds as one :class:`~trainrun.errors.UsageError`
(exit 2), each problem naming its key(s):

* :func:`load_config` (:func:`config_problems`): the keys against each other (model, loss, task against
  its family, optimizer, distributed, the eval metrics watched, ...), ``model.init_from``'s config.json
  against ``model.<builtin>``, and that the paths they name exist;
* :func:`check`: the files the keys name, before any graph is built: ``run.output_dir`` not a file (nor
  under one); ``data.train`` / ``data.eval`` (each
  named set ``data.eval.<NAME>``; :mod:`trainrun.data`) readable, token ids below the model's vocabulary,
  sequences within its positions, at least one batch each (a training step's global batch, an
  evaluation's batch), the same features, model.task / model.num_labels as the train set's manifest says;
  ``model.init_from``'s tensors' names and shapes (:mod:`trainrun.hf.pretrained`, the .safetensors header
  alone) and its tokenizer (a run's, a transformers folder's) against data.train's
  (:func:`trainrun.hf.tokenizer.mismatch`); ``optimizer.groups`` against the trainable parameters; ``model.onnx`` against the loss keys
  (:mod:`trainrun.graphs.forward`); ``data.inputs`` against the model's inputs; the metrics ``train.early_stopping.metric`` and
  ``checkpoint.best_metric`` watch against those the evaluations will log (:func:`eval_metrics`, from the
  model, its task and the data); the parameters, gradients and optimizer moments (float32) of one rank
  against the machine's physical memory (``models.*.param_specs``, nothing allocated);
* :func:`inactive` (at start-up, rank 0 prints it): what the launch's topology (ranks, nodes, MPI's
  threading) turns off, and why.

``trainrun config validate``, ``prepare``, training and ``resume`` call the first two.
"""

from __future__ import annotations

import fnmatch
import math
import os
from typing import NamedTuple

from .. import config as C
from .. import data as D
from ..step import feeding
from ..hf import pretrained
from ..hf import tokenizer
from ..checkpoint import is_step_dir
from ..step.cuda import cuda_provider_problem
from ..errors import UsageError
from ..graphs import forward as F
from ..graphs import lora
from ..graphs.losses import head_metrics
from ..graphs.names import METRIC_PREFIX, metric_names
from ..models import registry


def load_config(path: str | None, overrides=(), *, need_data: bool = False) -> C.Config:
    """:func:`trainrun.config.load_config` with :func:`config_problems`: every problem of one key and
    across keys at once (``need_data``: the config is to train, so data.train is required)."""
    return C.load_config(path, list(overrides), need_data=need_data, checks=config_problems)


# --------------------------------------------------------------------------- the keys against each other

def config_problems(cfg: C.Config, base_dir: str = ".", need_data: bool = False) -> list[str]:
    """Every problem (``"key: message"``) of the keys against each other and of the paths they name."""
    problems: list[str] = []

    def add(key: str, message: str) -> None:
        problems.append(f"{key}: {message}")

    m, t, o = cfg.model, cfg.train, cfg.optimizer
    families = ", ".join(C.FAMILIES)
    if m.builtin is None and m.onnx is None:
        add("model", f"set either model.builtin ({families}) or model.onnx (a forward graph)")
    if m.builtin is not None and m.onnx is not None:
        add("model", "model.builtin and model.onnx are exclusive; set model.builtin: null to train model.onnx")
    section = m.family_section() if m.builtin in C.FAMILIES else None
    if section is not None:
        for key, problem in section.problems():
            add(f"model.{m.builtin}.{key}", problem)
        if cfg.data.seq_len > C.positions(section):
            add("data.seq_len", f"{cfg.data.seq_len} is longer than the model's positions "
                f"(model.{m.builtin}.{section.POSITIONS} = {C.positions(section)})")
    if found := C.init_from_config_json(m, base_dir):     # a transformers folder's shape against model.<builtin>
        file, source = found
        if not isinstance(source, dict):
            add("model.init_from", f"{file}: not a JSON object ({source})")
        else:
            for key, problem in getattr(section, "config_json_problems", lambda _: [])(source):
                add("model.init_from", f"{file}: {key} {problem}")
            for key, value in C.config_json_values(section, source).items():
                if key in section.CONFIG_JSON_SHAPE and getattr(section, key) != value:
                    add(f"model.{m.builtin}.{key}", f"{getattr(section, key)!r}, but model.init_from's {file} says "
                        f"{value!r} (leave model.{m.builtin} out to take it from there)")
    family = _task_family(cfg, add)
    loss = m.loss
    if loss.output is not None and m.builtin is not None:
        add("model.loss.output", f"the built-in {m.builtin} has no loss output; only for model.onnx")
    if m.builtin is not None and (loss.type != "cross_entropy" or loss.class_axis != -1):
        add("model.loss.type", f"the built-in {m.builtin} trains with cross_entropy over its last axis")
    if loss.label_smoothing >= 1.0:
        add("model.loss.label_smoothing", f"must be < 1, got {loss.label_smoothing}")
    elif loss.label_smoothing and (loss.type != "cross_entropy" or loss.output is not None):
        add("model.loss.label_smoothing", "smooths the cross_entropy trainrun builds from the logits "
            "(not mse/l1 nor a model.loss.output)")
    elif loss.label_smoothing and family is not None and family.loss is not None:
        add("model.loss.label_smoothing", f"smooths the cross_entropy trainrun builds from the logits, not the "
            f"built-in {family.name}'s own loss ({family.loss})")
    elif loss.label_smoothing and family is not None and family.loss_type != "cross_entropy":
        add("model.loss.label_smoothing", f"smooths a cross_entropy, but model.num_labels {m.num_labels} makes "
            f"model.task {m.task} a regression, trained with {family.loss_type}")
    if loss.label_smoothing and t.precision != "fp32":
        add("model.loss.label_smoothing", f"runs with train.precision fp32 only (the smoothed loss's sums over "
            f"the classes are not kept in float32 under {t.precision})")
    if loss.weights and loss.type != "cross_entropy":
        add("model.loss.weights", f"class weights need type cross_entropy, not {loss.type}")
    elif loss.weights and m.builtin is not None:
        add("model.loss.weights", f"class weights apply to a model.onnx's cross_entropy; the built-in "
            f"{m.builtin} does not take them")
    if m.init_from and m.builtin is None:
        add("model.init_from", f"starts a built-in model ({families}); a model.onnx holds its own weights")
    if len(o.betas) != 2:
        add("optimizer.betas", f"expected two values [beta1, beta2], got {o.betas}")
    else:
        for i, b in enumerate(o.betas):
            if b is not None and not 0.0 <= b < 1.0:
                add(f"optimizer.betas[{i}]", f"must be in [0, 1), got {b}")
    if o.ratio_min > o.ratio_max:
        add("optimizer.ratio_min", f"{o.ratio_min} exceeds optimizer.ratio_max ({o.ratio_max})")
    for i, g in enumerate(o.groups):
        if not g.params:
            add(f"optimizer.groups[{i}].params", "a parameter name pattern is required")
    if o.layer_decay != 1.0 and m.builtin is None:
        add("optimizer.layer_decay", f"reads each parameter's layer from a built-in model's names "
            f"(model.builtin {' or '.join(C.FAMILIES)}); for model.onnx use optimizer.groups")
    elif o.layer_decay != 1.0 and family is not None and family.layers_above is None:
        add("optimizer.layer_decay", f"the built-in {family.name} does not say the layer of its parameters; "
            f"use optimizer.groups")
    if o.nesterov and o.momentum == 0:
        add("optimizer.nesterov", "needs optimizer.momentum > 0")
    if cfg.lr_schedule.min_lr > o.lr:
        add("lr_schedule.min_lr", f"{cfg.lr_schedule.min_lr} exceeds optimizer.lr ({o.lr})")
    if t.sample_every and (family is None or family.kv_cache is None):
        add("train.sample_every", f"samples need model.builtin {' or '.join(registry.generating())}")
    elif t.sample_every and m.lora is not None:
        add("train.sample_every", "samples the full model's weights; with model.lora, sample from an export "
            "(trainrun generate RUN_DIR)")
    if m.lora is not None and m.builtin is None:
        add("model.lora", f"adapts a built-in model ({families}); for a model.onnx use model.frozen")
    _distributed(cfg, add)
    if t.max_steps and cfg.profile.start_step > t.max_steps:
        add("profile.start_step", f"{cfg.profile.start_step} is after the last step (train.max_steps = "
            f"{t.max_steps})")
    try:
        t.max_time_s()
    except ValueError as exc:
        add("train.max_time", str(exc))
    _eval_keys(cfg, add)
    if cfg.device == "cuda" and (problem := cuda_provider_problem()):
        add("device", problem)
    if cfg.device == "cuda" and cfg.engine.optimizer_kernel == "host":
        add("engine.optimizer_kernel", "host runs on the CPU; with device: cuda use graph or auto")
    if need_data and t.early_stopping.patience and not cfg.data.eval:
        add("train.early_stopping.patience", "stops on an eval metric: needs data.eval")
    elif t.early_stopping.patience and not t.eval_every:      # keep_best's evaluations do not count
        add("train.early_stopping.patience", "stops on evaluations during training, but train.eval_every is 0 "
            "(an evaluation at the end only); set train.eval_every")
    if need_data and cfg.checkpoint.keep_best and not cfg.data.eval:
        add("checkpoint.keep_best", "ranks checkpoints by an eval metric: needs data.eval")
    if cfg.device == "cpu" and t.precision != "fp32":
        add("train.precision", f"{t.precision} needs device: cuda; onnxruntime-training 1.19.2's CPU provider "
            f"cannot run a {t.precision} train graph ("
            + ("no float16 SliceGrad kernel" if t.precision == "fp16" else "no bfloat16 kernels, not even Add")
            + "); with device: cpu use fp32")
    if need_data and not cfg.data.train:
        add("data.train", "is required to train (a directory made by trainrun-data)")
    for path, value, kind in C.path_fields(cfg):      # files and directories that must exist
        if value is None or (path.startswith("data.") and not need_data):
            continue
        full = C.resolve_path(value, base_dir)
        if kind == "file" and not os.path.isfile(full):
            add(path, f"file not found: {full}")
        elif kind == "dir" and not os.path.isdir(full):
            add(path, f"directory not found: {full}")
        elif kind == "any" and not os.path.exists(full) and not is_step_dir(full):   # a run's checkpoint, pruned:
            add(path, f"not found: {full}")             # its reader (pretrained.check) names the newest
    return problems


def _task_family(cfg: C.Config, add) -> registry.Family | None:
    """The built-in family with model.task's head (None for model.onnx, or when the task is refused)."""
    m = cfg.model
    if m.builtin is None:
        if m.task is not None:
            add("model.task", f"{m.task!r}: puts a head on a built-in model (model.builtin); model.onnx "
                f"trains its graph as it is")
        return None
    if m.builtin not in registry.names():
        return None
    family = registry.get(m.builtin)
    if m.task is None or (family.tasks and m.task == family.tasks[0]):
        return family
    if m.task not in family.tasks or family.task is None:
        add("model.task", f"{m.task!r} is not a task of model.builtin {family.name} (its tasks: "
            f"{', '.join(family.tasks) or 'none but its own'})")
        return None
    if m.num_labels == 1 and m.task not in family.regression:
        add("model.num_labels", f"1 (a regression) is not built for model.builtin {family.name}'s {m.task}"
            + (f"; only for {', '.join(family.regression)}" if family.regression else "") + "; use 2 or more")
        return None
    return registry.with_task(family, m.task, m.num_labels)


def _distributed(cfg: C.Config, add) -> None:
    d = cfg.distributed
    if d.zero_stage == 1:
        if cfg.device != "cpu" or d.backend == "nccl":
            add("distributed.zero_stage", "1 (sharded optimizer state) runs on the CPU with the mpi backend; use 0 "
                "with device: cuda or backend: nccl")
        if cfg.engine.optimizer_kernel == "graph":
            add("distributed.zero_stage", "1 (sharded optimizer state) needs engine.optimizer_kernel host or auto "
                "(the graph kernel updates the whole flat buffer)")
        if cfg.debug.stats_every:
            add("debug.stats_every", "needs distributed.zero_stage: 0 (with 1 no rank holds the whole reduced "
                "gradient)")
    if cfg.device == "cpu" and d.backend == "nccl":
        add("distributed.backend", "nccl needs device: cuda")
    if d.overlap_grad_reduce:
        if d.zero_stage:
            add("distributed.overlap_grad_reduce", "overlaps the replicated allreduce; distributed.zero_stage 1 "
                "reduce-scatters after the backward pass (use zero_stage 0, or overlap_grad_reduce false)")
        if cfg.device != "cpu" or d.backend == "nccl":
            add("distributed.overlap_grad_reduce", "runs on the CPU over MPI; not with device: cuda or "
                "distributed.backend: nccl")
    if d.elastic:
        for wrong, why in ((d.sync == "diloco" and not d.diloco.group, "distributed.diloco.group: a number of "
                            "ranks with distributed.sync diloco (a replica a node, group 0, is not built yet)"),
                           (d.sync == "diloco" and d.diloco.overlap_steps, "distributed.diloco.overlap_steps: 0 (an "
                            "outer step's exchange is redone over the survivors while it is waited for)"),
                           (d.zero_stage != 0, "distributed.zero_stage: 0 (every survivor holds the whole optimizer "
                            "state; a ZeRO-1 part would die with its rank)"),
                           (cfg.device != "cpu" or d.backend == "nccl", "device: cpu over MPI (Open MPI's ULFM)"),
                           (d.overlap_grad_reduce, "distributed.overlap_grad_reduce: false (the step's reduction is "
                            "redone over the survivors as one allreduce)")):
            if wrong:
                add("distributed.elastic", f"needs {why}")
    elif d.min_replicas > 1:
        add("distributed.min_replicas", "is the quorum of distributed.elastic: true runs; set that too, or leave "
            "min_replicas out")
    if d.sync == "diloco":
        k = d.diloco
        if cfg.device != "cpu" or d.backend == "nccl":
            add("distributed.sync", "diloco runs on the CPU over MPI; not with device: cuda or distributed.backend: "
                "nccl")
        if k.outer.nesterov and not k.outer.momentum:
            add("distributed.diloco.outer.nesterov", "needs distributed.diloco.outer.momentum > 0 (as "
                "torch.optim.SGD)")
        if k.fragments > k.inner_steps:
            add("distributed.diloco.fragments", f"{k.fragments} fragments take their turns within a round of "
                f"distributed.diloco.inner_steps ({k.inner_steps}) steps: at most that many")
        elif k.overlap_steps and k.overlap_steps >= k.inner_steps // k.fragments:
            add("distributed.diloco.overlap_steps", f"{k.overlap_steps} must be less than distributed.diloco."
                f"inner_steps / fragments ({k.inner_steps} / {k.fragments}): an exchange ends before the next "
                f"fragment's starts")
        if k.overlap_steps and k.fragments == 1:
            add("distributed.diloco.overlap_steps", "overlaps the exchange of one fragment with the inner steps "
                "of the others: needs distributed.diloco.fragments > 1")


def _eval_keys(cfg: C.Config, add) -> None:
    """data.eval's set names; the metrics early stopping and keep_best watch name one of its sets (that
    the evaluations log them: :func:`eval_metric_problems`, from the files)."""
    d = cfg.data
    if isinstance(d.eval, dict):
        if not d.eval:
            add("data.eval", "names no eval set (leave it out, or give {NAME: DIR, ...})")
        for name in d.eval:
            if not C.EVAL_NAME.fullmatch(str(name)):
                add(f"data.eval.{name}", "a set name is letters, digits, `_` and `-` (it becomes part of the "
                    "metric names eval_<NAME>_<metric>)")
            elif any(other != name and str(other).startswith(f"{name}_") for other in d.eval):
                add(f"data.eval.{name}", "is the start of another set's name and `_`: their metric names could "
                    "not be told apart")
    for key in ("train.early_stopping.metric", "checkpoint.best_metric"):
        metric = C.get(cfg, key)
        if metric is not None and d.eval and C.eval_set_of(d, metric) is False:
            sets = ", ".join(f"eval_{n}_<metric>" for n in d.eval) if isinstance(d.eval, dict) else "eval_<metric>"
            add(key, f"{metric!r} is not a metric of data.eval's set(s): expected {sets}, e.g. "
                f"{C.eval_key(next(iter(d.eval_sets())), 'loss')}")


# --------------------------------------------------------------------------- the keys against the files

class Checked(NamedTuple):
    """What :func:`check` opened and built on the way."""
    train: object               # data.train's dataset (None when not given, or ``datasets`` False)
    evals: dict                 # data.eval's sets {name: dataset} (the name None for a single data.eval)
    forward: F.Forward | None   # model.onnx's forward graph (None for a built-in model): prepare's, built once


def check(cfg: C.Config, world_size: int = 1, datasets: bool = True) -> Checked:
    """Raise :class:`UsageError` listing every problem of the files the (loaded) config names; return the
    opened datasets, each checked against ``world_size`` ranks' batches, and the user's forward graph the
    check built (:class:`Checked`: :func:`trainrun.graphs.manifest.prepare` takes it rather than build it
    again)."""
    problems: list[str] = output_dir_problems(cfg.run.output_dir)
    family = registry.of(cfg.model)
    specs = param_specs(cfg.model)
    if specs is not None:
        shapes = {name: shape for name, (shape, _) in specs.items()}
        problems += _memory(cfg, shapes, world_size)
        problems += _fragments(cfg.distributed, shapes)
        from ..step.optim import group_problems
        problems += group_problems(cfg.optimizer, [n for n in shapes if not any(
            fnmatch.fnmatchcase(n, p) for p in cfg.model.frozen)])
        if cfg.model.lora is not None:
            problems += lora.problems(cfg.model.lora, family, shapes)
        if cfg.model.init_from:
            problems += [f"model.init_from: {p}" for p in pretrained.check(shapes, cfg.model.init_from, family)]
    fwd = None
    if cfg.model.onnx and datasets:     # the user's graph against the loss keys (prepare checks it itself)
        try:
            fwd = F.forward_from_config(cfg)
        except UsageError as exc:
            problems += [exc.message] if not exc.problems else list(exc.problems)
    found = _datasets(cfg, world_size, problems) if datasets else (None, {})
    if datasets and cfg.model.init_from and cfg.data.train and (why := tokenizer.mismatch(cfg.model.init_from,
                                                                                         cfg.data.train)):
        problems.append(f"model.init_from: {cfg.model.init_from}: not trained on data.train's tokens: {why}")
    if cfg.model.builtin and cfg.model.task and found[0] is not None:
        problems += _task_problems(cfg, found[0])
    if found[0] is not None and (family is not None or fwd is not None):
        inputs, labels = (fwd.inputs, fwd.labels) if fwd else \
            (family.inputs, None if family.loss else cfg.model.loss.labels)
        try:
            feeding.feeds({"inputs": inputs, "labels": labels}, cfg.data.inputs)
        except UsageError as exc:
            problems.append(exc.message)
        problems += eval_metric_problems(cfg, eval_metrics(cfg, found[0], _graph_metrics(cfg, fwd) if fwd else None))
    if problems:
        raise UsageError(f"{len(problems)} problem(s) in the files the configuration names", problems)
    return Checked(*found, fwd)


def output_dir_problems(out: str) -> list[str]:
    """run.output_dir (absolute) against the filesystem: it, or the first of its parents that exists, must be a
    directory (the run directory is made there)."""
    there = out
    while not os.path.exists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there)
    if os.path.exists(there) and not os.path.isdir(there):
        return [f"run.output_dir: {out}: {there} is a file, not a directory (the run directory is made there: "
                f"choose another path)"]
    return []


def _task_problems(cfg: C.Config, train) -> list[str]:
    """model.task / model.num_labels against what the train dataset's manifest says of its labels."""
    m, manifest = cfg.model, getattr(train, "manifest", None) or {}
    where = f"data.train {cfg.data.train}"
    problems = []
    if "task" in manifest and manifest["task"] != m.task and m.task in registry.get(m.builtin).tasks[1:]:
        problems.append(f"model.task: {m.task}, but {where} holds {manifest['task']} samples")
    if "num_labels" in manifest and manifest["num_labels"] != m.num_labels:
        problems.append(f"model.num_labels: {m.num_labels}, but {where} has num_labels {manifest['num_labels']} "
                        f"(its manifest.json)")
    return problems


def param_specs(m: C.ModelConfig) -> dict | None:
    """The built-in model's {parameter: (shape, initialisation)}; None for a model.onnx."""
    family = registry.of(m)
    return family.param_specs(family.shape(m)) if family else None


def _datasets(cfg: C.Config, world_size: int, problems: list[str]):
    d, t = cfg.data, cfg.train
    vocab, positions = registry.vocab_and_positions(cfg.model)
    vocab_key = f"model.{cfg.model.builtin}.vocab_size" if cfg.model.builtin else None
    sets = {("train", None): d.train} if d.train else {}
    sets.update({("eval", name): path for name, path in d.eval_sets().items()})
    opened = {}
    for (part, name), path in sets.items():
        key = f"data.{part}" + (f".{name}" if name is not None else "")
        try:
            ds = D.open_dataset(path, d.seq_len, vocab_size=vocab, n_positions=positions, vocab_key=vocab_key)
            if part == "train":
                D.check_train(ds, t.micro_batch_size, t.gradient_accumulation_steps, world_size)
            else:
                D.check_eval(ds, t.micro_batch_size, world_size)
            opened[part, name] = ds
        except UsageError as exc:
            problems += [f"{key}: {exc.message}", *(f"{key}: {p}" for p in exc.problems)]
    train = opened.pop(("train", None), None)
    evals = {name: ds for (_, name), ds in opened.items()}
    for name, ds in evals.items():
        if train is not None and ds.specs != train.specs:
            key = "data.eval" + (f".{name}" if name is not None else "")
            problems.append(f"{key}: {sets['eval', name]} has features {_features(ds)}, data.train {_features(train)}")
    return train, evals


def _features(ds) -> str:
    return ", ".join(f"{n} {d} {list(s)}" for n, (s, d) in ds.specs.items())


def physical_memory() -> int | None:
    """The machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _fragments(d: C.DistributedConfig, shapes: dict) -> list[str]:
    """distributed.diloco.fragments: whole parameter tensors each, so no more than the model has."""
    if d.sync == "diloco" and d.diloco.fragments > len(shapes):
        return [f"distributed.diloco.fragments: {d.diloco.fragments} fragments of whole tensors, but the model has "
                f"{len(shapes)} parameter tensors"]
    return []


def _memory(cfg: C.Config, shapes: dict, world_size: int) -> list[str]:
    """The float32 parameters, gradients and optimizer moments one rank holds (on cuda: the host copy of
    the parameters that prepare builds) against the machine's memory: a lower bound of what training
    needs, so a config refused here could never run."""
    from ..step.optim import state_names
    n = sum(math.prod(s) for s in shapes.values())
    moments = len(state_names(cfg.optimizer))
    per_param = 1 if cfg.device == "cuda" else 2 + moments / (world_size if cfg.distributed.zero_stage else 1)
    need, ram = 4 * n * per_param, physical_memory()
    if ram is None or need <= ram:
        return []
    family = cfg.model.builtin
    section = getattr(cfg.model, family)
    vocab = sum(math.prod(s) for s in shapes.values() if s[0] == section.vocab_size) / n
    held = "parameters" if cfg.device == "cuda" else \
        f"parameters, gradients and {moments} {cfg.optimizer.name} moment(s)"
    return [f"model.{family}: {n:,} parameters need {need / 2**30:,.1f} GiB for the {held} (float32) on each "
            f"rank, more than this machine's {ram / 2**30:,.1f} GiB of memory; the vocabulary "
            f"(model.{family}.vocab_size {section.vocab_size:,}) holds {vocab:.0%} of them"]


# --------------------------------------------------------------------------- the eval metrics

def logs_perplexity(loss: C.LossConfig, train) -> bool:
    """Whether evaluations report a perplexity: next-token cross-entropy (``loss``: model.loss) over token
    sequences."""
    return train.kind == "tokens" and loss.output is None and loss.type == "cross_entropy"


def _graph_metrics(cfg: C.Config, fwd: F.Forward) -> list[str]:
    """The metrics the eval graph of model.onnx (``fwd``) logs besides the loss: the loss head's (built
    from its logits) and the graph's own."""
    own = metric_names([o.name for o in fwd.model.graph.output if o.name.startswith(METRIC_PREFIX)])
    if fwd.loss:
        return own
    return [*head_metrics(fwd.loss_type, F.num_classes(fwd), cfg.model.loss.label_smoothing), *own]


def eval_metrics(cfg: C.Config, train, graph_metrics: list[str] | None = None,
                 manifest: dict | None = None) -> list[str]:
    """The metrics each evaluation logs (``loss``, ``perplexity``, ``accuracy``, ``f1``, ...) on the train
    set's kind of data: from the prepared graphs' ``manifest`` when given, else from the config (the
    built-in family's loss head and task; a model.onnx's ``graph_metrics``, :func:`_graph_metrics`)."""
    m = cfg.model
    if manifest is not None:
        graph_metrics, labels = manifest["metrics"], manifest.get("task_labels")
    else:
        labels = registry.task_labels(m)
        if graph_metrics is None:
            family = registry.of(m)
            classes = labels or family.shape(m).vocab_size
            graph_metrics = list(family.metrics) if family.loss else \
                head_metrics(family.loss_type, classes, m.loss.label_smoothing)
    task = [] if not labels else ["pearson", "spearman"] if labels == 1 else ["accuracy", "f1"]
    logged = ["loss", *(["perplexity"] if logs_perplexity(m.loss, train) else []), *graph_metrics, *task]
    return list(dict.fromkeys(logged))


def eval_metric_problems(cfg: C.Config, metrics: list[str]) -> list[str]:
    """The problems of train.early_stopping.metric and checkpoint.best_metric when the evaluations log
    ``metrics`` (:func:`eval_metrics`) for each set of data.eval (none without data.eval)."""
    problems = []
    for key in ("train.early_stopping.metric", "checkpoint.best_metric") if cfg.data.eval else ():
        found = C.eval_set_of(cfg.data, C.watched_metric(cfg, key))
        if found and found[1] not in metrics:
            problems.append(f"{key}: {C.watched_metric(cfg, key)!r}: the evaluations log no {found[1]!r} (they "
                            "log " + ", ".join(C.eval_key(found[0], x) for x in metrics) + ")")
    return problems


# --------------------------------------------------------------------------- what a launch turns off

def inactive(d: C.DistributedConfig, world_size: int, shared: tuple[int, int] | None, overlaps: bool,
             buckets: int, replicas: int = 1) -> list[str]:
    """What the config's distributed section ``d`` asks for that this launch cannot do, each with why (known
    at start-up only: the ranks, their nodes, the MPI library). ``world_size``: the ranks the step reduces
    gradients over (the world, or under DiLoCo each of its ``replicas``); ``shared``: (ranks per node, nodes)
    where the ranks of a node share memory (``distributed.intra_node: shared`` in effect), else None;
    ``overlaps``: the step may reduce gradients during the backward pass
    (:func:`trainrun.sync.reducer.applies`); ``buckets``: how many it cuts them into."""
    notes = []
    # DiLoCo's replicas of one rank each: the step reduces nothing; the replicas meet at the outer step only
    alone = (f"one rank per replica ({replicas} DiLoCo replicas of 1 rank: distributed.diloco.group), nothing "
             f"to reduce within a replica; the replicas exchange weights at the outer step "
             f"(distributed.diloco.outer_dtype)" if replicas > 1 else "one rank, no gradients to reduce")
    if d.overlap_grad_reduce and buckets < 2:
        if world_size == 1:
            why = alone
        elif shared is not None:
            why = (f"the {shared[0]} ranks of each node sum their gradients in shared memory (distributed."
                   f"intra_node: shared) once every backward pass has ended; set distributed.intra_node: mpi "
                   f"to overlap the allreduce")
        elif not overlaps:
            why = "this MPI does not let a second thread call it (less than MPI_THREAD_SERIALIZED)"
        else:
            why = f"the gradients fit in one bucket of distributed.bucket_mb {d.bucket_mb:g}"
        notes.append(f"distributed.overlap_grad_reduce is off: {why}")
    if d.reduce_dtype == "bf16" and (world_size == 1 or (shared is not None and shared[1] == 1)):
        why = alone if world_size == 1 else \
            ("every rank is on one node, whose gradients are summed in shared memory (distributed.intra_node: shared)"
             if replicas == 1 else "each replica is one node, whose gradients are summed in shared memory "
             "(distributed.intra_node: shared)")
        notes.append(f"distributed.reduce_dtype: bf16 is off: {why}; no gradient goes over the wire")
    return notes
