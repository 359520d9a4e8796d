"""Collective communication between data-parallel ranks.

One interface, :class:`Communicator`, with three implementations:

* :class:`SingleProcess`: world size 1; every collective is a copy or a no-op.
  Works on numpy and cupy arrays alike and never touches MPI.
* :class:`MPICommunicator`: mpi4py on numpy buffers over ``MPI.COMM_WORLD``
  (cupy buffers through host copies: lets ranks share a GPU).
* :class:`NCCLCommunicator`: cupy's NCCL binding on cupy arrays, with an
  :class:`MPICommunicator` as its control plane (unique-id exchange, objects,
  scalars, barrier).

:func:`make_communicator` picks one. Launch several ranks with ``mpirun -np N``.

Rules every implementation keeps:

* Buffers are contiguous 1-D arrays of float32, float64 or int64 (numpy or
  cupy for MPI, cupy for NCCL). Collectives write in place or into ``out``; nothing is
  allocated per call.
* No pickle anywhere: objects travel as JSON (``allgather_object``), so what
  comes back is the JSON round trip of what went in (tuples become lists,
  dict keys become strings) on every backend, world size 1 included.
* No collective waits forever. MPI collectives are started non-blocking and
  polled until ``timeout_s`` (an attribute: a runner may lower it after the
  first step, as torchtitan does); NCCL collectives are waited on through a
  CUDA event polled the same way. On timeout a :class:`TrainrunError` names
  the collective, the rank and the time waited. The collective is still in
  flight at that point and cannot be cancelled, so the caller must then call
  :meth:`Communicator.abort`, which ends every rank of the job.

What MPICH's launcher (hydra, ``mpirun``) does when a rank dies, measured with
the ``mpich`` 5.0 wheel: if a rank exits *without* ``MPI_Finalize``
(``os._exit``, a signal, a crash), hydra SIGKILLs all the other ranks within
a fraction of a second. For a signal it prints a "BAD TERMINATION ... Killed
(signal 9)" banner on stdout and exits 9; for a plain exit it prints nothing
and its exit status is racy (that of the dead rank, or 9) -- a rank calling
``os._exit(0)`` mid-run can end the whole job with status 0. If a rank instead
leaves through Python's normal exit (an uncaught exception, ``sys.exit``),
mpi4py calls ``MPI_Finalize`` at exit, which waits for the others, and hydra
kills nobody: the other ranks hang in their next collective. That is the case
the timeout exists for.

Importing this module never imports ``mpi4py.MPI`` (importing it initialises
MPI), nor cupy: both are imported by :func:`make_communicator` when needed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from . import cuda, faults
from .errors import TrainrunError, UsageError, collective

__all__ = [
    "Communicator",
    "SingleProcess",
    "MPICommunicator",
    "MPIGroup",
    "NodeMemory",
    "SharedMemoryUnavailable",
    "NCCLCommunicator",
    "make_communicator",
    "detect_world",
    "cuda_device_count",
]

#: Environment variables that launchers set, as (rank variable, size variable),
#: in the order they are consulted: MPICH/Intel MPI hydra, Open MPI, MVAPICH.
WORLD_ENV_VARS = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64),
                    np.dtype(np.uint16))      # uint16: bfloat16 bits (trainrun.wire), moved, never reduced
SCALAR_OPS = ("sum", "max", "min")

# Polling of an in-flight collective: Test() back to back for the first
# SPIN_S seconds (MPI makes progress only inside MPI calls, so this runs at the
# speed of the blocking call, which spins too), then sleep between Test()
# calls, doubling from MIN_SLEEP_S up to MAX_SLEEP_S, so that a rank waiting
# for a slow peer gives its core back. scripts/bench_comm.py measures the cost.
SPIN_S = 0.2
MIN_SLEEP_S = 1e-5
MAX_SLEEP_S = 1e-3
# A thread that waits on collectives while the computation goes on beside it (the gradient buckets reduced
# during the backward pass, trainrun.update) does not spin: it shares the rank's cores with onnxruntime. It
# polls every QUIET_SLEEP_S instead (MPI progresses only inside MPI calls: a rendezvous or a collective's next
# round waits for the next poll), until the main thread waits for it too (hurry()), then it spins.
# Why 100 us: docs/design.md ("How the overlap thread waits").
QUIET_SLEEP_S = 1e-4
_quiet = threading.local()
_hurry = threading.Event()


def wait_quietly() -> None:
    """The calling thread's collectives poll every QUIET_SLEEP_S instead of spinning (unless :func:`hurry`):
    for a thread that communicates while the main thread computes."""
    _quiet.on = True


def hurry(on: bool = True) -> None:
    """The main thread now waits for the quiet threads' collectives: they spin until ``hurry(False)``."""
    _hurry.set() if on else _hurry.clear()


def detect_world() -> tuple[int, int]:
    """Return ``(rank, world_size)`` from the launcher's environment variables.

    Does not initialise MPI. ``(0, 1)`` when not started by mpirun (or by a
    launcher that sets none of :data:`WORLD_ENV_VARS`).
    """
    for rank_var, size_var in WORLD_ENV_VARS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            try:
                rank_i, size_i = int(rank), int(size)
            except ValueError:
                raise UsageError(f"bad launcher environment: {rank_var}={rank!r} {size_var}={size!r}") from None
            if not (size_i >= 1 and 0 <= rank_i < size_i):
                raise UsageError(f"bad launcher environment: {rank_var}={rank_i} {size_var}={size_i}")
            return rank_i, size_i
    return 0, 1


def cuda_device_count() -> int:
    """Number of CUDA devices cupy can see; 0 when cupy is not installed or the CUDA runtime reports
    no driver or no device. A CUDA library that fails to load raises (TrainrunError naming it).

    This asks the CUDA runtime, not onnxruntime: the onnxruntime-training wheel
    lists CUDAExecutionProvider on machines without any GPU.
    """
    cuda.setup()            # CUDA's environment is read when the runtime initialises: set it first
    try:
        import cupy
    except ImportError:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError:      # no driver, no device
        return 0


def local_device(local_rank: int) -> int:
    """The CUDA device of the rank with this local rank: ``local_rank`` modulo the visible devices.

    A launcher that gives every rank all of a host's GPUs (plain ``mpirun``) makes it local rank
    r -> GPU r; one that gives each rank its own (per-rank ``CUDA_VISIBLE_DEVICES``, SLURM
    ``--gpus-per-task=1``) makes every rank see one device, device 0. More ranks than GPUs on a host
    share GPUs: fine for the MPI backend (tests), refused by NCCL (:class:`NCCLCommunicator`)."""
    n = cuda_device_count()
    if n == 0:
        raise UsageError("device: cuda, but no CUDA GPU is visible (checked with cupy; install the `gpu` "
                         "extra on a machine with a GPU, or set device: cpu)")
    return local_rank % n


def machine_id() -> str:
    """This kernel's boot id (the CPUs that processes with the same one see are the same CPUs); the host
    name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return socket.gethostname()


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_share(mine: list[int], peers: list[list[int]]) -> int:
    """Threads for a rank with affinity ``mine`` among ``peers`` (the masks of the ranks on its machine, its
    own included): each of its CPUs counted 1/k, k the ranks whose mask holds it, at least 1. Ranks launched
    unbound (one mask for all) get cores / ranks; ranks a launcher bound to CPUs of their own (SLURM's
    task/affinity, mpirun's -bind-to) keep all of theirs, not a part of them divided again."""
    holders: dict[int, int] = {}
    for mask in peers:
        for c in set(mask):
            holders[c] = holders.get(c, 0) + 1
    share = sum(1 / max(1, holders.get(c, 1)) for c in set(mine))
    return max(1, int(share + 1e-9))


def _check_buffer(buf: Any, what: str) -> None:
    """A contiguous 1-D array of a supported dtype (numpy or cupy), else ValueError."""
    if getattr(buf, "ndim", None) != 1 or not getattr(getattr(buf, "flags", None), "c_contiguous", False):
        raise ValueError(f"{what} must be a contiguous 1-D array, got {type(buf).__name__} "
                         f"with shape {getattr(buf, 'shape', None)}")
    if np.dtype(buf.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{what} has dtype {buf.dtype}; supported: float32, float64, int64, uint16")


def _check_shapes(op: str, src: Any, out: Any, world_size: int, counts=None, rank: int = 0) -> None:
    """Checks shared by every backend for reduce_scatter and allgather (``counts``: the uneven
    variants, one element count per rank: the full buffer is their concatenation)."""
    _check_buffer(src, f"{op} input")
    _check_buffer(out, f"{op} output")
    if src.dtype != out.dtype:
        raise ValueError(f"{op}: input dtype {src.dtype} != output dtype {out.dtype}")
    if counts is not None:
        if len(counts) != world_size or min(counts) < 0:
            raise ValueError(f"{op}: counts must be {world_size} element counts >= 0, got {list(counts)}")
        full, part = (src, out) if op == "reduce_scatter" else (out, src)
        if full.size != sum(counts) or part.size != counts[rank]:
            raise ValueError(f"{op}: buffer sizes {full.size} (whole) and {part.size} (this rank's part) do not "
                             f"match counts {list(counts)} at rank {rank}")
        return
    if op == "reduce_scatter":
        if src.size % world_size:
            raise ValueError(f"reduce_scatter: input size {src.size} is not divisible by the world size "
                             f"{world_size}; pad the buffer to a multiple of it")
        if out.size != src.size // world_size:
            raise ValueError(f"reduce_scatter: output size {out.size} != input size / world size "
                             f"= {src.size // world_size}")
    elif out.size != src.size * world_size:
        raise ValueError(f"allgather: output size {out.size} != chunk size x world size = {src.size * world_size}")


def _displacements(counts) -> list[int]:
    return [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))]


def _part(counts, rank: int) -> slice:
    """Rank ``rank``'s part of a buffer laid out as ``counts``."""
    lo = int(sum(counts[:rank]))
    return slice(lo, lo + int(counts[rank]))


def _same_memory(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the very same elements (same start, size and dtype)."""
    ai, bi = getattr(a, "__array_interface__", None), getattr(b, "__array_interface__", None)
    return (ai is not None and bi is not None and ai["data"][0] == bi["data"][0]
            and a.size == b.size and a.dtype == b.dtype)


def _json_bytes(obj: Any) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValueError(f"allgather_object needs a JSON-serialisable object: {e}") from None


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


class Communicator:
    """The collectives a data-parallel runner needs. See the module docstring.

    Attributes: ``rank``, ``world_size``, ``local_rank`` (rank among the
    processes on this host), ``local_size``, ``hostname``, ``timeout_s``,
    ``backend`` ("none", "mpi" or "nccl").
    """

    backend = "?"
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    hostname: str
    timeout_s: float

    def allreduce_(self, buf) -> None:
        """In place: ``buf`` becomes the element-wise SUM of every rank's ``buf``."""
        raise NotImplementedError

    def reduce_scatter(self, buf, out, counts=None) -> None:
        """SUM over ranks of ``buf``; ``out`` receives this rank's chunk.

        Without ``counts``, ``buf.size`` must be divisible by ``world_size``; rank r gets elements
        ``[r*k, (r+1)*k)`` of the sum, ``k = buf.size // world_size = out.size``. With ``counts``
        (one element count per rank, summing to ``buf.size``) rank r gets the ``counts[r]``
        elements after the first ``sum(counts[:r])``; ``out`` may then be the start of ``buf``
        (``buf[:counts[rank]]``): reduced in place, ``buf``'s other elements left undefined.
        """
        raise NotImplementedError

    def allgather(self, chunk, out, counts=None) -> None:
        """``out`` (size ``chunk.size * world_size``, or ``sum(counts)``) receives every rank's chunk,
        in rank order. With ``counts``, ``chunk`` may be this rank's own part of ``out`` (a view of it
        at its offset): then it is gathered in place, without a copy."""
        raise NotImplementedError

    def alltoall(self, send, recv, counts) -> None:
        """Part r of ``send`` (laid out as ``counts``, one element count per rank) goes to rank r; ``recv``
        (size ``counts[rank] * world_size``) receives every rank's part ``rank``, in rank order. Moves bytes
        only (any supported dtype, uint16 included): :mod:`trainrun.wire`'s bf16 reduction runs on it."""
        raise NotImplementedError

    def gather(self, chunk, out, counts, root: int = 0) -> None:
        """Rank ``root``'s ``out`` (size ``sum(counts)``) receives every rank's ``chunk`` (size
        ``counts[rank]``) in rank order; ``out`` is ignored (may be None) on the other ranks."""
        raise NotImplementedError

    def broadcast_(self, buf, root: int = 0) -> None:
        """In place: every rank's ``buf`` becomes rank ``root``'s."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Return once every rank has called barrier (or raise on timeout)."""
        raise NotImplementedError

    def allgather_object(self, obj) -> list:
        """The JSON round trip of every rank's ``obj``, as a list in rank order.

        For small objects (config hashes, graph hashes, metadata). Raises
        ValueError if ``obj`` is not JSON-serialisable.
        """
        raise NotImplementedError

    def allreduce_scalars(self, values: list[float], op: str = "sum") -> list[float]:
        """Reduce a short list of floats over ranks with ``op`` in sum/max/min.

        Computed in float64. Every rank must pass the same number of values.
        NaN propagates through "sum" but not reliably through "max"/"min":
        agree on finiteness by reducing 0/1 flags with "min".
        """
        raise NotImplementedError

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now with exit status ``code``; does not return."""
        raise NotImplementedError

    def agree(self, error: TrainrunError | None) -> None:
        """Raise the same error on every rank when any rank has one (the lowest rank's wins).

        Every rank must call it. Such an error is *collective*: no rank is left
        waiting in a collective, so the job ends normally with the error's exit
        code instead of an MPI abort."""
        mine = [error.exit_code, error.message, error.problems] if error else None
        for r, report in enumerate(self.allgather_object(mine)):
            if report:
                code, message, problems = report
                raise collective((UsageError if code == 2 else TrainrunError)(
                    message if r == 0 or self.world_size == 1 else f"rank {r}: {message}", problems))

    def close(self) -> None:
        """Release communicator resources. Idempotent. MPI itself is finalised at exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"local_rank={self.local_rank}, local_size={self.local_size}, hostname={self.hostname!r})")


class SingleProcess(Communicator):
    """World size 1: reductions are identities, gathers are copies."""

    backend = "none"

    def __init__(self, timeout_s: float = 300.0):
        self.rank, self.world_size = 0, 1
        self.local_rank, self.local_size = 0, 1
        self.hostname = socket.gethostname()
        self.timeout_s = float(timeout_s)

    def allreduce_(self, buf) -> None:
        _check_buffer(buf, "allreduce_ buffer")

    def reduce_scatter(self, buf, out, counts=None) -> None:
        _check_shapes("reduce_scatter", buf, out, 1, counts)
        if not _same_memory(out, buf):
            out[...] = buf

    def allgather(self, chunk, out, counts=None) -> None:
        _check_shapes("allgather", chunk, out, 1, counts)
        if not _same_memory(chunk, out):
            out[...] = chunk

    def alltoall(self, send, recv, counts) -> None:
        if list(counts) != [send.size] or recv.size != send.size:
            raise ValueError(f"alltoall: sizes {send.size}, {recv.size} do not match counts {list(counts)}")
        recv[...] = send

    def gather(self, chunk, out, counts, root: int = 0) -> None:
        if root != 0:
            raise ValueError(f"gather: root {root} out of range for world size 1")
        self.allgather(chunk, out, counts)

    def broadcast_(self, buf, root: int = 0) -> None:
        _check_buffer(buf, "broadcast_ buffer")
        if root != 0:
            raise ValueError(f"broadcast_: root {root} out of range for world size 1")

    def barrier(self) -> None:
        pass

    def allgather_object(self, obj) -> list:
        return [json.loads(_json_bytes(obj))]

    def allreduce_scalars(self, values, op="sum") -> list[float]:
        if op not in SCALAR_OPS:
            raise ValueError(f"allreduce_scalars: op must be one of {SCALAR_OPS}, got {op!r}")
        return [float(v) for v in values]

    def abort(self, code: int = 1) -> None:
        _flush_stdio()
        os._exit(code)


class MPICommunicator(Communicator):
    """mpi4py over ``MPI.COMM_WORLD`` with numpy buffers (cupy ones staged through host copies, see
    :meth:`_staged`); every collective polled to ``timeout_s``."""

    backend = "mpi"

    def __init__(self, timeout_s: float = 300.0):
        MPI = _import_mpi()
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()
        self.timeout_s = float(timeout_s)
        self.hostname = socket.gethostname()
        self._stuck: list = []  # buffers of timed-out collectives: MPI may still write them
        self._twins: dict = {}  # host copies of cupy buffers (see _staged)
        # Ranks sharing this host's memory, ordered by world rank, give the local
        # rank. Split_type is a blocking collective: a polled barrier first makes
        # sure every rank is alive and about to call it.
        self._node = None
        self.barrier()
        self._node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = self._node.Get_rank(), self._node.Get_size()

    # -- the one place that waits -------------------------------------------------
    def _wait(self, request, op: str, keep_alive: tuple = ()) -> None:
        """Poll ``request`` with Test() until done; TrainrunError after ``timeout_s``."""
        MPI = self._MPI
        start = time.monotonic()
        quiet = getattr(_quiet, "on", False)
        spin_until, deadline = start + (0.0 if quiet else SPIN_S), start + self.timeout_s
        sleep = QUIET_SLEEP_S if quiet else MIN_SLEEP_S
        try:
            while not request.Test():
                now = time.monotonic()
                if now >= deadline:
                    self._stuck.append((request, keep_alive))
                    raise TrainrunError(
                        f"{op} timed out on {self._who()} after "
                        f"{now - start:.1f} s (timeout_s={self.timeout_s:g}): a peer rank probably died or hung "
                        f"before reaching this collective; the job must be aborted")
                if now >= spin_until and not (quiet and _hurry.is_set()):
                    time.sleep(sleep)
                    if not quiet:
                        sleep = min(2 * sleep, MAX_SLEEP_S)
        except MPI.Exception as e:
            raise TrainrunError(f"{op} failed on {self._who()} "
                                f"after {time.monotonic() - start:.1f} s: {e.Get_error_string()}") from None

    def _who(self) -> str:
        return f"rank {self.rank} of {self.world_size} ({self.hostname})"

    def threads_ok(self) -> bool:
        """MPI lets a thread other than the main one call it (MPI_THREAD_SERIALIZED or more)."""
        MPI = self._MPI
        return MPI.Query_thread() >= MPI.THREAD_SERIALIZED

    def _np(self, buf, what: str) -> np.ndarray:
        _check_buffer(buf, what)
        if not isinstance(buf, np.ndarray):
            raise ValueError(f"{what}: the MPI backend takes numpy or cupy arrays, got {type(buf).__module__}."
                             f"{type(buf).__name__}")
        return buf

    def _staged(self, op: str, run, arrays: tuple, down: tuple, up: tuple) -> None:
        """``run(*arrays)`` with numpy twins in place of cupy arrays (host staging: MPICH from PyPI is
        not CUDA-aware): the arrays at indices ``down`` are copied to their twins first, the twins at
        ``up`` back to the GPU afterwards; numpy arrays are passed through. One twin per (address,
        size, dtype), kept: nothing is allocated per call."""
        if all(isinstance(b, np.ndarray) for b in arrays):
            run(*arrays)
            return
        twins = []
        for b in arrays:
            if isinstance(b, np.ndarray):
                twins.append(b)
            elif type(b).__module__.startswith("cupy"):
                key = (b.data.ptr, b.size, b.dtype.str)
                if key not in self._twins:
                    self._twins[key] = np.empty(b.size, b.dtype)
                twins.append(self._twins[key])
            else:
                twins.append(self._np(b, f"{op} buffer"))     # raises
        for i in down:
            if arrays[i] is not twins[i]:
                arrays[i].get(out=twins[i])     # synchronous: waits for the GPU work queued before it
        run(*twins)
        copied = [arrays[i].set(twins[i]) for i in up if arrays[i] is not twins[i]]
        if copied:
            import cupy
            cupy.cuda.get_current_stream().synchronize()    # the twin is reused by the next call

    def _op(self, name: str):
        return {"sum": self._MPI.SUM, "max": self._MPI.MAX, "min": self._MPI.MIN}[name]

    # -- collectives --------------------------------------------------------------
    def allreduce_(self, buf) -> None:
        _check_buffer(buf, "allreduce_ buffer")
        self._staged("allreduce_", lambda b: self._wait(
            self._comm.Iallreduce(self._MPI.IN_PLACE, b, op=self._MPI.SUM), "allreduce_", (b,)),
            (buf,), (0,), (0,))

    def reduce_scatter(self, buf, out, counts=None) -> None:
        _check_shapes("reduce_scatter", buf, out, self.world_size, counts, self.rank)
        if counts is not None:      # numpy only (distributed.zero_stage 1 runs on the CPU)
            b, o = self._np(buf, "reduce_scatter input"), self._np(out, "reduce_scatter output")
            if _same_memory(o, b[:o.size]):     # in place: MPI leaves this rank's part at the start
                self._wait(self._comm.Ireduce_scatter(self._MPI.IN_PLACE, b, recvcounts=list(counts),
                                                      op=self._MPI.SUM), "reduce_scatter", (b,))
            else:
                self._wait(self._comm.Ireduce_scatter(b, o, recvcounts=list(counts), op=self._MPI.SUM),
                           "reduce_scatter", (b, o))
            return
        self._staged("reduce_scatter", lambda b, o: self._wait(
            self._comm.Ireduce_scatter_block(b, o, op=self._MPI.SUM), "reduce_scatter", (b, o)),
            (buf, out), (0,), (1,))

    def allgather(self, chunk, out, counts=None) -> None:
        _check_shapes("allgather", chunk, out, self.world_size, counts, self.rank)
        if counts is not None:
            c, o = self._np(chunk, "allgather input"), self._np(out, "allgather output")
            spec = [o, (list(counts), _displacements(counts))]
            src = self._MPI.IN_PLACE if _same_memory(c, o[_part(counts, self.rank)]) else c
            self._wait(self._comm.Iallgatherv(src, spec), "allgather", (c, o))
            return
        self._staged("allgather", lambda c, o: self._wait(self._comm.Iallgather(c, o), "allgather", (c, o)),
                     (chunk, out), (0,), (1,))

    def alltoall(self, send, recv, counts) -> None:
        s, r = self._np(send, "alltoall input"), self._np(recv, "alltoall output")
        me, p = self.rank, self.world_size
        if len(counts) != p or s.size != sum(counts) or r.size != counts[me] * p or s.dtype != r.dtype:
            raise ValueError(f"alltoall: sizes {s.size} (send), {r.size} (receive) do not match counts "
                             f"{list(counts)} at rank {me}")
        k = int(counts[me])
        send_spec = [s, (list(counts), _displacements(counts))]
        recv_spec = [r, ([k] * p, [k * i for i in range(p)])]
        self._wait(self._comm.Ialltoallv(send_spec, recv_spec), "alltoall", (s, r))

    def gather(self, chunk, out, counts, root: int = 0) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(f"gather: root {root} out of range for world size {self.world_size}")
        c = self._np(chunk, "gather input")
        if self.rank == root:
            _check_shapes("gather", c, self._np(out, "gather output"), self.world_size, counts, self.rank)
            spec = [out, (list(counts), _displacements(counts))]
        else:
            _check_buffer(c, "gather input")
            spec = None
        self._wait(self._comm.Igatherv(c, spec, root=root), "gather", (c, out))

    def broadcast_(self, buf, root: int = 0) -> None:
        _check_buffer(buf, "broadcast_ buffer")
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast_: root {root} out of range for world size {self.world_size}")
        self._staged("broadcast_", lambda b: self._wait(self._comm.Ibcast(b, root=root), "broadcast_", (b,)),
                     (buf,), (0,) if self.rank == root else (), (0,))

    def barrier(self) -> None:
        self._wait(self._comm.Ibarrier(), "barrier")

    def allgather_object(self, obj) -> list:
        data = np.frombuffer(_json_bytes(obj), dtype=np.uint8)
        sizes = np.empty(self.world_size, dtype=np.int64)
        self._wait(self._comm.Iallgather(np.array([data.size], dtype=np.int64), sizes),
                   "allgather_object (sizes)", (sizes,))
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
        recv = [gathered, (sizes, offsets), self._MPI.BYTE]
        self._wait(self._comm.Iallgatherv([data, self._MPI.BYTE], recv), "allgather_object", (data, gathered))
        return [json.loads(gathered[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]

    def allreduce_scalars(self, values, op="sum") -> list[float]:
        if op not in SCALAR_OPS:
            raise ValueError(f"allreduce_scalars: op must be one of {SCALAR_OPS}, got {op!r}")
        buf = np.array(values, dtype=np.float64).reshape(-1)
        self._wait(self._comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._op(op)),
                   f"allreduce_scalars({op})", (buf,))
        return buf.tolist()

    def abort(self, code: int = 1) -> None:
        _flush_stdio()
        self._comm.Abort(code)
        # MPICH's MPI_Abort can return: it asks hydra to kill the job and hydra
        # does so a moment later. Never run on meanwhile.
        os._exit(code)

    def close(self) -> None:
        if self._node is not None and not self._MPI.Is_finalized():
            self._node.Free()
        self._node = None

    def dup(self, what: str) -> "MPIGroup":
        """The same ranks as a communicator of their own (``MPI_Comm_dup``): collectives on it never match
        this one's, so another thread may run them while this communicator's run in the caller's order
        (the gradient buckets reduced during the backward pass, :class:`trainrun.update.Replicated`). Every
        rank must call it."""
        self.barrier()      # Dup is a blocking collective: first make sure every rank is alive and here
        return MPIGroup(self, self._comm.Dup(), what)

    def split(self, color: int, what: str) -> "MPIGroup":
        """The ranks that pass the same ``color``, ordered by world rank, as a communicator of their own
        (collectives polled to this communicator's ``timeout_s``). Every rank must call it."""
        self.barrier()      # Split is a blocking collective: first make sure every rank is alive and here
        return MPIGroup(self, self._comm.Split(color, key=self.rank), what)


class MPIGroup(MPICommunicator):
    """A sub-communicator of an :class:`MPICommunicator` (:meth:`MPICommunicator.split`): ``rank`` and
    ``world_size`` are within the group; its timeout is the parent's; errors name the world rank too."""

    def __init__(self, parent: MPICommunicator, comm, what: str):
        parent = parent._parent if isinstance(parent, MPIGroup) else parent     # the world communicator
        self._MPI, self._comm, self._parent, self.what = parent._MPI, comm, parent, what
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.local_rank, self.local_size = parent.local_rank, parent.local_size
        self.hostname = parent.hostname
        self._stuck, self._twins, self._node = parent._stuck, {}, None

    @property
    def timeout_s(self) -> float:
        return self._parent.timeout_s

    def _who(self) -> str:
        return f"{self._parent._who()}, {self.what} rank {self.rank} of {self.world_size}"

    def abort(self, code: int = 1) -> None:
        self._parent.abort(code)

    def close(self) -> None:
        if self._comm is not None and not self._MPI.Is_finalized():
            self._comm.Free()
        self._comm = None


class SharedMemoryUnavailable(Exception):
    """MPI-3 shared-memory windows cannot be had here (raised on every rank alike)."""


_ALIGN = 64     # bytes: each rank's segment of a window starts on a cache line
SHM_DIR = "/dev/shm"     # where MPICH maps shared windows from (a tmpfs file)


def split_nodes(world: MPICommunicator, ranks_per_node: int | None = None) -> tuple[MPIGroup, int]:
    """This rank's node as training groups ranks (a collective): the ranks sharing memory
    (``MPI_COMM_TYPE_SHARED``, ordered by world rank), or, with ``ranks_per_node`` K, pretend nodes of K
    consecutive world ranks inside them; and how many ranks share this machine (pretend nodes or not)."""
    world.barrier()     # Split_type is a blocking collective
    shared = MPIGroup(world, world._comm.Split_type(world._MPI.COMM_TYPE_SHARED, key=world.rank), "node")
    if not ranks_per_node:
        return shared, shared.world_size
    node = shared.split(world.rank // ranks_per_node, "node")
    shared.close()
    return node, shared.world_size


class NodeMemory:
    """The ranks of this node with MPI-3 shared memory between them (``distributed.intra_node: shared``).

    ``node``: the ranks sharing memory (``MPI_COMM_TYPE_SHARED``), or, with ``ranks_per_node`` K (the
    environment's ``TRAINRUN_RANKS_PER_NODE``), pretend nodes of K consecutive world ranks inside them, so
    that a test exercises the cross-node path on one machine. ``cross``: the ranks with the same node rank,
    one per node (ordered by world rank: the node of world rank 0 is cross rank 0). Both poll their
    collectives to the world's ``timeout_s``.

    :meth:`allocate` makes a float32 buffer in a shared window, zero-filled: one segment per node rank (a
    list of every node rank's segment, this rank's at ``node.rank``) or one segment for the whole node
    (owned by node rank 0). Every node rank holds numpy views of all of them: what one rank writes the
    others read, no copy. :class:`SharedMemoryUnavailable` (on every rank) when the windows cannot be had.
    """

    def __init__(self, world: MPICommunicator, ranks_per_node: int | None = None):
        self._MPI = world._MPI
        self.world, self.node, self.cross, self._windows = world, None, None, []
        self.node, self._machine_ranks = split_nodes(world, ranks_per_node)
        self.cross = world.split(self.node.rank, "cross-node")
        sizes = world.allgather_object([self.node.world_size, faults.hit("SHARED_WINDOWS", world.rank, 0)])
        if len({n for n, _ in sizes}) != 1:
            self.close()
            raise SharedMemoryUnavailable(f"nodes of unequal sizes ({sorted({n for n, _ in sizes})} ranks): "
                                          f"the cross-node groups need the same number of ranks on every node")
        if any(f for _, f in sizes):     # fault injection: a system without shared windows
            self.close()
            raise SharedMemoryUnavailable("MPI_Win_allocate_shared failed (TRAINRUN_FAULT_SHARED_WINDOWS)")

    def require(self, nbytes: int, where: str = SHM_DIR) -> None:
        """:class:`SharedMemoryUnavailable` (on every rank) unless ``where`` (the tmpfs MPICH maps its
        shared windows from) has room for ``nbytes`` per node, for every (pretend) node on this machine. A
        window larger than the tmpfs is handed out anyway, and its first touch kills the rank with SIGBUS
        (Docker's default /dev/shm is 64 MB)."""
        error = None
        if os.path.isdir(where):
            st = os.statvfs(where)
            free = st.f_bavail * st.f_frsize
            need = int(nbytes) * (self._machine_ranks // self.node.world_size)
            if free < need + (64 << 20):
                error = (f"{where} has {free / 2**20:,.0f} MB free on rank {self.world.rank} "
                         f"({self.world.hostname}), the shared windows need {need / 2**20:,.0f} MB there "
                         f"(in a container: a larger --shm-size)")
        self._agree(error)

    def _agree(self, error: str | None) -> None:
        """Every rank raises :class:`SharedMemoryUnavailable` (the first rank's ``error``, after freeing what
        was made) if any rank has an error; a collective."""
        failed = [e for e in self.world.allgather_object(error) if e]
        if failed:
            self.close()
            raise SharedMemoryUnavailable(failed[0])

    def allocate(self, n: int, per_rank: bool) -> list[np.ndarray]:
        node = self.node
        owners = list(range(node.world_size)) if per_rank else [0]
        nbytes = -(-4 * int(n) // _ALIGN) * _ALIGN if node.rank in owners else 0
        node.barrier()      # Allocate_shared is a blocking collective
        error = None
        try:
            win = self._MPI.Win.Allocate_shared(nbytes, 4, comm=node._comm)
            self._windows.append(win)
            views = [np.frombuffer(win.Shared_query(r)[0], np.float32, count=int(n)) for r in owners]
        except self._MPI.Exception as e:
            error = f"MPI_Win_allocate_shared failed on rank {self.world.rank}: {e.Get_error_string()}"
        self._agree(error)
        if node.rank in owners:
            views[owners.index(node.rank)][...] = 0.0     # by its owner (first touch: its own NUMA node)
        node.barrier()
        return views

    def close(self) -> None:
        """Free the windows (every view of them is then invalid) and the groups. Every rank calls it."""
        if not self._MPI.Is_finalized():
            for win in self._windows:
                win.Free()
        self._windows = []
        for group in (self.node, self.cross):
            if group is not None:
                group.close()
        self.node = self.cross = None


class NCCLCommunicator(Communicator):
    """NCCL (through cupy) for array collectives on cupy arrays; ``host`` for the rest.

    Each rank uses GPU :func:`local_device` (made current here); two ranks on one GPU are refused. Collectives are
    enqueued on cupy's current stream and then waited for (a CUDA event polled
    until ``timeout_s``), so when a call returns its result is ready, as with
    the MPI backend. ``allgather_object``, ``allreduce_scalars`` and
    ``barrier`` go through ``host`` (MPI, or SingleProcess at world size 1).
    """

    backend = "nccl"

    def __init__(self, host: Communicator, timeout_s: float = 300.0):
        cupy, nccl = _import_nccl()
        self._cupy, self._nccl = cupy, nccl
        self._host = host
        self.rank, self.world_size = host.rank, host.world_size
        self.local_rank, self.local_size = host.local_rank, host.local_size
        self.hostname = host.hostname
        self.timeout_s = float(timeout_s)
        self.device = local_device(self.local_rank)
        cupy.cuda.Device(self.device).use()
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") and may hang doing so: compare
        # the GPUs' PCI bus ids, which name a device whatever each rank's CUDA_VISIBLE_DEVICES says
        where = host.allgather_object([self.hostname, cupy.cuda.Device(self.device).pci_bus_id])
        for r, w in enumerate(where):
            first = where.index(w)
            if first != r:
                raise collective(UsageError(
                    f"nccl backend: ranks {first} and {r} on host {w[0]} would share GPU {w[1]}; NCCL needs "
                    f"one GPU per rank: launch at most one rank per GPU (or give each rank its own with "
                    f"CUDA_VISIBLE_DEVICES / srun --gpus-per-task=1), or use distributed.backend: mpi"))
        # Rank 0 makes the unique id (NCCL_UNIQUE_ID_BYTES = 128 chars); the host communicator carries it.
        # cupy < 14 hands it out as a tuple of 128 ints, cupy 14 as 128 bytes (seen on an H200); each
        # takes back what it gave: the last element says which.
        uid = np.zeros(129, np.int64)
        if self.rank == 0:
            made = nccl.get_unique_id()
            raw = isinstance(made, (bytes, bytearray))
            uid[:128] = np.frombuffer(bytes(made), np.int8) if raw else made
            uid[128] = raw
        host.broadcast_(uid, root=0)
        commid = uid[:128].astype(np.int8).tobytes() if uid[128] else tuple(int(x) for x in uid[:128])
        self._comm = nccl.NcclCommunicator(self.world_size, commid, self.rank)
        self._dtypes = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                        np.dtype(np.int64): nccl.NCCL_INT64}
        self._bf16, self._to_bf16 = {}, None      # allreduce_bf16_'s uint16 twins and kernels, made on first use

    def _gpu(self, buf, what: str):
        _check_buffer(buf, what)
        if not isinstance(buf, self._cupy.ndarray):
            raise ValueError(f"{what}: the nccl backend takes cupy arrays, got {type(buf).__module__}."
                             f"{type(buf).__name__}")
        return buf

    def _wait(self, op: str) -> None:
        """Wait for the work just enqueued on the current stream, up to ``timeout_s``."""
        event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self._cupy.cuda.get_current_stream())
        start = time.monotonic()
        sleep = MIN_SLEEP_S
        while not event.done:
            now = time.monotonic()
            try:
                self._comm.check_async_error()
            except self._nccl.NcclError as e:
                raise TrainrunError(f"{op} failed on rank {self.rank} of {self.world_size} "
                                    f"({self.hostname}): {e}") from None
            if now - start >= self.timeout_s:
                raise TrainrunError(
                    f"{op} timed out on rank {self.rank} of {self.world_size} ({self.hostname}) after "
                    f"{now - start:.1f} s (timeout_s={self.timeout_s:g}): a peer rank probably died or hung "
                    f"before reaching this collective; the job must be aborted")
            if now - start >= SPIN_S:
                time.sleep(sleep)
                sleep = min(2 * sleep, MAX_SLEEP_S)

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def allreduce_(self, buf) -> None:
        buf = self._gpu(buf, "allreduce_ buffer")
        self._comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtypes[np.dtype(buf.dtype)],
                             self._nccl.NCCL_SUM, self._stream())
        self._wait("allreduce_")

    def allreduce_bf16_(self, buf) -> None:
        """In place, a float32 ``buf``: the SUM over ranks with bfloat16 on the wire (``distributed.reduce_dtype:
        bf16``): rounded to bf16 (nearest even, NaN kept) on the GPU into a kept uint16 twin, NCCL's own bf16
        allreduce on it (``ncclBfloat16``, NCCL >= 2.10: float32 arithmetic within a hop, a bf16 rounding between
        hops), widened back into ``buf``. cupy has no bfloat16 dtype: the bits travel as uint16 and NCCL is told
        the datatype by its enum. Checked bit for bit against the host rounding at world size 1
        (tests/test_gpu.py::test_nccl_bf16_wire_rounds_as_the_host_kernel); the sum of 2 ranks needs 2 GPUs."""
        buf = self._gpu(buf, "allreduce_bf16_ buffer")
        if np.dtype(buf.dtype) != np.float32:
            raise ValueError(f"allreduce_bf16_ takes a float32 buffer, got {buf.dtype}")
        cp = self._cupy
        if self._to_bf16 is None:
            self._to_bf16 = cp.ElementwiseKernel(
                "uint32 u", "uint16 b",
                "b = ((u & 0x7fffffffu) > 0x7f800000u) ? (unsigned short)0x7fc0"
                " : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)", "trainrun_to_bf16")
            self._from_bf16 = cp.ElementwiseKernel("uint16 b", "uint32 u", "u = ((unsigned int)b) << 16",
                                                   "trainrun_from_bf16")
        key = (buf.data.ptr, buf.size)
        if key not in self._bf16:
            self._bf16[key] = cp.empty(buf.size, cp.uint16)
        half, bits = self._bf16[key], buf.view(cp.uint32)
        self._to_bf16(bits, half)
        self._comm.allReduce(half.data.ptr, half.data.ptr, half.size, getattr(self._nccl, "NCCL_BFLOAT16", 9),
                             self._nccl.NCCL_SUM, self._stream())     # ncclBfloat16 = 9 in nccl.h
        self._from_bf16(half, bits)
        self._wait("allreduce_bf16_")

    def reduce_scatter(self, buf, out, counts=None) -> None:
        _no_counts("reduce_scatter", counts)
        _check_shapes("reduce_scatter", buf, out, self.world_size)
        buf, out = self._gpu(buf, "reduce_scatter input"), self._gpu(out, "reduce_scatter output")
        self._comm.reduceScatter(buf.data.ptr, out.data.ptr, out.size, self._dtypes[np.dtype(buf.dtype)],
                                 self._nccl.NCCL_SUM, self._stream())
        self._wait("reduce_scatter")

    def allgather(self, chunk, out, counts=None) -> None:
        _no_counts("allgather", counts)
        _check_shapes("allgather", chunk, out, self.world_size)
        chunk, out = self._gpu(chunk, "allgather input"), self._gpu(out, "allgather output")
        self._comm.allGather(chunk.data.ptr, out.data.ptr, chunk.size, self._dtypes[np.dtype(chunk.dtype)],
                             self._stream())
        self._wait("allgather")

    def gather(self, chunk, out, counts, root: int = 0) -> None:
        raise NotImplementedError("gather runs on the mpi backend only (its user, distributed.zero_stage: 1, "
                                  "needs it); the nccl backend has none")

    def broadcast_(self, buf, root: int = 0) -> None:
        buf = self._gpu(buf, "broadcast_ buffer")
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast_: root {root} out of range for world size {self.world_size}")
        self._comm.bcast(buf.data.ptr, buf.size, self._dtypes[np.dtype(buf.dtype)], root, self._stream())
        self._wait("broadcast_")

    def barrier(self) -> None:
        self._host.timeout_s = self.timeout_s
        self._host.barrier()

    def allgather_object(self, obj) -> list:
        self._host.timeout_s = self.timeout_s
        return self._host.allgather_object(obj)

    def allreduce_scalars(self, values, op="sum") -> list[float]:
        self._host.timeout_s = self.timeout_s
        return self._host.allreduce_scalars(values, op)

    def abort(self, code: int = 1) -> None:
        try:  # unblocks kernels waiting on a dead peer
            if self._comm is not None:
                self._comm.abort()
        finally:
            self._host.abort(code)

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
        self._host.close()


def _no_counts(op: str, counts) -> None:
    if counts is not None:
        raise NotImplementedError(f"{op} with per-rank counts (distributed.zero_stage: 1) runs on the mpi "
                                  f"backend only")


UCX_SHM_MIN = 64 << 20     # bytes free in /dev/shm below which UCX's posix transport is left out


def _ucx_transports(shm: str = SHM_DIR) -> None:
    """Before MPI_Init: with less than :data:`UCX_SHM_MIN` free in ``shm`` (a small container or node
    tmpfs), ``UCX_TLS=^posix`` unless the user set UCX_TLS. MPICH's UCX posix shared-memory transport can
    crash MPI_Init with SIGSEGV there (seen at 16-18 MB), before trainrun could say why; without it UCX
    takes its other transports, and ``distributed.intra_node: shared`` its documented fallback."""
    if "UCX_TLS" in os.environ or not os.path.isdir(shm):
        return
    st = os.statvfs(shm)
    if st.f_bavail * st.f_frsize < UCX_SHM_MIN:
        os.environ["UCX_TLS"] = "^posix"


def _import_mpi():
    """Import mpi4py.MPI (which initialises MPI) and return the module."""
    _ucx_transports()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise UsageError(f"several ranks need mpi4py, which cannot be imported: {e}") from None
    return MPI


def _import_nccl():
    """Import cupy and its NCCL binding, or raise UsageError saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise UsageError(f"backend 'nccl' needs cupy (pip install 'trainrun[gpu]'), which cannot be "
                         f"imported: {e}") from None
    if cuda_device_count() == 0:
        raise UsageError("backend 'nccl' needs a CUDA GPU, and the CUDA runtime reports none on this machine")
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise UsageError("backend 'nccl': cupy cannot load the NCCL library (pip install nvidia-nccl-cu11)")
    return cupy, nccl


def _check_srun(world_size: int) -> None:
    """UsageError when srun started several tasks that are not one MPI job (srun without ``--mpi=pmi2``
    where SLURM's MpiDefault is none): each would train alone, with another global batch."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")      # set by srun for its tasks, not in a batch script
    if world_size == 1 and tasks.isdigit() and int(tasks) > 1:
        raise UsageError(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) but MPI sees one rank in each: "
                         f"launch with `srun --mpi=pmi2` (or mpirun inside the allocation) so that they form one job")


BACKENDS = ("auto", "none", "mpi", "nccl")
DEVICES = ("cpu", "cuda")


def make_communicator(backend: str = "auto", device: str = "cpu", timeout_s: float = 300.0) -> Communicator:
    """Build the communicator for this process.

    ``backend``: "auto" chooses "nccl" when ``device == "cuda"`` and the world
    has more than one rank, "mpi" when it has more than one rank, else "none"
    (:class:`SingleProcess`). MPI is initialised only when an MPI communicator
    is actually built ("mpi" or "nccl" with world size > 1, or "mpi" asked
    for explicitly). Asking for "nccl" without cupy or a GPU is a UsageError.
    """
    if backend not in BACKENDS:
        raise UsageError(f"unknown communication backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if not timeout_s > 0:
        raise UsageError(f"collective timeout must be > 0 seconds, got {timeout_s}")
    _, world_size = detect_world()
    _check_srun(world_size)
    if backend == "auto":
        backend = ("nccl" if device == "cuda" else "mpi") if world_size > 1 else "none"
    if backend == "none":
        if world_size > 1:
            raise UsageError(f"backend 'none' runs one process, but the launcher started {world_size} ranks")
        return SingleProcess(timeout_s)
    if backend == "mpi":
        return MPICommunicator(timeout_s)
    # nccl: check the GPU side first, so a CPU machine fails fast without starting MPI.
    _import_nccl()
    host = MPICommunicator(timeout_s) if world_size > 1 else SingleProcess(timeout_s)
    try:
        return NCCLCommunicator(host, timeout_s)
    except BaseException:
        host.close()
        raise
