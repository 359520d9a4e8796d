"""The sync policy (``distributed.sync``): how the ranks' work is synchronised around the step, as one
interface the runner's step calls whatever the mode (:class:`Policy`). Every-step data parallelism is here
(:class:`EveryStep`); DiLoCo's replicas and outer steps in :mod:`trainrun.sync.diloco`, whose ``build`` picks
one (every rank, a collective). The interface::

    world, comm              every rank; the ranks whose gradients the step reduces (``update.build`` is given it)
    replica, replicas        this rank's replica and how many there are
    world_step(step, end, agree)   whether ``step``'s scalars are summed over the world (else: the replica's)
    scalars(loss_sum, norm_part, carried)   the step's ONE scalar allreduce: the loss, the gradient norm (one
                             per replica: each replica clips on its own), whether it is finite, what the
                             runner carries with it (checkpoint progress, stop flags)
    attach(engine, shard, total_steps)   after the update is built
    maybe_outer_step(step)   after every optimizer step: an outer step where a round ends; its log line or None
    global_weights()         a context in which the engine's parameters are the global weights (evaluation)
    full_state(), restore_state(saved), state_dict(), load_state_dict(state, ckpt)   the checkpoint's part,
                             registered without a key (:meth:`trainrun.checkpoint.Checkpointer.register`): it
                             writes and reads state.json's ``diloco`` itself
    describe(), advice(cold_start), close()
    elastic, regroup()       ``distributed.elastic``: the :class:`trainrun.sync.elastic.Elastic` that runs the policy's
                             own collectives (:meth:`Policy.agreed`), and what follows a shrink of the world
    ranks_per_replica        ... the ranks a death drops together (a lost rank's replica mates leave with it)
    joinable(), rejoined(saved)   ... when a rank that rejoins can be taken in, and its place in the schedule
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys

from .diloco_state import load_part, outer_state


@dataclasses.dataclass
class Scalars:
    """The step's scalars, summed over the ranks of :attr:`ranks` (the world, or at DiLoCo's steps between two
    world steps this rank's replica)."""
    loss_sum: float                 # the ranks' summed losses
    ranks: int                      # how many ranks summed them
    norm_sq: float                  # this replica's squared gradient norm (as the gradient buffer holds it)
    finite: bool                    # every replica's norm finite (NaN and inf propagate through the sum)
    carried: list[float] | None     # what the runner carried, summed over the world; None at a replica's own


class Policy:
    """What every sync policy shares: the step's scalars, over the world or over this rank's replica."""

    replica, replicas = 0, 1
    elastic = None      # distributed.elastic: its Elastic (set by it)

    def __init__(self, world, comm):
        self.world, self.comm = world, comm

    @property
    def ranks_per_replica(self) -> int:
        """``distributed.elastic``: the ranks of a replica, first ranks ``r // n`` together (every-step: one)."""
        return 1

    def agreed(self, step: int, run, what: str, again=None):
        """``run()``, collectives on the world only; under ``distributed.elastic`` redone over the survivors of
        a rank lost in them, ``again()`` first (:meth:`trainrun.sync.elastic.Elastic.agreed`)."""
        return run() if self.elastic is None else self.elastic.agreed(step, run, again=again, what=what)

    def regroup(self) -> None:
        """``distributed.elastic``: the world shrank to the survivors of a lost rank, or took a rank back (every
        rank calls it)."""

    def joinable(self) -> bool:
        """``distributed.elastic``: a rank that rejoins can be taken in after this step."""
        return True

    def rejoined(self, saved: dict | None) -> None:
        """``distributed.elastic``, the rank that rejoined: its place in the policy's schedule, from rank 0's
        :meth:`state_dict` (its tensors, :attr:`state`, came with the parameters)."""

    def world_step(self, step: int, end: int, agree: bool) -> bool:
        """Whether ``step``'s scalars are summed over the world (``end``: the session's last step; ``agree``:
        the world must agree at this step whatever the schedule)."""
        return True

    def scalars(self, loss_sum: float, norm_part: float, carried: list[float] | None = None) -> Scalars:
        """ONE allreduce of a few scalars: this rank's loss sum, its share of the squared gradient norm and
        (``carried`` not None: a world step) what the runner carries, over the world, one norm per replica;
        or (``carried`` None) the loss and the norm over this rank's replica alone."""
        if carried is None:
            comm = self.comm
            loss_total, norm_sq = comm.allreduce_scalars([loss_sum, norm_part], op="sum") \
                if comm.world_size > 1 else (loss_sum, norm_part)
            return Scalars(loss_total, comm.world_size, norm_sq, math.isfinite(norm_sq), None)
        norms = [0.0] * self.replicas       # each replica's squared norm (DiLoCo: each clips its own)
        norms[self.replica] = norm_part
        loss_total, *rest = self.world.allreduce_scalars([loss_sum, *carried, *norms], op="sum")
        summed, norms = rest[:len(carried)], rest[len(carried):]
        return Scalars(loss_total, self.world.world_size, norms[self.replica], all(map(math.isfinite, norms)),
                       summed)


class EveryStep(Policy):
    """Data parallel: every step reduces over every rank; nothing between steps. Resumed from a DiLoCo
    checkpoint (``resume --force --set distributed.sync=every_step``) it continues from the global weights,
    those export and evaluate read (mid-round the checkpoint's parameters are replica 0's), and drops the
    outer state, saying so in one line."""

    state: dict = {}

    def __init__(self, comm):
        super().__init__(comm, comm)

    def attach(self, engine, shard, total_steps: int) -> None:
        self.engine, self.shard = engine, shard

    def maybe_outer_step(self, step: int) -> dict | None:
        return None

    def global_weights(self):
        return contextlib.nullcontext()

    def full_state(self) -> dict:
        return {}

    def restore_state(self, saved: dict | None = None) -> dict:
        """A DiLoCo checkpoint's outer states: taken (None: read here or not at all), so not listed as dropped."""
        if not (saved or {}).get("diloco"):
            return {}
        return {name: None for name in saved.get("optimizer_states", ()) if outer_state(name)}

    def state_dict(self) -> dict:
        return {"diloco": None}

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        """A DiLoCo checkpoint taken mid-round: the global weights in place of replica 0's; the line saying it."""
        saved = state.get("diloco")
        if not saved:
            return
        if saved["mid_round"]:
            load_part(ckpt, "outer_weights/", self.engine, self.shard)
            self.shard.gather()
        if self.comm.rank == 0:
            print("trainrun: warning: distributed.sync every_step resumes a DiLoCo checkpoint " + (
                  "taken mid-round: training continues from its global weights (those export and evaluate use), "
                  "not replica 0's; the replicas' own weights and the outer state are dropped" if saved["mid_round"]
                  else "taken at an outer step: training continues from its weights (the global weights); the "
                  "outer state is dropped"), file=sys.stderr, flush=True)

    def describe(self) -> str | None:
        return None

    def advice(self, cold_start: bool) -> str | None:
        return None

    def close(self) -> None:
        pass
