"""train.recompute: blocks (trainrun/graphs/recompute.py): gradients bit for bit the graph's without recomputation
(GPT-2 with dropout, BERT), onnxruntime keeps the recomputed nodes, the peak memory of a step goes down,
a real `mpirun -np 2` run, a model without blocks refused."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from conftest import mpirun, read_metrics, write_config

from trainrun import config as C
from trainrun.graphs.manifest import prepare
from trainrun.step.engine import Engine, EngineOptions
from trainrun.errors import UsageError
from trainrun.models.bert import sample_inputs
from trainrun.graphs.recompute import SUFFIX, recompute_blocks

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

GPT2 = dict(n_layer=3, n_head=4, n_embd=64, n_positions=64, vocab_size=300, dropout=0.1)
BERT = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
BERT_DIMS = {"input_ids": "seq", "segment_ids": "seq", "input_mask": "seq", "masked_lm_positions": "preds",
             "masked_lm_ids": "preds", "next_sentence_labels": None}


def engine(out, model, recompute, batch, seq, shapes, optimized_dir=None, direct=False):
    cfg = C.from_dict({"model": model, "data": {"seq_len": seq}, "train": {"micro_batch_size": batch,
                       "recompute": recompute}, "run": {"output_dir": str(out), "seed": 3},
                       "optimizer": {"name": "sgd"}})
    opts = EngineOptions(threads=2, seed=3, optimized_dir=optimized_dir, direct_gradients=direct)
    eng = Engine(prepare(cfg), opts, shapes, shapes)
    eng.load_weights()
    return cfg, eng


def assert_same_gradients(tmp_path, model, batch_of, shapes, batch, seq, layers, direct):
    """``direct``: the train graph without accumulators (gradients as outputs), as runs without
    accumulation open it."""
    grads, losses = {}, {}
    for mode in ("none", "blocks"):
        opt_dir = tmp_path / f"optimized-{mode}"
        opt_dir.mkdir()
        cfg, eng = engine(tmp_path / mode, model, mode, batch, seq, shapes, str(opt_dir), direct)
        losses[mode] = eng.forward_backward(batch_of(cfg), accumulate=False, position=7)
        grads[mode] = eng.grads.copy()
        written = onnx.load(os.path.join(tmp_path / mode, "graphs", "train.onnx"))
        optimized = onnx.load(str(opt_dir / "train.onnx"))
        recomputed = [n for n in optimized.graph.node if n.name.endswith(SUFFIX)]
        softmax = sum(n.op_type == "Softmax" for n in optimized.graph.node)
        if mode == "none":
            assert not any(n.name.endswith(SUFFIX) for n in written.graph.node) and softmax == layers
        else:   # onnxruntime kept the duplicates (no common-subexpression elimination): each block's twice
            assert recomputed and softmax == 2 * layers
    assert losses["blocks"] == losses["none"]
    scale = np.abs(grads["none"]).max()
    # the duplicates run the same kernels on the same values (dropout's masks are inputs): the same bits
    assert scale > 0 and np.array_equal(grads["blocks"], grads["none"]), np.abs(grads["blocks"] - grads["none"]).max()


def test_gpt2_gradients_equal_without_recomputation(tmp_path):
    shapes = {"input_ids": ((4, 32), np.int64), "labels": ((4, 32), np.int64)}
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 300, (4, 32)), "labels": rng.integers(0, 300, (4, 32))}
    assert_same_gradients(tmp_path, {"gpt2": GPT2}, lambda cfg: batch, shapes, 4, 32, GPT2["n_layer"], True)


def test_bert_gradients_equal_without_recomputation(tmp_path):
    dims = {"seq": 32, "preds": 5}
    shapes = {k: ((4, dims[d]) if d else (4,), np.int64) for k, d in BERT_DIMS.items()}
    assert_same_gradients(tmp_path, {"builtin": "bert", "bert": BERT},
                          lambda cfg: sample_inputs(cfg.model.bert, 4, 32, 5, np.random.default_rng(1)),
                          shapes, 4, 32, BERT["num_hidden_layers"], False)


_PEAK = r"""
import ctypes, sys, numpy as np
from trainrun import config as C
from trainrun.graphs.manifest import prepare
from trainrun.step.engine import Engine, EngineOptions
out, mode = sys.argv[1], sys.argv[2]
cfg = C.from_dict({"model": {"gpt2": {"n_layer": 8, "n_head": 8, "n_embd": 64, "n_positions": 256,
                   "vocab_size": 256}}, "data": {"seq_len": 256}, "train": {"micro_batch_size": 4, "recompute": mode},
                   "run": {"output_dir": out}})
shapes = {"input_ids": ((4, 256), np.int64), "labels": ((4, 256), np.int64)}
eng = Engine(prepare(cfg), EngineOptions(threads=1), shapes, shapes)
eng.load_weights()
rng = np.random.default_rng(0)
batch = {k: rng.integers(0, 256, (4, 256)) for k in shapes}

def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field)) / 1024

# what preparing the graphs freed goes back to the kernel, and the high-water mark starts again from here
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS:")
eng.forward_backward(batch, accumulate=False)
print(status("VmHWM:") - before)
"""


# onnxruntime-training's graphs: with trainrun's builder on stock onnxruntime 1.32 the same step grew 143 MB
# without and 125 MB with recomputation (0.88x, not 0.5x), not yet explained (docs/design.md)
@pytest.mark.ort_training
def test_recomputation_lowers_the_peak_memory_of_a_step(tmp_path):
    """A GPT-2 whose activations are mostly attention probabilities (8 heads x 256^2 per layer): the growth of
    the peak RSS over one forward/backward of 8 layers (each mode in its own process; the high-water mark reset
    just before the step, every large allocation its own mapping so that a freed one leaves the RSS) at most
    half without recomputation's."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    grow = {}
    for mode in ("none", "blocks"):
        res = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / mode), mode], capture_output=True,
                             text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr
        grow[mode] = float(res.stdout.split()[-1])
    assert grow["none"] > 120 and grow["blocks"] < 0.5 * grow["none"], grow


def test_real_run_with_recomputation_follows_the_same_losses(tmp_path, byte_dataset):
    """`mpirun -np 2` with train.recompute blocks (gradient accumulation: the accumulator graph; dropout)
    against the same run without: the same losses step by step; and a run without recomputation stopped at
    step 3 and resumed with `--set train.recompute=blocks` (a key resume may change: the graphs are prepared
    again) goes on with the same losses too."""
    def run(name, **over):
        (tmp_path / name).mkdir()
        cfg = write_config(tmp_path / name / "c.yaml", byte_dataset, **{
            "run.output_dir": str(tmp_path / name / "run"), "train.max_steps": 6, "checkpoint.every": 3,
            "train.gradient_accumulation_steps": 2, "model.gpt2.dropout": 0.1, **over})
        mpirun(2, "--config", cfg)
        return str(tmp_path / name / "run")

    def losses(run_dir):
        train, _ = read_metrics(run_dir)
        with open(os.path.join(run_dir, "graphs", "manifest.json")) as fh:
            return [train[s]["loss"] for s in sorted(train)], json.load(fh)["build"]["recompute"]

    ref, built = losses(run("none", **{"train.recompute": "none"}))
    assert len(ref) == 6 and built == "none"
    got, built = losses(run("blocks", **{"train.recompute": "blocks"}))
    assert built == "blocks"
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    switched = run("switched", **{"train.recompute": "none", "train.stop_at": 3})
    mpirun(2, "resume", switched, "--set", "train.stop_at=0", "--set", "train.recompute=blocks")
    got, built = losses(switched)
    assert built == "blocks"
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_a_model_without_numbered_blocks_is_refused():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Mul", ["x", "w"], ["loss"])], "g", [x], [])
    with pytest.raises(UsageError, match="train.recompute blocks needs repeated blocks"):
        recompute_blocks(onnx.helper.make_model(graph), ["w", "head.weight"], "loss", "user.onnx")


def test_a_random_op_inside_a_block_is_not_drawn_again():
    """A block with a RandomUniformLike (a user model's own noise): the block's other activations are
    recomputed, the noise is kept (the backward reads the one drawn in the forward pass)."""
    h = onnx.helper
    nodes = [h.make_node("MatMul", ["x", "blk.0.w"], ["a"]), h.make_node("Mul", ["a", "a"], ["a2"]),
             h.make_node("RandomUniformLike", ["a"], ["noise"]), h.make_node("Mul", ["a2", "noise"], ["b"]),
             h.make_node("MatMul", ["b", "blk.1.w"], ["c"]), h.make_node("ReduceSum", ["c"], ["loss"], keepdims=0),
             # a stand-in backward: reads the block-0 activations a2 and noise
             h.make_node("Mul", ["a2", "loss"], ["ga"]), h.make_node("Mul", ["noise", "ga"], ["gn"])]
    vi = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 2]) for n in ("x", "blk.0.w", "blk.1.w")]
    model = h.make_model(h.make_graph(nodes, "g", vi, [h.make_tensor_value_info("gn", onnx.TensorProto.FLOAT, None)]))
    out = recompute_blocks(model, ["blk.0.w", "blk.1.w"], "loss", "user.onnx")
    dups = [n.op_type for n in out.graph.node if n.name.endswith(SUFFIX)]
    assert "Mul" in dups and "RandomUniformLike" not in dups
    reads = {n.output[0]: list(n.input) for n in out.graph.node}
    assert reads["ga"][0] == "a2" + SUFFIX and reads["gn"][0] == "noise"
