"""The reduce and update part of the step, replicated or sharded over ranks (``distributed.zero_stage``).

:func:`build` returns the component the runner's step calls, in this order::

    reduce()          the gradients summed over ranks (each rank's part of them, for stage 1)
    norm_sq_part()    this rank's share of the squared gradient norm: the runner sums the
                      shares in its per-step scalar allreduce (runner.agree)
    step(lr, t, gs)   the optimizer update (of this rank's part, for stage 1)
    gather()          every rank's updated part to every rank (stage 1)

and holds the optimizer state (``state``: name -> flat buffer covering elements
``lo:hi`` of the flat parameters) for checkpoints.

* :class:`Replicated` (stage 0): one allreduce of the flat gradient buffer, every
  rank runs the whole update on identical buffers. The norm is taken by rank 0
  alone (every rank holds the same reduced gradients; the others send 0).
* :class:`Zero1` (stage 1, ZeRO-1): the flat buffer is cut into ``world_size``
  contiguous parts of equal size (+-1 element), wherever tensor boundaries fall.
  ``reduce`` is one in-place reduce-scatter (this rank's reduced part lands at
  the start of the gradient buffer: no buffer of its own);
  the optimizer and its moments cover the part only (1/N of the state per
  rank); ``gather`` is one in-place allgather of the parameters. LAMB's trust
  ratio needs ||p|| and ||d|| of whole tensors: a tensor cut by a part boundary
  contributes partial sums from two (or more) ranks, which one small allreduce
  (2 float64 per tensor of the model) adds up before the update is applied
  (:class:`trainrun.kernels.host.HostOptimizer`'s ``norm_sums``). AdamW, Adam and
  SGD are elementwise: a part's update is bit for bit that part of the
  replicated update.

Checkpoints keep full tensors by name: :meth:`Zero1.full_state` gathers the
moment parts on rank 0 for a save (one state at a time, as it is written), and a restore reads the full tensors and keeps
``lo:hi`` (so any stage on any number of ranks resumes any checkpoint).
Stage 1 runs on the CPU with the MPI backend and the host optimizer kernel
(config validation says so).
"""

from __future__ import annotations

import functools

import numpy as np

from . import optim
from .engine import norm_sq
from .errors import UsageError


def shard_counts(n: int, world_size: int) -> list[int]:
    """Element counts of the ``world_size`` contiguous parts of ``n`` elements (the first ``n % world_size``
    parts one larger)."""
    base, extra = divmod(int(n), int(world_size))
    return [base + (r < extra) for r in range(world_size)]


def build(stage: int, comm, engine, cfg_optimizer):
    """The reduce/update component of ``stage`` for ``engine``'s flat buffers. Stage 0 uses the
    engine's own optimizer (``engine.optimizer``); stage 1 builds one over this rank's part (build the
    engine without an optimizer then: it would hold full-size moments)."""
    if stage == 0:
        return Replicated(comm, engine)
    return Zero1(comm, engine, cfg_optimizer)


class Replicated:
    """Stage 0: allreduce, the whole update on every rank."""

    sharded = False

    def __init__(self, comm, engine):
        self.comm, self.engine = comm, engine
        self.optimizer = engine.optimizer
        self.state = self.optimizer.state
        self.lo, self.hi = 0, engine.layout.total

    def reduce(self) -> None:
        self.comm.allreduce_(self.engine.grads)

    def norm_sq_part(self) -> float:
        return self.engine.grad_norm_sq() if self.comm.rank == 0 else 0.0

    def step(self, lr: float, t: int, grad_scale: float) -> None:
        self.optimizer.step(lr, t, grad_scale)

    def gather(self) -> None:
        pass

    def full_state(self) -> dict:
        """name -> the whole flat optimizer state buffer (on rank 0; other ranks may get an empty dict)."""
        return self.state


class Zero1:
    """Stage 1: reduce-scatter, this rank's part updated with its part of the moments, allgather."""

    sharded = True

    def __init__(self, comm, engine, cfg_optimizer):
        self.comm, self.engine = comm, engine
        layout = engine.layout
        n, world, rank = layout.total, comm.world_size, comm.rank
        if n < world:
            raise UsageError(f"distributed.zero_stage: 1 needs at least one parameter per rank "
                             f"({n} parameters, {world} ranks)")
        self.counts = shard_counts(n, world)
        self.lo = sum(self.counts[:rank])
        self.hi = self.lo + self.counts[rank]
        # this rank's part of the reduced gradients: reduced in place into the start of the gradient buffer
        # (the next backward overwrites all of it), no buffer of its own
        self.grad = engine.grads[:self.counts[rank]]
        # the parts of tensors this rank holds: (name, size within [lo, hi), index of the tensor)
        bounds = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for s in layout.shapes]).tolist()
        parts = [(name, min(b, self.hi) - max(a, self.lo), i)
                 for i, (name, a, b) in enumerate(zip(layout.names, bounds, bounds[1:]))
                 if a < self.hi and b > self.lo]
        self.tensor_ids = np.array([i for *_, i in parts], np.int64)
        self._sums = np.zeros((len(layout.names), 2), np.float64)
        self.optimizer = optim.build(cfg_optimizer, [p[0] for p in parts], [p[1] for p in parts],
                                     engine.params[self.lo:self.hi], self.grad, np, kernel="host",
                                     norm_sums=self._norm_sums if cfg_optimizer.name == "lamb" else None)
        self.state = self.optimizer.state

    def reduce(self) -> None:
        self.comm.reduce_scatter(self.engine.grads, self.grad, self.counts)

    def norm_sq_part(self) -> float:
        return norm_sq(self.grad)

    def _norm_sums(self, sums: np.ndarray) -> np.ndarray:
        """LAMB: this rank's per-part sums of squares -> the whole tensors' (one allreduce)."""
        full = self._sums
        full[...] = 0.0
        full[self.tensor_ids] = sums
        self.comm.allreduce_(full.reshape(-1))
        return full[self.tensor_ids]

    def step(self, lr: float, t: int, grad_scale: float) -> None:
        self.optimizer.step(lr, t, grad_scale)

    def gather(self) -> None:
        params = self.engine.params
        self.comm.allgather(params[self.lo:self.hi], params, self.counts)

    def full_state(self) -> dict:
        """name -> a function that gathers the whole flat optimizer state on rank 0 into a new array
        (None on the other ranks), a collective: every rank calls each, in order (the checkpoint writer
        does, one state at a time, so rank 0 holds one gathered state at a time)."""
        return {name: functools.partial(self._gather, part) for name, part in self.state.items()}

    def _gather(self, part: np.ndarray) -> np.ndarray | None:
        full = np.empty(sum(self.counts), np.float32) if self.comm.rank == 0 else None
        self.comm.gather(part, full, self.counts, root=0)
        return full
