"""Gradients of ops that pick elements: dy goes back to the elements picked, added up where one is picked
more than once. Gather along an axis other than 0 (the rows of a table are :mod:`.indexing`'s),
GatherElements, GatherND (with batch_dims), ReduceMax / ReduceMin (dy split evenly between the elements
that tie for the extreme, as torch.amax), TopK's values; and their inverses, ScatterElements and ScatterND
(reduction none or add)."""

from onnx import TensorProto

from .core import Step, gradient


def half(s: Step, name: str) -> bool:
    """Whether tensor ``name`` is float16 or bfloat16."""
    return s.emit.types.get(name) in (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def scatter_add(s: Step, op_type: str, like: str, indices: str, updates: str, **attrs) -> str:
    """``op_type`` (ScatterND or ScatterElements) with reduction add of ``updates`` into zeros of ``like``'s
    shape and type. float16 and bfloat16 are added in float32 and cast back: stock onnxruntime's CPU kernels
    add in float, double and integers only (1.32: "MLFloat16 data type is not supported with ScatterND
    opset 16 when reduction is 'add'"), and a sum of many rows is better in float32."""
    if half(s, s.y[0]):
        zeros = s.op("ConstantOfShape", [s.op("Shape", [like])])        # float32 zeros
        added = s.op(op_type, [zeros, indices, s.op("Cast", [updates], to=TensorProto.FLOAT)], reduction="add",
                     **attrs)
        return s.op("CastLike", [added, like])
    return s.op(op_type, [s.emit.zeros_like(like, s.base), indices, updates], reduction="add", **attrs)


def scatter_nd_add(s: Step, like: str, indices: str, updates: str, k: int | None = None) -> str:
    """ScatterND's add of ``updates`` into zeros of ``like``'s shape at ``indices`` ([..., k]: index tuples into
    ``like``'s first k axes; ``k`` None: read from ``indices``' static dims), done by ScatterElements along axis 0
    of ``like`` viewed as rows (its first k axes one, the rest the row): onnxruntime's ScatterND runs its add
    over the updates in parallel threads, and where an index repeats sums are lost (measured, 1.32, 2 threads:
    65,536 rows of 16 into 1,000 lost one); its ScatterElements adds serially, so repeated indices sum, in the
    same order every run. k unknown: ScatterND."""
    k = k if k is not None else (s.emit.dims.get(indices) or [None])[-1]
    if k is None:
        return scatter_add(s, "ScatterND", like, indices, updates)
    lead, rest = s.op("Shape", [like], end=k), s.op("Shape", [like], start=k)
    if k == 1:
        where = indices
    else:       # the tuples' row numbers, a negative coordinate counted from its axis' end
        idx = s.op("Cast", [indices], to=TensorProto.INT64)
        idx = s.op("Add", [idx, s.op("Mul", [s.op("Cast", [s.op("Less", [idx, s.const(0)])],
                                                  to=TensorProto.INT64), lead])])
        where = s.op("ReduceSum", [s.op("Mul", [idx, _strides(s, lead, k)]), s.const([-1])], keepdims=0)
    width = s.op("ReduceProd", [rest], keepdims=1)
    rows = s.op("Reshape", [updates, s.op("Concat", [s.const([-1]), width], axis=0)])
    table = s.op("Reshape", [like, s.op("Concat", [s.op("ReduceProd", [lead], keepdims=1), width], axis=0)])
    where = s.op("Expand", [s.op("Reshape", [where, s.const([-1, 1])]), s.op("Shape", [rows])])
    return s.op("Reshape", [scatter_add(s, "ScatterElements", table, where, rows, axis=0), s.op("Shape", [like])])


def _strides(s: Step, lead: str, k: int) -> str:
    """The row-major strides ([k], int64) of the first k axes whose sizes are ``lead``."""
    sizes = [s.op("Slice", [lead, s.const([j]), s.const([j + 1])]) for j in range(k)]
    strides, acc = [None] * k, s.const([1])
    for j in range(k - 1, -1, -1):
        strides[j] = acc
        acc = s.op("Mul", [acc, sizes[j]])
    return s.op("Concat", strides, axis=0)


def gather_along(s: Step):
    """Gather along axis a: the axis moved to the front, dy's index axes to the front, added into zeros
    (:func:`scatter_nd_add`), moved back."""
    data, idx = s.x
    r, q = s.emit.rank(data, s.node), s.emit.rank(idx, s.node)
    a = s.attr("axis", 0) % r
    front = [a] + [k for k in range(r) if k != a]
    dy = s.op("Transpose", [s.dy[0]], perm=list(range(a, a + q)) + list(range(a)) + list(range(a + q, r - 1 + q)))
    spread = scatter_nd_add(s, s.op("Transpose", [data], perm=front), s.op("Unsqueeze", [idx, s.const([-1])]), dy,
                            k=1)
    return [s.op("Transpose", [spread], perm=[front.index(k) for k in range(r)]), None]


@gradient("GatherElements")
def _gather_elements(s: Step):
    data, idx = s.x
    return [scatter_add(s, "ScatterElements", data, idx, s.dy[0], axis=s.attr("axis", 0)), None]


@gradient("GatherND")
def _gather_nd(s: Step):
    """batch_dims b: each index tuple gets its b batch coordinates in front, then dy is added up at them
    (:func:`scatter_nd_add`)."""
    data, idx = s.x
    b = s.attr("batch_dims", 0)
    k = (s.emit.dims.get(idx) or [None])[-1]
    if b:
        q = s.emit.rank(idx, s.node)
        coords_shape = s.op("Concat", [s.op("Shape", [idx], end=-1), s.const([1])], axis=0)
        coords = []
        for j in range(b):
            size = s.op("Squeeze", [s.op("Shape", [idx], start=j, end=j + 1), s.const([0])])
            along = s.op("Reshape", [s.op("Range", [s.const(0), size, s.const(1)]),
                                     s.const([-1 if k == j else 1 for k in range(q)])])
            coords.append(s.op("CastLike", [s.op("Expand", [along, coords_shape]), idx]))
        idx = s.op("Concat", coords + [idx], axis=-1)
    return [scatter_nd_add(s, data, idx, s.dy[0], k=None if k is None else b + k), None]


def _reduced_axes(s: Step):
    """The reduced axes as a tensor name, or None for all of them."""
    if len(s.x) > 1 and s.x[1]:
        return s.x[1]
    axes = s.attr("axes")
    return s.const(list(axes)) if axes else None


def _extreme(s: Step):
    axes = _reduced_axes(s)
    out = [None] * len(s.x)
    if axes is None and s.attr("noop_with_empty_axes", 0):
        out[0] = s.dy[0]
        return out
    x, y, dy = s.x[0], s.y[0], s.dy[0]
    if not s.attr("keepdims", 1) and axes is not None:
        y, dy = s.op("Unsqueeze", [y, axes]), s.op("Unsqueeze", [dy, axes])
    hits = s.op("CastLike", [s.op("Equal", [x, y]), dy])
    count = s.op("ReduceSum", [hits] + ([axes] if axes is not None else []), keepdims=1)
    out[0] = s.op("Mul", [hits, s.op("Div", [dy, count])])
    return out


gradient("ReduceMax")(_extreme)
gradient("ReduceMin")(_extreme)


def _reduction(s: Step) -> str:
    r = s.attr("reduction", b"none")
    return r.decode() if isinstance(r, bytes) else r


def _scatter(s: Step, gather: str, **attrs):
    """ScatterElements / ScatterND: data's gradient dy where nothing was written over it (all of dy with
    reduction add), the updates' dy gathered at their indices. (With repeated indices and reduction none the
    spec leaves the winner open: every update written to a position gets its dy, as torch's scatter.)"""
    data, idx, updates = s.x
    reduction = _reduction(s)
    if reduction not in ("none", "add"):
        raise s.unsupported(f"reduction {reduction} (none and add only)")
    out = [None, None, None]
    if s.wants(0):
        out[0] = s.dy[0] if reduction == "add" else \
            s.op(s.node.op_type, [s.dy[0], idx, s.emit.zeros_like(updates, s.base)], **attrs)
    if s.wants(2):
        out[2] = s.op(gather, [s.dy[0], idx], **attrs)
    return out


gradient("ScatterElements")(lambda s: _scatter(s, "GatherElements", axis=s.attr("axis", 0)))
gradient("ScatterND")(lambda s: _scatter(s, "GatherND"))


@gradient("TopK")
def _top_k(s: Step):
    """The values' dy back at their indices along the axis (the indices carry no gradient)."""
    indices = s.emit.output(s.node, 1)
    return [scatter_add(s, "ScatterElements", s.x[0], indices, s.dy[0], axis=s.attr("axis", -1)), None]
