"""distributed.overlap_grad_reduce: the train graph cut at gradient buckets (trainrun.graphs.segments), the
buckets reduced in a background thread during the backward pass (trainrun.update.Replicated); real
onnxruntime sessions, real mpirun ranks on pretend nodes."""

import json

import numpy as np
import pytest

from conftest import TRAINRUN, mpirun, read_metrics, run, write_config


def _train(tmp_path, data, name, ranks, **extra):
    cfg = write_config(tmp_path / f"{name}.yaml", data, **{
        "run.output_dir": str(tmp_path / name), "train.max_steps": 12, "checkpoint.every": 12,
        "model.gpt2": {"n_layer": 3, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 512},
        **extra})
    mpirun(ranks, "--config", cfg, env={"TRAINRUN_RANKS_PER_NODE": "1"})
    with open(tmp_path / name / "summary.json") as fh:
        summary = json.load(fh)
    from safetensors.numpy import load_file
    weights = load_file(str(tmp_path / name / "checkpoints" / "12" / "model.safetensors"))
    return read_metrics(str(tmp_path / name))[0], summary, weights


@pytest.mark.parametrize("dtype,accum", [("fp32", 1), ("bf16", 2)])
def test_overlapped_buckets_train_bit_for_bit_as_one_allreduce(tmp_path, byte_dataset, dtype, accum):
    """2 pretend nodes of one rank: the same losses, norms and final weights, bit for bit, with the gradients
    reduced in buckets during the backward pass (0.004 MiB: a bucket every tensor or two) as with one allreduce
    after it; fp32 (a + b) and bf16 (rank-order sums of rounded values) both reduce elementwise."""
    extra = {"distributed.reduce_dtype": dtype, "train.gradient_accumulation_steps": accum}
    ref, ref_sum, ref_w = _train(tmp_path, byte_dataset, "one", 2, **extra)
    got, got_sum, got_w = _train(tmp_path, byte_dataset, "buckets", 2, **extra, **{
        "distributed.overlap_grad_reduce": True, "distributed.bucket_mb": 0.004})
    assert ref_sum["grad_buckets"] == 0 and got_sum["grad_buckets"] >= 8
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    for s in ref:
        assert (got[s]["loss"], got[s]["grad_norm"]) == (ref[s]["loss"], ref[s]["grad_norm"]), s
    assert ref[12]["loss"] < ref[1]["loss"]
    assert sorted(got_w) == sorted(ref_w)
    for name in ref_w:
        assert np.array_equal(got_w[name], ref_w[name]), name
    assert got_sum["wire_bytes_per_step"] == ref_sum["wire_bytes_per_step"]
