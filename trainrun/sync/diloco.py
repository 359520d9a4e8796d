"""How the ranks' work is synchronised (``distributed.sync``): every step, or DiLoCo's rounds of local steps
with an outer step between them, as one component the runner's step calls.

:func:`build` (every rank, a collective) returns :class:`EveryStep` or :class:`DiLoCo`. Its interface::

    comm                     the ranks whose gradients the step reduces (trainrun.sync.update.build is given it)
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

Streaming (``fragments`` F > 1): the model cut into F runs of whole tensors (:func:`fragments`), fragment f's
outer step (f + 1) H / F steps into each round. With ``overlap_steps`` T its exchange runs in the background
(a :class:`trainrun.sync.reducer.BucketReducer`, one bucket per fragment) and is applied T steps later: the
fragment's global weights take the outer SGD step, the replica's fragment becomes them plus what it learned
in those T steps. The run's last step synchronises the whole model.

Checkpoints hold the global weights and the momentum (optimizer.safetensors ``outer_weights/``,
``outer_momentum/``), the round's start step (state.json ``diloco``) and, mid-round, each other replica's
weights and inner optimizer state (``replica<j>_weights/``, ``replica<j>_<state>/``; replica 0's are the
checkpoint's parameters and optimizer state): a resume continues the round bit for bit. A resume onto another
number of replicas is refused. A resume of an every-step run's checkpoint (``resume --force --set
distributed.sync=diloco``) starts DiLoCo there: its weights are the first round's global weights, the outer
momentum zero, its inner optimizer state kept (the paper starts from a pre-trained model).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time

import numpy as np

from .. import checkpoint as K
from . import reducer, update, wire
from ..comm import MPICommunicator, split_nodes
from ..errors import UsageError, collective
from ..step.flat import norm_sq

def build(cfg, comm):
    """The synchronisation of ``distributed.sync`` on ``comm`` (the world; every rank calls it)."""
    if cfg.distributed.sync != "diloco":
        return EveryStep(comm)
    return DiLoCo.split(cfg.distributed.diloco, comm)


# How often the background exchange of an fp32 fragment polls MPI: on 2 pretend nodes its allreduce moved at
# the link's rate polled every 100 us or every 2 ms alike (11 MB at 100 Mbit/s, 77 MB at 1 Gbit/s), while the
# computation beside it kept 69-74% of its speed at a poll every 100 us against 89-100% every 2 ms (100
# Mbit/s; docs/design.md). bf16's two collectives advance only at a poll (every 2 ms: 3-4x slower), so they
# keep trainrun.comm.base.QUIET_SLEEP_S.
EXCHANGE_POLL_S = 2e-3


# What the start-up advice cites (BENCHMARKS.md, "DiLoCo's eval loss at equal tokens" and "DiLoCo across the
# slow link"): 2 replicas, inner_steps 50 and 100, eval loss above every-step training's at equal tokens from
# the initial weights and continuing every-step training's checkpoint; the streamed exchange's scaling
# efficiency at 100 Mbit/s.
COLD_LOSS, WARM_LOSS, STREAMED = "+13-15%", "+4.9-5.5%", "0.97"


def exchange(cross, summed, parts: list[tuple[int, int]], outer_dtype: str) -> reducer.BucketReducer:
    """The background exchange of ``overlap_steps``: one bucket per fragment (``parts`` of ``summed``) summed
    over the replicas (``cross``), polled every :data:`EXCHANGE_POLL_S` with fp32 on the wire."""
    return reducer.BucketReducer(cross, summed, parts, outer_dtype,
                                 poll_s=EXCHANGE_POLL_S if outer_dtype == "fp32" else None)


def fragments(offsets: list[int], total: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ranges of whole tensors (``offsets``: where each tensor starts in a flat buffer of
    ``total`` elements) of about equal size: each cut at the tensor boundary nearest to its share."""
    bounds = [*offsets, total]
    cuts = [0]
    for f in range(1, n):       # leaving a boundary for each fragment after this one
        want = f * total / n
        cuts.append(min((c for c in bounds[:len(bounds) - (n - f)] if c > cuts[-1]), key=lambda c: abs(c - want)))
    cuts.append(total)
    return list(zip(cuts, cuts[1:]))


def outer_state(name: str) -> bool:
    """Whether ``name``, an optimizer state of a checkpoint, is DiLoCo's (the outer state, the other
    replicas' weights and inner states) rather than the inner optimizer's."""
    return name.startswith("outer_") or (name.startswith("replica") and name[7:].partition("_")[0].isdigit())


def shared_barrier(shard) -> None:
    """With the node's parameters in shared memory: every local rank is done reading (or restoring) them."""
    if shard.sharded and len(shard.peers) > 1:
        shard.local.barrier()


def load_part(ckpt, prefix: str, engine, shard, buf=None) -> None:
    """This rank's part ``shard.lo:hi`` of the tensors under ``prefix`` in the checkpoint's
    optimizer.safetensors into ``buf`` (None: the engine's parameters, then gathered to every rank)."""
    layout, params, lo, hi = engine.layout, engine.params, shard.lo, shard.hi
    host = np.empty(params.size, np.float32)
    if buf is None:
        shared_barrier(shard)      # every local rank's restore of the parameters is done
    with K.reading(ckpt) as held:
        K.load_tensors_into(held, "optimizer.safetensors", layout.names, layout.shapes, host, prefix=prefix)
    (params[lo:hi] if buf is None else buf)[...] = host[lo:hi]


class EveryStep:
    """Data parallel: every step reduces over every rank; nothing between steps. Resumed from a DiLoCo
    checkpoint (``resume --force --set distributed.sync=every_step``) it continues from the global weights,
    those export and evaluate read (mid-round the checkpoint's parameters are replica 0's), and drops the
    outer state, saying so in one line."""

    replica, replicas = 0, 1
    state: dict = {}

    def __init__(self, comm):
        self.comm = comm

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

    def state_dict(self) -> dict | None:
        return None

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
                f"{k.outer_dtype} on the wire"
                + (f"; {k.fragments} fragments in turn" if k.fragments > 1 else "")
                + (f", each exchanged over {k.overlap_steps} step(s)" if k.overlap_steps else "") + ")")

    def advice(self, cold_start: bool) -> str | None:
        """One line for the run's start where its config describes a regime the measurements advise against
        (docs/distributed.md, "When to choose DiLoCo"; BENCHMARKS.md): DiLoCo from the initial weights
        (``cold_start``: no resume, no model.init_from) instead of from an every-step checkpoint, and an
        exchange each outer step waits for (``overlap_steps`` 0); None where neither."""
        parts = []
        if cold_start:
            parts.append(f"from the initial weights DiLoCo (inner_steps 50-100) ended {COLD_LOSS} above every-step "
                         f"training's eval loss, from an every-step checkpoint {WARM_LOSS}: train with distributed.sync "
                         f"every_step first, then `trainrun resume RUN --force --set distributed.sync=diloco`")
        if not self.cfg.overlap_steps:
            parts.append(f"each outer step waits for {'the whole model' if self.cfg.fragments == 1 else 'a fragment'}"
                         f" on the link: over a slow link stream it (distributed.diloco.fragments 4, overlap_steps "
                         f"2-6 kept {STREAMED} of linear at 100 Mbit/s; `trainrun doctor` measures the link)")
        return "advice (docs/distributed.md, When to choose DiLoCo): " + "; ".join(parts) if parts else None

    def attach(self, engine, shard, total_steps: int) -> None:
        """The round's start weights from the engine's parameters (this rank's part ``shard.lo:hi``), the
        fragments (this rank's share of each) and, with ``overlap_steps``, the exchange in the background."""
        k = self.cfg
        self.engine, self.shard, self.total_steps = engine, shard, total_steps
        self.lo, self.hi = lo, hi = shard.lo, shard.hi
        self.weights = np.array(engine.params[lo:hi], np.float32)
        self.momentum = np.zeros(hi - lo, np.float32)
        self.state = {"outer_weights": self.weights, "outer_momentum": self.momentum}
        self._backup = None
        # fragment f: elements parts[f] of this rank's part; its outer steps where step % H == offsets[f]
        self.parts = [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo)
                      for a, b in fragments(engine.layout.offsets, engine.layout.total, k.fragments)]
        self.offsets = [(f + 1) * k.inner_steps // k.fragments % k.inner_steps for f in range(k.fragments)]
        self.pending = None        # (fragment, the step its exchange started) of an exchange in flight
        self._started = None       # the wire's bytes sent before it (None: started before a resume), for the log
        self.background = None
        if k.overlap_steps:
            # the fragment's outer gradient, sent (kept: the replica's own) and summed over the replicas
            # written here (not np.zeros' pages mapped at the first touch): a fragment's first exchange would
            # otherwise fault them in on the step that starts it
            self.sent, self.summed = np.full(hi - lo, 0.0, np.float32), np.full(hi - lo, 0.0, np.float32)
            self.state.update(outer_sent=self.sent, outer_summed=self.summed)
            if self.cross.threads_ok():
                self.background = exchange(self.cross, self.summed, self.parts, k.outer_dtype)

    # ------------------------------------------------------------------ the outer step
    def maybe_outer_step(self, step: int) -> dict | None:
        """After optimizer step ``step`` (every rank): the exchange of a fragment that is due (every
        ``inner_steps`` steps, fragment f ``offsets[f]`` steps into the round; with ``overlap_steps`` its
        result applied that many steps later), and at the run's last step every fragment's; its metrics, else
        None."""
        k, last = self.cfg, step == self.total_steps
        if self.pending and (last or step - self.pending[1] >= k.overlap_steps):
            applied = self._apply(step)
        else:
            applied = None
        due = [f for f, o in enumerate(self.offsets) if step % k.inner_steps == o]
        self.fresh = False
        if last:
            done = self._sync(0, self.hi - self.lo)
            self.fresh = True
        elif due and k.overlap_steps:
            self._start(due[0], step)
            done = None
        elif due:
            a, b = self.parts[due[0]][0], self.parts[due[-1]][1]
            done = self._sync(a, b)
            self.fresh = k.fragments == 1
        else:
            done = None
        if done is None and applied is None:
            return None
        self.round_start = step
        self.rounds += 1
        return self._metrics(*(done or applied))

    def _sync(self, a: int, b: int) -> tuple:
        """The outer step of elements ``a:b`` of this rank's part, waited for: the replicas' mean outer
        gradient, the outer SGD step, the replica given the new global weights."""
        t0 = time.perf_counter()
        params, lo = self.engine.params, self.lo
        delta = self.engine.grads[:b - a]          # free until the next step's backward pass
        np.subtract(self.weights[a:b], params[lo + a:lo + b], out=delta)
        drift = (norm_sq(delta), norm_sq(self.weights[a:b]))
        sent = self.wire.sent_bytes
        t1 = time.perf_counter()
        if b > a:
            self.wire.allreduce_(delta)
        waited = time.perf_counter() - t1
        delta *= np.float32(1.0 / self.replicas)
        self._outer_sgd(delta, a, b)
        params[lo + a:lo + b] = self.weights[a:b]
        self.shard.gather()
        return t0, self.wire.sent_bytes - sent, waited, drift

    def _start(self, f: int, step: int) -> None:
        """Fragment ``f``'s outer gradient sent in the background (``overlap_steps``): applied (and logged) by
        :meth:`_apply` that many steps later. Nothing here waits for the other replicas (no collective on the
        world: the drift is summed with the apply's log line)."""
        (a, b), params, lo = self.parts[f], self.engine.params, self.lo
        np.subtract(self.weights[a:b], params[lo + a:lo + b], out=self.sent[a:b])
        self.summed[a:b] = self.sent[a:b]
        wire_ = self.background.wire if self.background else self.wire
        self._started = wire_.sent_bytes
        if b > a and self.background:
            self.background.bucket_ready(f)
        elif b > a:         # MPI allows no second thread here: the same sums, now
            self.wire.allreduce_(self.summed[a:b])
        self.pending = (f, step)

    def _apply(self, step: int) -> tuple:
        """The exchange in flight waited for (the time waited: what the link took beyond the overlap) and
        applied: the outer SGD step on the fragment's global weights, and the replica's fragment moved to them
        with what it learned since the exchange started (replica + own outer gradient - the outer step). The
        drift is that of the outer gradient sent (it and the fragment's global weights are as they were at the
        start, also after a resume)."""
        t0 = time.perf_counter()
        f, _ = self.pending
        self.pending = None
        (a, b), params, lo = self.parts[f], self.engine.params, self.lo
        drift = (norm_sq(self.sent[a:b]), norm_sq(self.weights[a:b]))
        t1 = time.perf_counter()
        if self.background:
            self.background.wait()
        waited = time.perf_counter() - t1
        g = self.summed[a:b]
        g *= np.float32(1.0 / self.replicas)
        self._outer_sgd(g, a, b)            # g: the step the global weights took
        mine = params[lo + a:lo + b]
        mine += self.sent[a:b]
        mine -= g
        self.shard.gather()
        sent, self._started = self._started, None       # sent None: started before a resume
        wire_ = self.background.wire if self.background else self.wire
        return t0, 0 if sent is None else wire_.sent_bytes - sent, waited, drift

    def _metrics(self, t0: float, nbytes: int, waited: float, drift: tuple[float, float]) -> dict:
        """The outer step's log line, from one allreduce over the world: bytes this rank sent, the ranks' mean
        wait, the replicas' drift from the global weights (of the fragment exchanged, when its exchange
        started: root mean square over replicas of ||replica - global|| / ||global||, from each rank's squared
        norms of its part, ``drift``, each part counted once per replica)."""
        counts = float(self._distinct_part())
        waited_sum, drift_sq, weights_sq = self.world.allreduce_scalars(
            [waited, counts * drift[0], counts * drift[1]], op="sum")
        return {"outer_bytes": nbytes, "outer_wait_s": round(waited_sum / self.world.world_size, 6),
                "outer_drift": float(np.sqrt(drift_sq / max(weights_sq, 1e-30))),
                "outer_s": round(time.perf_counter() - t0, 6)}

    def _outer_sgd(self, g: np.ndarray, a: int, b: int) -> None:
        """torch.optim.SGD's step (dampening 0, no weight decay) on elements ``a:b`` of the global weights with
        gradient ``g``, in place: ``g`` ends as the step taken (the weights minus it)."""
        o = self.cfg.outer
        mu = np.float32(o.momentum)
        if o.momentum:
            m = self.momentum[a:b]
            m *= mu
            m += g
            if o.nesterov:
                g += mu * m
            else:
                g[...] = m
        if o.lr != 1:
            g *= np.float32(o.lr)
        self.weights[a:b] -= g

    def _distinct_part(self) -> bool:
        """Whether this rank's part of the replica's parameters is counted (each part once per replica)."""
        s = self.shard
        if not s.sharded:
            return s.comm.rank == 0
        return bool(s.cross_counts) or s.cross.rank == 0

    def _shared_barrier(self) -> None:
        shared_barrier(self.shard)

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
    def _replica_states(self) -> dict:
        """What each replica holds of its own: its weights (None: the engine's parameters), its inner
        optimizer's states and, with an exchange in the background, the outer gradient it sent (this rank's
        part of each)."""
        own = {"weights": None, **self.shard.state}
        if self.cfg.overlap_steps:
            own["outer_sent"] = self.sent
        return own

    def full_state(self) -> dict:
        """The outer state and (mid-round) each other replica's weights and inner optimizer state, as the
        checkpoint writer takes optimizer states: whole buffers on rank 0, or functions whose generators
        gather them in pieces (every rank runs each to its end)."""
        s = self.shard
        if self.background:         # an exchange in flight: its sums are part of the state
            self.background.wait()
        out = {name: functools.partial(s._gather, buf) if s.sharded else buf for name, buf in self.state.items()}
        if not self.fresh:
            out.update({f"replica{j}_{name}": functools.partial(self._replica_pieces, j, name)
                        for j in range(1, self.replicas) for name in self._replica_states()})
        return out

    def _replica_pieces(self, j: int, name: str):
        """Replica ``j``'s ``name`` ("weights" or an inner optimizer state) on world rank 0, in pieces: within
        replica ``j`` on its first rank (every rank of a replica holds all of its weights after a step; a
        partitioned state is gathered there piece by piece, :meth:`trainrun.sync.update.Partitioned.full_state`),
        then from that rank to world rank 0 over the replicas' first ranks."""
        s, mine, buf = self.shard, self.replica == j, self._replica_states()[name]
        whole = self.engine.params if name == "weights" else None if s.sharded else buf
        parts = s._gather(buf) if mine and whole is None else None
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

    def restore_state(self, saved: dict | None = None) -> dict:
        """The buffers a restore fills (``lo:hi`` of the saved tensors), and the states it only checks (None:
        the other replicas', read by :meth:`load_state_dict`); none where ``saved`` (the checkpoint's
        state.json) is an every-step run's: DiLoCo starts from it."""
        if saved is not None and not saved.get("diloco"):
            return {}
        return {**self.state, **{f"replica{j}_{name}": None for j in range(1, self.replicas)
                                 for name in self._replica_states()}}

    def state_dict(self) -> dict:
        return {"round_start": self.round_start, "replicas": self.replicas, "group": self.comm.world_size,
                "rounds": self.rounds, "mid_round": not self.fresh,
                "in_flight": [*self.pending] if self.pending else None}

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        """After the checkpoint's tensors were restored (every rank): the round's position, and this
        replica's own weights and inner optimizer state where the checkpoint was taken mid-round."""
        saved = state.get("diloco")
        if not saved:       # an every-step run's checkpoint: its weights are the global weights of a first round
            self.weights[...] = np.asarray(self.engine.params[self.lo:self.hi], np.float32)
            self.momentum[...] = 0.0
            self.round_start, self.rounds, self.fresh = state["step"], 0, True
            return
        if saved["replicas"] != self.replicas:
            raise collective(UsageError(
                f"distributed.diloco.group: {ckpt} was saved by {saved['replicas']} replicas of {saved['group']} "
                f"rank(s), this launch makes {self.replicas} of {self.comm.world_size}; a resume continues the "
                f"replicas' rounds: launch {saved['replicas']} replicas (mpirun -np and distributed.diloco.group)"))
        self.round_start, self.rounds, self.fresh = saved["round_start"], saved["rounds"], not saved["mid_round"]
        if saved.get("in_flight"):      # an exchange in flight: its sums restored, applied when due
            f, started = saved["in_flight"][:2]      # a third item, the drift, in older checkpoints
            self.pending, self._started = (f, started), None
        if self.fresh or self.replica == 0:
            return
        for name, buf in self._replica_states().items():
            load_part(ckpt, f"replica{self.replica}_{name}/", self.engine, self.shard, buf)
        self.shard.gather()

    def close(self) -> None:
        if self.background:
            self.background.close()
        self.cross.close()
        self.comm.close()
