"""graphs.fuse (trainrun/graphs/fusion.py): the train graph of trainrun's own builder rewritten into fewer
nodes gives the unfused graph's loss and gradients (onnxruntime sessions, one batch) on GPT-2, BERT, Llama,
the CNN recipe and a graph with symbolic dims; each rule on a tiny graph of its own; a real 50-step run with
fusion has the losses of one without; each form of a node the fold computes gives onnxruntime's value.

Tolerance: "float32 reordering". The only rewrite that changes arithmetic is a scalar scale applied to a
product's sum instead of its result (FusedMatMul's alpha; onnxruntime's own MatMulScaleFusion makes the
same change at its default level), one rounding per element apart (2^-24 relative). A gradient is held
to 1e-6 of its largest element (test_autodiff_graphs.py's bound between the two builders); the 50 losses
to 1e-6 relative: the per-element roundings do not accumulate into the loss of a few steps by more
than a few float32 ulps (the runs measured here were equal bit for bit)."""

import collections
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import TRAINRUN, read_metrics, run as run_cmd, write_config
from test_autodiff_graphs import config, feeds_for, run
from trainrun.graphs.forward import forward_from_config
from trainrun.graphs.fusion import fuse
from trainrun.graphs.gradients import build_train_graph
from trainrun.graphs.losses import split_cross_entropy
from trainrun.graphs.manifest import build_options, loss_graph
from trainrun.graphs.names import GRAD_SUFFIX, LOSS

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

# com.microsoft ops the fused graph may hold: registered by stock onnxruntime's CPU and CUDA providers
STOCK_CONTRIB = {"FusedMatMul"}


def ops(model):
    return collections.Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("case", ["gpt2", "bert", "llama", "cnn", "gpt2_dynamic"])
def test_fused_train_graph_equals_the_unfused(tmp_path, case):
    """The builder's train graph and its fused form: the same loss and gradients, fewer nodes; in GPT-2's
    (static shapes) no shape is computed at run time; only standard ops and FusedMatMul; the CNN's Conv
    weights' gradients outputs of their products, in the products' dims (no Reshape copying them into the
    bound output), as many elements as the weight."""
    cfg = config(tmp_path, case)
    fwd = forward_from_config(cfg)
    model, dropout = loss_graph(cfg, fwd, build_options(cfg))
    keep = list((fwd.states or {}).values())
    plain = split_cross_entropy(build_train_graph(model, fwd.params, case, keep, builder="trainrun"))
    fused = fuse(plain)
    before, after = ops(plain), ops(fused)
    assert sum(after.values()) < 0.8 * sum(before.values()), (sum(before.values()), sum(after.values()))
    if case == "gpt2":
        assert before["Shape"] and not after["Shape"] and not after["Identity"], after
        constants = {n.output[0] for n in fused.graph.node if n.op_type == "Constant"}
        assert not [n for n in fused.graph.node if n.op_type in ("Cast", "CastLike") and n.input[0] in constants]
        assert after["FusedMatMul"] > 0
    assert {n.domain for n in fused.graph.node if n.domain not in ("", "ai.onnx")} <= {"com.microsoft"}
    assert {n.op_type for n in fused.graph.node if n.domain == "com.microsoft"} <= STOCK_CONTRIB
    assert [o.name for o in fused.graph.output] == [o.name for o in plain.graph.output]
    feeds = feeds_for(cfg, fwd, model, dropout, np.random.default_rng(7))
    want, got = run(plain, feeds), run(fused, feeds)
    assert got[LOSS] == pytest.approx(float(want[LOSS]), rel=1e-6)
    for p in fwd.params + keep:
        name = p + GRAD_SUFFIX if p in fwd.params else p
        g, w = got[name], want[name]
        assert g.size == w.size and np.abs(g.reshape(w.shape) - w).max() <= 1e-6 * max(np.abs(w).max(), 1e-30), name
    made = {o: n.op_type for n in fused.graph.node for o in n.output}
    flat = [o.name for o in fused.graph.output if o.name.endswith(GRAD_SUFFIX) and made[o.name] == "Reshape"]
    if case == "cnn":
        convs = [n.input[1] + GRAD_SUFFIX for n in plain.graph.node if n.op_type == "Conv"]
        assert convs and not set(convs) & set(flat), flat


# -- one rule at a time, on graphs of a few nodes -----------------------------------------------------

def graph(nodes, inputs, outputs, inits=(), ms=False):
    """A model of ``nodes``; ``inputs``/``outputs``: (name, dims) float32 tensors."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 9
    return m


def const(name, value, dtype=np.int64):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype)))


def same_outputs(a, b, inputs, seed=0):
    """``a`` and ``b`` on one random batch: every output the same to float32 reordering (1e-6 relative)."""
    rng = np.random.default_rng(seed)
    feeds = {n: rng.normal(size=d).astype(np.float32) for n, d in inputs}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL     # our rewrite, not onnxruntime's
    outs = []
    for m in (a, b):
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        outs.append(dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds))))
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        np.testing.assert_allclose(outs[1][k], outs[0][k], rtol=1e-6, atol=1e-7, err_msg=k)
    return outs[1]


def test_static_shapes_fold_into_constants():
    """Shape -> Gather -> Concat -> Reshape of a tensor of known dims, a Size, and a CastLike of a constant
    become constants: only the Reshape and the Mul run."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), const("i", [0]), const("last", [-1]),
             helper.make_node("Gather", ["s", "i"], ["b"], axis=0),
             helper.make_node("Concat", ["b", "last"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Size", ["x"], ["n"]), helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             const("half", 0.5, np.float64), helper.make_node("CastLike", ["half", "x"], ["h"]),
             helper.make_node("Mul", ["r", "h"], ["m"]), helper.make_node("Div", ["m", "nf"], ["y"])]
    m = graph(nodes, [("x", [2, 3, 4])], [("y", [2, 12])])
    f = fuse(m)
    assert {n.op_type for n in f.graph.node} == {"Constant", "Reshape", "Mul", "Div"}, ops(f)
    same_outputs(m, f, [("x", [2, 3, 4])])


def test_a_gradient_output_reshaped_from_a_product_is_the_product():
    """w_grad made by a Reshape of a MatMul's [4, 6] into [4, 3, 2, 1]: the MatMul writes w_grad itself,
    declared [4, 6] (the engine binds the weight's view of the buffer so); the same values. A Reshape into
    any other output, or of a tensor something else reads too, stays."""
    nodes = [helper.make_node("MatMul", ["a", "b"], ["p"]), const("s", [4, 3, 2, 1]),
             helper.make_node("Reshape", ["p", "s"], ["w_grad"]),
             helper.make_node("MatMul", ["a", "b"], ["q"]), helper.make_node("Reshape", ["q", "s"], ["logits"]),
             helper.make_node("MatMul", ["a", "b"], ["r"]), helper.make_node("Reshape", ["r", "s"], ["v_grad"]),
             helper.make_node("Neg", ["r"], ["r_neg"])]
    ins = [("a", [4, 5]), ("b", [5, 6])]
    m = graph(nodes, ins, [("w_grad", [4, 3, 2, 1]), ("logits", [4, 3, 2, 1]), ("v_grad", [4, 3, 2, 1]),
                           ("r_neg", [4, 6])])
    f = fuse(m)
    made = {o: n.op_type for n in f.graph.node for o in n.output}
    assert [made["w_grad"], made["logits"], made["v_grad"]] == ["MatMul", "Reshape", "Reshape"], made
    dims = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in f.graph.output}
    assert dims["w_grad"] == [4, 6] and dims["logits"] == dims["v_grad"] == [4, 3, 2, 1]
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(size=d).astype(np.float32) for n, d in ins}
    run_ = lambda g: ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        ["w_grad"], feeds)[0]
    np.testing.assert_allclose(run_(f).reshape(4, 3, 2, 1), run_(m), rtol=1e-6)


def test_a_broadcast_sum_over_a_symbolic_dim_gets_constant_axes():
    """The builder's sum of a broadcast gradient where a dim is symbolic (found at run time from two
    Shapes, NonZero, ...) becomes one ReduceSum over constant axes, without keepdims, when the target's
    dims are known."""
    from trainrun.graphs.autodiff import differentiate
    nodes = [helper.make_node("Add", ["x", "b"], ["z"]), helper.make_node("Mul", ["z", "z"], ["zz"]),
             helper.make_node("ReduceSum", ["zz"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5]),
                                       helper.make_tensor_value_info("b", TensorProto.FLOAT, [5])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    train = differentiate(m, ["b"], "loss")
    assert {"NonZero", "Shape"} <= set(ops(train))
    f = fuse(train)
    assert not {"NonZero", "Size", "Equal", "Concat", "Identity"} & set(ops(f)), ops(f)
    assert ops(f)["Shape"] == 1             # ReduceSum's gradient, an Expand to the symbolic shape
    sums = [n for n in f.graph.node if n.op_type == "ReduceSum" and n.output[0] == "b_grad"]
    assert sums and any(a.name == "keepdims" and a.i == 0 for a in sums[0].attribute)
    same_outputs(train, f, [("x", [3, 5]), ("b", [5])])


def test_no_op_nodes_go_and_outputs_keep_their_names():
    """Identity, a Cast to its own type, a Reshape to its own shape, a Mul by 1: gone; the graph output an
    Identity wrote keeps its name (its producer writes it); a tensor asked to be kept stays."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Cast", ["a"], ["c"], to=TensorProto.FLOAT),
             const("shape", [2, 3]), helper.make_node("Reshape", ["c", "shape"], ["r"]),
             const("one", 1.0, np.float32), helper.make_node("Mul", ["one", "r"], ["m"]),
             helper.make_node("Sigmoid", ["m"], ["s"]), helper.make_node("Identity", ["s"], ["y"]),
             helper.make_node("Identity", ["a"], ["kept"]), helper.make_node("Neg", ["kept"], ["y2"])]
    m = graph(nodes, [("x", [2, 3])], [("y", [2, 3]), ("y2", [2, 3])])
    f = fuse(m, keep=["kept"])
    assert [(n.op_type, n.output[0]) for n in f.graph.node if n.op_type != "Constant"] == [
        ("Relu", "kept"), ("Sigmoid", "y"), ("Neg", "y2")]
    same_outputs(m, f, [("x", [2, 3])])


FOLDS = {   # the forms the fold once computed otherwise than onnxruntime: nodes, their outputs' types, opset
    # a torch-exported GPT-2's attention mask (transformers): a [batch, seq] mask flattened at axis 2 (its
    # rank: [batch * seq, 1]), then gathered; folded as [1, batch * seq], the Gather ran out of range
    "flatten_at_rank": ([const("m", [[True, False, True], [False, True, True]], bool),
                         helper.make_node("Flatten", ["m"], ["f"], axis=2), const("i", [[5], [1]]),
                         helper.make_node("Gather", ["f", "i"], ["y"], axis=0)], {"f": TensorProto.BOOL,
                                                                                  "y": TensorProto.BOOL}, 17),
    "flatten_negative": ([const("x", np.arange(24).reshape(2, 3, 4)),
                          helper.make_node("Flatten", ["x"], ["y"], axis=-1)], {"y": TensorProto.INT64}, 17),
    # integer Div truncates toward zero (NumPy's // floors)
    "div_negative": ([const("a", [-7, 7, -7, 7, -6]), const("b", [2, -2, -2, 2, 3]),
                      helper.make_node("Div", ["a", "b"], ["y"])], {"y": TensorProto.INT64}, 17),
    # an empty axes list: every axis reduced, or none with noop_with_empty_axes (NumPy's axis=() reduces none)
    "reducesum_empty_axes": ([const("x", np.arange(6).reshape(2, 3)), const("e", np.zeros(0, np.int64)),
                              helper.make_node("ReduceSum", ["x", "e"], ["y"]),
                              helper.make_node("ReduceSum", ["x", "e"], ["z"], noop_with_empty_axes=1)],
                             {"y": TensorProto.INT64, "z": TensorProto.INT64}, 17),
    "reduceprod_empty_axes": ([const("x", np.arange(1, 7).reshape(2, 3)), const("e", np.zeros(0, np.int64)),
                               helper.make_node("ReduceProd", ["x", "e"], ["y"], keepdims=0)],
                              {"y": TensorProto.INT64}, 18),
    # Unsqueeze and Squeeze with their axes an input (opset 13 on), a negative one among them
    "unsqueeze_squeeze": ([const("x", [[3, 4]]), const("a", [0, -1]), const("s", [-3]),
                           helper.make_node("Unsqueeze", ["x", "a"], ["u"]),
                           helper.make_node("Squeeze", ["u", "s"], ["y"])], {"u": TensorProto.INT64,
                                                                             "y": TensorProto.INT64}, 17),
    # a cast to bfloat16 rounds (onnx 1.17 gives it NumPy's float32: a fold there would not round)
    "cast_bfloat16": ([const("x", [1 + 2 ** -9, -3.0078125, 1e-3], np.float32),
                       helper.make_node("Cast", ["x"], ["h"], to=TensorProto.BFLOAT16),
                       helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)], {"y": TensorProto.FLOAT}, 17),
}


@pytest.mark.parametrize("case", sorted(FOLDS))
def test_folded_constants_are_onnxruntimes_values(case):
    """Each form of a node the fold computes itself: the fused graph's outputs are the values, dtypes and
    shapes onnxruntime computes from the unfused graph (no optimization: onnxruntime's own folding off);
    every node but a bfloat16 cast (not where onnx has no dtype of it) is folded into a constant."""
    nodes, outputs, opset = FOLDS[case]
    g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(k, t, None) for k, t in outputs.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    f = fuse(m)
    if case != "cast_bfloat16" or helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16) != np.float32:
        assert set(ops(f)) == {"Constant"}, ops(f)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want, got = (ort.InferenceSession(x.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {})
                 for x in (m, f))
    for name, w, v in zip(outputs, want, got):
        assert v.dtype == w.dtype and v.shape == w.shape and np.array_equal(v, w), (name, v, w)


def test_reshape_chains_and_keepdims_reductions():
    """A Reshape of a Reshape reads the first one's input; ReduceSum(keepdims) + a Reshape dropping the
    reduced axes (a bias's gradient) is one ReduceSum without keepdims."""
    nodes = [const("s1", [6, 4]), const("s2", [2, 12]), const("axes", [0, 1]), const("s3", [4]),
             helper.make_node("Reshape", ["x", "s1"], ["r1"]), helper.make_node("Reshape", ["r1", "s2"], ["y"]),
             helper.make_node("ReduceSum", ["x", "axes"], ["k"], keepdims=1),
             helper.make_node("Reshape", ["k", "s3"], ["b"])]
    m = graph(nodes, [("x", [2, 3, 4])], [("y", [2, 12]), ("b", [4])])
    f = fuse(m)
    assert ops(f)["Reshape"] == 1 and next(n for n in f.graph.node if n.op_type == "Reshape").input[0] == "x"
    reduce = next(n for n in f.graph.node if n.op_type == "ReduceSum")
    assert reduce.output[0] == "b" and helper.get_attribute_value(reduce.attribute[0]) == 0
    same_outputs(m, f, [("x", [2, 3, 4])])


def test_transposes_compose_and_cancel():
    nodes = [helper.make_node("Transpose", ["x"], ["t1"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 2, 1, 3]),
             helper.make_node("Relu", ["t2"], ["y"]),
             helper.make_node("Transpose", ["x"], ["u1"], perm=[1, 0, 2, 3]),
             helper.make_node("Transpose", ["u1"], ["z"], perm=[0, 2, 1, 3])]
    m = graph(nodes, [("x", [2, 3, 4, 5])], [("y", [2, 3, 4, 5]), ("z", [3, 4, 2, 5])])
    f = fuse(m)
    assert [(n.op_type, list(n.input)) for n in f.graph.node] == [("Relu", ["x"]), ("Transpose", ["x"])]
    assert list(f.graph.node[1].attribute[0].ints) == [1, 2, 0, 3]
    same_outputs(m, f, [("x", [2, 3, 4, 5])])


def test_products_read_transposes_and_scales():
    """Attention's products: a Transpose of the last two dims of either operand read by a FusedMatMul
    (transA/transB), a scalar Mul after it its alpha; a Gemm's transposed operand its transB; the weight
    gradient's explicit transpose ([M, 1, K] permuted, autodiff/matrix.py) left alone."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), const("scale", 0.125, np.float32),
             helper.make_node("Mul", ["s", "scale"], ["scores"]),
             helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["qt", "k"], ["g"]),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("Gemm", ["x", "wt"], ["lin"]),
             const("s3", [8, 1, 6]), const("s2", [6, 8]),
             helper.make_node("Reshape", ["x", "s3"], ["x3"]),
             helper.make_node("Transpose", ["x3"], ["x3t"], perm=[2, 0, 1]),
             helper.make_node("Reshape", ["x3t", "s2"], ["xt"]),
             helper.make_node("MatMul", ["xt", "dy"], ["dw"])]
    inputs = [("q", [2, 4, 3]), ("k", [2, 4, 3]), ("w", [5, 6]), ("x", [8, 6]), ("dy", [8, 5])]
    m = graph(nodes, inputs, [("scores", [2, 4, 4]), ("g", [2, 3, 3]), ("lin", [8, 5]), ("dw", [6, 5])])
    f = fuse(m)
    fused = {n.output[0]: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in f.graph.node
             if n.op_type in ("FusedMatMul", "Gemm")}
    assert fused["scores"]["transB"] == 1 and fused["scores"]["alpha"] == pytest.approx(0.125)
    assert fused["g"]["transA"] == 1 and fused["lin"]["transB"] == 1
    assert ops(f)["Transpose"] == 1 and ops(f)["MatMul"] == 1          # the weight gradient's, as it was
    same_outputs(m, f, inputs)


def test_scaled_operands_and_transposed_results_of_products():
    """Attention's backward: dS times a scalar read only by products is their alpha (the Mul goes); the same
    Mul also read by a Relu stays; a Transpose of a product's last two dims is the product of the swapped
    operands, read transposed the other way (dK = (Q^T dS)^T as dS^T Q), unless that product would read its
    left operand transposed where the first did not."""
    nodes = [const("scale", 0.125, np.float32), helper.make_node("Mul", ["ds", "scale"], ["dss"]),
             helper.make_node("MatMul", ["dss", "k"], ["dq"]),
             helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["qt", "dss"], ["dkt"]),
             helper.make_node("Transpose", ["dkt"], ["dk"], perm=[0, 2, 1]),
             const("three", 3.0, np.float32), helper.make_node("Mul", ["ds", "three"], ["d3"]),
             helper.make_node("MatMul", ["d3", "k"], ["p3"]), helper.make_node("Relu", ["d3"], ["r3"]),
             helper.make_node("MatMul", ["x", "w"], ["xw"]),
             helper.make_node("Transpose", ["xw"], ["head"], perm=[1, 0])]
    inputs = [("ds", [2, 4, 4]), ("q", [2, 4, 3]), ("k", [2, 4, 3]), ("x", [6, 5]), ("w", [5, 7])]
    m = graph(nodes, inputs, [("dq", [2, 4, 3]), ("dk", [2, 4, 3]), ("p3", [2, 4, 3]), ("r3", [2, 4, 4]),
                              ("head", [7, 6])])
    f = fuse(m)
    made = {n.output[0]: n for n in f.graph.node}
    attrs = {o: {a.name: helper.get_attribute_value(a) for a in made[o].attribute} for o in ("dq", "dk")}
    assert list(made["dq"].input) == ["ds", "k"] and attrs["dq"]["alpha"] == pytest.approx(0.125)
    assert list(made["dk"].input) == ["ds", "q"] and attrs["dk"]["alpha"] == pytest.approx(0.125)
    assert (attrs["dk"]["transA"], attrs["dk"]["transB"]) == (1, 0)
    assert list(made["p3"].input) == ["d3", "k"] and made["d3"].op_type == "Mul"
    # a plain product's result stays transposed (B^T A^T would read its left operand transposed: slower in MLAS)
    assert ops(f)["Transpose"] == 1 and made["head"].op_type == "Transpose" and made["head"].input == ["xw"]
    same_outputs(m, f, inputs)


def test_fifty_steps_with_fusion_equal_fifty_without(tmp_path, byte_dataset):
    """A real tiny run (trainrun's builder, one process) with graphs.fuse true and false: the same 50 losses
    to 1e-6 relative, and the fused graph has fewer nodes."""
    losses, nodes = {}, {}
    for fuse_on in (True, False):
        d = tmp_path / str(fuse_on)
        d.mkdir()
        cfg = write_config(d / "c.yaml", byte_dataset, **{"graphs.builder": "trainrun", "graphs.fuse": fuse_on,
                                                          "train.max_steps": 50})
        run_cmd([TRAINRUN, "--config", cfg], check=0)
        train, _ = read_metrics(str(d / "run"))
        losses[fuse_on] = [train[s]["loss"] for s in sorted(train)]
        nodes[fuse_on] = len(onnx.load(os.path.join(d / "run", "graphs", "train.onnx")).graph.node)
    assert len(losses[True]) == 50 and losses[True][-1] < losses[True][0]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)
    assert nodes[True] < 0.8 * nodes[False], nodes


def test_the_engine_binds_gradients_left_in_their_products_dims(tmp_path):
    """The CNN recipe prepared with trainrun's builder (fused: its Conv weights' gradient outputs in their
    products' dims), run by the engine: the gradient buffer holds the unfused graph's gradients, each in its
    weight's layout."""
    from trainrun.graphs.manifest import prepare
    from trainrun.step.engine import Engine, EngineOptions
    cfg = config(tmp_path, "cnn")
    cfg.graphs.builder, cfg.run.output_dir = "trainrun", str(tmp_path / "run")
    fwd = forward_from_config(cfg)
    model, dropout = loss_graph(cfg, fwd, build_options(cfg))
    keep = list((fwd.states or {}).values())
    plain = build_train_graph(model, fwd.params, "cnn", keep, builder="trainrun")
    out = prepare(cfg)
    train = onnx.load(os.path.join(out, "train.onnx"))
    dims = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in train.graph.output}
    inits = {t.name: numpy_helper.to_array(t) for t in fwd.model.graph.initializer}
    assert any(len(dims[p + GRAD_SUFFIX]) != inits[p].ndim for p in fwd.params), "no gradient left flat"
    rng = np.random.default_rng(5)
    batch = {"x": rng.normal(0, 1, (4, 1, 24, 24)).astype(np.float32), "labels": rng.integers(0, 10, 4)}
    shapes = {k: (v.shape, v.dtype) for k, v in batch.items()}
    eng = Engine(out, EngineOptions(threads=1), shapes, shapes)
    eng.load_weights()
    loss = eng.forward_backward(batch, accumulate=False)
    want = run(plain, {**{p: inits[p] for p in fwd.params}, **{s: inits[s] for s in fwd.states}, **batch})
    assert loss == pytest.approx(float(want[LOSS]), rel=1e-6)
    for i, p in enumerate(eng.layout.names):
        got, w = eng.layout.view(eng.grads, i), want[p + GRAD_SUFFIX]
        assert np.abs(got - w).max() <= 1e-6 * max(np.abs(w).max(), 1e-30), p
