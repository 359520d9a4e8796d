"""Reverse mode over an ONNX graph, in standard ONNX ops only.

:func:`differentiate` walks the graph backwards from a scalar loss (in dependency order, not stored
order), seeds d loss / d loss = 1, asks each node's rule (registered with :func:`gradient`) for the
gradients of its inputs, sums the contributions to a tensor read by several nodes, skips every branch
that does not lead from a parameter to the loss, and outputs ``<param>_grad`` for each parameter. A rule
gets a :class:`Step` (the node, the gradients of its outputs, which inputs want one, and the emitter of
new nodes) and returns one gradient (or None) per input. The package's face imports every module of
rules."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from ...errors import UsageError
from ..onnx_edit import declared, names_in, node_reads, subgraphs, topological, unique_name
from ..names import GRAD_SUFFIX
from . import static
from .branches import inline_known_ifs, unknown_condition

RULES: dict[str, Callable] = {}
# finders of subgraphs differentiated as one (``find(nodes, consumers, emit)`` -> [(the subgraph's last
# node, its other nodes, rule)]): the rule gets the last node's Step and returns {input: gradient} for the
# tensors the subgraph reads; its other nodes then get no gradient of their own
PATTERNS: list[Callable] = []
# ops written out in other ops before the walk (``expand(step)`` emits nodes that compute the node's
# outputs, under their names), so that those ops' rules differentiate them: LSTM, GRU, RNN
EXPANSIONS: dict[str, Callable] = {}

# float types a constant is written in directly (bfloat16 has no NumPy type)
FLOATS = {onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE}

# the opset the rules write (ScatterND and ScatterElements with reduction add, CastLike, Shape's start and
# end): an older graph is converted to it first
MIN_OPSET = 16

# ops whose outputs carry no gradient (integers, booleans, or piecewise constant in their float inputs):
# the walk stops there as at a constant
NO_GRADIENT = {"Shape", "Size", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "And", "Or",
               "Xor", "ArgMax", "ArgMin", "NonZero", "IsNaN", "IsInf", "Sign", "Floor", "Ceil", "Round",
               "ConstantOfShape", "OneHot", "EyeLike", "RandomNormalLike", "RandomUniformLike", "Bernoulli"}
FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


class NoGradient(UsageError):
    """An op the builder has no gradient rule for (or a case of it the rule does not cover)."""


def gradient(op_type: str):
    """Register ``rule(step) -> [gradient or None per input]`` as the gradient of ``op_type``."""
    def register(rule):
        RULES[op_type] = rule
        return rule
    return register


class Emitter:
    """Appends nodes with unique, readable names; knows the static dims and constant values of the
    forward graph's tensors."""

    def __init__(self, model: onnx.ModelProto, ordered: list[onnx.NodeProto]):
        self.nodes: list[onnx.NodeProto] = []
        g = model.graph
        self.taken = {n for node in g.node for n in list(node.input) + list(node.output)}
        self.taken |= {t.name for t in list(g.input) + list(g.initializer) + list(g.output)}
        self.taken |= {node.name for node in g.node}
        for sub in (sub for node in g.node for sub in subgraphs(node)):     # a name no subgraph shadows
            self.taken |= names_in(sub)
        self.dims, self.types = {}, {}
        # gradients that are a dy padded with zeros along one axis (a Slice's): name -> (dy, axis, start,
        # stop, the axis's size)
        self.pieces: dict[str, tuple] = {}
        self.graph_outputs = {o.name for o in g.output}
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        self.producer = {o: node for node in ordered for o in node.output if o}
        sorted_model = onnx.ModelProto()
        sorted_model.CopyFrom(model)
        del sorted_model.graph.node[:]
        sorted_model.graph.node.extend(ordered)
        inferred = static.infer(sorted_model)
        types, dims, self.syms = declared(inferred)
        self.types.update(types)
        self.dims.update(dims)
        for t in g.initializer:
            self.dims[t.name] = self.syms[t.name] = list(t.dims)
            self.types[t.name] = t.data_type
        self.values = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        # the graph's Constants, and the integer tensors static.infer folded (shapes and bounds computed from
        # dims fixed when the graph is built)
        for node in list(g.node) + list(inferred.graph.node):
            if node.op_type == "Constant" and node.attribute[0].name == "value":
                self.values.setdefault(node.output[0], numpy_helper.to_array(node.attribute[0].t))

    def name(self, base: str) -> str:
        return unique_name(base, self.taken)

    def op(self, op_type: str, inputs, base: str, outputs: int = 1, **attrs):
        """Emit one node; its output name (a list when ``outputs`` > 1). A Transpose that keeps the axis
        order is no node: onnxruntime 1.19's GemmTransposeFusion (basic level) folds a Transpose after a Gemm
        into the Gemm whatever its perm, so an identity one would transpose the Gemm's result (1.30 does
        not)."""
        if op_type == "Transpose" and list(attrs.get("perm", [None])) == list(range(len(attrs.get("perm", [])))):
            return inputs[0]
        outs = [self.name(base if outputs == 1 else f"{base}.{k}") for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name(f"{base}/{op_type}"),
                                           **attrs))
        self.producer.update((o, self.nodes[-1]) for o in outs)
        return outs[0] if outputs == 1 else outs

    def reduce(self, op_type: str, x: str, axes: list[int], base: str, keepdims: int = 1) -> str:
        """A Reduce* over the static ``axes`` (an input from opset 18, ReduceSum's from 13; an attribute before)."""
        if self.opset >= (13 if op_type == "ReduceSum" else 18):
            return self.op(op_type, [x, self.const(list(axes), base)], base, keepdims=keepdims)
        return self.op(op_type, [x], base, axes=list(axes), keepdims=keepdims)

    def output(self, node: onnx.NodeProto, k: int) -> str:
        """Output ``k`` of the forward ``node``, which is given that optional output (computed by the same
        kernel, e.g. LayerNormalization's Mean and InvStdDev) where it leaves it out."""
        while len(node.output) <= k:
            node.output.append("")
        if not node.output[k]:
            node.output[k] = self.name(f"{node.output[0]}/output_{k}")
            self.producer[node.output[k]] = node
        return node.output[k]

    def elem_type(self, name: str, default: str) -> int:
        """The element type of ``name`` (that of ``default`` when not known)."""
        return self.types.get(name) or self.types.get(default, 0)

    def like(self, name: str, ref: str, base: str) -> str:
        """``name`` cast to ``ref``'s element type, where the two differ (or are not known)."""
        a, b = self.types.get(name), self.types.get(ref)
        return name if a and a == b else self.op("CastLike", [name, ref], f"{base}/cast")

    def const(self, value, base: str, like: str | None = None) -> str:
        """A constant: int64, or a float of tensor ``like``'s type (written in that type where it is known
        when the graph is built: a constant onnxruntime folds, not a CastLike run every step)."""
        arr = np.array(value, np.int64 if like is None else np.float64)
        typed = like is not None and self.types.get(like) in FLOATS
        if typed:
            arr = arr.astype(helper.tensor_dtype_to_np_dtype(self.types[like]))
        name = self.op("Constant", [], f"{base}/const", value=numpy_helper.from_array(arr))
        return name if like is None or typed else self.op("CastLike", [name, like], f"{base}/const")

    def static(self, name: str):
        """Fully known dims of ``name``, else None."""
        dims = self.dims.get(name)
        return dims if dims is not None and None not in dims else None

    def rank(self, name: str, node: onnx.NodeProto) -> int:
        if self.dims.get(name) is None:
            raise NoGradient(f"the rank of '{name}' (read by {node.op_type} node '{node.name}') is unknown")
        return len(self.dims[name])

    def zeros_like(self, x: str, base: str) -> str:
        shape = self.op("Shape", [x], f"{base}/shape")
        return self.op("CastLike", [self.op("ConstantOfShape", [shape], f"{base}/zeros"), x], f"{base}/zeros")

    def add_all(self, terms: list, base: str) -> str:
        """The sum of a tensor's gradient contributions: names of dense tensors, and :class:`Rows` (rows
        of a table), scattered with ScatterElements(add) into the dense sum (or into zeros) rather than
        each written out as a dense table."""
        dense = self._tiled([t for t in terms if isinstance(t, str)], base)
        total = None if not dense else dense[0] if len(dense) == 1 else self.op("Sum", dense, base)
        for r in (t for t in terms if isinstance(t, Rows)):
            total = r.scatter_into(self, total, base)
        return total

    def _tiled(self, dense: list, base: str) -> list:
        """``dense``, or, where its terms are :attr:`pieces` along one axis that tile it (the chunks of a
        split written as Slices), their dys concatenated: one pass, not a Pad of zeros per piece and a Sum."""
        pieces = sorted((self.pieces[t] for t in dense if t in self.pieces), key=lambda p: p[2])
        if len(dense) < 2 or len(pieces) < len(dense) or len({p[1] for p in pieces}) != 1 or pieces[0][2] != 0 \
                or pieces[-1][3] != pieces[-1][4] or any(a[3] != b[2] for a, b in zip(pieces, pieces[1:])):
            return dense
        for t in dense:
            self.nodes.remove(self.producer[t])
        return [self.op("Concat", [p[0] for p in pieces], base, axis=pieces[0][1])]

    def sum_to(self, grad: str, target: str, base: str, grad_dims=None, grad_syms=None) -> str:
        """``grad`` (of a broadcast result, dims ``grad_dims`` if known, dims or their symbols ``grad_syms``)
        summed over the axes ``target`` was broadcast along, so it has ``target``'s shape. Static axes where
        both shapes are known; ``grad`` itself where every dim of both is known or named and they agree (a
        symbolic sequence length: no broadcast); else the axes found at run time from the two Shapes."""
        tdims = self.static(target)
        if grad_syms is not None and None not in grad_syms and self.syms.get(target) == list(grad_syms):
            return grad
        if tdims is not None and grad_dims is not None and None not in grad_dims:
            if list(grad_dims) == tdims:
                return grad
            lead = len(grad_dims) - len(tdims)
            axes = list(range(lead)) + [lead + i for i, d in enumerate(tdims) if d == 1 and grad_dims[lead + i] != 1]
            summed = self.op("ReduceSum", [grad, self.const(axes, base)], f"{base}/sum", keepdims=1)
            return self.op("Reshape", [summed, self.const(tdims, base)], base)
        gshape = self.op("Shape", [grad], f"{base}/grad_shape")
        tshape = self.op("Shape", [target], f"{base}/target_shape")
        lead = self.op("Sub", [self.op("Size", [gshape], f"{base}/rank"), self.op("Size", [tshape], f"{base}/rank")],
                       f"{base}/lead")
        ones = self.op("ConstantOfShape", [self.op("Reshape", [lead, self.const([1], base)], f"{base}/lead")],
                       f"{base}/ones", value=numpy_helper.from_array(np.array([1], np.int64)))
        padded = self.op("Concat", [ones, tshape], f"{base}/padded", axis=0)
        where_one = self.op("Equal", [padded, self.const(1, base)], f"{base}/broadcast")
        axes = self.op("Reshape", [self.op("NonZero", [where_one], f"{base}/axes"), self.const([-1], base)],
                       f"{base}/axes")
        summed = self.op("ReduceSum", [grad, axes], f"{base}/sum", keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", [summed, tshape], base)


class Rows:
    """A gradient contribution that is the rows ``updates`` ([..., width]) at rows ``indices`` of a 2-D
    ``table`` (an embedding's lookup), the other rows zero."""

    def __init__(self, table: str, indices: str, updates: str, width: int):
        self.table, self.indices, self.updates, self.width = table, indices, updates, width

    def scatter_into(self, emit: Emitter, total: str | None, base: str) -> str:
        """``total`` + these rows, scattered along axis 0 (rows of the table and of dy contiguous: a third
        faster in onnxruntime's ScatterElements than the columns of a transposed table). On the CPU
        ScatterElements adds serially, so repeated indices are summed in the same order every run (ScatterND's
        add runs the rows in parallel threads: lost sums where a row repeats)."""
        rows = emit.op("Reshape", [self.updates, emit.const([-1, self.width], base)], f"{base}/rows")
        if total is None:
            total = emit.zeros_like(self.table, base)
        where = emit.op("Expand", [emit.op("Reshape", [self.indices, emit.const([-1, 1], base)], f"{base}/ids"),
                                   emit.op("Shape", [rows], f"{base}/rows_shape")], f"{base}/where")
        return emit.op("ScatterElements", [total, where, rows], base, axis=0, reduction="add")


class Step:
    """One node being differentiated: what a rule reads and the emitter it writes with."""

    def __init__(self, emit: Emitter, node: onnx.NodeProto, dy: list, wants: set[int]):
        self.emit, self.node, self.dy, self.wants_set = emit, node, dy, wants
        self.x, self.y = list(node.input), list(node.output)
        self.base = f"grad/{node.name or node.op_type}"
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def wants(self, i: int) -> bool:
        return i in self.wants_set

    def attr(self, name: str, default=None):
        return self.attrs.get(name, default)

    def op(self, op_type: str, inputs, outputs: int = 1, **attrs):
        return self.emit.op(op_type, inputs, self.base, outputs, **attrs)

    def const(self, value, like: str | None = None) -> str:
        return self.emit.const(value, self.base, like)

    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int = 1) -> str:
        return self.emit.reduce(op_type, x, axes, self.base, keepdims)

    def sum_to(self, grad: str, i: int, grad_dims=None, grad_syms=None) -> str:
        """``grad``, of output 0's shape unless ``grad_dims`` (static) or ``grad_syms`` (dims or symbols) say
        otherwise, reduced to input ``i``'s."""
        if grad_dims is None and grad_syms is None:
            grad_dims, grad_syms = self.emit.static(self.y[0]), self.emit.syms.get(self.y[0])
        return self.emit.sum_to(grad, self.x[i], f"{self.base}/{self.x[i]}", grad_dims, grad_syms)

    def value(self, i: int):
        """The constant value of input ``i`` (an initializer or a Constant), else :class:`NoGradient`."""
        if i >= len(self.x) or self.x[i] not in self.emit.values:
            raise self.unsupported(f"input {i} is not a constant")
        return self.emit.values[self.x[i]]

    def unsupported(self, why: str) -> NoGradient:
        return NoGradient(f"no gradient for {self.node.op_type} node '{self.node.name}': {why}")


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _paths(nodes, params: list[str], loss: str, types: dict | None = None):
    """(the tensors that depend on a parameter, the tensors the loss depends on through them, the nodes
    between parameters and the loss in reverse dependency order) of the sorted ``nodes``. Gradients flow
    through float tensors only (``types``: tensor -> elem type, where known) and not out of
    :data:`NO_GRADIENT`'s ops. A node reads what its subgraphs read from outside them too."""
    depends, reads = set(params), {id(n): node_reads(n) for n in nodes}
    for n in nodes:
        if n.op_type not in NO_GRADIENT and any(i in depends for i in reads[id(n)]):
            depends.update(o for o in n.output if o and (types or {}).get(o, onnx.TensorProto.FLOAT) in FLOATS)
    needed, on_path = {loss}, []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            ins = [i for i in reads[id(n)] if i in depends]
            if ins:
                on_path.append(n)
                needed.update(ins)
    return depends, needed, on_path


def _at_least(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """``model`` itself, or converted to opset ``version`` by onnx's version converter when older."""
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), version)
    if current >= version:
        return model
    ordered = _copy(model)
    del ordered.graph.node[:]
    ordered.graph.node.extend(topological(list(model.graph.node)))
    try:
        return version_converter.convert_version(ordered, version)
    except Exception as exc:        # onnx raises plain RuntimeError / ValueError / its C++ errors
        raise NoGradient(f"the graph is opset {current}; trainrun's gradient builder writes opset {version} ops "
                         f"and onnx's version converter could not convert it ({str(exc).splitlines()[0][:200]}): "
                         f"export the model at opset {version} or newer") from None


def blocked_by(model: onnx.ModelProto, params: list[str], loss: str = "loss") -> list[onnx.NodeProto]:
    """The nodes of :data:`NO_GRADIENT`'s ops on the paths from ``params`` to ``loss`` (e.g. a Round of a
    weight): why the loss, which reads ``params``, gets no gradient from them."""
    nodes = topological(list(model.graph.node))
    depends = set(params)
    for n in nodes:
        if any(i in depends for i in node_reads(n)):
            depends.update(o for o in n.output if o)
    needed, found = {loss}, []
    for n in reversed(nodes):
        if any(o in needed for o in n.output) and any(i in depends for i in node_reads(n)):
            needed.update(i for i in node_reads(n) if i in depends)
            if n.op_type in NO_GRADIENT:
                found.append(n)
    return found[::-1]


def unreached(model: onnx.ModelProto, params: list[str], loss: str = "loss") -> list[str]:
    """The parameters ``loss`` does not depend on (their gradient would be zero)."""
    g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    _, needed, _ = _paths(topological(list(g.node)), params, loss, types)
    return [p for p in params if p not in needed]


def _expand(model: onnx.ModelProto, params: list[str], loss: str) -> onnx.ModelProto:
    """``model`` with each node of :data:`EXPANSIONS`' ops between the parameters and the loss written out
    in other ops (in place of the node, in the graph's dependency order)."""
    g = model.graph
    nodes = topological(list(g.node))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    _, _, on_path = _paths(nodes, params, loss, types)
    todo = {id(n) for n in on_path if n.op_type in EXPANSIONS and n.domain in ("", "ai.onnx")}
    if not todo:
        return model
    emit = Emitter(model, nodes)
    written = []
    for n in nodes:
        if id(n) not in todo:
            written.append(n)
            continue
        emit.nodes = []
        step = Step(emit, n, [], set())
        step.base = n.name or n.op_type
        EXPANSIONS[n.op_type](step)
        written.extend(emit.nodes)
    del g.node[:]
    g.node.extend(written)
    return model


def differentiate(model: onnx.ModelProto, params: list[str], loss: str = "loss") -> onnx.ModelProto:
    """``model`` with one more output per parameter, ``<param>_grad`` = d ``loss`` / d ``param`` (zeros
    for a parameter the loss does not depend on, :func:`unreached`). The forward's nodes come first, in
    dependency order, then the gradient's, in the order they run; an If whose condition is known is
    replaced by the branch it takes (:mod:`.branches`), a graph older than :data:`MIN_OPSET` is converted to
    it, :data:`EXPANSIONS`' ops are written out in other ops."""
    model = _expand(_at_least(inline_known_ifs(_copy(model)), MIN_OPSET), params, loss)  # rules may add outputs
    g = model.graph
    nodes = topological(list(g.node))
    emit = Emitter(model, nodes)
    depends, _, on_path = _paths(nodes, params, loss, emit.types)
    consumers: dict[str, list] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    fused = {}
    for find in PATTERNS:
        for last, inner, rule in find(on_path, consumers, emit):
            fused[id(last)] = rule
    emit.taken.update(f"{p}{GRAD_SUFFIX}" for p in params)
    grads: dict[str, list[str]] = {loss: [emit.op("Expand", [emit.const(1.0, "grad/seed", like=loss),
                                                           emit.op("Shape", [loss], "grad/seed/shape")],
                                                  f"{loss}{GRAD_SUFFIX}")]}
    for n in on_path:
        dy = [emit.add_all(grads[o], f"{o}{GRAD_SUFFIX}") if grads.get(o) else None for o in n.output]
        if all(d is None for d in dy):
            continue
        if n.op_type == "If" and n.domain in ("", "ai.onnx"):
            raise NoGradient(unknown_condition(n))
        if n.op_type not in RULES or n.domain not in ("", "ai.onnx"):
            raise NoGradient(f"no gradient rule for op type '{n.op_type}' (node '{n.name}')")
        wants = {k for k, i in enumerate(n.input) if i in depends}
        if id(n) in fused:
            for name, dx in fused[id(n)](Step(emit, n, dy, wants)).items():
                grads.setdefault(name, []).append(dx)
            continue
        for k, dx in enumerate(RULES[n.op_type](Step(emit, n, dy, wants))):
            if dx is not None and k in wants:
                grads.setdefault(n.input[k], []).append(dx)
    outputs = list(g.output)
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in g.input}
    elem.update({t.name: t.data_type for t in g.initializer})
    for p in params:
        total = (emit.add_all(grads[p], f"{p}{GRAD_SUFFIX}/sum") if grads.get(p)
                 else emit.zeros_like(p, f"{p}{GRAD_SUFFIX}"))
        name = f"{p}{GRAD_SUFFIX}"
        emit.nodes.append(helper.make_node("Identity", [total], [name], name=emit.name(f"{name}/Identity")))
        outputs.append(helper.make_tensor_value_info(name, elem[p], emit.dims.get(p)))
    graph = helper.make_graph(nodes + emit.nodes, g.name or "graph", list(g.input), outputs,
                              list(g.initializer), value_info=list(g.value_info))
    out = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="trainrun")
    out.ir_version = model.ir_version
    return out
