"""Matrix products whose rows lie 4 KiB apart, padded (train graphs for the CPU).

onnxruntime's CPU GEMM (MLAS) packs the right operand but reads the left one in place, a dozen rows at a
time. When those rows are a multiple of 4 KiB apart (the contraction K a multiple of 1024 float32), they
fall into one L1 cache set, and a set holds 8 to 12 lines: the rows evict each other and the product runs
slower (docs/design.md, "Rows 4 KiB apart in CPU products"). It happens wherever a model's sizes are powers
of two: every weight gradient when a micro-batch holds 1024 tokens (8 x 128, 4 x 256, 1 x 1024; K is the
token count), GPT-2's MLP projection (K = 3072 = 3 x 1024).

:func:`pad_contractions` pads K with 16 zeros (one cache line) on both operands of such a product: the
rows then fall into successive sets. The padded terms are exact zeros, so the product keeps its value.
It is a property of the processor and of the kernel MLAS picks for it: measured on AMD's with AVX-512
(Zen 4), not on an Intel Xeon nor on an AMD Zen 3 (AVX2: K = 1024 as fast as 1008 and 1040, where the padding
cost a 3M GPT-2's step 2-6%), so ``engine.pad_products: auto`` pads on AMD processors with AVX-512 only
(:func:`wanted`). The two copies cost less than the product gains once
M*N/(M+N) >= 128 (rows and columns of the result), so smaller products are left alone. Only float32 MatMul, Gemm and
FusedMatMul of a left operand read as rows (not transposed; leading dims flattened into M) and a matrix,
every dim known: graphs with static shapes. Batched products (attention's) are left alone: a padded copy of
their [S, S] operands costs about what a product over a head's 64 columns would gain.
"""

from __future__ import annotations

import functools

import onnx
from onnx import TensorProto, helper, shape_inference

from .onnx_edit import const, opset

ROW = 1024        # float32 elements in 4 KiB
PAD = 16          # float32 elements in a 64-byte cache line
MIN_SIZE = 128    # M*N/(M+N) at or above which padding pays


def wanted(setting: str, device: str) -> bool:
    """Whether ``prepare`` pads (``engine.pad_products``): never on a GPU; ``auto`` on AMD processors with
    AVX-512, where the slowdown shows (docs/design.md, "Rows 4 KiB apart in CPU products")."""
    if device != "cpu" or setting == "never":
        return False
    vendor, flags = cpu_id()
    return setting == "always" or (vendor == "AuthenticAMD" and "avx512f" in flags)


@functools.cache
def cpu_id() -> tuple[str, frozenset]:
    """The x86 vendor id of this machine's processor ('AuthenticAMD', 'GenuineIntel'; '' if unknown) and its
    feature flags."""
    vendor, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split())
                if vendor and flags:
                    break
    except OSError:
        pass
    return vendor, flags


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, list]]:
    """name -> (element type, dims) for every tensor whose type onnx knows or infers."""
    try:
        model = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
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


OPS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "FusedMatMul")}


def _product(node, shapes) -> tuple[int, int, int, bool, int] | None:
    """(M, K, N, B transposed, A's rank) of a float32 product of a left operand ([..., M, K], leading dims
    flattened into M, as onnxruntime does when B is a matrix) and a matrix B ([K, N], or [N, K] transposed)
    whose dims are all known; else None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    domain = "" if node.domain == "ai.onnx" else node.domain
    if (domain, node.op_type) not in OPS or attrs.get("transA", 0) or attrs.get("transBatchA", 0) \
            or attrs.get("transBatchB", 0):
        return None
    a, b = shapes.get(node.input[0]), shapes.get(node.input[1])
    if not a or not b or a[0] != TensorProto.FLOAT or b[0] != TensorProto.FLOAT:
        return None
    if len(a[1]) < 2 or (node.op_type == "Gemm" and len(a[1]) != 2) or len(b[1]) != 2 or None in a[1] + b[1]:
        return None
    trans_b = bool(attrs.get("transB", 0))
    m, k = 1, a[1][-1]
    for d in a[1][:-1]:
        m *= d
    n, k2 = b[1] if trans_b else b[1][::-1]
    return (m, k, n, trans_b, len(a[1])) if k == k2 else None


def pad_contractions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Pad K of the products described in the module docstring; returns ``model``, changed in place."""
    shapes = _shapes(model)
    pads_input = opset(model) >= 11          # Pad-2 takes its pads as an attribute
    made: dict[tuple, str] = {}              # pads -> the Constant that holds them (one per distinct value)

    def pad(x, name, pads):
        if not pads_input:
            return [helper.make_node("Pad", [x], [name], name=name, pads=pads)]
        new = [] if tuple(pads) in made else [const(made.setdefault(tuple(pads), name + "_pads"), pads)]
        return new + [helper.make_node("Pad", [x, made[tuple(pads)]], [name], name=name)]
    out = []
    for node in model.graph.node:
        p = _product(node, shapes)
        if p is None or p[1] % ROW or p[0] * p[2] < MIN_SIZE * (p[0] + p[2]):
            out.append(node)
            continue
        trans_b, rank = p[3], p[4]
        base = f"{node.name or node.output[0]}/kpad"
        a, b = node.input[0], node.input[1]
        out += pad(a, base + "/a", [0] * (2 * rank - 1) + [PAD]) \
            + pad(b, base + "/b", [0, 0, 0, PAD] if trans_b else [0, 0, PAD, 0])
        node.input[0], node.input[1] = base + "/a", base + "/b"
        out.append(node)
    del model.graph.node[:]
    model.graph.node.extend(out)
    return model
