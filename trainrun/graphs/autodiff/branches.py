"""If nodes whose condition is known when the graph is built, replaced by the branch they take, so that the
rules differentiate that branch's nodes as any others: torch's legacy exporter writes ``Tensor.tile`` as two
Ifs on the difference of two ranks (a Size of a Shape), which the graph's static ranks decide.

A condition is known when :func:`.static.known_values` folds it (Constants, small integer initializers, the
Shapes and Sizes of tensors whose dims are static, and integer arithmetic on those). The taken branch's values
get names the graph does not use (its initializers become Constants; a subgraph inside it reads the new names),
its outputs are written under the If's output names, and the names it reads from the graph around it stay;
an If that a taken branch holds is decided in the next round. An If whose condition is not known stays: the
walk names it (:func:`unknown_condition`) where gradients must flow through it."""

from __future__ import annotations

import onnx
from onnx import helper

from ..onnx_edit import defined, names_in, subgraphs, topological, unique_name
from . import static

ROUNDS = 16     # nested Ifs inlined at most this deep


def unknown_condition(node: onnx.NodeProto) -> str:
    """Why trainrun's builder cannot differentiate the If ``node``, for the error."""
    return (f"If node '{node.name}': its condition '{node.input[0]}' is not known when the graph is built (not a "
            f"constant, nor computed from constants and static shapes alone), so trainrun's builder cannot "
            f"replace it by one of its branches; export the model with its input shapes static, or without the "
            f"data-dependent branch")


def _reading(node: onnx.NodeProto, names: dict) -> None:
    """``node`` (in place) reading ``names``' new names, in its subgraphs too (but for a name a subgraph
    defines itself)."""
    node.input[:] = [names.get(i, i) for i in node.input]
    for g in subgraphs(node):
        inner = {k: v for k, v in names.items() if k not in defined(g)}
        for n in g.node:
            _reading(n, inner)
        for o in g.output:
            o.name = inner.get(o.name, o.name)


def _taken(node: onnx.NodeProto, branch: onnx.GraphProto, taken: set) -> list[onnx.NodeProto]:
    """The nodes that compute ``node``'s outputs by its ``branch``, with new names from ``taken``."""
    base = node.name or "If"
    names = {}
    for o, out in zip(branch.output, node.output):
        if out and o.name in defined(branch) and o.name not in names:
            names[o.name] = out
    for name in sorted(defined(branch)):
        names.setdefault(name, unique_name(f"{base}/{name}", taken))
    nodes = [helper.make_node("Constant", [], [names[t.name]], name=unique_name(f"{base}/{t.name}", taken), value=t)
             for t in branch.initializer]
    for n in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        _reading(copy, names)
        copy.output[:] = [names.get(o, o) for o in n.output]
        copy.name = unique_name(f"{base}/{n.name or n.op_type}", taken)
        nodes.append(copy)
    for o, out in zip(branch.output, node.output):       # an outer value, or one output given twice
        if out and names.get(o.name) != out:
            nodes.append(helper.make_node("Identity", [names.get(o.name, o.name)], [out],
                                          name=unique_name(f"{base}/{out}/Identity", taken)))
    return nodes


def inline_known_ifs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (changed in place) with each If of its graph whose condition is known replaced by the nodes of
    the branch it takes, in dependency order; ``model`` itself where it has no If."""
    g = model.graph
    for _ in range(ROUNDS):
        if not any(n.op_type == "If" and n.domain in ("", "ai.onnx") for n in g.node):
            return model
        nodes = topological(list(g.node))
        del g.node[:]
        g.node.extend(nodes)
        values = static.known_values(model)
        taken = names_in(g)
        written, changed = [], False
        for n in nodes:
            cond = values.get(n.input[0]) if n.op_type == "If" and n.domain in ("", "ai.onnx") else None
            if cond is None or cond.size != 1:
                written.append(n)
                continue
            branch = next(a.g for a in n.attribute if a.name == ("then_branch" if cond.item() else "else_branch"))
            written.extend(_taken(n, branch, taken))
            changed = True
        del g.node[:]
        g.node.extend(written)
        if not changed:
            return model
    return model
