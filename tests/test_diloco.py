"""distributed.sync: diloco on real `mpirun` ranks: replicas of one rank each (group 1), so no pretend cluster
is needed; the pretend cluster's test is in test_cluster.py."""

import glob
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import mpirun, mpirun_probe, read_metrics, write_config


def _weights(path):
    return np.concatenate([t.ravel() for _, t in sorted(load_file(path).items())])


def _checkpoint_weights(run_dir, step):
    return _weights(os.path.join(run_dir, "checkpoints", str(step), "model.safetensors"))


def test_one_inner_step_outer_lr_one_equals_every_step_data_parallel(tmp_path, byte_dataset):
    """Inner SGD, inner_steps 1, outer lr 1, momentum 0: each replica steps w - lr g_j, the outer step sets
    w - mean_j(lr g_j): every-step data parallel's SGD step. Equal to float32 rounding: the two paths round
    at different points (the replica's step, the mean of the outer gradients and the outer step against the
    sum of the gradients and one step), each rounding within 2^-24 of the weights' scale (about 1: a
    LayerNorm's weight), so a step adds at most 2 eps = 2^-22 of it (measured: 1.2e-7 after step 1, 2.4e-7 by
    step 6; the relative difference of the whole weight vectors 4e-8 after step 1, 1.0e-7 after 6)."""
    common = {"train.max_steps": 6, "checkpoint.every": 1, "checkpoint.keep_last": 100,
              "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.0, "max_grad_norm": 0.0, "weight_decay": 0.0}}
    runs = {}
    for name, extra in [("every_step", {}),
                        ("diloco", {"distributed.sync": "diloco",
                                    "distributed.diloco": {"inner_steps": 1, "group": 1,
                                                           "outer": {"lr": 1.0, "momentum": 0.0,
                                                                     "nesterov": False}}})]:
        d = tmp_path / name
        d.mkdir()
        mpirun(2, "--config", write_config(d / "c.yaml", byte_dataset, **common, **extra))
        runs[name] = str(d / "run")
    start = _weights(os.path.join(runs["diloco"], "graphs", "weights.safetensors"))
    for step in range(1, 7):
        ref, got = _checkpoint_weights(runs["every_step"], step), _checkpoint_weights(runs["diloco"], step)
        assert np.abs(ref - start).max() > 1e-4            # the weights did move
        scale = max(1.0, np.abs(ref).max())
        assert np.abs(got - ref).max() <= 2 * np.finfo(np.float32).eps * scale * step, step
        assert np.linalg.norm(got - ref) <= 1e-7 * step * np.linalg.norm(ref), step
    ref_train, _ = read_metrics(runs["every_step"])
    got_train, _ = read_metrics(runs["diloco"])
    np.testing.assert_allclose([got_train[s]["loss"] for s in range(1, 7)],
                               [ref_train[s]["loss"] for s in range(1, 7)], rtol=1e-6)


def _reference_outer(start, replicas_by_step, lr, mu, nesterov):
    """DiLoCo's outer step in NumPy (float64), torch.optim.SGD's momentum (dampening 0): the global weights
    after each outer step, from the replicas' weights before it."""
    weights, buf, out = start.astype(np.float64), None, {}
    for step in sorted(replicas_by_step):
        g = np.mean([weights - w.astype(np.float64) for w in replicas_by_step[step]], axis=0)
        if mu:
            buf = g.copy() if buf is None else mu * buf + g
            g = g + mu * buf if nesterov else buf
        weights = weights - lr * g
        out[step] = weights
    return out


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_steps_match_a_numpy_reference(tmp_path, byte_dataset, nesterov):
    """Three replicas, outer SGD with momentum 0.9 (Nesterov or not), inner AdamW, an outer step every 2 steps
    and at the last (step 7, a round of one step): each rank records its replica's weights before every
    outer step and the new weights after it (tests/rank_probe.py); the new weights are the reference's, from
    the recorded replicas, to float32 rounding (momentum sums 4 rounds: 1e-6 of the weights' scale), equal on
    every replica, and the run's final weights. Evaluations run on the global weights: between two outer
    steps the eval loss does not move."""
    rec = tmp_path / "outer"
    rec.mkdir()
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 7, "train.eval_every": 1, "train.micro_batch_size": 2,
        "distributed.sync": "diloco",
        "distributed.diloco": {"inner_steps": 2, "group": 1,
                               "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": nesterov}}})
    mpirun_probe(3, "--config", cfg, env={"TRAINRUN_PROBE_OUTER_DIR": str(rec)})
    steps = sorted({int(os.path.basename(p).split("_step")[1].split("_")[0]) for p in glob.glob(str(rec / "*.npy"))})
    assert steps == [2, 4, 6, 7]
    run_dir = str(tmp_path / "run")
    start = _weights(os.path.join(run_dir, "graphs", "weights.safetensors"))
    before = {s: [np.load(rec / f"rank{r}_step{s}_before.npy") for r in range(3)] for s in steps}
    after = {s: [np.load(rec / f"rank{r}_step{s}_after.npy") for r in range(3)] for s in steps}
    # the flat buffer's order is the manifest's, the safetensors' sorted: compare in the flat order
    import json
    names = [p["name"] for p in json.load(open(os.path.join(run_dir, "graphs", "manifest.json")))["params"]]
    init = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
    start = np.concatenate([init[n].ravel() for n in names])
    ref = _reference_outer(start, before, 0.7, 0.9, nesterov)
    scale = np.abs(start).max()
    for s in steps:
        assert not np.array_equal(before[s][0], before[s][1])          # the replicas trained apart
        for r in range(3):
            assert np.array_equal(after[s][r], after[s][0])           # every replica takes the new weights
        assert np.abs(after[s][0] - ref[s]).max() <= 1e-6 * scale, s
    final = load_file(os.path.join(run_dir, "checkpoints", "7", "model.safetensors"))
    assert np.array_equal(np.concatenate([final[n].ravel() for n in names]), after[7][0])
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "outer_bytes" in r]
    assert [r["step"] for r in rows] == steps
    n = start.size
    for row in rows:        # fp32 over 3 replicas: reduce-scatter + allgather, (P-1)/P of the buffer each
        assert row["outer_bytes"] == 2 * 4 * n * 2 // 3
        assert row["outer_wait_s"] >= 0 and 0 < row["outer_drift"] < 1
    _, evals = read_metrics(run_dir)
    assert evals[3]["eval_loss"] == evals[2]["eval_loss"] and evals[5]["eval_loss"] == evals[4]["eval_loss"]
    assert evals[4]["eval_loss"] != evals[3]["eval_loss"]
