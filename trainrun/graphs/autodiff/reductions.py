"""Gradients of reductions and of Softmax / LogSoftmax (in standard ops)."""

from .core import Step, gradient


def _axes(s: Step):
    """The reduced axes as a tensor name (from the attribute or the input), or None for all."""
    if len(s.x) > 1 and s.x[1]:
        return s.x[1]
    axes = s.attr("axes")
    return s.const(list(axes)) if axes else None


def _spread(s: Step, dy: str) -> str:
    """dy of the reduced output back over the input's shape."""
    axes = _axes(s)
    if axes is None and s.attr("noop_with_empty_axes", 0):
        return dy
    if not s.attr("keepdims", 1) and axes is not None:
        dy = s.op("Unsqueeze", [dy, axes])
    return s.op("Expand", [dy, s.op("Shape", [s.x[0]])])


@gradient("ReduceSum")
def _reduce_sum(s: Step):
    return [_spread(s, s.dy[0])] + [None] * (len(s.x) - 1)


@gradient("ReduceMean")
def _reduce_mean(s: Step):
    count = s.op("CastLike", [s.op("Div", [s.op("Size", [s.x[0]]), s.op("Size", [s.y[0]])]), s.dy[0]])
    return [_spread(s, s.op("Div", [s.dy[0], count]))] + [None] * (len(s.x) - 1)


@gradient("Softmax")
def _softmax(s: Step):
    y, dy = s.y[0], s.dy[0]
    dot = s.op("ReduceSum", [s.op("Mul", [dy, y]), s.const([s.attr("axis", -1)])], keepdims=1)
    return [s.op("Mul", [y, s.op("Sub", [dy, dot])])]


@gradient("LogSoftmax")
def _log_softmax(s: Step):
    y, dy = s.y[0], s.dy[0]
    total = s.op("ReduceSum", [dy, s.const([s.attr("axis", -1)])], keepdims=1)
    return [s.op("Sub", [dy, s.op("Mul", [s.op("Exp", [y]), total])])]
