"""graphs.strides: products over a multiple of 1024 float32 padded by a cache line (CPU train graphs)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import assert_matches_torch, hf_gpt2
from trainrun import config as C
from trainrun.step.engine import Engine, EngineOptions
from trainrun.graphs.manifest import prepare, up_to_date
from trainrun.graphs.strides import pad_contractions, wanted
from trainrun.step.sessions import import_onnxruntime

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

# (name, A's shape, B's shape, Gemm transB or None for MatMul, padded?)
CASES = [
    ("weight_grad", [256, 1024], [1024, 768], None, True),      # K = 1024 tokens, M*N/(M+N) = 192
    ("proj", [512, 3072], [768, 3072], 1, True),                # GPT-2's MLP projection read as Gemm transB
    ("gemm_kn", [300, 2048], [2048, 300], 0, True),
    ("small", [64, 1024], [1024, 64], None, False),             # M*N/(M+N) = 32: the copies would cost more
    ("odd_k", [256, 1000], [1000, 768], None, False),
    ("k_512", [256, 512], [512, 768], None, False),             # rows 2 KiB apart share a set by twos only
    ("batched", [2, 128, 1024], [2, 1024, 128], None, False),   # attention-like: left alone
    ("rows_3d", [2, 256, 1024], [1024, 300], None, True),       # [2, 256] flattened: M = 512
    ("head_dx", [2, 128, 1024], [300, 1024], "fused", True),    # a tied head's input gradient
]


def _cases(version: int = 17):
    """CASES for an opset: before 11 only the MatMuls (Gemm's C is required there)."""
    return [c for c in CASES if version >= 11 or c[3] is None]


def _graph(dynamic: bool = False, version: int = 17):
    nodes, inputs, outputs = [], [], []
    for name, a, b, trans_b, _ in _cases(version):
        a_dims = ["rows"] + a[1:] if dynamic else a
        inputs += [helper.make_tensor_value_info(name + "_a", TensorProto.FLOAT, a_dims),
                   helper.make_tensor_value_info(name + "_b", TensorProto.FLOAT, b)]
        op = ("MatMul", {}) if trans_b is None else ("FusedMatMul", {"transB": 1, "alpha": 0.5}) \
            if trans_b == "fused" else ("Gemm", {"transB": trans_b})
        nodes.append(helper.make_node(op[0], [name + "_a", name + "_b"], [name + "_c"], name=name,
                                      domain="com.microsoft" if op[0] == "FusedMatMul" else "", **op[1]))
        outputs.append(helper.make_tensor_value_info(name + "_c", TensorProto.FLOAT, None))
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", version), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model


def _run(model, feeds):
    ort = import_onnxruntime()
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


def _padded(model) -> set:
    """Names of the products whose two inputs both come from Pad nodes."""
    made = {o: n.op_type for n in model.graph.node for o in n.output}
    return {n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm", "FusedMatMul")
            and all(made.get(i) == "Pad" for i in n.input[:2])}


@pytest.mark.parametrize("version", [17, 9])
def test_products_over_4_kib_rows_are_padded_and_keep_their_value(version):
    rng = np.random.default_rng(0)
    feeds = {}
    for name, a, b, _, _ in _cases(version):
        feeds[name + "_a"] = rng.standard_normal(a).astype(np.float32)
        feeds[name + "_b"] = rng.standard_normal(b).astype(np.float32)
    plain = _graph(version=version)
    want = _run(plain, feeds)
    model = pad_contractions(_graph(version=version))     # opset 9: Pad-2, its pads an attribute
    assert _padded(model) == {name for name, *_, padded in _cases(version) if padded}
    got = _run(model, feeds)
    for name in want:
        # the padded terms are exact zeros; only the order of the sums may differ (K float32 products)
        scale = np.abs(want[name]).max()
        assert got[name].shape == want[name].shape
        assert np.abs(got[name] - want[name]).max() <= 1e-6 * scale, name


def test_products_with_unknown_dims_are_left_alone():
    model = pad_contractions(_graph(dynamic=True))
    assert _padded(model) == set()      # every product has a symbolic row count
    assert not [n for n in model.graph.node if n.op_type == "Pad"]


def _gpt2(tmp_path, seed, n_layer=1, setting="always", device="cpu"):
    """A GPT-2 of 8 x 128 = 1024 tokens a micro-batch and an MLP 1024 wide, and its data shapes."""
    shape = dict(n_layer=n_layer, n_head=4, n_embd=256, n_positions=128, vocab_size=300)
    cfg = C.from_dict({"model": {"gpt2": shape}, "data": {"seq_len": 128}, "train": {"micro_batch_size": 8},
                       "run": {"output_dir": str(tmp_path / setting), "seed": seed}, "optimizer": {"name": "sgd"},
                       "engine": {"pad_products": setting}, "device": device})
    return cfg, shape, {"input_ids": ((8, 128), np.int64), "labels": ((8, 128), np.int64)}


@pytest.mark.torch
def test_gpt2_with_1024_tokens_a_micro_batch_matches_transformers(tmp_path):
    """A micro-batch of 8 x 128 = 1024 tokens and an MLP of 1024: every weight gradient, the MLP's
    projection and its input's gradient are padded products in the train graph; the loss and every
    gradient equal transformers' GPT-2 in float64 (1e-5 of the largest, as the other parity tests)."""
    cfg, shape, shapes = _gpt2(tmp_path, seed=6)
    graphs_dir = prepare(cfg)
    padded = _padded(onnx.load(f"{graphs_dir}/train.onnx"))
    # the block's 4 weight gradients and the tied head's (K = 1024 tokens; the head's 256 x 300 result is
    # just above the size bar), the MLP's projection and the gradient of its input (K = 1024)
    assert len(padded) == 7, sorted(padded)
    assert any("_Grad" not in n and not n.startswith("grad/") for n in padded)     # the forward projection
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    eng.load_weights()
    rng = np.random.default_rng(7)
    batch = {k: rng.integers(0, shape["vocab_size"], v[0]) for k, v in shapes.items()}
    loss = eng.forward_backward(batch, accumulate=False)
    hf = hf_gpt2(shape, eng.layout.unflatten(eng.params.copy())).double()
    assert_matches_torch(eng, loss, hf, batch, shape["vocab_size"], rel=1e-5)


def test_a_padded_train_graph_cut_into_segments_computes_the_same_bits(tmp_path):
    """overlap_grad_reduce's segments (the train graph cut where buckets of gradients are final) over a
    graph with padded products: the same loss and gradients bit for bit as the whole graph."""
    cfg, shape, shapes = _gpt2(tmp_path, seed=8, n_layer=2)
    graphs_dir = prepare(cfg)
    assert _padded(onnx.load(f"{graphs_dir}/train.onnx"))
    rng = np.random.default_rng(9)
    data = {k: rng.integers(0, shape["vocab_size"], v[0]) for k, v in shapes.items()}
    results = []
    for bucket_bytes in (0, 64 << 10):
        eng = Engine(graphs_dir, EngineOptions(threads=1, seed=3, direct_gradients=True, bucket_bytes=bucket_bytes),
                     shapes, shapes)
        eng.load_weights()
        results.append((eng.forward_backward(data, accumulate=False), eng.grads.copy(), len(eng.train_s.sessions)))
    (loss, grads, one), (cut_loss, cut_grads, many) = results
    assert one == 1 and many >= 3
    assert cut_loss == loss and np.array_equal(cut_grads, grads)


def test_pad_products_never_and_on_the_gpu_leave_the_graph_as_built(tmp_path):
    """engine.pad_products never: the same 1024-token graph without a Pad; the setting is baked (a prepared
    folder of the other setting is not up to date); never on cuda."""
    never = prepare(_gpt2(tmp_path, seed=6, setting="never")[0])
    # the padding's own Pads (named .../kpad/a|b): a gradient rule may write others (a Slice's gradient)
    assert not [n for n in onnx.load(f"{never}/train.onnx").graph.node if n.op_type == "Pad" and "/kpad/" in n.name]
    assert up_to_date(never, _gpt2(tmp_path, seed=6, setting="never")[0])
    assert not up_to_date(never, _gpt2(tmp_path, seed=6, setting="always")[0])
    assert not wanted("always", "cuda") and not wanted("auto", "cuda") and not wanted("never", "cpu")
    assert wanted("always", "cpu")
