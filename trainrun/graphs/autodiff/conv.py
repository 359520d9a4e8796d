"""Gradients of Conv, ConvTranspose, MaxPool, AveragePool, LpPool, their Global forms (1-, 2- and 3-D
windows) and BatchNormalization (training and inference forms), in standard ops. Conv's input gradient is
a ConvTranspose of dy with the same weight (``output_padding`` making up the rows a stride left unread
where the dims are known when the graph is built; else the unpadded ConvTranspose padded and cut to the
input by sizes found at run time), its weight gradient a Conv of the input (batch and channel swapped) by
dy with strides and dilations swapped, cut to the kernel's size. ConvTranspose is Conv's adjoint: its
input gradient is a Conv of dy with the same weight and geometry, its weight gradient Conv's with the
roles of input and output exchanged. MaxPool routes dy to the element its own Indices output names (one
per window, ties included), GlobalMaxPool to the first maximum; AveragePool and LpPool spread dy with a
ConvTranspose of each plane by a kernel of ones (AveragePool's divisors, ceil_mode's and padding's
included, read off the op itself run on ones). Training-mode BatchNormalization differentiates through the
batch's statistics."""

import itertools

import numpy as np
from onnx import numpy_helper

from .core import Step, gradient
from .selection import scatter_add

ONE = numpy_helper.from_array(np.array([1.0], np.float32))
OFFSETS = 32        # the largest kernel whose weight gradient is a MatMul per offset


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _geometry(s: Step, kernel):
    """(strides, pads, dilations) of a window op of ``len(kernel)`` spatial axes; auto_pad's padding worked
    out from the input's dims, which must then be known when the graph is built."""
    k = len(kernel)
    if k not in (1, 2, 3):
        raise s.unsupported(f"a {k}-D window (1-, 2- and 3-D ones are covered)")
    strides, dilations = list(s.attr("strides", [1] * k)), list(s.attr("dilations", [1] * k))
    auto_pad = _text(s.attr("auto_pad", "NOTSET"))
    if auto_pad == "NOTSET":
        return strides, list(s.attr("pads", [0] * 2 * k)), dilations
    if auto_pad == "VALID":
        return strides, [0] * 2 * k, dilations
    dims = s.emit.static(s.x[0])
    if dims is None:
        raise s.unsupported(f"auto_pad {auto_pad} with the input's dims unknown when the graph is built "
                            f"(give explicit pads)")
    begin, end = [], []
    for size, kk, stride, dilation in zip(dims[2:], kernel, strides, dilations):
        total = max(0, (-(-size // stride) - 1) * stride + (kk - 1) * dilation + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return strides, begin + end, dilations


def _dims(s: Step, name: str):
    dims = s.emit.static(name)
    if dims is None:
        raise s.unsupported(f"the dims of '{name}' are not known when the graph is built")
    return dims


def _transpose(s: Step, dy: str, w: str, x: str, kernel, strides, pads, dilations, group) -> str:
    """The ConvTranspose of ``dy`` by ``w`` with ``x``'s spatial dims (those of the node's input, its output's
    dy's, where known when the graph is built): the rows a stride left unread (or, in
    ceil_mode, the windows' rows past the end padding) made up by output_padding (or cut by the end pads)
    where the dims are known when the graph is built; else the unpadded ConvTranspose padded at the end by a
    stride's rows and cut to ``x`` by sizes found at run time."""
    k = len(kernel)
    xdims, ydims = s.emit.static(s.x[0]), s.emit.static(s.y[0])
    spatial = list(range(2, 2 + k))
    if xdims is not None and ydims is not None:
        begin, end, extra = pads[:k], [], []
        for i in range(k):
            total = strides[i] * (ydims[2 + i] - 1) + (kernel[i] - 1) * dilations[i] + 1 - xdims[2 + i]
            end.append(max(0, total - begin[i]))
            extra.append(max(0, begin[i] - total))
        return s.op("ConvTranspose", [dy, w], strides=strides, pads=begin + end, dilations=dilations, group=group,
                    output_padding=extra)
    full = s.op("ConvTranspose", [dy, w], strides=strides, dilations=dilations, group=group)
    if any(st > 1 for st in strides):
        full = s.op("Pad", [full, s.const([0] * (2 + k) + [0, 0] + [st - 1 for st in strides])])
    size = s.op("Shape", [x], start=2)
    return s.op("Slice", [full, s.const(pads[:k]), s.op("Add", [size, s.const(pads[:k])]), s.const(spatial)])


def _weight_grad(s: Step, x: str, dy: str, in_per_group: int, kernel, strides, pads, dilations, group) -> str:
    """d loss / d w of y = Conv(x, w) [out, in_per_group, *kernel] from the input ``x`` and dy: per kernel
    offset (:func:`_weight_grad_offsets`), or for a kernel of more than :data:`OFFSETS` elements a Conv of x
    (each group's channels as the batch, the (group, sample) pairs as channels) by dy (its channels as the
    batch), strides and dilations swapped, cut to the kernel's size."""
    if int(np.prod(kernel)) <= OFFSETS:
        return _weight_grad_offsets(s, x, dy, in_per_group, kernel, strides, pads, dilations, group)
    k = len(kernel)
    if group == 1:
        xt = s.op("Transpose", [x], perm=[1, 0] + list(range(2, 2 + k)))
    else:
        sp = s.op("Shape", [x], start=2)
        split = s.op("Concat", [s.op("Shape", [x], end=1), s.const([group, in_per_group]), sp], axis=0)
        xt = s.op("Reshape", [s.op("Transpose", [s.op("Reshape", [x, split])], perm=[2, 1, 0] + list(range(3, 3 + k))),
                              s.op("Concat", [s.const([in_per_group, -1]), sp], axis=0)])
    dyt = s.op("Transpose", [dy], perm=[1, 0] + list(range(2, 2 + k)))
    full = s.op("Conv", [xt, dyt], strides=dilations, dilations=strides, pads=pads, group=group)
    cut = s.op("Slice", [full, s.const([0] * k), s.const(list(kernel)), s.const(list(range(2, 2 + k)))])
    return s.op("Transpose", [cut], perm=[1, 0] + list(range(2, 2 + k)))


def _weight_grad_offsets(s: Step, x: str, dy: str, in_per_group: int, kernel, strides, pads, dilations, group) -> str:
    """d loss / d w of y = Conv(x, w) as one batched MatMul per kernel offset: dy times the strided Slice of
    the padded input that offset reads, summed over the batch (2-3x faster on onnxruntime's CPU than the
    Conv by dy, whose huge kernel it runs through one im2col)."""
    k = len(kernel)
    spatial = list(range(2, 2 + k))
    if any(pads):
        x = s.op("Pad", [x, s.const([0, 0] + list(pads[:k]) + [0, 0] + list(pads[k:]))])
    out = s.op("Shape", [dy], start=2)
    reach = s.op("Mul", [out, s.const(list(strides))])
    grads = s.op("Reshape", [dy, s.op("Concat", [s.const([0, group, -1]), s.op("ReduceProd", [out], keepdims=1)],
                                      axis=0)])                                    # [N, g, mg, O]
    per_offset = []
    for offset in itertools.product(*[range(kk) for kk in kernel]):
        start = [o * d for o, d in zip(offset, dilations)]
        ends = s.op("Add", [reach, s.const([st + 1 - sd for st, sd in zip(start, strides)])])
        cols = s.op("Slice", [x, s.const(start), ends, s.const(spatial), s.const(list(strides))])
        cols = s.op("Reshape", [cols, s.const([0, group, in_per_group, -1])])     # [N, g, cg, O]
        prod = s.op("MatMul", [grads, s.op("Transpose", [cols], perm=[0, 1, 3, 2])])   # [N, g, mg, cg]
        per_offset.append(s.op("Unsqueeze", [prod, s.const([-1])]))
    joined = per_offset[0] if len(per_offset) == 1 else s.op("Concat", per_offset, axis=-1)
    summed = s.op("ReduceSum", [joined, s.const([0])], keepdims=0)                # [g, mg, cg, K]
    return s.op("Reshape", [summed, s.const([-1, in_per_group] + list(kernel))])


def _bias_grad(s: Step, dy: str, k: int) -> str:
    return s.op("ReduceSum", [dy, s.const([0] + list(range(2, 2 + k)))], keepdims=0)


def _spatial(s: Step, w: str):
    dims = _dims(s, w)
    k = len(dims) - 2
    xdims = s.emit.dims.get(s.x[0])
    if xdims is not None and len(xdims) != k + 2:
        raise s.unsupported(f"input of rank {len(xdims)} with a {k}-D kernel")
    return dims, k


@gradient("Conv")
def _conv(s: Step):
    x, w = s.x[:2]
    (m, cg, *kernel), k = _spatial(s, w)
    strides, pads, dilations = _geometry(s, kernel)
    group = s.attr("group", 1)
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        out[0] = _transpose(s, dy, w, x, kernel, strides, pads, dilations, group)
    if s.wants(1):
        out[1] = _weight_grad(s, x, dy, cg, kernel, strides, pads, dilations, group)
    if len(s.x) > 2 and s.x[2] and s.wants(2):
        out[2] = _bias_grad(s, dy, k)
    return out


def _transposed_pads(s: Step, kernel, strides, dilations):
    """ConvTranspose's pads: its own, or worked out from output_shape / auto_pad SAME (the input's dims
    then known when the graph is built) as the ONNX spec says."""
    k = len(kernel)
    auto_pad = _text(s.attr("auto_pad", "NOTSET"))
    shape = s.attr("output_shape")
    if auto_pad == "VALID":
        return [0] * 2 * k
    if auto_pad == "NOTSET" and not shape:
        return list(s.attr("pads", [0] * 2 * k))
    dims = s.emit.static(s.x[0])
    if dims is None:
        raise s.unsupported("output_shape or auto_pad SAME with the input's dims unknown when the graph is built")
    extra = list(s.attr("output_padding", [0] * k))
    want = list(shape)[-k:] if shape else [d * st for d, st in zip(dims[2:], strides)]
    begin, end = [], []
    for i in range(k):
        total = max(0, strides[i] * (dims[2 + i] - 1) + extra[i] + (kernel[i] - 1) * dilations[i] + 1 - want[i])
        first = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        begin.append(first)
        end.append(total - first)
    return begin + end


@gradient("ConvTranspose")
def _conv_transpose(s: Step):
    x, w = s.x[:2]
    (c, mg, *kernel), k = _spatial(s, w)
    k = len(kernel)
    strides, dilations = list(s.attr("strides", [1] * k)), list(s.attr("dilations", [1] * k))
    pads = _transposed_pads(s, kernel, strides, dilations)
    group = s.attr("group", 1)
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        out[0] = s.op("Conv", [dy, w], strides=strides, pads=pads, dilations=dilations, group=group)
    if s.wants(1):
        out[1] = _weight_grad(s, dy, x, mg, kernel, strides, pads, dilations, group)
    if len(s.x) > 2 and s.x[2] and s.wants(2):
        out[2] = _bias_grad(s, dy, k)
    return out


@gradient("MaxPool")
def _max_pool(s: Step):
    if s.dy[1:] and any(d is not None for d in s.dy[1:]):
        raise s.unsupported("the Indices output reaches the loss")
    if s.attr("storage_order", 0):
        raise s.unsupported("storage_order is 1")
    x = s.x[0]
    if len(s.attr("kernel_shape")) not in (1, 2, 3):
        raise s.unsupported(f"a {len(s.attr('kernel_shape'))}-D window (1-, 2- and 3-D ones are covered)")
    indices = s.y[1] if len(s.y) > 1 and s.y[1] else s.op("MaxPool", [x], outputs=2, **s.attrs)[1]
    flat = s.const([-1])
    # onnxruntime's and ONNX's indices count over the whole input, batch and channel included
    spread = scatter_add(s, "ScatterElements", s.op("Reshape", [x, flat]), s.op("Reshape", [indices, flat]),
                         s.op("Reshape", [s.dy[0], flat]), axis=0)
    return [s.op("Reshape", [spread, s.op("Shape", [x])])]


def _windows(s: Step):
    """(kernel, strides, pads, dilations, the end pads ceil_mode's last windows reach past the padding) of a
    pooling node."""
    kernel = list(s.attr("kernel_shape"))
    strides, pads, dilations = _geometry(s, kernel)
    k = len(kernel)
    xdims = s.emit.dims.get(s.x[0])
    if xdims is not None and len(xdims) != k + 2:
        raise s.unsupported(f"input of rank {len(xdims)} with a {k}-D window")
    over = [0] * k
    if s.attr("ceil_mode", 0):
        xdims, ydims = s.emit.static(s.x[0]), s.emit.static(s.y[0])
        if xdims is None or ydims is None:
            raise s.unsupported("ceil_mode 1 with the dims unknown when the graph is built")
        over = [max(0, strides[i] * (ydims[2 + i] - 1) + (kernel[i] - 1) * dilations[i] + 1
                    - (xdims[2 + i] + pads[i] + pads[k + i])) for i in range(k)]
    return kernel, strides, pads, dilations, over


def _ones_kernel(s: Step, kernel, like: str) -> str:
    return s.op("CastLike", [s.op("ConstantOfShape", [s.const([1, 1] + list(kernel))], value=ONE), like])


def _spread(s: Step, g: str, x: str, kernel, strides, pads, dilations, over) -> str:
    """Sum over the windows that read each element of ``x`` of ``g`` (pooling's output shape): a
    ConvTranspose of each (sample, channel) plane by a kernel of ones."""
    k = len(kernel)
    planes = s.op("Reshape", [g, s.op("Concat", [s.const([-1, 1]), s.op("Shape", [g], start=2)], axis=0)])
    xplanes = s.op("Reshape", [x, s.op("Concat", [s.const([-1, 1]), s.op("Shape", [x], start=2)], axis=0)])
    wide = pads[:k] + [p + o for p, o in zip(pads[k:], over)]
    spread = _transpose(s, planes, _ones_kernel(s, kernel, x), xplanes, kernel, strides, wide, dilations, 1)
    return s.op("Reshape", [spread, s.op("Shape", [x])])


@gradient("AveragePool")
def _average_pool(s: Step):
    x = s.x[0]
    kernel, strides, pads, dilations, over = _windows(s)
    k = len(kernel)
    # each output's 1 / divisor = AveragePool(ones) / (the input elements its window reads): the op itself
    # says what it divides by (padding counted or not, ceil_mode's last windows)
    plane = s.op("Concat", [s.const([1, 1]), s.op("Shape", [x], start=2)], axis=0)
    ones = s.op("CastLike", [s.op("ConstantOfShape", [plane], value=ONE), x])
    averaged = s.op("AveragePool", [ones], **s.attrs)
    wide = pads[:k] + [p + o for p, o in zip(pads[k:], over)]
    read = s.op("Conv", [ones, _ones_kernel(s, kernel, x)], strides=strides, pads=wide, dilations=dilations)
    scale = s.op("Div", [averaged, s.op("Max", [read, s.const(1.0, like=x)])])
    return [_spread(s, s.op("Mul", [s.dy[0], scale]), x, kernel, strides, pads, dilations, over)]


@gradient("LpPool")
def _lp_pool(s: Step):
    """y = (sum of |x|^p over the window)^(1/p): dx = sign(x) |x|^(p-1) * spread(dy * y^(1-p))."""
    x = s.x[0]
    kernel, strides, pads, dilations, over = _windows(s)
    p = float(s.attr("p", 2))
    spread = _spread(s, _lp_scaled(s, x, p), x, kernel, strides, pads, dilations, over)
    return [s.op("Mul", [spread, _lp_factor(s, x, p)])]


def _lp_scaled(s: Step, x: str, p: float) -> str:
    """dy * y^(1-p); a window of zeros (whose elements' factor is 0) scaled by 1, not by 1/0."""
    y = s.y[0]
    safe = s.op("Where", [s.op("Equal", [y, s.const(0.0, like=x)]), s.const(1.0, like=x), y])
    return s.op("Mul", [s.dy[0], s.op("Pow", [safe, s.const(1.0 - p, like=x)])])


def _lp_factor(s: Step, x: str, p: float) -> str:
    """d |x|^p / dx / p = sign(x) |x|^(p-1)."""
    if p == 2.0:
        return x
    return s.op("Mul", [s.op("Sign", [x]), s.op("Pow", [s.op("Abs", [x]), s.const(p - 1.0, like=x)])])


@gradient("GlobalLpPool")
def _global_lp_pool(s: Step):
    x = s.x[0]
    p = float(s.attr("p", 2))
    return [s.op("Mul", [_lp_scaled(s, x, p), _lp_factor(s, x, p)])]


@gradient("GlobalAveragePool")
def _global_average_pool(s: Step):
    x = s.x[0]
    count = s.op("CastLike", [s.op("Div", [s.op("Size", [x]), s.op("Size", [s.y[0]])]), x])
    return [s.op("Expand", [s.op("Div", [s.dy[0], count]), s.op("Shape", [x])])]


@gradient("GlobalMaxPool")
def _global_max_pool(s: Step):
    """dy to each plane's first maximum (ArgMax over the plane flattened)."""
    x = s.x[0]
    rows = s.op("Reshape", [x, s.op("Concat", [s.op("Shape", [x], end=2), s.const([-1])], axis=0)])
    first = s.op("ArgMax", [rows], axis=2, keepdims=1)
    dy = s.op("Reshape", [s.dy[0], s.op("Shape", [first])])
    spread = scatter_add(s, "ScatterElements", rows, first, dy, axis=2)
    return [s.op("Reshape", [spread, s.op("Shape", [x])])]


@gradient("BatchNormalization")
def _batch_norm(s: Step):
    if s.attr("training_mode", 0):
        return _batch_norm_training(s)
    x, scale, bias, mean, var = s.x
    rank = s.emit.rank(x, s.node)
    per_channel = s.const([-1] + [1] * (rank - 2))
    axes = s.const([0] + list(range(2, rank)))
    inv_std = s.op("Reciprocal", [s.op("Sqrt", [s.op("Add", [var, s.const(s.attr("epsilon", 1e-5), like=x)])])])
    dy = s.dy[0]
    centred = s.op("Sub", [x, s.op("Reshape", [mean, per_channel])])
    out = [None] * 5
    dy_sum = s.op("ReduceSum", [dy, axes], keepdims=0)
    if s.wants(0):
        out[0] = s.op("Mul", [dy, s.op("Reshape", [s.op("Mul", [scale, inv_std]), per_channel])])
    if s.wants(1) or s.wants(4):
        dot = s.op("ReduceSum", [s.op("Mul", [dy, centred]), axes], keepdims=0)
        if s.wants(1):
            out[1] = s.op("Mul", [dot, inv_std])
        if s.wants(4):
            cube = s.op("Mul", [inv_std, s.op("Mul", [inv_std, inv_std])])
            out[4] = s.op("Mul", [s.op("Mul", [dot, scale]), s.op("Mul", [cube, s.const(-0.5, like=x)])])
    if s.wants(2):
        out[2] = dy_sum
    if s.wants(3):
        out[3] = s.op("Neg", [s.op("Mul", [dy_sum, s.op("Mul", [scale, inv_std])])])
    return out


def _batch_norm_training(s: Step):
    """training_mode 1: y from the batch's mean and (population) variance over all axes but the channels';
    the running statistics' outputs are the forward node's own and get no gradient."""
    if any(d is not None for d in s.dy[1:]):
        raise s.unsupported("a running mean or variance output reaches the loss")
    x, scale = s.x[:2]
    rank = s.emit.rank(x, s.node)
    axes = s.const([0] + list(range(2, rank)))
    per_channel = s.const([-1] + [1] * (rank - 2))

    def mean(t):
        total = s.op("ReduceSum", [t, axes], keepdims=1)
        return s.op("Div", [total, s.op("CastLike", [s.op("Div", [s.op("Size", [t]), s.op("Size", [total])]), t])])
    centred = s.op("Sub", [x, mean(x)])
    inv_std = s.op("Reciprocal", [s.op("Sqrt", [s.op("Add", [mean(s.op("Mul", [centred, centred])),
                                                              s.const(s.attr("epsilon", 1e-5), like=x)])])])
    normed = s.op("Mul", [centred, inv_std])
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        inner = s.op("Sub", [s.op("Sub", [dy, mean(dy)]), s.op("Mul", [normed, mean(s.op("Mul", [dy, normed]))])])
        out[0] = s.op("Mul", [s.op("Mul", [s.op("Reshape", [scale, per_channel]), inv_std]), inner])
    if s.wants(1):
        out[1] = s.op("ReduceSum", [s.op("Mul", [dy, normed]), axes], keepdims=0)
    if s.wants(2):
        out[2] = s.op("ReduceSum", [dy, axes], keepdims=0)
    return out
