"""Fewer, larger nodes in a train graph of trainrun's own gradient builder (``graphs.fuse``), the same
numbers (float32 reordering at most: a scale applied to a product's sum instead of its operand or result).

The builder writes each op's gradient by its rule, and the rules know only their own node: shapes found
at run time where a dim is symbolic, casts of constants, a Reshape of a Reshape, a transpose a product
could read transposed. :func:`fuse` rewrites the graph, rule by rule until none applies:

* constants folded: ``Shape`` and ``Size`` of a tensor whose dims are all known (every dim under
  ``build.static_shape``; a shape's own length always), and every node whose inputs are all constants, where
  it is exact (integer and boolean results, casts and data movement of floats) and small
  (:data:`MAX_FOLD` elements): the run-time shape arithmetic of a broadcast gradient's sum
  (``Shape``/``Size``/``NonZero``/``Concat``...) becomes its constant axes;
* no-ops removed: Identity, a Cast or CastLike to the type it has, a Reshape or Expand to the shape it has,
  a Mul or Div by a scalar 1; each reader then reads the input (a graph output keeps its name: the input
  is renamed);
* a Reshape of a Reshape reads the first one's input; a ReduceSum/ReduceMean keeping its dims followed by
  a Reshape that drops exactly them is one reduction without keepdims (a bias's gradient);
* a Transpose of a Transpose is one (none when they cancel);
* a MatMul (or Gemm) whose operand is a Transpose of its last two dims reads it transposed
  (com.microsoft FusedMatMul transA/transB, registered by stock onnxruntime's CPU and CUDA providers; Gemm's
  own transA/transB); a Mul of a product by a scalar constant is its ``alpha``, and so is a Mul by a scalar
  constant read only by products (attention's dS times the scale, read by dQ's and dK's products); a
  Transpose of a product's last two dims is the product of the swapped operands ((A B)^T = B^T A^T). The
  weight gradients' explicit transposes (``autodiff/matrix.py``: a [M, 1, K] view permuted) are not such a Transpose and
  stay: MLAS runs a transposed left operand slower;
* nodes nobody reads removed, equal constants shared;
* a gradient output (``<param>_grad``) made by a Reshape of a tensor of as many elements, its dims known, is
  that tensor, under its own dims (a Conv weight's [M, C K] product, not [M, C, kh, kw]): onnxruntime copies
  a Reshape's input into an output bound to the caller's buffer, a copy of every Conv weight's gradient
  each step; the engine binds the parameter's view of the gradient buffer in the output's declared dims
  (``trainrun.step.bound.Bound.bind_out``).

onnxruntime does the last three itself where a session's optimization level allows, so they change the
file more than the nodes run; the folding and the no-ops are nodes onnxruntime runs otherwise (it folds
neither a shape of a symbolic dim's tensor nor a Cast of a constant). No rule fuses LayerNormalization's,
Softmax's or GELU's backward into one op: stock onnxruntime has no kernel of that math (its LayerNormalizationGrad,
SoftmaxGrad and GeluGrad are the training build's)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from .names import GRAD_SUFFIX
from .onnx_edit import declared, unique_name

MAX_FOLD = 4096         # elements of a folded constant at most: shapes and axes, not tables
MS = "com.microsoft"
# exact on floats: casts (rounding to nearest, as onnxruntime's) and data movement
EXACT_FLOAT = {"Cast", "CastLike", "Reshape", "Identity", "Unsqueeze", "Squeeze", "Concat", "Expand", "Flatten",
               "Transpose", "Slice", "Gather", "ConstantOfShape", "Neg", "Shape", "Size"}
RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
          "Dropout"}
INTS = {TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8, TensorProto.UINT8,
        TensorProto.BOOL}


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _value(node):
    """The value of a Constant node (None for a form not read here, e.g. a sparse one)."""
    a = node.attribute[0] if len(node.attribute) == 1 else None
    if a is None:
        return None
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    kinds = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32, "value_floats": np.float32}
    return np.array(helper.get_attribute_value(a), kinds[a.name]) if a.name in kinds else None


class _Graph:
    """The nodes, what is known of each tensor (dims, element type, constant value), who reads what."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.nodes = list(model.graph.node)
        self.keep: set[str] = set()
        self.outputs = {o.name for o in model.graph.output}
        self.inputs = {i.name for i in model.graph.input}
        self.taken = {n for node in self.nodes for n in list(node.input) + list(node.output)} | self.inputs
        self.taken |= {t.name for t in model.graph.initializer} | {n.name for n in self.nodes}
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
        self.infer()

    def infer(self):
        g = self.model.graph
        del g.node[:]
        g.node.extend(self.nodes)
        del g.value_info[:]
        try:
            inferred = shape_inference.infer_shapes(self.model, strict_mode=False, data_prop=True)
        except Exception:  # noqa: BLE001 - an uninferable graph: only the declared shapes are known
            inferred = self.model
        self.types, self.dims, self.syms = declared(inferred)
        self.values = {}
        for t in g.initializer:
            self.values[t.name] = numpy_helper.to_array(t)
            self.dims[t.name], self.types[t.name] = list(t.dims), t.data_type
        for n in self.nodes:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                v = _value(n)
                if v is not None:
                    self.values[n.output[0]] = v
                    self.dims[n.output[0]] = list(v.shape)
                    self.types[n.output[0]] = helper.np_dtype_to_tensor_dtype(v.dtype)
        self.readers = {}
        for n in self.nodes:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)
        self.producer = {o: n for n in self.nodes for o in n.output if o}

    def static(self, name):
        d = self.dims.get(name)
        return d if d is not None and None not in d else None

    def name(self, base: str) -> str:
        return unique_name(base, self.taken)

    def constant(self, value: np.ndarray, base: str) -> onnx.NodeProto:
        out = self.name(f"{base}/folded")
        return helper.make_node("Constant", [], [out], name=self.name(f"{out}/Constant"),
                                value=numpy_helper.from_array(np.asarray(value)))

    def only_reader(self, name) -> bool:
        return len(self.readers.get(name, [])) == 1 and name not in self.outputs

    def bypass(self, node, source: str) -> bool:
        """Every reader of ``node``'s output reads ``source`` instead; the node goes. A graph output keeps
        its name: ``source`` is renamed to it where ``source`` is a node's output nothing else needs as
        named. False (nothing changed) otherwise."""
        out = node.output[0]
        if source in self.keep:
            return False
        if out in self.outputs or out in self.keep:
            if source in self.outputs or source in self.inputs or source not in self.producer \
                    or source in self.values:
                return False
            self._rename(source, out)
        else:
            self._rename(out, source)
        self.nodes.remove(node)
        return True

    def _rename(self, old: str, new: str):
        for n in self.nodes:        # `in` on a repeated field runs in C: only the nodes that name it are walked
            if old in n.input:
                for k, i in enumerate(n.input):
                    if i == old:
                        n.input[k] = new
            if old in n.output:
                for k, o in enumerate(n.output):
                    if o == old:
                        n.output[k] = new


def _fold(g: _Graph) -> int:
    """Nodes whose outputs are constants replaced by Constant nodes."""
    changed = 0
    for k, n in enumerate(list(g.nodes)):
        if n.domain not in ("", "ai.onnx") or n.op_type in RANDOM or n.op_type == "Constant" or len(n.output) != 1:
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            continue
        value = None
        if n.op_type in ("Shape", "Size") and g.static(n.input[0]) is not None:
            dims = g.static(n.input[0])
            if n.op_type == "Size":
                value = np.array(int(np.prod(dims, dtype=np.int64)), np.int64)
            else:
                a = _attrs(n)
                value = np.array(dims[slice(a.get("start", 0), a.get("end"))], np.int64)
        elif n.op_type == "CastLike" and n.input[0] in g.values and g.types.get(n.input[1]) \
                and g.values[n.input[0]].size <= MAX_FOLD:
            value = g.values[n.input[0]].astype(helper.tensor_dtype_to_np_dtype(g.types[n.input[1]]))
        elif all(i in g.values for i in n.input if i) and n.input:
            out_type = g.types.get(n.output[0])
            if n.op_type not in EXACT_FLOAT and out_type not in INTS:
                continue
            dims = g.static(n.output[0])
            if dims is not None and int(np.prod(dims, dtype=np.int64)) > MAX_FOLD:
                continue
            value = _evaluate(n, [g.values[i] if i else None for i in n.input], g.opset)
            if value is None or value.size > MAX_FOLD:
                continue
        if value is None or not _agrees(g, n, value):
            continue
        c = g.constant(value, n.output[0])
        c.output[0] = n.output[0]
        g.nodes[g.nodes.index(n)] = c
        g.values[n.output[0]] = value
        changed += 1
    return changed


def _agrees(g: _Graph, node, value: np.ndarray) -> bool:
    """Whether a folded ``value`` has the element type (a Cast's ``to``) and the dims onnx's shape inference
    gives ``node``'s output, where it gives them: a value that disagrees (e.g. a cast to a type NumPy has no
    dtype of, which onnx 1.17 maps to float32) is left to the runtime to compute."""
    out = node.output[0]
    want = _attrs(node)["to"] if node.op_type == "Cast" else g.types.get(out)
    try:
        got = helper.np_dtype_to_tensor_dtype(value.dtype)
    except (KeyError, TypeError, ValueError):
        return False
    dims = g.dims.get(out)
    return (want is None or got == want) and (dims is None or (
        len(dims) == value.ndim and all(d is None or d == v for d, v in zip(dims, value.shape))))


def _axes(node, values, opset: int, since: int):
    """An op's axes: its ``axes`` input from opset ``since`` on, its attribute before."""
    if opset >= since:
        return None if len(values) < 2 or values[1] is None else [int(a) for a in values[1].reshape(-1)]
    return _attrs(node).get("axes")


def _slice(x, starts, ends, axes, steps):
    index = [slice(None)] * x.ndim
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[int(a)] = slice(int(s), int(e), int(st))
    return x[tuple(index)]


def _int_div(a, b):
    """ONNX's integer Div: the quotient truncated toward zero (C's, onnxruntime's), not NumPy's floor."""
    if np.any(b == 0):
        raise ZeroDivisionError("an integer Div by 0: left to the runtime")
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))


def _flatten(x, axis: int):
    """ONNX's Flatten: [d_0 * ... * d_(axis-1), the rest]; ``axis`` in [-rank, rank] (rank itself: [all, 1])."""
    axis = axis + x.ndim if axis < 0 else axis
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def _reduce(fn, node, values, axes):
    """ReduceSum/ReduceProd: no axes (none given, or an empty list) reduce every axis, or with
    noop_with_empty_axes none (NumPy's ``axis=()`` reduces none)."""
    a = _attrs(node)
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return values[0]
        axes = None
    return fn(values[0], axis=None if axes is None else tuple(axes), keepdims=bool(a.get("keepdims", 1)))


def _reshape(x, shape, allowzero: int):
    shape = [int(d) for d in shape]
    if not allowzero:
        shape = [x.shape[k] if d == 0 else d for k, d in enumerate(shape)]
    return x.reshape(shape)


# the ops the fold meets (shape arithmetic; float data-movement ops): NumPy, exact for these dtypes
_NUMPY = {
    "Add": lambda n, v, o: v[0] + v[1], "Sub": lambda n, v, o: v[0] - v[1],
    "Mul": lambda n, v, o: v[0] * v[1],
    "Div": lambda n, v, o: _int_div(v[0], v[1]) if v[0].dtype.kind in "iu" else v[0] / v[1],
    "Mod": lambda n, v, o: np.fmod(v[0], v[1]) if _attrs(n).get("fmod") else np.mod(v[0], v[1]),
    "Neg": lambda n, v, o: -v[0], "Abs": lambda n, v, o: np.abs(v[0]),
    "Min": lambda n, v, o: np.minimum.reduce(v), "Max": lambda n, v, o: np.maximum.reduce(v),
    "Equal": lambda n, v, o: np.equal(v[0], v[1]), "Less": lambda n, v, o: np.less(v[0], v[1]),
    "Greater": lambda n, v, o: np.greater(v[0], v[1]), "Not": lambda n, v, o: np.logical_not(v[0]),
    "And": lambda n, v, o: np.logical_and(v[0], v[1]), "Or": lambda n, v, o: np.logical_or(v[0], v[1]),
    "Where": lambda n, v, o: np.where(v[0], v[1], v[2]),
    "Identity": lambda n, v, o: v[0],
    "Cast": lambda n, v, o: v[0].astype(helper.tensor_dtype_to_np_dtype(_attrs(n)["to"])),
    "Concat": lambda n, v, o: np.concatenate(v, axis=_attrs(n)["axis"]),
    "Reshape": lambda n, v, o: _reshape(v[0], v[1], _attrs(n).get("allowzero", 0)),
    "Flatten": lambda n, v, o: _flatten(v[0], _attrs(n).get("axis", 1)),
    "Unsqueeze": lambda n, v, o: np.expand_dims(v[0], tuple(
        int(a) % (v[0].ndim + len(_axes(n, v, o, 13))) for a in _axes(n, v, o, 13))),
    "Squeeze": lambda n, v, o: np.squeeze(v[0], None if _axes(n, v, o, 13) is None else tuple(_axes(n, v, o, 13))),
    "Transpose": lambda n, v, o: np.transpose(v[0], _attrs(n).get("perm")),
    "Gather": lambda n, v, o: np.take(v[0], v[1], axis=_attrs(n).get("axis", 0)),
    "Slice": lambda n, v, o: _slice(v[0], v[1], v[2], None if len(v) < 4 or v[3] is None else v[3],
                                    None if len(v) < 5 or v[4] is None else v[4]) if o >= 10 else
    _slice(v[0], _attrs(n)["starts"], _attrs(n)["ends"], _attrs(n).get("axes"), None),
    "Range": lambda n, v, o: np.arange(v[0].reshape(()), v[1].reshape(()), v[2].reshape(()), dtype=v[0].dtype),
    "NonZero": lambda n, v, o: np.array(np.nonzero(v[0]), np.int64).reshape(v[0].ndim, -1),
    "ConstantOfShape": lambda n, v, o: np.full([int(d) for d in v[0]], *(
        (numpy_helper.to_array(_attrs(n)["value"]).reshape(()),) if "value" in _attrs(n) else (0.0,)),
        dtype=numpy_helper.to_array(_attrs(n)["value"]).dtype if "value" in _attrs(n) else np.float32),
    "Expand": lambda n, v, o: v[0] * np.ones([int(d) for d in v[1]], v[0].dtype),
    "ReduceProd": lambda n, v, o: _reduce(np.prod, n, v, _axes(n, v, o, 18)),
    "ReduceSum": lambda n, v, o: _reduce(np.sum, n, v, _axes(n, v, o, 13)),
}


def _evaluate(node, values, opset: int):
    """The value of ``node`` on constant ``values`` (NumPy, :data:`_NUMPY`'s ops; None for another op, or a
    form not read here: left as it is)."""
    fn = _NUMPY.get(node.op_type)
    if fn is None:
        return None
    try:
        with np.errstate(all="ignore"):
            return np.asarray(fn(node, values, opset))
    except Exception:  # noqa: BLE001 - a form not read here: left as it is
        return None


def _scalar(g: _Graph, name: str):
    """The value of a one-element constant ``name`` (None if it is not one)."""
    v = g.values.get(name)
    return float(v.reshape(())) if v is not None and v.size == 1 and v.dtype.kind == "f" else None


def _keeps_shape(g: _Graph, const: str, other: str) -> bool:
    """Whether broadcasting the one-element ``const`` against ``other`` keeps ``other``'s shape."""
    d = g.dims.get(other)
    return d is not None and len(g.values[const].shape) <= len(d)


def _noops(g: _Graph) -> int:
    changed = 0
    for n in list(g.nodes):
        if n.domain not in ("", "ai.onnx") or not n.input or len(n.output) != 1:
            continue
        x, op, source = n.input[0], n.op_type, None
        if op == "Identity":
            source = x
        elif op == "Cast" and g.types.get(x) == _attrs(n).get("to"):
            source = x
        elif op == "CastLike" and g.types.get(x) and g.types.get(x) == g.types.get(n.input[1]):
            source = x
        elif op in ("Reshape", "Expand") and g.static(x) is not None and g.static(x) == g.static(n.output[0]):
            source = x
        elif op == "Reshape" and _same_dims(g, x, g.producer.get(n.input[1])):
            source = x
        elif op in ("ReduceSum", "ReduceMean") and _attrs(n).get("noop_with_empty_axes", 0) and len(n.input) > 1 \
                and n.input[1] in g.values and g.values[n.input[1]].size == 0:
            source = x
        elif op == "Transpose" and _attrs(n).get("perm") is not None \
                and list(_attrs(n)["perm"]) == list(range(len(_attrs(n)["perm"]))):
            source = x
        elif op in ("Mul", "Div") and len(n.input) == 2:
            for k in ((0, 1) if op == "Mul" else (1,)):
                if _scalar(g, n.input[k]) == 1.0 and _keeps_shape(g, n.input[k], n.input[1 - k]):
                    source = n.input[1 - k]
                    break
        if source is not None and g.bypass(n, source):
            changed += 1
    return changed


def _same_dims(g: _Graph, x: str, shape) -> bool:
    """Whether ``shape`` is a node Shape(t) of a ``t`` whose every dim (a number or a symbol) is ``x``'s."""
    if shape is None or shape.op_type != "Shape" or shape.attribute or shape.domain not in ("", "ai.onnx"):
        return False
    a, b = g.syms.get(x), g.syms.get(shape.input[0])
    return a is not None and a == b and None not in a


def _made(g: _Graph, name: str, op: str):
    n = g.producer.get(name)
    return n if n is not None and n.op_type == op and n.domain in ("", "ai.onnx") and n in g.nodes else None


def _broadcast_sums(g: _Graph) -> int:
    """The axes of a broadcast gradient's sum the builder finds at run time where a dim is symbolic
    (``autodiff.core.Emitter.sum_to``: ReduceSum over NonZero(Equal(Concat(ones, Shape(target)), 1))), made
    constant from the dims of the gradient and the target: the leading axes, those where the target's dim
    is 1 and the gradient's is not; a symbolic dim of the target is the gradient's same symbol (then its size
    does not matter: summing over it or not gives the same) or the rewrite is not made."""
    changed = 0
    for n in list(g.nodes):
        if n.op_type != "ReduceSum" or len(n.input) < 2 or n.input[1] in g.values:
            continue
        r = _made(g, n.input[1], "Reshape")
        nz = r and _made(g, r.input[0], "NonZero")
        eq = nz and _made(g, nz.input[0], "Equal")
        if not eq or not any(v is not None and v.size == 1 and v.reshape(-1)[0] == 1
                             for v in (g.values.get(i) for i in eq.input)):
            continue
        cat = next((_made(g, i, "Concat") for i in eq.input if _made(g, i, "Concat")), None)
        if cat is None or len(cat.input) != 2 or cat.input[0] not in g.values:
            continue
        sh = _made(g, cat.input[1], "Shape")
        gd, td = g.syms.get(n.input[0]), sh and g.syms.get(sh.input[0])
        if sh is None or sh.attribute or gd is None or td is None or len(gd) < len(td) \
                or g.values[cat.input[0]].size != len(gd) - len(td):
            continue
        lead = len(gd) - len(td)
        axes = list(range(lead))
        for k, t in enumerate(td):
            d = gd[lead + k]
            if t == 1 and d != 1:
                axes.append(lead + k)
            elif not (isinstance(t, int) and t != 1) and not (t is not None and t == d):
                axes = None
                break
        if axes is None:
            continue
        c = g.constant(np.array(axes, np.int64), n.output[0] + "/axes")
        g.nodes.insert(g.nodes.index(n), c)
        n.input[1] = c.output[0]
        changed += 1
    return changed


def _reduced_axes(g: _Graph, n):
    """A reduction node's axes: its constant ``axes`` input, or its attribute (None: unknown or not given)."""
    a = _attrs(n)
    if len(n.input) > 1 and n.input[1]:
        v = g.values.get(n.input[1])
        return None if v is None else [int(i) for i in v.reshape(-1)]
    return None if a.get("axes") is None else list(a["axes"])


def _reshapes(g: _Graph) -> int:
    """A Reshape of a Reshape reads the first one's input; a reduction keeping its dims and a Reshape
    dropping exactly them are one reduction without keepdims."""
    changed = 0
    for n in list(g.nodes):
        if n.op_type != "Reshape" or n.domain not in ("", "ai.onnx"):
            continue
        p = g.producer.get(n.input[0])
        if p is None or p not in g.nodes or p.domain not in ("", "ai.onnx"):
            continue
        out = g.static(n.output[0])
        if p.op_type == "Reshape" and out is not None:
            shape = g.constant(np.array(out, np.int64), n.output[0])
            g.nodes.insert(g.nodes.index(n), shape)
            n.input[0], n.input[1] = p.input[0], shape.output[0]
            changed += 1
        elif p.op_type in ("ReduceSum", "ReduceMean") and _attrs(p).get("keepdims", 1) == 1 \
                and g.only_reader(p.output[0]) and p.output[0] not in g.keep:
            axes, kept = _reduced_axes(g, p), g.static(p.output[0])
            if not axes or kept is None or out is None:
                continue
            axes = {a % len(kept) for a in axes}
            if [d for k, d in enumerate(kept) if k not in axes] != out:
                continue
            for a in list(p.attribute):
                if a.name == "keepdims":
                    p.attribute.remove(a)
            p.attribute.append(helper.make_attribute("keepdims", 0))
            p.output[0] = n.output[0]
            g.nodes.remove(n)
            changed += 1
    return changed


def _transposes(g: _Graph) -> int:
    """A Transpose of a Transpose as one, or none where they cancel."""
    changed = 0
    for n in list(g.nodes):
        p = g.producer.get(n.input[0]) if n.op_type == "Transpose" and n.input else None
        if p is None or p.op_type != "Transpose" or p not in g.nodes or n not in g.nodes:
            continue
        outer, inner = _attrs(n).get("perm"), _attrs(p).get("perm")
        if outer is None or inner is None:
            continue
        perm = [int(inner[k]) for k in outer]
        if perm == list(range(len(perm))):
            if g.bypass(n, p.input[0]):
                changed += 1
            continue
        n.input[0] = p.input[0]
        del n.attribute[:]
        n.attribute.append(helper.make_attribute("perm", perm))
        changed += 1
    return changed


def _dead(g: _Graph) -> int:
    """Nodes none of whose outputs anything reads."""
    needed = set(g.outputs) | g.keep
    kept = []
    for n in reversed(g.nodes):
        if any(o in needed for o in n.output if o):
            kept.append(n)
            needed.update(i for i in n.input if i)
    removed = len(g.nodes) - len(kept)
    g.nodes[:] = kept[::-1]
    return removed


def _swap(perm) -> bool:
    """Whether ``perm`` swaps the last two axes and keeps the others."""
    r = len(perm)
    return r >= 2 and list(perm) == list(range(r - 2)) + [r - 1, r - 2]


def _fused(g: _Graph, n, inputs, **changes) -> onnx.NodeProto:
    """``n`` (MatMul or FusedMatMul) as a FusedMatMul of ``inputs`` with ``changes`` to its attributes."""
    a = {"alpha": 1.0, "transA": 0, "transB": 0, **(_attrs(n) if n.op_type == "FusedMatMul" else {}), **changes}
    return helper.make_node("FusedMatMul", list(inputs), list(n.output), name=n.name or g.name("FusedMatMul"),
                            domain=MS, **a)


def _products(g: _Graph) -> int:
    """Transposes of a product's operands read by the product; a scalar Mul of its result its alpha."""
    changed = 0
    for n in list(g.nodes):
        if n not in g.nodes:
            continue
        if n.op_type == "Mul" and n.domain in ("", "ai.onnx") and len(n.input) == 2:
            for k in (0, 1):
                c, p = _scalar(g, n.input[k]), g.producer.get(n.input[1 - k])
                if c is None or p is None or p not in g.nodes or not _product(g, p) \
                        or not g.only_reader(p.output[0]) or p.output[0] in g.keep \
                        or not _keeps_shape(g, n.input[k], p.output[0]):
                    continue
                alpha = (_attrs(p).get("alpha", 1.0) if p.op_type == "FusedMatMul" else 1.0) * c
                fused = _fused(g, p, p.input, alpha=float(np.float32(alpha)))
                fused.output[0] = n.output[0]
                g.nodes[g.nodes.index(p)] = fused
                g.nodes.remove(n)
                g.producer[n.output[0]] = fused
                changed += 1
                break
            else:
                changed += _scaled_operand(g, n)
            continue
        if n.op_type == "Transpose" and n.domain in ("", "ai.onnx"):
            changed += _transposed_product(g, n)
            continue
        if not _product(g, n) and not (n.op_type == "Gemm" and n.domain in ("", "ai.onnx")):
            continue
        ins, flips = list(n.input), {}
        for k, flag in ((0, "transA"), (1, "transB")):
            p = g.producer.get(ins[k])
            perm = _attrs(p).get("perm") if p is not None and p.op_type == "Transpose" else None
            if perm is None or not _swap(perm) or (n.op_type == "Gemm" and len(perm) != 2):
                continue
            if n.op_type == "MatMul" and len(g.dims.get(n.input[1 - k]) or []) < 2:
                continue
            ins[k] = p.input[0]
            flips[flag] = 1 - (_attrs(n).get(flag, 0))
        if not flips:
            continue
        if n.op_type == "Gemm":
            new = helper.make_node("Gemm", ins, list(n.output), name=n.name, **{**_attrs(n), **flips})
        else:
            new = _fused(g, n, ins, **flips)
        g.nodes[g.nodes.index(n)] = new
        g.producer[n.output[0]] = new
        changed += 1
    return changed


def _scaled_operand(g: _Graph, mul) -> int:
    """A Mul of a tensor by a scalar constant read only by products, as their operand: each product reads
    the tensor and scales its sum by the scalar (``alpha``), the Mul goes (attention's backward: dS times
    the forward's 1/sqrt(head) read by dQ's and dK's products). 1 if so, else 0."""
    out = mul.output[0]
    if out in g.outputs or out in g.keep:
        return 0
    for k in (0, 1):
        c, x = _scalar(g, mul.input[k]), mul.input[1 - k]
        if c is None or not _keeps_shape(g, mul.input[k], x) or g.types.get(x) != TensorProto.FLOAT:
            continue
        readers = [n for n in g.nodes if out in n.input]
        if not readers or not all(_product(g, n) and list(n.input[:2]).count(out) == 1 for n in readers):
            return 0
        for n in readers:
            alpha = (_attrs(n).get("alpha", 1.0) if n.op_type == "FusedMatMul" else 1.0) * c
            fused = _fused(g, n, [x if i == out else i for i in n.input], alpha=float(np.float32(alpha)))
            g.nodes[g.nodes.index(n)] = fused
            g.producer[n.output[0]] = fused
        g.nodes.remove(mul)
        return 1
    return 0


def _transposed_product(g: _Graph, t) -> int:
    """A Transpose of the last two axes of a product's result (its only reader) as the product of the
    swapped operands, each read transposed the other way: (A B)^T = B^T A^T (attention's dK = (Q^T dS)^T
    as dS^T Q), where that reads no operand transposed that the product did not (a plain MatMul's result
    stays transposed: a tied head's weight gradient, which strides.py pads). 1 if so, else 0."""
    p = g.producer.get(t.input[0])
    perm = _attrs(t).get("perm")
    if p is None or p not in g.nodes or perm is None or not _swap(perm) or not _product(g, p) \
            or not g.only_reader(p.output[0]) or p.output[0] in g.keep \
            or len({len(g.dims[i]) for i in p.input[:2]} | {len(perm)}) != 1:
        return 0
    a = _attrs(p) if p.op_type == "FusedMatMul" else {}
    if not a.get("transA", 0) and not a.get("transB", 0):
        return 0            # B^T A^T would read its left operand transposed: slower in MLAS, and never padded
    new = _fused(g, p, [p.input[1], p.input[0]], transA=1 - a.get("transB", 0), transB=1 - a.get("transA", 0))
    new.output[0] = t.output[0]
    g.nodes[g.nodes.index(p)] = new
    g.nodes.remove(t)
    g.producer[t.output[0]] = new
    return 1


def _product(g: _Graph, n) -> bool:
    """A float32 MatMul or FusedMatMul (no batch transposes) of operands of rank 2 or more."""
    if n.op_type == "MatMul" and n.domain in ("", "ai.onnx"):
        ok = True
    elif n.op_type == "FusedMatMul" and n.domain == MS:
        a = _attrs(n)
        ok = not a.get("transBatchA", 0) and not a.get("transBatchB", 0)
    else:
        return False
    return ok and g.types.get(n.output[0]) == TensorProto.FLOAT \
        and all(len(g.dims.get(i) or []) >= 2 for i in n.input[:2])


def _flat_gradients(g: _Graph) -> int:
    """Gradient outputs made by a Reshape of a tensor of as many elements (its dims known, read by nothing
    else): that tensor is the output, its dims the output's declared ones."""
    changed = 0
    declared_outputs = {o.name: o for o in g.model.graph.output}
    for n in list(g.nodes):
        out = n.output[0] if n.op_type == "Reshape" and n.domain in ("", "ai.onnx") else ""
        if not out.endswith(GRAD_SUFFIX) or out not in g.outputs or out in g.keep:
            continue
        src, dims, want = n.input[0], g.static(n.input[0]), g.static(out)
        if dims is None or want is None or int(np.prod(dims)) != int(np.prod(want)) or not g.only_reader(src) \
                or src in g.inputs or src in g.values or src in g.keep or src not in g.producer:
            continue
        g.nodes.remove(n)
        g._rename(src, out)
        shape = declared_outputs[out].type.tensor_type.shape
        del shape.dim[:]
        for d in dims:
            shape.dim.add().dim_value = d
        changed += 1
    return changed


def _shared_constants(g: _Graph) -> int:
    """Constants of equal type, shape and value as one."""
    first, changed = {}, 0
    for n in list(g.nodes):
        if n.op_type != "Constant" or n.output[0] not in g.values or n.output[0] in g.outputs | g.keep:
            continue
        v = g.values[n.output[0]]
        if v.size > MAX_FOLD:
            continue
        key = (v.dtype.str, v.shape, v.tobytes())
        if key in first:
            g._rename(n.output[0], first[key])
            g.nodes.remove(n)
            changed += 1
        else:
            first[key] = n.output[0]
    return changed


def fuse(model: onnx.ModelProto, keep=()) -> onnx.ModelProto:
    """``model`` (a train graph of trainrun's own builder) with fewer nodes, the same outputs; the
    tensors ``keep`` (e.g. ``debug.tensors``) stay under their names. A new model; ``model`` is not
    changed."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    value_info = list(model.graph.value_info)
    g = _Graph(out)
    g.keep = set(keep)
    for _ in range(32):
        if not (_fold(g) + _broadcast_sums(g) + _noops(g) + _reshapes(g) + _transposes(g) + _dead(g)):
            break
        g.infer()
    if _flat_gradients(g):
        g.infer()
    while _products(g):
        pass
    _dead(g)
    _shared_constants(g)
    del out.graph.node[:]
    out.graph.node.extend(g.nodes)
    read = {i for n in g.nodes for i in n.input} | g.outputs
    kept = [t for t in out.graph.initializer if t.name in read or t.name in g.inputs]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    names = {o for n in g.nodes for o in n.output}
    del out.graph.value_info[:]
    out.graph.value_info.extend(v for v in value_info if v.name in names)
    declared = {v.name for v in out.graph.value_info} | g.outputs
    for n in g.nodes:       # onnx infers no FusedMatMul: its result's type and dims, for the passes after
        for o in n.output:
            if n.domain == MS and o not in declared and g.types.get(o):
                out.graph.value_info.append(helper.make_tensor_value_info(o, g.types[o], g.syms.get(o)))
    if any(n.domain == MS for n in g.nodes) and not any(o.domain == MS for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS, 1))
    return out
