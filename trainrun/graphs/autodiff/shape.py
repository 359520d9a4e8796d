"""Gradients of ops that move elements without changing them."""

import onnx

from .core import Step, gradient


def _reshape_back(s: Step):
    """dy in the shape of the data input (Reshape, Unsqueeze, Squeeze, Flatten)."""
    return [s.op("Reshape", [s.dy[0], s.op("Shape", [s.x[0]])])] + [None] * (len(s.x) - 1)


for _op in ("Reshape", "Unsqueeze", "Squeeze", "Flatten"):
    gradient(_op)(_reshape_back)


@gradient("Transpose")
def _transpose(s: Step):
    perm = s.attr("perm") or list(reversed(range(s.emit.rank(s.x[0], s.node))))
    inverse = [perm.index(k) for k in range(len(perm))]
    return [s.op("Transpose", [s.dy[0]], perm=inverse)]


@gradient("Concat")
def _concat(s: Step):
    if len(s.x) == 1:
        return [s.dy[0]]
    axis = s.attr("axis")
    sizes = [s.op("Gather", [s.op("Shape", [x]), s.const([axis])]) for x in s.x]
    return s.op("Split", [s.dy[0], s.op("Concat", sizes, axis=0)], outputs=len(s.x), axis=axis)


@gradient("Split")
def _split(s: Step):
    parts = [d if d is not None else s.emit.zeros_like(y, f"{s.base}/{y}") for d, y in zip(s.dy, s.y)]
    return [s.op("Concat", parts, axis=s.attr("axis", 0))] + [None] * (len(s.x) - 1)


@gradient("Slice")
def _slice(s: Step):
    """dy padded with zeros back to x where x's dims and the bounds are known when the graph is built and
    every step is 1 (a chunk; the Pad noted as a piece of x's gradient along its one axis, if one: the
    pieces of Slices that tile x are concatenated, ``Emitter.add_all``); else each element's flat position,
    sliced the same way, says where dy goes: a scatter into zeros."""
    x = s.x[0]
    pads = _slice_pads(s)
    if pads is not None:
        padded = s.op("Pad", [s.dy[0], s.const(pads)])
        rank, dims = len(pads) // 2, s.emit.static(x)
        moved = [a for a in range(rank) if pads[a] or pads[rank + a]]
        if len(moved) == 1:
            a = moved[0]
            s.emit.pieces[padded] = (s.dy[0], a, pads[a], dims[a] - pads[rank + a], dims[a])
        return [padded] + [None] * (len(s.x) - 1)
    shape = s.op("Shape", [x])
    size = s.op("Reshape", [s.op("Size", [x]), s.const([1])])
    positions = s.op("Reshape", [s.op("Range", [s.const(0), s.op("Size", [x]), s.const(1)]), shape])
    picked = s.op("Reshape", [s.op("Slice", [positions] + s.x[1:]), s.const([-1])])
    zeros = s.op("CastLike", [s.op("ConstantOfShape", [size]), x])
    flat = s.op("ScatterElements", [zeros, picked, s.op("Reshape", [s.dy[0], s.const([-1])])], axis=0)
    return [s.op("Reshape", [flat, shape])] + [None] * (len(s.x) - 1)


def _slice_pads(s: Step):
    """The Pad that undoes a Slice of steps 1 (ONNX's clamping of its bounds), or None (also for bfloat16,
    which onnxruntime's CUDA provider pads not)."""
    dims = s.emit.static(s.x[0])
    if s.emit.types.get(s.x[0]) == onnx.TensorProto.BFLOAT16:
        return None
    given = (s.x[1:] + [""] * 4)[:4]
    values = [s.emit.values.get(i) if i else None for i in given]
    if dims is None or any(i and v is None for i, v in zip(given, values)):
        return None
    starts, ends = (v.reshape(-1).tolist() for v in values[:2])
    axes = values[2].reshape(-1).tolist() if values[2] is not None else list(range(len(starts)))
    steps = values[3].reshape(-1).tolist() if values[3] is not None else [1] * len(starts)
    if any(st != 1 for st in steps):
        return None
    rank = len(dims)
    begin, end = [0] * rank, [0] * rank
    for a, b, e in zip(axes, starts, ends):
        a = a % rank
        b, e = (min(max(v + dims[a] if v < 0 else v, 0), dims[a]) for v in (b, e))
        if e <= b:
            return None
        begin[a], end[a] = b, dims[a] - e
    return begin + end


@gradient("Expand")
def _expand(s: Step):
    return [s.sum_to(s.dy[0], 0), None]


@gradient("Pad")
def _pad(s: Step):
    """Constant mode: dy cut back to the input (pads at least 0; an axes input, opset 18, names the padded
    axes); the fill value gets none."""
    mode = s.attr("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        raise s.unsupported(f"mode {mode} (constant only)")
    pads = [int(p) for p in s.value(1)]
    if min(pads) < 0:
        raise s.unsupported("a negative pad (a crop)")
    rank = s.emit.rank(s.x[0], s.node)
    axes = [int(a) % rank for a in s.value(3)] if len(s.x) > 3 and s.x[3] else list(range(rank))
    begin = s.const(pads[:len(axes)])
    ends = s.op("Add", [s.op("Gather", [s.op("Shape", [s.x[0]]), s.const(axes)]), begin])
    return [s.op("Slice", [s.dy[0], begin, ends, s.const(axes)])] + [None] * (len(s.x) - 1)


@gradient("Tile")
def _tile(s: Step):
    """dy as [r0, n0, r1, n1, ...] (repeats r, x's dims n), summed over the repeats."""
    rank = s.emit.rank(s.x[0], s.node)
    pairs = s.op("Concat", [s.op("Unsqueeze", [s.x[1], s.const([1])]),
                            s.op("Unsqueeze", [s.op("Shape", [s.x[0]]), s.const([1])])], axis=1)
    split = s.op("Reshape", [s.dy[0], s.op("Reshape", [pairs, s.const([-1])])])
    return [s.op("ReduceSum", [split, s.const(list(range(0, 2 * rank, 2)))], keepdims=0), None]


@gradient("Trilu")
def _trilu(s: Step):
    """The same triangle of dy (k an optional input)."""
    return [s.op("Trilu", [s.dy[0]] + s.x[1:2], upper=s.attr("upper", 1)), None][:len(s.x)]


@gradient("CumSum")
def _cumsum(s: Step):
    """The sums run the other way: dx_j = sum over i >= j of dy_i (i > j when exclusive)."""
    return [s.op("CumSum", [s.dy[0], s.x[1]], exclusive=s.attr("exclusive", 0),
                 reverse=1 - s.attr("reverse", 0)), None]


def _blocks(s: Step, b: int) -> str:
    """[N, C / b^2, H, b, W, b] of x [N, C, H, W]."""
    shape = s.op("Shape", [s.x[0]])
    nc = s.op("Div", [s.op("Slice", [shape, s.const([0]), s.const([2])]), s.const([1, b * b])])
    h, w = (s.op("Slice", [shape, s.const([k]), s.const([k + 1])]) for k in (2, 3))
    return s.op("Concat", [nc, h, s.const([b]), w, s.const([b])], axis=0)


@gradient("DepthToSpace")
def _depth_to_space(s: Step):
    """A permutation of x: DCR's inverse is SpaceToDepth; CRD's, dy in blocks [N, C', H, b1, W, b2] moved back
    to [N, C', b1, b2, H, W] (CRD reads the channels as [C', b1, b2])."""
    b = s.attr("blocksize")
    mode = s.attr("mode", b"DCR")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode == "DCR":
        return [s.op("SpaceToDepth", [s.dy[0]], blocksize=b)]
    blocks = s.op("Reshape", [s.dy[0], _blocks(s, b)])
    return [s.op("Reshape", [s.op("Transpose", [blocks], perm=[0, 1, 3, 5, 2, 4]), s.op("Shape", [s.x[0]])])]


@gradient("SpaceToDepth")
def _space_to_depth(s: Step):
    return [s.op("DepthToSpace", [s.dy[0]], blocksize=s.attr("blocksize"), mode="DCR")]
