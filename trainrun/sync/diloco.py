"""DiLoCo's rounds of local steps with an outer step between them (``distributed.sync: diloco``), a sync
policy (:class:`trainrun.sync.policy.Policy`: the interface the runner's step calls). :func:`build` (every
rank, a collective) returns :class:`trainrun.sync.policy.EveryStep` or :class:`DiLoCo`.

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
import time

import numpy as np

from . import reducer, update, wire
from .diloco_state import DiLoCoState
from .policy import EveryStep, Policy
from ..comm import MPICommunicator, split_nodes
from ..errors import UsageError, collective
from ..step.flat import norm_sq
from ..step.schedule import every


def build(cfg, comm):
    """The sync policy of ``distributed.sync`` on ``comm`` (the world; every rank calls it)."""
    if cfg.distributed.sync != "diloco":
        return EveryStep(comm)
    t = cfg.train
    return DiLoCo.split(cfg.distributed.diloco, comm, schedule=(t.log_every, t.eval_every, cfg.checkpoint.every,
                                                                t.sample_every, cfg.debug.stats_every))


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


class DiLoCo(Policy):
    """Replicas that synchronise at outer steps (see the module's docstring); its checkpoint part is a
    :class:`trainrun.sync.diloco_state.DiLoCoState`."""

    def __init__(self, cfg_diloco, world, comm, cross, replica: int, replicas: int, schedule: tuple = ()):
        super().__init__(world, comm)               # this replica's ranks: comm
        self.cfg, self.cross = cfg_diloco, cross    # the replicas' corresponding ranks: cross
        self.replica, self.replicas = replica, replicas
        self.schedule = schedule      # the *_every of what follows a step: the world steps (world_step)
        self.checkpoint = DiLoCoState(self)
        self.wire = wire.make(cross, cfg_diloco.outer_dtype)
        self.round_start = 0          # the step the current round started at (its outer step, or 0)
        self.fresh = True             # the replica's weights are the global weights (no inner step since)
        self.rounds = 0
        self.state: dict = {}

    @classmethod
    def split(cls, k, world, schedule: tuple = ()) -> "DiLoCo":
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
        # distributed.elastic, one rank per replica: the replicas are the world itself, so that the world's
        # shrink to the survivors of a lost rank is the replicas' too (several: regroup() splits them again)
        cross = world if world.elastic and comm.world_size == 1 else world.split(comm.rank, "replicas")
        replica = comm.allgather_object(cross.rank)[0]       # the replica's first rank's place among the replicas
        return cls(k, world, comm, cross, replica, replicas, schedule)

    def world_step(self, step: int, end: int, agree: bool) -> bool:
        """Only where the world must agree or the world's mean is read (a metrics line, an evaluation, a
        checkpoint, a sample, debug statistics: :attr:`schedule`; the run's end; ``agree``: a checkpoint write
        in flight, fp16's loss scale). Between them each replica sums its own (its ranks only): no round trip
        over the slow link and no wait for the slowest replica at every step; a stop signal is carried at the
        next world step."""
        return step >= end or agree or any(every(step, n) for n in self.schedule)

    @property
    def ranks_per_replica(self) -> int:
        return self.comm.world_size

    def regroup(self) -> None:
        """``distributed.elastic``: the world shrank to the survivors (one rank a replica: the replicas), or to the
        whole replicas left (several ranks each: the replicas' corresponding ranks split again, every rank); the
        outer steps from now on average over them."""
        if self.cross is not self.world:
            self.cross.close()
            self.cross = self.world.split(self.comm.rank, "replicas")
            sent, self.wire = self.wire.sent_bytes, wire.make(self.cross, self.cfg.outer_dtype)
            self.wire.sent_bytes = sent      # the run's count goes on
        self.replicas = self.cross.world_size
        self.replica = self.comm.allgather_object(self.cross.rank)[0] if self.cross is not self.world \
            else self.cross.rank

    def joinable(self) -> bool:
        """Right after an outer step of the whole model: every replica holds the global weights (rank 0's, the
        new replica's start), and no exchange is in flight."""
        return self.fresh and self.pending is None

    def rejoined(self, saved: dict | None) -> None:
        saved = saved["diloco"]         # state_dict()'s: the state.json entry it owns
        self.round_start, self.rounds, self.fresh = saved["round_start"], saved["rounds"], True

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
            done = self._sync(step, 0, self.hi - self.lo)
            self.fresh = True
        elif due and k.overlap_steps:
            self._start(due[0], step)
            done = None
        elif due:
            a, b = self.parts[due[0]][0], self.parts[due[-1]][1]
            done = self._sync(step, a, b)
            self.fresh = k.fragments == 1
        else:
            done = None
        if done is None and applied is None:
            return None
        self.round_start = step
        self.rounds += 1
        return self._metrics(step, *(done or applied))

    def _sync(self, step: int, a: int, b: int) -> tuple:
        """The outer step of elements ``a:b`` of this rank's part, waited for: the replicas' mean outer
        gradient, the outer SGD step, the replica given the new global weights. Under distributed.elastic the
        exchange is redone over the survivors of a replica lost in it (the outer gradient formed again)."""
        t0 = time.perf_counter()
        params, lo = self.engine.params, self.lo
        delta = self.engine.grads[:b - a]          # free until the next step's backward pass
        np.subtract(self.weights[a:b], params[lo + a:lo + b], out=delta)
        drift = (norm_sq(delta), norm_sq(self.weights[a:b]))
        sent = self.wire.sent_bytes
        t1 = time.perf_counter()
        if b > a:
            self.agreed(step, lambda: self.wire.allreduce_(delta), what="outer step",
                        again=lambda: np.subtract(self.weights[a:b], params[lo + a:lo + b], out=delta))
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

    def _metrics(self, step: int, t0: float, nbytes: int, waited: float, drift: tuple[float, float]) -> dict:
        """The outer step's log line, from one allreduce over the world: bytes this rank sent, the ranks' mean
        wait, the replicas' drift from the global weights (of the fragment exchanged, when its exchange
        started: root mean square over replicas of ||replica - global|| / ||global||, from each rank's squared
        norms of its part, ``drift``, each part counted once per replica)."""
        counts = float(self.shard.counts_part)     # each part of the replica's parameters counted once
        waited_sum, drift_sq, weights_sq = self.agreed(step, lambda: self.world.allreduce_scalars(
            [waited, counts * drift[0], counts * drift[1]], op="sum"), what="outer step's log line")
        return {"outer_bytes": nbytes, "outer_wait_s": round(waited_sum / self.world.world_size, 6),
                "outer_drift": float(np.sqrt(drift_sq / max(weights_sq, 1e-30))),
                "outer_s": round(time.perf_counter() - t0, 6),
                **({"outer_replicas": self.replicas} if self.elastic else {})}

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

    @contextlib.contextmanager
    def global_weights(self):
        """The engine's parameters are the global weights inside (every rank): evaluation mid-round."""
        if self.fresh:
            yield
            return
        params, lo, hi = self.engine.params, self.lo, self.hi
        if self._backup is None:
            self._backup = np.empty(hi - lo, np.float32)
        self.shard.node_barrier()
        self._backup[...] = params[lo:hi]
        params[lo:hi] = self.weights
        self.shard.gather()
        try:
            yield
        finally:
            self.shard.node_barrier()
            params[lo:hi] = self._backup
            self.shard.gather()

    # ------------------------------------------------------------------ checkpoints (DiLoCoState)
    def full_state(self) -> dict:
        return self.checkpoint.full_state()

    def restore_state(self, saved: dict | None = None) -> dict:
        return self.checkpoint.restore_state(saved)

    def state_dict(self) -> dict:
        return self.checkpoint.state_dict()

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        self.checkpoint.load_state_dict(state, ckpt)

    def close(self) -> None:
        if self.background:
            self.background.close()
        if self.cross is not self.world:
            self.cross.close()
        self.comm.close()
