"""The built-in GPT-2 graph against transformers' GPT-2 (an independent reference)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from trainrun import config as C
from trainrun.graphs.gradients import build_train_graph, direct_gradients
from trainrun.graphs.losses import _cross_entropy_grad_by_exp
from trainrun.graphs.manifest import prepare
from trainrun.graphs.names import GRAD_SUFFIX, LOSS, RESET
from trainrun.step.engine import Engine, EngineOptions
from trainrun.models.gpt2 import build_gpt2, init_weights, param_count

from conftest import assert_matches_torch, hf_gpt2, optional

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

torch = optional("torch")

SHAPES = [
    dict(n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=97),
    dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=300),
    dict(n_layer=3, n_head=6, n_embd=96, n_positions=128, vocab_size=1024),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.torch
def test_logits_match_transformers(shape):
    gcfg = C.GPT2Config(**shape)
    weights = init_weights(gcfg, seed=7)
    assert param_count(gcfg) == sum(w.size for w in weights.values())
    sess = ort.InferenceSession(build_gpt2(gcfg, weights).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    hf = hf_gpt2(shape, weights).eval()
    rng = np.random.default_rng(0)
    for batch, seq in [(1, 1), (2, shape["n_positions"] // 2), (3, shape["n_positions"])]:
        ids = rng.integers(0, shape["vocab_size"], (batch, seq))
        ours = sess.run(["logits"], {"input_ids": ids})[0]
        with torch.no_grad():
            ref = hf(torch.from_numpy(ids)).logits.numpy()
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() < 1e-4, (shape, batch, seq)


def test_initialisation_is_seeded_and_gpt2_like():
    gcfg = C.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048)
    a, b, c = init_weights(gcfg, 1), init_weights(gcfg, 1), init_weights(gcfg, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["transformer.wte.weight"], c["transformer.wte.weight"])
    assert a["transformer.wte.weight"].std() == pytest.approx(0.02, rel=0.02)
    assert a["transformer.h.0.mlp.c_proj.weight"].std() == pytest.approx(0.02 / np.sqrt(8), rel=0.03)
    assert (a["transformer.h.0.ln_1.weight"] == 1).all() and (a["transformer.h.0.attn.c_attn.bias"] == 0).all()


def make_engine(tmp_path, shape, batch, seq, **cfg_over):
    cfg = C.from_dict({"model": {"gpt2": shape}, "data": {"seq_len": seq}, "train": {"micro_batch_size": batch},
                       "run": {"output_dir": str(tmp_path), "seed": 3}, **cfg_over})
    graphs_dir = prepare(cfg)
    shapes = {"input_ids": ((batch, seq), np.int64), "labels": ((batch, seq), np.int64)}
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    eng.load_weights()
    return eng


@pytest.mark.torch
def test_train_graph_gradients_match_torch(tmp_path, tiny_gpt2):
    eng = make_engine(tmp_path, tiny_gpt2, batch=4, seq=32, optimizer={"name": "sgd"})
    weights = {k: v.copy() for k, v in eng.layout.unflatten(eng.params).items()}
    hf = hf_gpt2(tiny_gpt2, weights)
    rng = np.random.default_rng(1)
    batch = {"input_ids": rng.integers(0, 300, (4, 32)), "labels": rng.integers(0, 300, (4, 32))}
    batch["labels"][0, :5] = -100   # ignored positions count for neither loss nor gradient
    eng.grads[:] = 123.0            # stale content: lazy reset must overwrite it
    loss = eng.forward_backward(batch, accumulate=False)
    assert_matches_torch(eng, loss, hf, batch, 300, rel=1e-4)

    # accumulation happens in place: a second identical micro-batch doubles the buffer
    first = eng.grads.copy()
    eng.forward_backward(batch, accumulate=True)
    np.testing.assert_allclose(eng.grads, 2 * first, rtol=1e-5, atol=1e-9)
    # the parameters are never written by the train graph
    assert all(np.array_equal(v, weights[k]) for k, v in eng.layout.unflatten(eng.params).items())


def test_direct_gradients_write_the_accumulators_bits(tmp_path, tiny_gpt2):
    """Without accumulation the engine runs the train graph with its gradients as outputs bound to the
    flat buffer (graphs.gradients.direct_gradients): the same loss and the same gradient bits as the graph with
    InPlaceAccumulatorV2, stale buffer content overwritten, and accumulation (added by the engine) too."""
    acc = make_engine(tmp_path, tiny_gpt2, batch=2, seq=32)
    shapes = {"input_ids": ((2, 32), np.int64), "labels": ((2, 32), np.int64)}
    direct = Engine(acc.dir, EngineOptions(threads=1, direct_gradients=True), shapes, shapes)
    acc.reopen(EngineOptions(threads=1))
    direct.params[:] = acc.params
    assert RESET not in direct.train_s.input_names and not direct.flags
    rng = np.random.default_rng(4)
    batch = {"input_ids": rng.integers(0, 300, (2, 32)), "labels": rng.integers(0, 300, (2, 32))}
    acc.grads[:] = 5.0
    direct.grads[:] = np.nan
    assert direct.forward_backward(batch, accumulate=False) == acc.forward_backward(batch, accumulate=False)
    assert np.array_equal(direct.grads, acc.grads) and np.abs(acc.grads).max() > 0
    # a later micro-batch's gradients are added in the engine: the accumulators' bits again
    batch2 = {"input_ids": rng.integers(0, 300, (2, 32)), "labels": rng.integers(0, 300, (2, 32))}
    direct.forward_backward(batch2, accumulate=True)
    acc.forward_backward(batch2, accumulate=True)
    assert np.array_equal(direct.grads, acc.grads)


def test_eval_graph_matches_train_loss(tmp_path, tiny_gpt2):
    eng = make_engine(tmp_path, tiny_gpt2, batch=2, seq=16)
    rng = np.random.default_rng(2)
    batch = {"input_ids": rng.integers(0, 300, (2, 16)), "labels": rng.integers(0, 300, (2, 16))}
    assert eng.evaluate(batch) == pytest.approx(eng.forward_backward(batch, accumulate=False), rel=1e-6)


@pytest.mark.parametrize("reduction,ignore_index,rank", [("mean", 2, 2), ("sum", None, 2), ("mean", None, 3),
                                                         ("sum", 1, 3)])
@pytest.mark.ort_training
def test_cross_entropy_gradient_by_exp_matches_numpy(reduction, ignore_index, rank):
    """graphs.losses._cross_entropy_grad_by_exp in every form it takes (mean or sum, with or without
    ignore_index, class axis 1 of a 2-D or 3-D input) against the float64 NumPy gradient of
    softmax cross-entropy, and against onnxruntime's own SoftmaxCrossEntropyLossGrad."""
    n, d, k, c = 6, 3, 4, 37
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, d, k) if rank == 3 else (n, k)).astype(np.float32)
    w = rng.standard_normal((k, c)).astype(np.float32)
    labels = rng.integers(0, c, (n, d) if rank == 3 else (n,))
    if ignore_index is not None:
        labels.flat[[0, 4]] = ignore_index
    attrs = {"reduction": reduction, **({} if ignore_index is None else {"ignore_index": ignore_index})}
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["z"])]
    if rank == 3:      # classes on axis 1: [n, c, d]
        nodes.append(onnx.helper.make_node("Transpose", ["z"], ["logits"], perm=[0, 2, 1]))
    else:
        nodes[0].output[0] = "logits"
    nodes.append(onnx.helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], [LOSS, "log_prob"], **attrs))
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    graph = onnx.helper.make_graph(nodes, "ce", [onnx.helper.make_tensor_value_info("x", f32, list(x.shape)),
                                                 onnx.helper.make_tensor_value_info("w", f32, [k, c]),
                                                 onnx.helper.make_tensor_value_info("labels", i64, list(labels.shape))],
                                   [onnx.helper.make_tensor_value_info(LOSS, f32, [])])
    loss_model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    loss_model.ir_version = 8
    train = build_train_graph(loss_model, ["w"], "test")
    plain = onnx.ModelProto()
    plain.CopyFrom(train)
    _cross_entropy_grad_by_exp(train)
    assert "SoftmaxCrossEntropyLossGrad" not in {m.op_type for m in train.graph.node}

    def run(model):      # w's gradient as an output (graphs.gradients.direct_gradients)
        direct, outputs = direct_gradients(model)
        sess = ort.InferenceSession(direct.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run([outputs["w"]], {"x": x, "w": w, "labels": labels})[0].astype(np.float64)

    z = (x.astype(np.float64) @ w).reshape(-1, c)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = labels.reshape(-1)
    keep = np.ones(len(y), bool) if ignore_index is None else y != ignore_index
    p[np.arange(len(y)), np.where(keep, y, 0)] -= 1
    p *= keep[:, None] / (keep.sum() if reduction == "mean" else 1)
    want = x.reshape(-1, k).astype(np.float64).T @ p
    got = run(train)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    np.testing.assert_allclose(got, run(plain), rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("head,axis", [("Gemm", 0), ("Transpose", 1)])
@pytest.mark.ort_training
def test_tied_embedding_gradient_matches_numpy(head, axis):
    """graphs.ort_gradients._scatter_tied_gradients on both of its paths: a head whose gradient is the embedding's shape
    (Gemm(h, E, transB=1): rows scattered into it along axis 0) and a head through a Transpose
    (MatMul(h, Transpose(E)): scattered into the Transpose's input along axis 1), repeated ids, against
    the float64 NumPy gradient."""
    v, d, n = 41, 8, 12
    rng = np.random.default_rng(8)
    emb = rng.standard_normal((v, d)).astype(np.float32)
    ids = rng.integers(0, 5, n)                       # few distinct rows: the adds must be summed
    w = rng.standard_normal((n, v)).astype(np.float32)
    h = onnx.helper.make_node("Gather", ["E", "ids"], ["h"], axis=0)
    if head == "Gemm":
        heads = [onnx.helper.make_node("Gemm", ["h", "E"], ["logits"], transB=1)]
    else:
        heads = [onnx.helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
                 onnx.helper.make_node("MatMul", ["h", "Et"], ["logits"])]
    loss = [onnx.helper.make_node("Mul", ["logits", "W"], ["lw"]),
            onnx.helper.make_node("ReduceSum", ["lw"], [LOSS], keepdims=0)]
    f32 = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph([h, *heads, *loss], "tied",
                                   [onnx.helper.make_tensor_value_info("E", f32, [v, d]),
                                    onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [n])],
                                   [onnx.helper.make_tensor_value_info(LOSS, f32, [])],
                                   initializer=[onnx.numpy_helper.from_array(w, "W")])
    loss_model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    loss_model.ir_version = 8
    train, outputs = direct_gradients(build_train_graph(loss_model, ["E"], "test"))
    scatters = [m for m in train.graph.node if m.op_type == "ScatterElements"]
    assert [a.i for m in scatters for a in m.attribute if a.name == "axis"] == [axis]
    assert "GatherGrad" not in {m.op_type for m in train.graph.node}
    sess = ort.InferenceSession(train.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run([outputs["E"]], {"E": emb, "ids": ids})[0]
    e64, w64 = emb.astype(np.float64), w.astype(np.float64)
    want = w64.T @ e64[ids]                            # through the head
    np.add.at(want, ids, w64 @ e64)                     # through the lookup
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.torch
@pytest.mark.ort_training
def test_vocabulary_sized_loss_and_tied_gradient_match_transformers(tmp_path):
    """The cross-entropy as LogSoftmax + NegativeLogLikelihoodLoss, its gradient from Exp(log_prob), the
    tied embedding's gradient added by ScatterElements (graphs.losses.split_cross_entropy,
    graphs.losses._cross_entropy_grad_by_exp, graphs.ort_gradients._scatter_tied_gradients), every
    weight gradient a MatMul over a transposed input, no Gemm with transA
    (graphs.ort_gradients._untransposed_weight_gradients), against transformers' GPT-2 in float64: a vocabulary far
    larger than the model, repeated tokens (the scatter must sum them), labels ignored by a non-default
    ignore_index, 2 threads; the loss and every gradient within 1e-5."""
    ignore_index = 0
    shape = dict(n_layer=1, n_head=2, n_embd=32, n_positions=32, vocab_size=4099)
    batch, seq = 3, 32
    cfg = C.from_dict({"model": {"gpt2": shape, "loss": {"ignore_index": ignore_index}},
                       "data": {"seq_len": seq}, "train": {"micro_batch_size": batch},
                       "run": {"output_dir": str(tmp_path), "seed": 4}, "optimizer": {"name": "sgd"}})
    graphs_dir = prepare(cfg)
    nodes = onnx.load(f"{graphs_dir}/train.onnx").graph.node
    ops = {n.op_type for n in nodes}
    assert {"LogSoftmax", "NegativeLogLikelihoodLoss", "ScatterElements"} <= ops
    assert not ops & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad", "GatherGrad"}
    assert not [n.name for n in nodes if n.op_type == "Gemm" and any(a.name == "transA" and a.i for a in n.attribute)]
    producer = {o: n for n in nodes for o in n.output}      # the tied head's gradient scattered into before
    assert producer["transformer.wte.weight" + GRAD_SUFFIX].op_type == "Transpose"    # its Transpose
    shapes = {"input_ids": ((batch, seq), np.int64), "labels": ((batch, seq), np.int64)}
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    eng.load_weights()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, shape["vocab_size"], (batch, seq))
    ids[1] = rng.integers(0, 6, seq)                      # the same rows looked up many times
    labels = rng.integers(0, shape["vocab_size"], (batch, seq))
    labels[0, :7] = ignore_index
    labels[2, 3] = 1
    data = {"input_ids": ids, "labels": labels}
    loss = eng.forward_backward(data, accumulate=False)
    assert eng.evaluate(data) == pytest.approx(loss, rel=1e-6)

    hf = hf_gpt2(shape, eng.layout.unflatten(eng.params.copy())).double()
    logits = hf(torch.from_numpy(ids)).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, shape["vocab_size"]),
                                            torch.from_numpy(labels).reshape(-1), ignore_index=ignore_index)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    named = dict(hf.named_parameters())
    for name, grad in eng.layout.unflatten(eng.grads).items():
        want = named[name].grad.numpy()
        assert np.abs(grad - want).max() <= 1e-5 * np.abs(want).max(), name


@pytest.mark.parametrize("extra_use", [False, True])
@pytest.mark.ort_training
def test_gelu_gradient_by_hand_matches_numpy(extra_use):
    """graphs.ort_gradients._gelu_gradients: the built-in MLP's tanh-GELU (y * sigmoid(y (a + b y^2))) gets its
    gradient written by hand (no four-way Sum of the builder's chain) and it equals float64 NumPy's
    derivative; where y also feeds something else the builder's chain is kept (and is right too)."""
    n, d = 16, 24
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((n, d)) * 2).astype(np.float32)
    w = rng.standard_normal((n, d)).astype(np.float32)
    k = np.sqrt(2 / np.pi)
    a, b = np.float32(2 * k), np.float32(2 * k * 0.044715)
    mk = onnx.helper.make_node
    nodes = [mk("Identity", ["X"], ["y"]), mk("Mul", ["y", "y"], ["y2"]), mk("Mul", ["y2", "B"], ["t"]),
             mk("Add", ["t", "A"], ["poly"]), mk("Mul", ["y", "poly"], ["z"]), mk("Sigmoid", ["z"], ["s"]),
             mk("Mul", ["y", "s"], ["act"]), mk("Mul", ["act", "W"], ["aw"])]
    if extra_use:
        nodes += [mk("Mul", ["y", "W"], ["yw"]), mk("Add", ["aw", "yw"], ["out"])]
    nodes.append(mk("ReduceSum", ["out" if extra_use else "aw"], [LOSS], keepdims=0))
    f32 = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(nodes, "gelu", [onnx.helper.make_tensor_value_info("X", f32, [n, d])],
                                   [onnx.helper.make_tensor_value_info(LOSS, f32, [])],
                                   initializer=[onnx.numpy_helper.from_array(w, "W"),
                                                onnx.numpy_helper.from_array(np.array(a), "A"),
                                                onnx.numpy_helper.from_array(np.array(b), "B")])
    loss_model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    loss_model.ir_version = 8
    train, outputs = direct_gradients(build_train_graph(loss_model, ["X"], "test"))
    sums = [len(m.input) for m in train.graph.node if m.op_type == "Sum"]
    assert (5 in sums) if extra_use else (not sums and any(m.name.endswith("/gelu_grad") for m in train.graph.node))
    sess = ort.InferenceSession(train.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run([outputs["X"]], {"X": x})[0]
    y, w64 = x.astype(np.float64), w.astype(np.float64)
    z = y * (float(a) + float(b) * y * y)
    s = 1 / (1 + np.exp(-z))
    want = w64 * (s + y * s * (1 - s) * (float(a) + 3 * float(b) * y * y)) + (w64 if extra_use else 0)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
