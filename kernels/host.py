"""The optimizer update rules as chunked, in-place NumPy code for the CPU.

:mod:`.optimizers` writes each rule once, symbolically, and trainrun.optim turns
it into an ONNX graph. On the CPU that graph runs every elementwise op over the
whole flat buffer: a dozen passes over main memory and full-size intermediates
(several times the parameter bytes of extra memory). :class:`HostOptimizer`
runs the same rules on slices of ``chunk`` elements, so the dozen ops of a slice
stay in cache: the update is about one pass over params, grads and state, and
the only temporaries are two chunk-sized buffers allocated once.

The arithmetic mirrors the graph op for op: the same float32 operations in the
same order, and the same scalar coefficients, computed in float64 from the
float32-rounded ``lr`` / ``grad_scale`` (the graph's inputs are float32) and
cast to float32 once per step. So SGD, and the moments of AdamW and LAMB, come
out bit for bit as onnxruntime's CPU kernels compute them. Past a square root
the results differ by an ulp here and there: np.sqrt is correctly rounded,
onnxruntime's float32 Sqrt (Eigen's rsqrt + Newton step) is not always. LAMB's
two norms per tensor are also summed in another order (float32 partial sums per
chunk, added up in float64, instead of onnxruntime's float32 ReduceSumSquare).

NumPy buffers only: the GPU path keeps the ONNX graph.
"""

from __future__ import annotations

import math

import numpy as np

from trainrun.config import OptimizerConfig

from .optimizers import state_names, weight_decays

_F32 = np.float32


def _moments(g, m, v, b1, c1, b2, c2, scratch) -> None:
    """In place: m = b1*m + c1*g; v = b2*v + c2*g*g (the graph's op order). ``scratch`` must not alias g."""
    np.multiply(m, b1, out=m)
    np.multiply(g, c1, out=scratch)
    np.add(m, scratch, out=m)
    np.multiply(g, g, out=scratch)
    np.multiply(scratch, c2, out=scratch)
    np.multiply(v, b2, out=v)
    np.add(v, scratch, out=v)


def _ratio(m, v, e, out) -> None:
    """out = m / (sqrt(v) + e)."""
    np.sqrt(v, out=out)
    np.add(out, e, out=out)
    np.divide(m, out, out=out)


class HostOptimizer:
    """One in-place optimizer update of flat float32 NumPy buffers, chunk by chunk.

    ``cfg`` picks the rule and its hyper-parameters (``cfg.lr`` is not used: the
    scheduled lr is an argument of :meth:`step`); ``sizes`` are the element
    counts of the parameter tensors in flat-buffer order and ``names`` their
    names (for ``cfg.no_decay``). The semantics are those of the optimizer
    graph of :func:`trainrun.optim.build_optimizer_graph` for the same
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

    Elementwise work runs over chunks of at most ``chunk`` elements of runs of
    consecutive tensors that share one weight decay (one tensor at a time for
    LAMB), with NumPy ufuncs writing in place (``out=``) or into the two
    preallocated chunk temporaries. The default chunk (2**16 elements, 256 KiB
    per float32 array: the six a chunk touches fit in a 2 MiB L2) beat 2**18
    on 62M parameters (half of GPT-2 124M) with two processes updating at once
    on the 2-core AMD EPYC: AdamW 78-81 vs 85-100 ms, LAMB 139 vs 141, SGD with
    momentum 40 vs 44; 2**15 was slower again (86 ms AdamW): smaller chunks pay
    more Python overhead per element.

    ``norm_sums`` (LAMB only): the tensors are parts of tensors split over ranks
    (ZeRO-1, :mod:`trainrun.zero`). It receives this rank's (parts, 2) float64
    array of (||p||^2, ||d||^2) partial sums and returns the sums over the whole
    tensors (over every rank), from which each part takes its trust ratio.
    """

    def __init__(self, cfg: OptimizerConfig, sizes: list[int], names: list[str], chunk: int = 1 << 16,
                 norm_sums=None):
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
        self.weight_decay = weight_decays(cfg, names)
        self.b1, self.b2 = (float(b) for b in cfg.betas) if cfg.name != "sgd" else (0.0, 0.0)

        bounds = np.cumsum([0] + sizes).tolist()
        if cfg.name == "lamb":  # per tensor: (chunks of the tensor, wd)
            self.tensors = [(self._cut(a, b), wd) for a, b, wd in zip(bounds, bounds[1:], self.weight_decay)]
        else:  # runs of consecutive tensors with the same decay, cut into chunks
            runs: list[list] = []
            for a, b, wd in zip(bounds, bounds[1:], self.weight_decay):
                if runs and runs[-1][2] == wd:
                    runs[-1][1] = b
                else:
                    runs.append([a, b, wd])
            self.runs = [(self._cut(a, b), wd) for a, b, wd in runs]
        self.tmp = np.empty(min(chunk, self.numel), _F32)
        self.tmp2 = np.empty(min(chunk, self.numel), _F32)

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
        nesterov = bool(self.cfg.nesterov)
        mul, add, sub = np.multiply, np.add, np.subtract
        tmp, tmp2 = self.tmp, self.tmp2
        if not mu:
            # p -= (grads + (wd/gs)*p) * (gs*lr): the graph keeps gs*lr as one coefficient
            k = _F32(gs * lr)
            for chunks, wd in self.runs:
                a_wd = _F32(wd / gs)
                for a, b in chunks:
                    pp, t1 = p[a:b], tmp[:b - a]
                    if wd:
                        mul(pp, a_wd, out=t1)
                        add(g[a:b], t1, out=t1)
                        mul(t1, k, out=t1)
                    else:
                        mul(g[a:b], k, out=t1)
                    sub(pp, t1, out=pp)
            return
        gsf, muf, lrf = _F32(gs), _F32(mu), _F32(lr)
        for chunks, wd in self.runs:
            a_wd = _F32(wd / gs)
            for a, b in chunks:
                n = b - a
                pp, bb, t1 = p[a:b], buf[a:b], tmp[:n]
                if wd:  # g = (grads + (wd/gs)*p) * gs
                    mul(pp, a_wd, out=t1)
                    add(g[a:b], t1, out=t1)
                    mul(t1, gsf, out=t1)
                else:
                    mul(g[a:b], gsf, out=t1)
                mul(bb, muf, out=bb)
                add(bb, t1, out=bb)
                if nesterov:
                    t2 = tmp2[:n]
                    mul(bb, muf, out=t2)
                    add(t1, t2, out=t1)
                    mul(t1, lrf, out=t1)
                else:
                    mul(bb, lrf, out=t1)
                sub(pp, t1, out=pp)

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
        eps_mode = self.cfg.eps_mode
        c1, c2, e, c = self._direction_scalars(t, gs, eps_mode)
        c1f, c2f, ef, kf = _F32(c1), _F32(c2), _F32(e), _F32(c * lr)
        b1f, b2f = _F32(self.b1), _F32(self.b2)
        torch_mode = eps_mode == "torch"
        mul, add, sub = np.multiply, np.add, np.subtract
        tmp, tmp2 = self.tmp, self.tmp2
        for chunks, wd in self.runs:
            a_wd = _F32(wd / gs)  # adam: L2 decay in the gradient, grads + (wd/gs)*p
            keep = _F32(1 - lr * wd)  # adamw: decoupled decay
            for a, b in chunks:
                n = b - a
                pp, mm, vv = p[a:b], m[a:b], v[a:b]
                t1, t2 = tmp[:n], tmp2[:n]
                if wd and not decoupled:
                    gg = t1
                    mul(pp, a_wd, out=gg)
                    add(g[a:b], gg, out=gg)
                else:
                    gg = g[a:b]
                _moments(gg, mm, vv, b1f, c1f, b2f, c2f, scratch=t2)
                _ratio(mm, vv, ef, out=t1)
                mul(t1, kf, out=t1)
                if wd and decoupled and torch_mode:
                    mul(pp, keep, out=pp)
                    sub(pp, t1, out=pp)
                elif wd and decoupled:
                    sub(pp, t1, out=pp)
                    mul(pp, keep, out=pp)
                else:
                    sub(pp, t1, out=pp)

    def _lamb(self, p, g, m, v, lr, t, gs) -> None:
        c = self._direction_scalars(t, gs, "torch")[3]  # LAMB: always torch's eps form
        scalars = self._lamb_scalars(t, gs)
        if self.norm_sums is None:  # tensor by tensor: both passes while the tensor is in cache
            for chunks, wd in self.tensors:
                p_sq, d_sq = self._lamb_sums(p, g, m, v, chunks, wd, c, scalars)
                self._lamb_apply(p, m, v, chunks, wd, c, self._trust(lr, c, p_sq, d_sq), scalars)
            return
        # the tensors are parts of tensors split over ranks: every first pass, then the sums of the
        # whole tensors (norm_sums), then every second pass
        sums = np.array([self._lamb_sums(p, g, m, v, chunks, wd, c, scalars) for chunks, wd in self.tensors],
                        np.float64).reshape(len(self.tensors), 2)
        sums = self.norm_sums(sums)
        for (chunks, wd), (p_sq, d_sq) in zip(self.tensors, sums):
            self._lamb_apply(p, m, v, chunks, wd, c, self._trust(lr, c, float(p_sq), float(d_sq)), scalars)

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
        tmp, tmp2 = self.tmp, self.tmp2
        p_sq = d_sq = 0.0
        for a, b in chunks:
            n = b - a
            pp, gg, mm, vv = p[a:b], g[a:b], m[a:b], v[a:b]
            t1, t2 = tmp[:n], tmp2[:n]
            _moments(gg, mm, vv, b1f, c1f, b2f, c2f, scratch=t2)
            _ratio(mm, vv, ef, out=t1)
            if wd:
                np.multiply(pp, a_wd, out=t2)
                np.add(t1, t2, out=t1)
            p_sq += float(np.dot(pp, pp))
            d_sq += float(np.dot(t1, t1))
        return p_sq, d_sq

    def _lamb_apply(self, p, m, v, chunks, wd, c, r, scalars) -> None:
        """Pass 2 over one tensor: the same d from the new m, v; p -= (c*r) * (d/c)."""
        ef = scalars[2]
        a_wd, k = _F32(wd / c), _F32(c * r)
        tmp, tmp2 = self.tmp, self.tmp2
        for a, b in chunks:
            n = b - a
            pp, mm, vv = p[a:b], m[a:b], v[a:b]
            t1, t2 = tmp[:n], tmp2[:n]
            _ratio(mm, vv, ef, out=t1)
            if wd:
                np.multiply(pp, a_wd, out=t2)
                np.add(t1, t2, out=t1)
            np.multiply(t1, k, out=t1)
            np.subtract(pp, t1, out=pp)
