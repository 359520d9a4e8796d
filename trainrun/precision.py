"""Dynamic loss scaling for ``train.precision: fp16`` (bf16 and fp32 need none).

The fp16 train graph multiplies its loss by the float32 input ``loss_scale``
(:func:`trainrun.graphs.scale_loss`), so every gradient comes out multiplied by
it; the runner divides it out where it already scales the gradients (the
optimizer's ``grad_scale``, the logged norm and loss), so unscaling costs no pass.
After each step :meth:`LossScaler.update` is told whether every rank's
gradients were finite: on an overflow the update is skipped and the scale
halved; after ``growth_interval`` finite steps in a row it doubles. The
defaults are onnxruntime's (``DynamicLossScaler``: 2^16, 2000, x2, [1, 2^24]).
Its state is two numbers, saved in the checkpoint and restored exactly.
"""

from __future__ import annotations


class LossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000, factor: float = 2.0,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24):
        self.scale = float(init_scale)
        self.good_steps = 0
        self.growth_interval, self.factor = growth_interval, factor
        self.min_scale, self.max_scale = min_scale, max_scale

    def update(self, finite: bool) -> bool:
        """After a step: halve on overflow (True: the skip is the scaler's to handle, the scale went
        down), grow after ``growth_interval`` finite steps. False: a non-finite step the scaler cannot
        help (already at its minimum): a real divergence."""
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale = min(self.scale * self.factor, self.max_scale)
                self.good_steps = 0
            return True
        self.good_steps = 0
        if self.scale <= self.min_scale:
            return False
        self.scale = max(self.scale / self.factor, self.min_scale)
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def make_scaler(precision: str) -> LossScaler | None:
    return LossScaler() if precision == "fp16" else None
