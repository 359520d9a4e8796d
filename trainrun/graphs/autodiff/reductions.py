"""Gradients of reductions (ReduceSum ReduceMean ReduceL1 ReduceL2 ReduceSumSquare ReduceLogSumExp ReduceProd;
the reduced axes an attribute or, opset 18 on, an input) and of Softmax / LogSoftmax (in standard ops)."""

from .core import Step, gradient


def _axes(s: Step):
    """The reduced axes as a tensor name (from the attribute or the input), or None for all (or none, with
    noop_with_empty_axes) where they are not given or a constant empty list."""
    if len(s.x) > 1 and s.x[1]:
        value = s.emit.values.get(s.x[1])
        return None if value is not None and value.size == 0 else s.x[1]
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


def _kept(s: Step, t: str) -> str:
    """``t`` of the reduced output's shape with the reduced axes kept (size 1): it broadcasts against x."""
    axes = _axes(s)
    if not s.attr("keepdims", 1) and axes is not None:
        return s.op("Unsqueeze", [t, axes])
    return t


def _reduction_rule(s: Step, local):
    """dy * local(step, y kept, x), dy and y broadcast over the reduced axes. With noop_with_empty_axes and no
    axes refused: onnxruntime 1.19 passes the input through, onnx's reference and onnxruntime 1.32 apply the
    op's elementwise part (x^2 for ReduceSumSquare), so no one gradient matches every runtime's forward."""
    if s.attr("noop_with_empty_axes", 0) and _axes(s) is None:
        raise s.unsupported("noop_with_empty_axes with no axes: onnxruntime 1.19 passes the input through, "
                            "newer runtimes apply the op elementwise; give the axes")
    out = [None] * len(s.x)
    out[0] = s.op("Mul", [_kept(s, s.dy[0]), local(s, _kept(s, s.y[0]), s.x[0])])
    return out


def _reduction(op_type: str, local):
    gradient(op_type)(lambda s: _reduction_rule(s, local))


def _zero(s: Step) -> str:
    return s.const(0.0, like=s.x[0])


# sqrt(sum x^2): x / y, 0 where the norm is 0 (torch's norm)
_reduction("ReduceL2", lambda s, y, x: s.op("Where", [s.op("Equal", [y, _zero(s)]), _zero(s), s.op("Div", [x, y])]))
# log(sum e^x): e^(x - y), the softmax over the reduced axes
_reduction("ReduceLogSumExp", lambda s, y, x: s.op("Exp", [s.op("Sub", [x, y])]))
_reduction("ReduceSumSquare", lambda s, y, x: s.op("Mul", [x, s.const(2.0, like=x)]))
# sum |x|: sign x, 0 at 0 (torch's abs)
_reduction("ReduceL1", lambda s, y, x: s.op("Sign", [x]))


@gradient("ReduceProd")
def _reduce_prod(s: Step):
    """The product of the other elements of x's slice (torch's rule, zeros included): with P the product of the
    slice's nonzero elements and z its count of zeros, P / x where z = 0; at the one zero of a slice with z = 1,
    P (0 at its other elements); 0 where z > 1."""
    def local(s: Step, y: str, x: str) -> str:
        zero, one = _zero(s), s.const(1.0, like=x)
        is_zero = s.op("Equal", [x, zero])
        axes = _axes(s)
        reduce = [axes] if axes is not None else []
        nonzero = s.op("Where", [is_zero, one, x])
        if s.attr("axes") is not None:          # opset < 18: ReduceProd's axes an attribute
            product = s.op("ReduceProd", [nonzero], keepdims=1, axes=list(s.attr("axes")))
        else:
            product = s.op("ReduceProd", [nonzero] + reduce, keepdims=1)
        zeros = s.op("ReduceSum", [s.op("CastLike", [is_zero, x])] + reduce, keepdims=1)
        at_zero = s.op("Where", [s.op("Equal", [zeros, one]), product, zero])
        elsewhere = s.op("Where", [s.op("Equal", [zeros, zero]), s.op("Div", [product, nonzero]), zero])
        return s.op("Where", [is_zero, at_zero, elsewhere])
    return _reduction_rule(s, local)
