"""The resume policy: which saved run ``trainrun resume`` continues, and with what config.

A resume continues the *same* run: the config saved with the checkpoint, plus
``--set`` overrides of keys that do not change the model, the optimizer's
rule or the data (:data:`SAFE_ON_RESUME`; others need ``--force``). The global
batch must stay the same (the data order and the LR schedule count in it), on
any number of ranks: choose micro-batch and accumulation to keep it. A
``train.stop_at`` the saving session reached is cleared, so the run goes on.
"""

from __future__ import annotations

import os

from . import checkpoint as K
from . import config as C
from . import rundir
from . import validity
from .comm import detect_world
from .errors import UsageError

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

