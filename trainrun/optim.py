"""The optimizer graph: one in-place update of flat parameter / gradient / state buffers.

Graph interface (N = total number of parameter elements)::

    inputs   params f32[N], grads f32[N], <state> f32[N] for each state_names(cfg),
             lr f32[] (the scheduled lr), step i64[] (1-based update number),
             grad_scale f32[] (> 0; grads are multiplied by it first)
    outputs  params_out f32[N], <state>_out f32[N] for each state

The flat layout is the given parameters back to back, each flattened
row-major. Hyper-parameters other than lr are constants of the graph; weight
decay is 0 for parameters matching a ``cfg.no_decay`` pattern (fnmatch,
case-sensitive). ``eps_mode`` applies to adam and adamw; LAMB always uses ORT's
m_hat / (sqrt(v_hat) + eps). Every input is declared even where a rule does not
read it (``step`` for SGD or without bias correction). Only standard ONNX operators (opset 17) are used, so the graph
runs on any execution provider, and it is safe to bind each ``X_out`` to the
same buffer as ``X`` (see :func:`inplace_aliases`). Clipping and the is-finite
check are the caller's: pass the clip divisor's inverse as ``grad_scale`` and
skip the update when the gradients are not finite.

The update rules live in :mod:`trainrun.kernels.optimizers`.
"""

from __future__ import annotations

import fnmatch
import math

import onnx

from trainrun.config import OptimizerConfig
from trainrun.kernels import optimizers as rules
from trainrun.kernels.sym import DOUBLE, FLOAT, INT64, GraphBuilder, inplace_conflicts


def state_names(cfg: OptimizerConfig) -> list[str]:
    """Per-element state buffers of the optimizer, in graph input order."""
    if cfg.name in ("adam", "adamw", "lamb"):
        return ["exp_avg", "exp_avg_sq"]
    if cfg.name == "sgd":
        return ["momentum"] if cfg.momentum > 0 else []
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def inplace_aliases(cfg: OptimizerConfig) -> dict[str, str]:
    """Graph input -> output pairs meant to share one buffer."""
    return {name: f"{name}_out" for name in ["params", *state_names(cfg)]}


def weight_decays(cfg: OptimizerConfig, names: list[str]) -> list[float]:
    """Each parameter's weight decay: 0 when its name matches a no_decay pattern."""
    return [0.0 if any(fnmatch.fnmatchcase(n, pat) for pat in cfg.no_decay) else float(cfg.weight_decay)
            for n in names]


def build_optimizer_graph(cfg: OptimizerConfig, params: list[tuple[str, tuple[int, ...]]]) -> onnx.ModelProto:
    """The optimizer graph for ``params`` (name, shape) in flat-buffer order."""
    if not params:
        raise ValueError("no parameters to optimize")
    sizes = [math.prod(shape) for _, shape in params]
    if min(sizes) == 0:
        empty = [name for (name, _), n in zip(params, sizes) if n == 0]
        raise ValueError(f"parameters without elements: {empty}")
    states = state_names(cfg)
    n = sum(sizes)

    b = GraphBuilder(f"trainrun_{cfg.name}")
    flat = {name: b.input(name, FLOAT, [n]) for name in ["params", "grads", *states]}
    update = rules.Update(
        params=flat["params"], grads=flat["grads"], state={s: flat[s] for s in states},
        lr=b.input("lr", FLOAT).cast(DOUBLE), t=b.input("step", INT64).cast(DOUBLE),
        grad_scale=b.input("grad_scale", FLOAT).cast(DOUBLE),
        sizes=sizes, weight_decay=weight_decays(cfg, [name for name, _ in params]))

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
