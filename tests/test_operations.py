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
from trainrun import rundir
from trainrun.stopping import STOPPED_EXIT


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
    long the save took after the signal."""
    cfg = _long_config(tmp_path, byte_dataset)
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


def test_early_stopping_stops_with_a_checkpoint_and_resumes_its_state(tmp_path, byte_dataset):
    """patience 2 with a min_delta no eval can beat: evaluations at 3, 6, 9 -> stop at 9 with a
    checkpoint and exit 0; the counter is in state.json."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 40, "train.eval_every": 3,
        "train.early_stopping": {"patience": 2, "min_delta": 100.0}})
    proc = mpirun(2, "--config", cfg)
    _, evals = read_metrics(str(tmp_path / "run"))
    assert sorted(evals) == [3, 6, 9]
    assert "early stopping at step 9" in proc.stdout
    state = K.read_state(rundir.resolve_checkpoint(str(tmp_path / "run")))
    assert state["step"] == 9 and state["early_stopping"]["evals_since_best"] == 2
    assert state["early_stopping"]["best_step"] == 3
    assert os.path.exists(tmp_path / "run" / "model.onnx")
    # resumed with more patience, the saved count goes on: one more evaluation without improvement
    mpirun(2, "resume", str(tmp_path / "run"), "--set", "train.early_stopping.patience=3")
    _, evals = read_metrics(str(tmp_path / "run"))
    assert max(evals) == 12


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
