"""distributed.elastic: a rank killed mid-run (SIGKILL: no MPI_Finalize, no clean-up) and the others training on,
on Open MPI's ULFM fault tolerance (`mpirun --with-ft ulfm`), real processes and files; and `trainrun doctor`
saying whether the installed MPI can survive a lost rank.

Open MPI lives in its own venv (`make setup-elastic`: .venv-elastic beside .venv, or TRAINRUN_ELASTIC_VENV): the
tests that need it skip, saying so, where it is missing, and fail instead under TRAINRUN_REQUIRE_FT=1 (`make
test-elastic`)."""

import glob
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import MPIRUN, PROBE, ROOT, TRAINRUN, read_metrics, run, write_config
from test_diloco import _reference_outer

VENV = os.environ.get("TRAINRUN_ELASTIC_VENV") or os.path.join(ROOT, ".venv-elastic")
EBIN = os.path.join(VENV, "bin")
# Open MPI's launcher refuses root unless told; 3 ranks on a 2-core box need --oversubscribe
OMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _ft_missing() -> str | None:
    """Why the Open MPI venv cannot run an elastic job here, or None."""
    for tool in ("mpirun", "ompi_info", "trainrun"):
        if not os.access(os.path.join(EBIN, tool), os.X_OK):
            return f"no Open MPI venv with trainrun at {VENV} (its bin/{tool} is missing): make setup-elastic"
    info = subprocess.run([os.path.join(EBIN, "ompi_info")], capture_output=True, text=True, timeout=60).stdout
    if "FT MPI support: yes" not in info:
        return f"{VENV}'s Open MPI was built without fault tolerance (ompi_info: no 'FT MPI support: yes')"
    return None


@pytest.fixture(scope="module")
def ft():
    missing = _ft_missing()
    if missing:
        if os.environ.get("TRAINRUN_REQUIRE_FT") == "1":
            pytest.fail(f"TRAINRUN_REQUIRE_FT=1: {missing}")
        pytest.skip(missing)
    return EBIN


def ompi_start(n: int, *args, env=None, ft_flag=True, probe=False) -> subprocess.Popen:
    """`mpirun [--with-ft ulfm] -np n trainrun ARGS` of the Open MPI venv (``probe``: through tests/rank_probe.py),
    started in a session of its own (see :func:`ompi`)."""
    cmd = [os.path.join(EBIN, "mpirun"), *(["--with-ft", "ulfm"] if ft_flag else []), "--oversubscribe",
           "-np", str(n), *[a for k, v in (env or {}).items() for a in ("-x", f"{k}={v}")],
           *([os.path.join(EBIN, "python"), PROBE] if probe else [os.path.join(EBIN, "trainrun")]), *args]
    full = dict(os.environ, **OMPI_ENV, **(env or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                            start_new_session=True)


def ompi(n: int, *args, timeout=120, env=None, ft_flag=True, probe=False, proc=None):
    """:func:`ompi_start` (or ``proc``, started so) waited for: on a timeout the whole group is killed (Open MPI's
    launcher can outlive a SIGTERM while an abort is in progress)."""
    proc = proc or ompi_start(n, *args, env=env, ft_flag=ft_flag, probe=probe)
    cmd = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _config(tmp_path, byte_dataset, **over):
    return write_config(tmp_path / "c.yaml", byte_dataset, **{
        "distributed.elastic": True, "train.max_steps": 12, "checkpoint.every": 4, **over})


def _committed(run_dir):
    return sorted(int(os.path.basename(d)) for d in glob.glob(os.path.join(run_dir, "checkpoints", "*"))
                  if os.path.basename(d).isdigit() and os.path.exists(os.path.join(d, "COMMITTED")))


def _lines(run_dir):
    """Every metrics.jsonl line parses (none half-written); the step lines by step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {r["step"]: r for r in rows if "loss" in r}


# ----------------------------------------------------------------------------- doctor and the default MPICH

def test_doctor_says_mpich_cannot_survive_a_lost_rank_and_elastic_training_refuses_it(tmp_path, byte_dataset):
    """The default venv's MPICH: doctor says no, with the reason (SKIP; FAIL with a config that sets
    distributed.elastic), and an elastic run on it stops at start with exit 2 saying what to launch instead."""
    out = run([MPIRUN, "-np", "2", TRAINRUN, "doctor", "--size-mb", "1", "--iters", "1"], check=0).stdout
    line = next(ln for ln in out.splitlines() if ln.split()[1:2] == ["elastic"])
    assert line.split()[0] == "SKIP" and "no: MPICH 5." in line and "MPIR_CVAR_ENABLE_FT" in line, line
    cfg = _config(tmp_path, byte_dataset)
    proc = run([MPIRUN, "-np", "2", TRAINRUN, "doctor", "--config", cfg, "--size-mb", "1", "--iters", "1"], check=1)
    assert any(ln.split()[:2] == ["FAIL", "elastic"] for ln in proc.stdout.splitlines()), proc.stdout
    proc = run([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], check=2)
    assert "distributed.elastic: this job cannot survive a lost rank: MPICH 5." in proc.stderr
    assert "`mpirun --with-ft ulfm`" in proc.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_doctor_says_open_mpi_survives_a_lost_rank_launched_with_ft(ft):
    out = ompi(2, "doctor", "--size-mb", "1", "--iters", "1", timeout=120).stdout
    line = next(ln for ln in out.splitlines() if ln.split()[1:2] == ["elastic"])
    assert line.split()[0] == "PASS" and "Open MPI 5." in line and "ULFM" in line, out
    out = ompi(2, "doctor", "--size-mb", "1", "--iters", "1", timeout=120, ft_flag=False).stdout
    line = next(ln for ln in out.splitlines() if ln.split()[1:2] == ["elastic"])
    assert line.split()[0] == "SKIP" and "launch with `mpirun --with-ft ulfm`" in line, out


# ----------------------------------------------------------------------------- a rank lost

def test_a_killed_rank_drops_out_and_the_others_finish_and_resume(ft, tmp_path, byte_dataset):
    """3 ranks, rank 2 SIGKILLed at the start of step 6: the two others redo step 6's reduce over themselves and
    train to the end (exit 0); every metrics line says how many replicas trained it; the final checkpoint holds
    the same weights on both survivors and resumes."""
    cfg = _config(tmp_path, byte_dataset, **{"train.eval_every": 4})
    proc = ompi(3, "--config", cfg, env={"TRAINRUN_FAULT_KILL_STEP": "2:6"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "run"
    lost = [ln for ln in proc.stdout.splitlines() if ln.startswith("elastic: rank(s) 2 lost during step 6")]
    assert len(lost) == 1 and "2 replica(s) go on" in lost[0], proc.stdout
    assert "elastic: step 6 redone over 2 rank(s)" in proc.stdout
    steps = _lines(out)
    assert sorted(steps) == list(range(1, 13))
    assert [steps[s]["replicas"] for s in range(1, 13)] == [3] * 5 + [2] * 7
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 12 and summary["world_size"] == 2
    assert 12 in _committed(out) and os.path.exists(out / "model.onnx")
    # the survivors held the same bits after every step since: a partial sum on one of them would show here
    final = out / "checkpoints" / "12"
    digests = {json.loads((final / f"rank-{r}.json").read_text())["params_sha256"] for r in (0, 1)}
    assert len(digests) == 1 and not os.path.exists(final / "rank-2.json")
    # the final checkpoint resumes (here on the survivors' 2 ranks of the default venv's MPICH: the global batch
    # it saved is theirs)
    proc = run([MPIRUN, "-np", "2", TRAINRUN, "resume", str(out), "--set", "train.max_steps=14",
                "--set", "distributed.elastic=false"], check=0)
    assert "at step 12 (saved by 2 rank(s), now 2)" in proc.stdout
    assert sorted(_lines(out))[-2:] == [13, 14]


def test_diloco_averages_over_the_replicas_alive_at_the_outer_step(ft, tmp_path, byte_dataset):
    """DiLoCo, 3 replicas of one rank, an outer step every 4 steps (outer SGD lr 0.7, Nesterov momentum 0.9);
    rank 1 SIGKILLed at the start of step 7. Steps 7 and 8 are the replicas' own (world steps: every 3rd), so the
    survivors learn of it in step 8's outer exchange: they shrink and redo it over themselves (first ranks 0 and
    2, now replicas 0 and 1) and train to the end (exit 0). Each rank records its replica's weights before and
    after every outer step (tests/rank_probe.py): the global weights after steps 4, 8 and 12 are a NumPy
    reference's from the replicas alive at that outer step (3, then 2, then 2), the same bits on every
    survivor, the final checkpoint's; the step lines and the outer lines say how many replicas there were."""
    rec = tmp_path / "outer"
    rec.mkdir()
    cfg = _config(tmp_path, byte_dataset, **{
        "train.log_every": 3, "checkpoint.every": 0, "distributed.sync": "diloco",
        "distributed.diloco": {"inner_steps": 4, "group": 1, "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}})
    proc = ompi(3, "--config", cfg, probe=True, env={"TRAINRUN_FAULT_KILL_STEP": "1:7",
                                                     "TRAINRUN_PROBE_OUTER_DIR": str(rec)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lost = [ln for ln in proc.stdout.splitlines() if ln.startswith("elastic: rank(s) 1 lost during step 8")]
    assert len(lost) == 1 and "2 replica(s) go on, the step's outer step redone over them" in lost[0], proc.stdout
    assert "elastic: step 8's outer step redone over 2 rank(s)" in proc.stdout
    out = tmp_path / "run"
    alive = {4: [0, 1, 2], 8: [0, 2], 12: [0, 2]}
    assert sorted(os.listdir(rec)) == sorted(f"rank{r}_step{s}_{w}.npy" for s, ranks in alive.items()
                                             for r in ranks for w in ("before", "after"))
    names = [p["name"] for p in json.loads((out / "graphs" / "manifest.json").read_text())["params"]]
    init = load_file(str(out / "graphs" / "weights.safetensors"))
    start = np.concatenate([init[n].ravel() for n in names])
    before = {s: [np.load(rec / f"rank{r}_step{s}_before.npy") for r in ranks] for s, ranks in alive.items()}
    after = {s: [np.load(rec / f"rank{r}_step{s}_after.npy") for r in ranks] for s, ranks in alive.items()}
    ref = _reference_outer(start, before, 0.7, 0.9, True)
    # the mean over all three replicas at step 8 (the dead one's weights from before its death) is another one
    wrong = _reference_outer(start, {**before, 8: before[8] + [before[4][1]]}, 0.7, 0.9, True)
    scale = np.abs(start).max()
    for s in alive:
        assert all(np.array_equal(a, after[s][0]) for a in after[s]), s
        assert np.abs(after[s][0] - ref[s]).max() <= 1e-6 * scale, s
        assert s < 8 or np.abs(after[s][0] - wrong[s]).max() > 1e-4 * scale, s
    final = load_file(str(out / "checkpoints" / "12" / "model.safetensors"))
    assert np.array_equal(np.concatenate([final[n].ravel() for n in names]), after[12][0])
    digests = {json.loads((out / "checkpoints" / "12" / f"rank-{r}.json").read_text())["params_sha256"]
               for r in (0, 1)}
    assert len(digests) == 1
    steps = _lines(out)
    assert [steps[s]["replicas"] for s in (3, 6, 9, 12)] == [3, 3, 2, 2]
    with open(out / "metrics.jsonl") as fh:
        outer = {r["step"]: r["outer_replicas"] for r in map(json.loads, fh) if "outer_bytes" in r}
    assert outer == {4: 3, 8: 2, 12: 2}
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


def _rejoin_when(proc, out, ready, timeout=60):
    """`trainrun rejoin RUN` once ``ready()`` holds; the job (``proc``) ending or ``timeout`` passing first fails
    the test (the job's output in the message)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            out_, err = proc.communicate()
            raise AssertionError(f"the job ended or {timeout} s passed before a rejoin could be asked\n{out_}\n{err}")
        time.sleep(0.05)
    asked = run([TRAINRUN, "rejoin", str(out)], check=0).stdout
    assert asked.startswith(f"asked the job in {out} for a rank back"), asked


def _replicas_seen(out, n):
    """Whether a whole step line of RUN ``out`` says ``n`` replicas (a function of nothing, for :func:`_rejoin_when`)."""
    metrics = out / "metrics.jsonl"
    return lambda: metrics.exists() and any(r.get("replicas") == n for r in map(
        json.loads, metrics.read_text().splitlines()[:-1]))


def _joined_after(stdout, slot, n=3):
    """The step after which a rank joined in ``slot``'s place, the job back to ``n`` ranks (the log line says it),
    and the line."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith(f"elastic: rank {n - 1} joined after step"))
    assert f"in first rank {slot}'s place, healed from rank 0 over MPI; {n} replica(s) train step" in line, line
    return int(line.split()[6]), line


def test_a_lost_rank_rejoins_healed_from_rank_0_and_all_end_with_the_same_bits(ft, tmp_path, byte_dataset):
    """3 ranks, rank 1 SIGKILLed at the start of step 4; once the survivors train on, `trainrun rejoin RUN` asks
    it back: they spawn a rank, train on while it sets up, and (by step 8: TRAINRUN_FAULT_WAIT_JOIN holds
    them there until it is ready) send it rank 0's weights, optimizer state, counters and data position over
    MPI and take it in. The run ends (exit 0) on 3 ranks: every step line says how many replicas trained it
    (3, 2 until the join, 3), the final checkpoint holds the same bits on all three (a rank healed with other
    moments, step counts or weights would differ after its first update), the losses are finite and fall, and
    summary.json counts 3. Asked again once the job ended, rejoin says no job trains there (exit 2)."""
    cfg = _config(tmp_path, byte_dataset)
    out = tmp_path / "run"
    proc = ompi_start(3, "--config", cfg, env={"TRAINRUN_FAULT_KILL_STEP": "1:4", "TRAINRUN_FAULT_WAIT_JOIN": "8"})
    _rejoin_when(proc, out, _replicas_seen(out, 2))
    proc = ompi(3, proc=proc, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "elastic: rank(s) 1 lost during step 4; 2 replica(s) go on" in proc.stdout
    spawned = next(ln for ln in proc.stdout.splitlines() if ln.startswith("elastic: a rank spawned after step"))
    joined, line = _joined_after(proc.stdout, 1)
    assert 4 <= int(spawned.split()[6]) <= joined <= 8 and "to take rank 1's place" in spawned, proc.stdout
    steps = _lines(out)
    assert sorted(steps) == list(range(1, 13))
    assert [steps[s]["replicas"] for s in range(1, 13)] == [3] * 3 + [2] * (joined - 3) + [3] * (12 - joined)
    losses = [steps[s]["loss"] for s in range(1, 13)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
    final = out / "checkpoints" / "12"
    digests = {json.loads((final / f"rank-{r}.json").read_text())["params_sha256"] for r in range(3)}
    assert len(digests) == 1, digests
    assert json.loads((out / "summary.json").read_text())["world_size"] == 3
    again = run([TRAINRUN, "rejoin", str(out)], check=2)
    assert f"{out}: no job trains there now" in again.stderr


def test_one_rank_left_alone_grows_back_to_three(ft, tmp_path, byte_dataset):
    """3 ranks; rank 1 SIGKILLed at the start of step 4, rank 2 at step 6: rank 0 trains alone (a communicator of
    one). `trainrun rejoin RUN` once the step lines say 1 replica, and again once the first request was taken (it
    waits, the file kept, until the first rank is in): two ranks spawned one after the other, each healed from rank
    0 and taken in; TRAINRUN_FAULT_WAIT_JOIN holds the job after step 9 until both are back. The second spawn and
    admission run over rank 0 and the first rank to rejoin: that rank acts with the job from its first step on (it
    once ran them alone, still set up as joining: rank 0 waited in a collective it never entered, the hang seen in
    the benchmark). The run ends (exit 0) on 3 ranks with the same bits on all three, every metrics line whole, the
    replicas 3, 2, 1, then 2 and 3 again."""
    cfg = _config(tmp_path, byte_dataset)
    out = tmp_path / "run"
    proc = ompi_start(3, "--config", cfg, env={"TRAINRUN_FAULT_KILL_STEP": "1:4,2:6", "TRAINRUN_FAULT_WAIT_JOIN": "9"})
    _rejoin_when(proc, out, _replicas_seen(out, 1))
    _rejoin_when(proc, out, lambda: not (out / "rejoin.json").exists())
    proc = ompi(3, proc=proc, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "elastic: rank(s) 1 lost during step 4; 2 replica(s) go on" in proc.stdout
    assert "elastic: rank(s) 2 lost during step 6; 1 replica(s) go on" in proc.stdout
    joins = [ln for ln in proc.stdout.splitlines() if " joined after step " in ln]
    assert [ln.split()[1:3] for ln in joins] == [["rank", "1"], ["rank", "2"]], proc.stdout
    assert "in first rank 1's place" in joins[0] and "2 replica(s) train step" in joins[0], joins
    assert "in first rank 2's place" in joins[1] and "3 replica(s) train step" in joins[1], joins
    first, second = (int(ln.split()[6]) for ln in joins)
    assert 6 <= first <= second == 9, joins
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(ln) for ln in text.splitlines())
    steps = _lines(out)
    assert sorted(steps) == list(range(1, 13))
    assert [steps[s]["replicas"] for s in range(1, 13)] == \
        [3] * 3 + [2] * 2 + [1] * (first - 5) + [2] * (second - first) + [3] * (12 - second)
    final = out / "checkpoints" / "12"
    digests = {json.loads((final / f"rank-{r}.json").read_text())["params_sha256"] for r in range(3)}
    assert len(digests) == 1, digests
    assert json.loads((out / "summary.json").read_text())["world_size"] == 3


@pytest.mark.parametrize("n", [3, 2])
def test_diloco_takes_a_lost_replica_back_at_an_outer_step(ft, tmp_path, byte_dataset, n):
    """DiLoCo, ``n`` replicas of one rank, an outer step every 4 steps; rank 1 SIGKILLed at the start of step 3 and
    asked back (`trainrun rejoin RUN`) once the others train on. It is taken in right after an outer step (step 8:
    TRAINRUN_FAULT_WAIT_JOIN holds the survivors there until it is ready), when every replica holds the global
    weights: it starts step 9 from exactly rank 0's weights after that outer step (tests/rank_probe.py records
    them), and the last outer step averages over the ``n`` replicas again: every outer step's global weights are a
    NumPy reference's from the replicas alive at it (n - 1, n - 1, then n), the same bits on all of them. With
    n = 2, rank 0 is left alone: its outer steps 4 and 8 are over one replica (a communicator of one), and it
    grows back to two."""
    rec, first = tmp_path / "outer", tmp_path / "first"
    rec.mkdir()
    first.mkdir()
    cfg = _config(tmp_path, byte_dataset, **{
        "checkpoint.every": 0, "distributed.sync": "diloco",
        "distributed.diloco": {"inner_steps": 4, "group": 1, "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}})
    out = tmp_path / "run"
    proc = ompi_start(n, "--config", cfg, probe=True, env={
        "TRAINRUN_FAULT_KILL_STEP": "1:3", "TRAINRUN_FAULT_WAIT_JOIN": "8", "TRAINRUN_PROBE_OUTER_DIR": str(rec),
        "TRAINRUN_PROBE_FIRST_DIR": str(first)})
    _rejoin_when(proc, out, _replicas_seen(out, n - 1))
    proc = ompi(n, proc=proc, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"elastic: rank(s) 1 lost during step 3; {n - 1} replica(s) go on" in proc.stdout
    assert _joined_after(proc.stdout, 1, n)[0] == 8
    survivors = ["0", "2"][:n - 1]
    alive = {4: survivors, 8: survivors, 12: [*survivors, "joined"]}
    names = [p["name"] for p in json.loads((out / "graphs" / "manifest.json").read_text())["params"]]
    init = load_file(str(out / "graphs" / "weights.safetensors"))
    start = np.concatenate([init[n].ravel() for n in names])
    before = {s: [np.load(rec / f"rank{r}_step{s}_before.npy") for r in ranks] for s, ranks in alive.items()}
    after = {s: [np.load(rec / f"rank{r}_step{s}_after.npy") for r in ranks] for s, ranks in alive.items()}
    assert np.array_equal(np.load(first / "rankjoined_first.npy"), after[8][0])
    ref = _reference_outer(start, before, 0.7, 0.9, True)
    scale = np.abs(start).max()
    for s in alive:
        assert all(np.array_equal(a, after[s][0]) for a in after[s]), s
        assert np.abs(after[s][0] - ref[s]).max() <= 1e-6 * scale, s
    steps = _lines(out)
    assert [steps[s]["replicas"] for s in range(1, 13)] == [n] * 2 + [n - 1] * 6 + [n] * 4
    with open(out / "metrics.jsonl") as fh:
        outer = {r["step"]: r["outer_replicas"] for r in map(json.loads, fh) if "outer_bytes" in r}
    assert outer == {4: n - 1, 8: n - 1, 12: n}
    digests = {json.loads((out / "checkpoints" / "12" / f"rank-{r}.json").read_text())["params_sha256"]
               for r in range(n)}
    assert len(digests) == 1


@pytest.mark.parametrize("dead, kill", [(3, 7), (3, 6), (1, 6)])
def test_diloco_a_rank_lost_drops_its_whole_replica(ft, tmp_path, byte_dataset, dead, kill):
    """DiLoCo, 2 replicas of 2 ranks (`diloco.group: 2`: ranks 0, 1 and 2, 3), an outer step every 4 steps, a world
    step every 3rd (the metrics lines); rank ``dead`` SIGKILLed at the start of step ``kill``. Step 7: its replica
    mate learns of it in the replica's own reduce and leaves (exit 0, saying so); the other replica learns of both
    at step 8's outer exchange and goes on alone. Step 6, a world step: all three survivors learn of it there, the
    mate leaves at the shrink (split off: the other replica goes on without another failure); where the mate is
    rank 0 (``dead`` 1), the lowest rank of the other replica takes its writing over. Either way the job ends with
    exit 0, the other replica's two ranks with the same bits, every metrics line whole, the lines' replicas and the
    outer steps' replicas 2, then 1."""
    cfg = _config(tmp_path, byte_dataset, **{
        "train.log_every": 3, "checkpoint.every": 0, "distributed.sync": "diloco",
        "distributed.diloco": {"inner_steps": 4, "group": 2, "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}})
    proc = ompi(4, "--config", cfg, env={"TRAINRUN_FAULT_KILL_STEP": f"{dead}:{kill}"}, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, mate = tmp_path / "run", dead ^ 1
    left = [ln for ln in proc.stdout.splitlines()
            if ln.startswith(f"elastic: this rank (launched as rank {mate}) leaves with its replica: ")]
    assert len(left) == 1 and f"during step {kill}; the other replicas go on" in left[0], proc.stdout
    lost = [ln for ln in proc.stdout.splitlines() if ln.startswith("elastic: rank(s) ")]
    if kill == 7:
        assert len(lost) == 1 and lost[0].startswith("elastic: rank(s) 2, 3 lost during step 8; 1 replica(s) go on, "
                                                     "the step's outer step redone"), proc.stdout
    else:
        assert len(lost) == 1 and lost[0].startswith(
            f"elastic: rank(s) {dead} (rank(s) {mate}, their replica mates, left with them) lost during step 6; "
            f"1 replica(s) go on"), proc.stdout
    assert ("elastic: rank 0 was lost; this rank (launched as rank 2) writes" in proc.stdout) == (mate == 0)
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(ln) for ln in text.splitlines())
    steps = _lines(out)
    assert [steps[s]["replicas"] for s in (3, 6, 9, 12)] == ([2, 2, 1, 1] if kill == 7 else [2, 1, 1, 1])
    outer = {r["step"]: r["outer_replicas"] for r in map(json.loads, text.splitlines()) if "outer_bytes" in r}
    assert outer == {4: 2, 8: 1, 12: 1}
    final = out / "checkpoints" / "12"
    digests = {json.loads((final / f"rank-{r}.json").read_text())["params_sha256"] for r in (0, 1)}
    assert len(digests) == 1 and not os.path.exists(final / "rank-2.json")
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert not os.path.exists(out / ".lock")


def test_rank_0_lost_hands_its_writing_to_the_lowest_survivor(ft, tmp_path, byte_dataset):
    """Rank 0 writes the metrics, the checkpoints' shared files and the run's end: SIGKILLed at the start of step
    10, the lowest survivor takes that over and the two survivors train to the end (exit 0): every step's
    metrics line is there (step 10 on by the new writer, over 2 replicas), no half line, TensorBoard has the new
    writer's event file beside the first, the last checkpoint is committed with the survivors' equal weights
    and resumes, summary.json and the export are written, and the run directory's lock was held to the end
    (removed by the clean end)."""
    cfg = _config(tmp_path, byte_dataset, **{"tensorboard.enabled": True})
    proc = ompi(3, "--config", cfg, env={"TRAINRUN_FAULT_KILL_STEP": "0:10"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "run"
    assert "elastic: rank 0 was lost; this rank (launched as rank 1) writes" in proc.stdout, proc.stdout
    lost = [ln for ln in proc.stdout.splitlines() if ln.startswith("elastic: rank(s) 0 lost during step 10")]
    assert len(lost) == 1 and "2 replica(s) go on" in lost[0], proc.stdout
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(ln) for ln in text.splitlines())
    steps = _lines(out)
    assert sorted(steps) == list(range(1, 13))
    assert [steps[s]["replicas"] for s in range(1, 13)] == [3] * 9 + [2] * 3
    assert len(glob.glob(str(out / "tensorboard" / "events*"))) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 12 and summary["world_size"] == 2
    assert _committed(out)[-1] == 12 and os.path.exists(out / "model.onnx")
    final = out / "checkpoints" / "12"
    digests = {json.loads((final / f"rank-{r}.json").read_text())["params_sha256"] for r in (0, 1)}
    assert len(digests) == 1 and not os.path.exists(final / "rank-2.json")
    assert not os.path.exists(out / ".lock")
    proc = run([TRAINRUN, "resume", str(out), "--set", "train.max_steps=14",
                "--set", "train.gradient_accumulation_steps=2"], check=0)
    assert "at step 12 (saved by 2 rank(s), now 1)" in proc.stdout and max(_lines(out)) == 14


def test_fewer_ranks_than_min_replicas_stop_with_a_checkpoint(ft, tmp_path, byte_dataset):
    """distributed.min_replicas 3 of 3: rank 1 lost at step 7, the two survivors finish step 7 over themselves,
    commit its checkpoint and stop with the contract's "stopped, resumable" 75; the checkpoint resumes."""
    cfg = _config(tmp_path, byte_dataset, **{"distributed.min_replicas": 3})
    proc = ompi(3, "--config", cfg, env={"TRAINRUN_FAULT_KILL_STEP": "1:7"})
    assert proc.returncode == 75, proc.stdout + proc.stderr
    out = tmp_path / "run"
    assert ("stopped after step 7: distributed.min_replicas: 2 rank(s) alive, fewer than 3; checkpoint "
            f"{out}/checkpoints/7 committed") in proc.stderr + proc.stdout
    assert _committed(out)[-1] == 7 and _lines(out)[7]["replicas"] == 2
    proc = run([TRAINRUN, "resume", str(out), "--set", "distributed.min_replicas=1",
                "--set", "train.gradient_accumulation_steps=2"], check=0)
    assert "at step 7 (saved by 2 rank(s), now 1)" in proc.stdout and max(_lines(out)) == 12


def test_without_a_fault_elastic_trains_the_same_bits(ft, tmp_path, byte_dataset):
    """No rank lost: the elastic step (its copy of the gradients and its agreement) changes nothing: the losses
    and gradient norms of every step and the final weights are those of the same run without elastic."""
    runs = {}
    for elastic in (False, True):
        d = tmp_path / str(elastic)
        d.mkdir()
        cfg = write_config(d / "c.yaml", byte_dataset, **{"distributed.elastic": elastic,
                                                          "distributed.intra_node": "mpi", "train.max_steps": 6})
        proc = ompi(2, "--config", cfg)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[elastic] = ({s: (r["loss"], r["grad_norm"]) for s, r in _lines(d / "run").items()},
                         (d / "run" / "checkpoints" / "6" / "model.safetensors").read_bytes())
    assert runs[True] == runs[False]
