"""A checkpoint against the graphs it was trained with: `prepare` on a run directory in use or with
checkpoints, readers (export, evaluate, generate) of a checkpoint whose graphs were prepared again,
`resume --force` to a smaller model; real processes, real checkpoints."""

import json
import os
import shutil

import numpy as np
import pytest

from conftest import TRAINRUN, mpirun, run, write_config

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

H1 = [f"transformer.h.1.{t}" for t in ("ln_1.weight", "attn.c_attn.weight", "mlp.c_proj.bias")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, byte_dataset):
    """A 2-layer run of 2 steps with its checkpoint at step 2 (copied by each test: they change it)."""
    root = tmp_path_factory.mktemp("two_layers")
    cfg = write_config(root / "c.yaml", byte_dataset, **{"train.max_steps": 2, "checkpoint.every": 2})
    run([TRAINRUN, "--config", cfg, "--log-level", "warning"], check=0)
    return str(root / "run")


def _copy(trained, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(trained, run_dir)
    return run_dir, os.path.join(run_dir, "checkpoints", "2")


def _graph_files(run_dir):
    with open(os.path.join(run_dir, "graphs", "manifest.json")) as fh:
        return json.load(fh)["files"]


def test_prepare_takes_the_run_lock_and_refuses_a_run_with_checkpoints(tmp_path, trained):
    from trainrun.run.lock import RunLock
    run_dir, ckpt = _copy(trained, tmp_path)
    before = _graph_files(run_dir)
    prepare = [TRAINRUN, "prepare", "--config", os.path.join(ckpt, "config.yaml"), "--set",
               f"run.output_dir={run_dir}", "--set", "model.gpt2.n_layer=1"]
    lock = RunLock(run_dir)
    lock.acquire()              # as a job training there holds it
    try:
        proc = run(prepare + ["--force"], check=2)
    finally:
        lock.release()
    assert "is in use by another trainrun job" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
    proc = run(prepare, check=2)
    assert f"{run_dir} holds checkpoints" in proc.stderr and f"trainrun resume {run_dir}" in proc.stderr
    assert "--force" in proc.stderr
    assert _graph_files(run_dir) == before          # untouched both times
    assert not os.path.exists(os.path.join(run_dir, ".lock"))
    run(prepare + ["--force"], check=0)
    assert _graph_files(run_dir)["eval.onnx"] != before["eval.onnx"]


def test_readers_refuse_a_checkpoint_of_other_graphs_naming_both(tmp_path, trained, byte_dataset):
    """After `prepare --force` with another n_layer, export, evaluate and generate exit 2 naming both
    graphs' hashes (not a 2-layer checkpoint exported as a 1-layer model); the prepare the message
    names restores the run's graphs and export works again."""
    run_dir, ckpt = _copy(trained, tmp_path)
    with open(os.path.join(ckpt, "state.json")) as fh:
        trained_with = json.load(fh)["graphs"]
    run([TRAINRUN, "prepare", "--config", os.path.join(ckpt, "config.yaml"), "--set", f"run.output_dir={run_dir}",
         "--set", "model.gpt2.n_layer=1", "--force"], check=0)
    now = _graph_files(run_dir)
    model = str(tmp_path / "model.onnx")
    for cmd in (["export", run_dir, "--output", model],
                ["evaluate", run_dir, "--data", os.path.join(byte_dataset, "eval")],
                ["generate", run_dir, "--prompt", "def", "--max-new-tokens", "2"]):
        proc = run([TRAINRUN, *cmd], check=2)
        assert f"{ckpt} was trained with other graphs than {run_dir}/graphs" in proc.stderr, proc.stderr
        for f in ("eval.onnx", "forward.onnx"):
            assert f"{f}: sha256 {trained_with[f]} in {ckpt}/state.json, {now[f]} in {run_dir}/graphs/manifest.json" \
                in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not os.path.exists(model)
    hint = proc.stderr.split("`")[1]        # the prepare the message names
    assert hint.startswith("trainrun prepare --config")
    run([os.path.join(os.path.dirname(TRAINRUN), hint.split()[0]), *hint.split()[1:]], check=0)
    assert _graph_files(run_dir) == trained_with
    proc = run([TRAINRUN, "export", run_dir, "--output", model], check=0)
    assert "max |logits - eval graph| = 0 " in proc.stdout


def test_resume_force_with_fewer_layers_lists_what_it_drops(tmp_path, trained):
    """2 ranks: rank 0 prints the warning once; the layer kept continues from the checkpoint's values."""
    from safetensors.numpy import load_file
    run_dir, ckpt = _copy(trained, tmp_path)
    proc = mpirun(2, "resume", run_dir, "--force", "--set", "model.gpt2.n_layer=1", "--set", "train.max_steps=3",
                  "--set", "train.micro_batch_size=2", "--set", "optimizer.lr=1e-7", "--set", "lr_schedule.min_lr=0",
                  "--log-level", "warning")
    assert proc.stderr.count("trainrun: warning: resume --force") == 1, proc.stderr
    dropped = proc.stderr.split("dropped:")[1]
    assert all(name in dropped for name in H1)
    assert "transformer.h.0." not in dropped and "transformer.wte.weight" not in dropped
    assert "optimizer.safetensors: their exp_avg, exp_avg_sq" in dropped
    before = load_file(os.path.join(ckpt, "model.safetensors"))
    after = load_file(os.path.join(run_dir, "checkpoints", "3", "model.safetensors"))
    initial = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
    assert set(after) == set(initial) == {k for k in before if not k.startswith("transformer.h.1.")}
    # one step at lr 1e-7 moves no weight by 1e-5; two steps at 3e-3 moved them from the initial ones by more
    assert max(np.abs(after[k] - before[k]).max() for k in after) < 1e-5
    assert np.abs(before["transformer.wte.weight"] - initial["transformer.wte.weight"]).max() > 1e-4


def test_a_checkpoint_tensor_the_model_does_not_take_is_an_error(tmp_path, trained):
    """Restoring a 2-layer checkpoint into a 1-layer model without --force: exit 2 naming the tensors,
    the buffers untouched (the same check as every reader's)."""
    from trainrun import checkpoint as K
    from trainrun.comm import make_communicator
    from trainrun.step.flat import FlatLayout
    from trainrun.errors import UsageError
    run_dir, ckpt = _copy(trained, tmp_path)
    run([TRAINRUN, "prepare", "--config", os.path.join(ckpt, "config.yaml"), "--set", f"run.output_dir={run_dir}",
         "--set", "model.gpt2.n_layer=1", "--force"], check=0)
    with open(os.path.join(run_dir, "graphs", "manifest.json")) as fh:
        layout = FlatLayout.from_manifest(json.load(fh))
    comm = make_communicator("none", "cpu", 60)
    params = np.zeros(layout.total, np.float32)
    state = {s: np.zeros(layout.total, np.float32) for s in ("exp_avg", "exp_avg_sq")}
    with pytest.raises(UsageError) as err:
        K.Checkpointer(run_dir, comm, keep_last=3).restore(ckpt, layout, params, state)
    assert err.value.exit_code == 2
    assert "holds tensors that the model does not take" in err.value.message
    assert all(name in err.value.problems[0] for name in H1)
    assert not params.any() and not state["exp_avg"].any()
