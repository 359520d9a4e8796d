"""How the ranks' work is synchronised (``distributed.sync``): every step, or DiLoCo's rounds of local steps
with an outer step between them, as one component the runner's step calls.

:func:`build` (every rank, a collective) returns :class:`EveryStep` or :class:`DiLoCo`. Its interface::

    comm                     the ranks whose gradients the step reduces (trainrun.update.build is given it)
    replica, replicas        this rank's replica and how many there are (the step's scalar allreduce carries
                             one gradient norm per replica: each replica clips on its own)
    attach(engine, shard, total_steps)   after the update is built: the round's start weights taken
    maybe_outer_step(step)   after every optimizer step: an outer step where a round ends; its log line or None
    global_weights()         a context in which the engine's parameters are the global weights (evaluation)
    full_state(), restore_state(), state_dict(), load_state_dict(state, ckpt)   the checkpoint's part
    close()

DiLoCo (Douillard et al., 2023). The world's ranks form replicas: ``distributed.diloco.group`` consecutive
world ranks each, or (group 0) the ranks of one node (:func:`trainrun.comm.split_nodes`). A replica is what
``every_step`` training is on its ranks: its gradients reduced every step among them (shared memory, ZeRO-1,
overlap, as configured), its own inner optimizer and state. Every ``inner_steps`` steps, and at the run's
last step, the outer step:

    outer gradient    Δ = θ_start - θ_replica               (this replica's; θ_start: the round's start weights)
    mean              Δ̄ = Σ_replicas Δ / replicas          (one allreduce among the replicas' corresponding
                                                            ranks, fp32 or bf16 on the wire with fp32 sums)
    outer SGD         b = μ b + Δ̄;  d = Δ̄ + μ b (Nesterov) or b;  θ_start -= lr d
                      (torch.optim.SGD with dampening 0; momentum 0: d = Δ̄)
    every replica     θ_replica = θ_start

The inner optimizer's state is kept across rounds, as the paper does. The global weights θ_start and the
momentum b are kept in fp32 for this rank's part of the parameters only (the part its update owns,
``shard.lo:shard.hi``: the node's slice with shared memory, the ZeRO-1 part), so a replica holds them once;
the new weights reach the rest of the replica as the step's own update does (``shard.gather``). The outer
gradient is formed in the gradient buffer, free between two steps.

Checkpoints hold the global weights and the momentum (optimizer.safetensors ``outer_weights/``,
``outer_momentum/``), the round's start step (state.json ``diloco``) and, mid-round, each other replica's
weights and inner optimizer state (``replica<j>_weights/``, ``replica<j>_<state>/``; replica 0's are the
checkpoint's parameters and optimizer state): a resume continues the round bit for bit. A resume onto another
number of replicas is refused.
"""

from __future__ import annotations

import contextlib
import functools
import time

import numpy as np

from . import checkpoint as K
from . import update, wire
from .comm import MPICommunicator, split_nodes
from .errors import UsageError, collective
from .flat import norm_sq

def build(cfg, comm):
    """The synchronisation of ``distributed.sync`` on ``comm`` (the world; every rank calls it)."""
    if cfg.distributed.sync != "diloco":
        return EveryStep(comm)
    return DiLoCo.split(cfg.distributed.diloco, comm)


class EveryStep:
    """Data parallel: every step reduces over every rank; nothing between steps."""

    replica, replicas = 0, 1
    state: dict = {}

    def __init__(self, comm):
        self.comm = comm

    def attach(self, engine, shard, total_steps: int) -> None:
        pass

    def maybe_outer_step(self, step: int) -> dict | None:
        return None

    def global_weights(self):
        return contextlib.nullcontext()

    def full_state(self) -> dict:
        return {}

    def restore_state(self) -> dict:
        return {}

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        pass

    def describe(self) -> str | None:
        return None

    def close(self) -> None:
        pass


class DiLoCo:
    """Replicas that synchronise at outer steps (see the module's docstring)."""

    def __init__(self, cfg_diloco, world, comm, cross, replica: int, replicas: int):
        self.cfg, self.world = cfg_diloco, world
        self.comm, self.cross = comm, cross          # this replica's ranks; the replicas' corresponding ranks
        self.replica, self.replicas = replica, replicas
        self.wire = wire.make(cross, cfg_diloco.outer_dtype)
        self.round_start = 0          # the step the current round started at (its outer step, or 0)
        self.fresh = True             # the replica's weights are the global weights (no inner step since)
        self.rounds = 0
        self.state: dict = {}

    @classmethod
    def split(cls, k, world) -> "DiLoCo":
        """The replicas of ``world`` (every rank calls it): ``k.group`` consecutive ranks each, or the nodes."""
        if not isinstance(world, MPICommunicator) or world.world_size == 1:
            raise collective(UsageError(
                f"distributed.sync: diloco needs several replicas; this run has {world.world_size} rank(s) "
                f"(launch with mpirun, distributed.diloco.group ranks per replica)"))
        if k.group:
            if world.world_size % k.group:
                raise collective(UsageError(
                    f"distributed.diloco.group: {k.group} ranks per replica do not divide the {world.world_size} "
                    f"ranks of the run"))
            comm = world.split(world.rank // k.group, "replica")
        else:
            comm = split_nodes(world, update.ranks_per_node(world.world_size))[0]
            comm.what = "replica"
        sizes = world.allgather_object(comm.world_size)
        replicas = world.world_size // comm.world_size
        if len(set(sizes)) != 1 or replicas < 2:
            comm.close()
            why = (f"replicas of unequal sizes ({sorted(set(sizes))} ranks)" if len(set(sizes)) != 1 else
                   f"one replica of {comm.world_size} rank(s)")
            raise collective(UsageError(
                f"distributed.diloco.group: {k.group or 'the ranks of one node'} gives {why} on "
                f"{world.world_size} rank(s); diloco needs at least 2 replicas of equal size"))
        cross = world.split(comm.rank, "replicas")
        replica = comm.allgather_object(cross.rank)[0]       # the replica's first rank's place among the replicas
        return cls(k, world, comm, cross, replica, replicas)

    def describe(self) -> str:
        k = self.cfg
        nesterov = ", Nesterov" if k.outer.nesterov else ""
        return (f"diloco: {self.replicas} replicas of {self.comm.world_size} rank(s), an outer step every "
                f"{k.inner_steps} step(s) (outer SGD lr {k.outer.lr:g}, momentum {k.outer.momentum:g}{nesterov}, "
                f"{k.outer_dtype} on the wire)")

    def attach(self, engine, shard, total_steps: int) -> None:
        """The round's start weights from the engine's parameters (this rank's part ``shard.lo:hi``)."""
        self.engine, self.shard, self.total_steps = engine, shard, total_steps
        self.lo, self.hi = shard.lo, shard.hi
        self.weights = np.array(engine.params[self.lo:self.hi], np.float32)
        self.momentum = np.zeros(self.hi - self.lo, np.float32)
        self.state = {"outer_weights": self.weights, "outer_momentum": self.momentum}
        self._backup = None

    # ------------------------------------------------------------------ the outer step
    def maybe_outer_step(self, step: int) -> dict | None:
        """After optimizer step ``step`` (every rank): the outer step where the round ends (every
        ``inner_steps`` steps, and at the run's last step); its metrics, else None."""
        if step % self.cfg.inner_steps and step != self.total_steps:
            self.fresh = False
            return None
        t0 = time.perf_counter()
        params, lo, hi = self.engine.params, self.lo, self.hi
        delta = self.engine.grads[:hi - lo]          # free until the next step's backward pass
        np.subtract(self.weights, params[lo:hi], out=delta)
        drift_sq, weights_sq = norm_sq(delta), norm_sq(self.weights)
        sent = self.wire.sent_bytes
        t1 = time.perf_counter()
        self.wire.allreduce_(delta)
        waited = time.perf_counter() - t1
        delta *= np.float32(1.0 / self.replicas)
        self._outer_sgd(delta)
        params[lo:hi] = self.weights
        self.shard.gather()
        self.round_start, self.fresh = step, True
        self.rounds += 1
        # one part of each replica counts (the ranks whose parts are distinct), every rank its wait
        counts = float(self._distinct_part())
        drift_sq, weights_sq, waited_sum = self.world.allreduce_scalars(
            [counts * drift_sq, counts * weights_sq, waited], op="sum")
        return {"outer_bytes": self.wire.sent_bytes - sent,
                "outer_wait_s": round(waited_sum / self.world.world_size, 6),
                "outer_drift": float(np.sqrt(drift_sq / max(weights_sq, 1e-30))),
                "outer_s": round(time.perf_counter() - t0, 6)}

    def _outer_sgd(self, g: np.ndarray) -> None:
        """torch.optim.SGD's step (dampening 0, no weight decay) on the global weights with gradient ``g``
        (overwritten)."""
        o = self.cfg.outer
        mu = np.float32(o.momentum)
        if o.momentum:
            b = self.momentum
            b *= mu
            b += g
            if o.nesterov:
                g += mu * b
            else:
                g[...] = b
        self.weights -= np.float32(o.lr) * g

    def _distinct_part(self) -> bool:
        """Whether this rank's part of the replica's parameters is counted (each part once per replica)."""
        s = self.shard
        if not s.sharded:
            return s.comm.rank == 0
        return bool(s.cross_counts) or s.cross.rank == 0

    def _shared_barrier(self) -> None:
        """With the node's parameters in shared memory: every local rank is done reading them."""
        s = self.shard
        if s.sharded and len(s.peers) > 1:
            s.local.barrier()

    @contextlib.contextmanager
    def global_weights(self):
        """The engine's parameters are the global weights inside (every rank): evaluation mid-round."""
        if self.fresh:
            yield
            return
        params, lo, hi = self.engine.params, self.lo, self.hi
        if self._backup is None:
            self._backup = np.empty(hi - lo, np.float32)
        self._shared_barrier()
        self._backup[...] = params[lo:hi]
        params[lo:hi] = self.weights
        self.shard.gather()
        try:
            yield
        finally:
            self._shared_barrier()
            params[lo:hi] = self._backup
            self.shard.gather()

    # ------------------------------------------------------------------ checkpoints
    def _replica_states(self) -> list[str]:
        """What each replica holds of its own: its weights and its inner optimizer's states."""
        return ["weights", *self.shard.state]

    def full_state(self) -> dict:
        """The outer state and (mid-round) each other replica's weights and inner optimizer state, as the
        checkpoint writer takes optimizer states: whole buffers on rank 0, or functions whose generators
        gather them in pieces (every rank runs each to its end)."""
        s = self.shard
        out = {name: functools.partial(s._gather, buf) if s.sharded else buf for name, buf in self.state.items()}
        if not self.fresh:
            out.update({f"replica{j}_{name}": functools.partial(self._replica_pieces, j, name)
                        for j in range(1, self.replicas) for name in self._replica_states()})
        return out

    def _replica_pieces(self, j: int, name: str):
        """Replica ``j``'s ``name`` ("weights" or an inner optimizer state) on world rank 0, in pieces: within
        replica ``j`` on its first rank (every rank of a replica holds all of its weights after a step; a
        partitioned state is gathered there piece by piece, :meth:`trainrun.update.Partitioned.full_state`),
        then from that rank to world rank 0 over the replicas' first ranks."""
        s, mine = self.shard, self.replica == j
        whole = self.engine.params if name == "weights" else None if s.sharded else s.state[name]
        parts = s._gather(s.state[name]) if mine and whole is None else None
        if self.comm.rank != 0:
            for _ in parts or ():      # this rank's part of its replica's gather
                pass
            return
        n = self.engine.params.size
        step = min(update._GATHER_CHUNK, n)         # the pieces Partitioned's gather yields
        root = self.cross.rank == 0
        out = np.empty(step, np.float32) if root else None
        none = np.empty(0, np.float32)
        for c0 in range(0, n, step):
            c1 = min(c0 + step, n)
            counts = [0] * self.cross.world_size
            counts[j] = c1 - c0
            piece = (whole[c0:c1] if whole is not None else next(parts)) if mine else none
            self.cross.gather(piece, out[:c1 - c0] if root else None, counts, root=0)
            if root:
                yield out[:c1 - c0]

    def restore_state(self) -> dict:
        """The buffers a restore fills (``lo:hi`` of the saved tensors), and the states it only checks (None:
        the other replicas', read by :meth:`load_state_dict`)."""
        return {**self.state, **{f"replica{j}_{name}": None for j in range(1, self.replicas)
                                 for name in self._replica_states()}}

    def state_dict(self) -> dict:
        return {"round_start": self.round_start, "replicas": self.replicas, "group": self.comm.world_size,
                "rounds": self.rounds, "mid_round": not self.fresh}

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        """After the checkpoint's tensors were restored (every rank): the round's position, and this
        replica's own weights and inner optimizer state where the checkpoint was taken mid-round."""
        saved = state.get("diloco")
        if not saved:
            raise collective(UsageError(
                f"{ckpt}: was saved with distributed.sync every_step; it holds no outer state for diloco"))
        if saved["replicas"] != self.replicas:
            raise collective(UsageError(
                f"distributed.diloco.group: {ckpt} was saved by {saved['replicas']} replicas of {saved['group']} "
                f"rank(s), this launch makes {self.replicas} of {self.comm.world_size}; a resume continues the "
                f"replicas' rounds: launch {saved['replicas']} replicas (mpirun -np and distributed.diloco.group)"))
        self.round_start, self.rounds, self.fresh = saved["round_start"], saved["rounds"], not saved["mid_round"]
        if self.fresh or self.replica == 0:
            return
        layout, params, lo, hi = self.engine.layout, self.engine.params, self.lo, self.hi
        host = np.empty(params.size, np.float32)
        self._shared_barrier()      # every local rank's restore of the parameters is done
        with K.reading(ckpt) as held:
            for name in self._replica_states():
                K.load_tensors_into(held, "optimizer.safetensors", layout.names, layout.shapes, host,
                                    prefix=f"replica{self.replica}_{name}/")
                (params[lo:hi] if name == "weights" else self.shard.state[name])[...] = host[lo:hi]
        self.shard.gather()

    def close(self) -> None:
        self.cross.close()
        self.comm.close()
