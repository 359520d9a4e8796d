"""The reduce and update part of the step, replicated or partitioned over ranks (``distributed.zero_stage``,
``distributed.intra_node``), and the one owner of the optimizer on every path.

:func:`build` returns the component the runner's step calls, in this order::

    reduce()          the gradients summed over ranks (each rank's part of them, when partitioned)
    norm_sq_part()    this rank's share of the squared gradient norm: the runner sums the
                      shares in its per-step scalar allreduce (runner.step_scalars)
    step(lr, t, gs)   the optimizer update (of this rank's part, when partitioned)
    gather()          every rank's updated part to every rank that reads it

and holds the optimizer (:func:`trainrun.step.optim.build`, over the whole flat buffers or this rank's part of
them; the engine only opens its session when it runs a graph) and its state (``state``: name -> flat
buffer covering elements ``lo:hi`` of the flat parameters) for checkpoints.

* :class:`Replicated` (stage 0, ``intra_node: mpi`` or one rank per node): one allreduce of the flat
  gradient buffer, every rank runs the whole update on identical buffers. The norm is taken by rank 0
  alone (every rank holds the same reduced gradients; the others send 0).
* :class:`Partitioned`: the flat buffer is cut into contiguous parts of equal size (+-1 element),
  wherever tensor boundaries fall, at two levels:

  - within a node (``intra_node: shared``, :func:`node_buffers`): the parameters exist ONCE per node,
    in an MPI-3 shared-memory window every local rank's sessions bind to; each rank's gradient buffer
    is its segment of another window. ``reduce`` sums, for this rank's slice of the node, every local
    rank's gradients straight from their buffers (in cache-sized chunks, at memory bandwidth) into its
    own; its slice of the parameters is updated in place with its slice of the moments (so the update
    and the optimizer state are split over the node's ranks at stage 0 too); nothing to gather inside
    a node. Barriers (polled to ``distributed.timeout_s``) order it: every local backward done before
    the sum reads the buffers, every read done before a buffer is written again, every slice updated
    before any rank's next forward reads the parameters.
  - across nodes (the ranks with the same node rank, one per node): stage 0 allreduces the slice
    (every node then updates it alike); stage 1 (ZeRO-1) reduce-scatters it in place (this rank's
    reduced part lands at the start of its slice of the gradient buffer), updates its part with its
    part of the moments and allgathers the slice among the same ranks. With one rank per node this is
    plain ZeRO-1: one part per rank.

  LAMB's trust ratio needs ||p|| and ||d|| of whole tensors: a tensor cut by a part boundary
  contributes partial sums from two (or more) ranks, which one small allreduce (2 float64 per tensor
  of the model) adds up before the update is applied (:class:`trainrun.kernels.host.HostOptimizer`'s
  ``norm_sums``). AdamW, Adam and SGD are elementwise: a part's update is bit for bit that part of the
  replicated update.

Every inter-rank gradient collective goes through ``wire`` (:func:`trainrun.sync.wire.make`,
``distributed.reduce_dtype``): float32 on the wire, or bfloat16 summed in float32; the node's shared-memory
sum reads memory, not a wire, and stays float32.

Checkpoints keep full tensors by name: :meth:`Partitioned.full_state` gathers the moment parts on rank 0
for a save, one state at a time and each in pieces of 4 MiB, every piece written to the file as it comes
(rank 0 never holds a whole state: its peak stays that of its own part), and a restore reads the full
tensors and keeps ``lo:hi`` (so any stage on any number of ranks, shared or not, resumes any checkpoint). Partitioned updates run on
the CPU with the MPI backend and the host optimizer kernel (config validation says so for stage 1;
``intra_node: shared`` applies only there, :func:`node_buffers`).
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

from ..step import optim
from . import reducer, wire
from ..comm import MPICommunicator, NodeMemory, SharedMemoryUnavailable, SingleProcess
from ..step.flat import FlatLayout, norm_sq
from ..models import registry
from ..errors import UsageError

RANKS_PER_NODE_ENV = "TRAINRUN_RANKS_PER_NODE"
_SUM_CHUNK = 1 << 15      # float32 elements per chunk of the node-local sum: a few of them stay in L2
PIECE = 1 << 20   # float32 elements (4 MiB) per gathered piece of a flat buffer for a checkpoint


def pieces(n: int) -> list[tuple[int, int]]:
    """The pieces ``c0:c1`` of a flat buffer of ``n`` elements, in order, as a shard's :meth:`gather_pieces`
    yields them (every rank computes the same)."""
    step = max(1, min(PIECE, n))
    return [(c0, min(c0 + step, n)) for c0 in range(0, n, step)]


def _overlap(lo: int, hi: int, c0: int, c1: int) -> int:
    """Elements of [lo, hi) within [c0, c1)."""
    return max(0, min(hi, c1) - max(lo, c0))


def shard_counts(n: int, world_size: int) -> list[int]:
    """Element counts of the ``world_size`` contiguous parts of ``n`` elements (the first ``n % world_size``
    parts one larger)."""
    base, extra = divmod(int(n), int(world_size))
    return [base + (r < extra) for r in range(world_size)]


def build(cfg, comm, engine, node: "NodeBuffers | None" = None):
    """The reduce/update component for ``engine``'s flat buffers, with the run's optimizer (``cfg.optimizer``):
    over the whole buffers (stage 0 without ``node``: :class:`Replicated`, run by ``engine.optimizer_kernel``)
    or over this rank's part of them (:class:`Partitioned`, the host kernel)."""
    stage = cfg.distributed.zero_stage
    depths = registry.layer_depths(cfg.model, engine.layout.names)
    if stage == 0 and node is None:
        return Replicated(comm, engine, optimizer_for(engine, cfg.optimizer, cfg.engine.optimizer_kernel, depths),
                          cfg.distributed.reduce_dtype)
    return Partitioned(stage, comm, engine, cfg.optimizer, node, cfg.distributed.reduce_dtype, depths)


def optimizer_for(engine, cfg_optimizer, kernel: str = "auto", depths: dict | None = None):
    """The optimizer over all of ``engine``'s flat parameters and gradients (``depths``: each parameter's
    layer for ``layer_decay``, :func:`trainrun.models.registry.layer_depths`); one that runs a graph gets its
    session from the engine."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in engine.layout.shapes]
    opt = optim.build(cfg_optimizer, engine.layout.names, sizes, engine.params, engine.grads, engine.xp,
                      kernel=kernel, depths=depths)
    if opt.graph:
        engine.attach_optimizer(opt)
    return opt


class NodeBuffers:
    """The parameters and the frozen weights (one buffer each per node) and every local rank's gradient
    buffer, in shared memory."""

    def __init__(self, mem: NodeMemory, n: int, frozen: int = 0):
        self.mem = mem
        # one parameter buffer + every rank's gradients + the frozen weights
        mem.require(4 * (n * (1 + mem.node.world_size) + frozen))
        self.params = mem.allocate(n, per_rank=False)[0]
        self.grads = mem.allocate(n, per_rank=True)
        self.frozen = mem.allocate(frozen, per_rank=False)[0] if frozen else None
        self.buffers = (self.params, self.grads[mem.node.rank])     # for Engine(buffers=...)

    def close(self) -> None:
        self.params = self.grads = self.buffers = self.frozen = None
        self.mem.close()


def ranks_per_node(world_size: int) -> int | None:
    """``TRAINRUN_RANKS_PER_NODE`` (pretend nodes of K consecutive ranks), or None when unset."""
    value = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
    if not value:
        return None
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1 or world_size % k:
        raise UsageError(f"environment {RANKS_PER_NODE_ENV}={value!r}: must be a whole number >= 1 that "
                         f"divides the number of ranks ({world_size})")
    return k


def node_buffers(cfg, comm, n: int, frozen: int = 0) -> NodeBuffers | None:
    """Shared memory for ``distributed.intra_node: shared`` (``n`` parameters, ``frozen`` frozen weights) where it applies (several ranks per node, the
    CPU, the MPI backend, the host optimizer kernel, no debug.stats_every, not distributed.elastic: a rank
    lost would take its node's windows with it); None for the mpi path. Where MPI-3 shared windows cannot be
    had: a warning (rank 0) and None. Every rank calls it."""
    if (cfg.distributed.intra_node != "shared" or not isinstance(comm, MPICommunicator) or cfg.device != "cpu"
            or cfg.engine.optimizer_kernel == "graph" or cfg.debug.stats_every or cfg.distributed.elastic):
        return None
    k = ranks_per_node(comm.world_size)
    try:
        mem = NodeMemory(comm, k)
        if mem.node.world_size == 1:        # one rank per node: nothing to share
            mem.close()
            return None
        return NodeBuffers(mem, n, frozen)
    except SharedMemoryUnavailable as e:
        if comm.rank == 0:
            print(f"trainrun: warning: distributed.intra_node: shared is not available here ({e}); "
                  f"falling back to intra_node: mpi (every rank holds its own parameters)",
                  file=sys.stderr, flush=True)
        return None


def _part_optimizer(cfg_optimizer, layout: FlatLayout, lo: int, hi: int, params, grad, norm_sums, depths=None):
    """The host optimizer over elements ``lo:hi`` of the flat layout (``params`` and ``grad`` of that size),
    with the indices of the tensors it touches (for LAMB's per-tensor sums)."""
    bounds = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for s in layout.shapes]).tolist()
    parts = [(name, min(b, hi) - max(a, lo), i)
             for i, (name, a, b) in enumerate(zip(layout.names, bounds, bounds[1:])) if a < hi and b > lo]
    tensor_ids = np.array([i for *_, i in parts], np.int64)
    opt = optim.build(cfg_optimizer, [p[0] for p in parts], [p[1] for p in parts], params, grad, np,
                      kernel="host", norm_sums=norm_sums if cfg_optimizer.name == "lamb" else None,
                      depths=depths)
    return opt, tensor_ids


class Replicated:
    """Stage 0 over MPI: allreduce, the whole update on every rank.

    When the engine's train graph is cut at gradient buckets (it was opened with
    ``EngineOptions.bucket_bytes`` where :func:`trainrun.sync.reducer.applies` holds: ``engine.buckets``), the
    reduction belongs to :attr:`reducer` (:class:`trainrun.sync.reducer.BucketReducer`): the runner hands its
    ``bucket_ready`` to the engine for the last micro-batch, and :meth:`reduce` waits for the started
    buckets and reduces what is left (everything when no bucket was started, e.g. a step whose gradients
    ``debug.stats_every`` reads first). Otherwise :attr:`reducer` is None and :meth:`reduce` is one allreduce."""

    sharded = False

    def __init__(self, comm, engine, optimizer, reduce_dtype: str = "fp32"):
        self.comm, self.engine = comm, engine
        self.optimizer = optimizer
        self.state = self.optimizer.state
        self.lo, self.hi = 0, engine.layout.total
        self.reducer = reducer.BucketReducer(comm, engine.grads, engine.buckets, reduce_dtype) \
            if len(engine.buckets) > 1 else None
        self.wire = self.reducer.wire if self.reducer else wire.make(comm, reduce_dtype)

    def reduce(self) -> None:
        if self.reducer:
            self.reducer.reduce()
        elif self.engine.grads.size:
            self.wire.allreduce_(self.engine.grads)

    def norm_sq_part(self) -> float:
        return self.engine.grad_norm_sq() if self.comm.rank == 0 else 0.0

    def step(self, lr: float, t: int, grad_scale: float) -> None:
        self.optimizer.step(lr, t, grad_scale)

    def gather(self) -> None:
        pass

    @property
    def counts_part(self) -> bool:
        """Whether this rank's part is the one counted in a sum over the shard's ranks (each part once)."""
        return self.comm.rank == 0

    def node_barrier(self) -> None:
        """Every local rank done with the node's parameters (nothing to wait for: each rank holds its own)."""

    def for_checkpoint(self, buf: np.ndarray):
        """A buffer of this rank's part (``lo:hi``, here the whole) as the checkpoint writer takes it."""
        return buf

    def full_state(self) -> dict:
        """name -> the whole flat optimizer state buffer (on rank 0; other ranks may get an empty dict)."""
        return {name: self.for_checkpoint(buf) for name, buf in self.state.items()}

    def restore_state(self, saved: dict | None = None) -> dict:
        """name -> the optimizer state buffer a restore fills (the checkpoint's part)."""
        return self.state

    def close(self) -> None:
        if self.reducer:
            self.reducer.close()


class Partitioned:
    """Each rank updates its part with its part of the moments: parts within a node over shared memory,
    and for stage 1 parts of those over the nodes (see the module's docstring)."""

    sharded = True
    reducer = None     # the node's shared-memory sum waits for every local backward: no buckets

    def __init__(self, stage: int, comm, engine, cfg_optimizer, node: NodeBuffers | None,
                 reduce_dtype: str = "fp32", depths=None):
        self.comm, self.engine, self.node = comm, engine, node
        layout = engine.layout
        n = layout.total
        if node is None:        # one rank per node: every rank is a node of its own
            self.local, self.cross, self.peers = SingleProcess(comm.timeout_s), comm, [engine.grads]
        else:
            self.local, self.cross, self.peers = node.mem.node, node.mem.cross, node.grads
        self.wire = wire.make(self.cross, reduce_dtype)     # the inter-node part; the node's sum stays fp32
        parts = self.local.world_size * (self.cross.world_size if stage else 1)
        if n < parts:
            raise UsageError(f"distributed.zero_stage: {stage} needs at least one parameter per part "
                             f"({n} parameters, {parts} parts)")
        self.node_counts = shard_counts(n, self.local.world_size)
        self.a = sum(self.node_counts[:self.local.rank])      # this rank's slice a:b of the node
        self.b = self.a + self.node_counts[self.local.rank]
        self.cross_counts = shard_counts(self.b - self.a, self.cross.world_size) \
            if stage == 1 and self.cross.world_size > 1 else None
        if self.cross_counts:
            self.lo = self.a + sum(self.cross_counts[:self.cross.rank])
            self.hi = self.lo + self.cross_counts[self.cross.rank]
        else:
            self.lo, self.hi = self.a, self.b
        # this rank's part of the reduced gradients: at the start of its slice of its own gradient buffer
        # (the next backward overwrites all of it), no buffer of its own
        self.grad = engine.grads[self.a:self.a + self.hi - self.lo]
        # the ranks holding distinct parts (LAMB's per-tensor sums are added over them)
        self.parts_comm = comm if self.cross_counts else self.local
        self._sums = np.zeros((len(layout.names), 2), np.float64)
        self.optimizer, self.tensor_ids = _part_optimizer(cfg_optimizer, layout, self.lo, self.hi,
                                                          engine.params[self.lo:self.hi], self.grad,
                                                          self._norm_sums, depths)
        self.state = self.optimizer.state
        self._norm_sq = None     # the squared norm of this rank's reduced part, when reduce() took it

    def _sum_peers(self) -> float:
        """This rank's slice of the node: its own gradients plus every other local rank's, read from their
        buffers, chunk by chunk; returns the slice's squared norm, taken while each summed chunk is in cache
        (float32 dots of the chunks summed in float64, like :func:`trainrun.step.flat.norm_sq`)."""
        own = self.peers[self.local.rank]
        others = [p for r, p in enumerate(self.peers) if r != self.local.rank]
        sq = 0.0
        for i in range(self.a, self.b, _SUM_CHUNK):
            out = own[i:min(i + _SUM_CHUNK, self.b)]
            for p in others:
                np.add(out, p[i:i + out.size], out=out)
            sq += float(np.dot(out, out))
        return sq

    def reduce(self) -> None:
        self._norm_sq = None
        shared = len(self.peers) > 1
        if shared:
            self.local.barrier()    # every local backward is done
            sq = self._sum_peers()
            self.local.barrier()    # every read of the peers' buffers is done: the next backward may write
            if self.cross.world_size == 1:      # one node: the slice is reduced; its norm came with the sum
                self._norm_sq = sq
        slice_ = self.engine.grads[self.a:self.b]
        if self.cross_counts:
            self.wire.reduce_scatter(slice_, self.grad, self.cross_counts)
        elif self.cross.world_size > 1:
            self.wire.allreduce_(slice_)

    def norm_sq_part(self) -> float:
        if self._norm_sq is not None:
            return self._norm_sq
        # stage 0 across nodes: every node holds the same reduced slices; the first node's count
        return norm_sq(self.grad) if self.counts_part else 0.0

    def _norm_sums(self, sums: np.ndarray) -> np.ndarray:
        """LAMB: this rank's per-part sums of squares -> the whole tensors' (one allreduce)."""
        full = self._sums
        full[...] = 0.0
        full[self.tensor_ids] = sums
        self.parts_comm.allreduce_(full.reshape(-1))
        return full[self.tensor_ids]

    def step(self, lr: float, t: int, grad_scale: float) -> None:
        self.optimizer.step(lr, t, grad_scale)

    def gather(self) -> None:
        if self.cross_counts:
            params = self.engine.params
            self.cross.allgather(params[self.lo:self.hi], params[self.a:self.b], self.cross_counts)
        self.node_barrier()     # every slice updated before any local rank's next forward reads them

    @property
    def counts_part(self) -> bool:
        """Whether this rank's part is the one counted in a sum over the shard's ranks (each part once: stage
        0 across nodes holds the same slices on every node, the first node's count)."""
        return bool(self.cross_counts) or self.cross.rank == 0

    def node_barrier(self) -> None:
        """With the node's parameters in shared memory: every local rank done reading (or writing) them."""
        if len(self.peers) > 1:
            self.local.barrier()

    def for_checkpoint(self, part: np.ndarray):
        """A buffer of this rank's part (``lo:hi``) as the checkpoint writer takes it: a function returning a
        generator that gathers the whole on rank 0 in pieces (:meth:`gather_pieces`)."""
        return functools.partial(self.gather_pieces, part)

    def full_state(self) -> dict:
        """name -> a function returning a generator that gathers the whole flat optimizer state on rank 0
        in order, in pieces of at most ``PIECE`` elements (rank 0 gets the pieces; the generator
        yields nothing elsewhere). Its collectives take every rank: each runs every generator to its end, in
        order (the checkpoint writer does, writing each piece as it comes), so rank 0 holds one piece at a
        time, never a whole state."""
        return {name: self.for_checkpoint(part) for name, part in self.state.items()}

    def restore_state(self, saved: dict | None = None) -> dict:
        """name -> this rank's part (``lo:hi``) of the optimizer state, which a restore fills."""
        return self.state

    def gather_pieces(self, part: np.ndarray):
        """The pieces (:func:`pieces`) of the flat buffer whose part ``part`` is this rank's, on rank 0 (a
        collective: every rank runs it to its end): per piece, the parts over the nodes (the ranks sharing
        this rank's node slice a:b), then the slices over the first node."""
        n = sum(self.node_counts)
        step = max(1, min(PIECE, n))
        slices = np.cumsum([0] + self.node_counts).tolist()
        cuts = (np.cumsum([0] + self.cross_counts) + self.a).tolist() if self.cross_counts else None
        root = self.cross.rank == 0 and self.local.rank == 0
        mid = np.empty(step, np.float32) if self.cross_counts and self.cross.rank == 0 else None
        full = np.empty(step, np.float32) if root and self.local.world_size > 1 else None
        for c0, c1 in pieces(n):
            s0 = max(self.a, c0)                # this node slice's piece: s0:s1
            s1 = s0 + _overlap(self.a, self.b, c0, c1)
            if self.cross_counts:
                if s1 > s0:       # the same for every rank of this cross group: they all gather, or none
                    m0 = max(self.lo, c0) - self.lo
                    mine = part[m0:m0 + _overlap(self.lo, self.hi, c0, c1)]
                    counts = [_overlap(lo, hi, c0, c1) for lo, hi in zip(cuts, cuts[1:])]
                    self.cross.gather(mine, mid[:s1 - s0] if mid is not None else None, counts, root=0)
                piece = mid[:s1 - s0] if mid is not None else None
            else:
                piece = part[s0 - self.a:s1 - self.a]
            if self.cross.rank != 0:
                continue
            if self.local.world_size > 1:
                counts = [_overlap(lo, hi, c0, c1) for lo, hi in zip(slices, slices[1:])]
                self.local.gather(piece, full[:c1 - c0] if full is not None else None, counts, root=0)
                piece = full[:c1 - c0] if full is not None else None
            if root:
                yield piece

    def close(self) -> None:
        """Free the shared memory (every rank; the engine's buffers are gone then)."""
        if self.node is not None:
            self.engine.close()
            self.node.close()
