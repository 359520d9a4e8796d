"""The gradient of LayerNormalization in standard ops, from the mean and inverse deviation the forward
node writes (its optional Mean and InvStdDev outputs, added where the node leaves them out: the same
kernel computes them), not recomputed (a float64 input excepted: the outputs are float32 under the
default stash_type, so its statistics are recomputed in float64): with x^ = (x - mean) * inv_std and g = dy * scale,
dx = inv_std * (g - mean(g) - x^ * mean(g * x^)), dscale = sum(dy * x^), dbias = sum(dy)."""

from onnx import TensorProto

from .core import Step, gradient


@gradient("LayerNormalization")
def _layer_norm(s: Step):
    if any(d is not None for d in s.dy[1:]):
        raise s.unsupported("the Mean or InvStdDev output reaches the loss")
    x, scale = s.x[:2]
    rank = s.emit.rank(x, s.node)
    axis = s.attr("axis", -1) % rank
    axes = list(range(axis, rank))
    if s.emit.types.get(x) == TensorProto.DOUBLE:
        centred = s.op("Sub", [x, s.reduce("ReduceMean", x, axes)])
        var = s.reduce("ReduceMean", s.op("Mul", [centred, centred]), axes)
        inv_std = s.op("Reciprocal", [s.op("Sqrt", [s.op("Add", [var, s.const(s.attr("epsilon", 1e-5), like=x)])])])
    else:
        centred = s.op("Sub", [x, s.emit.like(s.emit.output(s.node, 1), x, s.base)])
        inv_std = s.emit.like(s.emit.output(s.node, 2), x, s.base)
    normed = s.op("Mul", [centred, inv_std])
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        g = s.op("Mul", [dy, scale])
        centred = s.op("Sub", [g, s.reduce("ReduceMean", g, axes)])
        along = s.op("Mul", [normed, s.reduce("ReduceMean", s.op("Mul", [g, normed]), axes)])
        out[0] = s.op("Mul", [s.op("Sub", [centred, along]), inv_std])
    if s.wants(1):
        out[1] = s.sum_to(s.op("Mul", [dy, normed]), 1)
    if len(s.x) > 2 and s.wants(2):
        out[2] = s.sum_to(dy, 2)
    return out
