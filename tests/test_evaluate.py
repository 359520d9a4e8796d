"""`trainrun evaluate`: a real run's checkpoint on its eval set, on 1 and 2 ranks, against the run's own
evaluation; bad batch and bad data refused."""

import json
import math
import os

import numpy as np
import pytest

from conftest import MPIRUN, TRAINRUN, mpirun, read_metrics, run, write_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, byte_dataset):
    root = tmp_path_factory.mktemp("evaluate")
    cfg = write_config(root / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "train.eval_steps": 3, "checkpoint": {"every": 6}, "model.gpt2.vocab_size": 257})
    mpirun(2, "--config", cfg)
    return str(root / "run")


def test_evaluate_on_one_and_two_ranks_and_as_the_run_evaluated(tmp_path, trained, byte_dataset):
    run_dir, evald = trained, os.path.join(byte_dataset, "eval")
    _, evals = read_metrics(run_dir)
    results = {}
    for ranks in (1, 2):
        out = str(tmp_path / f"e{ranks}.json")
        p = run([MPIRUN, "-np", str(ranks), TRAINRUN, "evaluate", run_dir, "--data", evald, "--batch", "8",
                 "--output", out], check=0)
        assert p.stdout.count("perplexity") == 1          # rank 0 prints
        results[ranks] = json.load(open(out))
    one, two = results[1], results[2]
    assert one["world_size"] == 1 and two["world_size"] == 2 and one["samples"] == two["samples"] > 0
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["perplexity"] == pytest.approx(math.exp(two["loss"]), rel=1e-12)
    for name in ("accuracy", "top5_accuracy"):       # counts of hits: exact whatever the ranks
        assert 0 < one[name] <= 1 and two[name] == one[name]
    # the run's own evaluation: eval_steps 3 global batches of 2 ranks x 4 = the first 24 samples
    p = run([TRAINRUN, "evaluate", run_dir, "--data", evald, "--batch", "8", "--steps", "3",
             "--output", str(tmp_path / "e.json")], check=0)
    again = json.load(open(tmp_path / "e.json"))
    assert again["samples"] == 24
    assert again["loss"] == pytest.approx(evals[6]["eval_loss"], rel=1e-5)
    assert again["accuracy"] == pytest.approx(evals[6]["eval_accuracy"], rel=1e-6)


def test_evaluate_refuses_a_batch_the_ranks_do_not_divide_and_data_without_the_features(tmp_path, trained,
                                                                                          byte_dataset):
    run_dir = trained
    p = run([MPIRUN, "-np", "2", TRAINRUN, "evaluate", run_dir, "--data", os.path.join(byte_dataset, "eval"),
             "--batch", "3"], check=2)
    assert "--batch 3" in p.stderr and p.stderr.count("--batch 3") == 1     # said once, by rank 0
    np.savez(tmp_path / "t.npz", x=np.zeros((8, 3), np.float32))
    from conftest import TRAINRUN_DATA
    run([TRAINRUN_DATA, "tensors", "--input", str(tmp_path / "t.npz"), "--output", str(tmp_path / "t")], check=0)
    p = run([TRAINRUN, "evaluate", run_dir, "--data", str(tmp_path / "t"), "--output", str(tmp_path / "out.json")],
            check=2)
    assert "input_ids" in p.stderr
    assert not os.path.exists(tmp_path / "out.json")
