"""Training controls: several named eval sets, train.max_epochs, train.max_time. Real runs of
a tiny GPT-2 (`mpirun -np 2` where ranks matter), real files read back: metrics.jsonl, TensorBoard's
event file, checkpoints' state.json."""

import glob
import json
import math
import os
import re
import time

import pytest

from conftest import MPIRUN, TRAINRUN, mpirun, run, write_config
from test_runner import _tensorboard_events
from trainrun import checkpoint as K
from trainrun.run import rundir
from trainrun.data import open_dataset
from trainrun.run.stopping import STOPPED_EXIT


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_named_eval_sets_metrics_tensorboard_early_stopping_and_keep_best(tmp_path, byte_dataset):
    """data.eval {held: eval, seen: train}: every evaluation runs both; metrics.jsonl has
    eval_<name>_<metric> and TensorBoard eval/<name>/<metric> (read back from the event file); early
    stopping watches eval_seen_accuracy (higher is better; an improvement beats the best by more than
    min_delta 0.01) and stops where the logged evaluations say it should (computed here from them), after
    improving at least once; keep_best ranks by eval_held_accuracy, higher first."""
    evald, traind = os.path.join(byte_dataset, "eval"), os.path.join(byte_dataset, "train")
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "data.eval": {"held": evald, "seen": traind}, "tensorboard.enabled": True,
        "train.max_steps": 40, "train.eval_every": 2, "checkpoint.every": 2, "checkpoint.keep_last": 1,
        "checkpoint.keep_best": 1, "checkpoint.best_metric": "eval_held_accuracy",
        "train.early_stopping": {"patience": 2, "min_delta": 0.01, "metric": "eval_seen_accuracy"}})
    proc = mpirun(1, "--config", cfg)
    out = tmp_path / "run"
    evals = {r["step"]: r for r in _rows(out) if any(k.startswith("eval_") for k in r)}
    best, best_step, since, stop = None, None, 0, None     # early stopping, over the logged evaluations
    for step in sorted(evals):
        value = evals[step]["eval_seen_accuracy"]
        if best is None or value > best + 0.01:
            best, best_step, since = value, step, 0
        else:
            since += 1
        if since == 2:
            stop = step
            break
    assert best_step > 2, evals                 # it improved after the first evaluation
    last = stop or 40
    assert sorted(evals) == list(range(2, last + 1, 2)), (stop, sorted(evals))
    if stop:
        assert f"early stopping at step {stop}: eval_seen_accuracy did not improve by more than 0.01 in 2 " \
               f"evaluations (best {best:.4f} at step {best_step})" in proc.stdout, proc.stdout
    for row in evals.values():
        for name in ("held", "seen"):
            for metric in ("loss", "perplexity", "accuracy", "top5_accuracy"):
                assert math.isfinite(row[f"eval_{name}_{metric}"]), row
        assert "eval_loss" not in row
        assert row["eval_held_loss"] != row["eval_seen_loss"]           # two sets, two results
    assert "eval held      2 | loss" in proc.stdout and "eval seen      2 | loss" in proc.stdout
    scalars = {}
    for event in _tensorboard_events(glob.glob(str(out / "tensorboard" / "events.*"))):
        for v in event.summary.value:
            scalars[v.tag, event.step] = v.simple_value
    for step, row in evals.items():
        for name in ("held", "seen"):
            for metric in ("loss", "accuracy"):
                assert scalars[f"eval/{name}/{metric}", step] == pytest.approx(row[f"eval_{name}_{metric}"],
                                                                                rel=1e-6)
    assert not any(tag in ("eval/loss", "eval/held_loss") for tag, _ in scalars)
    # keep_best 1 by accuracy (higher is better) besides keep_last 1 (the last step)
    best_held = max(evals, key=lambda s: (evals[s]["eval_held_accuracy"], s))
    kept = [int(os.path.basename(c)) for c in rundir.complete_checkpoints(str(out / "checkpoints"))]
    assert kept == sorted({last, best_held}), (kept, {s: evals[s]["eval_held_accuracy"] for s in evals})
    state = K.read_state(str(out / "checkpoints" / str(best_held)))
    assert state["best_metric"] == {"name": "eval_held_accuracy", "greater_is_better": True,
                                    "value": pytest.approx(evals[best_held]["eval_held_accuracy"], rel=1e-12)}
    assert state["eval"]["eval_seen_loss"] == pytest.approx(evals[best_held]["eval_seen_loss"], rel=1e-12)
    assert rundir.best_checkpoints(str(out / "checkpoints"), "eval_held_accuracy", True)[0][0] == \
        str(out / "checkpoints" / str(best_held))
    es = K.read_state(str(out / "checkpoints" / str(last)))["early_stopping"]
    assert es["metric"] == "eval_seen_accuracy" and es["best_step"] == best_step and es["evals_since_best"] == since
    assert es["best"] == pytest.approx(best, rel=1e-12)


def test_bad_eval_sets_and_controls_are_refused_by_name(tmp_path, byte_dataset):
    """Exit 2, every problem named by its key: a set name that cannot be part of a metric name, one that
    another's name starts with, a watched metric of no set, a broken max_time, a negative max_epochs;
    an eval set that does not exist or lacks a batch (the start-up check of each set); a metric the
    evaluations do not log (before any graph is built: decided from the model and its task)."""
    evald = os.path.join(byte_dataset, "eval")
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "data.eval": {"a/b": evald, "x": evald, "x_y": evald}, "train.early_stopping.metric": "eval_zz_loss",
        "train.max_time": "1:xx", "train.max_epochs": -1})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    for text in ("data.eval.a/b: a set name is letters, digits",
                 "data.eval.x: is the start of another set's name",
                 "train.early_stopping.metric: 'eval_zz_loss' is not a metric of data.eval's set(s)",
                 "train.max_time: expected seconds or \"HH:MM:SS\", got '1:xx'",
                 "train.max_epochs: must be >= 0.0, got -1.0"):
        assert text in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "data.eval": {"held": evald, "gone": str(tmp_path / "nothing")}, "train.max_time": -3})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert f"data.eval.gone: directory not found: {tmp_path / 'nothing'}" in p.stderr, p.stderr
    assert "train.max_time: must be a time > 0, got -3" in p.stderr, p.stderr
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "data.eval": {"held": evald, "big": evald}, "train.micro_batch_size": 10_000})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert "data.eval.held: " in p.stderr and "data.eval.big: " in p.stderr, p.stderr
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "data.eval": {"held": evald}, "checkpoint.keep_best": 1, "checkpoint.best_metric": "eval_held_f1"})
    p = mpirun(2, "--config", cfg, check=2)
    assert "checkpoint.best_metric: 'eval_held_f1': the evaluations log no 'f1' (they log eval_held_loss, " \
           "eval_held_perplexity, eval_held_accuracy" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "run" / "graphs")


def test_max_epochs_resolves_the_steps_and_the_schedule_on_two_ranks(tmp_path, byte_dataset):
    """train.max_epochs 1.5 on 2 ranks: ceil(1.5 x train samples / global batch) steps, the linear
    schedule reaching min_lr exactly at that step (it spans the resolved steps), the header says so."""
    gb = 8 * 2 * 2           # micro-batch 8 x accum 2 x 2 ranks
    small = os.path.join(byte_dataset, "eval")       # the small set trains here: a few epochs stay fast
    samples = open_dataset(small, 32).num_samples
    steps = math.ceil(1.5 * samples / gb)
    assert 3 <= steps < 120, steps
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "data.train": small, "train.micro_batch_size": 8,
        "train.max_steps": None, "train.max_epochs": 1.5, "train.gradient_accumulation_steps": 2,
        "train.log_every": 1, "data.eval": None, "optimizer.lr": 1e-3,
        "lr_schedule": {"name": "linear", "warmup_steps": 0, "min_lr": 1e-5}})
    proc = mpirun(2, "--config", cfg, timeout=600)
    assert f"train.max_epochs 1.5: {steps} steps" in proc.stdout, proc.stdout
    rows = {r["step"]: r for r in _rows(tmp_path / "run")}
    assert max(rows) == steps
    assert rows[steps]["lr"] == pytest.approx(1e-5, rel=1e-9) and rows[steps - 1]["lr"] > 1e-5
    assert rows[1]["lr"] == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 - 1 / steps), rel=1e-9)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == steps and summary["samples"] >= 1.5 * samples
    # max_steps given too: it wins (as HF Trainer's max_steps over num_train_epochs)
    both = write_config(tmp_path / "both.yaml", byte_dataset, **{
        "run.output_dir": str(tmp_path / "both"), "train.max_steps": 2, "train.max_epochs": 1.5,
        "data.eval": None})
    mpirun(2, "--config", both)
    assert max(r["step"] for r in _rows(tmp_path / "both")) == 2


def _under_max_time(tmp_path, cfg, wait_step: int, check: int):
    """Train ``cfg`` on 2 ranks under train.max_time, every rank waiting at the start of step ``wait_step``
    until the limit passes (TRAINRUN_FAULT_WAIT_SIGNAL), the graphs prepared beforehand. The limit counts
    from the start of set-up: where set-up outlasts it (a loaded machine), the run stops before its first
    step, as it should (checked), and it is tried again with a longer one. (process, limit, wall seconds)."""
    run([TRAINRUN, "prepare", "--config", cfg], check=0)
    env = dict(os.environ, TRAINRUN_FAULT_WAIT_SIGNAL=str(wait_step))
    for limit in (4, 16, 48):
        t0 = time.monotonic()
        proc = mpirun(2, "--config", cfg, "--set", f"train.max_time={limit}", env=env, check=None, timeout=300)
        wall = time.monotonic() - t0
        assert wall >= limit, wall                      # the limit counts from after the command's start
        if "during set-up" not in proc.stderr:
            assert proc.returncode == check, (proc.returncode, proc.stderr)
            return proc, limit, wall
        assert proc.returncode == STOPPED_EXIT and f"stopped by train.max_time (0:00:{limit:02d}) during " \
            f"set-up, before step 1: nothing was trained" in proc.stderr, proc.stderr
        assert not rundir.complete_checkpoints(str(tmp_path / "run" / "checkpoints"))
    raise AssertionError("set-up outlasted a 48 s train.max_time")


def test_max_time_stops_every_rank_with_a_checkpoint_and_resumes(tmp_path, byte_dataset):
    """train.max_time on 2 ranks that hold step 3 until it passes: they stop after step 3, no earlier, no
    later, with a committed checkpoint, exit 75 (stopped, resumable) naming the limit and the resume
    command; the resume (a longer limit: safe to change) trains on from that step to train.stop_at and
    exits 0."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 100000, "train.log_every": 10, "data.eval": None})
    proc, limit, wall = _under_max_time(tmp_path, cfg, 3, STOPPED_EXIT)
    ckpt = rundir.resolve_checkpoint(str(tmp_path / "run"))
    K.verify(ckpt)
    assert K.read_state(ckpt)["step"] == 3
    assert max(r["step"] for r in _rows(tmp_path / "run")) == 3      # the stop step is logged
    said = re.search(rf"stopped by train.max_time \(0:00:{limit:02d}\) after step 3; checkpoint {ckpt} "
                     rf"committed ([0-9.]+) s after the limit", proc.stderr)
    assert said and float(said.group(1)) <= wall - limit, proc.stderr
    assert f"trainrun resume {tmp_path / 'run'}" in proc.stderr
    assert proc.stderr.count("stopped by") == 1 and "Traceback" not in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == 3 and summary["stopped"] == f"train.max_time (0:00:{limit:02d})"
    mpirun(2, "resume", str(tmp_path / "run"), "--set", "train.max_time=600", "--set", "train.stop_at=6")
    assert K.read_state(rundir.resolve_checkpoint(str(tmp_path / "run")))["step"] == 6
    assert sorted(r["step"] for r in _rows(tmp_path / "run"))[-1] == 6


def test_max_time_passing_during_the_last_step_finishes_the_run(tmp_path, byte_dataset):
    """train.max_time that passes while the last step waits for it: the run is finished all the same
    (final evaluation, checkpoint, model.onnx, summary.json), exit 0."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "train.eval_every": 3, "checkpoint.every": 3})
    proc, limit, _ = _under_max_time(tmp_path, cfg, 6, 0)
    run_dir = tmp_path / "run"
    assert f"train.max_time (0:00:{limit:02d}) came during the last step, 6: finishing the run" in proc.stdout, \
        proc.stdout
    assert "stopped by" not in proc.stderr
    evals = [r["step"] for r in _rows(run_dir) if "eval_loss" in r]
    assert evals == [3, 6] and K.read_state(str(run_dir / "checkpoints" / "6"))["eval"] is not None
    assert f"exported {run_dir / 'model.onnx'} from {run_dir / 'checkpoints' / '6'}" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 6 and summary["stopped"] is None
