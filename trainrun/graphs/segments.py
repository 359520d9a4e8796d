"""The train graph cut into consecutive segments, each ending where a bucket of gradients is final.

The gradient reduction can then overlap the backward pass (``distributed.overlap_grad_reduce``): the engine
runs the segments one after another and, between two of them, the communication of the bucket the first one
finished starts in the background (:mod:`trainrun.sync.update`). The cut is by dependency, not by guessing a layer
structure: segment ``k`` holds every node the outputs ``targets[k]`` need (the gradients of bucket ``k``, or
their accumulators' outputs) that no earlier segment holds; the last segment holds everything left (the
remaining gradients, the loss, state updates, debug outputs). A node lands in exactly one segment and runs
on the same inputs as in the whole graph, so the values are the same: onnxruntime optimizes each segment on
its own, and a fusion whose pattern a cut would cross is not made (the engine's tests compare the bits).

A tensor made in one segment and read in a later one (the forward activations the lower layers' backward
needs, the gradient flowing down) becomes an output of the first and an input of the later ones; its type is
the one onnxruntime infers for it in the segment that makes it (:func:`typed_input`), so nothing here needs
onnx's shape inference (which does not know the training ops). The graph's declared shapes of a segment's own
tensors go with it: onnxruntime-training's MaxPoolGrad takes its output's shape from the declaration (without
one, onnxruntime 1.19 crashes loading the segment).
"""

from __future__ import annotations

import onnx
from onnx import helper

_ELEM = {"tensor(float)": onnx.TensorProto.FLOAT, "tensor(double)": onnx.TensorProto.DOUBLE,
         "tensor(float16)": onnx.TensorProto.FLOAT16, "tensor(bfloat16)": onnx.TensorProto.BFLOAT16,
         "tensor(int64)": onnx.TensorProto.INT64, "tensor(int32)": onnx.TensorProto.INT32,
         "tensor(int8)": onnx.TensorProto.INT8, "tensor(uint8)": onnx.TensorProto.UINT8,
         "tensor(bool)": onnx.TensorProto.BOOL}


def _reads(node: onnx.NodeProto) -> list[str]:
    """Every tensor ``node`` reads: its inputs and what its subgraphs (If, Loop, Scan) take from outside."""
    names = [i for i in node.input if i]
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            inner = {o for n in sub.node for o in n.output} | {i.name for i in sub.input} \
                | {t.name for t in sub.initializer}
            names += [i for n in sub.node for i in _reads(n) if i not in inner]
    return names


def split(model: onnx.ModelProto, targets: list[list[str]]) -> list[onnx.ModelProto]:
    """``model`` cut into ``len(targets) + 1`` segments: segment k (k < len(targets)) computes the outputs
    ``targets[k]``, the last one everything else. Boundary tensors are outputs without a type in the segment
    that makes them and inputs of the later ones named like them, typed by the caller (:func:`typed_input`)
    from the session of the segment that makes them. A segment that would hold no node (its targets made by
    an earlier one) is None."""
    g = model.graph
    nodes = list(g.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    outputs = [o.name for o in g.output]
    unknown = [t for ts in targets for t in ts if t not in producer]
    if unknown:
        raise ValueError(f"no node makes the target output(s) {', '.join(unknown[:5])}")
    owner = [-1] * len(nodes)
    for k, outs in enumerate([*targets, [o for o in outputs if o in producer]]):
        stack = [producer[o] for o in outs]
        while stack:
            i = stack.pop()
            if owner[i] >= 0:
                continue
            owner[i] = k
            stack.extend(producer[t] for t in _reads(nodes[i]) if t in producer)
    last = len(targets)
    owner = [last if o < 0 else o for o in owner]      # nodes no output needs: the last segment runs them
    graph_inputs = {i.name: i for i in g.input}
    inits = {t.name: t for t in g.initializer}
    made_in = {o: owner[i] for o, i in producer.items()}
    read_by: dict[str, set] = {}
    for i, n in enumerate(nodes):
        for t in _reads(n):
            read_by.setdefault(t, set()).add(owner[i])
    segments = []
    for k in range(last + 1):
        mine = [n for i, n in enumerate(nodes) if owner[i] == k]
        if not mine:
            segments.append(None)
            continue
        reads = list(dict.fromkeys(t for n in mine for t in _reads(n)))
        ins = [graph_inputs[t] for t in reads if t in graph_inputs]
        ins += [helper.make_value_info(t, onnx.TypeProto()) for t in reads
                if t in made_in and made_in[t] < k]
        outs = [o for o in g.output if made_in.get(o.name) == k]
        outs += [helper.make_value_info(t, onnx.TypeProto()) for t, m in made_in.items()
                 if m == k and t not in outputs and any(r > k for r in read_by.get(t, ()))]
        inside = {o for n in mine for o in n.output} - {o.name for o in outs}
        graph = helper.make_graph(mine, f"{g.name}_segment{len(segments)}", ins, outs,
                                  initializer=[inits[t] for t in reads if t in inits],
                                  value_info=[vi for vi in g.value_info if vi.name in inside])
        seg = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                producer_name=model.producer_name)
        seg.functions.extend(model.functions)
        segments.append(seg)
    return segments


def boundary_inputs(segment: onnx.ModelProto) -> list[str]:
    """The inputs of ``segment`` that an earlier segment makes (the untyped ones :func:`split` left)."""
    return [i.name for i in segment.graph.input if not i.type.HasField("tensor_type")]


def typed_input(segment: onnx.ModelProto, name: str, ort_type: str, shape: list) -> None:
    """Give ``segment``'s boundary input ``name`` the type onnxruntime reported for it where it is made
    (``NodeArg.type`` / ``.shape``: ints, symbolic names or None). onnxruntime reports a tensor whose shape it
    does not know as ``[]``, not None: declared so, the input would be a scalar; ``[]`` is no shape at all,
    which a true scalar passes as well."""
    for vi in segment.graph.input:
        if vi.name == name:
            if ort_type not in _ELEM:
                raise ValueError(f"segment boundary '{name}' has type {ort_type}, which the segments do not pass")
            dims = None if not shape else [d if isinstance(d, int) else (d or None) for d in shape]
            vi.CopyFrom(helper.make_tensor_value_info(name, _ELEM[ort_type], dims))
            return
    raise KeyError(name)
