"""The communicator's interface (:class:`Communicator`), the world of one process (:class:`SingleProcess`),
the argument checks every backend shares and how an in-flight collective is polled (the constants below,
read at each wait: a benchmark may change them here)."""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

import numpy as np

from ..errors import TrainrunError, UsageError, collective

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64),
                    np.dtype(np.uint16))      # uint16: bfloat16 bits (trainrun.sync.wire), moved, never reduced
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
# during the backward pass, trainrun.sync.reducer) does not spin: it shares the rank's cores with onnxruntime. It
# polls every QUIET_SLEEP_S instead (MPI progresses only inside MPI calls: a rendezvous or a collective's next
# round waits for the next poll), until the main thread waits for it too (its hurry event, see
# trainrun.comm.mpi.wait_quietly), then it spins.
# Why 100 us: docs/design.md ("How the overlap thread waits").
QUIET_SLEEP_S = 1e-4


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


_WITHOUT_FINALIZE: list[str] = []     # why this process leaves without MPI_Finalize (empty: it finalizes)


def leave_without_finalize(why: str) -> None:
    """From now on this process ends without MPI_Finalize (:func:`end_process`): an elastic job's survivor once a
    rank was lost (Open MPI 5.0's MPI_Finalize waits in a fence over the whole job, the dead rank included: across
    nodes it never returns, and its mpirun never exits)."""
    _WITHOUT_FINALIZE.append(why)


def end_process(code: int) -> None:
    """trainrun's last word (its main, ``code`` its exit status): where :func:`leave_without_finalize` was said, the
    process ends here, its output flushed, without MPI_Finalize; otherwise this returns and it exits as usual."""
    if _WITHOUT_FINALIZE:
        _flush_stdio()
        os._exit(code)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


class Communicator:
    """The collectives a data-parallel runner needs. See :mod:`trainrun.comm`.

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
        only (any supported dtype, uint16 included): :mod:`trainrun.sync.wire`'s bf16 reduction runs on it."""
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
