"""LR schedules against their closed forms, written out independently here."""

import math

import pytest

from trainrun.config import LRScheduleConfig
from trainrun.step.schedule import learning_rate


@pytest.mark.parametrize("name", ["constant", "linear", "poly", "cosine"])
def test_warmup_then_decay(name):
    s = LRScheduleConfig(name=name, warmup_steps=10, min_lr=1e-4, power=2.0)
    lr, T = 1e-3, 110
    lrs = [learning_rate(t, lr, T, s) for t in range(1, T + 1)]
    assert lrs[0] == pytest.approx(lr / 10)
    assert lrs[9] == pytest.approx(lr)                      # end of warmup: the peak
    assert all(b >= a for a, b in zip(lrs[:10], lrs[1:10]))  # rising
    if name == "constant":
        assert all(v == pytest.approx(lr) for v in lrs[10:])
        return
    assert lrs[-1] == pytest.approx(1e-4)                   # ends at min_lr
    assert all(b <= a + 1e-15 for a, b in zip(lrs[10:], lrs[11:]))  # decaying
    t = 60
    x = (t - 10) / 100
    expected = {"linear": 1 - x, "poly": (1 - x) ** 2, "cosine": 0.5 * (1 + math.cos(math.pi * x))}[name]
    assert learning_rate(t, lr, T, s) == pytest.approx(1e-4 + (lr - 1e-4) * expected)


def test_no_warmup_and_past_the_end():
    s = LRScheduleConfig(name="cosine", warmup_steps=0, min_lr=0.0)
    assert learning_rate(1, 1.0, 100, s) == pytest.approx(0.5 * (1 + math.cos(math.pi / 100)))
    assert learning_rate(500, 1.0, 100, s) == pytest.approx(0.0)   # resumed past max_steps: stays at min_lr
