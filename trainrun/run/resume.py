"""The resume policy: which saved run ``trainrun resume`` continues, and with what config.

A resume continues the *same* run: the config saved with the checkpoint, plus
``--set`` overrides of keys that do not change the model, the optimizer's
rule or the data (:data:`SAFE_ON_RESUME`; others need ``--force``). The global
batch must stay the same (the data order and the LR schedule count in it), on
any number of ranks: choose micro-batch and accumulation to keep it. A
``train.stop_at`` the saving session reached is cleared, so the run goes on.

``--set run.output_dir=NEW`` (another directory than the run's) branches: the run resumed from is only
read, and NEW becomes a run of its own that starts at the checkpoint (:func:`branch`, by rank 0 at
start-up): refused where NEW is inside the run (or holds it) or already holds checkpoints.
"""

from __future__ import annotations

import os
import shutil

from .. import checkpoint as K
from .. import config as C
from . import rundir
from . import validity
from ..comm import detect_world
from ..errors import UsageError
from ..graphs.manifest import up_to_date

# keys `resume --set` may change without --force (prefix match)
SAFE_ON_RESUME = ("train.max_steps", "train.max_epochs", "train.max_time", "train.stop_at", "train.eval_every", "train.eval_steps", "train.log_every",
                  "train.micro_batch_size", "train.gradient_accumulation_steps", "train.early_stopping", "checkpoint.",
                  "train.recompute",
                  "optimizer.lr", "optimizer.max_grad_norm", "lr_schedule.", "run.log_level", "engine.",
                  "tensorboard.", "data.prefetch", "data.eval", "distributed.timeout_s", "distributed.backend",
                  "distributed.zero_stage", "distributed.intra_node", "distributed.overlap_grad_reduce",
                  "distributed.bucket_mb", "distributed.reduce_dtype", "distributed.elastic", "distributed.min_replicas",
                  "profile.", "debug.", "graphs.")


def resume_config(path: str, overrides: list[str], force: bool = False) -> tuple[C.Config, str]:
    """(config, checkpoint directory) to continue the run holding ``path`` (a run directory,
    its latest complete checkpoint, or one checkpoint)."""
    ckpt = rundir.resolve_checkpoint(path)
    run_dir = rundir.run_dir_of(ckpt)
    saved_path = os.path.join(ckpt, "config.yaml")
    saved = C.load_config(saved_path)
    cfg = validity.load_config(saved_path, overrides, need_data=True)
    asked = cfg.run.output_dir != saved.run.output_dir or any(o.split("=", 1)[0].strip() == "run.output_dir"
                                                              for o in overrides)
    if asked and not _same_dir(cfg.run.output_dir, run_dir):       # a branch into another run directory
        check_branch(run_dir, cfg.run.output_dir)
        saved.run.output_dir = cfg.run.output_dir
    else:
        saved.run.output_dir = cfg.run.output_dir = run_dir   # the run may have been moved
    state = K.read_state(ckpt)
    if not any(o.split("=", 1)[0].strip() == "train.stop_at" for o in overrides) \
            and cfg.train.stop_at and cfg.train.stop_at <= state["step"]:
        saved.train.stop_at = cfg.train.stop_at = 0     # that stop was the saving session's; run on
    changed = C.changed_keys(C.to_dict(saved), C.to_dict(cfg))
    unsafe = [k for k in changed if not k.startswith(SAFE_ON_RESUME)]
    if unsafe and not force:
        raise UsageError("resume: these keys change the model, optimizer or data and would not continue the "
                         "same run (add --force to do it anyway)", [f"{k}: {C.get(saved, k)!r} -> "
                                                                   f"{C.get(cfg, k)!r}" for k in unsafe])
    _, world = detect_world()
    if cfg.global_batch(world) != state["global_batch"] and not force:
        raise UsageError(
            f"resume: the global batch would change from {state['global_batch']} "
            f"(saved by {state['world_size']} rank(s)) to {cfg.global_batch(world)} "
            f"({cfg.train.micro_batch_size} x {cfg.train.gradient_accumulation_steps} accum x {world} ranks); "
            f"keep it with --set train.micro_batch_size=... / train.gradient_accumulation_steps=... "
            f"(or --force)")
    return cfg, ckpt


# --------------------------------------------------------------------------- a branch into another run directory

def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _inside(a: str, b: str) -> bool:
    """Whether path ``a`` is ``b`` or under it."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def check_branch(run_dir: str, out: str) -> None:
    """A resume of ``run_dir`` into ``out``, another run directory: a UsageError where ``out`` is inside
    ``run_dir`` (or holds it) or already holds checkpoints (a run of its own, never written over)."""
    if _inside(out, run_dir):
        raise UsageError(f"run.output_dir {out} is inside {run_dir}, the run resumed from, which a resume into "
                         f"another run directory leaves as it is; choose a run.output_dir outside it")
    if _inside(run_dir, out):
        raise UsageError(f"run.output_dir {out} holds {run_dir}, the run resumed from, which a resume into "
                         f"another run directory leaves as it is; choose a run.output_dir outside it")
    done = rundir.complete_checkpoints(rundir.checkpoints_dir(out))
    if done:
        raise UsageError(f"run.output_dir {out} already holds checkpoints; a resume into another run directory "
                         f"starts a new run there: continue that one with `trainrun resume {out}`, or choose "
                         f"another run.output_dir")


def branch_of(ckpt: str, out: str) -> str | None:
    """Where resuming from ``ckpt`` into run directory ``out`` branches (``out`` is not ``ckpt``'s run
    directory): ``out``'s copy of the checkpoint, which the run restores from; None where it continues the
    checkpoint's own run."""
    if _same_dir(rundir.run_dir_of(ckpt), out):
        return None
    return os.path.join(rundir.checkpoints_dir(out), str(K.read_state(ckpt)["step"]))


def branch(ckpt: str, out: str, cfg: C.Config, log, retry=None) -> str:
    """rank 0, holding ``out``'s lock, config.yaml written: ``out`` made a run directory that starts at
    checkpoint ``ckpt`` of another run, which is only read. Copied into ``out``: the run's graphs (where they
    are those ``cfg`` needs and ``out`` lacks them: else the run prepares its own), its metrics.jsonl and
    TensorBoard events (the runner then cuts them back to the checkpoint's step), and, last, the checkpoint
    itself, its files checked against their checksums as they are copied (``retry``: the command resuming
    from another checkpoint, named where one is corrupt) and committed by one rename. Returns the copy."""
    check_branch(rundir.run_dir_of(ckpt), out)        # again, under the lock
    src = rundir.run_dir_of(ckpt)
    target = branch_of(ckpt, out)
    graphs = rundir.graphs_dir(out)
    if not up_to_date(graphs, cfg) and up_to_date(rundir.graphs_dir(src), cfg):
        _copy_tree(rundir.graphs_dir(src), graphs)
    if os.path.isfile(os.path.join(src, "metrics.jsonl")):
        shutil.copyfile(os.path.join(src, "metrics.jsonl"), os.path.join(out, "metrics.jsonl.tmp"))
        os.replace(os.path.join(out, "metrics.jsonl.tmp"), os.path.join(out, "metrics.jsonl"))
    if os.path.isdir(os.path.join(src, "tensorboard")):
        os.makedirs(os.path.join(out, "tensorboard"), exist_ok=True)
        for name in sorted(os.listdir(os.path.join(src, "tensorboard"))):
            if os.path.isfile(os.path.join(src, "tensorboard", name)):
                shutil.copy2(os.path.join(src, "tensorboard", name), os.path.join(out, "tensorboard", name))
    K.copy_checkpoint(ckpt, target, retry=retry)
    log(f"branched {ckpt} into {out} (a run of its own from step {os.path.basename(target)}; {src} is only read)")
    return target


def _copy_tree(src: str, dest: str) -> None:
    """``src`` copied to ``dest`` (replaced) through a staging folder renamed into place."""
    staging = dest + ".branching"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(staging, dest)
