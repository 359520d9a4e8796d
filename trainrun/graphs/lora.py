"""``model.lora``: low-rank adapters (PEFT's LoRA) added to a built-in model's forward graph, for every
family in this one place.

Each targeted linear layer ``y = x W (+ b)`` (a MatMul or Gemm reading the parameter ``<module>.weight``
and nothing else reading it; the families run them on rows, x [rows, in]) becomes
``y + Gemm(Gemm(dropout(x), A^T), B^T, alpha / r)`` with the new parameters ``<module>.lora_A.weight``
[r, in] (kaiming-uniform with a = sqrt(5), as PEFT initialises it: U(-1/sqrt(in), 1/sqrt(in))) and
``<module>.lora_B.weight`` [out, r] (zeros). Module names are the transformers ones the families'
parameters carry; ``target_modules`` and ``modules_to_save`` match them as PEFT does (the name itself or
a name ending in ``.<entry>``). The base weights stay initializers (frozen); the adapters and the
parameters of ``modules_to_save`` are the trainable parameters. The adapter's dropout is a Dropout node
on its input seen as [batch, -1, in] (trainrun's masks are drawn per sample: graphs.dropout_nodes)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UsageError

def matches(module: str, entry: str) -> bool:
    """PEFT's match of a module name against a target_modules / modules_to_save entry."""
    return module == entry or module.endswith("." + entry)


def adapter_names(module: str) -> tuple[str, str]:
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def linear_modules(model: onnx.ModelProto, weights) -> dict[str, tuple[int, onnx.NodeProto, bool]]:
    """{module: (its node's index, the node, W stored [out, in])} of every linear layer: a MatMul, or a
    Gemm without transA, whose second input is the parameter ``<module>.weight`` and which alone reads it."""
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    out = {}
    for index, n in enumerate(model.graph.node):
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2:
            continue
        w = n.input[1]
        if not w.endswith(".weight") or w not in weights or readers.get(w) != 1 or np.ndim(weights[w]) != 2:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
            continue
        out[w[:-len(".weight")]] = (index, n, bool(attrs.get("transB", 0)) if n.op_type == "Gemm" else False)
    return out


def layers(shapes: dict, family) -> list[str]:
    """The modules ``target_modules`` may name, from the parameters' {name: shape} alone (no graph): every
    ``<module>.weight`` of two dims that is not one of the family's lookup tables (``family.embeddings``)."""
    return [n[:-len(".weight")] for n, s in shapes.items()
            if n.endswith(".weight") and len(s) == 2 and n not in family.embeddings]


def _ends(modules) -> str:
    return ", ".join(sorted({m.rsplit(".", 1)[-1] for m in modules}))


def problems(lora, family, shapes: dict) -> list[str]:
    """Every entry of ``lora.target_modules`` (or the family's default) that matches no linear layer and of
    ``lora.modules_to_save`` that matches no module, from the parameters' {name: shape}: what ``config
    validate`` and prepare refuse, each naming the key, the entry and what the model has."""
    entries = list(lora.target_modules) or list(family.lora_targets)
    if not entries:
        return [f"model.lora.target_modules: {family.name} has no default target modules; name them"]
    linear = layers(shapes, family)
    tied = {head[:-len(".weight")]: table for head, table in (family.transformers.tied if family.transformers
                                                              else {}).items() if head not in shapes}
    out = []
    for e in entries:
        if any(matches(m, e) for m in linear):
            continue
        head = next((h for h in tied if matches(h, e)), None)
        out.append(f"model.lora.target_modules: '{e}' " + (
            f"is the {family.name} model's head tied to its token embedding {tied[head]}, a lookup table: LoRA "
            f"adapts an untied head only" if head else f"matches no linear layer of the {family.name} model")
            + f" (its linear layers end in: {_ends(linear)})")
    modules = [n.rsplit(".", 1)[0] for n in shapes]
    return out + [f"model.lora.modules_to_save: '{e}' matches no module of the {family.name} model (its modules "
                  f"end in: {_ends(modules)})" for e in lora.modules_to_save if not any(matches(m, e) for m in modules)]


def check(lora, family, shapes: dict) -> None:
    """:func:`problems` as one UsageError (exit 2)."""
    if found := problems(lora, family, shapes):
        raise UsageError("model.lora: the modules it names are not the model's", found)


def targets(lora, family, shapes: dict) -> list[str]:
    """The modules ``lora.target_modules`` (or the family's default) names."""
    entries = list(lora.target_modules) or list(family.lora_targets)
    return [m for m in layers(shapes, family) if any(matches(m, e) for e in entries)]


def saved(lora, names) -> list[str]:
    """The parameters of ``lora.modules_to_save``'s modules."""
    return [n for n in names if any(matches(n.rsplit(".", 1)[0], e) for e in lora.modules_to_save)]


def init_adapters(lora, shapes: dict[str, tuple[int, int]], seed: int) -> dict[str, np.ndarray]:
    """{lora_A, lora_B of each module: initial value}; ``shapes`` {module: (in, out)}. A as PEFT's
    kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)); B zeros. Deterministic in ``seed``."""
    rng = np.random.default_rng([seed, 0x10AA])
    out = {}
    for module, (fan_in, fan_out) in shapes.items():
        a, b = adapter_names(module)
        bound = 1.0 / math.sqrt(fan_in)
        out[a] = rng.uniform(-bound, bound, (lora.r, fan_in)).astype(np.float32)
        out[b] = np.zeros((fan_out, lora.r), np.float32)
    return out


def add_adapters(model: onnx.ModelProto, weights: dict, lora, family, seed: int
                 ) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """``model`` (the forward graph of ``family``, ``weights`` its parameters) with the adapters; returns
    (the new graph, the adapted modules whose weight is stored [in, out], the trainable parameters: the
    adapters, then modules_to_save's)."""
    batch_input = family.inputs[0]
    shapes = {n: np.shape(w) for n, w in weights.items()}
    check(lora, family, shapes)
    modules = linear_modules(model, weights)
    chosen = targets(lora, family, shapes)
    if missing := [m for m in chosen if m not in modules]:     # a family whose embeddings do not say all
        raise UsageError(f"model.lora.target_modules: {', '.join(missing)} of the {family.name} model "
                         f"{'is not a linear layer' if len(missing) == 1 else 'are not linear layers'} "
                         f"(family.embeddings names the lookup tables)")
    sizes = {}
    for m in chosen:
        _, node, out_in = modules[m]
        rows, cols = weights[node.input[1]].shape
        sizes[m] = (cols, rows) if out_in else (rows, cols)
    adapters = init_adapters(lora, sizes, seed)
    scale = float(np.float32(lora.alpha) / np.float32(lora.r))
    consts = []
    nodes_before = []
    if lora.dropout > 0:
        consts += [numpy_helper.from_array(np.array(lora.dropout, np.float32), "lora_dropout_ratio"),
                   numpy_helper.from_array(np.array(True), "lora_dropout_training"),
                   numpy_helper.from_array(np.array([-1], np.int64), "lora_rows")]
        nodes_before.append(helper.make_node("Shape", [batch_input], ["lora_batch"], name="lora_batch",
                                             start=0, end=1))
    where = {modules[m][0]: m for m in chosen}
    nodes = list(nodes_before)
    for index, n in enumerate(model.graph.node):
        if index not in where:
            nodes.append(n)
            continue
        m = where[index]
        a, b = adapter_names(m)
        x, y = n.input[0], n.output[0]
        base = f"{m}/base"
        node = onnx.NodeProto()
        node.CopyFrom(n)
        node.output[0] = base
        nodes.append(node)
        new = []
        if lora.dropout > 0:       # dropped as [batch, -1, in] (masks per sample), back to x's rows
            width = f"{m}/lora_width"
            consts.append(numpy_helper.from_array(np.array([sizes[m][0]], np.int64), width))
            shape = f"{m}/lora_shape"
            new += [helper.make_node("Concat", ["lora_batch", "lora_rows", width], [shape], name=shape, axis=0),
                    helper.make_node("Reshape", [x, shape], [f"{m}/lora_x"], name=f"{m}/lora_x"),
                    helper.make_node("Dropout", [f"{m}/lora_x", "lora_dropout_ratio", "lora_dropout_training"],
                                     [f"{m}/lora_dropout"], name=f"{m}.lora_dropout"),
                    helper.make_node("Shape", [x], [f"{m}/x_shape"], name=f"{m}/x_shape"),
                    helper.make_node("Reshape", [f"{m}/lora_dropout", f"{m}/x_shape"], [f"{m}/lora_in"],
                                     name=f"{m}/lora_in")]
            x = f"{m}/lora_in"
        # x [rows, in] (the families' linear layers run on rows): x A^T, then (x A^T) B^T alpha / r
        new += [helper.make_node("Gemm", [x, a], [f"{m}/lora_A"], name=f"{m}.lora_A", transB=1),
                helper.make_node("Gemm", [f"{m}/lora_A", b], [f"{m}/lora"], name=f"{m}.lora_B", transB=1,
                                 alpha=scale),
                helper.make_node("Add", [base, f"{m}/lora"], [y], name=f"{m}/with_lora")]
        nodes.extend(new)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(consts + [numpy_helper.from_array(v, k) for k, v in adapters.items()])
    trainable = list(adapters) + saved(lora, list(weights))
    return out, [m for m in chosen if not modules[m][2]], trainable


def merged(weights: dict[str, np.ndarray], lora: dict, in_out: list[str]) -> dict[str, np.ndarray]:
    """``weights`` (base and adapters, by name) with each adapted ``<module>.weight`` replaced by
    W + (B A) alpha / r (transposed for the modules of ``in_out``, whose W is stored [in, out]) and the
    adapters dropped: the full model export writes."""
    out = {k: v for k, v in weights.items() if ".lora_A." not in k and ".lora_B." not in k}
    scale = np.float32(lora["alpha"]) / np.float32(lora["r"])
    for name in weights:
        if name.endswith(".lora_A.weight"):
            module = name[:-len(".lora_A.weight")]
            delta = (weights[adapter_names(module)[1]] @ weights[name]) * scale     # [out, in]
            w = module + ".weight"
            out[w] = (weights[w] + (delta.T if module in in_out else delta)).astype(np.float32)
    return out


def digest(weights: dict[str, np.ndarray]) -> str:
    """sha256 over the frozen base weights (names, shapes and bytes, in name order)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        v = np.ascontiguousarray(weights[name], np.float32)
        h.update(f"{name}:{list(v.shape)};".encode())
        h.update(v.tobytes())
    return h.hexdigest()
