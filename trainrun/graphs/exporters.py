"""What torch's exporters leave in a user's graph about training, read before it is trained.

``torch.onnx.export(..., dynamo=True)`` (torch 2.9+'s default) records where each node and initializer
came from in ``metadata_props``: each node's FX node (``pkg.torch.onnx.fx_node``), each initializer's
kind in torch.export's graph signature (``pkg.torch.export.graph_signature.InputSpec.kind``: PARAMETER,
BUFFER, ...; on the graph's value_info), and what its optimizer folded an initializer from
(``pkg.onnxscript.optimizer.folded_from``). From them:

* a BatchNormalization that torch ran in training mode is written in inference form (the exporter
  sets ``training_mode`` to 0 whatever torch did): it is given ``training_mode=1`` back, so it trains
  as the legacy exporter's training-mode BatchNorm does (batch statistics, running statistics updated);
* a training-mode BatchNorm that the exporter's optimizer folded into the node before it (no
  BatchNormalization left: the weights are no longer torch's) is refused, by node;
* a Linear weight the optimizer stored transposed under a new name (``val_12``) gets torch's name and
  layout back, read through a Transpose node;
* buffers, constants and other folded tensors (rotary tables, masks) are frozen, not trained;
* ``torch.split`` / ``chunk`` written unoptimised as a SplitToSequence read only by SequenceAt at constant
  positions (a GPT-2's or GPT-NeoX's fused q/k/v) is written as the one Split it is: tensor sequences have no
  gradient in either builder;
* a Reshape of two integer Constants (how it writes the axes of ``mean(dim)``: an RMSNorm's, a pooling
  mean's) becomes the Constant it is, so that shape inference knows the reduction's rank.

The legacy exporter (``dynamo=False``) leaves none of this: its graph is taken as it is."""

from __future__ import annotations

import ast
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import UsageError

KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED = "pkg.onnxscript.optimizer.folded_from"
FX_NODE = "pkg.torch.onnx.fx_node"
SCOPES = "pkg.torch.onnx.name_scopes"
NOT_TRAINED = ("BUFFER", "CONSTANT_TENSOR")     # torch.export's kinds of an input that is no parameter

# torch's batch norms, the index of their ``training`` argument (``None``: no running statistics)
BATCH_NORMS = {"aten._native_batch_norm_legit_functional.default": 5, "aten.native_batch_norm.default": 5,
               "aten._native_batch_norm_legit.default": 5, "aten.batch_norm.default": 5,
               "aten._native_batch_norm_legit.no_stats": None}
_FX = re.compile(r"^%(\S+) : .*?target=torch\.ops\.(\S+?)\]\(args = \((.*)\), kwargs = ")
BUFFER_WHY = "a buffer (torch.export)"
FOLDED_WHY = "a constant the exporter folded"


def _meta(proto) -> dict:
    return {p.key: p.value for p in proto.metadata_props}


def _fx(node) -> tuple[str, str, list[str]] | None:
    """(FX node name, target, its arguments as written) of a node the dynamo exporter wrote, else None."""
    m = _FX.match(_meta(node).get(FX_NODE, ""))
    return (m.group(1), m.group(2), [a.strip() for a in m.group(3).split(",")]) if m else None


def is_dynamo(model: onnx.ModelProto) -> bool:
    return any(FX_NODE in _meta(n) for n in model.graph.node) or \
        any(KIND in _meta(v) for v in model.graph.value_info)


def from_torch(model: onnx.ModelProto, source: str) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``model`` (a copy where changed) as the dynamo exporter's metadata says torch trained it, and the
    initializers that are not parameters: ``{name: why}``. A graph without that metadata is returned as it is."""
    if not is_dynamo(model):
        return model, {}
    model = onnx.ModelProto.FromString(model.SerializeToString())
    _batchnorm_training(model, source)
    _fold_constant_reshapes(model)
    _sequences_as_split(model)
    renamed = _unfold_transposed_weights(model)
    info = {v.name: _meta(v) for v in model.graph.value_info}
    frozen = {}
    for t in model.graph.initializer:
        meta = info.get(t.name, {})
        if t.name in renamed or t.data_type != TensorProto.FLOAT or not t.dims:
            continue
        if meta.get(KIND) in NOT_TRAINED:
            frozen[t.name] = BUFFER_WHY
        elif FOLDED in meta:
            frozen[t.name] = FOLDED_WHY
    return model, frozen


def _batchnorm_training(model: onnx.ModelProto, source: str) -> None:
    """Each BatchNormalization whose FX node ran torch's batch norm with ``training=True`` gets
    ``training_mode=1``; such an FX node without a BatchNormalization (folded away) is an error."""
    groups: dict[str, list] = {}
    for n in model.graph.node:
        fx = _fx(n)
        if fx and fx[1] in BATCH_NORMS and BATCH_NORMS[fx[1]] is not None:
            groups.setdefault(fx[0], []).append((n, fx))
    for name, nodes in groups.items():
        _, target, args = nodes[0][1]
        at = BATCH_NORMS[target]
        if len(args) <= at or args[at] != "True":
            continue
        bns = [n for n, _ in nodes if n.op_type == "BatchNormalization"]
        if not bns:
            node = nodes[0][0]
            module = ".".join(s for s in ast.literal_eval(_meta(node).get(SCOPES, "[]"))[:-1] if s) or name
            raise UsageError(
                f"{source}: node '{node.name or node.output[0]}' ({node.op_type}) holds torch's BatchNorm "
                f"'{module}' in training mode, but the graph has no BatchNormalization for it: the exporter's "
                f"optimizer folded it into the weights before it, which training mode does not allow (the "
                f"weights are no longer torch's). Export with torch.onnx.export(..., dynamo=True, "
                f"optimize=False), or with dynamo=False, training=torch.onnx.TrainingMode.TRAINING "
                f"(docs/models.md, \"Exporting from torch\")")
        for bn in bns:
            attrs = [a for a in bn.attribute if a.name != "training_mode"]
            del bn.attribute[:]
            bn.attribute.extend(attrs + [helper.make_attribute("training_mode", 1)])


def _unfold_transposed_weights(model: onnx.ModelProto) -> set[str]:
    """Linear weights the exporter's optimizer stored transposed under a new name (an initializer folded
    from one tensor, read as the weight B of MatMul nodes whose FX node is ``aten.linear`` of that
    parameter): the initializer under torch's name and layout, a Transpose node giving the folded name.
    Returns torch's names of those weights."""
    info = {v.name: _meta(v) for v in model.graph.value_info}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            readers.setdefault(name, []).append((n, i))
    have = {t.name for t in model.graph.initializer}
    restored, transposes = set(), []
    for t in model.graph.initializer:
        try:
            sources = ast.literal_eval(info.get(t.name, {}).get(FOLDED, "None"))
        except (ValueError, SyntaxError):
            continue
        if not isinstance(sources, list) or len(sources) != 1 or len(t.dims) != 2 or sources[0] in have:
            continue
        torch_name = sources[0]
        wanted = "%p_" + re.sub(r"\W", "_", torch_name)
        uses = readers.get(t.name, [])
        if not uses or not all(n.op_type == "MatMul" and i == 1 and (fx := _fx(n)) is not None
                               and fx[1] == "aten.linear.default" and len(fx[2]) > 1 and fx[2][1] == wanted
                               for n, i in uses):
            continue
        folded = t.name
        t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(t).T), torch_name))
        transposes.append(helper.make_node("Transpose", [torch_name], [folded], perm=[1, 0],
                                           name=f"{torch_name}/transposed"))
        restored.add(torch_name)
    if transposes:
        nodes = transposes + list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return restored


def _constants(model: onnx.ModelProto, initializers: bool = True) -> dict[str, np.ndarray]:
    """The values of the Constant nodes' outputs (and of the initializers)."""
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer} if initializers else {}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name in ("value", "value_int", "value_ints"):
            a = n.attribute[0]
            out[n.output[0]] = numpy_helper.to_array(a.t) if a.name == "value" else np.array(
                helper.get_attribute_value(a), np.int64)
    return out


def _sequences_as_split(model: onnx.ModelProto) -> None:
    """Each SplitToSequence whose sequence only SequenceAt nodes read, at constant positions, with a constant
    split (sizes, or one size and the split axis's static length), becomes a Split whose outputs are those
    SequenceAt's outputs; the SequenceAt nodes go."""
    g = model.graph
    consts = _constants(model)
    readers: dict[str, list] = {}
    every = list(g.node)        # one Python object per node: id() names it below
    for n in every:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in list(g.input) + list(g.value_info) if v.type.tensor_type.HasField("shape")}
    outputs = {o.name for o in g.output}
    drop, replace = set(), {}
    for n in every:
        if n.op_type != "SplitToSequence" or len(n.input) < 2 or n.input[1] not in consts or n.output[0] in outputs:
            continue
        users = readers.get(n.output[0], [])
        if not users or any(u.op_type != "SequenceAt" or u.input[1] not in consts for u in users):
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        split = consts[n.input[1]].astype(np.int64)
        if split.ndim == 0:         # one size: pieces of it, the last the rest
            x_dims = dims.get(n.input[0])
            length = None if x_dims is None or axis >= len(x_dims) else x_dims[axis]
            if not length or split <= 0:
                continue
            split = np.array([int(split)] * (length // int(split)) + ([length % int(split)] if length % int(split)
                                                                       else []), np.int64)
        pieces = [f"{n.output[0]}/piece_{k}" for k in range(len(split))]
        positions = [int(consts[u.input[1]]) % len(split) for u in users]
        if len(set(positions)) != len(positions):
            continue            # one piece read twice: two names for one output
        for u, k in zip(users, positions):
            pieces[k] = u.output[0]
            drop.add(id(u))
        sizes = helper.make_node("Constant", [], [f"{n.output[0]}/sizes"], value=numpy_helper.from_array(split),
                                 name=f"{n.name}/sizes")
        replace[id(n)] = [sizes, helper.make_node("Split", [n.input[0], sizes.output[0]], pieces, axis=axis,
                                                  name=n.name or n.output[0])]
    if replace:
        nodes = [m for n in every if id(n) not in drop for m in replace.get(id(n), [n])]
        del g.node[:]
        g.node.extend(nodes)


def _fold_constant_reshapes(model: onnx.ModelProto) -> None:
    """Each Reshape of an integer Constant node's value by a constant shape becomes a Constant node. onnx's
    shape inference does not follow it: a ReduceMean whose axes it computes would have no known rank."""
    consts = _constants(model, initializers=False)
    nodes = []
    for n in model.graph.node:
        data = consts.get(n.input[0]) if n.op_type == "Reshape" and len(n.input) == 2 else None
        if data is not None and data.dtype.kind in "iu" and n.input[1] in consts:
            shape = [d if d != 0 else data.shape[k] for k, d in enumerate(consts[n.input[1]].tolist())]
            value = data.reshape(shape)
            consts[n.output[0]] = value
            n = helper.make_node("Constant", [], [n.output[0]], value=numpy_helper.from_array(value),
                                 name=n.name or n.output[0])
        nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
