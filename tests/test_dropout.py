"""Dropout with trainrun's own masks (graph inputs filled from run.seed and the sample position):
the masks' statistics and scale, gradients against transformers' GPT-2 fed the same masks, and real
`mpirun -np 2` runs: training, eval and export, exact resume, 2 ranks == 1 rank with accumulation."""

import json
import os

import numpy as np
import onnx
import pytest
import torch

from conftest import hf_gpt2, mpirun, read_metrics, write_config

from trainrun import config as C
from trainrun import graphs as G
from trainrun.engine import Engine, EngineOptions
from trainrun.models.gpt2 import build_gpt2, init_weights

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=300)


def make_engine(tmp_path, p, batch, seq, **over):
    cfg = C.from_dict({"model": {"gpt2": {**SHAPE, "dropout": p}}, "data": {"seq_len": seq},
                       "train": {"micro_batch_size": batch}, "run": {"output_dir": str(tmp_path), "seed": 3},
                       "optimizer": {"name": "sgd"}, **over})
    shapes = {"input_ids": ((batch, seq), np.int64), "labels": ((batch, seq), np.int64)}
    eng = Engine(G.prepare(cfg), EngineOptions(threads=2, seed=3), shapes, shapes, state_names=[])
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
    mask = eng.masks.buffers[G.MASK_PREFIX + first.name]
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
    from trainrun.dropout import DropoutMasks
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


class FixedMask(torch.nn.Module):
    """A dropout module that applies a given (already scaled) mask."""

    def __init__(self, mask):
        super().__init__()
        self.mask = torch.from_numpy(mask)

    def forward(self, x):
        assert x.shape == self.mask.shape
        return x * self.mask


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
    hf.transformer.drop = FixedMask(masks[0])
    for i, block in enumerate(hf.transformer.h):
        block.attn.reorder_and_upcast_attn = True        # the eager path that calls attn_dropout
        block.attn.attn_dropout, block.attn.resid_dropout, block.mlp.dropout = map(FixedMask, masks[1 + 3 * i:4 + 3 * i])
    logits = hf(torch.from_numpy(batch["input_ids"])).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), torch.from_numpy(batch["labels"]).reshape(-1),
                                                 ignore_index=-100)
    ref_loss.backward()
    # float32 (eps 1.2e-7) with different summation orders in both libraries: errors relative to a tensor's
    # largest gradient stay a few eps times the reduction depth (sums over 128 tokens and 64..300 features),
    # measured <= 1e-6 here; 1e-5 leaves 10x for other CPUs/thread counts, while a wrong mask or a mask
    # applied to the wrong tensor changes gradients by O(1) of that scale.
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    named = dict(hf.named_parameters())
    for name, grad in eng.layout.unflatten(eng.grads).items():
        ref = named[name].grad.numpy()
        rel = np.abs(grad - ref).max() / np.abs(ref).max()
        assert rel < 1e-5, (name, rel)
