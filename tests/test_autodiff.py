"""trainrun's own gradient builder (trainrun/graphs/autodiff) against torch autograd: per op a tiny graph,
loss = ReduceSum(output * random weights), the emitted gradients run in onnxruntime and compared to
torch's (float64 where onnxruntime's CPU kernels have it); the emitted graph holds standard ONNX ops only."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainrun.graphs.autodiff import NoGradient, differentiate
from trainrun.models.onnx_builder import OPSET

torch = pytest.importorskip("torch", reason="needs torch (the test extra), not installed here")

F64, F32 = np.float64, np.float32
ONNX_TYPE = {F64: TensorProto.DOUBLE, F32: TensorProto.FLOAT}


def float_type(inputs: dict):
    return next(a.dtype.type for a in inputs.values() if a.dtype.kind == "f")


def model_of(nodes, inputs: dict, initializers: dict = (), out="y", unknown_dims=False, opset=OPSET):
    """A model whose loss is ReduceSum(out * w); ``inputs`` name -> array (``w`` added), declared with their
    shapes, or with their ranks only if ``unknown_dims``."""
    dtype = float_type(inputs)
    nodes = list(nodes) + [helper.make_node("Mul", [out, "w"], ["weighted"], name="weigh"),
                           helper.make_node("ReduceSum", ["weighted"], ["loss"], name="loss", keepdims=0)]
    vis = [helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                         [f"{n}{k}" for k in range(a.ndim)] if unknown_dims else a.shape)
           for n, a in inputs.items()]
    graph = helper.make_graph(nodes, "g", vis + [helper.make_tensor_value_info("w", ONNX_TYPE[dtype], None)],
                              [helper.make_tensor_value_info("loss", ONNX_TYPE[dtype], [])],
                              [numpy_helper.from_array(a, n) for n, a in dict(initializers).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def output_shape(model, feeds, out):
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info(out, probe.graph.output[0].type.tensor_type.elem_type,
                                                            None))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([out], {**feeds, "w": np.zeros(1, float_type(feeds))})[0].shape


def check(nodes, inputs: dict, params: list[str], torch_fn, initializers: dict = (), out="y", seed=0,
          unknown_dims=False, opset=OPSET, tol=None):
    """The builder's gradients of every name in ``params`` against torch autograd of ``torch_fn``."""
    rng = np.random.default_rng(seed)
    dtype = float_type(inputs)
    feeds = {n: a for n, a in inputs.items()}
    model = model_of(nodes, inputs, initializers, out, unknown_dims, opset)
    w = rng.standard_normal(output_shape(model, feeds, out)).astype(dtype)
    grad_model = differentiate(model, params, "loss")
    assert {n.domain for n in grad_model.graph.node} <= {"", "ai.onnx"}
    sess = ort.InferenceSession(grad_model.SerializeToString(), basic_optimizations(),
                                providers=["CPUExecutionProvider"])
    got = sess.run([f"{p}_grad" for p in params], {**feeds, "w": w})
    tensors = {n: torch.tensor(a, requires_grad=n in params) for n, a in {**feeds, **dict(initializers)}.items()}
    (torch_fn(tensors) * torch.tensor(w)).sum().backward()
    tol = tol or (1e-10 if dtype is F64 else 1e-5)
    for p, g in zip(params, got):
        want = tensors[p].grad.numpy()
        assert g.shape == want.shape, p
        np.testing.assert_allclose(g, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()), err_msg=p)


def basic_optimizations():
    """onnxruntime's extended optimizations fuse MatMul + Transpose into com.microsoft FusedMatMul, which has
    no float64 kernel; the graph as emitted is what is checked."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return options


def rand(*shape, dtype=F64, seed=None, positive=False):
    a = np.random.default_rng(seed if seed is not None else sum(shape) * 7 + len(shape)).standard_normal(shape)
    return (np.abs(a) + 0.5 if positive else a).astype(dtype)


def node(op, ins, outs=("y",), **attrs):
    return helper.make_node(op, list(ins), list(outs), name=f"{op.lower()}_{'_'.join(ins)}", **attrs)


def binary(op, fn, a_shape, b_shape, positive_b=False):
    """Once with static shapes (broadcast axes known when the graph is built), once with the dims unknown
    (the axes found at run time)."""
    for unknown in (False, True):
        check([node(op, ["a", "b"])], {"a": rand(*a_shape, seed=1), "b": rand(*b_shape, seed=2, positive=positive_b)},
              ["a", "b"], lambda t: fn(t["a"], t["b"]), unknown_dims=unknown)


@pytest.mark.parametrize("op,fn", [("Add", torch.add), ("Sub", torch.sub), ("Mul", torch.mul),
                                   ("Div", torch.div)])
def test_binary_ops_with_broadcasting(op, fn):
    binary(op, fn, (2, 3, 4), (2, 3, 4), positive_b=op == "Div")
    binary(op, fn, (2, 3, 4), (3, 1), positive_b=op == "Div")      # b broadcast along axes 0 and 2
    binary(op, fn, (1, 4), (2, 3, 1), positive_b=op == "Div")      # both broadcast


UNARY = [("Neg", torch.neg, F64, False), ("Sqrt", torch.sqrt, F64, True), ("Exp", torch.exp, F64, False),
         ("Log", torch.log, F64, True), ("Tanh", torch.tanh, F64, False), ("Sigmoid", torch.sigmoid, F64, False),
         ("Relu", torch.relu, F64, False), ("Erf", torch.erf, F32, False), ("Identity", lambda x: x, F64, False)]


@pytest.mark.parametrize("op,fn,dtype,positive", UNARY, ids=[u[0] for u in UNARY])
def test_unary_ops(op, fn, dtype, positive):
    check([node(op, ["x"])], {"x": rand(3, 5, dtype=dtype, positive=positive)}, ["x"], lambda t: fn(t["x"]))


def test_pow_with_a_constant_exponent_and_cast():
    check([node("Pow", ["x", "p"], ["p_out"]), node("Cast", ["p_out"], ["p32"], to=TensorProto.FLOAT),
           node("Cast", ["p32"], to=TensorProto.DOUBLE)], {"x": rand(3, 4, positive=True)}, ["x"],
          lambda t: (t["x"] ** 2.5).float().double(), initializers={"p": np.array(2.5)})
    with pytest.raises(NoGradient, match="Pow node 'pow_x_p'.*exponent"):
        differentiate(model_of([node("Pow", ["x", "p"])], {"x": rand(2), "p": rand(2)}), ["x", "p"], "loss")


def test_where():
    cond = rand(3, 4, seed=5) > 0
    check([node("Where", ["c", "a", "b"])], {"c": cond, "a": rand(3, 4, seed=1), "b": rand(4, seed=2)},
          ["a", "b"], lambda t: torch.where(t["c"], t["a"], t["b"]))


@pytest.mark.parametrize("a_shape,b_shape", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)),
                                             ((4,), (2, 4, 5)), ((2, 3, 4), (4,)), ((4,), (4,))])
def test_matmul(a_shape, b_shape):
    binary("MatMul", torch.matmul, a_shape, b_shape)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(trans_a, trans_b):
    a, b = rand(*((4, 3) if trans_a else (3, 4)), seed=1), rand(*((5, 4) if trans_b else (4, 5)), seed=2)
    c = rand(5, seed=3)
    alpha, beta = float(np.float32(0.7)), float(np.float32(1.3))      # float attributes

    def fn(t):
        ta = t["a"].T if trans_a else t["a"]
        tb = t["b"].T if trans_b else t["b"]
        return alpha * ta @ tb + beta * t["c"]
    check([node("Gemm", ["a", "b", "c"], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)],
          {"a": a, "b": b, "c": c}, ["a", "b", "c"], fn)


def test_reshape_transpose_unsqueeze_squeeze_flatten():
    check([node("Reshape", ["x", "s"], ["r"]), node("Transpose", ["r"], ["t"], perm=[2, 0, 1]),
           node("Unsqueeze", ["t", "ax"], ["u"]), node("Squeeze", ["u", "ax"], ["q"]),
           node("Flatten", ["q"], ["f"], axis=1), node("Transpose", ["f"])],
          {"x": rand(6, 4)}, ["x"],
          lambda t: t["x"].reshape(2, 3, 4).permute(2, 0, 1).reshape(4, 6).T,
          initializers={"s": np.array([2, 3, 4]), "ax": np.array([1])})


def test_concat_and_split():
    check([node("Concat", ["a", "b"], ["c"], axis=1), node("Split", ["c", "sp"], ["p", "q"], axis=1),
           node("Mul", ["q", "q"])],
          {"a": rand(2, 3, seed=1), "b": rand(2, 4, seed=2)}, ["a", "b"],
          lambda t: torch.cat([t["a"], t["b"]], 1)[:, 2:] ** 2, initializers={"sp": np.array([2, 5])})


def test_slice_with_steps_and_negative_bounds():
    check([node("Slice", ["x", "st", "en", "ax", "sp"])], {"x": rand(5, 7)}, ["x"],
          lambda t: t["x"].flip(1)[:, 1:6:2][1:4],
          initializers={"st": np.array([1, -2]), "en": np.array([4, 0]), "ax": np.array([0, 1]),
                        "sp": np.array([1, -2])})


def test_slice_of_steps_one_with_bounds_known_is_a_pad():
    """A Slice of steps 1 (bounds clamped and negative), the dims known: dy padded back, no scatter; the
    bounds computed from the input's Shape (torch's chunk) count as known when the dims are."""
    nodes = [node("Slice", ["x", "st", "en", "ax"], ["p"]), node("Mul", ["p", "p"])]
    consts = {"st": np.array([1, -5]), "en": np.array([100, -1]), "ax": np.array([0, 1])}
    check(nodes, {"x": rand(5, 7)}, ["x"], lambda t: t["x"][1:, 2:6] ** 2, initializers=consts)
    grad = differentiate(model_of(nodes, {"x": rand(5, 7)}, consts), ["x"], "loss")
    ops = [n.op_type for n in grad.graph.node if n.name.startswith("grad/slice")]
    assert "Pad" in ops and "ScatterElements" not in ops, ops
    chunks = [node("Shape", ["x"], ["shape"]), node("Gather", ["shape", "one"], ["width"]),
              node("Div", ["width", "two"], ["half"]), node("Slice", ["x", "zero", "half", "one"], ["a"]),
              node("Slice", ["x", "half", "width", "one"], ["b"]), node("Mul", ["a", "b"])]
    consts = {"one": np.array([1]), "two": np.array([2]), "zero": np.array([0])}
    check(chunks, {"x": rand(3, 6)}, ["x"], lambda t: t["x"][:, :3] * t["x"][:, 3:], initializers=consts)
    grad = differentiate(model_of(chunks, {"x": rand(3, 6)}, consts), ["x"], "loss")
    assert "ScatterElements" not in [n.op_type for n in grad.graph.node]


def test_dims_known_through_a_chain_of_computed_reshapes():
    """Eight channel shuffles in a row, each Reshape's target computed from the Shape of the last one's
    output through a Div and Casts (as torch exports x.view(n, 2, c // 2, h, w)), the graph's input dims
    fixed: every tensor's dims known to the rules (folded round after round), so a Conv after them gets
    the static forms (no Shape of dy at run time)."""
    from trainrun.graphs.autodiff import static
    nodes, h = [], "x"
    for i in range(8):
        nodes += [node("Shape", [h], [f"s{i}"]), node("Gather", [f"s{i}", "one"], [f"c{i}"]),
                  node("Div", [f"c{i}", "two"], [f"half{i}"]),
                  node("Cast", [f"half{i}"], [f"hf{i}"], to=TensorProto.FLOAT),
                  node("Cast", [f"hf{i}"], [f"hi{i}"], to=TensorProto.INT64),
                  node("Concat", ["lead", f"hi{i}", "rest"], [f"t{i}"], axis=0),
                  node("Reshape", [h, f"t{i}"], [f"r{i}"]), node("Transpose", [f"r{i}"], [f"p{i}"], perm=[0, 2, 1, 3]),
                  node("Concat", ["batch", f"c{i}", "plane"], [f"u{i}"], axis=0),
                  node("Reshape", [f"p{i}", f"u{i}"], [f"h{i}"])]
        h = f"h{i}"
    nodes.append(node("Conv", [h, "k"], ["y"]))
    consts = {"one": np.array([1]), "two": np.array([2]), "lead": np.array([2, 2]), "rest": np.array([3]),
              "batch": np.array([2]), "plane": np.array([3])}
    inputs = {"x": rand(2, 4, 3, dtype=F32), "k": rand(5, 4, 2, seed=1, dtype=F32)}    # (Conv: no float64 kernel)

    def fn(t):
        h = t["x"]
        for _ in range(8):
            h = h.reshape(2, 2, 2, 3).transpose(1, 2).reshape(2, 4, 3)
        return torch.nn.functional.conv1d(h, t["k"])
    check(nodes, inputs, ["x", "k"], fn, initializers=consts)
    model = model_of(nodes, inputs, consts)
    dims = static._dims(static.infer(model))
    assert dims["h7"] == [2, 4, 3] and dims["y"] == [2, 5, 2], (dims.get("h7"), dims.get("y"))
    grad = differentiate(model, ["x", "k"], "loss")
    assert not [n for n in grad.graph.node if n.name.startswith("grad/conv") and n.op_type == "Shape"]


@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_sum_and_mean(keepdims):
    keep = bool(keepdims)
    check([node("ReduceSum", ["x", "ax"], ["s"], keepdims=keepdims), node("Mul", ["s", "s"])], {"x": rand(2, 3, 4)},
          ["x"], lambda t: t["x"].sum(-2, keepdim=keep) ** 2, initializers={"ax": np.array([-2])})
    check([node("ReduceMean", ["x"], ["m"], axes=[0, 2], keepdims=keepdims), node("Mul", ["m", "m"])],
          {"x": rand(2, 3, 4)}, ["x"], lambda t: t["x"].mean((0, 2), keepdim=keep) ** 2)
    check([node("ReduceSum", ["x"], ["s"], keepdims=keepdims), node("Mul", ["s", "x"])], {"x": rand(2, 3)},
          ["x"], lambda t: t["x"].sum() * t["x"])


@pytest.mark.parametrize("op,fn", [("Softmax", torch.softmax), ("LogSoftmax", torch.log_softmax)])
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_and_log_softmax(op, fn, axis):
    check([node(op, ["x"], axis=axis)], {"x": rand(2, 3, 4)}, ["x"], lambda t: fn(t["x"], axis))


def test_layer_norm_with_repeated_rows():
    x = rand(2, 3, 6)
    check([node("LayerNormalization", ["x", "g", "b"], axis=-1, epsilon=1e-3)],
          {"x": x, "g": rand(6, seed=3), "b": rand(6, seed=4)}, ["x", "g", "b"],
          lambda t: torch.nn.functional.layer_norm(t["x"], (6,), t["g"], t["b"], eps=1e-3))
    check([node("LayerNormalization", ["x", "g"], axis=1)],
          {"x": rand(2, 3, 4), "g": rand(3, 4, seed=3)}, ["x", "g"],
          lambda t: torch.nn.functional.layer_norm(t["x"], (3, 4), t["g"]))
    # float32: from the forward node's Mean and InvStdDev outputs (added to the node here)
    check([node("LayerNormalization", ["x", "g", "b"], axis=-1, epsilon=1e-3)],
          {"x": rand(4, 6, dtype=F32), "g": rand(6, seed=3, dtype=F32), "b": rand(6, seed=4, dtype=F32)},
          ["x", "g", "b"], lambda t: torch.nn.functional.layer_norm(t["x"], (6,), t["g"], t["b"], eps=1e-3))


def test_gather_rows_with_repeated_indices_sums_them():
    idx = np.array([[1, 3, 1], [0, 1, 4]])
    check([node("Gather", ["table", "idx"])], {"idx": idx, "table": rand(5, 4)}, ["table"],
          lambda t: t["table"][t["idx"]])


def test_gather_of_one_position_along_axis_1():
    """BERT's pooler reads x[:, 0] (a scalar index) into a Gemm: the gradient's transposes that keep the
    order are not emitted (onnxruntime's GemmTransposeFusion would fold one into the Gemm)."""
    check([node("Gather", ["x", "first"], ["g"], axis=1), node("Gemm", ["g", "m"], transB=1)],
          {"x": rand(2, 3, 4), "m": rand(5, 4, seed=3)}, ["x", "m"], lambda t: t["x"][:, 0] @ t["m"].T,
          initializers={"first": np.array(0)})


def test_tied_embedding_and_head():
    """A table read by a Gather (the embedding) and, transposed, by a MatMul (the tied head): the looked-up
    rows are added into the head's gradient (before its Transpose), repeated indices summed."""
    idx = np.array([[1, 3, 1], [0, 1, 4]])
    nodes = [node("Gather", ["table", "idx"], ["e"]), node("Transpose", ["table"], ["tt"], perm=[1, 0]),
             node("MatMul", ["e", "tt"])]
    check(nodes, {"idx": idx, "table": rand(5, 4, dtype=F32)}, ["table"], lambda t: t["table"][t["idx"]] @ t["table"].T)
    grad = differentiate(model_of(nodes, {"idx": idx, "table": rand(5, 4)}), ["table"], "loss")
    ops = [n.op_type for n in grad.graph.node]
    assert ops.count("ScatterElements") == 1 and "Sum" not in ops and "ScatterND" not in ops


@pytest.mark.parametrize("shared", [False, True])
def test_gelu_written_with_a_sigmoid(shared):
    """y * sigmoid(y * (a + b y^2)) differentiated as one (patterns.py); where its sigmoid also feeds the
    loss, node by node."""
    a, b = 1.5957691216057308, 0.0713548162726009
    nodes = [node("MatMul", ["x", "m"], ["y"]), node("Mul", ["y", "y"], ["y2"]), node("Mul", ["y2", "b"], ["t"]),
             node("Add", ["t", "a"], ["poly"]), node("Mul", ["y", "poly"], ["z"]), node("Sigmoid", ["z"], ["s"]),
             node("Mul", ["y", "s"], ["act"]),
             node("Add", ["act", "s"] if shared else ["act", "act"], ["out"])]

    def fn(t):
        y = t["x"] @ t["m"]
        s = torch.sigmoid(y * (a + b * y * y))
        return y * s + (s if shared else y * s)
    inputs = {"x": rand(3, 4, seed=1), "m": rand(4, 5, seed=2)}
    consts = {"a": np.array(a), "b": np.array(b)}
    check(nodes, inputs, ["x", "m"], fn, initializers=consts, out="out")
    grad = differentiate(model_of(nodes, inputs, consts, out="out"), ["x", "m"], "loss")
    assert ("Sum" in [n.op_type for n in grad.graph.node if n.name.startswith("y_grad")]) == shared


@pytest.mark.parametrize("shared", [False, True])
def test_silu_written_with_a_sigmoid(shared):
    """x * sigmoid(x) (torch's SiLU exported) differentiated as one (patterns.py): no Sigmoid gradient's
    1 - s and no Sum of x's two contributions; where its sigmoid also feeds the loss, node by node."""
    nodes = [node("MatMul", ["x", "m"], ["y"]), node("Sigmoid", ["y"], ["s"]), node("Mul", ["s", "y"], ["act"]),
             node("Add", ["act", "s"] if shared else ["act", "act"], ["out"])]

    def fn(t):
        y = t["x"] @ t["m"]
        return y * torch.sigmoid(y) + (torch.sigmoid(y) if shared else y * torch.sigmoid(y))
    # float32: onnxruntime's full optimisations (the output's shape probe) fuse x * sigmoid(x) into a
    # float-only QuickGelu
    inputs = {"x": rand(3, 4, seed=1, dtype=F32), "m": rand(4, 5, seed=2, dtype=F32)}
    check(nodes, inputs, ["x", "m"], fn, out="out")
    grad = differentiate(model_of(nodes, inputs, out="out"), ["x", "m"], "loss")
    assert ("Sum" in [n.op_type for n in grad.graph.node if n.name.startswith("y_grad")]) == shared
    assert ("Sub" in [n.op_type for n in grad.graph.node if n.name.startswith("grad/s")]) == shared


def test_mlp_stored_in_reverse_order_with_a_shared_tensor():
    """Embedding rows -> LayerNorm -> MatMul + bias -> Relu -> Gemm -> Softmax, times the mean of tanh(h0),
    the parameters as initializers and the nodes stored last first: h0 feeds both LayerNorm and Tanh, so its
    gradient is the sum of two."""
    rng = np.random.default_rng(3)
    params = {"emb": rng.standard_normal((7, 4)), "ln_g": rng.standard_normal(4), "ln_b": rng.standard_normal(4),
              "w1": rng.standard_normal((4, 6)), "b1": rng.standard_normal(6), "w2": rng.standard_normal((3, 6))}
    consts = {"flat": np.array([-1, 6]), "tokens": np.array([[1, 2], [6, 1]])}

    def fn(t):
        h0 = t["emb"][t["tokens"]] + t["x"]
        h1 = torch.nn.functional.layer_norm(h0, (4,), t["ln_g"], t["ln_b"])
        r1 = torch.relu(h1 @ t["w1"] + t["b1"]).reshape(-1, 6)
        return torch.softmax(r1 @ t["w2"].T, -1) * torch.tanh(h0).mean()
    nodes = [node("Gather", ["emb", "tokens"], ["e"]), node("Add", ["e", "x"], ["h0"]),
             node("LayerNormalization", ["h0", "ln_g", "ln_b"], ["h1"]),
             node("MatMul", ["h1", "w1"], ["m1"]), node("Add", ["m1", "b1"], ["a1"]), node("Relu", ["a1"], ["r1"]),
             node("Reshape", ["r1", "flat"], ["r1_2d"]), node("Gemm", ["r1_2d", "w2"], ["g2"], transB=1),
             node("Softmax", ["g2"], ["p"]), node("Tanh", ["h0"], ["side"]), node("ReduceMean", ["side"], ["sm"]),
             node("Mul", ["p", "sm"])]
    check(nodes[::-1], {"x": rand(2, 2, 4)}, list(params), fn, initializers={**params, **consts})


def test_reduce_mean_with_axes_as_an_input_at_opset_18():
    model = model_of([node("ReduceMean", ["x", "ax"], ["m"], keepdims=0), node("Mul", ["m", "m"])],
                     {"x": rand(2, 3, 4)}, {"ax": np.array([0, 2])})
    model.opset_import[0].version = 18
    grad = differentiate(model, ["x"], "loss")
    w = rand(3, seed=4)
    got = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["x_grad"], {"x": rand(2, 3, 4), "w": w})[0]
    x = torch.tensor(rand(2, 3, 4), requires_grad=True)
    (x.mean((0, 2)) ** 2 * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_cases_a_rule_does_not_cover_are_named():
    layer_norm = model_of([node("LayerNormalization", ["x", "g"], ["n", "mean"]), node("Mul", ["n", "mean"])],
                          {"x": rand(2, 3), "g": rand(3)})
    with pytest.raises(NoGradient, match="LayerNormalization node 'layernormalization_x_g'.*Mean"):
        differentiate(layer_norm, ["x"], "loss")
    loss = model_of([node("SoftmaxCrossEntropyLoss", ["x", "l", "cw"], reduction="none")],
                    {"x": rand(2, 3), "l": np.array([0, 2]), "cw": rand(3)})
    with pytest.raises(NoGradient, match="SoftmaxCrossEntropyLoss node .*weights input needs a gradient"):
        differentiate(loss, ["x", "cw"], "loss")
    pool = model_of([node("AveragePool", ["x"], kernel_shape=[2, 2], auto_pad="SAME_UPPER")],
                    {"x": rand(1, 1, 4, 4, dtype=F32)}, unknown_dims=True)
    with pytest.raises(NoGradient, match="AveragePool node 'averagepool_x'.*auto_pad"):
        differentiate(pool, ["x"], "loss")


def test_an_op_without_a_rule_is_named():
    model = model_of([node("LpNormalization", ["x"], ["c"]), node("Mul", ["c", "x"])], {"x": rand(3, dtype=F32)})
    with pytest.raises(NoGradient,
                       match="no gradient rule for op type 'LpNormalization' \\(node 'lpnormalization_x'\\)") as e:
        differentiate(model, ["x"], "loss")
    assert e.value.exit_code == 2


def test_branches_without_parameters_are_skipped_and_unused_parameters_get_zeros():
    x, d, unused = rand(3, dtype=F32), rand(3, dtype=F32, seed=5), rand(2, dtype=F32)
    model = model_of([node("Cos", ["d"], ["c"]), node("Mul", ["c", "x"])], {"x": x, "d": d, "unused": unused})
    grad = differentiate(model, ["x", "unused"], "loss")
    assert [n.op_type for n in grad.graph.node].count("Cos") == 1
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    w = rand(3, dtype=F32, seed=9)
    gx, gu = sess.run(["x_grad", "unused_grad"], {"x": x, "d": d, "unused": unused, "w": w})
    np.testing.assert_allclose(gx, np.cos(d) * w, rtol=1e-6)
    assert gu.tolist() == [0.0, 0.0]


LOSS_CASES = [(reduction, ignore, weighted, shape) for reduction in ("mean", "sum", "none")
              for ignore, weighted in ((None, False), (2, True), (-1, False)) for shape in ((5, 4), (3, 4, 2))]


def labels_for(shape, ignore):
    """Labels over the classes, ``ignore`` among them (and not all of them) where given."""
    labels = np.random.default_rng(len(shape)).integers(0, shape[1], (shape[0],) + shape[2:])
    if ignore is not None:
        labels.flat[::3] = ignore
    return labels


@pytest.mark.parametrize("reduction,ignore,weighted,shape", LOSS_CASES)
@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_cross_entropy_and_nll_losses(op, reduction, ignore, weighted, shape):
    labels = labels_for(shape, ignore)
    attrs = {"reduction": reduction, **({} if ignore is None else {"ignore_index": ignore})}
    ins = ["x", "labels"] + (["cw"] if weighted else [])
    inits = {"cw": rand(shape[1], seed=8, positive=True)} if weighted else {}
    fn = torch.nn.functional.cross_entropy if op == "SoftmaxCrossEntropyLoss" else torch.nn.functional.nll_loss
    check([node(op, ins, **attrs)], {"x": rand(*shape), "labels": labels}, ["x"],
          lambda t: fn(t["x"], t["labels"], weight=t.get("cw"), reduction=reduction,
                       ignore_index=-100 if ignore is None else ignore),
          initializers=inits)


def test_cross_entropy_log_prob_output_and_the_loss_both_reach_the_loss():
    labels = labels_for((3, 4, 2), 1)
    check([node("SoftmaxCrossEntropyLoss", ["x", "labels"], ["l", "lp"], ignore_index=1), node("Mul", ["lp", "l"])],
          {"x": rand(3, 4, 2), "labels": labels}, ["x"],
          lambda t: torch.log_softmax(t["x"], 1) * torch.nn.functional.cross_entropy(t["x"], t["labels"],
                                                                                     ignore_index=1))


CONV_CASES = [dict(), dict(strides=[2, 1], pads=[1, 0, 0, 2]),
              dict(strides=[2, 2], pads=[1, 1, 1, 1], dilations=[2, 1]),
              dict(group=2, strides=[1, 2], pads=[0, 1, 1, 0])]


@pytest.mark.parametrize("attrs", CONV_CASES, ids=["plain", "strides_pads", "dilations", "group"])
def test_conv_2d(attrs):
    group = attrs.get("group", 1)
    x, w, b = rand(2, 4, 7, 6, dtype=F32, seed=1), rand(6, 4 // group, 3, 2, dtype=F32, seed=2), rand(6, dtype=F32)
    top, left, bottom, right = attrs.get("pads", [0] * 4)      # torch pads the last dim first
    check([node("Conv", ["x", "k", "b"], **attrs)], {"x": x, "k": w, "b": b}, ["x", "k", "b"],
          lambda t: torch.nn.functional.conv2d(torch.nn.functional.pad(t["x"], (left, right, top, bottom)), t["k"],
                                               t["b"], stride=attrs.get("strides", 1),
                                               dilation=attrs.get("dilations", 1), groups=group))


def test_max_pool_with_ties_routes_each_window_to_one_element():
    x = rand(2, 3, 6, 7, dtype=F32)
    x[0, 0, :2, :2] = 1.5                      # a window of equal values
    for attrs, pad in ((dict(kernel_shape=[2, 2], strides=[2, 2]), (0, 0)),
                       (dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), (1, 1))):
        check([node("MaxPool", ["x"], **attrs)], {"x": x}, ["x"],
              lambda t: torch.nn.functional.max_pool2d(t["x"], attrs["kernel_shape"], attrs["strides"], pad))
    check([node("MaxPool", ["x"], ["y", "idx"], kernel_shape=[2, 3])], {"x": x}, ["x"],
          lambda t: torch.nn.functional.max_pool2d(t["x"], (2, 3), 1))


@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_and_global_average_pool(count_include_pad):
    check([node("AveragePool", ["x"], kernel_shape=[3, 2], strides=[2, 1], pads=[1, 1, 1, 1],
                count_include_pad=count_include_pad, outs=["p"]), node("GlobalAveragePool", ["p"], ["g"]),
           node("Mul", ["p", "g"])],
          {"x": rand(2, 3, 6, 5, dtype=F32)}, ["x"],
          lambda t: (lambda y: y * y.mean((2, 3), keepdim=True))(torch.nn.functional.avg_pool2d(
              t["x"], (3, 2), (2, 1), 1, count_include_pad=bool(count_include_pad))))


def test_batch_norm_inference_form():
    check([node("BatchNormalization", ["x", "g", "b", "mu", "var"], epsilon=1e-3)],
          {"x": rand(2, 3, 4, 2), "g": rand(3, seed=1), "b": rand(3, seed=2), "mu": rand(3, seed=3),
           "var": rand(3, seed=4, positive=True)}, ["x", "g", "b", "mu", "var"],
          lambda t: (t["x"] - t["mu"][:, None, None]) / torch.sqrt(t["var"][:, None, None] + 1e-3)
          * t["g"][:, None, None] + t["b"][:, None, None])


@pytest.mark.parametrize("spatial", [(5,), (3, 2, 2)], ids=["1d", "3d"])
def test_batch_norm_training_mode_with_dims_at_run_time(spatial):
    """Training-mode BatchNorm's gradients with the input's dims unknown when the graph is built (the
    count per channel found at run time), 1-D and 3-D planes."""
    inputs = {"x": rand(3, 4, *spatial), "g": rand(4, seed=1), "b": rand(4, seed=2)}
    axes = [0] + list(range(2, 2 + len(spatial)))

    def fn(t):
        shape = [1, -1] + [1] * len(spatial)
        mean = t["x"].mean(axes, keepdim=True)
        var = ((t["x"] - mean) ** 2).mean(axes, keepdim=True)
        return (t["x"] - mean) / torch.sqrt(var + 1e-3) * t["g"].reshape(shape) + t["b"].reshape(shape)
    bn = node("BatchNormalization", ["x", "g", "b", "mu", "var"], ["y", "run_mean", "run_var"], epsilon=1e-3,
              training_mode=1)
    check([bn], inputs, ["x", "g", "b"], fn, initializers={"mu": np.zeros(4), "var": np.ones(4)},
          unknown_dims=True)


def test_batch_norm_training_mode_uses_the_batch_statistics_and_keeps_the_running_ones():
    """training_mode 1 (the CNN recipe's BatchNorm): y from the batch's mean and population variance, the
    running mean and variance outputs (momentum * old + (1 - momentum) * batch, unbiased as ONNX defines) still
    outputs of the graph with the gradients."""
    inputs = {"x": rand(4, 3, 5, 2), "g": rand(3, seed=1), "b": rand(3, seed=2), "mu": rand(3, seed=3),
              "var": rand(3, seed=4, positive=True)}

    def fn(t):
        return torch.nn.functional.batch_norm(t["x"], None, None, t["g"], t["b"], training=True, eps=1e-3)
    bn = node("BatchNormalization", ["x", "g", "b", "mu", "var"], ["y", "run_mean", "run_var"], epsilon=1e-3,
              momentum=0.8, training_mode=1)
    check([bn], inputs, ["x", "g", "b"], fn)
    grad = differentiate(model_of([bn], inputs), ["x", "g", "b"], "loss")
    grad.graph.output.extend([helper.make_tensor_value_info(n, TensorProto.DOUBLE, [3])
                              for n in ("run_mean", "run_var")])
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    run_mean, run_var = sess.run(["run_mean", "run_var"], {**inputs, "w": rand(4, 3, 5, 2, seed=9)})
    x = inputs["x"]
    momentum = float(np.float32(0.8))         # a float attribute
    np.testing.assert_allclose(run_mean, momentum * inputs["mu"] + (1 - momentum) * x.mean((0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(run_var, momentum * inputs["var"] + (1 - momentum) * x.var((0, 2, 3)), rtol=1e-12)


MORE_UNARY = [("Abs", {}, torch.abs, F64), ("Reciprocal", {}, torch.reciprocal, F64),
              ("Softplus", {}, torch.nn.functional.softplus, F32),
              ("LeakyRelu", {"alpha": 0.25}, lambda x: torch.nn.functional.leaky_relu(x, 0.25), F32),
              ("Gelu", {}, torch.nn.functional.gelu, F32),
              ("Gelu", {"approximate": "tanh"}, lambda x: torch.nn.functional.gelu(x, approximate="tanh"), F32)]


@pytest.mark.parametrize("op,attrs,fn,dtype", MORE_UNARY, ids=[f"{u[0]}{u[1]}" for u in MORE_UNARY])
def test_more_unary_ops(op, attrs, fn, dtype):
    x = rand(3, 5, dtype=dtype)
    x[0, :3] = [0.5, -0.5, 2.0]
    check([node(op, ["x"], **attrs)], {"x": x}, ["x"], lambda t: fn(t["x"]), opset=20 if op == "Gelu" else OPSET)


def test_clip_with_and_without_bounds():
    x = rand(4, 5)
    check([node("Clip", ["x", "lo", "hi"])], {"x": x}, ["x"], lambda t: torch.clamp(t["x"], -0.5, 0.7),
          initializers={"lo": np.array(-0.5), "hi": np.array(0.7)})
    check([node("Clip", ["x", "", "hi"])], {"x": x}, ["x"], lambda t: torch.clamp(t["x"], max=0.7),
          initializers={"hi": np.array(0.7)})


def test_sum_min_max_with_broadcasting_and_ties():
    """Variadic Sum; Min and Max split dy evenly between inputs equal to the result (torch.maximum's rule)."""
    a, b, c = rand(2, 3, seed=1), rand(3, seed=2), rand(2, 1, seed=3)
    b[1] = a[0, 1]                           # a tie
    check([node("Sum", ["a", "b", "c"])], {"a": a, "b": b, "c": c}, ["a", "b", "c"],
          lambda t: t["a"] + t["b"] + t["c"])
    check([node("Max", ["a", "b"])], {"a": a, "b": b}, ["a", "b"], lambda t: torch.maximum(t["a"], t["b"]))
    check([node("Min", ["a", "b"])], {"a": a, "b": b}, ["a", "b"], lambda t: torch.minimum(t["a"], t["b"]))
    check([node("Max", ["a", "b", "c"])], {"a": a, "b": b, "c": c}, ["a", "b", "c"],
          lambda t: torch.maximum(torch.maximum(t["a"], t["b"]), t["c"]))


@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_max_and_min_split_ties_evenly(keepdims):
    x = rand(3, 4, 2)
    x[1, 0, 1] = x[1, 2, 1] = 5.0                 # a tie for a maximum along axis 1
    keep = bool(keepdims)
    check([node("ReduceMax", ["x"], axes=[1], keepdims=keepdims)], {"x": x}, ["x"],
          lambda t: torch.amax(t["x"], 1, keepdim=keep))
    check([node("ReduceMin", ["x"], keepdims=keepdims)], {"x": x}, ["x"],
          lambda t: torch.amin(t["x"], (0, 1, 2), keepdim=keep))
    check([node("ReduceMax", ["x", "ax"], keepdims=keepdims)], {"x": x}, ["x"],
          lambda t: torch.amax(t["x"], (0, 1), keepdim=keep), initializers={"ax": np.array([0, 1])}, opset=18)


def test_expand():
    for unknown in (False, True):
        check([node("Expand", ["x", "shape"])], {"x": rand(3, 1)}, ["x"], lambda t: t["x"].expand(2, 3, 4),
              initializers={"shape": np.array([2, 1, 4])}, unknown_dims=unknown)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_with_repeated_indices(axis):
    x = rand(3, 4)
    idx = np.random.default_rng(1).integers(0, x.shape[axis], (3, 4) if axis == 0 else (3, 6))
    idx[0, :2] = 1
    check([node("GatherElements", ["x", "idx"], axis=axis)], {"x": x, "idx": idx}, ["x"],
          lambda t: torch.gather(t["x"], axis, t["idx"]))


def test_gather_nd_with_batch_dims():
    """batch_dims 0 (whole coordinates) and 1 (BERT's masked positions: [B, S, E] by [B, P, 1]), repeats."""
    x = rand(2, 5, 3)
    pos = np.array([[[1], [3], [1]], [[0], [4], [4]]])
    check([node("GatherND", ["x", "pos"], batch_dims=1)], {"x": x, "pos": pos}, ["x"],
          lambda t: torch.stack([t["x"][b][t["pos"][b, :, 0]] for b in range(2)]))
    coords = np.array([[1, 2], [0, 4], [1, 2]])
    check([node("GatherND", ["x", "coords"])], {"x": x, "coords": coords}, ["x"],
          lambda t: t["x"][t["coords"][:, 0], t["coords"][:, 1]])
    for unknown in (False, True):
        check([node("GatherND", ["x", "pos"], batch_dims=1)], {"x": x, "pos": pos}, ["x"],
              lambda t: torch.stack([t["x"][b][t["pos"][b, :, 0]] for b in range(2)]), unknown_dims=unknown)


def test_gather_along_other_axes():
    """axis 1 with a scalar index (BERT's [CLS] token) and with a matrix of indices, axis -1."""
    x = rand(2, 4, 3)
    check([node("Gather", ["x", "i"], axis=1)], {"x": x}, ["x"], lambda t: t["x"][:, 0],
          initializers={"i": np.array(0)})
    idx = np.array([[3, 1], [1, 1]])
    check([node("Gather", ["x", "idx"], axis=1)], {"x": x, "idx": idx}, ["x"], lambda t: t["x"][:, t["idx"]])
    check([node("Gather", ["x", "idx"], axis=-1)], {"x": x, "idx": idx % 3}, ["x"],
          lambda t: t["x"][:, :, t["idx"] % 3])


def test_split_and_slice_with_inputs_known_at_run_time():
    """The split sizes and slice bounds as graph inputs, the dims unknown when the graph is built; an output
    of the Split not used."""
    x = rand(3, 7)
    check([node("Split", ["x", "sizes"], ["p", "q", "r"], axis=1), node("Mul", ["p", "r"])],
          {"x": x, "sizes": np.array([2, 3, 2])}, ["x"], lambda t: t["x"][:, :2] * t["x"][:, 5:],
          unknown_dims=True)
    check([node("Slice", ["x", "st", "en", "ax"])], {"x": x, "st": np.array([1]), "en": np.array([-1]),
                                                     "ax": np.array([1])}, ["x"], lambda t: t["x"][:, 1:-1],
          unknown_dims=True)


def test_integer_branches_carry_no_gradient():
    """A mean written as ReduceSum / Cast(Size(x)) (label smoothing's count, a user's own loss): the Size and
    the Cast carry none."""
    check([node("ReduceSum", ["x"], ["s"], keepdims=0), node("Size", ["x"], ["n"]),
           node("Cast", ["n"], ["nf"], to=TensorProto.DOUBLE), node("Div", ["s", "nf"], ["m"]),
           node("Shape", ["x"], ["sh"]), node("ConstantOfShape", ["sh"], ["z"], value=numpy_helper.from_array(
               np.array([1.0]))), node("Mul", ["m", "z"])],
          {"x": rand(3, 4)}, ["x"], lambda t: t["x"].mean() * torch.ones(3, 4, dtype=torch.float64))


def test_dropout_in_inference_form_and_with_its_mask():
    x, w = rand(4, 6, dtype=F32), rand(4, 6, dtype=F32, seed=5)
    check([node("Dropout", ["x"])], {"x": x}, ["x"], lambda t: t["x"])
    model = model_of([node("Dropout", ["x", "r", "t"], ["y", "mask"])], {"x": x},
                     {"r": np.array(0.25, np.float32), "t": np.array(True)})
    grad = differentiate(model, ["x"], "loss")
    grad.graph.output.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, None))
    sess = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    gx, mask = sess.run(["x_grad", "mask"], {"x": x, "w": w})
    assert 0 < mask.sum() < mask.size
    np.testing.assert_allclose(gx, w * mask / np.float32(0.75), rtol=1e-6)


@pytest.mark.parametrize("case", ["conv", "conv_group", "max_pool_ceil", "average_pool"])
def test_conv_and_pools_with_dims_known_at_run_time(case):
    """The batch and image dims unknown when the graph is built (engine.static_shapes false); MaxPool with
    ceil_mode (the CNN recipe's)."""
    x = rand(2, 4, 7, 6, dtype=F32, seed=1)
    if case.startswith("conv"):
        group = 2 if case == "conv_group" else 1
        attrs = dict(strides=[2, 2], pads=[1, 0, 0, 1], group=group)
        check([node("Conv", ["x", "k"], **attrs)], {"x": x}, ["x", "k"],
              lambda t: torch.nn.functional.conv2d(torch.nn.functional.pad(t["x"], (0, 1, 1, 0)), t["k"], stride=2,
                                                   groups=group), unknown_dims=True,
              initializers={"k": rand(6, 4 // group, 3, 3, dtype=F32, seed=2)})      # a weight's dims are known
    elif case == "max_pool_ceil":
        for unknown in (False, True):
            check([node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)], {"x": x}, ["x"],
                  lambda t: torch.nn.functional.max_pool2d(t["x"], 3, 2, ceil_mode=True), unknown_dims=unknown)
    else:
        check([node("AveragePool", ["x"], kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1])], {"x": x}, ["x"],
              lambda t: _avg_exclude_pad(t["x"]), unknown_dims=True)


def _avg_exclude_pad(x):
    """AveragePool kernel [3, 2], strides 2, pads top 1 bottom 1 left 0 right 1, padding not counted."""
    padded = torch.nn.functional.pad(x, (0, 1, 1, 1))
    ones = torch.nn.functional.pad(torch.ones_like(x), (0, 1, 1, 1))
    return (torch.nn.functional.avg_pool2d(padded, (3, 2), 2) / torch.nn.functional.avg_pool2d(ones, (3, 2), 2))


def test_more_refused_cases_are_named():
    pool = model_of([node("AveragePool", ["x"], kernel_shape=[2, 2], ceil_mode=1)], {"x": rand(1, 1, 5, 5, dtype=F32)},
                    unknown_dims=True)
    with pytest.raises(NoGradient, match="AveragePool node 'averagepool_x'.*ceil_mode 1 with the dims unknown"):
        differentiate(pool, ["x"], "loss")
    conv4d = model_of([node("Conv", ["x", "k"])],
                      {"x": rand(1, 1, 3, 3, 3, 3, dtype=F32), "k": rand(1, 1, 2, 2, 2, 2, dtype=F32)})
    with pytest.raises(NoGradient, match="Conv node 'conv_x_k'.*4-D window"):
        differentiate(conv4d, ["x"], "loss")
    stats = model_of([node("BatchNormalization", ["x", "g", "b", "mu", "var"], ["n", "rm", "rv"], training_mode=1),
                      node("Mul", ["n", "rm"])],
                     {"x": rand(2, 3, 4), "g": rand(3), "b": rand(3), "mu": rand(3), "var": rand(3, positive=True)})
    with pytest.raises(NoGradient, match="BatchNormalization node .*running mean or variance output reaches the loss"):
        differentiate(stats, ["x"], "loss")
    dropout = model_of([node("Dropout", ["x", "r", "t"])], {"x": rand(2, 3, dtype=F32)},
                       {"r": np.array(0.5, np.float32), "t": np.array(True)})
    with pytest.raises(NoGradient, match="Dropout node 'dropout_x_r_t'.*mask output"):
        differentiate(dropout, ["x"], "loss")


def test_scatters_of_float16_gradients_add_in_float32():
    """An embedding (and a GatherElements, a MaxPool) read in float16 as the fp16 recipe's casts do: the
    scatter that adds their gradients runs in float32 (onnxruntime's CPU kernels add no float16)."""
    idx = np.array([[1, 3, 1], [0, 1, 4]])
    pick = np.array([[2, 0], [1, 1]])
    half = TensorProto.FLOAT16
    check([node("Cast", ["table"], ["t16"], to=half), node("Gather", ["t16", "idx"], ["rows"]),
           node("GatherElements", ["t16", "pick"], ["picked"], axis=1), node("Cast", ["rows"], ["r32"], to=1),
           node("Cast", ["picked"], ["p32"], to=1), node("ReduceSum", ["p32"], ["ps"], keepdims=0),
           node("Mul", ["r32", "ps"])],
          {"idx": idx, "pick": pick, "table": rand(5, 4, dtype=F32)}, ["table"],
          lambda t: t["table"][t["idx"]] * torch.gather(t["table"], 1, t["pick"]).sum(), tol=2e-3)     # float16
    check([node("Cast", ["x"], ["x16"], to=half), node("MaxPool", ["x16"], ["m16"], kernel_shape=[2, 2]),
           node("Cast", ["m16"], to=1)], {"x": rand(1, 2, 4, 4, dtype=F32)}, ["x"],
          lambda t: torch.nn.functional.max_pool2d(t["x"].half().float(), 2, 1), tol=2e-3)


@pytest.mark.parametrize("opset", [11, 13])
def test_graphs_of_older_opsets_are_converted_to_the_rules_opset(opset):
    """The rules write opset-16 ops (ScatterND's add, CastLike, Shape's start): an older graph is converted
    to opset 16 first (Squeeze's axes and ReduceSum's from attributes to inputs), the gradient the same."""
    axes = {"axes": [1]} if opset < 13 else {}
    ins = ["m", "ax"] if opset >= 13 else ["m"]
    model = model_of([node("Gather", ["table", "idx"], ["rows"]), node("ReduceSum", ["rows"] + ins[1:], ["m"],
                                                                       keepdims=1, **axes),
                      node("Squeeze", ins, ["q"], **axes), node("Tanh", ["q"])],
                     {"idx": np.array([[1, 3, 1], [0, 1, 4]]), "table": rand(5, 4)},
                     {"ax": np.array([1])} if opset >= 13 else {}, opset=opset)
    grad = differentiate(model, ["table"], "loss")
    assert grad.opset_import[0].version == 16
    w = rand(2, 4, seed=3)
    got = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["table_grad"], {"idx": np.array([[1, 3, 1], [0, 1, 4]]), "table": rand(5, 4), "w": w})[0]
    table = torch.tensor(rand(5, 4), requires_grad=True)
    (torch.tanh(table[torch.tensor([[1, 3, 1], [0, 1, 4]])].sum(1)) * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(got, table.grad.numpy(), rtol=1e-10, atol=1e-12)


def same_pads(size, kernel, stride, upper):
    """ONNX's SAME_UPPER / SAME_LOWER padding of one axis: (before, after)."""
    total = max(0, (-(-size // stride) - 1) * stride + kernel - size)
    small, big = total // 2, total - total // 2
    return (small, big) if upper else (big, small)


@pytest.mark.parametrize("auto_pad,kernel,stride", [("SAME_UPPER", 3, 2), ("SAME_LOWER", 2, 1), ("VALID", 3, 2)])
def test_auto_pad_with_dims_known_when_the_graph_is_built(auto_pad, kernel, stride):
    """auto_pad's padding worked out from the input's dims (a Keras / TensorFlow export's Conv and MaxPool);
    SAME with the dims unknown until run time refused by name."""
    x = rand(2, 2, 11, 10, dtype=F32, seed=1)
    (top, bottom), (left, right) = [same_pads(n, kernel, stride, auto_pad == "SAME_UPPER") if auto_pad != "VALID"
                                    else (0, 0) for n in (11, 10)]
    check([node("Conv", ["x", "k"], ["c"], auto_pad=auto_pad, strides=[stride, stride]),
           node("MaxPool", ["c"], auto_pad=auto_pad, kernel_shape=[kernel, kernel], strides=[stride, stride])],
          {"x": x}, ["x", "k"],
          lambda t: max_pool_padded(torch.nn.functional.conv2d(
              torch.nn.functional.pad(t["x"], (left, right, top, bottom)), t["k"], stride=stride),
              auto_pad, kernel, stride),
          initializers={"k": rand(3, 2, kernel, kernel, dtype=F32, seed=2)})
    if auto_pad == "VALID":
        return
    with pytest.raises(NoGradient, match=f"Conv node 'conv_x_k'.*auto_pad {auto_pad} with the input's dims unknown"):
        differentiate(model_of([node("Conv", ["x", "k"], auto_pad=auto_pad)], {"x": x},
                               {"k": rand(3, 2, 2, 2, dtype=F32)}, unknown_dims=True), ["x"], "loss")


def max_pool_padded(y, auto_pad, kernel, stride):
    if auto_pad == "VALID":
        return torch.nn.functional.max_pool2d(y, kernel, stride)
    (top, bottom), (left, right) = [same_pads(n, kernel, stride, auto_pad == "SAME_UPPER") for n in y.shape[2:]]
    padded = torch.nn.functional.pad(y, (left, right, top, bottom), value=-float("inf"))
    return torch.nn.functional.max_pool2d(padded, kernel, stride)


def test_pad_constant_mode():
    """Pad's constant mode (pads as a constant input, a nonzero fill); the fill value gets no gradient;
    reflect mode refused by name."""
    check([node("Pad", ["x", "pads", "fill"])], {"x": rand(2, 3, 4)}, ["x"],
          lambda t: torch.nn.functional.pad(t["x"], (2, 0, 0, 1, 1, 0), value=0.5),
          initializers={"pads": np.array([1, 0, 2, 0, 1, 0]), "fill": np.array(0.5)})
    reflect = model_of([node("Pad", ["x", "pads"], mode="reflect")], {"x": rand(2, 4)},
                       {"pads": np.array([0, 1, 0, 1])})
    with pytest.raises(NoGradient, match="Pad node 'pad_x_pads'.*mode reflect"):
        differentiate(reflect, ["x"], "loss")


def test_gpt2_train_graph_in_the_cheaper_forms(tmp_path):
    """The built-in GPT-2's train graph as prepare makes it (static shapes): LayerNormalization's gradient
    from the forward's Mean/InvStdDev (no recomputed deviation), the tied embedding's rows scattered into
    the head's gradient, transposed, along axis 0 (no zero table, no ScatterND), the GELU as one subgraph
    (no y-gradient Sum of its four products), broadcast axes fixed when built (no run-time axis search per
    layer), input gradients by Gemm transB, and, after onnxruntime's optimizations, every weight gradient a
    plain MatMul over an explicitly transposed input."""
    import collections

    from conftest import ROOT
    from trainrun.config.load import load_config
    from trainrun.graphs.forward import forward_from_config
    from trainrun.graphs.manifest import build_options, loss_graph
    cfg = load_config(f"{ROOT}/configs/gpt2-tiny.yaml", ["data.train=null", "data.eval=null"])
    fwd = forward_from_config(cfg)
    loss_model, _ = loss_graph(cfg, fwd, build_options(cfg))
    model = differentiate(loss_model, fwd.params, "loss")
    ops = collections.Counter(n.op_type for n in model.graph.node)
    layers = cfg.model.gpt2.n_layer
    assert ops["Reciprocal"] == ops["Sqrt"] == ops["ScatterND"] == 0, ops
    assert ops["NonZero"] <= 1, ops           # the position table's slice (one [positions, width] sum)
    producer = {o: n for n in model.graph.node for o in n.output}
    chain = [producer["transformer.wte.weight_grad"]]
    while len(chain) < 3:
        chain.append(producer[chain[-1].input[0]])
    assert [n.op_type for n in chain] == ["Identity", "ScatterElements", "Transpose"]
    assert [a.i for a in chain[1].attribute if a.name == "axis"] == [0]     # rows into the [vocab, width] table
    assert producer[chain[-1].input[0]].op_type == "MatMul"          # the head's [width, vocab] gradient
    ce = next(n for n in model.graph.node if n.name == "grad/loss_sce/ScatterElements")   # by Exp(log_prob)
    assert [producer[ce.input[0]].op_type, producer[producer[ce.input[0]].input[0]].op_type] == ["Mul", "Exp"]
    for n in model.graph.node:
        if n.op_type == "LayerNormalization":
            assert len(n.output) == 3 and all(producer.get(o) is n for o in n.output)
    act = [n for n in model.graph.node if n.output[0].endswith("mlp.act") and not n.name.startswith("grad/")]
    assert len(act) == layers
    for n in act:
        y_grad = [m for m in model.graph.node if m.op_type == "Sum" and m.output[0] == f"{n.input[0]}_grad"]
        assert not y_grad
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    made = {o: n for n in optimized.graph.node for o in n.output}
    weights = [p for p in fwd.params if len(fwd_dims(fwd, p)) == 2 and "wte" not in p and "wpe" not in p]
    assert len(weights) == 4 * layers
    # the input gradient dY W^T as Gemm transB, which engine.pad_products pads without materialising W^T
    assert {n.input[1] for n in model.graph.node if n.op_type == "Gemm" and n.name.startswith("grad/")
            and any(a.name == "transB" and a.i == 1 for a in n.attribute)} >= set(weights)
    for p in weights:
        n = made[f"{p}_grad"]
        assert n.op_type == "MatMul" and made[n.input[0]].op_type == "Reshape", (p, n.op_type)


def fwd_dims(fwd, name):
    return next(list(t.dims) for t in fwd.model.graph.initializer if t.name == name)
