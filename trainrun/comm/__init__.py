"""Collective communication between data-parallel ranks.

One interface, :class:`Communicator`, with three implementations:

* :class:`SingleProcess`: world size 1; every collective is a copy or a no-op.
  Works on numpy and cupy arrays alike and never touches MPI.
* :class:`MPICommunicator`: mpi4py on numpy buffers over ``MPI.COMM_WORLD``
  (cupy buffers through host copies: lets ranks share a GPU).
* :class:`NCCLCommunicator`: cupy's NCCL binding on cupy arrays, with an
  :class:`MPICommunicator` as its control plane (unique-id exchange, objects,
  scalars, barrier).

:func:`make_communicator` picks one. Launch several ranks with ``mpirun -np N``.

Rules every implementation keeps:

* Buffers are contiguous 1-D arrays of float32, float64 or int64 (numpy or
  cupy for MPI, cupy for NCCL). Collectives write in place or into ``out``; nothing is
  allocated per call.
* No pickle anywhere: objects travel as JSON (``allgather_object``), so what
  comes back is the JSON round trip of what went in (tuples become lists,
  dict keys become strings) on every backend, world size 1 included.
* No collective waits forever. MPI collectives are started non-blocking and
  polled until ``timeout_s`` (an attribute: a runner may lower it after the
  first step, as torchtitan does); NCCL collectives are waited on through a
  CUDA event polled the same way. On timeout a :class:`TrainrunError` names
  the collective, the rank and the time waited. The collective is still in
  flight at that point and cannot be cancelled, so the caller must then call
  :meth:`Communicator.abort`, which ends every rank of the job.

What MPICH's launcher (hydra, ``mpirun``) does when a rank dies, measured with
the ``mpich`` 5.0 wheel: if a rank exits *without* ``MPI_Finalize``
(``os._exit``, a signal, a crash), hydra SIGKILLs all the other ranks within
a fraction of a second. For a signal it prints a "BAD TERMINATION ... Killed
(signal 9)" banner on stdout and exits 9; for a plain exit it prints nothing
and its exit status is racy (that of the dead rank, or 9) -- a rank calling
``os._exit(0)`` mid-run can end the whole job with status 0. If a rank instead
leaves through Python's normal exit (an uncaught exception, ``sys.exit``),
mpi4py calls ``MPI_Finalize`` at exit, which waits for the others, and hydra
kills nobody: the other ranks hang in their next collective. That is the case
the timeout exists for.

One module per part: ``base`` (the interface, :class:`SingleProcess`, the checks and the polling),
``mpi`` (:class:`MPICommunicator`, :class:`MPIGroup`), ``nccl`` (:class:`NCCLCommunicator`) and ``node``
(the launcher's world, srun, CPU affinity, GPUs, the node's ranks and shared memory). Importing this package
never imports ``mpi4py.MPI`` (importing it initialises MPI), nor cupy: both are imported by
:func:`make_communicator` when needed.
"""

from __future__ import annotations

import os

from ..errors import UsageError
from .base import SCALAR_OPS, SUPPORTED_DTYPES, Communicator, SingleProcess
from .mpi import MPICommunicator, MPIGroup, fault_tolerance, wait_quietly
from .nccl import NCCLCommunicator, _import_nccl
from .node import (WORLD_ENV_VARS, NodeMemory, SharedMemoryUnavailable, _check_srun, affinity, cpu_share,
                   cuda_device_count, detect_world, local_device, machine_id, split_nodes)

__all__ = [
    "Communicator",
    "SingleProcess",
    "MPICommunicator",
    "MPIGroup",
    "NodeMemory",
    "SharedMemoryUnavailable",
    "NCCLCommunicator",
    "make_communicator",
    "detect_world",
    "cuda_device_count",
    "local_device",
    "machine_id",
    "affinity",
    "cpu_share",
    "split_nodes",
    "wait_quietly",
    "fault_tolerance",
    "WORLD_ENV_VARS",
    "SUPPORTED_DTYPES",
    "SCALAR_OPS",
]


BACKENDS = ("auto", "none", "mpi", "nccl")
SPAWNED_ENV = "OMPI_PARENT_PORT"     # set by Open MPI in a process MPI_Comm_spawn started
DEVICES = ("cpu", "cuda")


def make_communicator(backend: str = "auto", device: str = "cpu", timeout_s: float = 300.0,
                      elastic: bool = False) -> Communicator:
    """Build the communicator for this process.

    ``backend``: "auto" chooses "nccl" when ``device == "cuda"`` and the world
    has more than one rank, "mpi" when it has more than one rank, else "none"
    (:class:`SingleProcess`). MPI is initialised only when an MPI communicator
    is actually built ("mpi" or "nccl" with world size > 1, or "mpi" asked
    for explicitly). Asking for "nccl" without cupy or a GPU is a UsageError. ``elastic``
    (``distributed.elastic``): an MPI communicator survives a dead peer (:meth:`MPICommunicator.make_elastic`:
    a UsageError where this MPI or launch cannot); one rank has nothing to survive.
    """
    if backend not in BACKENDS:
        raise UsageError(f"unknown communication backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if not timeout_s > 0:
        raise UsageError(f"collective timeout must be > 0 seconds, got {timeout_s}")
    _, world_size = detect_world()
    _check_srun(world_size)
    if backend == "auto":
        # a process an elastic job's survivors spawned (Open MPI names its parent's port): a world of one that
        # joins theirs (MPICommunicator's joining mode)
        several = world_size > 1 or (elastic and SPAWNED_ENV in os.environ)
        backend = ("nccl" if device == "cuda" else "mpi") if several else "none"
    if backend == "none":
        if world_size > 1:
            raise UsageError(f"backend 'none' runs one process, but the launcher started {world_size} ranks")
        return SingleProcess(timeout_s)
    if backend == "mpi":
        comm = MPICommunicator(timeout_s)
        if elastic and comm.world_size > 1:
            try:
                comm.make_elastic()
            except BaseException:
                comm.close()
                raise
        return comm
    # nccl: check the GPU side first, so a CPU machine fails fast without starting MPI.
    _import_nccl()
    host = MPICommunicator(timeout_s) if world_size > 1 else SingleProcess(timeout_s)
    try:
        return NCCLCommunicator(host, timeout_s)
    except BaseException:
        host.close()
        raise
