"""Optimizer update rules over flat buffers, written as symbolic math with :mod:`.sym`.

This is the form that becomes the optimizer graph (ONNX, any execution
provider). :mod:`.host` holds the same rules as fused in-place loops (Numba) for
the CPU: two implementations of one semantics, held together by
tests/test_host_optim.py (every rule and mode, rtol 1e-6). Which one runs is
decided once, by :func:`trainrun.step.optim.build`.

Every rule takes an :class:`Update` (the symbolic inputs of one step) and the
rule's hyper-parameters, and returns ``(new_params, {state_name: new_state})``.
Gradients enter as ``grad_scale * grads``; that scale is folded into the first
coefficient that multiplies them, so it costs no pass of its own.

Cost model: each node over a full tensor is one pass over memory; scalars are
free. The rules are written in forms that need few passes (e.g. Adam's bias
corrections are moved onto scalars), each rewrite noted where it happens.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from trainrun.config import OptimizerConfig

from .sym import Sym, clip, concat, fill, sqrt, sum_squares, where


def state_names(cfg: OptimizerConfig) -> list[str]:
    """Per-element state buffers of the optimizer, in graph input order."""
    if cfg.name in ("adam", "adamw", "lamb"):
        return ["exp_avg", "exp_avg_sq"]
    if cfg.name == "sgd":
        return ["momentum"] if cfg.momentum > 0 else []
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def tensor_settings(cfg: OptimizerConfig, names: list[str], depths: dict | None = None) -> list[tuple]:
    """Each parameter's ``(lr_scale, weight_decay)``, resolved from its name.

    For each of the two, the first of ``cfg.groups`` whose ``params`` pattern (fnmatch, case-sensitive)
    matches the name and that sets it decides; otherwise weight decay is 0 where a ``cfg.no_decay``
    pattern matches (the same as groups ``{weight_decay: 0}`` after the user's), else
    ``cfg.weight_decay``, and the lr scale 1. ``depths`` (name -> how many layers lie above the
    parameter, from the model family; missing: 0) multiplies the lr scale by ``cfg.layer_decay ** depth``.
    """
    out = []
    for n in names:
        groups = [g for g in cfg.groups if fnmatch.fnmatchcase(n, g.params)]
        scale = next((g.lr_scale for g in groups), 1.0)
        wd = next((g.weight_decay for g in groups if g.weight_decay is not None), None)
        if wd is None:
            wd = 0.0 if any(fnmatch.fnmatchcase(n, pat) for pat in cfg.no_decay) else cfg.weight_decay
        if cfg.layer_decay != 1.0 and depths:
            scale *= cfg.layer_decay ** depths.get(n, 0)
        out.append((float(scale), float(wd)))
    return out


def weight_decays(cfg: OptimizerConfig, names: list[str]) -> list[float]:
    """Each parameter's weight decay (see :func:`tensor_settings`)."""
    return [wd for _, wd in tensor_settings(cfg, names)]


@dataclass
class Update:
    """Symbolic inputs of one update of a flat parameter buffer.

    ``params``, ``grads`` and ``state`` are flat float32 tensors holding the
    parameter tensors back to back (``sizes``, in order); ``lr``, ``t`` (the
    1-based step number) and ``grad_scale`` are float64 scalars;
    ``weight_decay`` holds each tensor's decay coefficient and ``lr_scale``
    each tensor's factor of ``lr`` (parameter groups, layer-wise decay; all 1
    leaves the graph as without groups).
    """

    params: Sym
    grads: Sym
    state: dict
    lr: Sym
    t: Sym
    grad_scale: Sym
    sizes: list
    weight_decay: list
    lr_scale: list | None = None

    def __post_init__(self):
        if self.lr_scale is None:
            self.lr_scale = [1.0] * len(self.sizes)
        # one Sym per distinct scale: tensors of equal scale share it (scale_per_tensor sees them equal)
        lrs = {s: self.lr if s == 1.0 else self.lr * s for s in dict.fromkeys(self.lr_scale)}
        self.lrs = [lrs[s] for s in self.lr_scale]

    @property
    def scaled_lr(self) -> bool:
        """Whether the tensors' learning rates differ from ``lr``."""
        return any(s != 1.0 for s in self.lr_scale)

    def times_lr(self, x: Sym) -> Sym:
        """``x`` times each tensor's learning rate (``lr * x`` without groups)."""
        return self.scale_per_tensor(x, self.lrs) if self.scaled_lr else self.lr * x

    @property
    def grad(self) -> Sym:
        """The gradient the rule sees (lazy: no pass by itself)."""
        return self.grad_scale * self.grads

    def by_decay(self, fn) -> list:
        """``fn(wd)`` for each tensor's weight decay wd (``fn`` runs once per distinct wd)."""
        values = {wd: fn(wd) for wd in dict.fromkeys(self.weight_decay)}
        return [values[wd] for wd in self.weight_decay]

    def by_lr_decay(self, fn) -> list:
        """``fn(lr_i, wd)`` for each tensor's learning rate and weight decay (once per distinct pair)."""
        pairs = list(zip(self.lr_scale, self.weight_decay))
        values = {}
        for (s, wd), lr in zip(pairs, self.lrs):
            if (s, wd) not in values:
                values[(s, wd)] = fn(lr, wd)
        return [values[p] for p in pairs]

    def scale_per_tensor(self, x: Sym, values: list) -> Sym:
        """``x`` with tensor i's part multiplied by the scalar ``values[i]``.

        When all values are the same this is a plain (lazy) scaling. Otherwise
        ``x`` is viewed as rows of ``gcd(sizes)`` elements (a free Reshape), so
        that each row lies in one tensor, and multiplied by a column holding
        one value per row (one Expand per tensor, then a Concat): one pass over
        ``x``, and the only extra memory is the column (N / gcd floats). A
        pending scale of ``x`` is folded into the column. Keep the values
        dependent on a graph input, or onnxruntime may fold the column into a
        permanent initializer.
        """
        if all(_same(v, values[0]) for v in values):
            return x * values[0]
        c, base = x.split()
        width = math.gcd(*self.sizes)
        column = concat([fill(c * v, [n // width, 1], x) for v, n in zip(values, self.sizes)])
        total = sum(self.sizes)
        return (base.reshape([total // width, width]) * column).reshape([total])

    def pieces(self, x: Sym) -> list:
        """The per-tensor parts of a flat tensor (Slice copies; none for a single tensor)."""
        if len(self.sizes) == 1:
            return [x]
        out, start = [], 0
        for n in self.sizes:
            out.append(x[start:start + n])
            start += n
        return out


def _same(a, b) -> bool:
    """The same Sym, or equal numbers."""
    return a is b or not isinstance(a, Sym) and not isinstance(b, Sym) and a == b


def _l2_grad(u: Update) -> Sym:
    """g = gs * grads + wd * p (L2 weight decay in the gradient; gs = grad_scale > 0).

    Written as gs * (grads + (wd / gs) * p): gs stays a pending scale (no pass
    of its own) and the per-tensor factors wd / gs depend on a graph input.
    """
    if not any(u.weight_decay):
        return u.grad
    gs = u.grad_scale
    return gs * (u.grads + u.scale_per_tensor(u.params, u.by_decay(lambda wd: wd / gs)))


def _moments(u: Update, g: Sym, b1: float, b2: float):
    m = b1 * u.state["exp_avg"] + (1 - b1) * g
    v = b2 * u.state["exp_avg_sq"] + (1 - b2) * g * g
    return m, v


def adam_direction(u: Update, m: Sym, v: Sym, b1: float, b2: float, eps: float,
                   eps_mode: str, bias_correction: bool) -> Sym:
    """Adam's step direction (the step is lr times this).

    torch: m_hat / (sqrt(v_hat) + eps), with m_hat = m / bc1, v_hat = v / bc2;
    ort (HF): sqrt(bc2) / bc1 * m / (sqrt(v) + eps);  bc_i = 1 - b_i**t.
    torch's form equals sqrt(bc2) / bc1 * m / (sqrt(v) + eps * sqrt(bc2)), so
    both are a scalar times m / (sqrt(v) + e): three passes (Sqrt, Add, Div).
    Without bias correction bc1 = bc2 = 1 and both are m / (sqrt(v) + eps).
    """
    if not bias_correction:
        return m / (sqrt(v) + eps)
    bc1, root_bc2 = 1 - b1 ** u.t, sqrt(1 - b2 ** u.t)
    e = eps * root_bc2 if eps_mode == "torch" else eps
    return root_bc2 / bc1 * (m / (sqrt(v) + e))


def sgd(u: Update, momentum: float = 0.0, nesterov: bool = False):
    """torch.optim.SGD (dampening 0): g = grad + wd*p; buf = mu*buf + g;
    g = g + mu*buf (nesterov) or buf; p = p - lr*g."""
    g = _l2_grad(u)
    new = {}
    if momentum:
        buf = new["momentum"] = momentum * u.state["momentum"] + g
        g = g + momentum * buf if nesterov else buf
    return u.params - u.times_lr(g), new


def adam(u: Update, b1: float, b2: float, eps: float, eps_mode: str = "torch",
         bias_correction: bool = True):
    """Adam with L2 weight decay added to the gradient (torch.optim.Adam; ORT weight_decay_mode 0)."""
    m, v = _moments(u, _l2_grad(u), b1, b2)
    step = u.times_lr(adam_direction(u, m, v, b1, b2, eps, eps_mode, bias_correction))
    return u.params - step, {"exp_avg": m, "exp_avg_sq": v}


def adamw(u: Update, b1: float, b2: float, eps: float, eps_mode: str = "torch",
          bias_correction: bool = True):
    """Adam with decoupled weight decay.

    torch (torch.optim.AdamW): p = p * (1 - lr*wd), then the Adam step;
    ort (HF, ORT adam_mode 1): the Adam step, then p = p * (1 - lr*wd).
    """
    m, v = _moments(u, u.grad, b1, b2)
    step = u.times_lr(adam_direction(u, m, v, b1, b2, eps, eps_mode, bias_correction))
    p = u.params
    if not any(u.weight_decay):
        return p - step, {"exp_avg": m, "exp_avg_sq": v}
    def keep():     # 1 - lr*wd per tensor: each tensor's own lr decays it (torch's param groups)
        return u.by_lr_decay(lambda lr, wd: 1 - lr * wd)
    if eps_mode == "torch":
        p = u.scale_per_tensor(p, keep()) - step
    else:
        p = u.scale_per_tensor(p - step, keep())
    return p, {"exp_avg": m, "exp_avg_sq": v}


def lamb(u: Update, b1: float, b2: float, eps: float, ratio_min: float = 0.0,
         ratio_max: float = float("inf"), bias_correction: bool = True):
    """LAMB as ONNX Runtime defines it, per tensor:

    d = m_hat / (sqrt(v_hat) + eps) + wd * p;
    r = lr * clip(||p|| / ||d||, ratio_min, ratio_max), or lr when either norm is 0;
    p = p - r * d.
    """
    m, v = _moments(u, u.grad, b1, b2)
    c, q = adam_direction(u, m, v, b1, b2, eps, "torch", bias_correction).split()  # direction = c * q
    d = c * q
    if any(u.weight_decay):  # d = c * (q + (wd / c) * p): c stays pending, one pass less
        d = c * (q + u.scale_per_tensor(u.params, u.by_decay(lambda wd: wd / c)))
    ratios = []
    for p, d_i, lr in zip(u.pieces(u.params), u.pieces(d), u.lrs):
        p_norm, d_norm = sqrt(sum_squares(p)), sqrt(sum_squares(d_i))
        trust = lr * clip(p_norm / d_norm, ratio_min, ratio_max)
        ratios.append(where((p_norm > 0) & (d_norm > 0), trust, lr))
    return u.params - u.scale_per_tensor(d, ratios), {"exp_avg": m, "exp_avg_sq": v}
