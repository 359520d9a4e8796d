"""`trainrun evaluate`: a real run's checkpoint on its eval set, on 1 and 2 ranks, against the run's own
evaluation; bad batch and bad data refused."""

import json
import math
import os

import numpy as np
import pytest

from conftest import MPIRUN, TRAINRUN, mpirun, read_metrics, run, write_config


@pytest.fixture(scope="module")
def session(tmp_path_factory, byte_dataset):
    """2 ranks to step 6, checkpoints at 3 and 6: evaluated at step 3 over train.eval_steps 3 (24 samples),
    then (resumed with eval_steps beyond the set) at step 6 over every sample; the two sessions' outputs."""
    root = tmp_path_factory.mktemp("evaluate")
    cfg = write_config(root / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "train.stop_at": 3, "train.eval_every": 3, "train.eval_steps": 3,
        "checkpoint": {"every": 3}, "model.gpt2.vocab_size": 257})
    first = mpirun(2, "--config", cfg)
    second = mpirun(2, "resume", str(root / "run"), "--set", "train.stop_at=0", "--set", "train.eval_steps=1000")
    return str(root / "run"), first.stdout, second.stdout


@pytest.fixture(scope="module")
def trained(session):
    return session[0]


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
    # the run's own evaluation at step 3: eval_steps 3 global batches of 2 ranks x 4 = the first 24 samples
    p = run([TRAINRUN, "evaluate", os.path.join(run_dir, "checkpoints", "3"), "--data", evald, "--batch", "8",
             "--steps", "3", "--output", str(tmp_path / "e.json")], check=0)
    again = json.load(open(tmp_path / "e.json"))
    assert again["samples"] == 24
    assert again["loss"] == pytest.approx(evals[3]["eval_loss"], rel=1e-5)
    assert again["accuracy"] == pytest.approx(evals[3]["eval_accuracy"], rel=1e-6)


def test_the_run_evaluates_every_sample_as_evaluate_does_and_says_how_many(tmp_path, session, byte_dataset):
    """train.eval_steps beyond the eval set: the run's evaluation covers every sample, the last step smaller
    (the set is no multiple of the 8 samples of a step on 2 ranks), and equals `trainrun evaluate`'s of the
    same checkpoint on 2 ranks. An evaluation that stops short says how many of the set's samples it
    covered, in its console line and in metrics.jsonl."""
    from trainrun.data import open_dataset
    run_dir, first, second = session
    evald = os.path.join(byte_dataset, "eval")
    n = open_dataset(evald, 32).num_samples
    assert n % 8 and n > 24
    _, evals = read_metrics(run_dir)
    assert (evals[3]["eval_samples"], evals[3]["eval_dataset_samples"]) == (24, n)
    assert (evals[6]["eval_samples"], evals[6]["eval_dataset_samples"]) == (n, n)
    line = lambda out, step: next(x for x in out.splitlines() if x.startswith(f"eval {step:>6} | loss"))  # noqa: E731
    assert line(first, 3).endswith(f" (24 of {n} samples)") and line(second, 6).endswith(f" ({n} of {n} samples)")
    assert "samples" not in line(first, 3).split("(")[0]          # a count, not one of the metrics
    run([MPIRUN, "-np", "2", TRAINRUN, "evaluate", os.path.join(run_dir, "checkpoints", "6"), "--data", evald,
         "--output", str(tmp_path / "e.json")], check=0)
    result = json.load(open(tmp_path / "e.json"))
    assert result["samples"] == n and result["batch"] == 8
    for name in ("loss", "perplexity", "accuracy", "top5_accuracy"):
        assert result[name] == pytest.approx(evals[6][f"eval_{name}"], rel=1e-5), name


def _chars_data(root, extra=""):
    """A `trainrun-data tokens --chars` dataset of a little text (+ ``extra``): ids below 257, like bytes."""
    from conftest import TRAINRUN_DATA, synthetic_text_dir
    text = synthetic_text_dir(str(root / "text"), max_bytes=20_000)
    if extra:
        with open(os.path.join(text, "extra.py"), "w") as fh:
            fh.write(extra)
    run([TRAINRUN_DATA, "tokens", "--input", text, "--output", str(root / "data"), "--chars", "--eval-fraction",
         "0.1", "--no-progress"], check=0)
    return str(root / "data")


def test_evaluate_and_init_from_refuse_data_of_another_tokenizer(tmp_path, trained):
    """The run's data are raw bytes. A --chars dataset of the same text has every id below the model's
    vocabulary, so only the tokenizer tells them apart: `trainrun evaluate` refuses it by name (exit 2,
    nothing written) unless --force; `config validate` refuses model.init_from the run over it as data.train.
    Two tokenizer.json files that give every token the same id are one tokenizer; vocabularies that differ
    are named."""
    import yaml
    from trainrun.hf import tokenizer as T
    chars = _chars_data(tmp_path / "a")
    out = str(tmp_path / "e.json")
    p = run([MPIRUN, "-np", "2", TRAINRUN, "evaluate", trained, "--data", os.path.join(chars, "eval"),
             "--output", out], check=2)
    want = (f"--data {os.path.join(chars, 'eval')}: not tokenized as the run's data: the data's tokens are the "
            f"tokenizer {os.path.join(chars, 'tokenizer.json')}, the model's raw bytes")
    assert want in p.stderr and p.stderr.count(want) == 1 and "--force" in p.stderr, p.stderr
    assert not os.path.exists(out) and "perplexity" not in p.stdout
    p = run([TRAINRUN, "evaluate", trained, "--data", os.path.join(chars, "eval"), "--force", "--output", out], check=0)
    assert json.load(open(out))["samples"] > 0

    cfg = yaml.safe_load(open(os.path.join(trained, "config.yaml")))
    cfg["model"]["init_from"] = trained
    cfg["data"].update(train=os.path.join(chars, "train"), eval=os.path.join(chars, "eval"))
    cfg["run"]["output_dir"] = str(tmp_path / "run")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    p = run([TRAINRUN, "config", "validate", "--config", str(tmp_path / "c.yaml")], check=2)
    assert (f"model.init_from: {trained}: not trained on data.train's tokens: the data's tokens are the tokenizer "
            f"{os.path.join(chars, 'tokenizer.json')}, the model's raw bytes") in p.stderr, p.stderr

    # a run over the chars data (what training records at start) against other files and vocabularies
    os.makedirs(tmp_path / "r")
    T.record(os.path.join(chars, "train"), str(tmp_path / "r"))
    saved_again = tmp_path / "hf"
    os.makedirs(saved_again)
    T.for_data(os.path.join(chars, "train")).tokenizer.save(str(saved_again / "tokenizer.json"), pretty=False)
    assert (saved_again / "tokenizer.json").read_bytes() != open(os.path.join(chars, "tokenizer.json"), "rb").read()
    assert T.mismatch(str(saved_again), os.path.join(chars, "eval")) is None
    assert T.mismatch(str(tmp_path / "r"), os.path.join(chars, "eval")) is None
    other = _chars_data(tmp_path / "b", extra="# \u00e9\u00e8\u00ea\u00eb\u00ff\n")
    why = T.mismatch(str(tmp_path / "r"), os.path.join(other, "eval"))
    assert why.startswith(f"the data's tokenizer ({os.path.join(other, 'tokenizer.json')}) is not the model's "
                          f"({tmp_path / 'r' / 'tokenizer.json'}): ") and "tokens" in why, why


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
