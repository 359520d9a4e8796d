"""Gradients of 2-D Conv, MaxPool, AveragePool, GlobalAveragePool and BatchNormalization (training and
inference forms), in standard ops. Conv's input gradient is a ConvTranspose of dy with the same weight
(``output_padding`` making up the rows a stride left unread where the dims are known when the graph is
built; else the unpadded ConvTranspose padded and cut to the input by sizes found at run time), its weight
gradient a Conv of the input (batch and channel swapped) by dy with strides and dilations swapped, cut to
the kernel's size; MaxPool routes dy to the element its own Indices output names (one per window, ties
included); AveragePool spreads dy / divisor with a ConvTranspose of each plane by a kernel of ones.
Training-mode BatchNormalization differentiates through the batch's statistics."""

from .core import Step, gradient
from .selection import scatter_add


def _geometry(s: Step, kernel):
    """(strides, pads, dilations) of a 2-D window op; auto_pad's padding worked out from the input's dims,
    which must then be known when the graph is built."""
    if len(kernel) != 2:
        raise s.unsupported("only 2-D windows are covered")
    strides, dilations = list(s.attr("strides", [1, 1])), list(s.attr("dilations", [1, 1]))
    auto_pad = s.attr("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "NOTSET":
        return strides, list(s.attr("pads", [0, 0, 0, 0])), dilations
    if auto_pad == "VALID":
        return strides, [0, 0, 0, 0], dilations
    dims = s.emit.static(s.x[0])
    if dims is None:
        raise s.unsupported(f"auto_pad {auto_pad} with the input's dims unknown when the graph is built "
                            f"(give explicit pads)")
    begin, end = [], []
    for size, k, stride, dilation in zip(dims[2:], kernel, strides, dilations):
        total = max(0, (-(-size // stride) - 1) * stride + (k - 1) * dilation + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return strides, begin + end, dilations


def _dims(s: Step, name: str):
    dims = s.emit.static(name)
    if dims is None:
        raise s.unsupported(f"the dims of '{name}' are not known when the graph is built")
    return dims


def _output_padding(in_hw, out_hw, kernel, strides, pads, dilations):
    """What ConvTranspose must add so its output is ``in_hw`` again (rows a stride left unread)."""
    return [in_hw[i] - (strides[i] * (out_hw[i] - 1) + (kernel[i] - 1) * dilations[i] + 1 - pads[i] - pads[i + 2])
            for i in range(2)]


def _transpose(s: Step, dy: str, w: str, x: str, kernel, strides, pads, dilations, group) -> str:
    """The ConvTranspose of ``dy`` by ``w`` with ``x``'s height and width: output_padding makes up the rows a
    stride left unread where the dims are known when the graph is built, else the unpadded ConvTranspose
    padded with zeros (the rows left unread) and cut to ``x`` by sizes found at run time."""
    xdims, ydims = s.emit.static(x), s.emit.static(s.y[0])
    if xdims is not None and ydims is not None:
        return s.op("ConvTranspose", [dy, w], strides=strides, pads=pads, dilations=dilations, group=group,
                    output_padding=_output_padding(xdims[2:], ydims[2:], kernel, strides, pads, dilations))
    # the gradient of the padded input, rows no window read added as zeros, its padding cut off
    full = s.op("ConvTranspose", [dy, w], strides=strides, dilations=dilations, group=group)
    hw = s.op("Shape", [x], start=2)
    missing = s.op("Sub", [s.op("Add", [hw, s.const([pads[0] + pads[2], pads[1] + pads[3]])]),
                           s.op("Shape", [full], start=2)])
    padded = s.op("Pad", [full, s.op("Concat", [s.const([0] * 6), missing], axis=0)])
    return s.op("Slice", [padded, s.const(pads[:2]), s.op("Add", [hw, s.const(pads[:2])]), s.const([2, 3])])


def _rank4(s: Step, x: str):
    if s.emit.rank(x, s.node) != 4:
        raise s.unsupported("only 2-D windows are covered")


@gradient("Conv")
def _conv(s: Step):
    x, w = s.x[:2]
    _rank4(s, x)
    m, cg, kh, kw = _dims(s, w)
    strides, pads, dilations = _geometry(s, [kh, kw])
    group = s.attr("group", 1)
    dy = s.dy[0]
    out = [None] * len(s.x)
    if s.wants(0):
        out[0] = _transpose(s, dy, w, x, [kh, kw], strides, pads, dilations, group)
    if s.wants(1):
        # [C/g, g*N, H, W]: each group's channels as the "batch", its (group, sample) pairs as channels
        if group == 1:
            xt = s.op("Transpose", [x], perm=[1, 0, 2, 3])
        else:
            hw = s.op("Shape", [x], start=2)
            split = s.op("Concat", [s.op("Shape", [x], end=1), s.const([group, cg]), hw], axis=0)
            xt = s.op("Reshape", [s.op("Transpose", [s.op("Reshape", [x, split])], perm=[2, 1, 0, 3, 4]),
                                  s.op("Concat", [s.const([cg, -1]), hw], axis=0)])
        dyt = s.op("Transpose", [dy], perm=[1, 0, 2, 3])
        full = s.op("Conv", [xt, dyt], strides=dilations, dilations=strides, pads=pads, group=group)
        cut = s.op("Slice", [full, s.const([0, 0]), s.const([kh, kw]), s.const([2, 3])])
        out[1] = s.op("Transpose", [cut], perm=[1, 0, 2, 3])
    if len(s.x) > 2 and s.x[2] and s.wants(2):
        out[2] = s.op("ReduceSum", [dy, s.const([0, 2, 3])], keepdims=0)
    return out


@gradient("MaxPool")
def _max_pool(s: Step):
    if s.dy[1:] and any(d is not None for d in s.dy[1:]):
        raise s.unsupported("the Indices output reaches the loss")
    if s.attr("storage_order", 0):
        raise s.unsupported("storage_order is 1")
    x = s.x[0]
    _geometry(s, s.attr("kernel_shape"))
    indices = s.y[1] if len(s.y) > 1 and s.y[1] else s.op("MaxPool", [x], outputs=2, **s.attrs)[1]
    flat = s.const([-1])
    # onnxruntime's and ONNX's indices count over the whole input, batch and channel included
    spread = scatter_add(s, "ScatterElements", s.op("Reshape", [x, flat]), s.op("Reshape", [indices, flat]),
                         s.op("Reshape", [s.dy[0], flat]), axis=0)
    return [s.op("Reshape", [spread, s.op("Shape", [x])])]


@gradient("AveragePool")
def _average_pool(s: Step):
    x = s.x[0]
    kernel = list(s.attr("kernel_shape"))
    strides, pads, _ = _geometry(s, kernel)
    if s.attr("ceil_mode", 0):
        raise s.unsupported("ceil_mode is 1")
    _rank4(s, x)
    dy = s.dy[0]
    if s.attr("count_include_pad", 0):
        scaled = s.op("Div", [dy, s.const(float(kernel[0] * kernel[1]), like=dy)])
    else:
        # the share of each window that is not padding, times the window's size: the elements averaged
        share = s.op("AveragePool", [s.op("Add", [s.emit.zeros_like(x, s.base), s.const(1.0, like=x)])],
                     kernel_shape=kernel, strides=strides, pads=pads, count_include_pad=1)
        scaled = s.op("Div", [dy, s.op("Mul", [share, s.const(float(kernel[0] * kernel[1]), like=dy)])])
    # each (sample, channel) plane on its own: [N*C, 1, h, w] by a [1, 1, kh, kw] kernel of ones
    ones = s.op("CastLike", [s.op("ConstantOfShape", [s.const([1, 1] + kernel)]), x])
    ones = s.op("Add", [ones, s.const(1.0, like=x)])
    planes = s.op("Reshape", [scaled, s.op("Concat", [s.const([-1, 1]), s.op("Shape", [scaled], start=2)], axis=0)])
    spread = _transpose(s, planes, ones, x, kernel, strides, pads, [1, 1], 1)
    return [s.op("Reshape", [spread, s.op("Shape", [x])])]


@gradient("GlobalAveragePool")
def _global_average_pool(s: Step):
    x = s.x[0]
    count = s.op("CastLike", [s.op("Div", [s.op("Size", [x]), s.op("Size", [s.y[0]])]), x])
    return [s.op("Expand", [s.op("Div", [s.dy[0], count]), s.op("Shape", [x])])]


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
