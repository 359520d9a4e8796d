"""The MPI backend: mpi4py over ``MPI.COMM_WORLD`` (:class:`MPICommunicator`) and its sub-communicators
(:class:`MPIGroup`), every collective started non-blocking and polled to ``timeout_s``; importing mpi4py.MPI
(which initialises MPI) only when one is built."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import numpy as np

from ..errors import PeerLost, TrainrunError, UsageError
from . import base
from .base import (SCALAR_OPS, Communicator, _check_buffer, _check_shapes, _displacements, _flush_stdio,
                   _json_bytes, _part, _same_memory)

FT_ENV = "OMPI_MCA_mpi_ft_enable"     # set to 1 by Open MPI's `mpirun --with-ft ulfm` (or `--mca mpi_ft_enable 1`)
SHM_DIR = "/dev/shm"     # where MPICH maps shared windows from (a tmpfs file)
UCX_SHM_MIN = 64 << 20     # bytes free in /dev/shm below which UCX's posix transport is left out
_quiet = threading.local()
_READY_TAG = 7041      # the spawned rank's "set up" message to the survivors' rank 0 (distributed.elastic)


def wait_quietly(hurry: threading.Event, poll_s: float | None = None) -> None:
    """The calling thread's collectives poll every ``poll_s`` (default ``QUIET_SLEEP_S``) instead of
    spinning, and spin while ``hurry`` is set: for a thread that communicates while the main thread
    computes, whose owner sets ``hurry`` when the main thread waits for it too
    (:class:`trainrun.sync.reducer.BucketReducer`)."""
    _quiet.hurry = hurry
    _quiet.poll_s = base.QUIET_SLEEP_S if poll_s is None else float(poll_s)


def fault_tolerance(MPI) -> tuple[bool, str]:
    """Whether this job can survive a rank's death (Open MPI 5's ULFM, enabled by ``mpirun --with-ft ulfm``),
    and why (one line)."""
    name, version = MPI.get_vendor()
    v = ".".join(map(str, version))
    if name == "MPICH":
        return False, (f"MPICH {v}: its fault tolerance is not usable (MPI_Init aborts with MPIR_CVAR_ENABLE_FT=1, "
                       f"and a dead rank makes its launcher kill the job); distributed.elastic runs on Open MPI 5 "
                       f"with ULFM: `make setup-elastic`, then `mpirun --with-ft ulfm`")
    if name != "Open MPI" or version[0] < 5:
        return False, f"{name} {v}: distributed.elastic runs on Open MPI 5's ULFM (`make setup-elastic`)"
    if os.environ.get(FT_ENV, "").strip().lower() not in ("1", "true", "yes", "on", "enabled"):
        return False, (f"Open MPI {v} has ULFM, but this launch did not enable it ({FT_ENV} is not set): launch "
                       f"with `mpirun --with-ft ulfm`")
    return True, f"Open MPI {v} with ULFM, enabled for this launch (mpirun --with-ft ulfm)"


def _failure_classes(MPI) -> tuple:
    """The error classes of a dead peer (ULFM): the operation could not complete, or a peer revoked the
    communicator after seeing a death."""
    return tuple(getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                 if hasattr(MPI, n))


class MPICommunicator(Communicator):
    """mpi4py over ``MPI.COMM_WORLD`` with numpy buffers (cupy ones staged through host copies, see
    :meth:`_staged`); every collective polled to ``timeout_s``.

    Elastic (:meth:`make_elastic`, ``distributed.elastic``): a collective that fails on a dead peer raises
    :class:`~trainrun.errors.PeerLost`, and :meth:`revoke`, :meth:`agreement` and :meth:`shrink` (ULFM's
    revoke, agreement and shrink, polled like the rest) let the survivors go on as a smaller communicator:
    this object's ``rank`` and ``world_size`` change then, ``members`` says which first ranks are alive.

    Rejoin (``distributed.elastic``): the survivors :meth:`spawn` a rank for a lost one and, once it is set up,
    :meth:`admit` it (its state sent from rank 0, the two sides merged into one communicator, the new rank
    last). A rank so started is ``joining`` from its start: ``rank`` and ``world_size`` are already those it
    will have, and until :meth:`enter` its set-up's collectives are its own (:meth:`allgather_object`,
    :meth:`allreduce_scalars`, :meth:`barrier`, :meth:`split`: as if every rank had passed what it passes;
    the others set up long ago from the same run directory); :meth:`announce` and :meth:`join` take it in."""

    backend = "mpi"
    elastic = False
    joining = False

    def __init__(self, timeout_s: float = 300.0):
        MPI = _import_mpi()
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()
        self.timeout_s = float(timeout_s)
        self.hostname = socket.gethostname()
        self._stuck: list = []  # buffers of timed-out collectives: MPI may still write them
        self._twins: dict = {}  # host copies of cupy buffers (see _staged)
        # Ranks sharing this host's memory, ordered by world rank, give the local
        # rank. Split_type is a blocking collective: a polled barrier first makes
        # sure every rank is alive and about to call it.
        self._node = None
        self.barrier()
        self._node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = self._node.Get_rank(), self._node.Get_size()
        self._inter = None       # the intercommunicator to a spawned rank (survivors) or to the job (joining)
        parent = MPI.Comm.Get_parent()
        if parent != MPI.COMM_NULL:     # spawned by an elastic job's survivors: it joins them, last
            parent.Set_errhandler(MPI.ERRORS_RETURN)
            self._inter, self.joining = parent, True
            self.rank = parent.Get_remote_size()
            self.world_size = self.rank + 1

    # -- the one place that waits -------------------------------------------------
    def _wait(self, request, op: str, keep_alive: tuple = ()) -> None:
        """Poll ``request`` with Test() until done; TrainrunError after ``timeout_s``."""
        MPI = self._MPI
        start = time.monotonic()
        hurry = getattr(_quiet, "hurry", None)
        quiet = hurry is not None
        spin_until, deadline = start + (0.0 if quiet else base.SPIN_S), start + self.timeout_s
        sleep = _quiet.poll_s if quiet else base.MIN_SLEEP_S
        try:
            while not request.Test():
                now = time.monotonic()
                if now >= deadline:
                    self._stuck.append((request, keep_alive))
                    raise TrainrunError(
                        f"{op} timed out on {self._who()} after "
                        f"{now - start:.1f} s (timeout_s={self.timeout_s:g}): a peer rank probably died or hung "
                        f"before reaching this collective; the job must be aborted")
                if now >= spin_until and not (quiet and hurry.is_set()):
                    time.sleep(sleep)
                    if not quiet:
                        sleep = min(2 * sleep, base.MAX_SLEEP_S)
        except MPI.Exception as e:
            if self.elastic and e.Get_error_class() in _failure_classes(MPI):
                self.revoke()       # no other rank waits on this communicator for the dead one (a replica's too)
                raise PeerLost(f"{op} on {self._who()}: {e.Get_error_string()}") from None
            raise TrainrunError(f"{op} failed on {self._who()} "
                                f"after {time.monotonic() - start:.1f} s: {e.Get_error_string()}") from None

    def _who(self) -> str:
        return f"rank {self.rank} of {self.world_size} ({self.hostname})"

    def _not_joining(self, op: str) -> None:
        """A joining rank has no peers to reduce with before its first step (:meth:`enter`)."""
        if self.joining:
            raise TrainrunError(f"{op} on {self._who()} before it joined the job (a rank that rejoins runs its "
                                f"first collective in its first step)")

    def threads_ok(self) -> bool:
        """MPI lets a thread other than the main one call it (MPI_THREAD_SERIALIZED or more)."""
        MPI = self._MPI
        return MPI.Query_thread() >= MPI.THREAD_SERIALIZED

    def _np(self, buf, what: str) -> np.ndarray:
        _check_buffer(buf, what)
        if not isinstance(buf, np.ndarray):
            raise ValueError(f"{what}: the MPI backend takes numpy or cupy arrays, got {type(buf).__module__}."
                             f"{type(buf).__name__}")
        return buf

    def _staged(self, op: str, run, arrays: tuple, down: tuple, up: tuple) -> None:
        """``run(*arrays)`` with numpy twins in place of cupy arrays (host staging: MPICH from PyPI is
        not CUDA-aware): the arrays at indices ``down`` are copied to their twins first, the twins at
        ``up`` back to the GPU afterwards; numpy arrays are passed through. One twin per (address,
        size, dtype), kept: nothing is allocated per call."""
        if all(isinstance(b, np.ndarray) for b in arrays):
            run(*arrays)
            return
        twins = []
        for b in arrays:
            if isinstance(b, np.ndarray):
                twins.append(b)
            elif type(b).__module__.startswith("cupy"):
                key = (b.data.ptr, b.size, b.dtype.str)
                if key not in self._twins:
                    self._twins[key] = np.empty(b.size, b.dtype)
                twins.append(self._twins[key])
            else:
                twins.append(self._np(b, f"{op} buffer"))     # raises
        for i in down:
            if arrays[i] is not twins[i]:
                arrays[i].get(out=twins[i])     # synchronous: waits for the GPU work queued before it
        run(*twins)
        copied = [arrays[i].set(twins[i]) for i in up if arrays[i] is not twins[i]]
        if copied:
            import cupy
            cupy.cuda.get_current_stream().synchronize()    # the twin is reused by the next call

    def _op(self, name: str):
        return {"sum": self._MPI.SUM, "max": self._MPI.MAX, "min": self._MPI.MIN}[name]

    # -- collectives --------------------------------------------------------------
    def allreduce_(self, buf) -> None:
        self._not_joining("allreduce_")
        _check_buffer(buf, "allreduce_ buffer")
        self._staged("allreduce_", lambda b: self._wait(
            self._comm.Iallreduce(self._MPI.IN_PLACE, b, op=self._MPI.SUM), "allreduce_", (b,)),
            (buf,), (0,), (0,))

    def reduce_scatter(self, buf, out, counts=None) -> None:
        self._not_joining("reduce_scatter")
        _check_shapes("reduce_scatter", buf, out, self.world_size, counts, self.rank)
        if counts is not None:      # numpy only (distributed.zero_stage 1 runs on the CPU)
            b, o = self._np(buf, "reduce_scatter input"), self._np(out, "reduce_scatter output")
            if _same_memory(o, b[:o.size]):     # in place: MPI leaves this rank's part at the start
                self._wait(self._comm.Ireduce_scatter(self._MPI.IN_PLACE, b, recvcounts=list(counts),
                                                      op=self._MPI.SUM), "reduce_scatter", (b,))
            else:
                self._wait(self._comm.Ireduce_scatter(b, o, recvcounts=list(counts), op=self._MPI.SUM),
                           "reduce_scatter", (b, o))
            return
        self._staged("reduce_scatter", lambda b, o: self._wait(
            self._comm.Ireduce_scatter_block(b, o, op=self._MPI.SUM), "reduce_scatter", (b, o)),
            (buf, out), (0,), (1,))

    def allgather(self, chunk, out, counts=None) -> None:
        self._not_joining("allgather")
        _check_shapes("allgather", chunk, out, self.world_size, counts, self.rank)
        if counts is not None:
            c, o = self._np(chunk, "allgather input"), self._np(out, "allgather output")
            spec = [o, (list(counts), _displacements(counts))]
            src = self._MPI.IN_PLACE if _same_memory(c, o[_part(counts, self.rank)]) else c
            self._wait(self._comm.Iallgatherv(src, spec), "allgather", (c, o))
            return
        self._staged("allgather", lambda c, o: self._wait(self._comm.Iallgather(c, o), "allgather", (c, o)),
                     (chunk, out), (0,), (1,))

    def alltoall(self, send, recv, counts) -> None:
        self._not_joining("alltoall")
        s, r = self._np(send, "alltoall input"), self._np(recv, "alltoall output")
        me, p = self.rank, self.world_size
        if len(counts) != p or s.size != sum(counts) or r.size != counts[me] * p or s.dtype != r.dtype:
            raise ValueError(f"alltoall: sizes {s.size} (send), {r.size} (receive) do not match counts "
                             f"{list(counts)} at rank {me}")
        k = int(counts[me])
        send_spec = [s, (list(counts), _displacements(counts))]
        recv_spec = [r, ([k] * p, [k * i for i in range(p)])]
        self._wait(self._comm.Ialltoallv(send_spec, recv_spec), "alltoall", (s, r))

    def gather(self, chunk, out, counts, root: int = 0) -> None:
        self._not_joining("gather")
        if not 0 <= root < self.world_size:
            raise ValueError(f"gather: root {root} out of range for world size {self.world_size}")
        c = self._np(chunk, "gather input")
        if self.rank == root:
            _check_shapes("gather", c, self._np(out, "gather output"), self.world_size, counts, self.rank)
            spec = [out, (list(counts), _displacements(counts))]
        else:
            _check_buffer(c, "gather input")
            spec = None
        self._wait(self._comm.Igatherv(c, spec, root=root), "gather", (c, out))

    def broadcast_(self, buf, root: int = 0) -> None:
        self._not_joining("broadcast_")
        _check_buffer(buf, "broadcast_ buffer")
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast_: root {root} out of range for world size {self.world_size}")
        self._staged("broadcast_", lambda b: self._wait(self._comm.Ibcast(b, root=root), "broadcast_", (b,)),
                     (buf,), (0,) if self.rank == root else (), (0,))

    def barrier(self) -> None:
        if self.joining:
            return
        self._wait(self._comm.Ibarrier(), "barrier")

    def allgather_object(self, obj) -> list:
        if self.joining:
            return [json.loads(_json_bytes(obj)) for _ in range(self.world_size)]
        data = np.frombuffer(_json_bytes(obj), dtype=np.uint8)
        sizes = np.empty(self.world_size, dtype=np.int64)
        self._wait(self._comm.Iallgather(np.array([data.size], dtype=np.int64), sizes),
                   "allgather_object (sizes)", (sizes,))
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
        recv = [gathered, (sizes, offsets), self._MPI.BYTE]
        self._wait(self._comm.Iallgatherv([data, self._MPI.BYTE], recv), "allgather_object", (data, gathered))
        return [json.loads(gathered[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]

    def allreduce_scalars(self, values, op="sum") -> list[float]:
        if op not in SCALAR_OPS:
            raise ValueError(f"allreduce_scalars: op must be one of {SCALAR_OPS}, got {op!r}")
        buf = np.array(values, dtype=np.float64).reshape(-1)
        if self.joining:
            return (buf * self.world_size if op == "sum" else buf).tolist()
        self._wait(self._comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._op(op)),
                   f"allreduce_scalars({op})", (buf,))
        return buf.tolist()

    def abort(self, code: int = 1) -> None:
        _flush_stdio()
        if self.joining:         # a rank that never joined: its end is its own, not the job's
            os._exit(code)
        self._comm.Abort(code)
        # MPICH's MPI_Abort can return: it asks hydra to kill the job and hydra
        # does so a moment later. Never run on meanwhile.
        os._exit(code)

    def close(self) -> None:
        if self._node is not None and not self._MPI.Is_finalized():
            self._node.Free()
        self._node = None
        if self._inter is not None and not self.joining and not self._MPI.Is_finalized():
            # every survivor at the end of a run: a rank spawned to rejoin and not admitted yet ends too
            try:
                root = self._MPI.ROOT if self.rank == 0 else self._MPI.PROC_NULL
                self._wait(self._inter.Ibcast(np.zeros(1, np.int64), root=root), "dismiss a spawned rank")
            except TrainrunError:
                pass
            self.forget_spawned()

    # -- surviving a dead peer (distributed.elastic) --------------------------------
    def make_elastic(self) -> None:
        """From now on a dead peer raises :class:`PeerLost` instead of ending the job; a UsageError where this
        MPI or launch cannot survive one (:func:`fault_tolerance`). Every rank calls it. The node's
        communicator is freed now, while every rank lives (a rank lost later would leave it broken)."""
        ok, why = fault_tolerance(self._MPI)
        if not ok:
            raise UsageError(f"distributed.elastic: this job cannot survive a lost rank: {why}")
        self.elastic = True
        # the ranks alive, by the rank they started with (a joining rank learns them from the job)
        self.members = [] if self.joining else list(range(self.world_size))
        self.barrier()
        if self._node is not None:
            self._node.Free()
            self._node = None

    def revoke(self) -> None:
        """After a :class:`PeerLost`: interrupt every survivor's operations on this communicator (MPI_Comm_revoke),
        so that none waits in a collective the dead rank will never join."""
        try:
            self._comm.Revoke()
        except self._MPI.Exception:
            pass        # revoked already

    def agreement(self, flags: int) -> int | None:
        """ULFM's agreement on ``flags`` (bits; fault tolerant): their AND over every rank, the same answer on
        every survivor; None where a rank of this communicator died (then :meth:`shrink`)."""
        flag = np.array([flags], np.int32)
        try:
            self._wait(self._comm.Iagree(flag), "agreement", (flag,))
        except PeerLost:
            return None
        return int(flag[0])

    def shrink(self) -> list[int]:
        """Every survivor: this communicator becomes the survivors' (MPI_Comm_shrink; they keep their order, so
        the lowest survivor is rank 0); the ranks lost, by the rank they started with."""
        old, me = self._comm, self.members[self.rank]
        # blocking: Open MPI 5.0's MPI_Comm_ishrink failed here with MPI_ERR_INTERN; a shrink is fault tolerant
        # (it ends with the survivors whoever dies meanwhile), so it cannot hang on a dead rank
        try:
            new = old.Shrink()
        except self._MPI.Exception as e:
            raise TrainrunError(f"shrink failed on {self._who()}: {e.Get_error_string()}") from None
        self._comm = new
        try:
            old.Free()
        except self._MPI.Exception:
            pass
        self.rank, self.world_size = new.Get_rank(), new.Get_size()
        base.leave_without_finalize("a rank was lost")
        alive = [int(r) for r in self.allgather_object(me)]
        lost = [r for r in self.members if r not in alive]
        self.members = alive
        return lost

    def drop(self, leaving: list[int]) -> bool:
        """Every survivor, after :meth:`shrink`: the ranks ``leaving`` (by the rank they started with: a lost rank's
        replica mates) leave this communicator (MPI_Comm_split, they keep their order); whether this rank is one
        of them (then it has no communicator and ends: :meth:`trainrun.sync.elastic.Elastic.leave`)."""
        MPI, me = self._MPI, self.members[self.rank]
        old = self._comm
        try:
            new = old.Split(MPI.UNDEFINED if me in leaving else 0, key=self.rank)
        except MPI.Exception as e:
            raise TrainrunError(f"dropping a lost rank's replica failed on {self._who()}: {e.Get_error_string()}") \
                from None
        self.members = [m for m in self.members if m not in leaving]
        if new == MPI.COMM_NULL:
            return True
        new.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm = new
        old.Free()
        self.rank, self.world_size = new.Get_rank(), new.Get_size()
        return False

    def leave(self) -> None:
        """This rank leaves the job for good (its replica dropped, :meth:`drop`): the process ends here with exit
        0, its output flushed, without MPI_Finalize (which would wait for the dead)."""
        base.leave_without_finalize("this rank left the job with its replica")
        base.end_process(0)

    # -- a rank that rejoins (distributed.elastic) ----------------------------------
    def spawn(self, argv: list[str], host: str | None = None) -> str | None:
        """Every survivor: start one rank with the command ``argv`` (MPI_Comm_spawn; on ``host`` where rank 0 gives
        one: the info key ``host``, else where Open MPI maps it; it returns once the new process initialised MPI),
        to be admitted when it says it is set up (:meth:`joiner_ready`). Rank 0 listens for that from now on.
        Returns None, or why the spawn failed (every survivor alike: the job goes on without it)."""
        MPI = self._MPI
        info = MPI.Info.Create()
        if host and self.rank == 0:
            info.Set("host", host)
        try:
            self._inter = self._comm.Spawn(argv[0], argv[1:], maxprocs=1, info=info, root=0)
        except MPI.Exception as e:
            return e.Get_error_string()
        finally:
            info.Free()
        self._inter.Set_errhandler(MPI.ERRORS_RETURN)
        self._ready = np.zeros(1, np.float64)
        self._ready_req = self._inter.Irecv(self._ready, source=0, tag=_READY_TAG) if self.rank == 0 else None
        return None

    def joiner_ready(self) -> float | None:
        """Rank 0, after :meth:`spawn`: the seconds the spawned rank took to set up, once it said it is ready;
        None before (never blocks); -1 where it died before (its set-up failed: its error is in the job's output)."""
        req = getattr(self, "_ready_req", None)
        if req is None:
            return None
        try:
            return float(self._ready[0]) if req.Test() else None
        except self._MPI.Exception:
            return -1.0

    def forget_spawned(self) -> None:
        """Every survivor: the spawned rank died before it was admitted; its intercommunicator let go."""
        if self._inter is not None:
            try:
                self._inter.Free()
            except self._MPI.Exception:
                pass
        self._inter = self._ready_req = None

    def admit(self, meta: dict, arrays: list) -> None:
        """Every survivor, once the spawned rank is ready: rank 0 sends it ``meta`` (JSON) and ``arrays`` (the
        others pass theirs, unused), then the survivors and it become one communicator, it last."""
        MPI, inter = self._MPI, self._inter
        root = MPI.ROOT if self.rank == 0 else MPI.PROC_NULL
        head = np.frombuffer(_json_bytes(meta), np.uint8)
        self._wait(inter.Ibcast(np.array([head.size], np.int64), root=root), "admit (size)")
        self._wait(inter.Ibcast(head, root=root), "admit (state)", (head,))
        for a in arrays:
            self._wait(inter.Ibcast(a, root=root), "admit (arrays)", (a,))
        self._merge(high=False)
        self.members = [*self.members, int(meta["slot"])]

    def announce(self, setup_s: float) -> None:
        """The joining rank: tell the job it is set up (``setup_s``: seconds since its start), so that the
        survivors admit it at the next step they can."""
        self._announced = np.array([setup_s], np.float64)
        self._announce_req = self._inter.Isend(self._announced, dest=0, tag=_READY_TAG)

    def join(self, arrays_for) -> dict | None:
        """The joining rank, after :meth:`announce`: wait (without a deadline: the job admits it at its next
        outer step or step) for the state rank 0 sends, ``arrays_for(meta)`` giving the buffers it fills; then
        one communicator with the survivors. Returns the state's JSON part (None: the job ended first)."""
        MPI, inter = self._MPI, self._inter
        n = np.zeros(1, np.int64)
        req = inter.Ibcast(n, root=0)
        while not req.Test():
            time.sleep(base.MAX_SLEEP_S)
        if not n[0]:        # the job ended first (:meth:`close`)
            return None
        head = np.empty(int(n[0]), np.uint8)
        self._wait(inter.Ibcast(head, root=0), "join (state)", (head,))
        meta = json.loads(head.tobytes())
        for a in arrays_for(meta):
            self._wait(inter.Ibcast(a, root=0), "join (arrays)", (a,))
        self._announce_req.Wait()
        self._merge(high=True)
        self.members = [*meta["members"], int(meta["slot"])]
        return meta

    def enter(self) -> None:
        """The joining rank, before its first step (and before what the job does ahead of it: a spawn, an
        admission): its collectives are the job's from now on."""
        self.joining = False

    def _merge(self, high: bool) -> None:
        """The survivors (``high`` False) and the spawned rank (True): one intracommunicator, in place of this
        one (its rank and size with it)."""
        MPI, inter = self._MPI, self._inter
        try:
            merged = inter.Merge(high=high)
        except MPI.Exception as e:
            raise TrainrunError(f"admitting a rank that rejoins failed on {self._who()}: {e.Get_error_string()}") \
                from None
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        old, self._comm, self._inter = self._comm, merged, None
        self._ready_req = None
        if old is not MPI.COMM_WORLD:
            old.Free()
        inter.Free()
        self.rank, self.world_size = merged.Get_rank(), merged.Get_size()

    def dup(self, what: str) -> "MPIGroup":
        """The same ranks as a communicator of their own (``MPI_Comm_dup``): collectives on it never match
        this one's, so another thread may run them while this communicator's run in the caller's order
        (the gradient buckets reduced during the backward pass, :class:`trainrun.sync.reducer.BucketReducer`). Every
        rank must call it."""
        self.barrier()      # Dup is a blocking collective: first make sure every rank is alive and here
        return MPIGroup(self, self._comm.Dup(), what)

    def split(self, color: int, what: str) -> "MPIGroup":
        """The ranks that pass the same ``color``, ordered by world rank, as a communicator of their own
        (collectives polled to this communicator's ``timeout_s``). Every rank must call it."""
        if self.joining:     # a group of this rank alone (DiLoCo's replica of one rank under elastic)
            return MPIGroup(self, self._MPI.COMM_SELF.Dup(), what)
        self.barrier()      # Split is a blocking collective: first make sure every rank is alive and here
        return MPIGroup(self, self._comm.Split(color, key=self.rank), what)


class MPIGroup(MPICommunicator):
    """A sub-communicator of an :class:`MPICommunicator` (:meth:`MPICommunicator.split`): ``rank`` and
    ``world_size`` are within the group; its timeout is the parent's; errors name the world rank too."""

    def __init__(self, parent: MPICommunicator, comm, what: str):
        parent = parent._parent if isinstance(parent, MPIGroup) else parent     # the world communicator
        self._MPI, self._comm, self._parent, self.what = parent._MPI, comm, parent, what
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.local_rank, self.local_size = parent.local_rank, parent.local_size
        self.hostname = parent.hostname
        self._stuck, self._twins, self._node = parent._stuck, {}, None

    @property
    def timeout_s(self) -> float:
        return self._parent.timeout_s

    @property
    def elastic(self) -> bool:
        """A dead peer raises PeerLost here too where the world is elastic (a replica's ranks, DiLoCo's replicas)."""
        return self._parent.elastic

    def _who(self) -> str:
        return f"{self._parent._who()}, {self.what} rank {self.rank} of {self.world_size}"

    def abort(self, code: int = 1) -> None:
        self._parent.abort(code)

    def close(self) -> None:
        if self._comm is not None and not self._MPI.Is_finalized():
            try:
                self._comm.Free()
            except self._MPI.Exception:
                pass        # distributed.elastic: revoked, or a member died
        self._comm = None


def _ucx_transports(shm: str = SHM_DIR) -> None:
    """Before MPI_Init: with less than :data:`UCX_SHM_MIN` free in ``shm`` (a small container or node
    tmpfs), ``UCX_TLS=^posix`` unless the user set UCX_TLS. MPICH's UCX posix shared-memory transport can
    crash MPI_Init with SIGSEGV there (seen at 16-18 MB), before trainrun could say why; without it UCX
    takes its other transports, and ``distributed.intra_node: shared`` its documented fallback."""
    if "UCX_TLS" in os.environ or not os.path.isdir(shm):
        return
    st = os.statvfs(shm)
    if st.f_bavail * st.f_frsize < UCX_SHM_MIN:
        os.environ["UCX_TLS"] = "^posix"


def _import_mpi():
    """Import mpi4py.MPI (which initialises MPI) and return the module."""
    _ucx_transports()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise UsageError(f"several ranks need mpi4py, which cannot be imported: {e}") from None
    return MPI
