"""Dropout with trainrun's own masks (graph inputs filled from run.seed and the sample position):
the masks' statistics and scale, gradients against transformers' GPT-2 fed the same masks, and real
`mpirun -np 2` runs: training, eval and export, exact resume, 2 ranks == 1 rank with accumulation."""

import json
import os

import numpy as np
import onnx
import pytest

from conftest import assert_matches_torch, hf_gpt2, mpirun, read_metrics, write_config, optional

from trainrun import config as C
from trainrun.graphs.dropout_nodes import dropout_masks
from trainrun.graphs.manifest import load_manifest, prepare
from trainrun.graphs.names import MASK_PREFIX
from trainrun.step.engine import Engine, EngineOptions
from trainrun.models.gpt2 import build_gpt2, init_weights

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

torch = optional("torch")

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=300)


def make_engine(tmp_path, p, batch, seq, **over):
    cfg = C.from_dict({"model": {"gpt2": {**SHAPE, "dropout": p}}, "data": {"seq_len": seq},
                       "train": {"micro_batch_size": batch}, "run": {"output_dir": str(tmp_path), "seed": 3},
                       "optimizer": {"name": "sgd"}, **over})
    shapes = {"input_ids": ((batch, seq), np.int64), "labels": ((batch, seq), np.int64)}
    eng = Engine(prepare(cfg), EngineOptions(threads=2, seed=3), shapes, shapes)
    eng.load_weights()
    return eng


def random_batch(rng, batch, seq, vocab=300):
    return {"input_ids": rng.integers(0, vocab, (batch, seq)), "labels": rng.integers(0, vocab, (batch, seq))}


@pytest.mark.parametrize("p", [0.1, 0.2])
def test_masks_drop_the_ratio_and_scale_the_rest(tmp_path, p):
    """One layer's output (the embedding dropout's, a test-only extra output) against NumPy on the mask fed,
    and the zero fraction of the attention masks within 3 sigma of the ratio."""
    gcfg = C.GPT2Config(**SHAPE, dropout=p)
    first = next(n for n in build_gpt2(gcfg, init_weights(gcfg, 3)).graph.node if n.op_type == "Dropout")
    eng = make_engine(tmp_path, p, 8, 64, debug={"stats_every": 1, "tensors": [first.input[0], first.output[0]]})
    spec = eng.manifest["dropout"]["masks"]
    assert len(spec) == 1 + 3 * SHAPE["n_layer"] and {m["ratio"] for m in spec} == {p}
    eng.forward_backward(random_batch(np.random.default_rng(0), 8, 64), accumulate=False, position=40)
    out = eng.extra_train_outputs()
    x, y = out[first.input[0]], out[first.output[0]]
    mask = eng.masks.buffers[MASK_PREFIX + first.name]
    assert mask.shape == x.shape == (8, 64, 64)
    np.testing.assert_array_equal(y, x * mask)                      # one float32 product, as NumPy's
    keep = mask != 0
    np.testing.assert_array_equal(mask[keep], np.float32(1 / (1 - p)))
    np.testing.assert_allclose(y[keep], x[keep] / (1 - p), rtol=1e-6)
    assert not y[~keep].any()
    probs = np.concatenate([eng.masks.buffers[m["name"]].ravel() for m in spec if len(m["shape"]) == 4])
    assert probs.size == 8 * 4 * 64 * 64 * SHAPE["n_layer"]
    zeros = np.mean(probs == 0)
    assert abs(zeros - p) < 3 * np.sqrt(p * (1 - p) / probs.size), zeros
    # the same position draws the same masks, another position others
    before = {k: v.copy() for k, v in eng.masks.buffers.items()}
    eng.masks.fill(40)
    assert all(np.array_equal(before[k], v) for k, v in eng.masks.buffers.items())
    eng.masks.fill(48)
    assert not any(np.array_equal(before[k], v) for k, v in eng.masks.buffers.items())


def test_masks_are_keyed_by_sample_not_by_micro_batch(tmp_path):
    """Micro-batches of 4 at positions 0 and 4 (two ranks, or two accumulation steps) hold the samples'
    masks that a micro-batch of 8 at position 0 holds; the two halves differ."""
    from trainrun.step.dropout import DropoutMasks
    eng = make_engine(tmp_path, 0.1, 4, 16)
    spec, sizes = eng.manifest["dropout"], {"batch": 4, "seq": 16}
    halves = []
    for position in (0, 4):
        m = DropoutMasks(spec, sizes, seed=3)
        m.fill(position)
        halves.append(m.buffers)
    whole = DropoutMasks(spec, {"batch": 8, "seq": 16}, seed=3)
    whole.fill(0)
    for name, buf in whole.buffers.items():
        np.testing.assert_array_equal(buf, np.concatenate([halves[0][name], halves[1][name]]))
        assert not np.array_equal(halves[0][name], halves[1][name])
    other_seed = DropoutMasks(spec, sizes, seed=4)
    other_seed.fill(0)
    assert not any(np.array_equal(other_seed.buffers[k], v) for k, v in halves[0].items())


def fixed_mask(mask):
    """A dropout module that applies a given (already scaled) mask."""
    class FixedMask(torch.nn.Module):
        def forward(self, x):
            assert x.shape == self.mask.shape
            return x * self.mask
    module = FixedMask()
    module.mask = torch.from_numpy(mask)
    return module


@pytest.mark.torch
def test_gradients_match_transformers_with_the_same_masks(tmp_path):
    eng = make_engine(tmp_path, 0.1, 4, 32)
    weights = {k: v.copy() for k, v in eng.layout.unflatten(eng.params).items()}
    batch = random_batch(np.random.default_rng(1), 4, 32)
    batch["labels"][0, :5] = -100
    loss = eng.forward_backward(batch, accumulate=False, position=1000)
    masks = [eng.masks.buffers[m["name"]] for m in eng.manifest["dropout"]["masks"]]

    hf = hf_gpt2(SHAPE, weights).train()
    hf.set_attn_implementation("eager")
    # the graph's order: embeddings, then per block attention probabilities, attn c_proj, mlp c_proj
    hf.transformer.drop = fixed_mask(masks[0])
    for i, block in enumerate(hf.transformer.h):
        block.attn.reorder_and_upcast_attn = True        # the eager path that calls attn_dropout
        block.attn.attn_dropout, block.attn.resid_dropout, block.mlp.dropout = map(fixed_mask, masks[1 + 3 * i:4 + 3 * i])
    # float32 (eps 1.2e-7) with different summation orders in both libraries: errors relative to a tensor's
    # largest gradient stay a few eps times the reduction depth (sums over 128 tokens and 64..300 features),
    # measured <= 1e-6 here; 1e-5 leaves 10x for other CPUs/thread counts, while a wrong mask or a mask
    # applied to the wrong tensor changes gradients by O(1) of that scale.
    assert_matches_torch(eng, loss, hf, batch, 300, rel=1e-5)


# ---------------------------------------------------------------------- real runs (mpirun -np 2)

def losses(run_dir):
    train, _ = read_metrics(run_dir)
    return np.array([train[s]["loss"] for s in sorted(train)])


def digests(run_dir, step, world=2):
    ckpt = os.path.join(run_dir, "checkpoints", str(step))
    return [json.load(open(os.path.join(ckpt, f"rank-{r}.json")))["params_sha256"] for r in range(world)]


def no_dropout(path):
    model = onnx.load(path)
    return not [n for n in model.graph.node if n.op_type == "Dropout"] and \
        not [i for i in model.graph.input if i.name.startswith(MASK_PREFIX)]


@pytest.mark.parametrize("p", [0.1, 0.2])
def test_dropout_trains_evaluates_and_exports_on_two_ranks(tmp_path, byte_dataset, p):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model.gpt2.dropout": p, "train.max_steps": 30, "train.eval_every": 30, "train.log_every": 10})
    mpirun(2, "--config", cfg)
    run_dir = str(tmp_path / "run")
    train, evals = read_metrics(run_dir)
    assert sorted(train) == [10, 20, 30] and np.isfinite(evals[30]["eval_loss"])
    assert train[30]["loss"] < train[10]["loss"]
    graphs = os.path.join(run_dir, "graphs")
    train_graph = onnx.load(os.path.join(graphs, "train.onnx"))
    assert not [n for n in train_graph.graph.node if n.op_type == "Dropout"]
    assert len([i for i in train_graph.graph.input if i.name.startswith(MASK_PREFIX)]) == 7
    for f in ("graphs/eval.onnx", "graphs/forward.onnx", "model.onnx"):
        assert no_dropout(os.path.join(run_dir, f)), f

    # dropout is really on: on the trained weights and the same batches, the train graph's loss (masks
    # of 4 positions each) is above the eval graph's
    mb, seq = 4, 32
    shapes = {"input_ids": ((mb, seq), np.int64), "labels": ((mb, seq), np.int64)}
    eng = Engine(graphs, EngineOptions(threads=1, seed=5), shapes, shapes)
    eng.load_weights(os.path.join(run_dir, "checkpoints", "30", "model.safetensors"))
    from trainrun.data import open_dataset
    ds = open_dataset(os.path.join(byte_dataset, "train"), seq)
    batch = ds.read(np.arange(mb), ds.new_batch(mb))
    trained = [eng.forward_backward(batch, accumulate=False, position=k * mb) for k in range(4)]
    assert np.mean(trained) > eng.evaluate(batch)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, byte_dataset):
    """A 2-rank run with dropout 0.1, 1 intra-op thread per rank (bitwise reproducible), 8 steps."""
    d = tmp_path_factory.mktemp("straight")
    cfg = write_config(d / "c.yaml", byte_dataset, **RESUME)
    mpirun(2, "--config", cfg)
    return str(d / "run")


RESUME = {"model.gpt2.dropout": 0.1, "engine.threads": 1, "train.max_steps": 8, "checkpoint.every": 4}


def test_resume_with_dropout_continues_bit_for_bit(tmp_path, byte_dataset, straight):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **RESUME, **{"train.stop_at": 4})
    mpirun(2, "--config", cfg)
    run_dir = str(tmp_path / "run")
    assert sorted(read_metrics(run_dir)[0]) == [1, 2, 3, 4]
    mpirun(2, "resume", run_dir)
    np.testing.assert_array_equal(losses(run_dir), losses(straight))          # exact
    assert digests(run_dir, 8) == digests(straight, 8)


def test_two_ranks_equal_one_rank_with_accumulation_with_dropout(tmp_path, byte_dataset, straight):
    """The masks belong to the samples, not to the ranks: the same losses on 1 rank x 2 micro-batches."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **RESUME, **{"train.gradient_accumulation_steps": 2})
    mpirun(1, "--config", cfg)
    np.testing.assert_allclose(losses(str(tmp_path / "run")), losses(straight), rtol=1e-5, atol=1e-5)


@pytest.mark.torch
def test_a_users_onnx_dropouts_become_masks(tmp_path):
    """transformers' GPT-2 exported by torch.onnx in training mode: its Dropouts in training mode get
    masks (the exporter writes SDPA's attention dropout without training_mode: ONNX's inference mode)."""
    from test_prepare import export_user_gpt2
    seq, batch = 16, 4
    export_user_gpt2(tmp_path / "user.onnx", SHAPE, seq, pdrop=0.1)
    cfg = C.from_dict({"model": {"builtin": None, "onnx": str(tmp_path / "user.onnx"), "inputs": ["input_ids"]},
                       "run": {"output_dir": str(tmp_path / "run")}, "data": {"seq_len": seq},
                       "train": {"micro_batch_size": batch}, "optimizer": {"name": "sgd"}})
    graphs = prepare(cfg)
    spec = load_manifest(graphs)["dropout"]
    assert [(m["shape"], m["ratio"]) for m in spec["masks"]] == [(["batch", seq, 64], 0.1)] * 5
    assert spec["dims"] == {"batch": ["input_ids", 0]}
    for f in ("eval.onnx", "forward.onnx"):
        assert no_dropout(os.path.join(graphs, f))
    shapes = {"input_ids": ((batch, seq), np.int64), "labels": ((batch, seq), np.int64)}
    eng = Engine(graphs, EngineOptions(threads=2, seed=3), shapes, shapes)
    eng.load_weights()
    data = random_batch(np.random.default_rng(0), batch, seq)
    first, again, other = (eng.forward_backward(data, accumulate=False, position=p) for p in (0, 0, 4))
    assert first == again != other != eng.evaluate(data)


def test_unresolvable_mask_shape_is_a_usage_error(tmp_path):
    """A Dropout whose input's shape shape inference cannot give (here: a Reshape to a shape that is a
    graph input) is named in the error."""
    from onnx import TensorProto, helper, numpy_helper
    from trainrun.errors import UsageError
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
             helper.make_node("Dropout", ["r", "p", "t"], ["d"], name="my_dropout"),
             helper.make_node("MatMul", ["d", "w"], ["logits"], name="mm")]
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "p"), numpy_helper.from_array(np.array(True), "t"),
             numpy_helper.from_array(np.ones((4, 3), np.float32), "w")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4]),
                                       helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 3])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    with pytest.raises(UsageError, match="Dropout node 'my_dropout'.*cannot be determined"):
        dropout_masks(m, ["x", "shape"], "user.onnx")
