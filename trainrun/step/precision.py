"""Dynamic loss scaling for ``train.precision: fp16`` (bf16 and fp32 need none).

The fp16 train graph multiplies its loss by the float32 input ``loss_scale``
(:func:`trainrun.graphs.casts.scale_loss`), so every gradient comes out multiplied by
it; the runner divides it out where it already scales the gradients (the
optimizer's ``grad_scale``, the logged norm and loss), so unscaling costs no pass.
Whether a run scales its loss is read from its graphs (the manifest's ``loss_scale``
input, :func:`make_scaler`); the scaler keeps the value of that input (the engine's
buffer bound to it) equal to its scale.
After each step :meth:`LossScaler.update` is told whether every rank's
gradients were finite: on an overflow the update is skipped and the scale
halved; after ``growth_interval`` finite steps in a row it doubles. The
defaults are onnxruntime's (``DynamicLossScaler``: 2^16, 2000, x2, [1, 2^24]).
Its state is two numbers, saved in the checkpoint and restored exactly.
"""

from __future__ import annotations

import numpy as np


class LossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000, factor: float = 2.0,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24, graph_input: np.ndarray | None = None):
        """``graph_input``: the float32 scalar bound to the train graph's ``loss_scale`` input; it holds
        :attr:`scale` from here on."""
        self.graph_input = np.ones((), np.float32) if graph_input is None else graph_input
        self.good_steps = 0
        self.growth_interval, self.factor = growth_interval, factor
        self.min_scale, self.max_scale = min_scale, max_scale
        self._set(float(init_scale))

    def _set(self, scale: float) -> None:
        self.scale = scale
        self.graph_input[()] = scale

    def update(self, finite: bool) -> bool:
        """After a step: halve on overflow (True: the skip is the scaler's to handle, the scale went
        down), grow after ``growth_interval`` finite steps. False: a non-finite step the scaler cannot
        help (already at its minimum): a real divergence."""
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self._set(min(self.scale * self.factor, self.max_scale))
                self.good_steps = 0
            return True
        self.good_steps = 0
        if self.scale <= self.min_scale:
            return False
        self._set(max(self.scale / self.factor, self.min_scale))
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self._set(float(state["scale"]))
        self.good_steps = int(state["good_steps"])


def make_scaler(engine) -> LossScaler | None:
    """The scaler of ``engine``'s train graph when it has a ``loss_scale`` input (fp16), else None."""
    return None if engine.loss_scale is None else LossScaler(graph_input=engine.loss_scale)
