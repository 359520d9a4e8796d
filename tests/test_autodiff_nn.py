"""trainrun's own gradient builder (trainrun/graphs/autodiff) on the layers of "any model users bring":
Conv / ConvTranspose / pooling with 1-, 2- and 3-D windows, Instance / Group normalisation, LSTM / GRU / RNN.
Per case a tiny graph, loss = ReduceSum(y * w) for a random w, the emitted gradients run in onnxruntime and
compared with central finite differences of the forward graph run in onnxruntime: no torch needed
(one torch-marked test compares exported torch modules with torch autograd where torch is installed).

onnxruntime's CPU kernels of these ops have no float64 (GroupNormalization excepted), so most graphs run
in float32: the finite differences are taken of y (float32) with the loss summed in float64 by NumPy, with
h = 1 where the output is linear in the input (Conv, ConvTranspose, AveragePool: the difference is then
exact up to y's rounding), with inputs a step apart far wider than h where it is piecewise linear (MaxPool:
exact too), and Richardson-extrapolated (error O(h^4)) where it is smooth. y's float32 rounding (2^-24
relative) over a few hundred summed terms stays under 1e-5 of the gradient's scale; the bound, 1e-4 (5e-4
for the smooth cases: h^4 and the rounding divided by h), leaves a margin of 10 over either."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainrun.graphs.autodiff import NoGradient, differentiate

from conftest import optional
from test_autodiff_ops import session

torch = optional("torch")

F64, F32 = np.float64, np.float32
OPSET = 19      # AveragePool's dilations


def model_of(nodes, inputs: dict, out="y", unknown=(), opset=OPSET, consts: dict = (), keep=()):
    """loss = ReduceSum(out * w); ``inputs`` (name -> array) declared with their dims, or with the dims in
    ``unknown`` (a set of names) symbolic; ``consts`` as initializers; the tensors ``keep`` graph outputs too."""
    dtype = next(a.dtype for a in inputs.values() if a.dtype.kind == "f")
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    nodes = list(nodes) + [helper.make_node("Mul", [out, "w"], ["weighted"], name="weigh"),
                           helper.make_node("ReduceSum", ["weighted"], ["loss"], name="sum", keepdims=0)]
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype),
                                         [f"{n}{k}" for k in range(a.ndim)] if n in unknown else a.shape)
           for n, a in inputs.items()]
    graph = helper.make_graph(nodes, "g", vis + [helper.make_tensor_value_info("w", elem, None)],
                              [helper.make_tensor_value_info(n, elem, None) for n in ("loss", *keep)],
                              [numpy_helper.from_array(a, n) for n, a in dict(consts).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def forward(model, outputs):
    """A session of ``model`` that outputs ``outputs`` (intermediate tensors) instead of the loss."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    elem = model.graph.output[0].type.tensor_type.elem_type
    probe.graph.output.extend(helper.make_tensor_value_info(o, elem, None) for o in outputs)
    return session(probe)


def finite_differences(run, feeds, w, p, h, smooth):
    """d sum(run(feeds) * w) / d feeds[p], by central differences in float64 (Richardson's with ``smooth``)."""
    def loss(value):
        return float(np.sum(run({**feeds, p: value}).astype(F64) * w))

    def central(step):
        grad = np.zeros(feeds[p].shape)
        for i in np.ndindex(*feeds[p].shape):
            up, down = feeds[p].copy(), feeds[p].copy()
            up[i] += step
            down[i] -= step
            grad[i] = (loss(up) - loss(down)) / (2 * step)
        return grad
    return (4 * central(h / 2) - central(h)) / 3 if smooth else central(h)


def check(nodes, inputs: dict, params, out="y", unknown=(), opset=OPSET, h=1.0, smooth=False, tol=None,
          consts: dict = (), written_out=False, keep=()):
    """The builder's gradients of ``params`` against finite differences of the forward graph (with
    ``written_out``: of the train graph's own forward, its op written out in other ops, float64 ones)."""
    model = model_of(nodes, inputs, out, unknown, opset, consts, keep)
    feeds = dict(inputs)
    grad_model = differentiate(model, list(params), "loss")
    assert {n.domain for n in grad_model.graph.node} <= {"", "ai.onnx"}
    fwd = forward(grad_model if written_out else model, [out])
    y = fwd.run(None, {**feeds, "w": np.zeros(1, next(iter(feeds.values())).dtype)})[0]
    w = np.random.default_rng(7).standard_normal(y.shape).astype(y.dtype)
    got = session(grad_model).run([f"{p}_grad" for p in params], {**feeds, "w": w})
    dtype = y.dtype.type
    tol = tol or (1e-7 if dtype is F64 else 5e-4 if smooth else 1e-4)
    for p, g in zip(params, got):
        want = finite_differences(lambda f: fwd.run(None, {**f, "w": w})[0], feeds, w.astype(F64), p, h, smooth)
        assert g.shape == want.shape, p
        np.testing.assert_allclose(g, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()), err_msg=p)
    return grad_model


def rand(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed + 11 * len(shape) + sum(shape)).standard_normal(shape).astype(dtype)


def spaced(*shape, seed=0):
    """Distinct values 1/4 apart (exact in float32): a step h = 1/32 changes no window's maximum."""
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n).reshape(shape) / 4 - n / 8).astype(F32)


def node(op, ins, outs=("y",), **attrs):
    return helper.make_node(op, list(ins), list(outs), name=f"{op.lower()}_{'_'.join(i for i in ins if i)}", **attrs)


# (spatial dims of x, kernel, out channels, attrs); group g splits x's 4 channels
CONV = {
    "1d": ((9,), (3,), 3, {}),
    "1d_stride_pads_dilation": ((11,), (3,), 3, dict(strides=[2], pads=[1, 2], dilations=[2])),
    "1d_group": ((8,), (2,), 6, dict(group=2, strides=[3], pads=[0, 1])),
    "1d_same_upper": ((10,), (4,), 2, dict(auto_pad="SAME_UPPER", strides=[3])),
    "1d_same_lower": ((9,), (2,), 2, dict(auto_pad="SAME_LOWER", strides=[2])),
    "1d_valid": ((10,), (3,), 2, dict(auto_pad="VALID", strides=[3])),
    "2d_same_lower": ((7, 6), (3, 2), 2, dict(auto_pad="SAME_LOWER", strides=[2, 1])),
    "3d": ((5, 4, 6), (2, 3, 2), 3, dict(strides=[1, 2, 2], pads=[1, 0, 1, 0, 1, 1], dilations=[1, 1, 2])),
    "3d_group": ((4, 5, 4), (2, 2, 3), 4, dict(group=4, strides=[2, 1, 1], pads=[0, 1, 0, 1, 0, 2])),
    # kernels of more than 32 elements: the weight's gradient a Conv by dy rather than a MatMul per offset
    "1d_long_kernel": ((40,), (33,), 2, dict(strides=[2], pads=[3, 1], dilations=[1])),
    "2d_large_kernel_group": ((9, 8), (6, 6), 4, dict(group=2, strides=[2, 1], pads=[1, 1, 0, 2])),
    # depthwise (4 groups of 1 channel): planes of at most conv.DENSE input x output positions (dims known),
    # dense per-channel maps of the plane; else at stride 1 the input's gradient a Conv by the flipped kernel,
    # the weight's a Conv by dy where dy's planes are small (2 x 4 x 3, dims at run time), else the one-hot
    # im2col's MatMul (2 x 12 x 13)
    "2d_depthwise": ((4, 3), (3, 3), 4, dict(group=4, pads=[1, 1, 1, 1])),
    "1d_depthwise_dense": ((7,), (3,), 4, dict(group=4, strides=[2], pads=[1, 2], dilations=[2])),
    "2d_depthwise_dense_strided_dilated": ((4, 3), (3, 2), 4, dict(group=4, strides=[2, 1], dilations=[1, 2],
                                                                   pads=[1, 0, 2, 1])),
    "3d_depthwise_dense": ((3, 2, 3), (2, 2, 2), 4, dict(group=4, pads=[1, 0, 0, 0, 0, 1])),
    "2d_depthwise_dilated_large_planes": ((12, 13), (3, 2), 4, dict(group=4, pads=[2, 1, 1, 2], dilations=[2, 3])),
    "2d_depthwise_strided": ((9, 8), (5, 5), 4, dict(group=4, strides=[2, 2], pads=[2, 2, 2, 2])),
    "2d_pointwise_group": ((5, 6), (1, 1), 4, dict(group=2)),
    # a 1x1 kernel: the input's gradient a Conv by the weight with its channel axes swapped
    "1d_pointwise": ((9,), (1,), 3, {}),
    "2d_pointwise_strided": ((5, 6), (1, 1), 3, dict(strides=[2, 2])),
}


@pytest.mark.parametrize("unknown", [False, True], ids=["dims_known", "dims_at_run_time"])
@pytest.mark.parametrize("case", list(CONV))
def test_conv(case, unknown):
    """Conv with 1-, 2- and 3-D kernels; the input's dims also unknown until run time (the weight's known),
    auto_pad SAME then refused by name."""
    spatial, kernel, m, attrs = CONV[case]
    group = attrs.get("group", 1)
    ins = {"x": rand(2, 4, *spatial, seed=1), "k": rand(m, 4 // group, *kernel, seed=2), "b": rand(m, seed=3)}
    nodes = [node("Conv", ["x", "k", "b"], **attrs)]
    if unknown and "SAME" in attrs.get("auto_pad", ""):
        with pytest.raises(NoGradient, match=f"Conv node 'conv_x_k_b'.*auto_pad {attrs['auto_pad']} with the "
                                             f"input's dims unknown"):
            differentiate(model_of(nodes, ins, unknown={"x"}), ["x", "k"], "loss")
        return
    check(nodes, ins, ["x", "k", "b"], unknown={"x"} if unknown else ())


@pytest.mark.parametrize("cols", [1, 300, 2000], ids=["offset_at_a_time", "offsets_in_chunks", "one_piece"])
def test_conv_weight_gradient_in_chunks(cols, monkeypatch):
    """The weight gradient's im2col (4 channels x 2 samples x 4 x 4 = 128 elements per kernel offset) built
    in chunks of the offsets that fit conv.COLS elements, a MatMul each: the same gradient."""
    from trainrun.graphs.autodiff import conv
    monkeypatch.setattr(conv, "COLS", cols)
    ins = {"x": rand(2, 4, 7, 8, seed=1), "k": rand(3, 4, 3, 3, seed=2)}
    nodes = [node("Conv", ["x", "k"], strides=[2, 2], pads=[1, 0, 1, 1])]
    grad = check(nodes, ins, ["x", "k"])
    matmuls = sum(n.op_type == "MatMul" for n in grad.graph.node)
    assert matmuls == {1: 9, 300: 5, 2000: 1}[cols], matmuls


def test_cnn_gradients_in_few_nodes():
    """A 3x3 Conv, training-mode BatchNorm, Relu, a depthwise 3x3 Conv and a 1x1 Conv, the dims known (a
    train graph of static shapes): each Conv's weight gradient one MatMul (per-sample products summed
    over the batch where the planes are large and the weights small, as here: no transpose of the input
    or dy), the depthwise and 1x1 input gradients Convs (no ConvTranspose), BatchNorm's in twelve
    nodes, its per-channel maps three inference BatchNormalizations (no Sqrt/Reciprocal/Pow chain, and no
    training-mode one, whose variance output differs between onnxruntime's CPU and CUDA kernels), and no
    CastLike of a float constant. (The values: test_conv's cases and test_batch_norm_training_mode.)"""
    ins = {"x": rand(2, 4, 6, 5), "k": rand(8, 4, 3, 3), "g": rand(8), "b": rand(8), "d": rand(8, 1, 3, 3),
           "p": rand(3, 8, 1, 1)}
    consts = {"mu": np.zeros(8, F32), "var": np.ones(8, F32)}
    nodes = [node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
             node("BatchNormalization", ["c", "g", "b", "mu", "var"], ["n", "rm", "rv"], training_mode=1),
             node("Relu", ["n"], ["r"]), node("Conv", ["r", "d"], ["z"], group=8, pads=[1, 1, 1, 1]),
             node("Conv", ["z", "p"], ["y"])]
    grad = differentiate(model_of(nodes, ins, consts=consts, keep=("rm", "rv")), ["x", "k", "g", "b", "d", "p"],
                         "loss")
    ops = {}
    for n in grad.graph.node:
        if n.name.startswith("grad/"):
            ops.setdefault(n.name.split("/")[1], []).append(n.op_type)
    assert ops["conv_x_k"].count("MatMul") == 1, ops["conv_x_k"]
    swaps = [n for n in grad.graph.node if n.name.startswith("grad/conv_x_k/") and n.op_type == "Transpose"
             and list(n.attribute[0].ints[:2]) == [1, 0]]
    assert not swaps, [n.input for n in swaps]
    assert "ConvTranspose" not in ops["conv_r_d"] + ops["conv_z_p"], (ops["conv_r_d"], ops["conv_z_p"])
    bn = [n for n in grad.graph.node if n.name.startswith("grad/batchnormalization_c_g_b_mu_var/")]
    assert sum(n.op_type != "Constant" for n in bn) == 12, [n.op_type for n in bn]
    assert not {"Sqrt", "Reciprocal", "Pow", "ReduceSumSquare"} & {n.op_type for n in bn}
    assert [n.op_type for n in bn].count("BatchNormalization") == 3
    assert not any(a.name == "training_mode" and a.i for n in bn for a in n.attribute)
    assert not any(n.op_type == "CastLike" for n in grad.graph.node)


@pytest.mark.parametrize("kept", [True, False], ids=["running_stats_kept", "running_stats_unread"])
@pytest.mark.parametrize("unknown", [False, True], ids=["dims_known", "dims_at_run_time"])
@pytest.mark.parametrize("spatial", [(5,), (3, 4), (2, 3, 2)], ids=["1d", "2d", "3d"])
def test_batch_norm_training_mode(spatial, unknown, kept):
    """Training-mode BatchNormalization's gradients through the batch's mean and population variance, in
    float64 (a mean and scale far from 0 and 1, epsilon 1e-3), the count per channel known when the graph
    is built or found at run time; its running mean and variance (initializers of zeros and ones) graph
    outputs as ``prepare`` keeps them, or read by nobody: onnxruntime then writes them into their inputs'
    buffers, which its optimiser shares with equal constants (the gradient's vectors of zeros and ones are
    then computed, not constants)."""
    ins = {"x": rand(3, 4, *spatial, dtype=F64) * 2.5 + 3, "g": rand(4, dtype=F64, seed=1),
           "b": rand(4, dtype=F64, seed=2)}
    consts = {"mu": np.zeros(4), "var": np.ones(4)}
    bn = node("BatchNormalization", ["x", "g", "b", "mu", "var"], ["y", "rm", "rv"], epsilon=1e-3, momentum=0.8,
              training_mode=1)
    check([bn], ins, ["x", "g", "b"], unknown={"x"} if unknown else (), smooth=True, h=1e-3, tol=1e-6,
          consts=consts, keep=("rm", "rv") if kept else ())


def test_conv_weight_gradient_of_a_batch_of_one_reads_dy_and_the_input_as_they_lie():
    """A batch of one: a Conv's weight gradient is one MatMul of dy by the input (1x1) or its one-hot im2col
    (3x3), no channel-major Transpose of either (only the MatMul's operand's last two axes swapped, and the
    1x1 kernel's for the input's gradient)."""
    ins = {"x": rand(1, 4, 6, 5, seed=1), "k": rand(6, 4, 1, 1, seed=2), "j": rand(3, 6, 3, 3, seed=3)}
    nodes = [node("Conv", ["x", "k"], ["h"]), node("Conv", ["h", "j"], strides=[2, 1], pads=[1, 0, 1, 1])]
    grad = check(nodes, ins, ["x", "k", "j"])
    for conv in ("conv_x_k", "conv_h_j"):
        made = [n for n in grad.graph.node if n.name.startswith(f"grad/{conv}/")]
        assert [n.op_type for n in made].count("MatMul") == 1, (conv, [n.op_type for n in made])
        swaps = [n.input[0] for n in made if n.op_type == "Transpose" and list(n.attribute[0].ints) == [1, 0, 2, 3]]
        assert swaps in ([], ["k"]), (conv, swaps)


def test_depthwise_gradients_of_small_planes_are_products_by_dense_maps():
    """A depthwise Conv of planes of at most conv.DENSE input x output positions, its dims known: both
    gradients MatMuls by the plane's constant map, no Conv (onnxruntime's grouped Conv runs a channel at a
    time); larger planes (5 x 6 -> 225 x 5 x 6) the Convs. (The values: test_conv's depthwise cases.)"""
    for spatial, dense in (((4, 3), True), ((5, 6), False)):
        ins = {"x": rand(2, 4, *spatial, seed=1), "k": rand(4, 1, 3, 3, seed=2)}
        model = model_of([node("Conv", ["x", "k"], group=4, pads=[1, 1, 1, 1])], ins)
        ops = [n.op_type for n in differentiate(model, ["x", "k"], "loss").graph.node if n.name.startswith("grad/conv")]
        assert (ops.count("MatMul") == 4 and "Conv" not in ops) == dense, (spatial, ops)


# (spatial dims of x, kernel, out channels per group, attrs); x has 4 channels
CONV_TRANSPOSE = {
    "1d": ((5,), (3,), 3, {}),
    "1d_stride_pads_output_padding": ((6,), (3,), 2, dict(strides=[3], pads=[1, 2], output_padding=[2])),
    "1d_dilation_group": ((5,), (2,), 3, dict(dilations=[2], group=2, strides=[2], pads=[0, 1])),
    "1d_output_shape": ((5,), (3,), 2, dict(strides=[2], output_shape=[10])),
    "1d_same_upper": ((5,), (4,), 2, dict(strides=[2], auto_pad="SAME_UPPER")),
    "1d_same_lower": ((5,), (4,), 2, dict(strides=[2], auto_pad="SAME_LOWER")),
    "2d_group": ((4, 5), (3, 2), 1, dict(group=4, strides=[2, 1], pads=[1, 0, 0, 1])),
    "3d": ((3, 4, 3), (2, 2, 3), 2, dict(strides=[2, 1, 2], pads=[0, 1, 1, 1, 0, 0], output_padding=[1, 0, 0])),
}


@pytest.mark.parametrize("unknown", [False, True], ids=["dims_known", "dims_at_run_time"])
@pytest.mark.parametrize("case", list(CONV_TRANSPOSE))
def test_conv_transpose(case, unknown):
    spatial, kernel, m, attrs = CONV_TRANSPOSE[case]
    ins = {"x": rand(2, 4, *spatial, seed=1), "k": rand(4, m, *kernel, seed=2), "b": rand(m * attrs.get("group", 1))}
    nodes = [node("ConvTranspose", ["x", "k", "b"], **attrs)]
    if unknown and ("auto_pad" in attrs or "output_shape" in attrs):
        with pytest.raises(NoGradient, match="ConvTranspose node 'convtranspose_x_k_b'.*output_shape or auto_pad "
                                             "SAME with the input's dims unknown"):
            differentiate(model_of(nodes, ins, unknown={"x"}), ["x", "k"], "loss")
        return
    check(nodes, ins, ["x", "k", "b"], unknown={"x"} if unknown else ())


# (spatial dims of x, attrs)
MAX_POOL = {
    "1d": ((9,), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "1d_ceil_dilated": ((10,), dict(kernel_shape=[2], strides=[3], dilations=[2], ceil_mode=1)),
    "1d_same_upper": ((9,), dict(kernel_shape=[4], strides=[2], auto_pad="SAME_UPPER")),
    "2d_same_lower": ((5, 6), dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_LOWER")),
    "3d": ((4, 5, 4), dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[0, 1, 1, 1, 1, 0])),
    "3d_ceil": ((5, 4, 5), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2], ceil_mode=1)),
}


@pytest.mark.parametrize("unknown", [False, True], ids=["dims_known", "dims_at_run_time"])
@pytest.mark.parametrize("case", list(MAX_POOL))
def test_max_pool(case, unknown):
    """MaxPool routes dy by its own Indices, whatever the window: auto_pad SAME too with the dims unknown."""
    spatial, attrs = MAX_POOL[case]
    check([node("MaxPool", ["x"], **attrs)], {"x": spaced(2, 3, *spatial)}, ["x"], unknown={"x"} if unknown else (),
          h=1 / 32)


# (spatial dims of x, attrs)
AVERAGE_POOL = {
    "1d": ((9,), dict(kernel_shape=[3], strides=[2], pads=[1, 2])),
    "1d_include_pad": ((9,), dict(kernel_shape=[3], strides=[2], pads=[2, 1], count_include_pad=1)),
    "1d_ceil": ((10,), dict(kernel_shape=[3], strides=[3], pads=[1, 0], ceil_mode=1)),
    "1d_ceil_include_pad": ((10,), dict(kernel_shape=[4], strides=[3], pads=[1, 1], ceil_mode=1,
                                        count_include_pad=1)),
    "1d_dilated": ((11,), dict(kernel_shape=[3], strides=[2], dilations=[2], pads=[1, 1])),
    "1d_same_upper": ((10,), dict(kernel_shape=[3], strides=[3], auto_pad="SAME_UPPER")),
    "2d_same_lower_include_pad": ((5, 7), dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_LOWER",
                                               count_include_pad=1)),
    "2d_ceil": ((6, 7), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 0, 1], ceil_mode=1)),
    "3d": ((4, 5, 4), dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[0, 1, 1, 1, 1, 0])),
    "3d_include_pad": ((4, 4, 5), dict(kernel_shape=[2, 2, 3], strides=[1, 2, 2], pads=[1, 0, 1, 0, 1, 1],
                                       count_include_pad=1)),
}


@pytest.mark.parametrize("unknown", [False, True], ids=["dims_known", "dims_at_run_time"])
@pytest.mark.parametrize("case", list(AVERAGE_POOL))
def test_average_pool(case, unknown):
    """AveragePool's divisors (padding counted or not, ceil_mode's last windows) as onnxruntime's kernel has
    them; ceil_mode and auto_pad SAME with the dims unknown until run time refused by name."""
    spatial, attrs = AVERAGE_POOL[case]
    nodes, ins = [node("AveragePool", ["x"], **attrs)], {"x": rand(2, 3, *spatial)}
    if unknown and (attrs.get("ceil_mode") or "auto_pad" in attrs):
        with pytest.raises(NoGradient, match="AveragePool node 'averagepool_x'.*(ceil_mode 1|auto_pad SAME)"):
            differentiate(model_of(nodes, ins, unknown={"x"}), ["x"], "loss")
        return
    check(nodes, ins, ["x"], unknown={"x"} if unknown else ())


LP_POOL = {
    "1d_p2": ((9,), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "2d_p3": ((5, 6), dict(kernel_shape=[2, 3], strides=[1, 2], pads=[0, 1, 1, 0], p=3)),
    "3d_p1_ceil": ((4, 5, 3), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 1], p=1, ceil_mode=1)),
}


@pytest.mark.parametrize("case", list(LP_POOL))
def test_lp_pool(case):
    """|x| kept a step from its kink at 0 (p 1)."""
    spatial, attrs = LP_POOL[case]
    x = rand(2, 3, *spatial)
    check([node("LpPool", ["x"], **attrs)], {"x": np.sign(x) * (np.abs(x) + 0.25)}, ["x"], h=1 / 16, smooth=True)


@pytest.mark.parametrize("op", ["LpPool", "GlobalLpPool"])
def test_lp_pool_of_a_window_of_zeros_has_gradient_zero(op):
    """A window of zeros (after a Relu) has y = 0: its elements get 0, not 0 * y^(1-p) = NaN."""
    x = rand(1, 2, 6)
    x[0, 0] = 0.0
    model = model_of([node(op, ["x"], **({"kernel_shape": [3], "strides": [3]} if op == "LpPool" else {}))],
                     {"x": x})
    w = np.ones((1, 2, 2) if op == "LpPool" else (1, 2, 1), F32)
    got = session(differentiate(model, ["x"], "loss")).run(["x_grad"], {"x": x, "w": w})[0]
    assert np.isfinite(got).all() and not got[0, 0].any() and got[0, 1].all()


@pytest.mark.parametrize("op,spatial", [("GlobalMaxPool", (7,)), ("GlobalMaxPool", (3, 2, 4)),
                                        ("GlobalAveragePool", (7,)), ("GlobalAveragePool", (3, 2, 4)),
                                        ("GlobalLpPool", (7,)), ("GlobalLpPool", (3, 2, 4))])
def test_global_pools(op, spatial):
    smooth = op == "GlobalLpPool"
    attrs = {"p": 3} if smooth and len(spatial) == 3 else {}
    check([node(op, ["x"], **attrs)], {"x": spaced(2, 3, *spatial) if op == "GlobalMaxPool" else rand(2, 3, *spatial)},
          ["x"], unknown={"x"}, h=1 / 16 if smooth else 1 / 32 if op == "GlobalMaxPool" else 1.0, smooth=smooth)


@pytest.mark.parametrize("spatial", [(7,), (3, 4), (2, 3, 3)], ids=["1d", "2d", "3d"])
def test_instance_normalization(spatial):
    check([node("InstanceNormalization", ["x", "s", "b"], epsilon=1e-3)],
          {"x": rand(2, 3, *spatial), "s": rand(3, seed=1), "b": rand(3, seed=2)}, ["x", "s", "b"],
          unknown={"x"}, h=1 / 16, smooth=True)


@pytest.mark.parametrize("opset,dtype", [(21, F64), (21, F32), (18, F64)], ids=["21_f64", "21_f32", "18_per_group"])
def test_group_normalization(opset, dtype):
    """Opset 21's scale and bias per channel, 18's per group (float64: onnxruntime expands the op's function,
    in the input's type where stash_type says so)."""
    per = 6 if opset >= 21 else 2
    stash = {"stash_type": TensorProto.DOUBLE} if opset >= 21 and dtype is F64 else {}
    for spatial in ((5,), (2, 3, 2)):
        check([node("GroupNormalization", ["x", "s", "b"], num_groups=2, epsilon=1e-3, **stash)],
              {"x": rand(2, 6, *spatial, dtype=dtype), "s": rand(per, dtype=dtype, seed=1),
               "b": rand(per, dtype=dtype, seed=2)}, ["x", "s", "b"], opset=opset,
              h=1e-4 if dtype is F64 else 1 / 16, smooth=True, tol=1e-7 if dtype is F64 else None)


@pytest.mark.parametrize("axis", [-1, 1])
def test_rms_normalization(axis):
    """RMSNormalization is opset 23's: where the installed onnx and onnxruntime know it (Python 3.13's), in
    float64 (stash_type double)."""
    if onnx.defs.onnx_opset_version() < 23 or tuple(int(v) for v in ort.__version__.split(".")[:2]) < (1, 22):
        pytest.skip(f"onnx {onnx.__version__} / onnxruntime {ort.__version__}: no RMSNormalization (opset 23)")
    shape = (2, 3, 4)
    check([node("RMSNormalization", ["x", "s"], axis=axis, epsilon=1e-3, stash_type=TensorProto.DOUBLE)],
          {"x": rand(*shape, dtype=F64), "s": rand(*shape[axis:], dtype=F64, seed=1)}, ["x", "s"], opset=23,
          h=1e-4, smooth=True, tol=1e-7)


T, B, I, H = 3, 2, 3, 2      # steps, batch, input width, hidden width
# op: (gates, activations per direction); case: (op, attrs, optional inputs given)
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
RECURRENT = {
    "lstm": ("LSTM", {}, ()),
    "lstm_reverse_all_inputs": ("LSTM", dict(direction="reverse"), ("B", "initial_h", "initial_c", "P")),
    "lstm_bidirectional_layout1": ("LSTM", dict(direction="bidirectional", layout=1), ("B", "initial_h", "initial_c")),
    "lstm_activations": ("LSTM", dict(activations=["Sigmoid", "Relu", "Tanh"]), ("B",)),
    "lstm_gates_tanh_bidirectional": ("LSTM", dict(activations=["Tanh", "Sigmoid", "Sigmoid"] * 2,
                                                   direction="bidirectional"), ("B", "initial_c")),
    "gru": ("GRU", {}, ("B", "initial_h")),
    "gru_bidirectional_linear_before_reset_layout1": ("GRU", dict(direction="bidirectional", linear_before_reset=1,
                                                                  layout=1), ("B", "initial_h")),
    "gru_reverse_linear_before_reset": ("GRU", dict(direction="reverse", linear_before_reset=1), ()),
    "gru_activations": ("GRU", dict(activations=["Sigmoid", "Relu", "Sigmoid", "Tanh"], direction="bidirectional",
                                    hidden_size=H), ("B",)),
    "rnn": ("RNN", {}, ("B",)),
    "rnn_bidirectional_layout1": ("RNN", dict(direction="bidirectional", layout=1, activations=["Relu", "Sigmoid"]),
                                  ("B", "initial_h")),
    "rnn_reverse_full_sequence_lens": ("RNN", dict(direction="reverse"), ("sequence_lens",)),
}


def recurrent(op, attrs, given, dtype=F64, seed=0, as_layout0=False, read=None):
    """(nodes, inputs, params, constants): ``op`` over random inputs, y = its outputs (or those in ``read``)
    flattened and joined. ``as_layout0`` for a layout 1 ``attrs``: the same inputs and y, by a layout 0 node
    between Transposes (onnxruntime's kernels have no layout 1)."""
    d = 2 if attrs.get("direction") == "bidirectional" else 1
    layout, g = attrs.get("layout", 0), GATES[op]
    shapes = {"X": (T, B, I) if not layout else (B, T, I), "W": (d, g * H, I), "R": (d, g * H, H),
              "B": (d, 2 * g * H), "initial_h": (d, B, H) if not layout else (B, d, H), "P": (d, 3 * H)}
    shapes["initial_c"] = shapes["initial_h"]
    ins = {n: rand(*shape, dtype=dtype, seed=seed + k) for k, (n, shape) in enumerate(shapes.items())
           if n in ("X", "W", "R") or n in given}
    order = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
    last = max(order.index(n) for n in list(ins) + list(given))
    names = [n if n in ins or n in given else "" for n in order[:last + 1]]
    outs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    nodes = [node(op, names, outs, **{"hidden_size": H, **attrs})]
    if as_layout0 and layout:
        swap = {"X": [1, 0, 2], "initial_h": [1, 0, 2], "initial_c": [1, 0, 2]}
        nodes = [node("Transpose", [n], [f"{n}_t"], perm=swap[n]) for n in names if n in swap]
        nodes += [node(op, [f"{n}_t" if n in swap else n for n in names], [f"{o}_t" for o in outs],
                       **{"hidden_size": H, **attrs, "layout": 0})]
        nodes += [node("Transpose", [f"{o}_t"], [o], perm=[2, 0, 1, 3] if o == "Y" else [1, 0, 2]) for o in outs]
    nodes += [node("Reshape", [o, "flat"], [f"{o}_flat"]) for o in outs if o in (read or outs)]
    nodes += [node("Concat", [f"{o}_flat" for o in outs if o in (read or outs)], axis=0)]
    consts = {"flat": np.array([-1])}
    if "sequence_lens" in given:
        consts["sequence_lens"] = np.full(B, T, np.int32)
    return nodes, ins, [n for n in ins], consts


@pytest.mark.parametrize("case", list(RECURRENT))
def test_recurrent(case):
    """The op written out in per-timestep ops (float64, and in float32 every case but the LSTMs left whole,
    test_lstm_left_whole): its forward equals onnxruntime's kernel's (float32, which is all the kernel has;
    layout 1 by the kernel's layout 0 between Transposes), and its gradients (float64) the finite differences
    of it."""
    op, attrs, given = RECURRENT[case]
    nodes, ins, params, consts = recurrent(op, attrs, given, F32)
    train = differentiate(model_of(nodes, ins, consts=consts), params, "loss")
    assert (op in {n.op_type for n in train.graph.node}) == (case in WHOLE)
    kernel = model_of(*recurrent(op, attrs, given, F32, as_layout0=True)[:2], consts=consts)
    feeds = {**ins, "w": np.ones(1, F32)}
    np.testing.assert_allclose(forward(train, ["y"]).run(None, feeds)[0], forward(kernel, ["y"]).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-6)
    nodes, ins, params, consts = recurrent(op, attrs, given, F64)
    check(nodes, ins, params, consts=consts, h=1e-5, written_out=True)


# LSTMs onnxruntime's kernel computes forward (layout 0, float32, no peepholes, the default activations): the
# node stays whole, its rule (recurrent._lstm) differentiates it; case: (attrs, optional inputs, outputs read)
WHOLE = {
    "lstm": ({}, (), None),
    "lstm_reverse_full_sequence_lens": (dict(direction="reverse"), ("B", "sequence_lens", "initial_h", "initial_c"),
                                        None),
    "lstm_bidirectional": (dict(direction="bidirectional"), ("B", "initial_h", "initial_c"), None),
    "lstm_bidirectional_y_h": (dict(direction="bidirectional"), ("initial_c",), ["Y_h"]),
    "lstm_y_c": ({}, ("B", "initial_h"), ["Y_c"]),
    "lstm_y_and_y_c": (dict(direction="reverse"), ("initial_c",), ["Y", "Y_c"]),
}


@pytest.mark.parametrize("case", list(WHOLE))
def test_lstm_left_whole(case):
    """An LSTM that onnxruntime's kernel computes stays one node (float32: the kernel's only type), its rule
    differentiating it by the kernel's outputs: its gradients (float32) against float64 finite differences of
    the float64 graph written out in per-timestep ops (test_recurrent checks that one's forward against the
    kernel), within 1e-5 of their scale (float32's rounding over 3 steps: ~3e-7)."""
    attrs, given, read = WHOLE[case]
    nodes, ins, params, consts = recurrent("LSTM", attrs, given, F32, read=read)
    train = differentiate(model_of(nodes, ins, consts=consts), params, "loss")
    kinds = collections.Counter(n.op_type for n in train.graph.node)
    assert kinds["LSTM"] == 1 and kinds["Sigmoid"] == (2 if attrs.get("direction") == "bidirectional" else 1)
    nodes64, ins64, _, _ = recurrent("LSTM", attrs, given, F64, read=read)
    written = differentiate(model_of(nodes64, ins64, consts=consts), params, "loss")
    assert "LSTM" not in {n.op_type for n in written.graph.node}
    written = forward(written, ["y"])
    y = written.run(None, {**ins64, "w": np.zeros(1)})[0]
    np.testing.assert_allclose(forward(train, ["y"]).run(None, {**ins, "w": np.zeros(1, F32)})[0], y,
                               rtol=1e-5, atol=1e-5)
    w = np.random.default_rng(7).standard_normal(y.shape)
    got = session(train).run([f"{p}_grad" for p in params], {**ins, "w": w.astype(F32)})
    for p, g in zip(params, got):
        want = finite_differences(lambda f: written.run(None, {**f, "w": w})[0], ins64, w, p, 1e-5, False)
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()), err_msg=p)


def test_recurrent_written_out_in_few_nodes_per_step():
    """Each node costs onnxruntime a dispatch that outweighs a small cell's arithmetic: an LSTM left whole
    takes 8 nodes a step (the cell state's Mul and Add, backward a Gemm, three Muls, an Add and a Concat) and
    its gates' activations over every step in one node; written out, an LSTM without peepholes takes its i, o
    and f gates' activation in one node a step (peepholes: one a gate), and the steps' slices and states need
    no Squeeze or Unsqueeze per step, forward or backward."""
    def counts(op, attrs, given, steps):
        global T
        saved, T = T, steps
        try:
            nodes, ins, params, consts = recurrent(op, attrs, given, F32)
        finally:
            T = saved
        train = differentiate(model_of(nodes, ins, consts=consts), params, "loss")
        return collections.Counter(n.op_type for n in train.graph.node)
    short, long = counts("LSTM", {}, ("B",), 3), counts("LSTM", {}, ("B",), 9)
    assert long["LSTM"] == 1 and long["Sigmoid"] == 1 and long["Tanh"] == 2
    assert sum(long.values()) - sum(short.values()) == 8 * (9 - 3)
    short, long = counts("LSTM", dict(layout=1), ("B",), 3), counts("LSTM", dict(layout=1), ("B",), 9)
    assert long["Sigmoid"] == 9 and long["Tanh"] == 2 * 9
    shaping = ("Squeeze", "Unsqueeze")
    assert [long[k] for k in shaping] == [short[k] for k in shaping]
    assert counts("LSTM", {}, ("B", "P"), 3)["Sigmoid"] == 3 * 3
    gru = [counts("GRU", dict(direction="bidirectional"), (), steps) for steps in (3, 9)]
    assert [gru[1][k] for k in shaping] == [gru[0][k] for k in shaping]


def test_recurrent_cases_refused_by_name():
    def refused(op, attrs, given, why, unknown=(), seq=None):
        nodes, ins, params, consts = recurrent(op, attrs, given, F32)
        if seq is not None:
            consts["sequence_lens"] = seq
        with pytest.raises(NoGradient, match=f"{op} node '{op.lower()}_.*{why}"):
            differentiate(model_of(nodes, ins, unknown=unknown, consts=consts), params, "loss")
    refused("LSTM", dict(clip=5.0), (), "clip is set")
    refused("LSTM", dict(input_forget=1), (), "input_forget is 1")
    refused("GRU", dict(activations=["HardSigmoid", "Tanh"]), (), "activation HardSigmoid")
    refused("RNN", {}, ("sequence_lens",), "sequence_lens is given and not known to be the full length",
            seq=np.array([T, T - 1], np.int32))
    refused("RNN", {}, (), "sequence length is not known when the graph is built", unknown={"X"})
    nodes, ins, params, consts = recurrent("GRU", {}, ("sequence_lens",), F32)
    del consts["sequence_lens"]
    ins["sequence_lens"] = np.full(B, T, np.int32)
    with pytest.raises(NoGradient, match="sequence_lens is given and not known"):
        differentiate(model_of(nodes, ins, consts=consts), params, "loss")


@pytest.mark.torch
def test_exported_torch_conv1d_lstm_gru_against_autograd():
    """torch's Conv1d, MaxPool1d, a bidirectional batch-first LSTM and a GRU (linear_before_reset 1) as
    torch.onnx.export (TorchScript) writes them, the weights' gate reordering included: the builder's
    gradients of the input and every weight (float32) against torch autograd in float64."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 6, 3, stride=2, padding=1)
            self.pool = torch.nn.MaxPool1d(2, stride=1)
            self.lstm = torch.nn.LSTM(6, 5, batch_first=True, bidirectional=True)
            self.gru = torch.nn.GRU(10, 3)

        def forward(self, x, w):
            h = self.pool(torch.relu(self.conv(x))).transpose(1, 2)
            return (self.gru(self.lstm(h)[0])[0] * w).sum()
    torch.manual_seed(0)
    against_torch_autograd(Net(), torch.randn(2, 4, 11), torch.randn(2, 5, 3))


@pytest.mark.torch
def test_exported_torch_two_layer_lstm_and_its_states_against_autograd():
    """A two-layer bidirectional LSTM (the second layer's input the first's Y: its gradient through the rule)
    whose loss reads Y, h_n and c_n: two LSTM nodes left whole, against torch autograd."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(6, 5, num_layers=2, batch_first=True, bidirectional=True)

        def forward(self, x, w):
            y, (h, c) = self.lstm(x)
            return (y * w).sum() + (h * h).sum() + c.sum()
    torch.manual_seed(0)
    train = against_torch_autograd(Net(), torch.randn(2, 7, 6), torch.randn(2, 7, 10))
    assert [n.op_type for n in train.graph.node].count("LSTM") == 2


def test_ranks_behind_shape_arithmetic_are_folded():
    """A Reshape whose target is a Slice of the input's Shape by bounds from an Add and a Mod of constants (as
    torch exports nn.MultiheadAttention in training mode): onnx's data propagation leaves its rank unknown;
    the arithmetic folded, the Gather that reads it gets its gradient."""
    c = {"one": np.array([1]), "two": np.array(1), "three": np.array([3]), "zero": np.array([0]),
         "heads": np.array([2, 2]), "pick": np.array(1)}
    nodes = [node("Shape", ["x"], ["shape"]), node("Add", ["one", "two"], ["a"]), node("Mod", ["a", "three"], ["m"]),
             node("Slice", ["shape", "zero", "m"], ["lead"]), node("Concat", ["lead", "heads"], ["target"], axis=0),
             node("Reshape", ["x", "target"], ["split"]), node("Gather", ["split", "pick"], ["g"], axis=2),
             node("Tanh", ["g"])]
    check(nodes, {"x": rand(2, 6, 4, dtype=F64)}, ["x"], consts=c, h=1e-5)


@pytest.mark.torch
def test_exported_torch_multihead_attention_in_training_mode_against_autograd():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, w):
            return (self.attention(x, x, x)[0] * w).sum()
    torch.manual_seed(0)
    against_torch_autograd(Net(), torch.randn(2, 5, 8), torch.randn(2, 5, 8), training=True)


def against_torch_autograd(net, x, w, training: bool = False):
    """``net(x, w)``'s loss exported by torch's legacy exporter (``training``: in TrainingMode.TRAINING),
    differentiated by the builder for x and every parameter, run in float32, against torch autograd in
    float64. Returns the train graph."""
    import io
    f = io.BytesIO()
    torch.onnx.export(net, (x, w), f, input_names=["x", "w"], output_names=["loss"], dynamo=False,
                      do_constant_folding=False, opset_version=17,
                      **({"training": torch.onnx.TrainingMode.TRAINING} if training else {}))
    params = [n for n, _ in net.named_parameters()]
    grad_model = differentiate(onnx.load_from_string(f.getvalue()), ["x"] + params, "loss")
    got = session(grad_model).run([f"{p}_grad" for p in ["x"] + params], {"x": x.numpy(), "w": w.numpy()})
    net.double()
    xd = x.double().requires_grad_()
    net(xd, w.double()).backward()
    for name, g, ref in zip(["x"] + params, got, [xd.grad] + [p.grad for p in net.parameters()]):
        ref = ref.numpy()
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(ref).max()), err_msg=name)
    return grad_model
