"""Model FLOP/s utilisation (MFU): how close a run's steps come to the machine's matrix products.

MFU = the model's training FLOPs per second / the peak FLOP/s of the run's own devices, as nanoGPT's
``estimate_mfu`` and torchtitan report it, with two differences: the FLOPs are counted from the run's
forward graph, not from a formula of one architecture, and the peak is measured, not read from a data sheet.

* **Model FLOPs** (:func:`training_flops`): the multiply-adds of the forward graph's matrix products
  (MatMul, Gemm, Conv, ConvTranspose, Einsum's contractions), each 2 FLOPs, at the shapes of one micro-batch,
  once for the forward pass and once more for each operand whose gradient the backward pass needs: an
  operand computed from a trained parameter (the parameter itself included). With every weight trained
  that is 3 x the forward products, the PaLM / nanoGPT convention (``6 N`` a token) but for the first
  products of a model whose inputs are data, whose input gradient nobody computes; with ``model.lora`` or
  ``model.frozen`` a frozen weight's gradient is not counted, nor the backward of the layers below the
  lowest trained parameter (counted as trained, LoRA's MFU read 116% on SmolLM2-135M). What the model
  needs, not what the graphs run: a recomputed block, ``train.recompute``, is not counted twice.
  Elementwise ops are not counted: on any model where MFU means something they are a few percent of the
  FLOPs.
* **Peak** (:func:`measured_peak`): every rank times a square float32 MatMul in onnxruntime with the
  engine's threads and execution provider (MLAS on the CPU, cuBLAS on a GPU), best of a few runs, at
  start-up, all ranks at once: so ranks that share a machine's cores, caches or memory bandwidth measure
  the peak they share. The run's peak is the sum over ranks.

A graph whose matrix products' shapes cannot be inferred has no model FLOPs (None): the run logs no MFU.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

PRODUCTS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul")


def _dims(vi) -> list | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return None if any(d is None or d < 0 for d in dims) else dims


def _with_static_inputs(model, shapes: dict):
    """A copy of ``model`` whose graph inputs named in ``shapes`` (name -> shape) have those dims."""
    import onnx
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for vi in fixed.graph.input:
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            want = list(shapes[vi.name])
            if len(dims) != len(want):
                continue
            for d, n in zip(dims, want):
                d.Clear()
                d.dim_value = int(n)
    return fixed


def _inferred(model) -> dict:
    """Every value's static dims (name -> list) that shape inference finds: onnx's, then onnxruntime's
    symbolic shape inference where onnx's leaves a product's operand unknown."""
    import onnx
    known: dict = {}

    def collect(m):
        g = m.graph
        for vi in [*g.input, *g.value_info, *g.output]:
            if (d := _dims(vi)) is not None:
                known.setdefault(vi.name, d)
        for t in g.initializer:
            known.setdefault(t.name, list(t.dims))

    try:
        collect(onnx.shape_inference.infer_shapes(model, data_prop=True))
    except Exception:  # noqa: BLE001 - a graph onnx cannot infer: try onnxruntime's, below
        collect(model)
    if all(x in known for n in model.graph.node if n.op_type in PRODUCTS for x in n.input[:2] if x):
        return known
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
        collect(SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True))
    except Exception:  # noqa: BLE001 - left as onnx inferred it
        pass
    return known


def _attrs(node) -> dict:
    import onnx
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _einsum_flops(equation, shapes: list) -> float | None:
    """2 x the product of every index's size (the contraction's multiply-adds), for explicit equations
    without ellipses."""
    eq = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    if "..." in eq:
        return None
    lhs = eq.split("->")[0].split(",")
    sizes: dict = {}
    for term, dims in zip(lhs, shapes):
        if dims is None or len(dims) != len(term):
            return None
        sizes.update(zip(term, dims))
    return 2.0 * math.prod(sizes.values())


# FusedMatMul's layouts of an operand's two matrix dims (positions of M and K in A, of K and N in B): as it
# is, transposed, and with transBatch (dim 0 moved behind the batch dims), without and with the transpose
_LAYOUTS = ((-2, -1), (-1, -2), (0, -1), (-1, 0))


def _fused_contracted(a: list, b: list, out: list, attrs: dict | None) -> int | None:
    """FusedMatMul's contracted dim: from its attributes, or where they are unknown (a node onnxruntime
    fused, seen in a profile) the one that A's and B's layouts agree on with the output's M and N."""
    if len(a) == 1 or len(b) == 1:
        return a[0] if len(a) == 1 else b[0]
    if attrs is not None:
        if not attrs.get("transA", 0):
            return a[-1]
        return a[0] if attrs.get("transBatchA", 0) and len(a) > 2 else a[-2]
    batch = out[:-2]

    def fits(x: list, dim: int, want: int, other: int) -> bool:      # the dim is the output's, the rest batch
        rest = [d for i, d in enumerate(x) if i not in (dim % len(x), other % len(x))]
        return x[dim] == want and len(rest) <= len(batch) and \
            all(d in (1, o) for d, o in zip(reversed(rest), reversed(batch)))
    ks_b = {b[k] for k, n in _LAYOUTS[:2 + 2 * (len(b) > 2)] if fits(b, n, out[-1], k)}
    return next((a[k] for m, k in _LAYOUTS[:2 + 2 * (len(a) > 2)] if fits(a, m, out[-2], k) and a[k] in ks_b),
                None)


def product_flops(op: str, shapes: list, out: list | None, attrs: dict | None = None) -> float | None:
    """The forward FLOPs of one node ``op`` whose inputs have ``shapes`` and whose first output ``out`` (lists
    of dims, None where unknown): a matrix product's multiply-adds x 2, 0 for any other op (elementwise,
    shape, normalisation: not counted); None where a product's shapes are unknown. ``attrs``: the node's
    attributes, None where they are not known (a node onnxruntime fused, seen in a profile: a Gemm's or a
    FusedMatMul's contracted dim is then read from the shapes; an Einsum has no count without its equation)."""
    if op not in PRODUCTS:
        return 0.0
    if op == "Einsum":
        return None if attrs is None else _einsum_flops(attrs.get("equation", b""), shapes)
    a, b = (list(shapes) + [None, None])[:2]
    if op in ("MatMul", "FusedMatMul"):
        if a is None or b is None or out is None:
            return None
        k = a[-1] if op == "MatMul" else _fused_contracted(a, b, out, attrs)
        return None if k is None else 2.0 * math.prod(out) * k
    if op == "Gemm":
        if a is None or out is None or len(a) != 2 or not out:
            return None
        k = (a[0] if attrs.get("transA", 0) else a[1]) if attrs is not None else math.prod(a) // out[0]
        return 2.0 * math.prod(out) * k
    if op == "Conv":             # each output element: C_in / group x the kernel's size multiply-adds
        if b is None or out is None:
            return None
        return 2.0 * math.prod(out) * math.prod(b[1:])
    if b is None or a is None:   # ConvTranspose: each input element scattered through C_out / group x the kernel
        return None
    return 2.0 * math.prod(a) * math.prod(b[1:])


def _product_flops(node, known: dict) -> float | None:
    """The forward FLOPs of one matrix product of a graph whose values' dims are ``known``."""
    return product_flops(node.op_type, [known.get(x) for x in node.input],
                         known.get(node.output[0]) if node.output else None, _attrs(node))


def gradient_flow(model, trained) -> set:
    """The values of ``model``'s graph whose gradient a backward pass computes: the ``trained`` parameters
    and every value computed from one (the nodes are in dependency order, as ONNX requires)."""
    flow = set(trained)
    for node in model.graph.node:
        if any(x in flow for x in node.input if x):
            flow.update(o for o in node.output if o)
    return flow


def backward_flops(model, shapes: dict, trained) -> float | None:
    """The FLOPs of one forward and backward pass of ``model``'s matrix products, its inputs at ``shapes``
    (name -> shape), the parameters named in ``trained`` trained: each product's forward FLOPs once, and once
    more for each of its operands (an Einsum's: each one) that the gradient flows to; None when some
    product's shapes cannot be inferred."""
    known = _inferred(_with_static_inputs(model, shapes))
    flow = gradient_flow(model, trained)
    total = 0.0
    for node in model.graph.node:
        if node.op_type in PRODUCTS:
            flops = _product_flops(node, known)
            if flops is None:
                return None
            operands = node.input if node.op_type == "Einsum" else node.input[:2]
            total += flops * (1 + sum(x in flow for x in operands if x))
    return total


def training_flops(graphs_dir: str, shapes: dict, trained) -> float | None:
    """Model FLOPs of one micro-batch's forward and backward pass (:func:`backward_flops` over the forward
    graph, the parameters named in ``trained`` trained), the batch's inputs at ``shapes`` (name -> shape);
    None where they cannot be counted."""
    import onnx
    path = os.path.join(graphs_dir, "forward.onnx")
    if not os.path.exists(path):
        return None
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - no MFU rather than no run
        return None
    return backward_flops(model, shapes, trained)


def measured_peak(session, threads: int, n: int = 768, repeats: int = 2, min_s: float = 0.005) -> float:
    """This rank's peak float32 FLOP/s: the best of ``repeats`` runs of an n x n MatMul in onnxruntime on
    ``session``'s execution provider (with its options) and ``threads`` intra-op threads, operands on the
    provider's device; n doubles (up to 4096) until one product takes ``min_s``, so that a fast device's
    product is not over before it is timed."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ..step.sessions import session_options
    providers = session.get_providers()
    options = session.get_provider_options()
    cuda = providers[0] == "CUDAExecutionProvider"
    device, device_id = ("cuda", int(options[providers[0]].get("device_id", 0))) if cuda else ("cpu", 0)
    rng = np.random.default_rng(0)
    while True:
        g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "peak",
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n]) for x in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 9
        sess = ort.InferenceSession(model.SerializeToString(), session_options(max(1, threads), spinning=False),
                                    providers=providers, provider_options=[options.get(p, {}) for p in providers])
        binding = sess.io_binding()
        # the OrtValues are kept alive while bound (the binding holds only their memory's address)
        held = [ort.OrtValue.ortvalue_from_numpy(rng.random((n, n), np.float32), device, device_id)
                for _ in "ab"] + [ort.OrtValue.ortvalue_from_shape_and_type([n, n], np.float32, device, device_id)]
        binding.bind_ortvalue_input("a", held[0])
        binding.bind_ortvalue_input("b", held[1])
        binding.bind_ortvalue_output("c", held[2])
        sess.run_with_iobinding(binding)     # warm-up: packing, allocation, kernel selection
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            sess.run_with_iobinding(binding)
            if cuda:
                binding.synchronize_outputs()
            best = min(best, time.perf_counter() - t)
        if best >= min_s or n >= 4096:
            return 2.0 * n ** 3 / best
        n *= 2


class Utilisation:
    """A run's MFU: the model FLOPs of a global step (every rank's micro-batches) against the sum of the
    ranks' measured peaks. Built on every rank (one scalar allreduce: collective)."""

    def __init__(self, engine, comm, threads: int, accum: int):
        shapes = {name: buf.shape for name, buf in engine.batch.items()}
        micro = training_flops(engine.dir, shapes, {p["name"] for p in engine.manifest["params"]})
        self.step_flops = None if micro is None else micro * accum * comm.world_size
        self.rank_peak = measured_peak(engine.train_s.sessions[0], threads)
        self.peak = comm.allreduce_scalars([self.rank_peak])[0]

    def of(self, steps: int, seconds: float) -> float | None:
        """The MFU of ``steps`` global steps in ``seconds`` (None: the model's FLOPs are unknown)."""
        if self.step_flops is None or seconds <= 0 or self.peak <= 0:
            return None
        return self.step_flops * steps / seconds / self.peak

    def summary(self, steps: int, seconds: float) -> dict:
        """summary.json's figures: the MFU over the session, the model FLOPs of a step, the run's peak."""
        return {"mfu": self.of(steps, seconds), "model_flops_per_step": self.step_flops,
                "peak_flops": self.peak}
