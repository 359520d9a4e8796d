"""``distributed.elastic``: training goes on when a rank dies (Open MPI's ULFM fault tolerance; docs/distributed.md,
"Elastic runs").

The runner hands :meth:`Elastic.step` the part of its step that talks to the other ranks: the gradients' reduce
and the step's one scalar allreduce (loss, norm, stop flags, the checkpoint write's progress). Before it, this
rank's own gradients are kept (one copy of the flat gradient buffer). Then::

    try the reduce and the scalars       a dead peer raises PeerLost; this rank revokes the communicator, so
                                         that no survivor waits in a collective the dead rank never joins
    agree (ULFM, fault tolerant)         every survivor learns the same thing: all got through, or a rank died
    all got through                      the step goes on (the optimizer update is local)
    a rank died                          shrink to the survivors (their order kept: rank 0 stays rank 0),
                                         restore this rank's own gradients, try again over the survivors

So a step's update is always a sum over exactly the ranks alive when it was agreed: what a dead rank had sent
of that step is dropped with the redone reduce, and no survivor has moved on to the next step with a sum the
others do not have. The data positions do not change: each survivor keeps reading its own slice of each global
batch (the dead rank's slices are skipped), so the global batch shrinks with the ranks and the learning rate
stays (the batch policy). After a loss: the write of a checkpoint in flight is abandoned (its staging
directory holds a dead rank's part; committed checkpoints are untouched); fewer ranks than
``distributed.min_replicas`` stop the run after this step with a checkpoint (exit 75); rank 0's death (it
writes the checkpoints and metrics) ends the job on every survivor with exit 1, the last committed checkpoint
standing.

Not handled: a death outside the step's collectives (an evaluation, a checkpoint's final commit, the start-up
or the end), or during the recovery itself, ends the job as without elastic.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import PeerLost, TrainrunError, collective


class Elastic:
    """The step's collectives retried over the survivors of ``comm`` (an elastic
    :class:`trainrun.comm.MPICommunicator`); ``grads``: the flat gradient buffer the reduce sums in place;
    ``checkpoints``: the runner's :class:`trainrun.checkpoint.Checkpointer`; ``resume_hint()``: how to go on
    from the last committed checkpoint."""

    def __init__(self, comm, grads, checkpoints, min_replicas: int, log, resume_hint):
        self.comm, self.grads, self.checkpoints = comm, grads, checkpoints
        self.min_replicas = int(min_replicas)
        self.log, self.resume_hint = log, resume_hint
        self.saved = np.empty_like(grads)      # this rank's own gradients of the step, for a redo
        self.lost: list[int] = []              # the ranks lost so far, by the rank they started with
        self.below: str | None = None          # why the run stops: fewer ranks alive than min_replicas
        self.recoveries: list[float] = []      # seconds from each failed attempt's start to the redo's end

    @property
    def replicas(self) -> int:
        return self.comm.world_size

    def step(self, step: int, run):
        """``run()`` (the reduce and the scalar allreduce; its result returned) once every survivor got through
        it, redone over the survivors after each death."""
        np.copyto(self.saved, self.grads)
        started = None
        while True:
            t0 = time.monotonic()
            ok, out = True, None
            try:
                out = run()
            except PeerLost:
                ok = False
                self.comm.revoke()
            if self.comm.survived(ok):
                if started is not None:
                    self.recoveries.append(time.monotonic() - started)
                    self.log(f"elastic: step {step} redone over {self.replicas} rank(s) "
                             f"{time.monotonic() - started:.2f} s after its reduce first failed")
                return out
            started = t0 if started is None else started
            self._lost(step, self.comm.shrink(), time.monotonic() - t0)
            np.copyto(self.grads, self.saved)

    def _lost(self, step: int, lost: list[int], took: float) -> None:
        """After a shrink: the run's bookkeeping for ``lost`` (by first rank), or the end of the job."""
        self.lost += lost
        n = self.replicas
        names = ", ".join(map(str, lost))
        if 0 in lost:
            saved = self.checkpoints.saved_step
            exc = collective(TrainrunError(
                f"distributed.elastic: rank 0 died during step {step}; it writes the checkpoints and metrics and "
                f"an elastic run does not hand that on yet, so the {n} surviving rank(s) stop. "
                + (f"Checkpoint {saved} stands: {self.resume_hint()}" if saved is not None
                   else "No checkpoint was committed yet: run the same command again")))
            exc.report_here = self.comm.rank == 0      # the lowest survivor says it (the launcher's rank 0 is gone)
            raise exc
        dropped = self.checkpoints.regroup()
        self.log(f"elastic: rank(s) {names} lost during step {step}; {n} replica(s) go on, the step's reduce "
                 f"redone over them (dropped in {took:.2f} s)"
                 + (f"; the write of checkpoint {dropped} in flight abandoned" if dropped is not None else ""))
        if n < self.min_replicas and self.below is None:
            self.below = f"distributed.min_replicas: {n} rank(s) alive, fewer than {self.min_replicas}"
