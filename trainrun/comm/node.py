"""The node and its topology: who launched this process (:func:`detect_world`, srun's tasks), its CPUs
(:func:`affinity`, :func:`cpu_share`, :func:`machine_id`), its GPUs (:func:`cuda_device_count`,
:func:`local_device`; cupy imported only when asked), the node's ranks as a group (:func:`split_nodes`) and
their MPI-3 shared memory (:class:`NodeMemory`)."""

from __future__ import annotations

import os
import socket

import numpy as np

from ..step import cuda
from .. import faults
from ..errors import UsageError
from .mpi import SHM_DIR, MPICommunicator, MPIGroup

#: Environment variables that launchers set, as (rank variable, size variable),
#: in the order they are consulted: MPICH/Intel MPI hydra, Open MPI, MVAPICH.
WORLD_ENV_VARS = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)


def detect_world() -> tuple[int, int]:
    """Return ``(rank, world_size)`` from the launcher's environment variables.

    Does not initialise MPI. ``(0, 1)`` when not started by mpirun (or by a
    launcher that sets none of :data:`WORLD_ENV_VARS`).
    """
    for rank_var, size_var in WORLD_ENV_VARS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            try:
                rank_i, size_i = int(rank), int(size)
            except ValueError:
                raise UsageError(f"bad launcher environment: {rank_var}={rank!r} {size_var}={size!r}") from None
            if not (size_i >= 1 and 0 <= rank_i < size_i):
                raise UsageError(f"bad launcher environment: {rank_var}={rank_i} {size_var}={size_i}")
            return rank_i, size_i
    return 0, 1


def cuda_device_count() -> int:
    """Number of CUDA devices cupy can see; 0 when cupy is not installed or the CUDA runtime reports
    no driver or no device. A CUDA library that fails to load raises (TrainrunError naming it).

    This asks the CUDA runtime, not onnxruntime: the onnxruntime-training wheel
    lists CUDAExecutionProvider on machines without any GPU.
    """
    cuda.setup()            # CUDA's environment is read when the runtime initialises: set it first
    try:
        import cupy
    except ImportError:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError:      # no driver, no device
        return 0


def local_device(local_rank: int) -> int:
    """The CUDA device of the rank with this local rank: ``local_rank`` modulo the visible devices.

    A launcher that gives every rank all of a host's GPUs (plain ``mpirun``) makes it local rank
    r -> GPU r; one that gives each rank its own (per-rank ``CUDA_VISIBLE_DEVICES``, SLURM
    ``--gpus-per-task=1``) makes every rank see one device, device 0. More ranks than GPUs on a host
    share GPUs: fine for the MPI backend (tests), refused by NCCL (:class:`NCCLCommunicator`)."""
    n = cuda_device_count()
    if n == 0:
        raise UsageError("device: cuda, but no CUDA GPU is visible (checked with cupy; install the `gpu` "
                         "extra on a machine with a GPU, or set device: cpu)")
    return local_rank % n


def machine_id() -> str:
    """This kernel's boot id (the CPUs that processes with the same one see are the same CPUs); the host
    name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return socket.gethostname()


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_share(mine: list[int], peers: list[list[int]]) -> int:
    """Threads for a rank with affinity ``mine`` among ``peers`` (the masks of the ranks on its machine, its
    own included): each of its CPUs counted 1/k, k the ranks whose mask holds it, at least 1. Ranks launched
    unbound (one mask for all) get cores / ranks; ranks a launcher bound to CPUs of their own (SLURM's
    task/affinity, mpirun's -bind-to) keep all of theirs, not a part of them divided again."""
    holders: dict[int, int] = {}
    for mask in peers:
        for c in set(mask):
            holders[c] = holders.get(c, 0) + 1
    share = sum(1 / max(1, holders.get(c, 1)) for c in set(mine))
    return max(1, int(share + 1e-9))


def _check_srun(world_size: int) -> None:
    """UsageError when srun started several tasks that are not one MPI job (srun without ``--mpi=pmi2``
    where SLURM's MpiDefault is none): each would train alone, with another global batch."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")      # set by srun for its tasks, not in a batch script
    if world_size == 1 and tasks.isdigit() and int(tasks) > 1:
        raise UsageError(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) but MPI sees one rank in each: "
                         f"launch with `srun --mpi=pmi2` (or mpirun inside the allocation) so that they form one job")


class SharedMemoryUnavailable(Exception):
    """MPI-3 shared-memory windows cannot be had here (raised on every rank alike)."""


_ALIGN = 64     # bytes: each rank's segment of a window starts on a cache line


def split_nodes(world: MPICommunicator, ranks_per_node: int | None = None) -> tuple[MPIGroup, int]:
    """This rank's node as training groups ranks (a collective): the ranks sharing memory
    (``MPI_COMM_TYPE_SHARED``, ordered by world rank), or, with ``ranks_per_node`` K, pretend nodes of K
    consecutive world ranks inside them; and how many ranks share this machine (pretend nodes or not)."""
    world.barrier()     # Split_type is a blocking collective
    shared = MPIGroup(world, world._comm.Split_type(world._MPI.COMM_TYPE_SHARED, key=world.rank), "node")
    if not ranks_per_node:
        return shared, shared.world_size
    node = shared.split(world.rank // ranks_per_node, "node")
    shared.close()
    return node, shared.world_size


class NodeMemory:
    """The ranks of this node with MPI-3 shared memory between them (``distributed.intra_node: shared``).

    ``node``: the ranks sharing memory (``MPI_COMM_TYPE_SHARED``), or, with ``ranks_per_node`` K (the
    environment's ``TRAINRUN_RANKS_PER_NODE``), pretend nodes of K consecutive world ranks inside them, so
    that a test exercises the cross-node path on one machine. ``cross``: the ranks with the same node rank,
    one per node (ordered by world rank: the node of world rank 0 is cross rank 0). Both poll their
    collectives to the world's ``timeout_s``.

    :meth:`allocate` makes a float32 buffer in a shared window, zero-filled: one segment per node rank (a
    list of every node rank's segment, this rank's at ``node.rank``) or one segment for the whole node
    (owned by node rank 0). Every node rank holds numpy views of all of them: what one rank writes the
    others read, no copy. :class:`SharedMemoryUnavailable` (on every rank) when the windows cannot be had.
    """

    def __init__(self, world: MPICommunicator, ranks_per_node: int | None = None):
        self._MPI = world._MPI
        self.world, self.node, self.cross, self._windows = world, None, None, []
        self.node, self._machine_ranks = split_nodes(world, ranks_per_node)
        self.cross = world.split(self.node.rank, "cross-node")
        sizes = world.allgather_object([self.node.world_size, faults.hit("SHARED_WINDOWS", world.rank, 0)])
        if len({n for n, _ in sizes}) != 1:
            self.close()
            raise SharedMemoryUnavailable(f"nodes of unequal sizes ({sorted({n for n, _ in sizes})} ranks): "
                                          f"the cross-node groups need the same number of ranks on every node")
        if any(f for _, f in sizes):     # fault injection: a system without shared windows
            self.close()
            raise SharedMemoryUnavailable("MPI_Win_allocate_shared failed (TRAINRUN_FAULT_SHARED_WINDOWS)")

    def require(self, nbytes: int, where: str = SHM_DIR) -> None:
        """:class:`SharedMemoryUnavailable` (on every rank) unless ``where`` (the tmpfs MPICH maps its
        shared windows from) has room for ``nbytes`` per node, for every (pretend) node on this machine. A
        window larger than the tmpfs is handed out anyway, and its first touch kills the rank with SIGBUS
        (Docker's default /dev/shm is 64 MB)."""
        error = None
        if os.path.isdir(where):
            st = os.statvfs(where)
            free = st.f_bavail * st.f_frsize
            need = int(nbytes) * (self._machine_ranks // self.node.world_size)
            if free < need + (64 << 20):
                error = (f"{where} has {free / 2**20:,.0f} MB free on rank {self.world.rank} "
                         f"({self.world.hostname}), the shared windows need {need / 2**20:,.0f} MB there "
                         f"(in a container: a larger --shm-size)")
        self._agree(error)

    def _agree(self, error: str | None) -> None:
        """Every rank raises :class:`SharedMemoryUnavailable` (the first rank's ``error``, after freeing what
        was made) if any rank has an error; a collective."""
        failed = [e for e in self.world.allgather_object(error) if e]
        if failed:
            self.close()
            raise SharedMemoryUnavailable(failed[0])

    def allocate(self, n: int, per_rank: bool) -> list[np.ndarray]:
        node = self.node
        owners = list(range(node.world_size)) if per_rank else [0]
        nbytes = -(-4 * int(n) // _ALIGN) * _ALIGN if node.rank in owners else 0
        node.barrier()      # Allocate_shared is a blocking collective
        error = None
        try:
            win = self._MPI.Win.Allocate_shared(nbytes, 4, comm=node._comm)
            self._windows.append(win)
            views = [np.frombuffer(win.Shared_query(r)[0], np.float32, count=int(n)) for r in owners]
        except self._MPI.Exception as e:
            error = f"MPI_Win_allocate_shared failed on rank {self.world.rank}: {e.Get_error_string()}"
        self._agree(error)
        if node.rank in owners:
            views[owners.index(node.rank)][...] = 0.0     # by its owner (first touch: its own NUMA node)
        node.barrier()
        return views

    def close(self) -> None:
        """Free the windows (every view of them is then invalid) and the groups. Every rank calls it."""
        if not self._MPI.Is_finalized():
            for win in self._windows:
                win.Free()
        self._windows = []
        for group in (self.node, self.cross):
            if group is not None:
                group.close()
        self.node = self.cross = None
