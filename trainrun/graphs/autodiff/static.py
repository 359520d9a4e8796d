"""The dims of a graph's tensors for the rules: onnx's shape inference (with data propagation), and where
it leaves a tensor's rank unknown (or, the graph's inputs' dims all fixed, a dim: torch's channel shuffle
computes its Reshape's target by a Div and Casts that data propagation stops at), inference again after
folding the graph's integer computations whose
inputs are all known (Constants, small integer initializers, the Shape of a tensor whose dims are
static): the arithmetic an exporter writes around a Reshape's target shape (torch's
nn.MultiheadAttention in training mode: a Slice of a Shape by bounds from Add and Mod), which data
propagation does not follow, becomes Constants, so that the Reshape's rank (and, with the run's dims
fixed, its dims) is known."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

INTEGERS = {TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL}
LARGEST = 1024          # elements of a folded value: shapes and indices, not data
ROUNDS = 64          # folding and inference rounds at most (a round reaches one more of a chain of Reshapes)
NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}


def _ranks_missing(inferred: onnx.ModelProto) -> bool:
    """Whether a tensor's rank is unknown, or (the graph's inputs' dims all fixed) one of its dims."""
    shapes = {vi.name: vi.type.tensor_type.shape for vi in list(inferred.graph.value_info) + list(inferred.graph.output)
              if vi.type.tensor_type.HasField("shape")}
    known = set(shapes) | {t.name for t in inferred.graph.initializer} | {vi.name for vi in inferred.graph.input}
    if any(o and o not in known for n in inferred.graph.node for o in n.output):
        return True
    fixed = all(d.HasField("dim_value") for vi in inferred.graph.input for d in vi.type.tensor_type.shape.dim)
    return fixed and any(not d.HasField("dim_value") for shape in shapes.values() for d in shape.dim)


def _dims(inferred: onnx.ModelProto) -> dict:
    out = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return out


def _evaluate(node: onnx.NodeProto, inputs: list, opset: int):
    """``node``'s outputs from ``inputs`` (NumPy arrays) by onnx's reference evaluator, or None."""
    from onnx.reference import ReferenceEvaluator
    names = [f"in{k}" if i else "" for k, i in enumerate(node.input)]
    single = helper.make_node(node.op_type, names, [f"out{k}" for k in range(len(node.output))],
                              **{a.name: helper.get_attribute_value(a) for a in node.attribute})
    feeds = {n: v for n, v in zip(names, inputs) if n}
    graph = helper.make_graph([single], "fold", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(
        v.dtype), v.shape) for n, v in feeds.items()], [helper.make_tensor_value_info(o, 0, None)
                                                          for o in single.output])
    try:
        return ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])).run(
            None, feeds)
    except Exception:       # an op the reference evaluator lacks, or inputs it rejects: left unfolded
        return None


def _fold(n: onnx.NodeProto, values: dict, dims: dict, opset: int):
    """``n``'s outputs, small integer or boolean arrays, computed from the known ``values`` of its inputs (the
    Shape and Size of a tensor from its ``dims`` where they are static), or None. A node with subgraphs (an If)
    is not folded here."""
    if n.domain not in ("", "ai.onnx") or n.op_type in NOT_FOLDED or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
        return None
    if n.op_type in ("Shape", "Size") and dims.get(n.input[0]) is not None and None not in dims[n.input[0]]:
        out = _evaluate(n, [np.broadcast_to(np.int8(0), dims[n.input[0]])], opset)
    elif all(not i or i in values for i in n.input):
        out = _evaluate(n, [values[i] if i else None for i in n.input], opset)
    else:
        return None
    ok = out is not None and all(isinstance(v, np.ndarray) and v.dtype.kind in "iub" and v.size <= LARGEST
                                 for v in out)
    return out if ok else None


def _small_integers(model: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.data_type in INTEGERS and np.prod(t.dims) <= LARGEST}


def known_values(model: onnx.ModelProto) -> dict:
    """The integer and boolean tensors of ``model`` (its nodes in dependency order) whose values are known
    when the graph is built: its Constants and small integer initializers, the Shapes and Sizes of tensors
    whose dims :func:`infer` finds static (the ranks torch's legacy exporter compares before a Tile), and
    what is computed from those alone."""
    dims, values = _dims(infer(model)), _small_integers(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    for n in model.graph.node:
        out = _fold(n, values, dims, opset)
        if out is not None:
            values.update(zip(n.output, out))
    return values


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (its nodes in dependency order) with the value_info onnx's shape inference gives it, after
    folding its known integer computations where a rank is otherwise left unknown."""
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    if not _ranks_missing(inferred):
        return inferred
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    values = _small_integers(model)
    for _ in range(ROUNDS):
        dims, changed, nodes = _dims(inferred), False, []
        for n in folded.graph.node:
            out = _fold(n, values, dims, opset) if n.op_type != "Constant" and n.input else None
            if out is not None:
                for o, v in zip(n.output, out):
                    values[o] = v
                    nodes.append(helper.make_node("Constant", [], [o], value=numpy_helper.from_array(v, o)))
                changed = True
                continue
            if n.op_type == "Constant" and n.output[0] not in values and n.attribute[0].name == "value" \
                    and n.attribute[0].t.data_type in INTEGERS:
                values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
                changed = True
            nodes.append(n)
        if not changed:
            break
        del folded.graph.node[:]
        folded.graph.node.extend(nodes)
        inferred = shape_inference.infer_shapes(folded, data_prop=True)
        if not _ranks_missing(inferred):
            break
    return inferred
