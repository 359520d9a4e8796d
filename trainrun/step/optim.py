"""The optimizer: one component that updates the flat parameters in place.

:func:`build` is the only way in: it takes the run's ``OptimizerConfig``, the
parameter layout and the flat ``params`` / ``grads`` buffers, owns the state
buffers (``exp_avg`` ...) and returns an :class:`Optimizer` whose
:meth:`Optimizer.step` does one update. Who computes it is decided there, once:

* ``host`` (default on the CPU): :class:`trainrun.kernels.host.HostOptimizer`,
  the rule as fused in-place loops over the buffers, compiled by Numba;
* ``graph`` (default on CUDA): ``graphs/optimizer.onnx`` in onnxruntime, built
  by :func:`build_optimizer_graph` at prepare time from the symbolic rules of
  :mod:`trainrun.kernels.optimizers`; the engine hands it a session to bind.

Optimizer graph interface (N = total number of parameter elements)::

    inputs   params f32[N], grads f32[N], <state> f32[N] for each state_names(cfg),
             lr f32[] (the scheduled lr), step i64[] (1-based update number),
             grad_scale f32[] (> 0; grads are multiplied by it first)
    outputs  params_out f32[N], <state>_out f32[N] for each state

The flat layout is the given parameters back to back, each flattened
row-major. Hyper-parameters other than lr are constants of the graph. Each
tensor's lr scale and weight decay come from ``cfg.groups``, ``cfg.no_decay``
and ``cfg.layer_decay`` (:func:`trainrun.kernels.optimizers.tensor_settings`;
the layer of a built-in model's parameter from its family,
:func:`trainrun.models.registry.layer_depths`):
a tensor's learning rate is the ``lr`` input times its scale. ``eps_mode``
applies to adam and adamw; LAMB always uses ORT's m_hat / (sqrt(v_hat) + eps). Every input is declared even where a rule does not
read it (``step`` for SGD or without bias correction). Only standard ONNX
operators (opset 17) are used, so the graph runs on any execution provider, and
it is safe to bind each ``X_out`` to the same buffer as ``X`` (see
:func:`inplace_aliases`). Clipping and the is-finite check are the caller's:
pass the clip divisor's inverse as ``grad_scale`` and skip the update when the
gradients are not finite.
"""

from __future__ import annotations

import fnmatch
import math

import numpy as np
import onnx

from trainrun.config import OptimizerConfig
from trainrun.errors import UsageError
from trainrun.kernels import optimizers as rules
from trainrun.kernels.optimizers import state_names, tensor_settings, weight_decays  # noqa: F401
from trainrun.kernels.sym import DOUBLE, FLOAT, INT64, GraphBuilder, inplace_conflicts

GRAPH = "optimizer.onnx"


class Optimizer:
    """One update rule over flat buffers. ``state``: name -> flat buffer (same device as params)."""

    graph: str | None = None     # the graph file this optimizer runs, if any (the engine opens it)

    def __init__(self, cfg: OptimizerConfig, params, grads, xp):
        self.cfg = cfg
        self.params, self.grads = params, grads
        self.state = {s: xp.zeros(params.shape, np.float32) for s in state_names(cfg)}

    def step(self, lr: float, t: int, grad_scale: float) -> None:
        """Update params and state in place: the ``t``-th update (1-based), grads times ``grad_scale``."""
        raise NotImplementedError


def group_problems(cfg: OptimizerConfig, names: list[str]) -> list[str]:
    """One line per ``optimizer.groups`` pattern that matches none of the trainable ``names``."""
    return [f"optimizer.groups[{i}].params: {g.params!r} matches no trainable parameter"
            for i, g in enumerate(cfg.groups) if not any(fnmatch.fnmatchcase(n, g.params) for n in names)]


def check_groups(cfg: OptimizerConfig, names: list[str]) -> None:
    """A UsageError naming each ``optimizer.groups`` pattern that matches none of the trainable ``names``."""
    unmatched = group_problems(cfg, names)
    if unmatched:
        shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
        raise UsageError(f"{len(unmatched)} parameter group(s) match nothing (the parameters: {shown})",
                         unmatched)


class _Host(Optimizer):
    def __init__(self, cfg, params, grads, xp, sizes, names, norm_sums=None, depths=None):
        super().__init__(cfg, params, grads, xp)
        from trainrun.kernels.host import HostOptimizer
        self.kernel = HostOptimizer(cfg, sizes, names, norm_sums=norm_sums, depths=depths)

    def step(self, lr, t, grad_scale):
        self.kernel.step(self.params, self.grads, self.state, lr, t, grad_scale)


class _Graph(Optimizer):
    graph = GRAPH

    def __init__(self, cfg, params, grads, xp):
        super().__init__(cfg, params, grads, xp)
        # scalar inputs live on the host; on CUDA the engine binds them again before each run, since
        # onnxruntime copies a host input to the device when it is bound (step.bound.Bound.run)
        self.lr = np.zeros((), np.float32)
        self.t = np.zeros((), np.int64)
        self.grad_scale = np.ones((), np.float32)
        self.session = None

    def bind(self, session) -> None:
        """Bind ``session`` (the engine's, of :data:`GRAPH`) to the buffers, in place."""
        session.bind_in("params", self.params)
        session.bind_out("params_out", self.params)
        session.bind_in("grads", self.grads)
        for s, arr in self.state.items():
            session.bind_in(s, arr)
            session.bind_out(s + "_out", arr)
        session.bind_in("lr", self.lr)
        session.bind_in("step", self.t)
        session.bind_in("grad_scale", self.grad_scale)
        self.session = session

    def step(self, lr, t, grad_scale):
        self.lr[()] = lr
        self.t[()] = t
        self.grad_scale[()] = grad_scale
        self.session.run()


def build(cfg: OptimizerConfig, names: list[str], sizes: list[int], params, grads, xp=np, *,
          kernel: str = "auto", norm_sums=None, depths: dict | None = None) -> Optimizer:
    """The optimizer of ``cfg`` over flat ``params``/``grads`` laid out as ``names``/``sizes``;
    ``xp`` is their array module (numpy, or cupy on the GPU). ``kernel``: host, graph or auto
    (host for numpy buffers, graph otherwise; the graph was built by :func:`build_optimizer_graph`
    with the same ``depths``: :func:`trainrun.models.registry.layer_depths`).

    A shard (ZeRO-1, :mod:`trainrun.sync.update`): ``params``/``grads`` are views of one rank's part of
    the flat buffers, ``names``/``sizes`` the parts of tensors it holds (a tensor may be cut at
    either end), and ``norm_sums`` combines LAMB's per-tensor sums of squares over the ranks (see
    :class:`trainrun.kernels.host.HostOptimizer`); host kernel only."""
    on_host = xp is np
    if kernel == "host" or (kernel == "auto" and on_host):
        if not on_host:     # config validation refuses it first; this guards other callers
            raise ValueError("the host optimizer kernel runs on the CPU; the buffers are on the GPU")
        return _Host(cfg, params, grads, xp, sizes, names, norm_sums, depths)
    if norm_sums is not None:
        raise ValueError("a sharded optimizer (norm_sums) runs on the host kernel only")
    return _Graph(cfg, params, grads, xp)


def inplace_aliases(cfg: OptimizerConfig) -> dict[str, str]:
    """Graph input -> output pairs meant to share one buffer."""
    return {name: f"{name}_out" for name in ["params", *state_names(cfg)]}


def build_optimizer_graph(cfg: OptimizerConfig, params: list[tuple[str, tuple[int, ...]]],
                          depths: dict | None = None) -> onnx.ModelProto:
    """The optimizer graph for ``params`` (name, shape) in flat-buffer order; ``depths``: the layer
    of each (:func:`trainrun.models.registry.layer_depths`) for ``cfg.layer_decay``."""
    if not params:
        raise ValueError("no parameters to optimize")
    sizes = [math.prod(shape) for _, shape in params]
    if min(sizes) == 0:
        empty = [name for (name, _), n in zip(params, sizes) if n == 0]
        raise ValueError(f"parameters without elements: {empty}")
    states = state_names(cfg)
    n = sum(sizes)

    settings = tensor_settings(cfg, [name for name, _ in params], depths)
    b = GraphBuilder(f"trainrun_{cfg.name}")
    flat = {name: b.input(name, FLOAT, [n]) for name in ["params", "grads", *states]}
    update = rules.Update(
        params=flat["params"], grads=flat["grads"], state={s: flat[s] for s in states},
        lr=b.input("lr", FLOAT).cast(DOUBLE), t=b.input("step", INT64).cast(DOUBLE),
        grad_scale=b.input("grad_scale", FLOAT).cast(DOUBLE),
        sizes=sizes, weight_decay=[wd for _, wd in settings], lr_scale=[s for s, _ in settings])

    b1, b2 = cfg.betas
    if cfg.name == "sgd":
        new_params, new_state = rules.sgd(update, cfg.momentum, cfg.nesterov)
    elif cfg.name == "lamb":
        new_params, new_state = rules.lamb(update, b1, b2, cfg.eps, cfg.ratio_min, cfg.ratio_max,
                                           cfg.bias_correction)
    else:
        rule = rules.adam if cfg.name == "adam" else rules.adamw
        new_params, new_state = rule(update, b1, b2, cfg.eps, cfg.eps_mode, cfg.bias_correction)

    b.output(new_params, "params_out", [n])
    for s in states:
        b.output(new_state[s], f"{s}_out", [n])
    model = b.model(opset=17, ir_version=9)
    problems = inplace_conflicts(model, inplace_aliases(cfg))
    if problems:  # a bug in a rule, never a user error
        raise AssertionError("optimizer graph is not safe to run in place:\n" + "\n".join(problems))
    return model
