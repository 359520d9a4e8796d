"""The NCCL backend: cupy's NCCL binding on cupy arrays (:class:`NCCLCommunicator`), with a host
communicator as its control plane. cupy is imported when one is built, never at import."""

from __future__ import annotations

import time

import numpy as np

from ..errors import TrainrunError, UsageError, collective
from . import base
from .base import Communicator, _check_buffer, _check_shapes
from .node import cuda_device_count, local_device


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
        sleep = base.MIN_SLEEP_S
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
            if now - start >= base.SPIN_S:
                time.sleep(sleep)
                sleep = min(2 * sleep, base.MAX_SLEEP_S)

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
