"""trainrun's gradient builder on the ops of activations, trigonometry, more reductions, tiling, scatters, TopK,
Einsum and Resize, without torch (the py313 leg runs it): per op a tiny graph, loss = ReduceSum(y * w) with
random w, the builder's gradients run in onnxruntime against central finite differences of the loss in
float64: onnxruntime's forward graph in float64 where its CPU kernel has float64, else a NumPy reference of
the op (the gradient graph then in float32, with a float32 bound).

Bounds: the differences take a step of 1e-5 (1 for an op linear in its input, whose difference is exact), so in
float64 their error is about step^2 |f'''| + eps / step, below 1e-9 for these losses of order 1-10: 1e-6
relative leaves three orders of margin. A gradient graph computed in float32 is off by a few float32 roundings
per op it chains (unit roundoff 6e-8, chains of up to ~20 ops): 2e-5 relative of the gradient's largest."""

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from trainrun.graphs.autodiff import NoGradient, differentiate
from trainrun.graphs.exporters import FX_NODE, from_torch

F64, F32 = np.float64, np.float32
OPSET = 18


def model_of(nodes, inputs: dict, consts: dict = (), out="y", opset=OPSET, symbolic=False):
    """loss = ReduceSum(out * w): ``inputs`` graph inputs (name -> array; their dims declared, or named only if
    ``symbolic``), ``consts`` initializers; w, an input too, of out's type and any shape."""
    dtype = next(a.dtype for a in inputs.values() if a.dtype.kind == "f")
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    nodes = list(nodes) + [helper.make_node("Mul", [out, "w"], ["weighted"], name="weigh"),
                           helper.make_node("ReduceSum", ["weighted"], ["loss"], name="loss", keepdims=0)]
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype),
                                         [f"{n}{k}" for k in range(a.ndim)] if symbolic else a.shape)
           for n, a in inputs.items()]
    graph = helper.make_graph(nodes, "g", vis + [helper.make_tensor_value_info("w", elem, None)],
                              [helper.make_tensor_value_info("loss", elem, [])],
                              [numpy_helper.from_array(np.asarray(a), n) for n, a in dict(consts).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def session(model):
    """onnxruntime's basic optimizations only: the extended ones fuse into com.microsoft ops without float64
    kernels; the graph as built is what is checked."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def forward_of(model, out):
    """A session of ``model`` whose output is tensor ``out``."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    elem = probe.graph.output[0].type.tensor_type.elem_type
    del probe.graph.output[:]
    probe.graph.output.append(helper.make_tensor_value_info(out, elem, None))
    return session(probe)


def feeds_dtype(feeds):
    return next(a.dtype for a in feeds.values() if a.dtype.kind == "f")


def finite_differences(loss_of, values: dict, param: str, step: float) -> np.ndarray:
    """d loss / d values[param] by central differences, element by element, in float64."""
    x = values[param].astype(F64)
    grad = np.zeros_like(x)
    for k in np.ndindex(x.shape):
        h = step * max(1.0, abs(x[k])) if step < 1 else step
        for sign in (1, -1):
            moved = x.copy()
            moved[k] += sign * h
            grad[k] += sign * loss_of({**values, param: moved})
        grad[k] /= 2 * h
    return grad


def check(nodes, inputs: dict, params, consts: dict = (), ref=None, linear=False, out="y", opset=OPSET, seed=0,
          symbolic=False, prepare=None):
    """The builder's gradients of ``params`` against central differences: of onnxruntime's forward graph in
    float64 (inputs of float64), or of ``ref`` (NumPy, float64: name -> array -> ``out``), needed for float32
    inputs unless the op is ``linear`` in them (then the differences of onnxruntime's float32 output, summed in
    float64, are exact but for that output's rounding); ``prepare`` rewrites the graph first, as trainrun's
    prepare does. Returns the gradient graph."""
    model = model_of(nodes, inputs, consts, out, opset, symbolic)
    model = prepare(model) if prepare else model
    feeds = dict(inputs)
    dtype = feeds_dtype(feeds)
    forward = forward_of(model, out)
    y = forward.run([out], {**feeds, "w": np.zeros(1, dtype)})[0]
    w = np.random.default_rng(seed).standard_normal(y.shape).astype(dtype)
    grad_model = differentiate(model, list(params), "loss")
    assert {n.domain for n in grad_model.graph.node} <= {"", "ai.onnx"}
    got = session(grad_model).run([f"{p}_grad" for p in params], {**feeds, "w": w})
    tol = 1e-6 if dtype == F64 else 2e-5
    if ref is None:
        assert dtype == F64 or linear, "float32 inputs: the differences need a float64 NumPy reference of the op"

        def loss_of(values):
            cast = {n: v.astype(dtype) if v.dtype.kind == "f" else v for n, v in values.items()}
            return float((forward.run([out], {**cast, "w": w})[0].astype(F64) * w.astype(F64)).sum())
    else:
        consts64 = {n: np.asarray(a).astype(F64) if np.asarray(a).dtype.kind == "f" else np.asarray(a)
                    for n, a in dict(consts).items()}

        def loss_of(values):
            return float((ref({**consts64, **values}) * w.astype(F64)).sum())
    values = {n: a.astype(F64) if a.dtype.kind == "f" else a for n, a in feeds.items()}
    for p, g in zip(params, got):
        want = finite_differences(loss_of, values, p, 1.0 if linear else 1e-5)
        assert g.shape == want.shape, p
        np.testing.assert_allclose(g, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()), err_msg=p)
    return grad_model


def rand(*shape, dtype=F64, seed=0, low=None, high=None, away=()):
    """Normal values (uniform in [low, high] when given), each at least 0.05 from the points in ``away`` (the
    kinks of piecewise ops)."""
    rng = np.random.default_rng(seed + 31 * len(shape) + sum(shape))
    a = rng.uniform(low, high, shape) if low is not None else rng.standard_normal(shape)
    for point in away:
        near = np.abs(a - point) < 0.05
        a[near] = point + np.where(a[near] >= point, 0.05, -0.05) * 2
    return a.astype(dtype)


def node(op, ins, outs=("y",), **attrs):
    return helper.make_node(op, list(ins), list(outs), name=f"{op.lower()}_{'_'.join(i for i in ins if i)}", **attrs)


def celu(x, alpha):
    return np.maximum(0, x) + np.minimum(0, alpha * (np.exp(x / alpha) - 1))


# op, attributes, dtype (float32 where onnxruntime's CPU kernel is float only), input range and kinks,
# NumPy reference (float32 ops only)
UNARY = [
    ("Relu", {}, F64, dict(low=-3, high=3, away=(0,)), None),
    ("Relu", {}, F32, dict(low=-3, high=3, away=(0,)), lambda x: np.maximum(x, 0)),
    ("HardSigmoid", {}, F64, dict(low=-4, high=4, away=(-2.5, 2.5)), None),
    ("HardSigmoid", dict(alpha=0.5, beta=0.25), F64, dict(low=-3, high=3, away=(-0.5, 1.5)), None),
    ("HardSwish", {}, F64, dict(low=-5, high=5, away=(-3, 3)), None),
    ("Elu", {}, F64, dict(away=(0,)), None),
    ("Elu", dict(alpha=0.3), F64, dict(away=(0,)), None),
    ("Selu", {}, F64, dict(away=(0,)), None),
    ("Selu", dict(alpha=1.2, gamma=0.7), F64, dict(away=(0,)), None),
    ("Celu", {}, F32, dict(away=(0,)), lambda x: celu(x, 1.0)),
    ("Celu", dict(alpha=2.0), F32, dict(away=(0,)), lambda x: celu(x, 2.0)),
    ("Softsign", {}, F64, {}, None),
    ("Softplus", {}, F64, {}, None),
    ("Mish", {}, F64, {}, None),
    ("ThresholdedRelu", {}, F64, dict(low=-2, high=3, away=(1,)), None),
    ("ThresholdedRelu", dict(alpha=-0.5), F64, dict(away=(-0.5,)), None),
    ("Sin", {}, F64, dict(low=-4, high=4), None),
    ("Cos", {}, F32, dict(low=-4, high=4), np.cos),
    ("Tan", {}, F32, dict(low=-1.2, high=1.2), np.tan),
    ("Asin", {}, F32, dict(low=-0.9, high=0.9), np.arcsin),
    ("Acos", {}, F32, dict(low=-0.9, high=0.9), np.arccos),
    ("Atan", {}, F32, dict(low=-3, high=3), np.arctan),
    ("Sinh", {}, F32, {}, np.sinh),
    ("Cosh", {}, F32, {}, np.cosh),
    ("Asinh", {}, F32, dict(low=-3, high=3), np.arcsinh),
    ("Acosh", {}, F32, dict(low=1.2, high=4), np.arccosh),
    ("Atanh", {}, F32, dict(low=-0.9, high=0.9), np.arctanh),
]


@pytest.mark.parametrize("op,attrs,dtype,values,ref", UNARY,
                         ids=[f"{u[0]}{'-' + '-'.join(map(str, u[1].values())) if u[1] else ''}" for u in UNARY])
def test_unary_ops(op, attrs, dtype, values, ref):
    check([node(op, ["x"], **attrs)], {"x": rand(3, 5, dtype=dtype, **values)}, ["x"],
          ref=(lambda v: ref(v["x"])) if ref else None)


@pytest.mark.parametrize("exponent", [1.0, 2.0, 3.0, 2.5, -1.0])
def test_pow_of_a_constant_exponent(exponent):
    """Float64 finite differences; a whole exponent below 3 (an RMSNorm's square, GELU's cube) differentiated
    by products, no Pow in the gradient (onnxruntime's Pow is a scalar loop); others by Pow."""
    grad = check([node("Pow", ["x", "p"])], {"x": rand(3, 5, low=0.3, high=2.0)}, ["x"],
                 consts={"p": np.array(exponent)})
    pows = [n for n in grad.graph.node if n.op_type == "Pow"]
    assert len(pows) == (1 if exponent in (1.0, 2.0, 3.0) else 2), [n.name for n in pows]


@pytest.mark.parametrize("dtype", [F32, F64])
def test_relu_gradient_is_dy_exactly_where_the_output_is_positive(dtype):
    """Relu's gradient (dy times Ceil(Min(y, 1)) in float32 and float64): dy itself wherever y > 0, the
    smallest positive and the denormal included, and 0 where y = 0; bit for bit."""
    tiny = np.finfo(dtype).tiny
    x = np.array([-2.0, -tiny, 0.0, tiny / 4, tiny, 0.25, 1.0, 3e5], dtype)
    model = model_of([node("Relu", ["x"])], {"x": x})
    w = np.arange(1, 9, dtype=dtype) * dtype(1.5)
    got = session(differentiate(model, ["x"], "loss")).run(["x_grad"], {"x": x, "w": w})[0]
    np.testing.assert_array_equal(got, np.where(x > 0, w, dtype(0)))


@pytest.mark.parametrize("slope_shape", [(3, 1), (1,), (4,), (2, 3, 4), (1, 1, 1)])
def test_prelu_sums_the_slope_gradient_back_to_its_broadcast_shape(slope_shape):
    check([node("PRelu", ["x", "slope"])], {"x": rand(2, 3, 4, away=(0,)), "slope": rand(*slope_shape, seed=3)},
          ["x", "slope"])


REDUCTIONS = {"ReduceL2": lambda x, ax, k: np.sqrt((x * x).sum(ax, keepdims=k)),
              "ReduceLogSumExp": lambda x, ax, k: np.log(np.exp(x).sum(ax, keepdims=k)),
              "ReduceSumSquare": lambda x, ax, k: (x * x).sum(ax, keepdims=k),
              "ReduceL1": lambda x, ax, k: np.abs(x).sum(ax, keepdims=k),
              "ReduceProd": lambda x, ax, k: x.prod(ax, keepdims=k),
              "ReduceMean": lambda x, ax, k: x.mean(ax, keepdims=k)}


def reduce_case(op, x, axes, keepdims, opset, consts=()):
    """``op`` over ``axes`` (None: all), as an attribute before opset 18 and an input from it."""
    if axes is None or opset < 18:
        return [node(op, ["x"], keepdims=keepdims, **({"axes": axes} if axes is not None else {}))], {}
    return [node(op, ["x", "ax"], keepdims=keepdims)], {"ax": np.array(axes)}


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@pytest.mark.parametrize("axes,keepdims,opset", [([1], 0, 17), ([0, 2], 1, 17), ([-1], 0, 18), ([0, 2], 1, 18),
                                                 (None, 0, 18), (None, 1, 17)])
def test_reductions_with_axes_as_attribute_or_input(op, axes, keepdims, opset):
    """onnxruntime's CPU kernels: ReduceProd, and ReduceL1 / ReduceL2 before opset 18, in float32 only;
    ReduceL2's float64 kernel takes a float32 square root (1e-8 off): the differences are of NumPy's. ReduceProd
    with zeros: one in a slice (its gradient there the product of the others), two in another (all 0)."""
    dtype = F32 if op == "ReduceProd" or (op in ("ReduceL1", "ReduceL2") and opset < 18) else F64
    x = rand(2, 3, 4, dtype=dtype, low=0.3 if op == "ReduceLogSumExp" else None, high=2,
             away=(0,) if op == "ReduceL1" else ())
    if op == "ReduceProd":
        x[0, 1, 2] = 0
        x[1, 2, 0] = x[1, 0, 0] = 0
    nodes, consts = reduce_case(op, x, axes, keepdims, opset)
    ax = tuple(axes) if axes is not None else None
    check(nodes, {"x": x}, ["x"], consts, opset=opset,
          ref=(lambda v: REDUCTIONS[op](v["x"], ax, bool(keepdims))) if dtype == F32 or op == "ReduceL2" else None)


def test_reductions_without_axes_and_noop_are_the_identity():
    """ReduceSum with noop_with_empty_axes and no axes: the identity. The other reductions there are refused:
    onnxruntime 1.19 passes the input through, onnx's reference and onnxruntime 1.32 apply the op's
    elementwise part (x^2 for ReduceSumSquare), so no one gradient matches every runtime's forward."""
    for op in ("ReduceSumSquare", "ReduceLogSumExp"):      # runtimes disagree on the forward: refused
        for inputs, consts in ((["x", ""], {}), (["x", "ax"], {"ax": np.zeros(0, np.int64)})):
            with pytest.raises(NoGradient, match="noop_with_empty_axes"):
                check([node(op, inputs, noop_with_empty_axes=1)], {"x": rand(2, 3)}, ["x"], consts)
    for keepdims in (0, 1):     # an empty list of axes without noop: all axes
        check([node("ReduceSumSquare", ["x", "ax"], keepdims=keepdims)], {"x": rand(2, 3)}, ["x"],
              {"ax": np.zeros(0, np.int64)})
        check([node("ReduceSum", ["x", "ax"], keepdims=keepdims, noop_with_empty_axes=1)], {"x": rand(2, 3)}, ["x"],
              {"ax": np.zeros(0, np.int64)})


@pytest.mark.parametrize("bounds", [((0, 2), (2, 6)), ((2, 6), (0, 2), (0, 6)), ((0, 2), (3, 6))],
                         ids=["chunks", "chunks_and_whole", "a_gap"])
def test_slices_along_one_axis(bounds):
    """x read by Slices along one axis: where they tile it (a chunk's split written as Slices, as torch exports
    ``chunk``) its gradient is their dys concatenated, no Pad nor Sum; else the Pads of zeros summed."""
    slices = [node("Slice", ["x", f"s{k}", f"e{k}", "axis"], [f"p{k}"]) for k in range(len(bounds))]
    scaled = [node("Mul", [f"p{k}", f"p{k}"] if k == 0 else [f"p{k}", "three"], [f"q{k}"]) for k in range(len(bounds))]
    consts = {"axis": np.array([1]), "three": np.array(3.0)}
    for k, (b, e) in enumerate(bounds):
        consts.update({f"s{k}": np.array([b]), f"e{k}": np.array([e])})
    grad = check(slices + scaled + [node("Concat", [f"q{k}" for k in range(len(bounds))], axis=1)],
                 {"x": rand(2, 6, 3)}, ["x"], consts=consts)
    ops = [n.op_type for n in grad.graph.node if n.name.startswith("grad/")]
    assert ("Pad" in ops) == (len(bounds) != 2 or bounds[1][0] != 2), ops


def test_tile():
    check([node("Tile", ["x", "r"])], {"x": rand(2, 1, 3)}, ["x"], {"r": np.array([2, 3, 1])})


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2])
def test_trilu(upper, k):
    check([node("Trilu", ["x"] + (["k"] if k is not None else []), upper=upper)], {"x": rand(2, 3, 4)}, ["x"],
          {"k": np.array(k)} if k is not None else {})


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [1, -1])
def test_cumsum(exclusive, reverse, axis):
    check([node("CumSum", ["x", "axis"], exclusive=exclusive, reverse=reverse)], {"x": rand(2, 3, 4)}, ["x"],
          {"axis": np.array(axis)})


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_space_to_depth(mode):
    check([node("DepthToSpace", ["x"], blocksize=2, mode=mode)], {"x": rand(2, 8, 2, 3)}, ["x"], linear=True)
    check([node("SpaceToDepth", ["x"], blocksize=2)], {"x": rand(1, 2, 4, 6)}, ["x"], linear=True)


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements_and_scatter_nd(reduction):
    """Repeated indices with reduction add (each update's gradient its position's dy)."""
    idx = np.array([[1, 0, 2], [0, 2, 2]]) if reduction == "add" else np.array([[1, 0, 2], [0, 2, 1]])
    check([node("ScatterElements", ["d", "i", "u"], axis=1, reduction=reduction)],
          {"d": rand(2, 4), "u": rand(2, 3, seed=1)}, ["d", "u"], {"i": idx}, linear=True)
    nd = np.array([[[0, 1], [1, 3]], [[1, 0], [1, 3 if reduction == "add" else 2]]])
    check([node("ScatterND", ["d", "i", "u"], reduction=reduction)], {"d": rand(2, 4, 3), "u": rand(2, 2, 3, seed=1)},
          ["d", "u"], {"i": nd}, linear=True)
    check([node("ScatterND", ["d", "i", "u"], reduction=reduction)], {"d": rand(3, 2), "u": rand(2, 2, seed=1)},
          ["d", "u"], {"i": np.array([[2], [0]])}, linear=True)


@pytest.mark.parametrize("axis,largest,k", [(-1, 1, 2), (0, 0, 1), (1, 1, 3)])
def test_top_k_values(axis, largest, k):
    check([node("TopK", ["x", "k"], ["y", "i"], axis=axis, largest=largest)], {"x": rand(3, 4)}, ["x"],
          {"k": np.array([k])})
    check([node("TopK", ["x", "k"], ["y", "i"], axis=axis, largest=largest, sorted=0)], {"x": rand(3, 4)}, ["x"],
          {"k": np.array([k])})


# (a letter of size 1 against another size, "ij,ij->ij" on [1, 3] and [2, 3], is no ONNX Einsum: the spec
# broadcasts through the ellipsis only; onnxruntime 1.19 broadcast it, 1.32 reads i from the first operand)
EINSUM = [("ij,jk->ik", (2, 3), (3, 4)), ("bhqd,bhkd->bhqk", (2, 2, 3, 4), (2, 2, 5, 4)), ("ij,jk", (2, 3), (3, 4)),
          ("ii->i", (3, 3)), ("ii", (3, 3)), ("ij->", (2, 3)), ("ij->i", (2, 3)), ("ji", (2, 3)),
          ("i,j->ij", (2,), (3,)),
          ("...ij,...jk->...ik", (2, 1, 3, 4), (1, 5, 4, 2)),
          ("i...j,j->...i", (2, 4, 5, 3), (3,)), ("iij,jk->ik", (3, 3, 2), (2, 4)), ("ijk,k->", (2, 3, 4), (4,)),
          ("bIj,bJj->bIJ", (2, 3, 4), (2, 2, 4)), ("ij,jk,kl->il", (2, 3), (3, 4), (4, 2)), ("iji->j", (3, 2, 3)),
          ("...", (2, 3)), ("i j , j k -> k i", (2, 3), (3, 4))]


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("case", EINSUM, ids=[e[0].replace(" ", "_") for e in EINSUM])
def test_einsum(case, symbolic):
    """Every operand's gradient: contractions, diagonals, sums inside one operand, size-1 dims broadcast (by
    '...' and by a letter), an implicit output; with dims known when the graph is built, and not."""
    equation, *shapes = case
    names = [f"x{k}" for k in range(len(shapes))]
    check([node("Einsum", names, equation=equation)],
          {n: rand(*shape, seed=k) for k, (n, shape) in enumerate(zip(names, shapes))}, names, symbolic=symbolic)


F32_SCALES = np.array([1, 1, 2, 1.5], F32)
RESIZE = {
    "nearest": ({}, dict(scales=F32_SCALES)),
    "nearest asymmetric floor": (dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
                                 dict(scales=F32_SCALES)),
    "nearest ceil down": (dict(nearest_mode="ceil"), dict(scales=np.array([1, 1, 0.7, 0.5], F32))),
    "linear": (dict(mode="linear"), dict(scales=F32_SCALES)),
    "linear align_corners sizes": (dict(mode="linear", coordinate_transformation_mode="align_corners"),
                                   dict(sizes=np.array([1, 2, 5, 7]))),
    "linear pytorch_half_pixel down": (dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
                                       dict(scales=np.array([1, 1, 0.5, 0.5], F32))),
    "linear antialias down": (dict(mode="linear", antialias=1), dict(scales=np.array([1, 1, 0.6, 0.5], F32))),
    "cubic": (dict(mode="cubic", cubic_coeff_a=-0.5), dict(scales=F32_SCALES)),
    "cubic exclude_outside": (dict(mode="cubic", exclude_outside=1), dict(sizes=np.array([1, 2, 4, 7]))),
    "tf_crop_and_resize": (dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
                                extrapolation_value=5.0),
                           dict(roi=np.array([0, 0, 0.2, -0.1, 1, 1, 0.9, 0.8], F32), scales=F32_SCALES)),
    "axes": (dict(mode="linear", axes=[3, 2]), dict(scales=np.array([1.5, 2], F32))),     # (1.19 reads -2 wrong)
    "half_pixel_symmetric": (dict(mode="linear", coordinate_transformation_mode="half_pixel_symmetric"),
                             dict(sizes=np.array([1, 2, 5, 7]))),
}


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("case", sorted(RESIZE))
def test_resize(case, symbolic):
    """onnxruntime's Resize is float32 only (and linear in x: the differences are exact)."""
    attrs, given = RESIZE[case]
    inputs = ["x"] + [k if k in given else "" for k in ("roi", "scales", "sizes")]
    while not inputs[-1]:
        inputs.pop()
    check([node("Resize", inputs, **attrs)], {"x": rand(1, 2, 3, 4, dtype=F32)}, ["x"], given, linear=True,
          symbolic=symbolic, opset=19 if case == "half_pixel_symmetric" else OPSET)


def test_resize_of_an_opset_11_graph_with_sizes_and_empty_scales():
    """torch.onnx's form of F.interpolate(size=...): an empty roi and scales, the sizes; opset 11, converted."""
    check([node("Resize", ["x", "roi", "scales", "sizes"], mode="linear",
                coordinate_transformation_mode="pytorch_half_pixel")], {"x": rand(1, 1, 3, 4, dtype=F32)}, ["x"],
          {"roi": np.zeros(0, F32), "scales": np.zeros(0, F32), "sizes": np.array([1, 1, 6, 3])}, linear=True, opset=11)


@pytest.mark.parametrize("case", ["attention", "broadcast_p", "softmax_not_last"])
def test_softmax_read_by_one_product(case):
    """O = Softmax(S) @ V differentiated as one (autodiff/patterns.py: sum_j dP_ij P_ij as sum_d dO_id O_id,
    over [.., T, head]), S = Q K^T scaled and masked; P broadcast against V's batch dims, or a Softmax along
    another axis, node by node: every form against the differences."""
    heads, t, d = 2, 4, 3
    p_batch = [1, heads] if case == "broadcast_p" else [2, heads]
    inputs = {"q": rand(*p_batch, t, d, seed=1), "k": rand(*p_batch, t, d, seed=2), "v": rand(2, heads, t, d, seed=3)}
    mask = np.triu(np.full((t, t), -1e4), 1)
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["s"]),
             node("Mul", ["s", "scale"], ["ss"]), node("Add", ["ss", "mask"], ["sm"]),
             node("Softmax", ["sm"], ["p"], axis=2 if case == "softmax_not_last" else -1),
             node("MatMul", ["p", "v"], ["y"])]
    grad = check(nodes, inputs, ["q", "k", "v"], {"scale": np.array(0.5), "mask": mask})
    made = {o: n for n in grad.graph.node for o in n.output}
    sums = [made.get(n.input[0]) for n in grad.graph.node if n.op_type == "ReduceSum"]
    dot = [m for m in sums if m is not None and m.name.startswith("grad/") and m.op_type == "Mul"
           and {"y", "p"} & set(m.input)]
    assert len(dot) == 1 and ("y" in dot[0].input) == (case == "attention")          # dO * O, else dP * P


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_op(approximate):
    """Gelu (opset 20): erf's form in ten passes, tanh's as a Sigmoid of 2 w in thirteen; a float64 NumPy
    reference (onnxruntime's Gelu is float32 only)."""
    erf = np.vectorize(math.erf)

    def ref(v):
        x = v["x"]
        if approximate == "tanh":
            return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
        return 0.5 * x * (1 + erf(x / math.sqrt(2)))
    grad = check([node("Gelu", ["x"], approximate=approximate)], {"x": rand(4, 5, dtype=F32) * 2}, ["x"], ref=ref,
                 opset=20)
    passes = [n.op_type for n in grad.graph.node if n.name.startswith("grad/gelu_x/") and n.op_type != "Constant"]
    assert len(passes) == {"none": 10, "tanh": 13}[approximate], passes


@pytest.mark.parametrize("form", ["bert", "torch", "shared"])
def test_erf_gelu_written_out(form):
    """0.5 y (1 + erf(y / sqrt 2)) differentiated as one (autodiff/patterns.py): BERT's form (u = y c, h = (e + 1)
    0.5, act = y h) and torch's export (u = y / sqrt 2, act = (y (e + 1)) 0.5), no Erf gradient's Neg; where erf's
    value also feeds the loss, node by node. float32 graphs (onnxruntime's Erf), a float64 NumPy reference."""
    erf = np.vectorize(math.erf)
    if form == "torch":
        gelu = [node("Div", ["y", "sqrt2"], ["u"]), node("Erf", ["u"], ["e"]), node("Add", ["e", "one"], ["p"]),
                node("Mul", ["y", "p"], ["q"]), node("Mul", ["q", "half"], ["act"])]
    else:
        gelu = [node("Mul", ["y", "rsqrt2"], ["u"]), node("Erf", ["u"], ["e"]), node("Add", ["one", "e"], ["p"]),
                node("Mul", ["p", "half"], ["h"]), node("Mul", ["h", "y"], ["act"])]
    nodes = [node("MatMul", ["x", "m"], ["y"]), *gelu,
             node("Add", ["act", "e"] if form == "shared" else ["act", "act"], ["out"])]
    consts = {"sqrt2": np.array(math.sqrt(2), F32), "rsqrt2": np.array(1 / math.sqrt(2), F32),
              "one": np.array(1.0, F32), "half": np.array(0.5, F32)}

    def ref(v):
        y = v["x"] @ v["m"]
        e = erf(y / math.sqrt(2))
        return 0.5 * y * (1 + e) + (e if form == "shared" else 0.5 * y * (1 + e))
    grad = check(nodes, {"x": rand(3, 4, seed=1, dtype=F32), "m": rand(4, 5, seed=2, dtype=F32)}, ["x", "m"],
                 consts=consts, ref=ref, out="out")
    assert ("Neg" in [n.op_type for n in grad.graph.node]) == (form == "shared")


@pytest.mark.parametrize("broadcast", [False, True])
def test_products_of_named_dims_sum_only_where_broadcast(broadcast):
    """A batched MatMul whose dims are symbols (a sequence length not fixed when built): where the operands'
    batch dims name the output's, their gradients are the products themselves, no run-time broadcast search;
    an operand of batch 1 against a named batch is summed over it."""
    symbols = {"a": [None if broadcast else "B", "T"], "b": ["B"]}

    def named(model):
        for vi in model.graph.input:
            for dim, sym in zip(vi.type.tensor_type.shape.dim, symbols.get(vi.name, [])):
                if sym:
                    dim.dim_param = sym
        return model
    inputs = {"a": rand(1 if broadcast else 2, 3, 4, seed=1), "b": rand(2, 4, 5, seed=2)}
    grad = check([node("MatMul", ["a", "b"])], inputs, ["a", "b"], prepare=named)
    searched = [n for n in grad.graph.node if n.op_type == "NonZero" and n.name.startswith("grad/matmul")]
    assert len(searched) == broadcast, [n.name for n in searched]


def test_refused_cases_are_named():
    aspect = model_of([node("Resize", ["x", "", "", "sizes"], keep_aspect_ratio_policy="not_larger")],
                      {"x": rand(1, 1, 3, 4, dtype=F32)}, {"sizes": np.array([1, 1, 6, 6])})
    with pytest.raises(NoGradient, match="Resize node 'resize_x_sizes'.*keep_aspect_ratio_policy not_larger"):
        differentiate(aspect, ["x"], "loss")
    scale = model_of([node("Resize", ["x", "", "s"])], {"x": rand(1, 1, 3, 4, dtype=F32), "s": F32_SCALES})
    with pytest.raises(NoGradient, match="Resize node 'resize_x_s'.*scales or sizes depend on a parameter"):
        differentiate(scale, ["x", "s"], "loss")
    scatter = model_of([node("ScatterElements", ["d", "i", "u"], reduction="max")], {"d": rand(3), "u": rand(2)},
                       {"i": np.array([0, 2])})
    with pytest.raises(NoGradient, match="ScatterElements node 'scatterelements_d_i_u'.*reduction max"):
        differentiate(scatter, ["d"], "loss")
    einsum = model_of([node("Einsum", ["a", "b"], equation="ij->j")], {"a": rand(2, 3), "b": rand(3)})
    with pytest.raises(NoGradient, match="Einsum node 'einsum_a_b'.*names 1 operands, the node has 2"):
        differentiate(einsum, ["a"], "loss")


@pytest.mark.parametrize("op", ["Ceil", "Floor", "Round", "Sign"])
def test_piecewise_constant_ops_pass_no_gradient(op):
    """y = x * op(x): the derivative op(x) away from the steps (op(x) a constant to the walk)."""
    steps = np.arange(-3, 3.5, 0.5)         # Ceil's and Floor's at integers, Round's at halves, Sign's at 0
    check([node(op, ["x"], ["c"]), node("Mul", ["x", "c"])], {"x": rand(3, 4, low=-3, high=3, away=steps)}, ["x"])


def test_cast_like():
    """CastLike's gradient goes to its first input, cast back; the second input (the type's source) gets none:
    torch's dynamo exporter writes ``CastLike(constant, x)`` before x's mean-pool, Where and the like."""
    check([node("CastLike", ["c", "x"], ["k"]), node("CastLike", ["x", "like"], ["x2"]),
           node("Mul", ["k", "x2"], ["kx"]), node("Mul", ["kx", "x"])], {"x": rand(2, 3)}, ["x"], {"c": np.array(1.5), "like": np.zeros(1, F64)})


def as_dynamo_export(model):
    """``model`` marked as torch's dynamo exporter marks its nodes, read as trainrun reads such a graph
    (graphs/exporters.py)."""
    model.graph.node[0].metadata_props.add(key=FX_NODE, value="%split : [num_users=2] = call_function[...]")
    return from_torch(model, "m.onnx")[0]


@pytest.mark.parametrize("sizes", [np.array(2), np.array([1, 3])])
def test_split_to_sequence_of_the_dynamo_exporter(sizes):
    """torch.split as the dynamo exporter writes it without its optimizer (GPT-2's fused q/k/v): SplitToSequence
    (one size, or the sizes) read by SequenceAt at constant positions (one negative) is read as one Split:
    the same values, gradients that the finite differences confirm, no sequence left."""
    nodes = [node("SplitToSequence", ["x", "sizes"], ["seq"], axis=1), node("SequenceAt", ["seq", "last"], ["a"]),
             node("SequenceAt", ["seq", "first"], ["b"]), node("Mul", ["a", "b"])]
    x, consts = rand(2, 4, 3), {"sizes": sizes, "first": np.array(0), "last": np.array(-1)}
    grads = check(nodes, {"x": x}, ["x"], consts, prepare=as_dynamo_export)
    assert not {"SplitToSequence", "SequenceAt"} & {n.op_type for n in grads.graph.node}
    w = np.ones((2, 2, 3) if sizes.ndim == 0 else (2, 3, 3))
    written = model_of(nodes, {"x": x}, consts)
    want = session(written).run(["loss"], {"x": x, "w": w})[0]
    assert session(as_dynamo_export(written)).run(["loss"], {"x": x, "w": w})[0] == want


def test_mean_over_axes_the_dynamo_exporter_reshapes():
    """torch's ``x.mean(-1, keepdim=True)`` (an RMSNorm's) as the dynamo exporter writes it: the axes a Reshape of
    two Constants ``value_ints``, which shape inference does not follow; read as the Constant it is, the mean's
    rank and the rules' axes are known."""
    nodes = [node("Constant", [], ["axes_flat"], value_ints=[-1]), node("Constant", [], ["flat"], value_ints=[-1]),
             node("Reshape", ["axes_flat", "flat"], ["axes"]), node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
             node("Mul", ["x", "m"], ["xm"]), node("MatMul", ["xm", "v"])]
    check(nodes, {"x": rand(2, 3), "v": rand(3, 2, seed=1)}, ["x", "v"], prepare=as_dynamo_export)


def branch(nodes, outputs, initializers=()):
    """An If's branch: ``nodes``, its ``outputs`` (float64, shapes left to inference)."""
    return helper.make_graph(nodes, "branch", [], [helper.make_tensor_value_info(o, onnx.TensorProto.DOUBLE, None)
                                                   for o in outputs],
                             [numpy_helper.from_array(np.asarray(a), n) for n, a in dict(initializers).items()])


def tile_like_ifs(condition_nodes):
    """An If on condition ``c`` as torch's legacy exporter writes one before a Tile: the then branch reads ``x``
    and ``v`` from the graph around it, holds an initializer and a nested If on its own values (whose branches
    read them); the else branch other functions of x."""
    inner = node("If", ["k"], ["n"], then_branch=branch([node("Add", ["m", "scaled"], ["n_then"])], ["n_then"]),
                 else_branch=branch([node("Identity", ["m"], ["n_else"])], ["n_else"]))
    then = branch([node("Mul", ["x", "v"], ["m"]), node("Mul", ["m", "scale"], ["scaled"]),
                   node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(True))), inner], ["n", "m"],
                  {"scale": np.array(1.5)})
    other = branch([node("Neg", ["x"], ["neg"]), node("Sin", ["x"], ["sin"])], ["neg", "sin"])
    return list(condition_nodes) + [node("If", ["c"], ["y1", "y2"], then_branch=then, else_branch=other),
                                    node("Mul", ["y1", "y2"])]


RANK_ABOVE_2 = [node("Shape", ["x"], ["s"]), node("Size", ["s"], ["r"]), node("Greater", ["r", "two"], ["c"])]
FIRST_DIM_IS_2 = [node("Shape", ["x"], ["s"], end=1), node("Squeeze", ["s"], ["s0"]),
                  node("Equal", ["s0", "two"], ["c"])]


@pytest.mark.parametrize("condition,symbolic,taken", [(RANK_ABOVE_2, True, "then"), (FIRST_DIM_IS_2, False, "then"),
                                                      ([node("Less", ["two", "one"], ["c"])], True, "else")],
                         ids=["rank-of-symbolic-dims", "static-dim", "constant-false"])
def test_an_if_whose_condition_is_known_is_its_branch(condition, symbolic, taken):
    """An If whose condition folds when the graph is built (from constants, a rank, a static dim) is replaced by
    the branch it takes, nested Ifs, initializers and outer-scope reads included:
    gradients through it equal the finite differences of the graph with the If, and no If is left."""
    grads = check(tile_like_ifs(condition), {"x": rand(2, 3, 4), "v": rand(3, 4, seed=1)}, ["x", "v"],
                  {"two": np.array(2), "one": np.array(1)}, symbolic=symbolic)
    ops = {n.op_type for n in grads.graph.node}
    assert "If" not in ops and ("Sin" in ops) == (taken == "else")


def test_a_branch_that_gives_an_outer_value_or_one_value_twice():
    """Valid ONNX that onnxruntime refuses to run as an If (an outer value returned by a branch, one value as two
    outputs) runs once the branch is inlined: Identity nodes write the If's outputs."""
    from trainrun.graphs.autodiff.branches import inline_known_ifs
    then = branch([node("Neg", ["x"], ["n"])], ["x", "n", "n"])
    nodes = [node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([True]))),
             node("If", ["c"], ["a", "b", "d"], then_branch=then, else_branch=then), node("Sum", ["a", "b", "d"])]
    x = rand(2, 3)
    model = inline_known_ifs(model_of(nodes, {"x": x}))
    assert "If" not in {n.op_type for n in model.graph.node}
    np.testing.assert_array_equal(forward_of(model, "y").run(["y"], {"x": x, "w": np.ones(1)})[0], -x)


def test_an_if_whose_condition_is_not_known_is_named():
    """A condition that depends on the data, or on a dim the graph leaves open, is refused naming the If (exit 2 in
    a run), not the Shape and comparison nodes before it."""
    from trainrun.errors import UsageError
    from trainrun.graphs.gradients import build_train_graph
    data = [node("ReduceSum", ["x"], ["total"], keepdims=0), node("Greater", ["total", "zero"], ["c"])]
    for condition, symbolic in ((data, False), (FIRST_DIM_IS_2, True)):
        model = model_of(tile_like_ifs(condition), {"x": rand(2, 3, 4), "v": rand(3, 4, seed=1)},
                         {"two": np.array(2), "zero": np.array(0.0)}, symbolic=symbolic)
        with pytest.raises(NoGradient, match="If node 'if_c': its condition 'c' is not known when the graph is built"):
            differentiate(model, ["x", "v"], "loss")
        with pytest.raises(UsageError, match="cannot differentiate this graph: If node 'if_c'") as err:
            build_train_graph(model, ["x", "v"], "m.onnx", builder="trainrun")
        assert err.value.exit_code == 2


def test_gathers_with_repeated_indices_sum_them_in_parallel_threads_too():
    """The gradients of a Gather along axis 1 and of a GatherND of 2-D coordinates (negative ones too) add
    dy's rows at repeated indices by ScatterElements, not ScatterND: onnxruntime's ScatterND adds in parallel
    threads and lost a sum where an index repeats (1.32, 2 threads, 65,536 rows of 16 into 1,000). Many
    repeats, 2 threads, five runs each: every run equals NumPy's add.at; a finite-difference check on a small
    case of each."""
    check([node("Gather", ["x", "idx"], axis=1)], {"x": rand(2, 5, 3), "idx": np.array([[4, 1], [1, -1]])}, ["x"])
    check([node("GatherND", ["x", "coords"])], {"x": rand(3, 4, 2), "coords": np.array([[1, -1], [0, 3], [1, 3]])},
          ["x"])
    rng = np.random.default_rng(0)
    cases = [([node("Gather", ["x", "idx"], axis=1)], rng.standard_normal((2, 1000, 8)).astype(np.float32),
              {"idx": rng.integers(0, 1000, (32768,))}),
             ([node("GatherND", ["x", "coords"])], rng.standard_normal((50, 20, 16)).astype(np.float32),
              {"coords": np.stack([rng.integers(-50, 50, 65536), rng.integers(0, 20, 65536)], axis=1)})]
    for nodes, x, idx in cases:
        model = model_of(nodes, {"x": x, **idx})
        grad_model = differentiate(model, ["x"], "loss")
        assert "ScatterND" not in {n.op_type for n in grad_model.graph.node}
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        sess = ort.InferenceSession(grad_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        y = forward_of(model, "y").run(["y"], {"x": x, **idx, "w": np.zeros(1, np.float32)})[0]
        w = np.ones(y.shape, np.float32)
        want = np.zeros(x.shape, F64)
        if "idx" in idx:
            np.add.at(want, (slice(None), idx["idx"]), w.astype(F64))
        else:
            np.add.at(want, (idx["coords"][:, 0], idx["coords"][:, 1]), w.astype(F64))
        for _ in range(5):
            got = sess.run(["x_grad"], {"x": x, **idx, "w": w})[0]
            assert np.array_equal(got, want.astype(np.float32))
