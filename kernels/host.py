"""The optimizer update rules as fused, in-place loops for the CPU (compiled by Numba).

:mod:`.optimizers` writes each rule once, symbolically, and trainrun.step.optim turns
it into an ONNX graph. On the CPU that graph runs every elementwise op over the
whole flat buffer: a dozen passes over main memory and full-size intermediates
(several times the parameter bytes of extra memory). :class:`HostOptimizer`
runs the same rules as one loop over params, grads and state per run of
tensors: each element is read once and written once, nothing else is
allocated, and the loop is vectorised (AVX2/AVX-512 where the CPU has them).
A chunked NumPy update (a dozen ufuncs over an L2-sized slice at a time) is
bound by NumPy's per-call overhead and the passes over L2, not by main memory
(docs/design.md, "The optimizer update: host kernel against the graph").

The arithmetic mirrors the graph op for op: the same float32 operations in the
same order (Numba without ``fastmath``: no contraction into FMA, no
reassociation; ``error_model="numpy"``: IEEE division, which lets the loop
vectorise), and the same scalar coefficients, computed in float64 from the
float32-rounded ``lr`` / ``grad_scale`` (the graph's inputs are float32) and
cast to float32 once per step. So SGD, and the moments of AdamW and LAMB, come
out bit for bit as onnxruntime's CPU kernels compute them. Past a square root
the results differ by an ulp here and there: a vectorised sqrt is correctly
rounded, onnxruntime's float32 Sqrt (Eigen's rsqrt + Newton step) is not always.
LAMB's two norms per tensor are also summed in another order (float32 dots per
chunk, added up in float64, instead of onnxruntime's float32 ReduceSumSquare).

NumPy buffers only: the GPU path keeps the ONNX graph.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from trainrun.config import OptimizerConfig

from .optimizers import state_names, tensor_settings

_F32 = np.float32

# cache: compiled once per machine into __pycache__ (or NUMBA_CACHE_DIR), loaded by every later process
_jit = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
_inline = numba.njit(inline="always", boundscheck=False, error_model="numpy")

# how decay enters an Adam step (the ``decay`` argument of _adam)
_NO_DECAY, _L2, _DECOUPLED_BEFORE, _DECOUPLED_AFTER = 0, 1, 2, 3


@_inline
def _direction(g, m, v, b1, c1, b2, c2, e):
    """m = b1*m + c1*g; v = b2*v + c2*g*g; (m, v, m / (sqrt(v) + e)), in the graph's op order."""
    m = m * b1 + g * c1
    v = v * b2 + (g * g) * c2
    return m, v, m / (np.sqrt(v) + e)


@_jit
def _adam(p, g, m, v, b1, c1, b2, c2, e, k, a_wd, keep, decay):
    """Adam / AdamW over whole arrays: p -= k * m/(sqrt(v)+e), with ``decay`` one of the four forms."""
    n = p.size
    if decay == _L2:            # the gradient is grads + (wd/gs)*p
        for i in range(n):
            m[i], v[i], d = _direction(g[i] + p[i] * a_wd, m[i], v[i], b1, c1, b2, c2, e)
            p[i] = p[i] - d * k
    elif decay == _DECOUPLED_BEFORE:
        for i in range(n):
            m[i], v[i], d = _direction(g[i], m[i], v[i], b1, c1, b2, c2, e)
            p[i] = p[i] * keep - d * k
    elif decay == _DECOUPLED_AFTER:
        for i in range(n):
            m[i], v[i], d = _direction(g[i], m[i], v[i], b1, c1, b2, c2, e)
            p[i] = (p[i] - d * k) * keep
    else:
        for i in range(n):
            m[i], v[i], d = _direction(g[i], m[i], v[i], b1, c1, b2, c2, e)
            p[i] = p[i] - d * k


@_jit
def _sgd(p, g, a_wd, wd, k):
    """Plain SGD: p -= (grads + (wd/gs)*p) * (gs*lr), or grads * (gs*lr) without decay."""
    if wd:
        for i in range(p.size):
            p[i] = p[i] - (g[i] + p[i] * a_wd) * k
    else:
        for i in range(p.size):
            p[i] = p[i] - g[i] * k


@_jit
def _sgd_momentum(p, g, buf, a_wd, wd, gs, mu, lr, nesterov):
    """g' = (grads + (wd/gs)*p) * gs; buf = mu*buf + g'; p -= lr * (g' + mu*buf if nesterov else buf)."""
    for i in range(p.size):
        gi = (g[i] + p[i] * a_wd) * gs if wd else g[i] * gs
        b = buf[i] * mu + gi
        buf[i] = b
        if nesterov:
            p[i] = p[i] - (gi + b * mu) * lr
        else:
            p[i] = p[i] - b * lr


@_jit
def _lamb_direction(p, g, m, v, out, b1, c1, b2, c2, e, a_wd, wd):
    """LAMB's first pass over a chunk: m, v updated; out = m/(sqrt(v)+e) + (wd/c)*p (p is not written)."""
    for i in range(p.size):
        m[i], v[i], d = _direction(g[i], m[i], v[i], b1, c1, b2, c2, e)
        out[i] = d + p[i] * a_wd if wd else d


@_jit
def _lamb_apply(p, m, v, e, a_wd, wd, k):
    """LAMB's second pass: the same direction from the new m, v; p -= k * direction."""
    for i in range(p.size):
        d = m[i] / (np.sqrt(v[i]) + e)
        if wd:
            d = d + p[i] * a_wd
        p[i] = p[i] - d * k


class HostOptimizer:
    """One in-place optimizer update of flat float32 NumPy buffers.

    ``cfg`` picks the rule and its hyper-parameters (``cfg.lr`` is not used: the
    scheduled lr is an argument of :meth:`step`); ``sizes`` are the element
    counts of the parameter tensors in flat-buffer order and ``names`` their
    names (for ``cfg.groups`` and ``cfg.no_decay``; ``depths`` for
    ``cfg.layer_decay``, see :func:`.optimizers.tensor_settings`): each tensor's
    learning rate is ``lr`` times its lr scale. The semantics are those of the optimizer
    graph of :func:`trainrun.step.optim.build_optimizer_graph` for the same
    arguments (see :mod:`trainrun.kernels.optimizers`):

    * sgd: g = gs*grads + wd*p; buf = mu*buf + g; p -= lr * (g + mu*buf if
      nesterov else buf) (plain SGD without momentum: p -= lr * g);
    * adam: Adam with L2 decay in the gradient; adamw: decoupled decay, before
      the step (eps_mode torch) or after it (ort); the eps placement of
      eps_mode, bias correction on or off;
    * lamb: per tensor, d = m_hat / (sqrt(v_hat) + eps) + wd*p and
      p -= lr * clip(||p|| / ||d||, ratio_min, ratio_max) * d, or lr * d when
      either norm is 0. Two passes over each tensor: the first updates m, v and
      sums ||p||^2 and ||d||^2, the second recomputes d from the new m, v (the
      same arithmetic, so the same d) and applies it.

    Each run of consecutive tensors that share one weight decay and lr scale
    (each tensor for LAMB) is one call of a compiled loop that writes params and state in
    place. ``chunk`` (LAMB only) is how many elements of a tensor the first pass
    takes at a time: their direction goes to a preallocated chunk buffer and is
    summed while it is in cache.

    ``norm_sums`` (LAMB only): the tensors are parts of tensors split over ranks
    (ZeRO-1, :mod:`trainrun.sync.update`). It receives this rank's (parts, 2) float64
    array of (||p||^2, ||d||^2) partial sums and returns the sums over the whole
    tensors (over every rank), from which each part takes its trust ratio.
    """

    def __init__(self, cfg: OptimizerConfig, sizes: list[int], names: list[str], chunk: int = 1 << 16,
                 norm_sums=None, depths: dict | None = None):
        sizes = [int(n) for n in sizes]
        names = list(names)
        if not sizes:
            raise ValueError("no parameters to optimize")
        if len(sizes) != len(names):
            raise ValueError(f"{len(sizes)} sizes but {len(names)} names")
        if min(sizes) <= 0:
            empty = [name for name, n in zip(names, sizes) if n <= 0]
            raise ValueError(f"parameters without elements: {empty}")
        chunk = int(chunk)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.cfg = cfg
        self.norm_sums = norm_sums
        self.states = state_names(cfg)  # also rejects an unknown rule
        self.sizes, self.names, self.chunk = sizes, names, chunk
        self.numel = sum(sizes)
        settings = tensor_settings(cfg, names, depths)      # (lr scale, weight decay) per tensor
        self.weight_decay = [wd for _, wd in settings]
        self.b1, self.b2 = (float(b) for b in cfg.betas) if cfg.name != "sgd" else (0.0, 0.0)

        bounds = np.cumsum([0] + sizes).tolist()
        if cfg.name == "lamb":  # per tensor: (chunks of the tensor, wd, lr scale)
            self.tensors = [(self._cut(a, b), wd, s) for a, b, (s, wd) in zip(bounds, bounds[1:], settings)]
            self.tmp = np.empty(min(chunk, self.numel), _F32)   # the direction of one chunk
        else:  # runs [a, b, wd, lr scale] of consecutive tensors with the same decay and lr scale
            self.runs: list[list] = []
            for a, b, (s, wd) in zip(bounds, bounds[1:], settings):
                if self.runs and self.runs[-1][2:] == [wd, s]:
                    self.runs[-1][1] = b
                else:
                    self.runs.append([a, b, wd, s])

    def _cut(self, a: int, b: int) -> list[tuple[int, int]]:
        return [(s, min(b, s + self.chunk)) for s in range(a, b, self.chunk)]

    # ------------------------------------------------------------------ public

    def step(self, params: np.ndarray, grads: np.ndarray, state: dict[str, np.ndarray], lr: float, step: int,
             grad_scale: float) -> None:
        """Update params and state (keys = state_names(cfg)) in place; step is 1-based;
        grads are multiplied by grad_scale first; grads are not modified."""
        self._check("params", params)
        self._check("grads", grads)
        missing = [s for s in self.states if s not in state]
        if missing:
            raise KeyError(f"missing optimizer state {missing} (need {self.states})")
        for s in self.states:
            self._check(s, state[s])
        # The graph's lr and grad_scale inputs are float32; the scalar math is float64.
        lr, gs, t = float(_F32(lr)), float(_F32(grad_scale)), float(step)
        name = self.cfg.name
        if name == "sgd":
            self._sgd(params, grads, state.get("momentum"), lr, gs)
        elif name == "lamb":
            self._lamb(params, grads, state["exp_avg"], state["exp_avg_sq"], lr, t, gs)
        else:
            self._adam(params, grads, state["exp_avg"], state["exp_avg_sq"], lr, t, gs, decoupled=name == "adamw")

    def _check(self, what: str, x) -> None:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{what}: HostOptimizer updates NumPy arrays only, got {type(x).__module__}."
                            f"{type(x).__qualname__} (other devices use the optimizer graph)")
        if x.dtype != np.float32:
            raise TypeError(f"{what}: expected float32, got {x.dtype}")
        if x.shape != (self.numel,):
            raise ValueError(f"{what}: expected shape ({self.numel},), got {x.shape}")

    # ------------------------------------------------------------------ rules

    def _sgd(self, p, g, buf, lr, gs) -> None:
        mu = float(self.cfg.momentum)
        for a, b, wd, s in self.runs:
            lr_i = lr * s if s != 1.0 else lr
            a_wd = _F32(wd / gs)
            if not mu:      # the graph keeps gs*lr as one coefficient
                _sgd(p[a:b], g[a:b], a_wd, bool(wd), _F32(gs * lr_i))
            else:
                _sgd_momentum(p[a:b], g[a:b], buf[a:b], a_wd, bool(wd), _F32(gs), _F32(mu), _F32(lr_i),
                              bool(self.cfg.nesterov))

    def _direction_scalars(self, t, gs, eps_mode):
        """(c1, c2, e, c): m = b1*m + c1*g; v = b2*v + c2*g*g (g before grad_scale); direction = c*m/(sqrt(v)+e)."""
        b1, b2, eps = self.b1, self.b2, float(self.cfg.eps)
        c1 = gs * (1 - b1)
        c2 = gs * (1 - b2) * gs
        if self.cfg.bias_correction:
            bc1, root_bc2 = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
            e = eps * root_bc2 if eps_mode == "torch" else eps
            c = root_bc2 / bc1
        else:
            e, c = eps, 1.0
        return c1, c2, e, c

    def _adam(self, p, g, m, v, lr, t, gs, decoupled: bool) -> None:
        c1, c2, e, c = self._direction_scalars(t, gs, self.cfg.eps_mode)
        before = self.cfg.eps_mode == "torch"       # AdamW: decay before the step (torch) or after (ort)
        args = (_F32(self.b1), _F32(c1), _F32(self.b2), _F32(c2), _F32(e))
        for a, b, wd, s in self.runs:
            lr_i = lr * s if s != 1.0 else lr
            if not wd:
                decay = _NO_DECAY
            elif not decoupled:
                decay = _L2
            else:
                decay = _DECOUPLED_BEFORE if before else _DECOUPLED_AFTER
            # adam: L2 decay in the gradient, grads + (wd/gs)*p; adamw: p *= 1 - lr*wd
            _adam(p[a:b], g[a:b], m[a:b], v[a:b], *args, _F32(c * lr_i), _F32(wd / gs), _F32(1 - lr_i * wd), decay)

    def _lamb(self, p, g, m, v, lr, t, gs) -> None:
        c = self._direction_scalars(t, gs, "torch")[3]  # LAMB: always torch's eps form
        scalars = self._lamb_scalars(t, gs)
        if self.norm_sums is None:  # tensor by tensor: both passes while the tensor is in cache
            for chunks, wd, s in self.tensors:
                p_sq, d_sq = self._lamb_sums(p, g, m, v, chunks, wd, c, scalars)
                self._lamb_apply(p, m, v, chunks, wd, c, self._trust(lr * s, c, p_sq, d_sq), scalars)
            return
        # the tensors are parts of tensors split over ranks: every first pass, then the sums of the
        # whole tensors (norm_sums), then every second pass
        sums = np.array([self._lamb_sums(p, g, m, v, chunks, wd, c, scalars) for chunks, wd, _ in self.tensors],
                        np.float64).reshape(len(self.tensors), 2)
        sums = self.norm_sums(sums)
        for (chunks, wd, s), (p_sq, d_sq) in zip(self.tensors, sums):
            self._lamb_apply(p, m, v, chunks, wd, c, self._trust(lr * s, c, float(p_sq), float(d_sq)), scalars)

    def _lamb_scalars(self, t, gs):
        c1, c2, e, _ = self._direction_scalars(t, gs, "torch")
        return _F32(c1), _F32(c2), _F32(e), _F32(self.b1), _F32(self.b2)

    def _trust(self, lr, c, p_sq, d_sq) -> float:
        """lr times the trust ratio, from the two sums of squares of a whole tensor."""
        p_norm, d_norm = math.sqrt(p_sq), math.sqrt(d_sq * (c * c))
        if p_norm > 0 and d_norm > 0:
            return lr * min(max(p_norm / d_norm, float(self.cfg.ratio_min)), float(self.cfg.ratio_max))
        return lr

    def _lamb_sums(self, p, g, m, v, chunks, wd, c, scalars) -> tuple[float, float]:
        """Pass 1 over one tensor: m, v updated; (||p||^2, ||d/c||^2) returned (p is not written)."""
        c1f, c2f, ef, b1f, b2f = scalars
        a_wd = _F32(wd / c)  # d = c * (q + (wd/c)*p), q = m / (sqrt(v) + e)
        p_sq = d_sq = 0.0
        for a, b in chunks:     # chunk by chunk: each chunk's direction is summed while in cache
            pp, out = p[a:b], self.tmp[:b - a]
            _lamb_direction(pp, g[a:b], m[a:b], v[a:b], out, b1f, c1f, b2f, c2f, ef, a_wd, bool(wd))
            p_sq += float(np.dot(pp, pp))
            d_sq += float(np.dot(out, out))
        return p_sq, d_sq

    def _lamb_apply(self, p, m, v, chunks, wd, c, r, scalars) -> None:
        """Pass 2 over one tensor: the same d from the new m, v; p -= (c*r) * (d/c)."""
        a, b = chunks[0][0], chunks[-1][1]
        _lamb_apply(p[a:b], m[a:b], v[a:b], scalars[2], _F32(wd / c), bool(wd), _F32(c * r))
