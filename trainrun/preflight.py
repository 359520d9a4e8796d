"""What the files a config names tell before any graph is built.

``trainrun config validate``, ``trainrun prepare`` and training's start-up call :func:`check`, which
gathers the checks of the modules that own those files into one :class:`~trainrun.errors.UsageError`
(exit 2) listing every problem, each naming its key and file:

* ``data.train`` / ``data.eval`` (each named set ``data.eval.<NAME>``) (:mod:`trainrun.data`):
  readable, token ids below the model's vocabulary, sequences within its positions, at least one batch
  each (a training step's global batch, an evaluation's batch), the same features;
* ``model.init_from`` (:mod:`trainrun.pretrained`): its tensors' names and shapes against the model's,
  from the .safetensors header alone;
* ``optimizer.groups`` (built-in models): each pattern matches a trainable parameter;
* memory: the parameters, their gradients and the optimizer's moments (float32) of one rank against
  the machine's physical memory, from the model's shapes (``models.*.param_specs``), nothing allocated.
"""

from __future__ import annotations

import fnmatch
import math
import os

from . import config as C
from . import data as D
from . import pretrained
from .errors import UsageError
from .models import registry


def check(cfg: C.Config, world_size: int = 1, datasets: bool = True):
    """Raise :class:`UsageError` listing every problem; return the opened train dataset (None when not
    given, or ``datasets`` False) and the eval sets {name: dataset} (the name None for a single
    data.eval), each checked against ``world_size`` ranks' batches."""
    problems: list[str] = []
    family = registry.of(cfg.model)
    if cfg.train.sample_every and (family is None or family.kv_cache is None):
        problems.append(f"train.sample_every: samples need model.builtin {' or '.join(registry.generating())}")
    if family is not None and family.loss is not None and cfg.model.loss.label_smoothing:
        problems.append(f"model.loss.label_smoothing: smooths the cross_entropy trainrun builds from the logits, "
                        f"not the built-in {family.name}'s own loss ({family.loss})")
    if family is not None and family.layers_above is None and cfg.optimizer.layer_decay != 1.0:
        problems.append(f"optimizer.layer_decay: the built-in {family.name} does not say the layer of its "
                        f"parameters; use optimizer.groups")
    specs = param_specs(cfg.model)
    if specs is not None:
        shapes = {name: shape for name, (shape, _) in specs.items()}
        problems += _memory(cfg, shapes, world_size)
        from .optim import group_problems
        problems += group_problems(cfg.optimizer, [n for n in shapes if not any(
            fnmatch.fnmatchcase(n, p) for p in cfg.model.frozen)])
        if cfg.model.init_from:
            problems += [f"model.init_from: {p}" for p in pretrained.check(shapes, cfg.model.init_from, family)]
    found = _datasets(cfg, world_size, problems) if datasets else (None, {})
    if cfg.model.builtin and cfg.model.task and found[0] is not None:
        problems += _task_problems(cfg, found[0])
    if problems:
        raise UsageError(f"{len(problems)} problem(s) in the files the configuration names", problems)
    return found


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
    sets = {("train", None): d.train} if d.train else {}
    sets.update({("eval", name): path for name, path in d.eval_sets().items()})
    opened = {}
    for (part, name), path in sets.items():
        key = f"data.{part}" + (f".{name}" if name is not None else "")
        try:
            ds = D.open_dataset(path, d.seq_len, vocab_size=vocab, n_positions=positions)
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


def _memory(cfg: C.Config, shapes: dict, world_size: int) -> list[str]:
    """The float32 parameters, gradients and optimizer moments one rank holds (on cuda: the host copy of
    the parameters that prepare builds) against the machine's memory: a lower bound of what training
    needs, so a config refused here could never run."""
    from .optim import state_names
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
