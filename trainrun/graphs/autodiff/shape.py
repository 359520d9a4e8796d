"""Gradients of ops that move elements without changing them."""

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
    """Each element's flat position, sliced the same way, says where dy goes: a scatter into zeros."""
    x = s.x[0]
    shape = s.op("Shape", [x])
    size = s.op("Reshape", [s.op("Size", [x]), s.const([1])])
    positions = s.op("Reshape", [s.op("Range", [s.const(0), s.op("Size", [x]), s.const(1)]), shape])
    picked = s.op("Reshape", [s.op("Slice", [positions] + s.x[1:]), s.const([-1])])
    zeros = s.op("CastLike", [s.op("ConstantOfShape", [size]), x])
    flat = s.op("ScatterElements", [zeros, picked, s.op("Reshape", [s.dy[0], s.const([-1])])], axis=0)
    return [s.op("Reshape", [flat, shape])] + [None] * (len(s.x) - 1)


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
