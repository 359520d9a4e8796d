"""``distributed.elastic``: a lost rank comes back while the job trains on (docs/distributed.md, "Elastic runs":
rejoin).

Open MPI 5.0 cannot connect a separately launched process to a running job here: MPI_Comm_connect between two
``mpirun`` jobs waits forever (each is its own PMIx universe), and the shared runtime that would join them, a
PRRTE DVM (``prte``, then ``mpirun --dvm``), crashes the launching ``mpirun`` (PRRTE 3.0, openpmix/prrte#2364).
So the survivors start the new rank themselves (MPI_Comm_spawn, on a survivor's host: the one with the fewest
ranks, or the one `trainrun rejoin --host` names), when asked to, and take it in once it is set up; a spawn that
fails is said and the job goes on without it::

    ask      `trainrun rejoin RUN` writes a request file into the run directory; rank 0 looks for it (one stat)
             at each agreement of a step (:class:`trainrun.sync.elastic.Elastic`), whose bit tells every survivor
    spawn    after that step, every survivor: MPI_Comm_spawn of the run's own command on its config.yaml
             (:meth:`trainrun.run.heal.Heal.argv`); it returns once the new process started MPI, and the
             survivors train on while it sets itself up (alone: :class:`trainrun.comm.MPICommunicator`'s
             joining mode) and then tells rank 0 it is ready
    admit    rank 0's news in a step's agreement; after that step (DiLoCo: after an outer step, when every
             replica holds the global weights), every survivor: a checkpoint write in flight committed, rank 0
             sends the runner's state (:class:`trainrun.run.heal.Heal`: the parameters, the optimizer state, the
             counters, the data position; DiLoCo's global weights and momentum), and the two sides merge into one
             communicator, the new rank last. It reads the lost rank's slice of each global batch and trains from
             the next step with the others: the global batch is back to the job's first.

The flags ride on the step's agreement (ULFM's, an AND of bits): rank 0 sets a bit to what it saw, every other
rank sets it, so every survivor learns rank 0's news at the same step. A request while no rank is lost is
dropped (said in the log). A death during a spawn or an admission is not survived.
"""

from __future__ import annotations

import time

from .. import faults
from ..errors import TrainrunError, collective


class NotJoined(TrainrunError):
    """A spawned rank whose job ended before it was admitted: it ends too, cleanly (exit 0)."""
    exit_code = 0

    def __init__(self, message: str):
        super().__init__(message)
        collective(self)          # its own: no abort

    def render(self) -> str:
        return f"trainrun: {self.message}"

# the agreement's bits: the step got through; rank 0 saw a request; a spawned rank is set up; ... or died before
OK, REQUEST, READY, GONE = 1, 2, 4, 8


class Rejoin:
    """The rejoin of an :class:`trainrun.sync.elastic.Elastic` (``elastic``); ``heal``: the runner's state
    (:class:`trainrun.run.heal.Heal`; None: no rejoin). A rank that is joining takes its state here."""

    def __init__(self, elastic, heal):
        self.e, self.heal = elastic, heal
        self.first = elastic.comm.world_size    # the ranks the job started with (a joining rank: from its state)
        self.asked = self.ready = self.gone = False    # agreed at the last agreement: rank 0's news (the bits)
        self.spawned: tuple[float, float | None] | None = None    # (when, the request's time) of a rank setting up
        self.joins: list[dict] = []              # each admission's times (rank 0's), for the log and the benchmark
        if elastic.comm.joining:
            self._join()

    # ------------------------------------------------------------------ the agreement's bits
    def flags(self, ok: bool) -> int:
        """This rank's bits for the step's agreement."""
        comm, f = self.e.comm, OK if ok else 0
        if comm.rank != 0:
            return f | REQUEST | READY | GONE
        if self.heal is None:
            return f
        if self.spawned is None and self.heal.requested():
            f |= REQUEST
        ready = comm.joiner_ready() if self.spawned is not None else None
        if ready is not None:
            f |= READY if ready >= 0 else GONE
        return f

    def noted(self, flags: int) -> None:
        self.asked, self.ready, self.gone = bool(flags & REQUEST), bool(flags & READY), bool(flags & GONE)

    # ------------------------------------------------------------------ after a step
    def act(self, step: int) -> bool:
        """Before the step after ``step`` (every survivor alike): spawn where a request was agreed, admit where a
        spawned rank is ready and the policy can take one in; whether either happened.
        ``TRAINRUN_FAULT_WAIT_JOIN=STEP`` (the tests): after that step the survivors wait, agreeing every 50 ms,
        until a lost rank is back."""
        acted = self._act(step)
        while faults.hit("WAIT_JOIN", self.e.comm.rank, step) and len(self.e.comm.members) < self.first:
            time.sleep(0.05)
            t0 = time.monotonic()
            flags = self.e.comm.agreement(self.flags(True))
            if flags is None:
                self.e.shrunk(step, time.monotonic() - t0, "wait for a rank to rejoin")
                continue
            self.noted(flags)
            acted = self._act(step) or acted
        return acted

    def _act(self, step: int) -> bool:
        acted = self.gone or self.asked or self.ready
        if self.gone and self.spawned is not None:
            self.e.comm.forget_spawned()
            self.spawned = None
            self.e.log(f"elastic: the rank spawned to rejoin died before it joined (its error above); "
                       f"{self.e.comm.world_size} replica(s) go on; `trainrun rejoin` asks again")
        if self.asked and self.spawned is None:
            self._spawn(step)
        if self.ready and self.spawned is not None and self.e.sync.joinable():
            self._admit(step)
        self.asked = self.ready = self.gone = False
        return acted

    def _free(self) -> list[int]:
        """The first ranks lost and not back."""
        return [r for r in range(self.first) if r not in self.e.comm.members]

    def _spawn(self, step: int) -> None:
        e, comm = self.e, self.e.comm
        asked_at, host = self.heal.take_request() if comm.rank == 0 else (None, None)
        free = self._free()
        if e.sync.ranks_per_replica > 1:
            e.log(f"elastic: `trainrun rejoin` asked for a rank after step {step}, but a replica here is "
                  f"{e.sync.ranks_per_replica} ranks, and taking a replica of several ranks back is not built yet: "
                  f"nothing to do (`trainrun resume` from a checkpoint restores every replica)")
            return
        if not free:
            e.log(f"elastic: `trainrun rejoin` asked for a rank after step {step}, but none is lost: nothing to do")
            return
        # by default onto the survivors' least loaded host (rank 0's the last choice): Open MPI 5.0.11 may map it
        # onto the lost rank's node, where a spawned rank's MPI_Init fails and takes the job down
        # (open-mpi/ompi#13427; docs/distributed.md)
        hosts = [str(h) for h in comm.allgather_object(comm.hostname)]
        host = host or min(hosts, key=lambda h: (hosts.count(h), -hosts.index(h)))
        t0 = time.monotonic()
        failed = comm.spawn(self.heal.argv(), host)
        if failed:
            e.log(f"elastic: spawning a rank after step {step} to take rank {free[0]}'s place failed "
                  f"({failed}; on {host or 'a host of the job'}); {comm.world_size} replica(s) go on; "
                  f"`trainrun rejoin` asks again")
            return
        self.spawned = (time.time(), asked_at)
        e.log(f"elastic: a rank spawned after step {step} to take rank {free[0]}'s place (in "
              f"{time.monotonic() - t0:.2f} s" + (f", on {host}" if comm.rank == 0 and host else "")
              + "); it joins once it is set up")

    def _admit(self, step: int) -> None:
        e, comm = self.e, self.e.comm
        t0 = time.monotonic()
        setup_s = comm.joiner_ready()           # rank 0's: the seconds the new rank took to start and set up
        e.checkpoints.finish()       # a write in flight committed first: it counts the ranks that wrote it
        slot = self._free()[0]
        meta, arrays = self.heal.state()
        meta.update(slot=slot, members=comm.members, first_world=self.first)
        comm.admit(meta, arrays)
        e.checkpoints.regroup()
        e.sync.regroup()
        spawned_at, asked_at = self.spawned
        self.spawned = None
        now = time.time()
        took = {"step": step, "admit_s": round(time.monotonic() - t0, 3), "since_spawn_s": round(now - spawned_at, 3),
                **({"setup_s": round(setup_s, 3)} if setup_s is not None else {}),
                **({"since_request_s": round(now - asked_at, 3)} if asked_at is not None else {})}
        self.joins.append(took)
        e.log(f"elastic: rank {comm.world_size - 1} joined after step {step} in first rank {slot}'s place, healed "
              f"from rank 0 over MPI; {comm.world_size} replica(s) train step {step + 1} (state sent and merged in "
              f"{took['admit_s']:.2f} s; spawned {took['since_spawn_s']:.1f} s before"
              + (f", set up in {setup_s:.1f} s" if setup_s is not None else "")
              + (f"; asked {took['since_request_s']:.1f} s before" if asked_at is not None else "") + ")")

    # ------------------------------------------------------------------ the joining rank
    def _join(self) -> None:
        """This rank was spawned by a job's survivors: say it is set up, wait to be admitted, take the state."""
        comm = self.e.comm
        comm.announce(self.heal.setup_s())
        meta = comm.join(self.heal.buffers)
        if meta is None:
            raise NotJoined("the job ended before this rank could join it (it was spawned to rejoin an elastic "
                            "job; nothing to do)")
        self.first = int(meta["first_world"])
        self.heal.apply(meta)
        self.e.checkpoints.regroup()
        self.e.sync.regroup()
