"""DiLoCo's part of a checkpoint (:mod:`trainrun.sync.diloco`), apart from its algorithm: the global weights
and the outer momentum (optimizer.safetensors ``outer_weights/``, ``outer_momentum/``; with an exchange in the
background ``outer_sent/``, ``outer_summed/``), the round's position (state.json ``diloco``) and, mid-round,
each other replica's weights and inner optimizer state (``replica<j>_weights/``, ``replica<j>_<state>/``;
replica 0's are the checkpoint's parameters and optimizer state), gathered to world rank 0 in pieces as
they are written; and the resume onto the same replicas (another number of replicas refused; an every-step
run's checkpoint starting the first round)."""

from __future__ import annotations

import functools

import numpy as np

from .. import checkpoint as K
from ..errors import UsageError, collective
from . import update


def outer_state(name: str) -> bool:
    """Whether ``name``, an optimizer state of a checkpoint, is DiLoCo's (the outer state, the other
    replicas' weights and inner states) rather than the inner optimizer's."""
    return name.startswith("outer_") or (name.startswith("replica") and name[7:].partition("_")[0].isdigit())


def load_part(ckpt, prefix: str, engine, shard, buf=None) -> None:
    """This rank's part ``shard.lo:hi`` of the tensors under ``prefix`` in the checkpoint's
    optimizer.safetensors into ``buf`` (None: the engine's parameters, then gathered to every rank)."""
    layout, params, lo, hi = engine.layout, engine.params, shard.lo, shard.hi
    host = np.empty(params.size, np.float32)
    if buf is None:
        shard.node_barrier()      # every local rank's restore of the parameters is done
    with K.reading(ckpt) as held:
        K.load_tensors_into(held, "optimizer.safetensors", layout.names, layout.shapes, host, prefix=prefix)
    (params[lo:hi] if buf is None else buf)[...] = host[lo:hi]


class DiLoCoState:
    """The checkpoint's part of a :class:`trainrun.sync.diloco.DiLoCo` (``d``): what it saves, what a restore
    fills, and the round's position."""

    def __init__(self, d):
        self.d = d

    def _replica_states(self) -> dict:
        """What each replica holds of its own: its weights (None: the engine's parameters), its inner
        optimizer's states and, with an exchange in the background, the outer gradient it sent (this rank's
        part of each)."""
        d = self.d
        own = {"weights": None, **d.shard.state}
        if d.cfg.overlap_steps:
            own["outer_sent"] = d.sent
        return own

    def full_state(self) -> dict:
        """The outer state and (mid-round) each other replica's weights and inner optimizer state, as the
        checkpoint writer takes optimizer states: whole buffers on rank 0, or functions whose generators
        gather them in pieces (every rank runs each to its end)."""
        d = self.d
        if d.background:         # an exchange in flight: its sums are part of the state
            d.background.wait()
        out = {name: d.shard.for_checkpoint(buf) for name, buf in d.state.items()}
        if not d.fresh:
            out.update({f"replica{j}_{name}": functools.partial(self._replica_pieces, j, name)
                        for j in range(1, d.replicas) for name in self._replica_states()})
        return out

    def _replica_pieces(self, j: int, name: str):
        """Replica ``j``'s ``name`` ("weights" or an inner optimizer state) on world rank 0, in pieces
        (:func:`trainrun.sync.update.pieces`): within replica ``j`` on its first rank (every rank of a replica
        holds all of its weights after a step; a partitioned state is gathered there piece by piece,
        ``shard.gather_pieces``), then from that rank to world rank 0 over the replicas' first ranks."""
        d = self.d
        s, mine, buf = d.shard, d.replica == j, self._replica_states()[name]
        whole = d.engine.params if name == "weights" else None if s.sharded else buf
        parts = s.gather_pieces(buf) if mine and whole is None else None
        if d.comm.rank != 0:
            for _ in parts or ():      # this rank's part of its replica's gather
                pass
            return
        n = d.engine.params.size
        root = d.cross.rank == 0
        out = np.empty(min(update.PIECE, n), np.float32) if root else None
        none = np.empty(0, np.float32)
        for c0, c1 in update.pieces(n):
            counts = [0] * d.cross.world_size
            counts[j] = c1 - c0
            piece = (whole[c0:c1] if whole is not None else next(parts)) if mine else none
            d.cross.gather(piece, out[:c1 - c0] if root else None, counts, root=0)
            if root:
                yield out[:c1 - c0]

    def restore_state(self, saved: dict | None = None) -> dict:
        """The buffers a restore fills (``lo:hi`` of the saved tensors), and the states it only checks (None:
        the other replicas', read by :meth:`load_state_dict`); none where ``saved`` (the checkpoint's
        state.json) is an every-step run's: DiLoCo starts from it."""
        d = self.d
        if saved is not None and not saved.get("diloco"):
            return {}
        return {**d.state, **{f"replica{j}_{name}": None for j in range(1, d.replicas)
                              for name in self._replica_states()}}

    def state_dict(self) -> dict:
        """state.json's ``diloco``: the round's position."""
        d = self.d
        return {"diloco": {"round_start": d.round_start, "replicas": d.replicas, "group": d.comm.world_size,
                           "rounds": d.rounds, "mid_round": not d.fresh,
                           "in_flight": [*d.pending] if d.pending else None}}

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        """After the checkpoint's tensors were restored (every rank): the round's position, and this
        replica's own weights and inner optimizer state where the checkpoint was taken mid-round."""
        d = self.d
        saved = state.get("diloco")
        if not saved:       # an every-step run's checkpoint: its weights are the global weights of a first round
            d.weights[...] = np.asarray(d.engine.params[d.lo:d.hi], np.float32)
            d.momentum[...] = 0.0
            d.round_start, d.rounds, d.fresh = state["step"], 0, True
            return
        if saved["replicas"] != d.replicas:
            raise collective(UsageError(
                f"distributed.diloco.group: {ckpt} was saved by {saved['replicas']} replicas of {saved['group']} "
                f"rank(s), this launch makes {d.replicas} of {d.comm.world_size}; a resume continues the "
                f"replicas' rounds: launch {saved['replicas']} replicas (mpirun -np and distributed.diloco.group)"))
        d.round_start, d.rounds, d.fresh = saved["round_start"], saved["rounds"], not saved["mid_round"]
        if saved.get("in_flight"):      # an exchange in flight: its sums restored, applied when due
            f, started = saved["in_flight"][:2]      # a third item, the drift, in older checkpoints
            d.pending, d._started = (f, started), None
        if d.fresh or d.replica == 0:
            return
        for name, buf in self._replica_states().items():
            load_part(ckpt, f"replica{d.replica}_{name}/", d.engine, d.shard, buf)
        d.shard.gather()
