"""Learning-rate schedules: a pure function of the step; and :func:`every`, the one test of an ``*_every``
schedule (what follows a step, the world steps of DiLoCo).

``t`` is the 1-based step number (steps skipped for non-finite gradients count
too, so a skip never shifts the schedule). Warmup rises linearly from lr/warmup
to lr over ``warmup_steps`` steps; afterwards the decay runs over the
remaining steps with progress ``x`` from 0 to 1 and ends at ``min_lr``:

* constant: lr
* linear:   min_lr + (lr - min_lr) * (1 - x)
* poly:     min_lr + (lr - min_lr) * (1 - x) ** power
* cosine:   min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * x))

These are ORT's runner shapes, with one deliberate change: ORT measured ``x``
over the whole run including warmup, which makes cosine and poly jump down at
the end of warmup; here ``x`` counts from the end of warmup, so the schedule is
continuous (as in nanoGPT and transformers).
"""

from __future__ import annotations

import math

from ..config import LRScheduleConfig


def every(step: int, n: int) -> bool:
    """Whether ``step`` is one of every ``n``-th (``train.log_every``, ``checkpoint.every``, ...; 0: never)."""
    return bool(n) and step % n == 0


def learning_rate(t: int, lr: float, max_steps: int, s: LRScheduleConfig) -> float:
    if s.warmup_steps and t <= s.warmup_steps:
        return lr * t / s.warmup_steps
    if s.name == "constant":
        return lr
    span = max(1, max_steps - s.warmup_steps)
    x = min(1.0, max(0.0, (t - s.warmup_steps) / span))
    if s.name == "linear":
        f = 1.0 - x
    elif s.name == "poly":
        f = (1.0 - x) ** s.power
    elif s.name == "cosine":
        f = 0.5 * (1.0 + math.cos(math.pi * x))
    else:
        raise ValueError(f"unknown schedule {s.name}")
    return s.min_lr + (lr - s.min_lr) * f
