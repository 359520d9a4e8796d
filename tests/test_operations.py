"""Operations: stopping on a signal with a checkpoint, one job per run directory, best checkpoints,
early stopping, a stuck checkpoint write. Real `mpirun` jobs, real signals, real files."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import MPIRUN, ROOT, TRAINRUN, mpirun, rank_pids, read_metrics, run, write_config
from trainrun import checkpoint as K
from trainrun.run import rundir
from trainrun.run.stopping import STOPPED_EXIT, EarlyStopping


def _start(cmd, tmp_path, name="job"):
    out = open(tmp_path / f"{name}.out", "w")
    err = open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen(cmd, stdout=out, stderr=err, text=True)


def _wait_for_steps(run_dir, n, proc, timeout=120):
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended early with {proc.returncode}"
        if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} logged steps not reached in {timeout} s")


def _finish(proc, timeout=120):
    try:
        proc.wait(timeout=timeout)          # a hang raises TimeoutExpired
    finally:
        proc.kill()
    return proc.returncode


def _texts(tmp_path, name="job"):
    return (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()


def _long_config(tmp_path, byte_dataset, **more):
    # a cosine schedule over 100000 steps that the tests stop early: the signal must come mid-run
    return write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 100000, "checkpoint.every": 1000, "run.deterministic": True,
        "model.gpt2.dropout": 0.1, **more})


@pytest.mark.parametrize("sig,target", [("SIGTERM", "mpirun"), ("SIGUSR1", "rank 1"), ("SIGINT", "mpirun")])
def test_signal_stops_every_rank_with_a_committed_checkpoint(tmp_path, byte_dataset, sig, target):
    """A stop signal, to mpirun (which forwards it to every rank) or to one rank alone: every rank
    stops after the same step, that step's checkpoint is committed, the job exits 75 and says how
    long the save took after the signal. The stopped session writes its summary.json and ends the
    profiler's window (open from step 3 on) with each rank's trace."""
    cfg = _long_config(tmp_path, byte_dataset, **{"profile.start_step": 3, "profile.steps": 1000})
    proc = _start([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], tmp_path)
    _wait_for_steps(tmp_path / "run", 5, proc)
    victim = proc.pid if target == "mpirun" else rank_pids(str(tmp_path))[1]
    os.kill(victim, getattr(signal, sig))
    assert _finish(proc) == STOPPED_EXIT, _texts(tmp_path)
    out, err = _texts(tmp_path)
    train, _ = read_metrics(str(tmp_path / "run"))
    last = max(train)
    assert 5 <= last < 100000
    ckpt = rundir.resolve_checkpoint(str(tmp_path / "run"))
    assert ckpt == str(tmp_path / "run" / "checkpoints" / str(last))
    K.verify(ckpt)
    named = sig if target == "mpirun" else "a signal to another rank"    # rank 0 did not receive it
    assert f"stopped by {named} after step {last}" in err, err
    assert ("s after the signal" in err) == (target == "mpirun")
    assert err.count("stopped by") == 1 and "Traceback" not in err      # rank 0 alone reports
    assert not os.path.exists(tmp_path / "run" / ".lock")               # released on the way out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == summary["final_step"] == last and summary["final_loss"] == train[last]["loss"]
    assert summary["stopped"] == (sig if target == "mpirun" else "a signal to another rank")
    for r in (0, 1):
        trace = json.load(open(tmp_path / "run" / "profile" / f"rank-{r}.json"))
        assert trace["trainrun"]["steps"] == list(range(3, last + 1))


def test_stopped_run_resumes_bitwise_with_dropout(tmp_path, byte_dataset):
    """SIGTERM mid-run (dropout 0.1, deterministic), resume to step K: parameters, optimizer moments
    and every loss equal the straight run's to the bit."""
    cfg = _long_config(tmp_path, byte_dataset)
    proc = _start([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], tmp_path)
    _wait_for_steps(tmp_path / "run", 5, proc)
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == STOPPED_EXIT, _texts(tmp_path)
    stopped = max(read_metrics(str(tmp_path / "run"))[0])
    end = stopped + 7
    mpirun(2, "resume", str(tmp_path / "run"), "--set", f"train.stop_at={end}")

    straight = tmp_path / "straight"
    straight.mkdir()
    cfg2 = _long_config(straight, byte_dataset, **{"train.stop_at": end})
    mpirun(2, "--config", cfg2)
    a, b = (str(d / "run" / "checkpoints" / str(end)) for d in (tmp_path, straight))
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
        assert ta.keys() == tb.keys()
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), (name, k)
    resumed, direct = read_metrics(str(tmp_path / "run"))[0], read_metrics(str(straight / "run"))[0]
    assert [resumed[s]["loss"] for s in range(stopped + 1, end + 1)] == \
        [direct[s]["loss"] for s in range(stopped + 1, end + 1)]


def test_one_job_per_run_directory(tmp_path, byte_dataset):
    """A second job on a run directory in use exits 2 naming the holder; a lock left by a dead job is
    taken over with a warning."""
    cfg = _long_config(tmp_path, byte_dataset)
    first = _start([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], tmp_path)
    _wait_for_steps(tmp_path / "run", 3, first)
    holder = json.loads((tmp_path / "run" / ".lock").read_text())
    second = run([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], check=2, timeout=120)
    assert "is in use by another trainrun job" in second.stderr, second.stderr
    assert f"pid {holder['pid']}" in second.stderr and holder["host"] in second.stderr
    assert first.poll() is None                  # the first job runs on, untouched
    assert json.loads((tmp_path / "run" / ".lock").read_text()) == holder
    os.kill(rank_pids(str(tmp_path))[0], signal.SIGKILL)      # rank 0 dies without releasing
    _finish(first)
    assert os.path.exists(tmp_path / "run" / ".lock")
    proc = run([TRAINRUN, "--config", cfg, "--set", "train.max_steps=3"], check=0, timeout=300)
    assert "taking over the run directory's lock from a job that is gone" in proc.stdout
    assert f"pid {holder['pid']}" in proc.stdout
    assert not os.path.exists(tmp_path / "run" / ".lock")


def test_keep_best_and_export_best(tmp_path, byte_dataset):
    """keep_best keeps the checkpoints of lowest eval loss besides the newest keep_last; state.json
    records each one's eval loss; export --best takes the best."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 16, "train.eval_every": 0, "checkpoint.every": 2, "checkpoint.keep_last": 1,
        "checkpoint.keep_best": 2, "optimizer.lr": 0.05, "lr_schedule": {"name": "constant"}})
    mpirun(2, "--config", cfg)
    _, evals = read_metrics(str(tmp_path / "run"))
    assert sorted(evals) == list(range(2, 17, 2))     # keep_best: every checkpoint step evaluates
    best = sorted(evals, key=lambda s: (evals[s]["eval_loss"], -s))[:2]
    kept = sorted(int(os.path.basename(c)) for c in rundir.complete_checkpoints(str(tmp_path / "run" / "checkpoints")))
    assert kept == sorted({16, *best}), (kept, best)
    for s in kept:
        state = K.read_state(str(tmp_path / "run" / "checkpoints" / str(s)))
        assert state["eval_loss"] == pytest.approx(evals[s]["eval_loss"], rel=1e-12)
    run([TRAINRUN, "export", str(tmp_path / "run"), "--best", "--output", str(tmp_path / "best.onnx")], check=0)
    run([TRAINRUN, "export", str(tmp_path / "run" / "checkpoints" / str(best[0])),
         "--output", str(tmp_path / "direct.onnx")], check=0)
    assert (tmp_path / "best.onnx").read_bytes() == (tmp_path / "direct.onnx").read_bytes()


def _record_eval(ckpt, evaluated: dict, best: str):
    """Make a committed checkpoint's state.json record ``evaluated`` as the runner records an evaluation
    ranked by ``best`` (greater is better for an accuracy), and commit it again (checksums.json, COMMITTED)."""
    import hashlib
    state = json.loads((ckpt / "state.json").read_text())
    state.update(eval=evaluated, eval_loss=evaluated.get("eval_loss"),
                 best_metric={"name": best, "value": evaluated[best], "greater_is_better": best.endswith("accuracy")})
    (ckpt / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    sums = json.loads((ckpt / "checksums.json").read_text())
    sums["state.json"] = hashlib.sha256((ckpt / "state.json").read_bytes()).hexdigest()
    (ckpt / "checksums.json").write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")
    (ckpt / "COMMITTED").write_text(hashlib.sha256((ckpt / "checksums.json").read_bytes()).hexdigest() + "\n")


def test_keep_best_ranks_one_metric_with_non_finite_values_last(tmp_path, byte_dataset):
    """keep_best and export --best rank the checkpoints that recorded the metric checkpoint.best_metric
    names, by that name: a NaN value after every finite one (either direction), and a checkpoint of a
    session that ranked by another metric by the value of this one it recorded too."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 4, "checkpoint.every": 1, "checkpoint.keep_last": 10})
    mpirun(1, "--config", cfg)
    root = tmp_path / "run" / "checkpoints"
    nan = float("nan")
    _record_eval(root / "1", {"eval_loss": nan, "eval_accuracy": nan}, "eval_loss")
    _record_eval(root / "2", {"eval_loss": 0.5, "eval_accuracy": 0.3}, "eval_loss")
    _record_eval(root / "3", {"eval_loss": 0.25, "eval_accuracy": 0.2}, "eval_loss")
    _record_eval(root / "4", {"eval_loss": 0.4, "eval_accuracy": 0.1}, "eval_accuracy")  # ranked by accuracy
    order = lambda metric, greater: [int(os.path.basename(c)) for c, _ in   # noqa: E731
                                     rundir.best_checkpoints(str(root), metric, greater)]
    assert order("eval_loss", False) == [3, 4, 2, 1]
    assert order("eval_accuracy", True) == [2, 3, 4, 1]
    assert order("eval_perplexity", False) == []        # recorded by none
    proc = run([TRAINRUN, "export", str(tmp_path / "run"), "--best", "--output", str(tmp_path / "best.onnx")],
               check=0)
    assert f"from {root / '3'}:" in proc.stdout, proc.stdout
    # ranked by eval_loss from now on (allowed on resume): step 5 evaluates (keep_best), its real loss is far
    # above 0.25; keep_last 1 + keep_best 1 keep step 5 and the lowest eval_loss, step 3
    mpirun(1, "resume", str(tmp_path / "run"), "--set", "train.max_steps=5", "--set", "checkpoint.keep_last=1",
           "--set", "checkpoint.keep_best=1", "--set", "checkpoint.best_metric=eval_loss")
    assert sorted(os.listdir(root)) == ["3", "5"]
    _record_eval(root / "3", {"eval_loss": nan}, "eval_loss")
    proc = run([TRAINRUN, "export", str(tmp_path / "run"), "--best", "--output", str(tmp_path / "best.onnx")],
               check=0)
    assert f"from {root / '5'}:" in proc.stdout, proc.stdout       # 3's is NaN now: the finite one
    _record_eval(root / "5", {"eval_loss": float("inf")}, "eval_loss")
    proc = run([TRAINRUN, "export", str(tmp_path / "run"), "--best", "--output", str(tmp_path / "best.onnx")],
               check=2)
    assert "no checkpoint recorded a finite eval_loss" in proc.stderr and "Traceback" not in proc.stderr


def test_early_stopping_stops_with_a_checkpoint_and_resumes_its_state(tmp_path, byte_dataset):
    """patience 2 with a min_delta no eval can beat: evaluations of eval_every at 3, 6, 9 -> stop at 9
    with a checkpoint and exit 0; the counter is in state.json. keep_best evaluates at every checkpoint
    (2, 4, 6, 8) too: those rank checkpoints and do not count toward the patience."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 40, "train.eval_every": 3, "checkpoint.every": 2, "checkpoint.keep_best": 1,
        "train.early_stopping": {"patience": 2, "min_delta": 100.0}})
    proc = mpirun(2, "--config", cfg)
    _, evals = read_metrics(str(tmp_path / "run"))
    assert sorted(evals) == [2, 3, 4, 6, 8, 9]
    assert "early stopping at step 9" in proc.stdout
    state = K.read_state(rundir.resolve_checkpoint(str(tmp_path / "run")))
    assert state["step"] == 9 and state["early_stopping"]["evals_since_best"] == 2
    assert state["early_stopping"]["best_step"] == 3
    assert os.path.exists(tmp_path / "run" / "model.onnx")
    # resumed with more patience, the saved count goes on: one more evaluation without improvement (12; the
    # keep_best one at 10 does not count)
    proc = mpirun(2, "resume", str(tmp_path / "run"), "--set", "train.early_stopping.patience=3")
    _, evals = read_metrics(str(tmp_path / "run"))
    assert max(evals) == 12 and 10 in evals
    assert "early stopping at step 12" in proc.stdout, proc.stdout


def test_early_stopping_counts_evaluations_that_do_not_beat_the_best_by_min_delta():
    """EarlyStopping alone: lower is better for a loss, higher for an accuracy; an improvement must beat the
    best by more than min_delta (equal to it is none) and resets the count; patience 0 never stops; its
    state goes through state_dict/load_state_dict, and a state of another metric starts afresh."""
    loss = EarlyStopping(patience=2, min_delta=0.1, metric="eval_loss")
    steps = [(1, 5.0, False), (2, 4.0, False), (3, 3.95, False), (4, 3.9, True)]    # 3.9: beats 4.0 by 0.1 only
    for step, value, stop in steps:
        assert loss.update(step, {"eval_loss": value}) is stop, step
    assert (loss.best, loss.best_step, loss.evals_since_best) == (4.0, 2, 2)
    assert loss.update(5, {"eval_loss": 3.5}) is False and (loss.best, loss.evals_since_best) == (3.5, 0)
    assert "eval_loss did not improve by more than 0.1" in (loss.update(6, {"eval_loss": 9.0}) or loss.describe())

    acc = EarlyStopping(patience=2, min_delta=0.0, metric="eval_held_accuracy")     # greater is better
    for step, value, stop in [(1, 0.2, False), (2, 0.1, False), (3, 0.3, False), (4, 0.3, False), (5, 0.25, True)]:
        assert acc.update(step, {"eval_held_accuracy": value, "eval_held_loss": 0.0}) is stop, step
    assert (acc.best, acc.best_step) == (0.3, 3)

    never = EarlyStopping(patience=0, min_delta=0.0)
    assert not any(never.update(s, {"eval_loss": 1.0}) for s in range(1, 20))

    again = EarlyStopping(patience=2, min_delta=0.1, metric="eval_loss")
    again.load_state_dict(loss.state_dict())
    assert again.state_dict() == loss.state_dict()
    assert again.update(7, {"eval_loss": 3.45}) is True        # the second in a row (one before the save)
    other = EarlyStopping(patience=2, min_delta=0.0, metric="eval_accuracy")
    other.load_state_dict(loss.state_dict())
    assert other.best is None and other.evals_since_best == 0


def test_stuck_checkpoint_write_ends_the_job_within_the_timeout(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 4, "distributed.timeout_s": 5})
    env = dict(os.environ, TRAINRUN_FAULT_STALL_CHECKPOINT="4")      # the final checkpoint's write hangs
    proc = mpirun(2, "--config", cfg, env=env, check=1, timeout=120)
    assert "the checkpoint write of step 4" in proc.stderr and "did not finish within 5 s" in proc.stderr, \
        proc.stderr
    assert rundir.complete_checkpoints(str(tmp_path / "run" / "checkpoints")) == []


def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path, byte_dataset):
    """Rank 1 alone gets a NaN in its gradient at step 3: every rank skips step 3, the run goes on, and
    at the end both replicas hold the same parameters (each rank's digest in its rank-<r>.json)."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 6})
    proc = mpirun(2, "--config", cfg, env=dict(os.environ, TRAINRUN_FAULT_NAN_GRAD="1:3"))
    assert "step 3: non-finite gradients on some rank, update skipped" in proc.stdout
    train, _ = read_metrics(str(tmp_path / "run"))
    assert [train[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    ckpt = str(tmp_path / "run" / "checkpoints" / "6")
    digests = {json.load(open(os.path.join(ckpt, f"rank-{r}.json")))["params_sha256"] for r in (0, 1)}
    assert len(digests) == 1
    assert K.read_state(ckpt)["updates"] == 5


def test_a_rank_stuck_in_a_step_ends_the_job_within_the_timeout(tmp_path, byte_dataset):
    """Rank 1 hangs at the start of step 3 (as in a stuck data read): rank 0 waits in the step's
    allreduce, gives up after distributed.timeout_s and ends the job (the run's exit status is not 0)."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 6, "distributed.timeout_s": 5})
    proc = mpirun(2, "--config", cfg, env=dict(os.environ, TRAINRUN_FAULT_STALL_STEP="1:3"), check=None,
                  timeout=120)
    assert proc.returncode != 0
    assert "timed out on rank 0 of 2" in proc.stderr and "timeout_s=5" in proc.stderr, proc.stderr
    assert max(read_metrics(str(tmp_path / "run"))[0]) == 2


def test_second_ctrl_c_while_the_tensors_are_written_exits_130(tmp_path, byte_dataset):
    """Both Ctrl-Cs come while rank 0 writes step 6's tensors in the training thread (held there by fault
    injection): the first asks for a stop, the second interrupts that save at once: exit 130 and
    "interrupted", not exit 1 with "checkpoint at step 6 failed (rank 0: KeyboardInterrupt: )"; nothing of
    step 6's checkpoint is left."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 100000, "checkpoint.every": 6})
    ckpts = tmp_path / "run" / "checkpoints"
    proc = subprocess.Popen([TRAINRUN, "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TRAINRUN_FAULT_STALL_TENSORS="6"))
    try:
        deadline = time.monotonic() + 120
        while not (ckpts / f"{K.STAGING}6" / "model.safetensors").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "step 6's save not reached"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None                  # the first one only asked for a stop
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "trainrun: interrupted" in err and "KeyboardInterrupt" not in err and "Traceback" not in err, err
    assert os.listdir(ckpts) == []


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
@pytest.mark.parametrize("paused", [False, True], ids=["as-written", "srun-reaped-first"])
def test_the_documented_slurm_script_requeues_after_the_warning_or_sigterm(tmp_path, sig, paused):
    """docs/distributed.md's batch script, run by a real bash: srun replaced by a stand-in that stops with
    75 on USR1 or TERM, scontrol by one that records its arguments. SLURM's --signal=B:USR1 warning and
    its SIGTERM at the time limit (to the batch shell) both end in 75 and a requeue of the job.
    srun-reaped-first pauses after each `wait` so srun has ended (and bash has reaped it) before the
    script looks again: the race in which an earlier version of the script exited 138 (128 + USR1, the
    interrupted `wait`'s status) instead of srun's 75."""
    text = open(os.path.join(ROOT, "docs", "distributed.md")).read()
    script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH .*?)```", text, re.S).group(1)
    assert "srun --mpi=pmi2 .venv/bin/trainrun" in script and "scontrol requeue" in script
    if paused:
        assert script.count("do wait $PID;") == 1
        script = script.replace("do wait $PID;", "do wait $PID; sleep 1;")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
        open("{tmp_path / 'started'}", "w").close()
        time.sleep(120)
        sys.exit(0)
        """))
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol'}\n")
    for tool in ("srun", "scontrol"):
        os.chmod(bin_dir / tool, 0o755)
    (tmp_path / "job.sh").write_text(script)
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=dict(
        os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42"))
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the srun stand-in did not start"
        time.sleep(0.05)
    # the trap is set before the launcher starts: a signal from here on is forwarded
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    assert proc.wait(timeout=30) == 75
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "42"]


@pytest.mark.parametrize("resumed", [False, True], ids=["first-start", "resume"])
def test_a_signal_during_set_up_stops_before_the_first_step(tmp_path, byte_dataset, resumed):
    """SIGTERM to mpirun while the ranks are still setting up (TRAINRUN_FAULT_WAIT_SIGNAL=0 holds them there
    until it comes): exit 75 before any step, no checkpoint written or removed, the lock released; the same
    command (or `resume`) then trains on from where the run was."""
    cfg = _long_config(tmp_path, byte_dataset, **{"train.max_steps": 6, "checkpoint.every": 3})
    run_dir = tmp_path / "run"
    if resumed:
        subprocess.run([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg, "--set", "train.stop_at=3"],
                       capture_output=True, timeout=300, check=True)
    cmd = [TRAINRUN, "resume", str(run_dir)] if resumed else [TRAINRUN, "--config", cfg]
    env = dict(os.environ, TRAINRUN_FAULT_WAIT_SIGNAL="0")
    with open(tmp_path / "job.out", "w") as out, open(tmp_path / "job.err", "w") as err:
        proc = subprocess.Popen([MPIRUN, "-np", "2", *cmd], stdout=out, stderr=err, env=env)
    deadline = time.monotonic() + 120       # the job holds the run's lock: set-up has begun
    while not os.path.exists(run_dir / ".lock") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.5)     # past the handlers' installation, at the start of set-up
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == STOPPED_EXIT, _texts(tmp_path)
    out, err = _texts(tmp_path)
    assert "during set-up, before step " + ("4" if resumed else "1") in err, err
    assert ("stands" in err) == resumed and "Traceback" not in err
    done = sorted(os.listdir(run_dir / "checkpoints")) if (run_dir / "checkpoints").exists() else []
    assert done == (["3"] if resumed else [])
    assert not os.path.exists(run_dir / ".lock")
    subprocess.run([MPIRUN, "-np", "2", *cmd], capture_output=True, timeout=300, check=True)
    assert max(read_metrics(str(run_dir))[0]) == 6


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (SigCgt of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as fh:
        mask = next(line.split()[1] for line in fh if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


@pytest.mark.parametrize("sig,ranks", [("SIGTERM", 1), ("SIGINT", 1), ("SIGTERM", 2)])
def test_a_signal_during_start_up_says_so_and_exits_75(tmp_path, byte_dataset, sig, ranks):
    """A stop signal in the command's first moments (to `trainrun train`, or to `mpirun -np 2 trainrun train`,
    which forwards it), sent as soon as every trainrun process catches SIGTERM: that is before onnxruntime or
    numpy is loaded into it (its /proc maps), and the job exits 75, "stopped, resumable", with one line saying
    what happened and nothing written, not the launcher's bare 15 (or 130) and silence."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset)
    cmd = [TRAINRUN, "train", "--config", cfg]
    with open(tmp_path / "job.out", "w") as out, open(tmp_path / "job.err", "w") as err:
        proc = subprocess.Popen(cmd if ranks == 1 else [MPIRUN, "-np", "2", *cmd], stdout=out, stderr=err)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, _texts(tmp_path)
        pids = [proc.pid] if ranks == 1 else list(rank_pids(cfg).values())
        try:
            if len(pids) == ranks and all(_catches(p, signal.SIGTERM) for p in pids):
                loaded = [open(f"/proc/{p}/maps").read() for p in pids]
                break
        except (OSError, StopIteration):      # a rank not started yet, or between exec and its /proc entry
            pass
        time.sleep(0.002)
    proc.send_signal(getattr(signal, sig))
    assert _finish(proc) == STOPPED_EXIT, _texts(tmp_path)
    heavy = [[lib for lib in ("onnxruntime", "numpy") if lib in m] for m in loaded]
    assert heavy == [[]] * ranks, heavy        # caught before the heavy imports
    out, err = _texts(tmp_path)
    assert err == (f"trainrun: stopped by {sig} during start-up, before any step: nothing was written; run the "
                   f"same command again\n"), err
    assert out == "" and not (tmp_path / "run").exists()


def _end_config(tmp_path, byte_dataset, **more):
    # 6 steps: evaluations at 3 and 6, checkpoints at 3 and 6; the last step's are the final ones
    return write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "train.eval_every": 3, "checkpoint.every": 3, **more})


def _finished_at_6(run_dir, out):
    """A run finished at step 6: final evaluation logged and in checkpoint 6, model.onnx of checkpoint 6,
    summary.json of its 6 steps."""
    _, evals = read_metrics(str(run_dir))
    assert sorted(evals) == [3, 6]
    ckpt = str(run_dir / "checkpoints" / "6")
    K.verify(ckpt)
    assert K.read_state(ckpt)["eval"]["eval_loss"] == pytest.approx(evals[6]["eval_loss"], rel=1e-12)
    assert f"exported {run_dir / 'model.onnx'} from {ckpt}" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_step"] == 6 and summary["stopped"] is None
    assert summary["final_eval_loss"] == pytest.approx(evals[6]["eval_loss"], rel=1e-12)


@pytest.mark.parametrize("how", ["SIGTERM", "slurm-script"])
def test_a_stop_on_the_last_step_finishes_the_run(tmp_path, byte_dataset, how):
    """The ranks wait at the start of the last step until the signal comes (TRAINRUN_FAULT_WAIT_SIGNAL=6), so
    it lands on that step: SIGTERM to mpirun, or SLURM's warning (USR1) to docs/distributed.md's batch script
    (run by a real bash, its srun replaced by `mpirun -np 2`), whose trap forwards it. The run is finished
    all the same: final evaluation, checkpoint, model.onnx, exit 0 (so the script does not requeue)."""
    cfg = _end_config(tmp_path, byte_dataset)
    env = dict(os.environ, TRAINRUN_FAULT_WAIT_SIGNAL="6")
    if how == "SIGTERM":
        proc = subprocess.Popen([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], env=env,
                                stdout=open(tmp_path / "job.out", "w"), stderr=open(tmp_path / "job.err", "w"))
        sig = signal.SIGTERM
    else:
        text = open(os.path.join(ROOT, "docs", "distributed.md")).read()
        script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH .*?)```", text, re.S).group(1)
        for old, new in (("RUN=runs/gpt2", f"RUN={tmp_path / 'run'}"), ("--config gpt2.yaml", f"--config {cfg}"),
                         ("srun --mpi=pmi2 .venv/bin/trainrun", f"{MPIRUN} -np 2 {TRAINRUN}")):
            assert script.count(old) == 1, old
            script = script.replace(old, new)
        (tmp_path / "job.sh").write_text(script)
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol'}\n")
        os.chmod(bin_dir / "scontrol", 0o755)
        proc = subprocess.Popen(["bash", str(tmp_path / "job.sh")], cwd=tmp_path,
                                env=dict(env, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42"),
                                stdout=open(tmp_path / "job.out", "w"), stderr=open(tmp_path / "job.err", "w"))
        sig = signal.SIGUSR1
    train = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (train.exists() and '"step": 5,' in train.read_text()):    # step 5 done: step 6 waits
        assert proc.poll() is None and time.monotonic() < deadline, _texts(tmp_path)
        time.sleep(0.05)
    proc.send_signal(sig)
    assert _finish(proc) == 0, _texts(tmp_path)
    out, err = _texts(tmp_path)
    assert f"{sig.name} came during the last step, 6: finishing the run" in out, out
    assert "stopped by" not in err and "Traceback" not in err, err
    _finished_at_6(tmp_path / "run", out)
    assert not (tmp_path / "scontrol").exists()         # finished: not requeued


@pytest.mark.parametrize("phase", ["commit", "export"])
def test_a_stop_in_the_end_phase_leaves_a_run_that_resume_finishes(tmp_path, byte_dataset, phase):
    """A stop after the last step's allreduce: commit: SIGUSR1 to rank 1 alone while it holds step 6's
    checkpoint uncommitted (TRAINRUN_FAULT_WAIT_SIGNAL=1:commit); export: SIGTERM to mpirun while rank 0 has
    model.onnx half-written (TRAINRUN_FAULT_WAIT_SIGNAL=export). The checkpoint is committed either way, the
    export not started or abandoned (nothing half-written left), the job exits 75 saying which, with a
    summary.json; the older model.onnx (of step 3) is left. `trainrun resume` then trains nothing, exports
    model.onnx of checkpoint 6 (the same bytes as `trainrun export`) and leaves summary.json as it was."""
    cfg = _end_config(tmp_path, byte_dataset)
    run_dir = tmp_path / "run"
    mpirun(2, "--config", cfg, "--set", "train.stop_at=3")
    first_model = (run_dir / "model.onnx").read_bytes()
    spec = "1:commit" if phase == "commit" else "export"
    proc = subprocess.Popen([MPIRUN, "-np", "2", TRAINRUN, "resume", str(run_dir)],
                            env=dict(os.environ, TRAINRUN_FAULT_WAIT_SIGNAL=spec),
                            stdout=open(tmp_path / "job.out", "w"), stderr=open(tmp_path / "job.err", "w"))
    waiting = run_dir / ("checkpoints/.staging-6" if phase == "commit" else "model.onnx.tmp")
    deadline = time.monotonic() + 120
    while not waiting.exists():
        assert proc.poll() is None and time.monotonic() < deadline, _texts(tmp_path)
        time.sleep(0.05)
    time.sleep(0.5)
    if phase == "commit":
        os.kill(rank_pids(str(run_dir))[1], signal.SIGUSR1)
    else:
        proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == STOPPED_EXIT, _texts(tmp_path)
    out, err = _texts(tmp_path)
    ckpt = run_dir / "checkpoints" / "6"
    K.verify(str(ckpt))
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["3", "6"]        # nothing staged left behind
    if phase == "commit":
        assert f"stopped by a signal to another rank after the last step, 6: checkpoint {ckpt} committed " \
               f"(its write finished), model.onnx not exported" in err, err
    else:
        assert f"stopped by SIGTERM during the export of {run_dir / 'model.onnx'}: export abandoned, " \
               f"checkpoint {ckpt} committed" in err, err
    assert f"`trainrun resume {run_dir}` exports it" in err and err.count("stopped by") == 1, err
    assert "Traceback" not in err
    assert not (run_dir / "model.onnx.tmp").exists()
    assert (run_dir / "model.onnx").read_bytes() == first_model       # step 3's, older than checkpoint 6
    summary = (run_dir / "summary.json").read_text()
    stopped = json.loads(summary)
    assert stopped["steps"] == 3 and stopped["final_step"] == 6
    assert stopped["stopped"] == ("a signal to another rank" if phase == "commit" else "SIGTERM")
    assert not os.path.exists(run_dir / ".lock")

    proc = mpirun(2, "resume", str(run_dir))
    assert f"nothing to train: the run is at step 6, it ends at step 6 (train.max_steps 6); " \
           f"{run_dir / 'model.onnx'} is older than checkpoint {ckpt}: exporting it" in proc.stdout, proc.stdout
    _, evals = read_metrics(str(run_dir))
    assert sorted(evals) == [3, 6] and K.read_state(str(ckpt))["eval"] is not None
    run([TRAINRUN, "export", str(ckpt), "--output", str(tmp_path / "direct.onnx")], check=0)
    assert (run_dir / "model.onnx").read_bytes() == (tmp_path / "direct.onnx").read_bytes()
    assert (run_dir / "summary.json").read_text() == summary
