"""The gradient reduction's bytes on the wire (``distributed.reduce_dtype``): fp32, or bf16 with fp32 sums.

:func:`make` returns the reducer :mod:`trainrun.sync.update` runs its inter-rank gradient collectives through:

* :class:`FP32`: the communicator's own collectives (MPI's allreduce / reduce-scatter, NCCL's), float32 on the
  wire.
* :class:`BF16`: the same sums with half the bytes on the wire, in two phases trainrun runs itself over MPI:

  1. every rank rounds its float32 buffer to bfloat16 (round to nearest even, NaN kept NaN) and sends part r
     of it to rank r (one ``alltoallv``: the buffer cut into the world's parts, as ZeRO-1 cuts it);
  2. rank r sums the parts it received *in float32*, in rank order: its part of the reduced buffer.
     ``reduce_scatter`` stops here (ZeRO-1: the owner's part stays float32);
     ``allreduce_`` rounds it to bfloat16 once more and every rank gathers every part (one ``allgatherv``
     of bfloat16) and widens it back to float32: every rank then holds the same bits.

  Error of one reduced element ``r`` against the exact sum ``S`` of the ranks' float32 values ``g_i``
  (``u = 2**-8``, the unit roundoff of bfloat16's 8-bit significand; ``P`` ranks): each ``g_i`` is rounded
  once (``|b_i - g_i| <= u |g_i|``), the float32 sum of the ``b_i`` adds at most ``(P-1) 2**-24 sum|b_i|``,
  and ``allreduce_`` rounds the sum once more (``<= u |S'|``), so

      |r - S| <= (2u + (P-1) 2**-24 (1 + u)^2) * sum_i |g_i|   (about 2**-7 * sum_i |g_i|)

  whatever ``P`` is (``reduce_scatter``: ``u + ...``, about ``2**-8 * sum_i |g_i|``). Every element is
  rounded the same number of times on every MPI algorithm, and the result depends on the ranks' values
  alone, not on which rank sums it.
  (bfloat16 keeps float32's exponent range: no overflow that float32 would not have. Below 2**-126 both are
  subnormal and the bound holds with an absolute term of half bfloat16's smallest step, 2**-134, per rounding.)

  The alternative, an MPI user-defined reduction on bf16 buffers (``MPI.Op.Create`` summing in float32 and
  rounding each partial sum back to bf16 at every hop) sends the same bytes but rounds a partial sum at every
  hop of MPI's algorithm: ``P-1`` roundings on a ring, ``log2 P`` on a tree, chosen by MPI per message size,
  so the bound grows with ``P`` and depends on the algorithm; and MPI calls a Python function during the
  collective's progress. Not taken. NCCL's native bf16 allreduce (``ncclBfloat16``) is that design on the GPU:
  :meth:`trainrun.comm.NCCLCommunicator.allreduce_bf16_` (float32 arithmetic inside each hop, a bf16 rounding
  between hops: ``|r - S| <= ((P-1) + P) u sum|g_i|`` on its ring).

``sent_bytes`` counts the bytes this rank puts on the wire for the gradient collectives: for BF16 exactly what
it hands MPI for other ranks (its parts of the ``alltoallv``, its own part to each of the ``P-1`` others in the
``allgatherv``); for FP32 the traffic of the bandwidth-optimal algorithm MPI and NCCL use for large buffers
(reduce-scatter + allgather, ring or Rabenseifner: ``(P-1)/P`` of the buffer per phase). With parts of equal
size the two count alike per byte, so bf16 is exactly half. The runner reports it per step
(``summary.json``'s ``wire_bytes_per_step``).

The intra-node shared-memory sum (``distributed.intra_node: shared``) reads the peers' buffers in memory: no
wire, nothing to halve, it stays float32; across nodes the slice goes through this reducer.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["REDUCE_DTYPES", "make", "FP32", "BF16", "to_bf16", "from_bf16"]

REDUCE_DTYPES = ("fp32", "bf16")
_CHUNK = 1 << 16       # elements per conversion chunk: the uint32 temporaries stay in cache


def to_bf16(x: np.ndarray, out: np.ndarray) -> None:
    """``out`` (uint16, bfloat16 bits) = ``x`` (float32) rounded to nearest even; NaN stays NaN, inf inf.
    One compiled pass (Numba; numpy's five passes over uint32 temporaries took 20x longer)."""
    _kernel()(x.view(np.uint32), out)


@functools.cache
def _kernel():
    """The compiled rounding loop; Numba imported and the kernel compiled (or loaded from its cache) on the
    bf16 path's first use only."""
    import numba

    @numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
    def round_bits(u, out):
        for i in range(u.size):
            x = u[i]
            if (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):      # NaN: a quiet NaN (adding would wrap)
                out[i] = np.uint16(0x7FC0)
            else:       # + 0x7FFF + the lowest kept bit, truncated: round to nearest, ties to even
                out[i] = np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1)))
                                   >> np.uint32(16))
    return round_bits


def from_bf16(b: np.ndarray, out: np.ndarray, add: bool = False) -> None:
    """``out`` (float32) = the bfloat16 bits ``b`` widened (exact); with ``add``, ``out +=`` them."""
    t = np.empty(min(_CHUNK, b.size), np.uint32)
    for i in range(0, b.size, _CHUNK):
        ti = t[:min(_CHUNK, b.size - i)]
        np.left_shift(b[i:i + ti.size], 16, out=ti, dtype=np.uint32)
        if add:
            with np.errstate(over="ignore"):     # an overflowing sum is inf, as MPI's fp32 sum makes it
                out[i:i + ti.size] += ti.view(np.float32)
        else:
            out[i:i + ti.size] = ti.view(np.float32)


def _counts(n: int, p: int) -> list[int]:
    base, extra = divmod(int(n), int(p))
    return [base + (r < extra) for r in range(p)]


def make(comm, reduce_dtype: str):
    """The reducer for ``comm`` (the ranks that exchange gradients over the wire)."""
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be one of {REDUCE_DTYPES}, got {reduce_dtype!r}")
    if reduce_dtype == "fp32" or comm.world_size == 1:
        return FP32(comm)
    if comm.backend == "nccl":
        return NCCLBF16(comm)
    return BF16(comm)


class FP32:
    """The communicator's float32 collectives, counted."""

    dtype = "fp32"

    def __init__(self, comm):
        self.comm, self.sent_bytes = comm, 0

    def _count(self, nbytes: int, phases: int) -> None:
        p = self.comm.world_size
        self.sent_bytes += phases * (p - 1) * int(nbytes) // p

    def allreduce_(self, buf) -> None:
        self.comm.allreduce_(buf)
        self._count(buf.nbytes, 2)

    def reduce_scatter(self, buf, out, counts=None) -> None:
        self.comm.reduce_scatter(buf, out, counts)
        self._count(buf.nbytes, 1)


class BF16:
    """The two-phase bf16 reduction over MPI (see the module docstring). Scratch buffers are made on the first
    call for a buffer size and kept: nothing is allocated per step."""

    dtype = "bf16"

    def __init__(self, comm):
        self.comm, self.sent_bytes = comm, 0
        self._scratch: dict = {}
        self._host: dict = {}

    def _buffers(self, n: int, counts):
        key = (n, tuple(counts))
        if key not in self._scratch:
            p, me = self.comm.world_size, self.comm.rank
            self._scratch[key] = (np.empty(n, np.uint16), np.empty(counts[me] * p, np.uint16),
                                  np.empty(counts[me], np.float32))
        return self._scratch[key]

    def _parts(self, buf, counts):
        """Phase 1 and the fp32 sum: this rank's part of the reduced buffer (float32) and the scratch."""
        comm, p, me = self.comm, self.comm.world_size, self.comm.rank
        wire, recv, acc = self._buffers(buf.size, counts)
        to_bf16(buf, wire)
        comm.alltoall(wire, recv, counts)
        self.sent_bytes += 2 * (buf.size - counts[me])
        k = counts[me]
        from_bf16(recv[:k], acc)
        for r in range(1, p):
            from_bf16(recv[r * k:(r + 1) * k], acc, add=True)
        return acc, wire

    def reduce_scatter(self, buf, out, counts=None) -> None:
        counts = list(counts) if counts is not None else [buf.size // self.comm.world_size] * self.comm.world_size
        acc, _ = self._parts(self._on_host(buf), counts)
        out[...] = acc

    def allreduce_(self, buf) -> None:
        host = self._on_host(buf)
        p, me = self.comm.world_size, self.comm.rank
        counts = _counts(buf.size, p)
        acc, wire = self._parts(host, counts)
        lo = sum(counts[:me])
        mine = wire[lo:lo + counts[me]]
        to_bf16(acc, mine)
        self.comm.allgather(mine, wire, counts)
        self.sent_bytes += 2 * (p - 1) * counts[me]
        from_bf16(wire, host)
        if host is not buf:
            buf.set(host)

    def _on_host(self, buf):
        """numpy buffers as they are; a cupy buffer (the mpi backend on a GPU) through a kept host twin."""
        if isinstance(buf, np.ndarray):
            return buf
        key = (buf.data.ptr, buf.size)
        if key not in self._host:
            self._host[key] = np.empty(buf.size, np.float32)
        buf.get(out=self._host[key])
        return self._host[key]


class NCCLBF16(FP32):
    """NCCL's native bf16 allreduce (:meth:`trainrun.comm.NCCLCommunicator.allreduce_bf16_`)."""

    dtype = "bf16"

    def allreduce_(self, buf) -> None:
        self.comm.allreduce_bf16_(buf)
        self._count(buf.nbytes // 2, 2)

    def reduce_scatter(self, buf, out, counts=None) -> None:
        raise NotImplementedError("reduce_scatter in bf16 runs on the mpi backend (zero_stage 1 is CPU only)")
