"""trainrun.comm with real processes: mpirun (MPICH hydra) launching 2 and 3 ranks.

Each multi-rank test writes a small script into tmp_path and runs it under
the venv's mpirun with a wall-clock limit, so a hang fails the test instead
of hanging the suite. Scripts check their own results on every rank, write
one ``result.<rank>.json`` each (not stdout: hydra can splice one rank's
output into the middle of another's line), and on any failure print the
traceback and abort the whole job (an exception on one rank alone would leave
the others waiting in their next collective).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from trainrun import comm as C
from trainrun.errors import UsageError

MPIRUN = Path(sys.executable).with_name("mpirun")
LAUNCHER_VARS = [v for pair in C.WORLD_ENV_VARS for v in pair]

# Prepended to every rank script: checks that abort the job on failure.
PRELUDE = '''
import json, os, sys, time, traceback
import numpy as np
from trainrun.comm import make_communicator, detect_world
from trainrun.errors import TrainrunError, UsageError

def report(rank, result):
    """Hand this rank's result to the test (a file: hydra may interleave ranks' stdout mid-line)."""
    with open(f"result.{rank}.json", "w") as f:
        json.dump(result, f)

def run(main, comm):
    try:
        main(comm)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        comm.abort(1)
'''


def run_ranks(tmp_path: Path, nprocs: int, body: str, timeout: float = 30.0):
    """Run PRELUDE + body under ``mpirun -np nprocs``; return (rc, stdout+stderr, seconds)."""
    script = tmp_path / "rank_script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    start = time.monotonic()
    try:
        proc = subprocess.run([str(MPIRUN), "-np", str(nprocs), sys.executable, str(script)],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"mpirun -np {nprocs} did not finish within {timeout} s; output so far:\n{out}")
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def results(tmp_path: Path) -> list[dict]:
    """The results the ranks reported, in rank order."""
    files = sorted(tmp_path.glob("result.*.json"), key=lambda p: int(p.name.split(".")[1]))
    return [json.loads(p.read_text()) for p in files]


# ----------------------------------------------------------------------------- multi-rank

COLLECTIVES = '''
def main(comm):
    r, n = comm.rank, comm.world_size
    assert (r, n) == detect_world(), (r, n, detect_world())

    # allreduce_: distinct integer-valued float32 per rank and element, so the sum is exact.
    base = (np.arange(10_000) % 1000).astype(np.float32)
    buf = base * (r + 1) + r
    comm.allreduce_(buf)
    expect = base * sum(q + 1 for q in range(n)) + sum(range(n))
    assert buf.dtype == np.float32 and np.array_equal(buf, expect), "allreduce_ float32"
    for dtype in (np.float64, np.int64):
        b = np.full(7, r + 1, dtype=dtype)
        comm.allreduce_(b)
        assert b.dtype == dtype and np.array_equal(b, np.full(7, n * (n + 1) // 2)), f"allreduce_ {dtype}"

    # reduce_scatter: rank r receives chunk r of the sum.
    k = 1000
    src = np.arange(k * n, dtype=np.float32) + 10_000 * r
    out = np.empty(k, dtype=np.float32)
    comm.reduce_scatter(src, out)
    full = n * np.arange(k * n, dtype=np.float32) + 10_000 * sum(range(n))
    assert np.array_equal(out, full[r * k:(r + 1) * k]), "reduce_scatter"
    try:
        comm.reduce_scatter(np.zeros(k * n + 1, np.float32), out)
        raise AssertionError("reduce_scatter accepted a size not divisible by the world size")
    except ValueError as e:
        assert "divisible" in str(e)

    # allgather: chunks land in rank order.
    chunk = np.arange(5, dtype=np.float64) + 100 * r
    gathered = np.empty(5 * n, dtype=np.float64)
    comm.allgather(chunk, gathered)
    assert np.array_equal(gathered, np.concatenate([np.arange(5) + 100 * q for q in range(n)])), "allgather"

    # the uneven variants (ZeRO-1's parts): rank q holds counts[q] elements, one rank none at all
    counts = [7 + 3 * q for q in range(n)]
    counts[1] = 0
    offs = np.concatenate(([0], np.cumsum(counts)))
    total = int(offs[-1])
    src = (np.arange(total) % 97).astype(np.float32) * (r + 1)
    part = np.full(counts[r], -1.0, np.float32)
    comm.reduce_scatter(src, part, counts)
    whole = (np.arange(total) % 97).astype(np.float32) * (n * (n + 1) // 2)
    assert np.array_equal(part, whole[offs[r]:offs[r + 1]]), "reduce_scatter with counts"
    inplace = src.copy()
    comm.reduce_scatter(inplace, inplace[:counts[r]], counts)     # this rank's part lands at the start
    assert np.array_equal(inplace[:counts[r]], whole[offs[r]:offs[r + 1]]), "reduce_scatter in place"
    flat = np.full(total, -1.0, np.float32)
    flat[offs[r]:offs[r + 1]] = part
    comm.allgather(flat[offs[r]:offs[r + 1]], flat, counts)      # in place: this rank's part of flat
    assert np.array_equal(flat, whole), "allgather in place with counts"
    other = np.full(total, -1.0, np.float32)
    comm.allgather(part, other, counts)                          # from a separate buffer
    assert np.array_equal(other, whole), "allgather with counts"
    root = n - 1
    got = np.full(total, -1.0, np.float32) if r == root else None
    comm.gather(part, got, counts, root=root)
    assert r != root or np.array_equal(got, whole), "gather with counts"
    try:
        comm.reduce_scatter(src, np.empty(counts[r] + 1, np.float32), counts)
        raise AssertionError("reduce_scatter accepted a part of the wrong size")
    except ValueError as e:
        assert "do not match counts" in str(e), e

    # broadcast_ from the last rank (a root other than 0) and from rank 0.
    for root in (n - 1, 0):
        b = np.full(300, float(r), dtype=np.float32)
        comm.broadcast_(b, root=root)
        assert np.all(b == root), f"broadcast_ root={root}"

    # allgather_object: JSON round trip, in rank order, objects of different sizes.
    objs = comm.allgather_object({"rank": r, "hash": "ab" * (r + 1), "t": (1, 2)})
    assert objs == [{"rank": q, "hash": "ab" * (q + 1), "t": [1, 2]} for q in range(n)], objs

    # allreduce_scalars: sum, max, min.
    vals = [r + 1.0, -r, 0.25 * r]
    assert comm.allreduce_scalars(vals, "sum") == [n * (n + 1) / 2, -sum(range(n)), 0.25 * sum(range(n))]
    assert comm.allreduce_scalars(vals, "max") == [float(n), 0.0, 0.25 * (n - 1)]
    assert comm.allreduce_scalars(vals, "min") == [1.0, -(n - 1.0), 0.0]

    # barrier: the last rank arrives late and leaves a file just before; nobody may leave before it
    # arrives, so every rank finds the file after the barrier (order, not timing: a loaded machine is fine)
    if r == n - 1:
        time.sleep(0.5)
        open("last_rank_arrived", "w").close()
    comm.barrier()
    assert os.path.exists("last_rank_arrived"), f"rank {r} left the barrier before rank {n - 1} arrived"

    report(r, {"rank": r, "world": n, "local_rank": comm.local_rank,
               "local_size": comm.local_size, "backend": comm.backend})

comm = make_communicator(timeout_s=20)   # backend "auto"
run(main, comm)
comm.close()
'''


@pytest.mark.parametrize("nprocs", [2, 3])
def test_collectives_under_mpirun(tmp_path, nprocs):
    rc, out, _ = run_ranks(tmp_path, nprocs, COLLECTIVES)
    assert rc == 0, out
    ranks = results(tmp_path)
    assert [d["rank"] for d in ranks] == list(range(nprocs)), out
    for d in ranks:
        # auto backend with several ranks on the CPU is MPI; all ranks share this host.
        assert d == {"rank": d["rank"], "world": nprocs, "local_rank": d["rank"],
                     "local_size": nprocs, "backend": "mpi"}


def test_auto_with_cuda_and_explicit_none_are_usage_errors_under_mpirun(tmp_path):
    if C.cuda_device_count() > 0:
        pytest.skip("this machine has a GPU, so device='cuda' is not an error here")
    body = '''
    import sys
    errors = []
    for kwargs in ({"device": "cuda"}, {"backend": "nccl"}, {"backend": "none"}):
        try:
            make_communicator(**kwargs)
        except UsageError as e:
            errors.append(str(e))
    # None of the failed attempts started MPI.
    report(int(os.environ["PMI_RANK"]), {"errors": errors, "mpi_imported": "mpi4py.MPI" in sys.modules})
    '''
    rc, out, _ = run_ranks(tmp_path, 2, body)
    assert rc == 0, out
    reported = results(tmp_path)
    assert len(reported) == 2, out
    for res in reported:
        cuda, nccl, none = res["errors"]
        assert "nccl" in cuda and ("cupy" in cuda or "GPU" in cuda)
        assert "nccl" in nccl and ("cupy" in nccl or "GPU" in nccl)
        assert "2 ranks" in none
        assert res["mpi_imported"] is False


# ----------------------------------------------------------------------------- a dead or hung peer

ALLREDUCE_AFTER_PEER_FAILS = '''
import signal
MODE = {mode!r}

def main(comm):
    buf = np.ones(10_000, dtype=np.float32)
    comm.barrier()
    if comm.rank == 1:
        if MODE == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE == "os_exit":
            os._exit(3)
        if MODE == "exception":      # leaves through Python's exit: mpi4py runs MPI_Finalize
            raise SystemExit("rank 1 gives up")
        if MODE == "hang":
            time.sleep(120)
    t = time.monotonic()
    try:
        comm.allreduce_(buf)
    except TrainrunError as e:
        # a file as well as stderr: output still in hydra's pipes when it kills the job can be lost
        msg = f"rank {{comm.rank}}: TrainrunError: {{e}}"
        print(msg, file=sys.stderr, flush=True)
        with open(f"error.{{comm.rank}}.txt", "w") as f:
            f.write(msg)
        comm.abort(1)
    print(f"rank {{comm.rank}} finished allreduce", flush=True)

comm = make_communicator(timeout_s={timeout_s})
if MODE == "exception" and comm.rank == 1:
    main(comm)          # no abort-on-error wrapper: an ordinary crash of one rank
else:
    run(main, comm)
'''


@pytest.mark.parametrize("mode", ["sigkill", "os_exit"])
def test_peer_killed_hydra_ends_the_job(tmp_path, mode):
    """A rank that dies without MPI_Finalize: hydra SIGKILLs the others at once, long before rank 0's
    own timeout (60 s, beyond run_ranks' 30 s limit) could end the job."""
    rc, out, _ = run_ranks(tmp_path, 2, ALLREDUCE_AFTER_PEER_FAILS.format(mode=mode, timeout_s=60))
    assert rc != 0, out
    assert "finished allreduce" not in out, out
    assert not (tmp_path / "error.0.txt").exists(), out       # rank 0 did not time out: hydra killed it
    if mode == "sigkill":  # hydra names the cause only when a rank died by a signal
        assert "BAD TERMINATION" in out and "signal 9" in out, out


@pytest.mark.parametrize("mode", ["exception", "hang"])
def test_peer_gone_quietly_times_out_with_clear_error(tmp_path, mode):
    """A rank that exits through MPI_Finalize, or hangs: hydra kills nobody, the timeout fires."""
    timeout_s = 2
    rc, out, _ = run_ranks(tmp_path, 2, ALLREDUCE_AFTER_PEER_FAILS.format(mode=mode, timeout_s=timeout_s))
    assert rc != 0, out
    assert "finished allreduce" not in out, out
    err = tmp_path / "error.0.txt"
    assert err.exists(), out
    m = re.search(r"rank 0: TrainrunError: allreduce_ timed out on rank 0 of 2 \(.*\) after ([0-9.]+) s "
                  r"\(timeout_s=2\): a peer rank probably died or hung", err.read_text())
    assert m, (err.read_text(), out)
    assert float(m.group(1)) >= timeout_s, out      # never early; how late depends on the machine's load


def test_abort_ends_every_rank_and_does_not_return(tmp_path):
    body = '''
    comm = make_communicator(timeout_s=20)
    comm.barrier()
    if comm.rank == 0:
        open("abort_called", "w").close()
        comm.abort(7)
        open("abort_returned", "w").close()   # MPICH's MPI_Abort alone can return
    else:
        time.sleep(15)
        open("rank1_survived", "w").close()
    '''
    rc, out, _ = run_ranks(tmp_path, 2, body)
    # hydra's own exit status is racy (the code, or 9 when it SIGKILLs the job first), and so is
    # MPICH's "MPI_Abort(MPI_COMM_WORLD, 7)" line: output still in hydra's pipes when it kills the
    # job can be lost (seen in CI). What must hold: the job ended nonzero and rank 1 was killed
    # before it woke up (rank1_survived below), however loaded the machine.
    assert rc != 0, out
    assert (tmp_path / "abort_called").exists(), out
    assert not (tmp_path / "abort_returned").exists(), "comm.abort() returned"
    assert not (tmp_path / "rank1_survived").exists()


# ----------------------------------------------------------------------------- single process

@pytest.fixture
def no_launcher(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def test_import_and_single_process_do_not_start_mpi(tmp_path):
    code = textwrap.dedent('''
        import sys
        import trainrun.comm as C
        assert "mpi4py.MPI" not in sys.modules, "importing trainrun.comm started MPI"
        comm = C.make_communicator()
        assert type(comm).__name__ == "SingleProcess", comm
        assert "mpi4py.MPI" not in sys.modules, "a single-process communicator started MPI"
        print("clean")
    ''')
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stdout + proc.stderr


def test_single_process_semantics(no_launcher):
    comm = C.make_communicator()
    assert isinstance(comm, C.SingleProcess) and comm.backend == "none"
    assert (comm.rank, comm.world_size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    buf = np.arange(10, dtype=np.float32)
    comm.allreduce_(buf)
    comm.broadcast_(buf)
    assert np.array_equal(buf, np.arange(10))
    out = np.zeros(10, dtype=np.float32)
    comm.reduce_scatter(buf, out)
    assert np.array_equal(out, buf)
    out[:] = 0
    comm.allgather(buf, out)
    assert np.array_equal(out, buf)
    comm.barrier()
    assert comm.allgather_object({"a": (1, 2), 3: None}) == [{"a": [1, 2], "3": None}]
    assert comm.allreduce_scalars([1, 2.5], "max") == [1.0, 2.5]
    with pytest.raises(ValueError, match="JSON"):
        comm.allgather_object({1, 2})
    with pytest.raises(ValueError, match="op must be"):
        comm.allreduce_scalars([1.0], "mean")
    with pytest.raises(ValueError, match="dtype"):
        comm.allreduce_(np.zeros(4, dtype=np.float16))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        comm.allreduce_(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        comm.allreduce_(np.zeros(8, dtype=np.float32)[::2])
    with pytest.raises(ValueError, match="output size"):
        comm.allgather(buf, np.zeros(3, dtype=np.float32))
    out[:] = 0
    comm.reduce_scatter(buf, out, [10])
    comm.gather(out[:], buf, [10])
    comm.allgather(buf, buf, [10])          # in place
    assert np.array_equal(out, np.arange(10)) and np.array_equal(buf, np.arange(10))
    with pytest.raises(ValueError, match="do not match counts"):
        comm.allgather(buf, out, [9])
    comm.close()


def test_single_process_abort_exits_with_the_code():
    code = "import trainrun.comm as C; C.make_communicator().abort(5); print('abort returned')"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 5 and "abort returned" not in proc.stdout, proc.stdout + proc.stderr


def test_explicit_mpi_backend_as_a_singleton(no_launcher):
    """backend='mpi' without mpirun: a world of one MPI process (MPICH singleton init)."""
    code = textwrap.dedent('''
        import numpy as np
        import trainrun.comm as C
        comm = C.make_communicator("mpi", timeout_s=10)
        assert isinstance(comm, C.MPICommunicator) and comm.world_size == 1
        buf = np.arange(4, dtype=np.int64)
        comm.allreduce_(buf)
        assert buf.tolist() == [0, 1, 2, 3]
        assert comm.allgather_object(["x"]) == [["x"]]
        try:
            comm.allreduce_([1.0, 2.0])
        except ValueError as e:
            assert "contiguous 1-D" in str(e), e
        else:
            raise AssertionError("a list was accepted as a buffer")
        print("clean")
    ''')
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stdout + proc.stderr


def test_detect_world_from_environment(monkeypatch, no_launcher):
    assert C.detect_world() == (0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert C.detect_world() == (1, 4)
    monkeypatch.setenv("PMI_RANK", "2")
    monkeypatch.setenv("PMI_SIZE", "3")
    assert C.detect_world() == (2, 3)
    monkeypatch.setenv("PMI_RANK", "3")
    with pytest.raises(UsageError, match="PMI_RANK=3 PMI_SIZE=3"):
        C.detect_world()


def test_bad_arguments_are_usage_errors(no_launcher):
    with pytest.raises(UsageError, match="unknown communication backend 'gloo'"):
        C.make_communicator("gloo")
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        C.make_communicator(device="tpu")
    with pytest.raises(UsageError, match="timeout"):
        C.make_communicator(timeout_s=0)


@pytest.mark.skipif(C.cuda_device_count() > 0, reason="a GPU is present: nccl would not fail here")
def test_nccl_on_a_cpu_machine_is_a_clear_usage_error(no_launcher):
    with pytest.raises(UsageError, match=r"backend 'nccl' needs (cupy|a CUDA GPU)") as e:
        C.make_communicator("nccl", device="cuda")
    assert e.value.exit_code == 2
    assert C.cuda_device_count() == 0


# ----------------------------------------------------------------------------- GPU (skipped without one)

CUPY_COLLECTIVES = '''
import cupy as cp

def cupy_collectives(comm):
    """allreduce_ (on a view, twice), reduce_scatter, allgather and broadcast_ on cupy buffers, checked on
    every rank."""
    r, n = comm.rank, comm.world_size
    big = cp.full(12_000, cp.nan, cp.float32)
    buf = big[1000:11_000]                       # a view: its own pointer and count
    for k in range(2):                           # twice: a kept twin (the mpi backend's) carries new values
        base = cp.arange(10_000, dtype=cp.float32) % 1000 + k
        buf[...] = base * (r + 1) + r
        comm.allreduce_(buf)
        expect = base * (n * (n + 1) // 2) + n * (n - 1) // 2
        assert bool(cp.all(buf == expect)), ("allreduce_", k)
    assert bool(cp.isnan(big[:1000]).all()) and bool(cp.isnan(big[11_000:]).all()), "wrote outside the view"
    src = cp.arange(8 * n, dtype=cp.float64) + 100 * r
    out = cp.empty(8, dtype=cp.float64)
    comm.reduce_scatter(src, out)
    full = n * cp.arange(8 * n, dtype=cp.float64) + 100 * (n * (n - 1) // 2)
    assert bool(cp.all(out == full[8 * r:8 * (r + 1)])), "reduce_scatter"
    gathered = cp.empty(8 * n, dtype=cp.float64)
    comm.allgather(out, gathered)
    assert bool(cp.all(gathered == full)), "allgather"
    b = cp.full(64, r, dtype=cp.int64)
    comm.broadcast_(b, root=n - 1)
    assert bool(cp.all(b == n - 1)), "broadcast_"
'''

NCCL_SCRIPT = CUPY_COLLECTIVES + '''
def main(comm):
    r, n = comm.rank, comm.world_size
    assert comm.backend == "nccl" and cp.cuda.Device().id == comm.device
    cupy_collectives(comm)
    assert comm.allreduce_scalars([1.0], "sum") == [float(n)]
    assert comm.allgather_object(r) == list(range(n))
    comm.barrier()
    report(r, {"rank": r, "world": n})

comm = make_communicator("nccl", device="cuda", timeout_s=60)
run(main, comm)
comm.close()
'''


@pytest.mark.gpu
@pytest.mark.skipif(C.cuda_device_count() == 0, reason="needs a CUDA GPU and cupy (NCCL backend)")
def test_nccl_collectives_on_gpu(tmp_path):
    nprocs = min(C.cuda_device_count(), 2)  # NCCL needs one GPU per rank
    rc, out, _ = run_ranks(tmp_path, nprocs, NCCL_SCRIPT, timeout=120)
    assert rc == 0, out
    assert [d["rank"] for d in results(tmp_path)] == list(range(nprocs)), out


MPI_CUPY_SCRIPT = CUPY_COLLECTIVES + '''
from trainrun.sync import wire

def main(comm):
    r, n = comm.rank, comm.world_size
    assert comm.backend == "mpi"
    cupy_collectives(comm)
    # distributed.reduce_dtype: bf16 on the mpi backend from a cupy buffer: the bits of the numpy path
    host = np.random.default_rng(r).standard_normal(5_003).astype(np.float32)
    dev = cp.asarray(host)
    wire.make(comm, "bf16").allreduce_(host)
    wire.make(comm, "bf16").allreduce_(dev)
    assert np.array_equal(dev.get().view(np.uint32), host.view(np.uint32)), "bf16 wire"
    report(r, {"rank": r})

comm = make_communicator("mpi", device="cuda", timeout_s=60)
run(main, comm)
comm.close()
'''


@pytest.mark.gpu
@pytest.mark.skipif(C.cuda_device_count() == 0, reason="needs a CUDA GPU and cupy")
def test_mpi_backend_stages_cupy_buffers_for_ranks_sharing_a_gpu(tmp_path):
    """distributed.backend: mpi with device: cuda (ranks sharing one GPU): every collective on cupy
    buffers through the host twins, views at an offset, bf16 on the wire; 2 ranks on GPU 0."""
    rc, out, _ = run_ranks(tmp_path, 2, MPI_CUPY_SCRIPT, timeout=120)
    assert rc == 0, out
    assert [d["rank"] for d in results(tmp_path)] == [0, 1], out


def test_srun_without_pmi2_is_a_usage_error_naming_it(tmp_path):
    """srun's tasks without an MPI plugin (SLURM's MpiDefault=none) are N one-rank MPI worlds: each would
    train alone with another global batch. SLURM_STEP_NUM_TASKS > 1 (srun's, not the batch script's) in a
    world of one rank: exit 2 saying --mpi=pmi2, before MPI starts. A batch script's single rank is left be."""
    code = "from trainrun.comm import make_communicator; print(make_communicator().world_size)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MV2_", "SLURM_"))}
    trainrun = os.path.join(os.path.dirname(sys.executable), "trainrun")
    srun = subprocess.run([trainrun, "doctor"], capture_output=True, text=True, timeout=60,
                          env=dict(env, SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1"))
    assert srun.returncode == 2 and "`srun --mpi=pmi2`" in srun.stderr, srun.stderr
    assert "srun started 2 tasks (SLURM_STEP_NUM_TASKS) but MPI sees one rank in each" in srun.stderr
    batch = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env=dict(env, SLURM_NTASKS="2"))
    assert batch.returncode == 0 and batch.stdout.strip() == "1", batch.stderr


def test_cpu_share_divides_shared_cores_and_keeps_a_bound_ranks_own():
    """engine.threads 0: ranks launched unbound (one mask) share its cores; ranks a launcher bound to cores of
    their own (SLURM's task/affinity) keep them all, not divided again by the ranks on the machine."""
    eight = list(range(8))
    assert C.cpu_share(eight, [eight, eight]) == 4                       # mpirun, unbound: 8 cores / 2 ranks
    assert C.cpu_share(eight[:4], [eight[:4], eight[4:]]) == 4            # srun: 4 cores bound to each rank
    assert C.cpu_share([0, 1], [[0, 1], [2, 3], [4, 5], [6, 7]]) == 2
    assert C.cpu_share([0, 1, 2], [[0, 1, 2], [2, 3]]) == 2               # one core shared: half of it
    assert C.cpu_share([0], [[0], [0], [0]]) == 1                         # oversubscribed: at least 1
    assert C.cpu_share(C.affinity(), [C.affinity()]) == len(os.sched_getaffinity(0))
    assert C.machine_id() == C.machine_id() != ""
