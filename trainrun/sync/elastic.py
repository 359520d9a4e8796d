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
``distributed.min_replicas`` stop the run after this step with a checkpoint (exit 75). Rank 0 writes the
checkpoints' shared files, metrics.jsonl, TensorBoard and the run's end: at its death the lowest survivor (rank 0
of the shrunk communicator) takes that over (:meth:`trainrun.run.heal.Heal.take_over_writing`) and the run goes
on.

DiLoCo (``distributed.sync: diloco``): with one rank per replica the replicas are the world, so a shrink is
theirs too (:meth:`trainrun.sync.policy.Policy.regroup`); the policy runs its outer exchange and its log line
through :meth:`Elastic.agreed` (the outer gradient formed again before a redo), so the outer step averages
over the replicas alive at it. Between world steps a replica's step talks to no other replica, and nothing is
agreed then. Replicas of several ranks (``diloco.group`` > 1): a rank's death drops its whole replica. Its
replica mates learn of it in the replica's own reduce (between world steps), or at the shrink (ranks ``r // group``
with one missing); either way they end, cleanly (:meth:`Elastic.leave`: exit 0, no MPI_Finalize) and, at a
shrink, after splitting off (:meth:`trainrun.comm.MPICommunicator.drop`), so that the whole replicas go on
without another failure; the replicas' corresponding ranks are split again (DiLoCo's ``regroup``). A rank of
such a run is not taken back (`trainrun rejoin` says so).

A lost rank can come back (:mod:`trainrun.sync.rejoin`): every agreement also carries rank 0's news of a
request (`trainrun rejoin RUN`) and of a spawned rank that is set up; :meth:`Elastic.after_step` acts on them.

Not handled: a death outside the step's collectives (an evaluation, a checkpoint's final commit, the start-up
or the end), or during the recovery or an admission, ends the job as without elastic.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import PeerLost
from .rejoin import OK, Rejoin


class Elastic:
    """The step's collectives retried over the survivors of ``comm`` (an elastic
    :class:`trainrun.comm.MPICommunicator`); ``grads``: the flat gradient buffer the reduce sums in place;
    ``checkpoints``: the runner's :class:`trainrun.checkpoint.Checkpointer`; ``heal``: the runner's side
    (:class:`trainrun.run.heal.Heal`: the state a rank that rejoins takes here, from the job's rank 0; the
    handoff of rank 0's writing)."""

    def __init__(self, comm, grads, checkpoints, sync, min_replicas: int, log, heal=None):
        self.comm, self.grads, self.checkpoints, self.sync = comm, grads, checkpoints, sync
        sync.elastic = self         # the sync policy's own collectives (DiLoCo's outer step) go through agreed()
        self.min_replicas = int(min_replicas)
        self.log = log
        self.saved = np.empty_like(grads)      # this rank's own gradients of the step, for a redo
        self.lost: list[int] = []              # the ranks lost so far, by the rank they started with
        self.below: str | None = None          # why the run stops: fewer ranks alive than min_replicas
        self.recoveries: list[float] = []      # seconds from each failed attempt's start to the redo's end
        self.rejoin = Rejoin(self, heal)
        self.heal = heal

    @property
    def replicas(self) -> int:
        return self.comm.world_size // self.sync.ranks_per_replica

    def step(self, step: int, run, world: bool = True):
        """``run()`` (the reduce and the scalar allreduce; its result returned) once every survivor got through
        it, redone over the survivors after each death, this rank's own gradients restored first. Not ``world``
        (DiLoCo between two world steps: each replica on its own): ``run()`` talks to this rank's replica only,
        and a death there ends the replica's other ranks (:meth:`leave`); the other replicas learn of it at
        their next world step."""
        if not world:
            try:
                return run()
            except PeerLost:      # a rank of this replica died in its own reduce: the replica leaves whole
                self.leave(step, self.comm.members[self.comm.rank], "a rank of it died, seen in the replica's own reduce")
        np.copyto(self.saved, self.grads)
        return self.agreed(step, run, again=lambda: np.copyto(self.grads, self.saved))

    def agreed(self, step: int, run, again=None, what: str = "reduce"):
        """``run()`` (collectives only; its result returned) once every survivor got through it: after each
        death the survivors shrink, ``again()`` puts back what ``run`` overwrote, and ``run()`` is redone over
        them. ``what``: the step's part that ``run`` is, for the log lines ("reduce", "outer step")."""
        started = None
        while True:
            t0 = time.monotonic()
            ok, out = True, None
            try:
                out = run()
            except PeerLost:
                ok = False
                self.comm.revoke()
            flags = self.comm.agreement(self.rejoin.flags(ok))
            if flags is not None and flags & OK:
                self.rejoin.noted(flags)
                if started is not None:
                    self.recoveries.append(time.monotonic() - started)
                    done = f"step {step}" if what == "reduce" else f"step {step}'s {what}"
                    self.log(f"elastic: {done} redone over {self.replicas} rank(s) "
                             f"{time.monotonic() - started:.2f} s after its {what} first failed")
                return out
            started = t0 if started is None else started
            self._lost(step, time.monotonic() - t0, what)
            if again is not None:
                again()

    def before_step(self, step: int) -> bool:
        """Before the step after ``step`` (all that follows ``step`` done: its metrics line, evaluation,
        checkpoint), every rank: a rank spawned or admitted where the last agreement said so
        (:meth:`trainrun.sync.rejoin.Rejoin.act`); whether anything was. A rank that rejoined enters the job's
        collectives here, before its first step's: from now on it acts with the others (a spawn, an admission,
        the tests' wait for a rank to rejoin all run collectives over the whole job)."""
        if self.comm.joining:
            self.comm.enter()
        return self.rejoin.act(step)

    def shrunk(self, step: int, took: float, what: str) -> None:
        """A rank died in an agreement outside :meth:`agreed` (the rejoin's own): the survivors shrink."""
        self._lost(step, took, what)

    def _lost(self, step: int, took: float, what: str) -> None:
        """The survivors shrink; the run's bookkeeping for the ranks lost (by first rank); the writing handed on
        where rank 0 was among them."""
        writer = self.comm.members[0]       # rank 0 now, by the rank it started with
        t0 = time.monotonic()
        lost = self.comm.shrink()
        # replicas of several ranks: a lost rank's replica mates leave with it, the whole replicas go on
        k = self.sync.ranks_per_replica
        alive = [m // k for m in self.comm.members]
        leaving = [m for m in self.comm.members if alive.count(m // k) < k]
        me = self.comm.members[self.comm.rank]
        if me in leaving and self.heal is not None:
            self.heal.let_go()      # before the split: the others take over what it wrote only after it
        if leaving and self.comm.drop(leaving):
            self.leave(step, me, f"rank(s) {', '.join(map(str, lost))} of it lost")
        took += time.monotonic() - t0
        self.lost += lost + leaving
        n = self.replicas
        names = ", ".join(map(str, lost)) + (f" (rank(s) {', '.join(map(str, leaving))}, their replica mates, left "
                                             f"with them)" if leaving else "")
        dropped = self.checkpoints.regroup()
        self.sync.regroup()
        if writer in lost + leaving and self.heal is not None:
            self.heal.take_over_writing(step)
        self.log(f"elastic: rank(s) {names} lost during step {step}; {n} replica(s) go on, the step's {what} "
                 f"redone over them (dropped in {took:.2f} s)"
                 + (f"; the write of checkpoint {dropped} in flight abandoned" if dropped is not None else ""))
        if n < self.min_replicas and self.below is None:
            self.below = f"distributed.min_replicas: {n} rank(s) alive, fewer than {self.min_replicas}"

    def leave(self, step: int, me: int, why: str) -> None:
        """This rank's replica is broken (a rank of it died): it ends here, cleanly (exit 0: its output flushed, no
        MPI_Finalize, nothing more written), and the other replicas go on without it."""
        if self.heal is not None:
            self.heal.let_go()
        print(f"elastic: this rank (launched as rank {me}) leaves with its replica: {why} during step {step}; the "
              f"other replicas go on", flush=True)
        self.comm.leave()
