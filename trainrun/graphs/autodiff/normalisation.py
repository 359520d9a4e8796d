"""The gradient of LayerNormalization, its mean and inverse deviation recomputed in standard ops."""

from .core import Step, gradient


def _mean(s: Step, x: str, axes: str) -> str:
    total = s.op("ReduceSum", [x, axes], keepdims=1)
    count = s.op("CastLike", [s.op("Div", [s.op("Size", [x]), s.op("Size", [total])]), x])
    return s.op("Div", [total, count])


@gradient("LayerNormalization")
def _layer_norm(s: Step):
    if any(d is not None for d in s.dy[1:]):
        raise s.unsupported("the Mean or InvStdDev output reaches the loss")
    x, scale = s.x[:2]
    axis = s.attr("axis", -1)
    axes = s.const(list(range(axis, 0)) if axis < 0 else list(range(axis, s.emit.rank(x, s.node))))
    centred = s.op("Sub", [x, _mean(s, x, axes)])
    var = _mean(s, s.op("Mul", [centred, centred]), axes)
    inv_std = s.op("Reciprocal", [s.op("Sqrt", [s.op("Add", [var, s.const(s.attr("epsilon", 1e-5), like=x)])])])
    normed = s.op("Mul", [centred, inv_std])
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        dn = s.op("Mul", [dy, scale])
        inner = s.op("Sub", [s.op("Sub", [dn, _mean(s, dn, axes)]),
                             s.op("Mul", [normed, _mean(s, s.op("Mul", [dn, normed]), axes)])])
        out[0] = s.op("Mul", [inv_std, inner])
    if s.wants(1):
        out[1] = s.sum_to(s.op("Mul", [dy, normed]), 1)
    if len(s.x) > 2 and s.wants(2):
        out[2] = s.sum_to(dy, 2)
    return out
