"""Gradients of Conv, ConvTranspose, MaxPool, AveragePool, LpPool, their Global forms (1-, 2- and 3-D
windows) and BatchNormalization (training and inference forms), in standard ops. Conv's input gradient is
a ConvTranspose of dy with the same weight (``output_padding`` making up the rows a stride left unread
where the dims are known when the graph is built; else the unpadded ConvTranspose padded and cut to the
input by sizes found at run time), its weight gradient a Conv of the input (batch and channel swapped) by
dy with strides and dilations swapped, cut to the kernel's size. ConvTranspose is Conv's adjoint: its
input gradient is a Conv of dy with the same weight and geometry, its weight gradient Conv's with the
roles of input and output exchanged. MaxPool routes dy to the element its own Indices output names (one
per window, ties included; the output added to the forward node where it lacks it, not a second MaxPool), GlobalMaxPool to the first maximum; AveragePool and LpPool spread dy with a
ConvTranspose of each plane by a kernel of ones (AveragePool's divisors, ceil_mode's and padding's
included, read off the op itself run on ones). Training-mode BatchNormalization differentiates through the
batch's statistics."""

import itertools

import numpy as np
from onnx import numpy_helper

from .core import Step, gradient
from .selection import scatter_add

ONE = numpy_helper.from_array(np.array([1.0], np.float32))
OFFSETS = 32        # the largest kernel whose weight gradient is an im2col and a MatMul
SMALL_PLANES = 128  # dy's elements per channel over the batch up to which a depthwise weight gradient is a Conv by dy
DENSE = 256         # a depthwise Conv's input x output positions per plane up to which its gradients are dense maps
COLS = 1 << 22      # the most elements of an im2col (16 MiB in float32) a weight gradient builds in one piece


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


def _weight_grad(s: Step, x: str, dy: str, dims, w_dims, kernel, strides, pads, dilations, group) -> str:
    """d loss / d w of y = Conv(x, w) (``w_dims``: [out, in_per_group, *kernel]) from the input ``x`` and dy
    (``dims``: the dims of (x, dy) known when the graph is built, each None where not), in the form
    fastest on onnxruntime's CPU: for a depthwise Conv, the Conv by dy below where dy's planes are small
    (at most :data:`SMALL_PLANES` elements over the batch), else :func:`_weight_grad_depthwise`; for other
    Convs :func:`_weight_grad_cols`, or for a kernel of more than :data:`OFFSETS` elements a Conv of x
    (each group's channels as the batch, the (group, sample) pairs as channels) by dy (its channels as the
    batch), strides and dilations swapped, cut to the kernel's size."""
    m, in_per_group = w_dims[:2]
    ydims = dims[1]
    depthwise = group > 1 and in_per_group == 1 and m == group
    small = ydims is not None and ydims[0] * int(np.prod(ydims[2:])) <= SMALL_PLANES
    if depthwise and not small:
        return _weight_grad_depthwise(s, x, dy, w_dims, kernel, strides, pads, dilations)
    if not depthwise and int(np.prod(kernel)) <= OFFSETS:
        return _weight_grad_cols(s, x, dy, ydims, w_dims, kernel, strides, pads, dilations, group)
    k = len(kernel)
    swap = [1, 0] + list(range(2, 2 + k))
    if group == 1:
        xt = s.op("Transpose", [x], perm=swap)
    elif in_per_group == 1:
        xt = s.op("Reshape", [s.op("Transpose", [x], perm=swap), s.const([1, -1] + [0] * k)])
    else:
        sp = s.op("Shape", [x], start=2)
        split = s.op("Concat", [s.op("Shape", [x], end=1), s.const([group, in_per_group]), sp], axis=0)
        xt = s.op("Reshape", [s.op("Transpose", [s.op("Reshape", [x, split])], perm=[2, 1, 0] + list(range(3, 3 + k))),
                              s.op("Concat", [s.const([in_per_group, -1]), sp], axis=0)])
    dyt = s.op("Transpose", [dy], perm=swap)
    full = s.op("Conv", [xt, dyt], strides=dilations, dilations=strides, pads=pads, group=group)
    cut = s.op("Slice", [full, s.const([0] * k), s.const(list(kernel)), s.const(list(range(2, 2 + k)))])
    return s.op("Transpose", [cut], perm=swap)


def _weight_grad_depthwise(s: Step, x: str, dy: str, w_dims, kernel, strides, pads, dilations) -> str:
    """d loss / d w of a depthwise y = Conv(x, w): x's im2col [N C, K, O] as one Conv of each (sample,
    channel) plane by the K one-hot kernels, times dy [N C, O, 1] (a MatMul per plane), summed over the
    batch: nine nodes whatever the kernel, 1.2-2.5x faster than slicing each offset out."""
    taps = int(np.prod(kernel))
    cols = s.op("Reshape", [_im2col(s, x, kernel, strides, pads, dilations), s.const([0, 0, -1])])   # [N C, K, O]
    grads = s.op("Unsqueeze", [s.op("Flatten", [dy], axis=2), s.const([-1])])                  # [N C, O, 1]
    per_plane = s.op("Reshape", [s.op("MatMul", [cols, grads]), s.const([-1, w_dims[0], taps])])
    return s.op("Reshape", [s.op("ReduceSum", [per_plane, s.const([0])], keepdims=0), s.const(list(w_dims))])


def _weight_grad_cols(s: Step, x: str, dy: str, ydims, w_dims, kernel, strides, pads, dilations, group) -> str:
    """d loss / d w of y = Conv(x, w) as one MatMul (per group) of dy by x's im2col (cols: x itself for a 1x1
    kernel at stride 1 without pads, else one Conv of each (sample, channel) plane by the kernel's one-hot
    taps where cols stay under :data:`COLS` elements): a sum over the batch of per-sample products
    dy[n, g, mg, O] cols[n, g, cg K, O]^T, both read as they lie, where those products [N, M, cg K] are no
    more than the copies the other form takes (:func:`_batched`: early layers, large planes and small
    weights); else the batch folded into the contraction, dw[g, mg, cg K] = dy^T[g, mg, N O] x
    cols^T[g, cg K, N O]^T, cols^T the channel-major im2col or the strided Slices of the padded
    channel-major x^T [C, N, ...] that the kernel's offsets read, concatenated. Where cols would pass :data:`COLS` elements (or their count is
    unknown when the graph is built, ``ydims`` None) the offsets go in chunks, a MatMul each, whose products
    are concatenated along the kernel's axis. 1.5-20x faster on
    onnxruntime's CPU than a MatMul per offset and sample, and than onnxruntime-training's ConvGrad where
    the channels are many and the planes small."""
    k = len(kernel)
    m, cg = w_dims[:2]
    spatial = list(range(2, 2 + k))
    swap = [1, 0] + spatial
    lead = [group] if group > 1 else []
    offsets = list(itertools.product(*[range(kk) for kk in kernel]))
    taps = len(offsets)
    pointwise = taps == 1 and not any(pads) and all(st == 1 for st in strides)
    fits = ydims is not None and cg * group * ydims[0] * int(np.prod(ydims[2:])) * taps <= COLS
    if ydims is not None and (pointwise or fits) and _batched(ydims, m, cg, group, taps):
        n = ydims[0]        # dy and cols read as they lie
        grads = s.op("Reshape", [dy, s.const([n] + lead + [m // group, -1])])                     # [N, g, mg, O]
        if pointwise:
            cols = s.op("Reshape", [x, s.const([n] + lead + [cg, -1])])                          # [N, g, cg, O]
        else:
            cols = s.op("Reshape", [_im2col(s, x, kernel, strides, pads, dilations),
                                    s.const([n] + lead + [cg * taps, -1])])
        prod = s.op("MatMul", [grads, s.op("Transpose", [cols], perm=_last_two(1 + len(lead)))])   # [N, g, mg, cg K]
        if n > 1:
            prod = s.op("ReduceSum", [prod, s.const([0])], keepdims=0)
        return s.op("Reshape", [prod, s.const(list(w_dims))])
    grads = s.op("Reshape", [s.op("Transpose", [dy], perm=swap), s.const(lead + [m // group, -1])])   # [g, mg, NO]
    if pointwise:
        cols = s.op("Reshape", [s.op("Transpose", [x], perm=swap), s.const(lead + [cg, -1])])
        return s.op("Reshape", [s.op("MatMul", [grads, s.op("Transpose", [cols], perm=_last_two(len(lead)))]),
                                s.const(list(w_dims))])
    if fits:        # the im2col [N, C K, O], then channel-major
        planes = _im2col(s, x, kernel, strides, pads, dilations)
        cols = s.op("Transpose", [s.op("Reshape", [planes, s.const([ydims[0], cg * group * taps, -1])])],
                    perm=[1, 0, 2])                                                          # [C K, N, O]
        cols = s.op("Reshape", [cols, s.const(lead + [cg * taps, -1])])
        return s.op("Reshape", [s.op("MatMul", [grads, s.op("Transpose", [cols], perm=_last_two(len(lead)))]),
                                s.const(list(w_dims))])
    xt = s.op("Transpose", [x], perm=swap)                                                           # [C, N, *in]
    if any(pads):
        xt = s.op("Pad", [xt, s.const([0, 0] + list(pads[:k]) + [0, 0] + list(pads[k:]))])
    per = None if ydims is None else cg * group * ydims[0] * int(np.prod(ydims[2:]))   # one offset's Slice
    chunk = 1 if per is None else max(1, min(len(offsets), COLS // max(1, per)))
    reach = None if ydims is not None else s.op("Mul", [s.op("Shape", [dy], start=2), s.const(list(strides))])
    parts = []
    for first in range(0, len(offsets), chunk):
        slices = []
        for offset in offsets[first:first + chunk]:
            start = [o * d for o, d in zip(offset, dilations)]
            if reach is None:
                ends = s.const([b + st * (o - 1) + 1 for b, st, o in zip(start, strides, ydims[2:])])
            else:
                ends = s.op("Add", [reach, s.const([b + 1 - st for b, st in zip(start, strides)])])
            slices.append(s.op("Slice", [xt, s.const(start), ends, s.const(spatial), s.const(list(strides))]))
        joined = slices[0] if len(slices) == 1 else s.op("Concat", slices, axis=1)                 # [C, c N, *out]
        cols = s.op("Reshape", [joined, s.const(lead + [cg * len(slices), -1])])                   # [g, cg c, NO]
        prod = s.op("MatMul", [grads, s.op("Transpose", [cols], perm=_last_two(len(lead)))])      # [g, mg, cg c]
        parts.append(prod if chunk >= len(offsets) else s.op("Reshape", [prod, s.const([m, cg, len(slices)])]))
    joined = parts[0] if len(parts) == 1 else s.op("Concat", parts, axis=-1)
    return s.op("Reshape", [joined, s.const(list(w_dims))])


def _last_two(lead: int) -> list[int]:
    return list(range(lead)) + [lead + 1, lead]


def _batched(ydims, m: int, cg: int, group: int, taps: int) -> bool:
    """Whether a weight gradient's per-sample products [N, M, cg K] (written, then summed over the batch)
    are no more than the copies folding the batch into the contraction takes, dy^T [M, N O] and cols^T
    [C K, N O]; always for a batch of one (no sum, and those copies are but reshapes)."""
    n, out = ydims[0], int(np.prod(ydims[2:]))
    return n == 1 or m * cg * taps <= out * (cg * group * taps + m)


def _im2col(s: Step, x: str, kernel, strides, pads, dilations) -> str:
    """x's im2col [N C, K, *out]: one Conv of each (sample, channel) plane by the kernel's K one-hot taps."""
    k = len(kernel)
    taps = int(np.prod(kernel))
    onehot = s.const(np.eye(taps).reshape([taps, 1] + list(kernel)), like=x)
    return s.op("Conv", [s.op("Reshape", [x, s.const([-1, 1] + [0] * k)]), onehot], strides=strides, pads=pads,
                dilations=dilations)


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
    dims = (s.emit.static(x), s.emit.static(s.y[0]))
    depthwise = m == group and cg == 1
    if depthwise and None not in dims and int(np.prod(dims[0][2:])) * int(np.prod(dims[1][2:])) <= DENSE:
        out[:2] = _depthwise_dense(s, dy, dims, kernel, strides, pads, dilations)
    else:
        if s.wants(0):
            out[0] = _input_grad(s, dy, w, x, kernel, strides, pads, dilations, group, depthwise)
        if s.wants(1):
            out[1] = _weight_grad(s, x, dy, dims, [m, cg] + kernel, kernel, strides, pads, dilations, group)
    if len(s.x) > 2 and s.x[2] and s.wants(2):
        out[2] = _bias_grad(s, dy, k)
    return out


def _depthwise_dense(s: Step, dy: str, dims, kernel, strides, pads, dilations) -> list:
    """[dx, dw] of a depthwise y = Conv(x, w) whose planes are small (their input x output positions at most
    :data:`DENSE`): each channel's Conv is the linear map of its plane by A[c] = sum over the kernel's taps
    k of w[c, k] E[k] (E: :func:`_plane_map`, a constant), so dx[n, c] = dy[n, c] A[c], one batched MatMul
    after A's, and dw[c, k] = sum over (o, i) of E[k, o, i] M[c, o, i], M[c] = dy^T[c] x[c] (the batch
    contracted), two. onnxruntime runs a grouped Conv (and onnxruntime-training's ConvGrad) one channel at a
    time: 1.3-4x slower at EfficientNet's and ShuffleNet's last stages, hundreds of channels of 2x2 to 4x4."""
    x, w = s.x[:2]
    (n, c, *xs), ys = dims[0], dims[1][2:]
    i, o, taps = int(np.prod(xs)), int(np.prod(ys)), int(np.prod(kernel))
    plane = _plane_map(kernel, strides, pads, dilations, xs, ys).reshape(taps, o * i)
    out = [None, None]
    if s.wants(0):
        maps = s.op("MatMul", [s.op("Reshape", [w, s.const([c, taps])]), s.const(plane, like=x)])       # [C, O I]
        rows = s.op("MatMul", [s.op("Reshape", [dy, s.const([n, c, 1, o])]),
                               s.op("Reshape", [maps, s.const([c, o, i])])])                             # [N, C, 1, I]
        out[0] = s.op("Reshape", [rows, s.const(list(dims[0]))])
    if s.wants(1):
        dyt = s.op("Transpose", [s.op("Reshape", [dy, s.const([n, c, o])])], perm=[1, 2, 0])          # [C, O, N]
        xt = s.op("Transpose", [s.op("Reshape", [x, s.const([n, c, i])])], perm=[1, 0, 2])            # [C, N, I]
        outer = s.op("Reshape", [s.op("MatMul", [dyt, xt]), s.const([c, o * i])])
        out[1] = s.op("Reshape", [s.op("MatMul", [outer, s.const(plane.T, like=x)]), s.const([c, 1] + list(kernel))])
    return out


def _plane_map(kernel, strides, pads, dilations, xs, ys) -> np.ndarray:
    """E [K, O, I]: 1 where output position o of a plane reads input position i through the kernel's tap k
    (nothing where it reads padding)."""
    taps = list(itertools.product(*[range(kk) for kk in kernel]))
    outs = list(itertools.product(*[range(d) for d in ys]))
    plane = np.zeros((len(taps), len(outs), int(np.prod(xs))))
    for t, tap in enumerate(taps):
        for o, at in enumerate(outs):
            pos = [a * st + kk * d - p for a, st, kk, d, p in zip(at, strides, tap, dilations, pads)]
            if all(0 <= q < size for q, size in zip(pos, xs)):
                plane[t, o, np.ravel_multi_index(pos, xs)] = 1.0
    return plane


def _input_grad(s: Step, dy: str, w: str, x: str, kernel, strides, pads, dilations, group, depthwise) -> str:
    """d loss / d x of y = Conv(x, w): a ConvTranspose of dy by w (:func:`_transpose`); for a depthwise Conv
    at stride 1 a Conv of dy by w flipped along its spatial axes (padded by the kernel's reach less the
    forward's pads), and for a 1x1 kernel at stride 1 without pads or groups a Conv of dy by w with its two
    channel axes swapped: 1.2-3x faster than onnxruntime's ConvTranspose there."""
    k = len(kernel)
    swap = [1, 0] + list(range(2, 2 + k))
    if group == 1 and all(kk == 1 for kk in kernel) and all(st == 1 for st in strides) and not any(pads):
        return s.op("Conv", [dy, s.op("Transpose", [w], perm=swap)])
    flipped_pads = [(kk - 1) * d - p for kk, d, p in zip(kernel * 2, dilations * 2, pads)]
    if depthwise and group > 1 and all(st == 1 for st in strides) and min(flipped_pads) >= 0:
        flipped = s.op("Slice", [w, s.const([-1] * k), s.const([np.iinfo(np.int64).min] * k),
                                 s.const(list(range(2, 2 + k))), s.const([-1] * k)])
        return s.op("Conv", [dy, flipped], pads=flipped_pads, dilations=dilations, group=group)
    return _transpose(s, dy, w, x, kernel, strides, pads, dilations, group)


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
        dims = (s.emit.static(s.y[0]), s.emit.static(x))
        out[1] = _weight_grad(s, dy, x, dims, [c, mg] + kernel, kernel, strides, pads, dilations, group)
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
    indices = s.emit.output(s.node, 1)          # the forward's own Indices (given that output where it lacks it)
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
    the running statistics' outputs are the forward node's own and get no gradient. With x^ the normalised
    input, r = 1 / sqrt(var + eps) and n elements per channel: d bias = sum(dy) = n mean(dy),
    d scale = sum(dy x^), dx = scale r (dy - mean(dy) - x^ sum(dy x^) / n). Twelve nodes, each per-channel
    map an inference-mode BatchNormalization (mean, variance, scale and bias given): x^ from the centred
    input and its variance, x^ sum(dy x^) / n (variance n^2, epsilon 0), and dx from dy less it. The
    statistics are recomputed: a second training-mode BatchNormalization (scale 1, momentum 0) would give x^
    and the variance in one node, but its variance output is the population's on onnxruntime's CPU and
    cuDNN's unbiased one on CUDA. The maps' vectors (zeros, ones, n^2) are constants only where the node's
    running outputs are graph outputs (as ``prepare`` keeps them): onnxruntime's CPU kernel writes a
    running output nobody reads into its input's buffer (microsoft/onnxruntime#29790), and its optimiser lets an
    initializer of running statistics and an equal constant share one buffer; else (or the channels or the
    count unknown when the graph is built) they are computed: var - var, 1 and n^2 more."""
    if any(d is not None for d in s.dy[1:]):
        raise s.unsupported("a running mean or variance output reaches the loss")
    x, scale = s.x[:2]
    rank = s.emit.rank(x, s.node)
    axes = [0] + list(range(2, rank))
    eps = s.attr("epsilon", 1e-5)
    dims = s.emit.static(x)
    count = int(np.prod(dims)) // dims[1] if dims is not None else None
    centred = s.op("Sub", [x, s.reduce("ReduceMean", x, axes)])
    var = s.reduce("ReduceMean", s.op("Mul", [centred, centred]), axes, keepdims=0)
    channels = s.emit.static(scale)
    if count is not None and channels is not None and all(o in s.emit.graph_outputs for o in s.y[1:3]):
        n = s.const(float(count), like=x)
        zeros, ones = s.const(np.zeros(channels), like=x), s.const(np.ones(channels), like=x)
        squared = s.const(np.full(channels, float(count) ** 2), like=x)
    else:       # not constants: see the docstring
        n = s.const(float(count), like=x) if count is not None else s.op("Div", [
            s.op("CastLike", [s.op("Size", [x]), x]), s.op("CastLike", [s.op("Shape", [x], start=1, end=2), x])])
        zeros = s.op("Sub", [var, var])
        ones = s.op("Add", [zeros, s.const(1.0, like=x)])
        squared = s.op("Mul", [ones, s.op("Mul", [n, n])])
    normed = s.op("BatchNormalization", [centred, ones, zeros, zeros, var], epsilon=eps)
    dy = s.dy[0]
    dy_mean = s.reduce("ReduceMean", dy, axes, keepdims=0)
    dot = s.reduce("ReduceSum", s.op("Mul", [dy, normed]), axes, keepdims=0)
    out = [None] * len(s.x)
    if s.wants(0):
        along = s.op("BatchNormalization", [normed, dot, zeros, zeros, squared], epsilon=0.0)
        out[0] = s.op("BatchNormalization", [s.op("Sub", [dy, along]), scale, zeros, dy_mean, var], epsilon=eps)
    if s.wants(1):
        out[1] = dot
    if s.wants(2):
        out[2] = s.op("Mul", [dy_mean, n])
    return out
