"""The overlapped reduction (``distributed.overlap_grad_reduce``) as one component: :class:`BucketReducer`.

A flat float32 buffer is cut into buckets (element ranges); as each becomes final its allreduce starts in a
background thread, while the caller goes on computing; at the end the caller waits for them and reduces the
rest. The reducer owns all of it: the buckets, the one background thread, the duplicate communicator its
collectives run on, the wire they go over (:func:`trainrun.sync.wire.make`) and the wait. Its interface::

    bucket_ready(k)   bucket k is final: its allreduce starts in the background (the callback the engine's
                      segmented train graph calls between two segments, trainrun.step.engine.Engine.forward_backward)
    wait()            wait for every started bucket (re-raising a failed or timed-out collective); how many
    reduce()          wait(), then allreduce the rest of the buffer in the calling thread (with no bucket
                      started: the whole buffer)
    close()           stop the thread, free the duplicate communicator

Buckets are started in order 0, 1, ..., each rank starting the same ones in the same order; bucket k+1 lies
below bucket k in the buffer (the backward pass makes the last layers' gradients first, :meth:`trainrun.step.engine.Engine._buckets`),
so what :meth:`reduce` reduces itself is the buffer up to the last started bucket, in one call.

The collectives run on a duplicate of the communicator (:meth:`trainrun.comm.MPICommunicator.dup`):
whatever the main thread runs on the original meanwhile (the step's scalars, an error agreed on) cannot be
matched with a bucket's allreduce of another rank. The background thread polls its collectives quietly
(:func:`trainrun.comm.wait_quietly`: it shares the rank's cores with the computation) until :meth:`wait`
sets the reducer's hurry event (the main thread waits for it now), and spins then.

Each element is reduced by the same collective as in one allreduce of the buffer, only in a smaller call:
the same bits on 2 ranks and with ``reduce_dtype: bf16`` (rank-order sums); with fp32 on more ranks MPI
may pick another algorithm, and so another order of the float32 sum, for a smaller message (each element
then differs by at most the float32 rounding of that sum).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from . import wire
from ..comm import MPICommunicator, wait_quietly


def applies(d, device: str, comm, node) -> bool:
    """Whether the step reduces buckets of gradients during the backward pass
    (``distributed.overlap_grad_reduce``; ``d``: the config's distributed section): on the replicated path
    (:class:`trainrun.sync.update.Replicated`: stage 0, no node buffers) over MPI on the CPU (``device``), with
    several ranks, where MPI lets another thread than the main one call it. The engine then cuts its train graph
    at the buckets (``EngineOptions.bucket_bytes``)."""
    return bool(d.overlap_grad_reduce and comm.world_size > 1 and isinstance(comm, MPICommunicator)
                and device == "cpu" and d.zero_stage == 0 and node is None and comm.threads_ok())


class BucketReducer:
    """The buckets ``buckets`` (``(lo, hi)`` element ranges of ``buffer``, from its end) of a flat buffer
    summed over the ranks of ``comm`` (an :class:`trainrun.comm.MPICommunicator`), each in the background
    as soon as it is final; ``reduce_dtype``: the wire (``distributed.reduce_dtype``); ``poll_s``: how often
    the background thread polls (default ``trainrun.comm.base.QUIET_SLEEP_S``). Every rank of ``comm``
    builds it (the duplicate communicator is a collective). See the module's docstring."""

    def __init__(self, comm, buffer, buckets: list[tuple[int, int]], reduce_dtype: str = "fp32",
                 poll_s: float | None = None):
        self.buffer, self.buckets = buffer, list(buckets)
        self._comm = comm.dup("gradient buckets")
        self._hurry = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainrun-reduce", initializer=wait_quietly,
                                        initargs=(self._hurry, poll_s))
        self._pending: list = []
        self.wire = wire.make(self._comm, reduce_dtype)

    def bucket_ready(self, k: int) -> None:
        """Bucket ``k`` of the buffer is final: its allreduce starts in the background."""
        lo, hi = self.buckets[k]
        self._pending.append(self._pool.submit(self.wire.allreduce_, self.buffer[lo:hi]))

    def wait(self) -> int:
        """Wait for every started bucket (the background thread spins meanwhile); a failed or timed-out
        collective is raised here. Returns how many buckets had been started (they are then reduced)."""
        started, self._pending = self._pending, []
        if started:
            self._hurry.set()
            try:
                for f in started:
                    f.result()
            finally:
                self._hurry.clear()
        return len(started)

    def reduce(self) -> None:
        """The whole buffer summed over the ranks: the started buckets waited for, the rest reduced here."""
        started = self.wait()
        end = self.buckets[started - 1][0] if started else self.buffer.size
        if end:
            self.wire.allreduce_(self.buffer[:end])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._comm.close()
