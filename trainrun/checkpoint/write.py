"""Writing a checkpoint: the tensors at the step, the rest in the background, the agreed commit, pruning and
start-up clean-up (:class:`CheckpointWriter`); the runner's one component that also restores
(:class:`Checkpointer`). The protocol: :mod:`trainrun.checkpoint`."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Iterator

import numpy as np

from .. import config as C
from .. import faults
from ..errors import TrainrunError, UsageError, collective
from ..step.flat import from_host
from ..run.rundir import COMMITTED, best_checkpoints, checkpoints_dir, complete_checkpoints, sha256_file
from .files import _CHUNK, _fsync_dir, _header, params_digest, sync_file, write_flat_safetensors, write_json
from .read import FORMAT_VERSION, check_checkpoint, load_tensors_into, mismatch, pin, read_state, verify

STAGING = ".staging-"
PRUNING = ".pruning-"


def cleanup(ckpt_root: str, log=print) -> None:
    """Start-up hygiene (rank 0): remove stale staging dirs, warn about incomplete checkpoints."""
    if not os.path.isdir(ckpt_root):
        return
    for d in os.listdir(ckpt_root):
        full = os.path.join(ckpt_root, d)
        if d.startswith(STAGING):
            log(f"removing stale checkpoint staging directory {full}")
            shutil.rmtree(full, ignore_errors=True)
        elif d.startswith(PRUNING):       # a delete of an old checkpoint that was interrupted
            shutil.rmtree(full, ignore_errors=True)
        elif d.isdigit() and not os.path.exists(os.path.join(full, COMMITTED)):
            log(f"warning: ignoring incomplete checkpoint {full} (no {COMMITTED} marker)")


class _Once:
    """A function called at most once (later calls return None). :meth:`drain` calls it if it was not, and
    runs what it returned to its end where that is an iterator: a gather whose collectives every rank takes
    part in, in full, wherever its pieces go (nowhere off rank 0, or after a failed write)."""

    def __init__(self, fn):
        self.fn, self.out = fn, None

    def __call__(self):
        fn, self.fn = self.fn, None
        if fn is None:
            return None
        self.out = fn()
        return self.out

    def drain(self) -> None:
        out = self() if self.fn is not None else self.out
        self.out = None
        if isinstance(out, Iterator):
            for _ in out:
                pass


# --------------------------------------------------------------------------- saving

class CheckpointWriter:
    """Background checkpoint writing for one rank; the runner drives the commit."""

    def __init__(self, run_dir: str, rank: int, world_size: int, keep_last: int, log=print, keep_best: int = 0,
                 best_metric: str = "eval_loss"):
        self.root = checkpoints_dir(run_dir)
        self.rank, self.world = rank, world_size
        self.keep_last, self.keep_best, self.best_metric = keep_last, keep_best, best_metric
        self.log = log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pending_step: int | None = None

    # -- called by every rank at the checkpoint step
    def start(self, step: int, layout, buffers: dict, meta: dict, config_yaml: str, model_state=None) -> None:
        """Write ``buffers`` ("params" and one per optimizer state; rank 0 writes the tensors) and
        ``model_state`` ((layout, flat buffer) of the model's non-parameter state, written after the
        parameters in model.safetensors). Now, while the buffers hold this step: rank 0 writes the tensor
        files into the staging directory (into the kernel's page cache, no copy kept in this process),
        every other rank takes the digest of its parameters; the buffers may change once this returns.
        The fsync, the checksums and the small files follow in the background."""
        self.wait()   # at most one write in flight (Checkpointer.save settled it already)
        self.pending_step, self._error, self._thread = step, None, None
        staging = os.path.join(self.root, f"{STAGING}{step}")
        files, digest = [], None      # (tensor file, span of the parameters' bytes in it or None)
        # optimizer states given as functions (ZeRO-1's gathers, collectives): every rank calls each once
        gathers = {k: _Once(v) for k, v in buffers.items() if k != "params" and callable(v)}
        buffers = {**buffers, **gathers}
        try:
            os.makedirs(staging, exist_ok=True)
            if self.rank == 0:
                sl = model_state[0] if model_state and model_state[0].names else None
                names = layout.names + (sl.names if sl else [])
                shapes = layout.shapes + (sl.shapes if sl else [])
                metadata = {"format": "pt", "producer": "trainrun"}
                write_flat_safetensors(os.path.join(staging, "model.safetensors"), names, shapes,
                                       [buffers["params"]] + ([model_state[1]] if sl else []), metadata, sync=False)
                head = len(_header(names, shapes, metadata))
                files.append(("model.safetensors", (head, head + 4 * layout.total)))
                faults.stall("STALL_TENSORS", self.rank, step)
                states = [k for k in buffers if k != "params"]
                if states:
                    write_flat_safetensors(
                        os.path.join(staging, "optimizer.safetensors"),
                        [f"{s}/{n}" for s in states for n in layout.names],
                        [sh for _ in states for sh in layout.shapes], [buffers[s] for s in states], sync=False)
                    files.append(("optimizer.safetensors", None))
            else:
                digest = params_digest(buffers["params"])
        except KeyboardInterrupt:     # a second Ctrl-C while the tensors are written: interrupted (130), not
            self.abandon()            # a failed checkpoint (exit 1); nothing of this one is left
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to every rank by status()
            self._error = exc
        finally:
            for gather in gathers.values():      # those not run to their end (not rank 0, or its write failed)
                gather.drain()
        if self._error is not None:
            return
        self._thread = threading.Thread(target=self._write, name="checkpoint-writer", daemon=True,
                                        args=(staging, files, digest, meta, config_yaml))
        self._thread.start()

    def _write(self, staging, files, digest, meta, config_yaml) -> None:
        try:
            sums = {}
            if self.rank == 0:
                for name, span in files:
                    sums[name], part = sync_file(os.path.join(staging, name), span)
                    digest = part or digest
                sums["state.json"] = write_json(os.path.join(staging, "state.json"), meta)
                with open(os.path.join(staging, "config.yaml"), "w") as fh:
                    fh.write(config_yaml)
                    fh.flush()
                    os.fsync(fh.fileno())
                sums["config.yaml"] = sha256_file(os.path.join(staging, "config.yaml"))
            faults.stall("STALL_CHECKPOINT", self.rank, meta["step"])
            # each rank's own parameter digest: proves every replica holds the same bits
            own = {"rank": self.rank, "world_size": self.world, "step": meta["step"],
                   "loader": meta["loader"], "params_sha256": digest}
            digest = write_json(os.path.join(staging, f"rank-{self.rank}.json"), own)
            with open(os.path.join(staging, f"rank-{self.rank}.sha256"), "w") as fh:
                fh.write(digest)
            if self.rank == 0:
                self._rank0_sums = sums
        except BaseException as exc:  # noqa: BLE001 - reported to every rank by status()
            self._error = exc

    def status(self) -> tuple[float, float]:
        """(done, failed) flags of the write in flight, for the runner's per-step allreduce."""
        if self.pending_step is None:
            return 0.0, 0.0
        if self._thread is not None and self._thread.is_alive():
            return 0.0, 0.0
        return (0.0, 1.0) if self._error is not None else (1.0, 0.0)

    def error_text(self) -> str:
        return f"{type(self._error).__name__}: {self._error}" if self._error else ""

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the write in flight ends; a TrainrunError naming the step and the directory when it
        takes longer than ``timeout_s`` (a stuck filesystem must not hang the job)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TrainrunError(f"rank {self.rank}: the checkpoint write of step {self.pending_step} into "
                                    f"{self.root} did not finish within {timeout_s:g} s "
                                    f"(distributed.timeout_s); is the filesystem stuck?")

    def abandon(self) -> None:
        """A failed write: drop the staging directory (rank 0), keep older checkpoints intact."""
        step, self.pending_step = self.pending_step, None
        if self.rank == 0 and step is not None:
            shutil.rmtree(os.path.join(self.root, f"{STAGING}{step}"), ignore_errors=True)

    # -- rank 0, once every rank reported done
    def commit(self) -> str:
        step, self.pending_step = self.pending_step, None
        staging = os.path.join(self.root, f"{STAGING}{step}")
        sums = dict(self._rank0_sums)
        for r in range(self.world):
            try:
                with open(os.path.join(staging, f"rank-{r}.sha256")) as fh:
                    sums[f"rank-{r}.json"] = fh.read().strip()
            except FileNotFoundError:
                raise TrainrunError(f"checkpoint at step {step}: rank {r} reported its part written, but rank 0 "
                                    f"does not see {staging}/rank-{r}.json: the run directory must be on a "
                                    f"filesystem every rank shares (e.g. NFS), the same path on every host"
                                    ) from None
            os.remove(os.path.join(staging, f"rank-{r}.sha256"))
        digest = write_json(os.path.join(staging, "checksums.json"), sums)
        marker = os.path.join(staging, COMMITTED)
        with open(marker + ".tmp", "w") as fh:      # whole or absent: a signal cannot leave it half-written
            fh.write(digest + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(marker + ".tmp", marker)
        _fsync_dir(staging)
        final = os.path.join(self.root, str(step))
        if os.path.exists(final):       # an incomplete leftover of the same step
            shutil.rmtree(final)
        os.rename(staging, final)       # the commit: <step>/ appears whole, marker included
        _fsync_dir(self.root)
        self._prune()
        return final

    def _prune(self) -> None:
        """Delete checkpoints beyond the newest keep_last and the keep_best best by ``best_metric``
        (:func:`rundir.best_checkpoints`: only those that recorded it, a value that is not finite last). Each is
        first renamed out of the checkpoint namespace (one atomic rename), so an interrupted delete never
        leaves a directory that still holds COMMITTED but lacks files; start-up removes what is left of it."""
        done = complete_checkpoints(self.root)
        best = best_checkpoints(self.root, self.best_metric, C.greater_is_better(self.best_metric)) \
            if self.keep_best else []
        keep = set(done[-self.keep_last:]) | {c for c, _ in best[:self.keep_best]}
        for old in done:
            if old in keep:
                continue
            doomed = os.path.join(self.root, PRUNING + os.path.basename(old))
            os.rename(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def copy_checkpoint(ckpt: str, dest: str, retry=None) -> str:
    """A committed copy of checkpoint ``ckpt`` at ``dest`` (``<run>/checkpoints/<step>`` of another run,
    holding no committed one there): its files read through one :class:`Pinned` (a prune of ``ckpt`` takes
    nothing mid-copy), each checked against its checksum as it is copied (a mismatch: :func:`mismatch`,
    ``retry`` as for :func:`verify`), written into a staging directory and renamed into place, as a commit."""
    root = os.path.dirname(dest)
    staging = os.path.join(root, f"{STAGING}{os.path.basename(dest)}")
    with pin(ckpt) as held:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            for name in [*held.sums, "checksums.json", COMMITTED]:      # the marker last
                h, size = hashlib.sha256(), held.size(name)
                with open(os.path.join(staging, name), "wb") as fh:
                    for pos in range(0, size, _CHUNK):
                        part = bytearray(min(_CHUNK, size - pos))
                        held.readinto(name, part, pos)
                        h.update(part)
                        fh.write(part)
                    fh.flush()
                    os.fsync(fh.fileno())
                if name in held.sums and h.hexdigest() != held.sums[name]:
                    raise mismatch(held, name, retry=retry)
            _fsync_dir(staging)
            if os.path.exists(dest):        # an incomplete leftover of the same step
                shutil.rmtree(dest)
            os.rename(staging, dest)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return dest


# --------------------------------------------------------------------------- the runner's one component

def _call(part, method: str, *args, default=None):
    """``part.method(*args)``, or ``default`` where ``part`` has no such method (or is None)."""
    fn = getattr(part, method, None)
    return default if fn is None else fn(*args)


class Checkpointer:
    """Saving, committing and restoring checkpoints, on every rank of ``comm``.

    :meth:`save` writes the tensors at the step and the rest in the background;
    the write's progress rides in the runner's per-step scalar allreduce
    (:meth:`status` before it, :meth:`progress` with the reduced values after
    it), so a commit costs no collective of its own. :meth:`finish` settles
    the write in flight at the end; :meth:`restore` fills the buffers from a
    checkpoint and returns its ``state.json``. What a checkpoint holds besides
    the model's tensors is the state of the parts registered once
    (:meth:`register`): save and restore go through them, in their order.
    """

    def __init__(self, run_dir: str, comm, keep_last: int, log=print, keep_best: int = 0,
                 best_metric: str = "eval_loss"):
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world_size
        self.log = log
        self.writer = CheckpointWriter(run_dir, self.rank, self.world, keep_last, log=log, keep_best=keep_best,
                                       best_metric=best_metric)
        self.saved_step: int | None = None     # step of the newest committed checkpoint
        self.parts: list[tuple[str | None, object]] = []      # (state.json key, part), :meth:`register`

    def register(self, key: str | None, part) -> None:
        """``part``'s state saved with every checkpoint and handed back by :meth:`restore`; each of its methods
        below is optional. Under ``key`` state.json holds ``part.state_dict()`` (null where ``part`` is None:
        a component this run has not), and a restore calls ``part.load_state_dict(entry)`` with what the
        checkpoint holds there, unless it holds none (null, or absent from an older checkpoint). With
        ``key`` None, ``state_dict()`` gives keys of state.json itself, and ``load_state_dict(state, ckpt)``
        is handed the whole of state.json and the checkpoint's directory (to read tensors of its own). A part
        with array state also has ``full_state()`` (name -> the flat buffer of optimizer.safetensors'
        ``<name>/`` tensors, or a function whose generator gathers it to rank 0 in pieces: every rank calls
        it) and ``restore_state(saved)`` (given state.json before any tensor is read: name -> the buffer the
        restore fills, elements ``state_range`` of the saved tensor, or None for one the part only has
        checked and reads itself). :meth:`save` and :meth:`restore` take the parts in the order registered,
        the same on every rank (their gathers and loads may be collectives). A key registered again has its
        part replaced, in its place (a component rebuilt: a rejoined rank's loader)."""
        at = [i for i, (k, _) in enumerate(self.parts) if key is not None and k == key]
        if at:
            self.parts[at[0]] = (key, part)
        else:
            self.parts.append((key, part))

    def entries(self) -> dict:
        """What state.json holds of the registered parts now (their ``state_dict()``s)."""
        entries = {}
        for key, part in self.parts:
            entry = _call(part, "state_dict")
            entries.update((entry or {}) if key is None else {key: entry})
        return entries

    def load_keyed(self, saved: dict) -> None:
        """The parts registered under a key given their entry of ``saved`` (state.json's, or
        :meth:`entries` sent from another rank), where it holds one."""
        for key, part in self.parts:
            if key is not None and saved.get(key) is not None:
                _call(part, "load_state_dict", saved[key])

    # -- saving
    def status(self) -> tuple[float, float]:
        """(done, failed) of this rank's write in flight, to be summed over ranks."""
        return self.writer.status()

    def progress(self, done: float, failed: float) -> None:
        """After the per-step allreduce of :meth:`status`: commit once every rank is done;
        a failure on any rank raises the same collective error everywhere."""
        w = self.writer
        if w.pending_step is None:
            return
        if failed:
            step = w.pending_step
            # every rank's own write ends before rank 0 removes the staging directory (the allgather orders
            # it): a peer still writing its rank-N.json there could otherwise leave the directory behind
            w.wait(getattr(self.comm, "timeout_s", None))
            causes = self.comm.allgather_object(w.error_text())
            w.abandon()
            raise collective(TrainrunError(
                f"checkpoint at step {step} failed ("
                + "; ".join(f"rank {r}: {c}" for r, c in enumerate(causes) if c)
                + "); older checkpoints are intact"))
        if done == self.world:
            step = w.pending_step
            if self.rank == 0:
                self.log(f"checkpoint saved: {w.commit()}")
            else:
                w.pending_step = None
            self.saved_step = step

    def _settle(self) -> None:
        """Wait for the write in flight (if any) and commit or fail it, on every rank."""
        if self.writer.pending_step is not None:
            self.writer.wait(getattr(self.comm, "timeout_s", None))
            self.progress(*self.comm.allreduce_scalars(list(self.writer.status()), op="sum"))

    def regroup(self) -> int | None:
        """``distributed.elastic``: ``comm`` shrank to the survivors of a lost rank (every survivor calls it).
        A write in flight is abandoned, its staging directory removed (it may hold a dead rank's part, and the
        survivors' new rank numbers would commit the wrong ones); committed checkpoints are untouched. Returns
        the abandoned step, or None."""
        w, step = self.writer, self.writer.pending_step
        if step is not None:
            w.wait(getattr(self.comm, "timeout_s", None))      # this rank's own part written
        self.rank, self.world = self.comm.rank, self.comm.world_size
        w.rank, w.world = self.rank, self.world
        if step is not None:
            self.comm.barrier()        # every survivor's part written before rank 0 removes the directory
            w.abandon()
        return step

    def save(self, step: int, layout, buffers: dict, meta: dict, config_yaml: str, model_state=None) -> None:
        """Write ``buffers`` ("params", then the registered parts' ``full_state()``: one buffer per optimizer
        state) and ``model_state`` ((layout, flat) of the non-parameter state, or None): the tensors now, the
        rest in the background (:meth:`CheckpointWriter.start`). state.json: the registered parts'
        ``state_dict()`` and ``meta`` (``loader`` is required, from the parts or ``meta``)."""
        self._settle()     # at most one write in flight
        entries, buffers = self.entries(), dict(buffers)
        for _, part in self.parts:
            buffers.update(_call(part, "full_state", default={}))
        meta = {"format_version": FORMAT_VERSION, **entries, **meta, "step": step,
                "optimizer_states": [k for k in buffers if k != "params"]}
        self.writer.start(step, layout, buffers, meta, config_yaml, model_state)

    def finish(self) -> None:
        """At the end of training: the last write committed (or its failure raised)."""
        self._settle()

    # -- restoring
    def restore(self, ckpt: str, layout, params, state: dict | None = None, model_state=None, state_range=None,
                forced: bool = False, lora_base: str | None = None, retry=None) -> dict:
        """Fill ``params``, each optimizer ``state`` buffer (those given, then the registered parts'
        ``restore_state``) and ``model_state`` ((layout, flat) or None) (numpy or cupy) from ``ckpt`` on every
        rank, then hand the registered parts their state (:meth:`register`); return its state.json. Rank 0
        verifies the checksums and checks the tensors against the model first (:func:`check_checkpoint`;
        ``forced``: by ``resume --force``, tensors no longer taken are dropped with a warning).
        ``state_range`` (lo, hi): the optimizer state buffers hold elements lo:hi of the flat layout only (a
        ZeRO-1 part, :mod:`trainrun.sync.update`); by default all of it. A state given as None is one the
        checkpoint may hold but its owner reads (:meth:`trainrun.sync.diloco.DiLoCo.load_state_dict`).
        ``lora_base``: the sha256 of the model.lora base weights, which must be those the checkpoint's
        adapters were trained on. ``retry``: the command that resumes from another checkpoint, given its path
        (a corrupt one's error names the run's newest intact checkpoint and that command)."""
        error, saved, held, state = None, None, None, dict(state or {})
        try:
            held = pin(ckpt)        # every rank reads the files it opened here
            saved = read_state(held)
            for _, part in self.parts:
                state.update(_call(part, "restore_state", saved, default={}))
            if self.rank == 0:
                verify(held, retry=retry)       # once; every rank then reads the verified files
                check_checkpoint(held, layout.names + (model_state[0].names if model_state else []),
                                 optimizer_states=list(state), forced=forced, lora_base=lora_base)
        except TrainrunError as exc:
            error = exc
        try:
            self.comm.agree(error)
        except BaseException:
            if held is not None:
                held.close()
            raise
        try:
            host = np.empty(layout.total, np.float32)
            load_tensors_into(held, "model.safetensors", layout.names, layout.shapes, host)
            from_host(params, host)
            if model_state is not None and model_state[0].names:
                sl, buf = model_state
                held_state = np.empty(sl.total, np.float32)
                load_tensors_into(held, "model.safetensors", sl.names, sl.shapes, held_state)
                from_host(buf, held_state)
            for name, buf in state.items():
                if buf is None:     # checked above, read by its owner (another replica's weights)
                    continue
                if name not in saved["optimizer_states"]:
                    raise UsageError(f"{ckpt}: holds no optimizer state '{name}' (saved: "
                                     f"{saved['optimizer_states']}); the optimizer changed")
                load_tensors_into(held, "optimizer.safetensors", layout.names, layout.shapes, host,
                                  prefix=f"{name}/")
                from_host(buf, host[slice(*state_range)] if state_range else host)
        except TrainrunError as exc:
            error = exc
        finally:
            held.close()
        self.comm.agree(error)
        self.saved_step = saved["step"]
        for key, part in self.parts:
            if key is None:
                _call(part, "load_state_dict", saved, ckpt)
        self.load_keyed(saved)
        return saved
