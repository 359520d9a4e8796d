"""A model family is one place: a toy third family, defined in tests/toy_family.py alone and added with
``trainrun.models.registry.register``, is prepared, trained, exported and refused by name by
``export --format transformers`` (it has no transformers class) by the real command line, in processes
that import it first."""

import json
import os
import sys

import numpy as np
import onnxruntime as ort
from safetensors.numpy import load_file

from conftest import ROOT, run, write_config

TESTS = os.path.join(ROOT, "tests")
# the trainrun command line in a process that registered the toy family first
TRAINRUN_TOY = [sys.executable, "-c", f"import sys; sys.path.insert(0, {TESTS!r}); import toy_family; "
                                      f"from trainrun.cli import main; main()"]


def test_a_toy_family_prepares_trains_exports_and_is_refused_by_transformers(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model": {"builtin": "toy", "toy": {"vocab_size": 300, "width": 8, "context": 32}},
        "train.max_steps": 3, "checkpoint": {"every": 3}, "train.eval_every": 3})
    run_dir = str(tmp_path / "run")
    run([*TRAINRUN_TOY, "prepare", "--config", cfg], check=0)
    manifest = json.load(open(os.path.join(run_dir, "graphs", "manifest.json")))
    assert manifest["model"]["toy"] == {"vocab_size": 300, "width": 8, "context": 32}
    assert [p["name"] for p in manifest["params"]] == ["toy.embed.weight", "toy.head.weight", "toy.head.bias"]
    assert manifest["inputs"] == ["input_ids"] and manifest["labels"] == "labels"

    run([*TRAINRUN_TOY, "--config", cfg], check=0)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert abs(losses[0] - np.log(300)) < 0.5       # near uniform at the start: 0.1-scale weights
    assert any("eval_loss" in r for r in rows)
    ckpt = os.path.join(run_dir, "checkpoints", "3")

    out = str(tmp_path / "toy.onnx")
    p = run([*TRAINRUN_TOY, "export", ckpt, "--output", out], check=0)
    assert "max |logits - eval graph|" in p.stdout + p.stderr
    # the export against the toy model in NumPy (float64) with the checkpoint's weights; toy_family is not
    # imported here: registering it would add model.toy to the schema of every later test in this process
    w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
    ids = np.random.default_rng(0).integers(0, 300, (2, 7)).astype(np.int64)
    got = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(["logits"], {"input_ids": ids})[0]
    want = np.maximum(w["toy.embed.weight"][ids], 0) @ w["toy.head.weight"] + w["toy.head.bias"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    p = run([*TRAINRUN_TOY, "export", ckpt, "--format", "transformers", "--output", str(tmp_path / "hf")], check=2)
    assert "--format transformers" in p.stderr and "a toy model, a family with no transformers class" in p.stderr
    assert not os.path.exists(tmp_path / "hf")

    # the family's own check of its section, reported with its key (exit 2)
    bad = write_config(tmp_path / "bad.yaml", byte_dataset, **{"model": {"builtin": "toy", "toy": {"width": 7}}})
    p = run([*TRAINRUN_TOY, "config", "validate", "--config", bad], check=2)
    assert "model.toy.width: must be even, got 7" in p.stderr
