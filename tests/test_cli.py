"""The command line as users meet it, each a real subprocess: the subcommands' --set and --log-level,
export with the loss, renamed labels, model.frozen, every usage error's exit 2 naming the key or file,
and Ctrl-C."""

import glob
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import TRAINRUN, TRAINRUN_DATA, read_metrics, run, write_config
from trainrun.run import rundir


@pytest.fixture(scope="module")
def trained_proc(tmp_path_factory, byte_dataset):
    """A finished 1-rank run of 3 steps with a checkpoint at every step (do not modify: copy it), and
    its process: `trainrun train` of a config of 20 steps at log level info, with --set train.max_steps=3
    and --log-level devinfo."""
    d = tmp_path_factory.mktemp("trained")
    cfg = write_config(d / "c.yaml", byte_dataset, **{"checkpoint.every": 1, "train.eval_every": 3,
                                                      "engine.threads": 1})
    proc = run([TRAINRUN, "train", "--config", cfg, "--set", "train.max_steps=3", "--log-level", "devinfo"],
               check=0)
    return d / "run", proc


@pytest.fixture(scope="module")
def trained(trained_proc):
    return trained_proc[0]


def test_train_subcommand_set_and_log_level(trained_proc):
    run_dir, proc = trained_proc
    train, evals = read_metrics(str(run_dir))
    assert sorted(train) == [1, 2, 3] and sorted(evals) == [3]                  # --set train.max_steps=3
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2", "3"]
    assert "[rank 0] step 3 | local loss " in proc.stdout                       # --log-level devinfo
    assert "[I:onnxruntime:rank 0 train," in proc.stderr


def test_resume_log_level(tmp_path, trained):
    """`--log-level devinfo` applies to the command given it only: the run's config keeps the file's level
    (info), so `resume --log-level warning` continues quietly and a plain `resume` prints at info again."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    shutil.rmtree(copy / "checkpoints" / "3")
    for config in (copy / "config.yaml", copy / "checkpoints" / "2" / "config.yaml"):
        assert "log_level: info" in config.read_text()
    proc = run([TRAINRUN, "resume", str(copy), "--log-level", "warning"], check=0)
    assert proc.stdout == "" and "[I:onnxruntime" not in proc.stderr
    assert rundir.resolve_checkpoint(str(copy)) == str(copy / "checkpoints" / "3")    # it did train step 3
    assert "log_level: info" in (copy / "checkpoints" / "3" / "config.yaml").read_text()
    shutil.rmtree(copy / "checkpoints" / "3")
    proc = run([TRAINRUN, "resume", str(copy)], check=0)
    assert "step      3/3 | loss " in proc.stdout and "[rank 0]" not in proc.stdout, proc.stdout


def test_prepare_log_level_verbose_shows_the_traceback(tmp_path, byte_dataset):
    """prepare logs nothing of its own: --log-level verbose adds the traceback to an error (without it
    there is none: test_usage_errors_exit_2_naming_the_key_or_file)."""
    cfg = _config(tmp_path, byte_dataset, **{"debug.stats_every": 1, "debug.tensors": ["no_such_tensor*"]})
    proc = run([TRAINRUN, "prepare", "--config", cfg, "--log-level", "verbose"], check=2)
    assert "debug.tensors" in proc.stderr and "'no_such_tensor*'" in proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr and "select_outputs" in proc.stderr


def test_config_validate_set(tmp_path, byte_dataset):
    """--set can break a valid config (exit 2 naming the key) and mend a broken one."""
    good = _config(tmp_path, byte_dataset)
    assert f"{good}: valid" in run([TRAINRUN, "config", "validate", "--config", good], check=0).stdout
    proc = run([TRAINRUN, "config", "validate", "--config", good, "--set", "optimizer.betas=[0.9, 1.0]"], check=2)
    assert "optimizer.betas[1]: must be in [0, 1), got 1.0" in proc.stderr
    bad = write_config(tmp_path / "bad.yaml", byte_dataset, **{"lr_schedule.min_lr": 0.01})
    proc = run([TRAINRUN, "config", "validate", "--config", bad], check=2)
    assert "lr_schedule.min_lr: 0.01 exceeds optimizer.lr (0.003)" in proc.stderr
    proc = run([TRAINRUN, "config", "validate", "--config", bad, "--set", "lr_schedule.min_lr=0.0001"], check=0)
    assert f"{bad}: valid" in proc.stdout


def test_export_with_loss_keeps_the_loss_and_takes_labels(tmp_path, trained):
    out = tmp_path / "with_loss.onnx"
    proc = run([TRAINRUN, "export", str(trained / "checkpoints" / "3"), "--output", str(out), "--with-loss"], check=0)
    assert "max |logits - eval graph|" in proc.stdout
    import onnxruntime as ort
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert {i.name for i in sess.get_inputs()} == {"input_ids", "labels"}
    rng = np.random.default_rng(1)
    ids, labels = rng.integers(0, 512, (2, 32)), rng.integers(0, 512, (2, 32))
    loss, logits = sess.run(["loss", "logits"], {"input_ids": ids, "labels": labels})
    z = logits.reshape(-1, 512).astype(np.float64)
    logp = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    assert float(loss) == pytest.approx(-logp[np.arange(64), labels.ravel()].mean(), rel=1e-5)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_follow_the_umask(tmp_path, byte_dataset, trained, umask):
    """What prepare and `export --format transformers` write has the modes the umask gives a file (0666 less
    it) and a folder (0777 less it), as the checkpoints and model.onnx have: on a shared cluster the group
    reads them (with 022 everyone) -- not 0700/0600 whatever the umask. The writes stay atomic (a staged
    folder renamed into place, a temporary file replaced)."""
    def under_umask(*args):
        return run(["bash", "-c", f"umask {umask:03o} && exec \"$@\"", "bash", TRAINRUN, *args], check=0)
    cfg = write_config(tmp_path / "c.yaml", byte_dataset)
    under_umask("prepare", "--config", cfg)
    under_umask("export", str(trained), "--format", "transformers", "--output", str(tmp_path / "hf"))
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777
             for p in [tmp_path / "hf", *(tmp_path / "hf").iterdir(), *(tmp_path / "run" / "graphs").iterdir()]}
    assert "hf/model.safetensors" in modes and "run/graphs/weights.safetensors" in modes
    assert modes == {p: (0o777 if p == "hf" else 0o666) & ~umask for p in modes}


def test_renamed_labels_input_trains_on_the_dataset_labels(tmp_path, byte_dataset, trained):
    """model.loss.labels only names the graph input: the dataset's labels feed it, so the losses are
    those of the run with the default name (same seed, data and graph; 1 thread each, so the same
    computation whatever the core count)."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 3, "checkpoint.every": 1,
                                                             "train.eval_every": 3, "engine.threads": 1,
                                                             "model.loss": {"labels": "targets"}})
    run([TRAINRUN, "--config", cfg], check=0)
    (ours, our_eval), (ref, ref_eval) = read_metrics(str(tmp_path / "run")), read_metrics(str(trained))
    np.testing.assert_allclose([ours[s]["loss"] for s in (1, 2, 3)] + [our_eval[3]["eval_loss"]],
                               [ref[s]["loss"] for s in (1, 2, 3)] + [ref_eval[3]["eval_loss"]], rtol=1e-6)
    proc = run([TRAINRUN, "export", str(tmp_path / "run"), "--output", str(tmp_path / "m.onnx"), "--with-loss"],
               check=0)
    assert "max |logits - eval graph|" in proc.stdout


def _config(tmp_path, byte_dataset, **sections):
    return write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 2, **sections})


def _checkpoint_cases(tmp_path, trained):
    """(command, message) of the resume errors, on copies of the trained run."""
    none = tmp_path / "none"
    shutil.copytree(trained, none)
    for c in glob.glob(str(none / "checkpoints" / "*" / rundir.COMMITTED)):
        os.remove(c)
    half = tmp_path / "half"
    shutil.copytree(trained, half)
    os.remove(half / "checkpoints" / "3" / rundir.COMMITTED)
    return {"no complete checkpoint": ([TRAINRUN, "resume", str(none)],
                                       f"{none}: no complete checkpoint under checkpoints/"),
            "checkpoint without COMMITTED": ([TRAINRUN, "resume", str(half / "checkpoints" / "3")],
                                             f"{half / 'checkpoints' / '3'}: checkpoint is incomplete (no COMMITTED")}


USAGE_ERRORS = {   # name: (config sections, message): `trainrun train` must exit 2 naming the key
    "missing data.train": ({"data.train": None}, "data.train: is required to train"),
    "zero_stage 2": ({"distributed.zero_stage": 2}, "distributed.zero_stage: 2 is not one of: 0, 1"),
    "nccl on cpu": ({"distributed.backend": "nccl", "device": "cpu"}, "distributed.backend: nccl needs device: cuda"),
    "betas out of range": ({"optimizer.betas": [0.9, 1.0]}, "optimizer.betas[1]: must be in [0, 1), got 1.0"),
    "min_lr > lr": ({"lr_schedule.min_lr": 0.01}, "lr_schedule.min_lr: 0.01 exceeds optimizer.lr (0.003)"),
    "model.frozen everything": ({"model.frozen": ["*"]}, "model.frozen: ['*'] freezes every parameter of gpt2"),
    "model.trainable unknown": ({"model.trainable": ["transformer.wte.weight", "transformer.h.7.*"]},
                                "model.trainable: 'transformer.h.7.*' matches no parameter of gpt2"),
    "model.frozen unknown": ({"model.frozen": ["transformer.wte.weight", "transformer.h.*.attn.c_atn.*"]},
                             "model.frozen: 'transformer.h.*.attn.c_atn.*' matches no parameter of gpt2"),
    "model.trainable all frozen": ({"model.trainable": ["transformer.h.0.*"], "model.frozen": ["transformer.h.*"]},
                                   "model.frozen: ['transformer.h.*'] freezes every parameter of gpt2 that "
                                   "model.trainable lists"),
}


@pytest.mark.parametrize("case", [*USAGE_ERRORS, "no complete checkpoint", "checkpoint without COMMITTED",
                                  "bad tokenizer.json", "empty input"])
def test_usage_errors_exit_2_naming_the_key_or_file(tmp_path, byte_dataset, trained, case):
    written = tmp_path / "run"          # what must not be left behind
    if case in USAGE_ERRORS:
        sections, message = USAGE_ERRORS[case]
        cmd = [TRAINRUN, "train", "--config", _config(tmp_path, byte_dataset, **sections)]
    elif case in ("no complete checkpoint", "checkpoint without COMMITTED"):
        cmd, message = _checkpoint_cases(tmp_path, trained)[case]
    else:
        text = tmp_path / "text"
        text.mkdir()
        for i in range(3):
            (text / f"{i}.txt").write_text("" if case == "empty input" else f"some text {i}\n")
        bad = tmp_path / "tokenizer.json"
        bad.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')     # cut short
        written = tmp_path / "out"
        how = ["--tokenizer", str(bad)] if case == "bad tokenizer.json" else ["--bytes"]
        cmd = [TRAINRUN_DATA, "tokens", "--input", str(text), "--output", str(written), *how]
        message = (f"--tokenizer {bad}: not a readable tokenizer.json" if case == "bad tokenizer.json"
                   else "--input: the 3 file(s) found are all empty")
    proc = run(cmd, check=2)
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    if case not in ("no complete checkpoint", "checkpoint without COMMITTED"):   # nothing half-written
        left = [p for p in glob.glob(str(written / "**"), recursive=True) if os.path.isfile(p)]
        assert left in ([], [str(written / "config.yaml")]), f"{case}: left {left}"


def test_second_ctrl_c_during_the_save_exits_130_leaving_nothing_that_looks_committed(tmp_path, byte_dataset):
    """The first Ctrl-C asks for a stop with a checkpoint; a second one while that save waits
    interrupts at once (exit 130). The write of step 6 hangs (fault injection), so at step 12 the
    run waits for it: both signals arrive then. Nothing may look committed."""
    cfg = _config(tmp_path, byte_dataset, **{"train.max_steps": 100000, "checkpoint.every": 6,
                                            "distributed.timeout_s": 120})
    env = dict(os.environ, TRAINRUN_FAULT_STALL_CHECKPOINT="6")
    proc = subprocess.Popen([TRAINRUN, "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and \
                (not metrics.exists() or len(metrics.read_text().splitlines()) < 12):
            time.sleep(0.1)
        time.sleep(0.5)     # step 12's checkpoint now waits for step 6's write
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()      # the first one only asked for a stop
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "trainrun: interrupted" in err and "Traceback" not in err
    ckpts = tmp_path / "run" / "checkpoints"
    assert [d for d in os.listdir(ckpts) if d.isdigit()] == []      # no <step>/ directory
    assert not glob.glob(str(ckpts / "*" / rundir.COMMITTED))


@pytest.mark.torch
def test_a_trainrun_process_never_imports_torch(tmp_path, byte_dataset):
    """torch is installed here (the test extra), and onnxruntime-training's package check imports it with
    ORTModule (1.5 s of every start), and so does tensorboardX's writer (1.8 s): the CLI leaves it out, a run
    trains and writes its TensorBoard events, and torch still imports afterwards in the same process."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 2, "tensorboard.enabled": True})
    probe = ("import sys\nfrom trainrun.cli import main\nsys.argv = ['trainrun', '--config', sys.argv[1]]\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "import onnxruntime, torch\nprint('torch', torch.__version__)\n")
    proc = subprocess.run([os.path.join(os.path.dirname(TRAINRUN), "python"), "-c", probe, cfg],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "torch 2." in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "run" / "model.onnx").exists() and os.listdir(tmp_path / "run" / "tensorboard")
