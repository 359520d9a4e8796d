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


def test_evaluate_counts_every_sample_the_last_step_smaller(tmp_path, trained, byte_dataset):
    """Without --steps every sample is evaluated: the whole steps, then the rest split over the ranks, its
    loss weighed by its samples -- the numbers of one batch of every sample."""
    from trainrun.data import open_dataset
    evald = os.path.join(byte_dataset, "eval")
    n = open_dataset(evald, 32).num_samples
    assert n % 8 and n > 8                 # whole steps of 8, then a smaller one
    p = run([MPIRUN, "-np", "2", TRAINRUN, "evaluate", trained, "--data", evald, "--batch", "8",
             "--output", str(tmp_path / "steps.json")], check=0)
    assert f"{n} of {n} samples" in p.stdout
    run([TRAINRUN, "evaluate", trained, "--data", evald, "--batch", str(n), "--output", str(tmp_path / "all.json")],
        check=0)
    steps, whole = json.load(open(tmp_path / "steps.json")), json.load(open(tmp_path / "all.json"))
    assert steps["samples"] == whole["samples"] == steps["dataset_samples"] == n
    assert steps["accuracy"] == whole["accuracy"]          # counts of hits over the same tokens
    assert steps["loss"] == pytest.approx(whole["loss"], rel=1e-5)


def test_evaluate_on_a_fixed_batch_dim_checks_the_batch_as_training_does(tmp_path):
    """A user graph whose batch dim is fixed (8): --batch 4 is the named error of training's start-up check
    (exit 2, not onnxruntime's INVALID_ARGUMENT); the default batch runs, the last partial step said left out."""
    import onnx
    import yaml
    from onnx import TensorProto, helper, numpy_helper
    from conftest import TRAINRUN_DATA
    rng = np.random.default_rng(0)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["out"])],
                          "fixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 6])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [8, 5])],
                          [numpy_helper.from_array(rng.normal(0, 0.5, (6, 5)).astype(np.float32), "w"),
                           numpy_helper.from_array(np.zeros(5, np.float32), "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    for split, n in (("train", 64), ("eval", 30)):
        x = rng.normal(0, 1, (n, 6)).astype(np.float32)
        np.savez(tmp_path / f"{split}.npz", x=x, y=np.argmax(x[:, :5], 1).astype(np.int64))
        run([TRAINRUN_DATA, "tensors", "--input", str(tmp_path / f"{split}.npz"), "--output", str(tmp_path / split)],
            check=0)
    cfg = {"run": {"output_dir": str(tmp_path / "run")},
           "model": {"builtin": None, "onnx": str(tmp_path / "m.onnx"), "inputs": ["x"],
                     "loss": {"logits": "out", "labels": "y"}},
           "data": {"train": str(tmp_path / "train"), "eval": str(tmp_path / "eval")},
           "train": {"micro_batch_size": 8, "max_steps": 2, "eval_every": 0}, "checkpoint": {"every": 2},
           "tensorboard": {"enabled": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run([TRAINRUN, "--config", str(tmp_path / "c.yaml")], check=0)
    p = run([TRAINRUN, "evaluate", str(tmp_path / "run"), "--data", str(tmp_path / "eval"), "--batch", "4"], check=2)
    assert "eval.onnx: the data does not fit the graph's inputs (--batch 4 on 1 rank(s): 4 samples per rank)" \
        in p.stderr and "its batch dim is fixed to 8, the micro-batch has 4" in p.stderr
    p = run([TRAINRUN, "evaluate", str(tmp_path / "run"), "--data", str(tmp_path / "eval")], check=0)
    assert "24 of 30 samples (6 left out: the graph's batch dim is fixed to 8)" in p.stdout
