"""The gradients of LayerNormalization, InstanceNormalization, GroupNormalization and RMSNormalization in
standard ops.
LayerNormalization's from the mean and inverse deviation the forward
node writes (its optional Mean and InvStdDev outputs, added where the node leaves them out: the same
kernel computes them), not recomputed (a float64 input excepted: the outputs are float32 under the
default stash_type, so its statistics are recomputed in float64): with x^ = (x - mean) * inv_std and g = dy * scale,
dx = inv_std * (g - mean(g) - x^ * mean(g * x^)), dscale = sum(dy * x^), dbias = sum(dy). Instance and
group normalisation the same over their planes and groups, the statistics recomputed (their nodes have no
such outputs), and RMSNormalization's (opset 23: Python 3.13's onnx and onnxruntime) without the mean."""

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


def _normalised_grad(s: Step, x: str, view: str, axes: list[int], g: str):
    """(x^ in ``view``'s shape, d loss / d x in x's shape) of x^ = (v - mean(v)) / sqrt(var(v) + eps) over
    ``axes`` of the view v of x, g = d loss / d x^ (in the view's shape): statistics recomputed in x's type,
    dv = inv_std * (g - mean(g) - x^ * mean(g * x^))."""
    centred = s.op("Sub", [view, s.reduce("ReduceMean", view, axes)])
    var = s.reduce("ReduceMean", s.op("Mul", [centred, centred]), axes)
    inv_std = s.op("Reciprocal", [s.op("Sqrt", [s.op("Add", [var, s.const(s.attr("epsilon", 1e-5), like=x)])])])
    normed = s.op("Mul", [centred, inv_std])
    if not s.wants(0):
        return normed, None
    along = s.op("Mul", [normed, s.reduce("ReduceMean", s.op("Mul", [g, normed]), axes)])
    dv = s.op("Mul", [s.op("Sub", [s.op("Sub", [g, s.reduce("ReduceMean", g, axes)]), along]), inv_std])
    return normed, s.op("Reshape", [dv, s.op("Shape", [x])])


@gradient("InstanceNormalization")
def _instance_norm(s: Step):
    """Each (sample, channel) plane normalised, then scale and bias per channel."""
    x, scale = s.x[:2]
    rank = s.emit.rank(x, s.node)
    per_channel = s.const([-1] + [1] * (rank - 2))
    dy = s.dy[0]
    spatial = list(range(2, rank))
    normed, dx = _normalised_grad(s, x, x, spatial, s.op("Mul", [dy, s.op("Reshape", [scale, per_channel])]))
    out = [dx, None, None]
    if s.wants(1):
        out[1] = s.op("ReduceSum", [s.op("Mul", [dy, normed]), s.const([0] + spatial)], keepdims=0)
    if s.wants(2):
        out[2] = s.op("ReduceSum", [dy, s.const([0] + spatial)], keepdims=0)
    return out


@gradient("GroupNormalization")
def _group_norm(s: Step):
    """The channels in ``num_groups`` groups, each (sample, group) normalised over its channels and spatial
    dims; scale and bias per channel (opset 21) or per group (opset 18, deprecated)."""
    x, scale = s.x[:2]
    rank = s.emit.rank(x, s.node)
    groups = s.attr("num_groups")
    per_group = s.emit.opset < 21
    dy = s.dy[0]
    grouped = s.const([0, groups, -1])
    view = s.op("Reshape", [x, grouped])
    if per_group:
        g = s.op("Mul", [s.op("Reshape", [dy, grouped]), s.op("Reshape", [scale, s.const([groups, 1])])])
    else:
        g = s.op("Reshape", [s.op("Mul", [dy, s.op("Reshape", [scale, s.const([-1] + [1] * (rank - 2))])]), grouped])
    normed, dx = _normalised_grad(s, x, view, [2], g)
    out = [dx, None, None]
    if per_group:
        spread = s.op("Reshape", [dy, grouped])
        if s.wants(1):
            out[1] = s.op("ReduceSum", [s.op("Mul", [spread, normed]), s.const([0, 2])], keepdims=0)
        if s.wants(2):
            out[2] = s.op("ReduceSum", [spread, s.const([0, 2])], keepdims=0)
        return out
    axes = s.const([0] + list(range(2, rank)))
    if s.wants(1):
        normed_x = s.op("Reshape", [normed, s.op("Shape", [x])])
        out[1] = s.op("ReduceSum", [s.op("Mul", [dy, normed_x]), axes], keepdims=0)
    if s.wants(2):
        out[2] = s.op("ReduceSum", [dy, axes], keepdims=0)
    return out


@gradient("RMSNormalization")
def _rms_norm(s: Step):
    """y = x * r * scale, r = 1 / sqrt(mean(x^2) + eps) over the axes from ``axis`` on (opset 23): with
    x^ = x * r and g = dy * scale, dx = r * (g - x^ * mean(g * x^)), dscale = sum(dy * x^)."""
    x, scale = s.x[:2]
    rank = s.emit.rank(x, s.node)
    axes = list(range(s.attr("axis", -1) % rank, rank))
    mean_square = s.reduce("ReduceMean", s.op("Mul", [x, x]), axes)
    inv_rms = s.op("Reciprocal", [s.op("Sqrt", [s.op("Add", [mean_square, s.const(s.attr("epsilon", 1e-5),
                                                                                      like=x)])])])
    normed = s.op("Mul", [x, inv_rms])
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        g = s.op("Mul", [dy, scale])
        along = s.op("Mul", [normed, s.reduce("ReduceMean", s.op("Mul", [g, normed]), axes)])
        out[0] = s.op("Mul", [s.op("Sub", [g, along]), inv_rms])
    if s.wants(1):
        out[1] = s.sum_to(s.op("Mul", [dy, normed]), 1)
    return out
