"""Matrix products whose rows lie 4 KiB apart, padded (train graphs for the CPU).

onnxruntime's CPU GEMM (MLAS) packs the right operand but reads the left one in place, a dozen rows at a
time. When those rows are a multiple of 4 KiB apart (the contraction K a multiple of 1024 float32), they
fall into one L1 cache set, and a set holds 8 to 12 lines: the rows evict each other and the product runs
15-30% slower (scripts/bench/strides.py; BENCHMARKS.md). It happens wherever a model's sizes are powers
of two: every weight gradient when a micro-batch holds 1024 tokens (8 x 128, 4 x 256, 1 x 1024; K is the
token count), GPT-2's MLP projection (K = 3072 = 3 x 1024).

:func:`pad_contractions` pads K with 16 zeros (one cache line) on both operands of such a product: the
rows then fall into successive sets. The padded terms are exact zeros, so the product keeps its value.
The two copies cost less than the product gains once M*N/(M+N) >= 128 (rows and columns of the result;
the measured break-even is near 100), so smaller products are left alone. Only 2-D float32 MatMul and
Gemm (left operand not transposed) with every dim known, i.e. graphs with static shapes.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, shape_inference

from .onnx_edit import const

ROW = 1024        # float32 elements in 4 KiB
PAD = 16          # float32 elements in a 64-byte cache line
MIN_SIZE = 128    # M*N/(M+N) at or above which padding pays


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, list]]:
    """name -> (element type, dims) for every tensor whose type onnx knows or infers."""
    try:
        model = shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - an uninferable graph: nothing is known, nothing padded
        pass
    out = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = (t.elem_type, [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim])
    for init in model.graph.initializer:
        out[init.name] = (init.data_type, list(init.dims))
    return out


def _product(node, shapes) -> tuple[int, int, int, bool] | None:
    """(M, K, N, B transposed) of a 2-D float32 product whose dims are all known, else None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or attrs.get("transA", 0):
        return None
    a, b = shapes.get(node.input[0]), shapes.get(node.input[1])
    if not a or not b or a[0] != TensorProto.FLOAT or b[0] != TensorProto.FLOAT:
        return None
    if len(a[1]) != 2 or len(b[1]) != 2 or None in a[1] + b[1]:
        return None
    trans_b = bool(attrs.get("transB", 0))
    (m, k), (n, k2) = a[1], (b[1] if trans_b else b[1][::-1])
    return (m, k, n, trans_b) if k == k2 else None


def pad_contractions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Pad K of the products described in the module docstring; returns ``model``, changed in place."""
    shapes = _shapes(model)
    out = []
    for node in model.graph.node:
        p = _product(node, shapes)
        if p is None or p[1] % ROW or p[0] * p[2] < MIN_SIZE * (p[0] + p[2]):
            out.append(node)
            continue
        trans_b = p[3]
        base = f"{node.name or node.output[0]}/kpad"
        a, b = node.input[0], node.input[1]
        out += [const(base + "/a_pads", [0, 0, 0, PAD]),
                const(base + "/b_pads", [0, 0, 0, PAD] if trans_b else [0, 0, PAD, 0]),
                helper.make_node("Pad", [a, base + "/a_pads"], [base + "/a"], name=base + "/a"),
                helper.make_node("Pad", [b, base + "/b_pads"], [base + "/b"], name=base + "/b")]
        node.input[0], node.input[1] = base + "/a", base + "/b"
        out.append(node)
    del model.graph.node[:]
    model.graph.node.extend(out)
    return model
