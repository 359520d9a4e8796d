"""Small ONNX editing helpers every step of ``prepare`` shares: a new model from parts, parameters as
inputs, constants, the opset, a tensor's dims, what a node reads (its subgraphs' outer-scope names too) and
the nodes in dependency order."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

IR_VERSION = 9


def unique_name(base: str, taken: set) -> str:
    """``base``, or ``base.N`` with the first N that ``taken`` lacks; added to ``taken``."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}.{i}"
    taken.add(name)
    return name


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs of ``node``'s attributes (an If's branches, a Loop's or Scan's body)."""
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def defined(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph`` itself defines: its inputs, initializers and node outputs."""
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    return names | {o for n in graph.node for o in n.output if o}


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph``'s nodes (and their subgraphs') read from the scopes around it."""
    names = set()
    for n in graph.node:
        names.update(i for i in n.input if i)
        for g in subgraphs(n):
            names |= outer_reads(g)
    return (names | {o.name for o in graph.output}) - defined(graph)


def names_in(graph: onnx.GraphProto) -> set[str]:
    """Every value and node name ``graph`` and its subgraphs use."""
    names = defined(graph) | {o.name for o in graph.output}
    for n in graph.node:
        names.update(n.input)
        names.add(n.name)
        for g in subgraphs(n):
            names |= names_in(g)
    return names


def node_reads(node: onnx.NodeProto) -> list[str]:
    """What ``node`` reads: its inputs, then (sorted) the outer-scope names its subgraphs read."""
    inner = set().union(*map(outer_reads, subgraphs(node))) - set(node.input) if node.attribute else set()
    return list(node.input) + sorted(inner)


def topological(nodes) -> list[onnx.NodeProto]:
    """``nodes`` in dependency order (a subgraph's outer-scope reads included), whatever their stored order."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    reads = [node_reads(n) for n in nodes]
    order, state = [], {}

    def visit(k):
        stack = [(k, False)]
        while stack:
            k, done = stack.pop()
            if done:
                state[k] = 2
                order.append(nodes[k])
                continue
            if state.get(k):
                continue
            state[k] = 1
            stack.append((k, True))
            stack.extend((producer[i], False) for i in reads[k] if i in producer and not state.get(producer[i]))
    for k in range(len(nodes)):
        visit(k)
    return order


def declared(model: onnx.ModelProto) -> tuple[dict, dict, dict]:
    """Each value's element type, dims (None where unknown) and dims with their symbols (None where
    neither), from the graph's inputs, value_info and outputs (the initializers are not read)."""
    types, dims, syms = {}, {}, {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        t = vi.type.tensor_type
        if t.elem_type:
            types[vi.name] = t.elem_type
        if t.HasField("shape"):
            dims[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            syms[vi.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in t.shape.dim]
    return types, dims, syms


def fresh(model: onnx.ModelProto, nodes, inputs, outputs, initializers, value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, model.graph.name or "graph", inputs, outputs, initializers,
                              value_info=list(value_info))
    out = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="trainrun")
    out.ir_version = IR_VERSION
    return out


def params_to_inputs(model: onnx.ModelProto, params: list[str]) -> onnx.ModelProto:
    """Move the parameter initializers to graph inputs (in ``params`` order)."""
    inits = {t.name: t for t in model.graph.initializer}
    keep = [t for t in model.graph.initializer if t.name not in set(params)]
    data_inputs = [i for i in model.graph.input if i.name not in inits]
    param_inputs = [helper.make_tensor_value_info(p, inits[p].data_type, list(inits[p].dims)) for p in params]
    return fresh(model, list(model.graph.node), data_inputs + param_inputs, list(model.graph.output), keep)


def const(name, value, dtype=np.int64):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype)),
                            name=name + "_c")


def opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)


def value_dims(model, name):
    """Dims (ints, or symbols/None) of tensor ``name`` as declared or inferred by onnx; None if unknown."""
    for vi in list(model.graph.output) + list(model.graph.value_info):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in vi.type.tensor_type.shape.dim]
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - an uninferable graph: the shape stays unknown
        return None
    for vi in list(inferred.graph.output) + list(inferred.graph.value_info):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in vi.type.tensor_type.shape.dim]
    return None
