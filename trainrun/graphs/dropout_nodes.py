"""Dropout nodes: off (an Identity) in the eval and inference graphs; in the train graph each active
one a product with a mask input, which the run time fills (:mod:`trainrun.step.dropout`)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from ..errors import UsageError
from .names import MASK_PREFIX

def _dropouts(model: onnx.ModelProto, source: str) -> list[tuple[int, onnx.NodeProto, float, bool]]:
    """(index, node, ratio, training_mode) of every Dropout; ratio and training_mode must be constants."""
    values = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            values[n.output[0]] = n.attribute[0].t
    found = []
    for index, n in enumerate(model.graph.node):
        if n.op_type != "Dropout":
            continue
        args = []
        for i, default in ((1, 0.5), (2, False)):    # ONNX's defaults: ratio 0.5, inference mode
            name = n.input[i] if len(n.input) > i else ""
            if name and name not in values:
                raise UsageError(f"{source}: Dropout node '{n.name or n.output[0]}': its "
                                 f"{('ratio', 'training_mode')[i - 1]} '{name}' is not a constant")
            args.append(numpy_helper.to_array(values[name]).item() if name else default)
        if len(n.output) > 1 and n.output[1] and any(n.output[1] in m.input for m in model.graph.node):
            raise UsageError(f"{source}: Dropout node '{n.name or n.output[0]}': its mask output is used; "
                             f"trainrun feeds dropout masks as inputs and cannot produce it")
        found.append((index, n, float(str(np.float32(args[0]))), bool(args[1])))   # 0.1, not 0.100000001
    return found


def _replace_nodes(model: onnx.ModelProto, replace: dict) -> onnx.ModelProto:
    """A copy of ``model`` with the nodes ``replace[i]`` in place of its node i."""
    nodes = []
    for i, n in enumerate(model.graph.node):
        nodes.extend(replace.get(i, [n]))
    out = copy.deepcopy(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = {i for n in nodes for i in n.input} | {o.name for o in out.graph.output}
    kept = [t for t in out.graph.initializer if t.name in used]     # e.g. the Dropouts' ratio constants
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def dropout_off(model: onnx.ModelProto, source: str = "model") -> onnx.ModelProto:
    """Inference: every Dropout becomes an Identity (no Dropout node is left)."""
    return _replace_nodes(model, {i: [_identity(n)] for i, n, _, _ in _dropouts(model, source)})


def _identity(node: onnx.NodeProto) -> onnx.NodeProto:
    return helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)


def dropout_masks(model: onnx.ModelProto, inputs: list[str], source: str) -> tuple[onnx.ModelProto, dict | None]:
    """The train graph's dropout: every Dropout in training mode with ratio p > 0 becomes
    ``y = x * mask`` where ``mask`` is a new graph input of x's shape and type holding 0 or 1/(1-p),
    filled by trainrun's own random stream (:mod:`trainrun.step.dropout`); every other Dropout becomes an
    Identity. One Mul forward and one backward: cheaper than Where(bool mask, x, 0) * scale or
    x * Cast(bool mask) * scale, although a float mask takes 4 bytes an element and a bool one 1
    (docs/design.md, "Small costs per step").

    Returns the new model and the manifest's ``dropout`` entry (None when no mask is needed):
    ``{"dims": {symbol: [input, axis]}, "masks": [{"name", "node", "shape", "ratio", "dtype"}]}``, each shape
    x's, its dims ints or symbols of the data inputs' dims (the first is the batch)."""
    drops = _dropouts(model, source)
    active = [(i, n, p) for i, n, p, training in drops if training and p > 0]
    replace = {i: [_identity(n)] for i, n, p, training in drops if not (training and p > 0)}
    if not active:
        return _replace_nodes(model, replace), None
    dims, batch, shapes = _probe_shapes(model, inputs, [(n.name or n.output[0], n.input[0]) for _, n, _ in active],
                                        source)
    masks, new_inputs = [], []
    for i, n, p in active:
        node = n.name or n.output[0]
        shape, elem = shapes[n.input[0]]
        if not shape or shape[0] != batch:
            raise UsageError(f"{source}: Dropout node '{node}': its input's first dim ({shape[:1]}) is not the "
                             f"batch dim ('{batch}') of the data inputs; trainrun draws dropout masks per sample")
        name = MASK_PREFIX + node
        new_inputs.append(helper.make_tensor_value_info(name, elem, shape))
        replace[i] = [helper.make_node("Mul", [n.input[0], name], [n.output[0]], name=node)]
        dtype = helper.tensor_dtype_to_np_dtype(elem).name
        masks.append({"name": name, "node": node, "shape": shape, "ratio": p, "dtype": dtype})
    out = _replace_nodes(model, replace)
    out.graph.input.extend(new_inputs)
    return out, {"dims": dims, "masks": masks}


def _probe_shapes(model, inputs, tensors, source):
    """Shapes (dims as ints or data-input symbols) and element types of ``tensors`` [(node, tensor)],
    by onnx shape inference at two sets of values of the data inputs' symbolic dims: a dim that
    follows symbol k's values is that symbol, one that stays put is a constant.
    Returns ({symbol: [input, axis]}, the batch dim (symbol or int), {tensor: (dims, elem_type)})."""
    symbols: dict[str, list] = {}
    batch = None
    for vi in model.graph.input:
        if vi.name in inputs:
            for axis, d in enumerate(vi.type.tensor_type.shape.dim):
                if d.dim_param:
                    symbols.setdefault(d.dim_param, [vi.name, axis])
                if axis == 0 and batch is None:
                    batch = d.dim_param or d.dim_value
    named = list(symbols)
    probes = [{s: 2 + k for k, s in enumerate(named)}, {s: 3 + 2 * k for k, s in enumerate(named)}]
    # without the big initializers (shape inference needs their types, not their values)
    light = copy.deepcopy(helper.make_model(helper.make_graph(
        list(model.graph.node), "probe", list(model.graph.input), list(model.graph.output),
        [t for t in model.graph.initializer if np.prod(t.dims) <= 1024]), opset_imports=list(model.opset_import)))
    light.ir_version = model.ir_version
    light.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in model.graph.initializer if np.prod(t.dims) > 1024)
    seen = []
    for probe in probes:
        m = copy.deepcopy(light)
        for vi in m.graph.input:
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param in probe:
                    d.dim_value = probe[d.dim_param]
        try:
            m = shape_inference.infer_shapes(m, data_prop=True)
        except Exception as exc:  # noqa: BLE001 - onnx raises assorted errors on a malformed graph
            raise UsageError(f"{source}: shape inference failed: {exc}") from None
        info = {v.name: v.type.tensor_type for v in m.graph.value_info}
        seen.append(info)
    out = {}
    for node, t in tensors:
        a, b = (info.get(t) for info in seen)
        dims = None
        if a is not None and a.HasField("shape") and all(d.HasField("dim_value") for d in a.shape.dim) \
                and all(d.HasField("dim_value") for d in b.shape.dim) and len(a.shape.dim) == len(b.shape.dim):
            dims = []
            for x, y in zip((d.dim_value for d in a.shape.dim), (d.dim_value for d in b.shape.dim)):
                sym = [s for s in named if (probes[0][s], probes[1][s]) == (x, y)]
                dims.append(x if x == y else sym[0] if sym else None)
        if dims is None or None in dims:
            raise UsageError(f"{source}: Dropout node '{node}': the shape of its input '{t}' cannot be "
                             f"determined from the data inputs' dims (shape inference gives "
                             f"{[list(_dims(i.get(t))) for i in seen]}); trainrun needs it for the dropout mask")
        out[t] = (dims, a.elem_type)
    return symbols, batch, out


def _dims(tt):
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] \
        if tt is not None and tt.HasField("shape") else "unknown"
