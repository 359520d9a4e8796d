"""Checkpoints: atomic, checksummed, written in the background, resumable on any rank count.

Layout of ``<run>/checkpoints/<step>/``::

    model.safetensors      parameters, by name (safetensors: no pickle, readable by
                           safetensors/transformers/numpy tools), then the model's state that
                           is not a parameter (BatchNorm running mean/var), by name
    optimizer.safetensors  optimizer state, keys "<state>/<param name>" (e.g. exp_avg/...)
    state.json             step, updates, skipped steps, data-loader position, LR-schedule
                           position, world size and global batch at save time, seed, graph
                           hashes, the names of the optimizer states
    config.yaml            the resolved config of the run
    rank-<r>.json          each rank's step, data position and sha256 of its parameters
    checksums.json         sha256 of every file above
    COMMITTED              written last, after every rank finished: holds sha256(checksums.json)

Protocol. At a checkpoint step rank 0 writes the tensors into
``checkpoints/.staging-<step>/`` straight from the flat buffers (with ZeRO-1 the
optimizer state is gathered on rank 0 piece by piece as it is written, :mod:`trainrun.update`) and every
other rank takes the digest of its parameters: the only time the step waits. The
written data are then in the kernel's page cache, the snapshot that training may
not change, so no copy of the state is kept in the process; a background thread
fsyncs the files, reads them back for their checksums and writes the small files
(every rank its ``rank-<r>.json``). Completion is agreed through the
small per-step allreduce that the runner does anyway; once every rank is done,
rank 0 writes ``COMMITTED`` into the staging directory, renames it to
``<step>`` (one atomic rename: a ``<step>`` directory never lacks its marker)
and only then deletes checkpoints beyond ``keep_last`` (each renamed to
``.pruning-<step>`` first, so a delete cut short leaves nothing that looks
committed). A directory without ``COMMITTED`` is incomplete and ignored; stale
staging and pruning directories are removed at start-up.

The safetensors files are written directly from the flat buffers: the flat
layout is the concatenation of the tensors, so the data section is one
sequential write (a device buffer goes through one reused host chunk).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import threading
from collections.abc import Iterator

import numpy as np

from . import config as C
from . import faults
from .flat import from_host, to_host
from .rundir import (COMMITTED, best_checkpoints, checkpoints_dir, complete_checkpoints, resolve_checkpoint, run_dir_of,
                     sha256_file)
from .errors import TrainrunError, UsageError, collective

STAGING = ".staging-"
PRUNING = ".pruning-"
FORMAT_VERSION = 1
_CHUNK = 64 << 20
_READ_CHUNK = 4 << 20      # read back for the checksums


# --------------------------------------------------------------------------- safetensors on flat buffers

def _header(names, shapes, metadata=None) -> bytes:
    header, off = {}, 0
    for name, shape in zip(names, shapes):
        n = int(np.prod(shape, dtype=np.int64)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)      # keep the data section 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _chunks(flat, staging: list):
    """``flat`` (numpy or cupy, float32, an iterator of such pieces in order, or a function returning either)
    as byte chunks of at most _CHUNK; a device buffer goes through one reused host array (``staging``: [] or
    [that array])."""
    if callable(flat):
        flat = flat()
    if isinstance(flat, Iterator):
        for piece in flat:
            yield from _chunks(piece, staging)
        return
    if isinstance(flat, np.ndarray):
        mv = memoryview(np.ascontiguousarray(flat, dtype=np.float32)).cast("B")
        for i in range(0, len(mv), _CHUNK):
            yield mv[i:i + _CHUNK]
        return
    step = _CHUNK // 4
    if not staging:
        staging.append(np.empty(min(step, flat.size), np.float32))
    for i in range(0, flat.size, step):
        part = staging[0][:min(step, flat.size - i)]
        to_host(flat[i:i + step], part)
        yield memoryview(part).cast("B")


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


def write_flat_safetensors(path: str, names, shapes, flat_buffers, metadata=None, sync: bool = True) -> str | None:
    """Write tensors laid out contiguously in ``flat_buffers`` (float32, numpy or cupy); with ``sync``
    fsync and return the sha256, else leave both to :func:`sync_file` (the data are in the kernel's
    page cache once this returns: the buffers may change after it)."""
    h = hashlib.sha256() if sync else None
    staging: list = []
    with open(path, "wb") as fh:
        head = _header(names, shapes, metadata)
        fh.write(head)
        if h:
            h.update(head)
        for flat in flat_buffers:
            for chunk in _chunks(flat, staging):
                fh.write(chunk)
                if h:
                    h.update(chunk)
            chunk = None      # its view kept a gathered state alive while the next one was gathered
        if not sync:
            return None
        fh.flush()
        os.fsync(fh.fileno())
    return h.hexdigest()


def sync_file(path: str, span: tuple[int, int] | None = None) -> tuple[str, str | None]:
    """fsync ``path``; (sha256 of the file, sha256 of its bytes ``span`` = (start, end) or None), read back."""
    whole, part = hashlib.sha256(), hashlib.sha256() if span else None
    buf = memoryview(bytearray(_READ_CHUNK))
    with open(path, "rb", buffering=0) as fh:
        os.fsync(fh.fileno())
        pos = 0
        while n := fh.readinto(buf):
            block = buf[:n]
            whole.update(block)
            if part:
                lo, hi = max(span[0] - pos, 0), min(span[1] - pos, n)
                if lo < hi:
                    part.update(block[lo:hi])
            pos += n
    return whole.hexdigest(), part.hexdigest() if part else None


def params_digest(flat) -> str:
    """sha256 of a flat float32 buffer's bytes (numpy or cupy), chunk by chunk."""
    h = hashlib.sha256()
    for chunk in _chunks(flat, []):
        h.update(chunk)
    return h.hexdigest()


def write_json(path: str, obj) -> str:
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- start-up

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


# --------------------------------------------------------------------------- loading

class Pinned:
    """A committed checkpoint held open for reading: ``COMMITTED``, ``checksums.json`` (checked against the
    marker) and every file it lists opened at once, through the directory's descriptor. A prune of the
    checkpoint by the run still training (checkpoint.keep_last) then takes nothing away mid-read: an unlinked
    file stays readable while it is open. Reads are positional (no shared file offset). ``dir``: where the
    checkpoint was; ``sums``: checksums.json. Raises FileNotFoundError naming the file that is gone
    (:func:`pin` tells a pruned checkpoint from an incomplete one)."""

    def __init__(self, ckpt: str):
        self.dir = ckpt
        self._fds: dict[str, int] = {}
        d = os.open(ckpt, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            for name in (COMMITTED, "checksums.json"):
                self._open(name, d)
            marker = self.read(COMMITTED).decode(errors="replace").strip()
            if self.sha256("checksums.json") != marker:
                raise UsageError(f"{ckpt}/checksums.json: checksum does not match {ckpt}/{COMMITTED}; the "
                                 f"checkpoint is corrupt")
            self.sums = json.loads(self.read("checksums.json"))
            for name in self.sums:
                self._open(name, d)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(d)

    def _open(self, name: str, d: int) -> None:
        try:
            self._fds[name] = os.open(name, os.O_RDONLY, dir_fd=d)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "missing", name) from None

    def __contains__(self, name: str) -> bool:
        return name in self._fds

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def path(self, name: str) -> str:
        """Where the file was (for messages)."""
        return os.path.join(self.dir, name)

    def _fd(self, name: str) -> int:
        try:
            return self._fds[name]
        except KeyError:
            raise UsageError(f"{self.path(name)}: missing from the checkpoint (not in its checksums.json)") from None

    def size(self, name: str) -> int:
        return os.fstat(self._fd(name)).st_size

    def readinto(self, name: str, buf, offset: int) -> None:
        """Fill ``buf`` (a writable buffer) from byte ``offset`` of the file."""
        mv, got = memoryview(buf).cast("B"), 0
        while got < len(mv):
            n = os.preadv(self._fd(name), [mv[got:]], offset + got)
            if not n:
                raise UsageError(f"{self.path(name)}: ends at byte {offset + got}, {len(mv) - got} bytes short; "
                                 f"the file is corrupt")
            got += n

    def read(self, name: str, offset: int = 0, size: int | None = None) -> bytes:
        size = self.size(name) - offset if size is None else size
        buf = bytearray(size)
        self.readinto(name, buf, offset)
        return bytes(buf)

    def file(self, name: str):
        """The open file (for a memory map); it stays open while this checkpoint is."""
        return open(self._fd(name), "rb", closefd=False)

    def sha256(self, name: str) -> str:
        h, buf, pos = hashlib.sha256(), memoryview(bytearray(_READ_CHUNK)), 0
        while n := os.preadv(self._fd(name), [buf], pos):
            h.update(buf[:n])
            pos += n
        return h.hexdigest()

    def header(self, name: str) -> tuple[int, dict]:
        """(start of the data section, the header) of a safetensors file of the checkpoint."""
        try:
            size = struct.unpack("<Q", self.read(name, 0, 8))[0]
            if 8 + size > self.size(name):
                raise ValueError(f"a header of {size} bytes in a file of {self.size(name)}")
            return 8 + size, json.loads(self.read(name, 8, size))
        except (ValueError, struct.error, UsageError) as exc:
            raise UsageError(f"{self.path(name)}: not a readable safetensors file: {exc}") from None


_PIN_TRIES = 10


def pin(source: str) -> Pinned:
    """The checkpoint ``source`` names (a checkpoint directory, or a run directory: its latest complete one),
    held open (:class:`Pinned`): what every reader reads. When the checkpoint is pruned before all its files
    are open (the run still training, checkpoint.keep_last), a run directory's newest is taken instead; a
    checkpoint named by the user is a UsageError that says it was pruned and names the newest."""
    named = os.path.abspath(source)
    for _ in range(_PIN_TRIES):
        try:
            ckpt = resolve_checkpoint(source)
        except UsageError:
            if _is_step_dir(named) and not os.path.exists(named):
                raise _pruned(named, "not there: pruned") from None
            raise
        try:
            return Pinned(ckpt)
        except FileNotFoundError as exc:
            if os.path.isdir(ckpt):        # still there: incomplete or damaged, not pruned
                what = "missing; the checkpoint is incomplete" if exc.filename in (COMMITTED, "checksums.json") \
                    else "missing from the checkpoint"
                raise UsageError(f"{os.path.join(ckpt, exc.filename)}: {what}") from None
            if ckpt == named:
                raise _pruned(ckpt) from None
    raise _pruned(ckpt)


def _is_step_dir(path: str) -> bool:
    return os.path.basename(path).isdigit() and os.path.basename(os.path.dirname(path)) == "checkpoints"


def _pruned(ckpt: str, what: str = "pruned while being read") -> UsageError:
    """``ckpt`` was pruned (``what``: while it was being read, or before): the error, naming the run's
    newest checkpoint."""
    done = complete_checkpoints(os.path.dirname(ckpt))
    return UsageError(f"{ckpt}: {what} (the run writing it keeps only checkpoint.keep_last and "
                      f"checkpoint.keep_best); "
                      + (f"the newest checkpoint is {done[-1]}" if done else "the run holds no checkpoint now"))


def reading(ckpt):
    """For a with block over a checkpoint: ``ckpt`` itself when :class:`Pinned` (left open after it), else
    the checkpoint the path names, pinned (:func:`pin`) for the block."""
    return contextlib.nullcontext(ckpt) if isinstance(ckpt, Pinned) else pin(ckpt)


def read_config(ckpt) -> "C.Config":
    """The resolved config a checkpoint (a path or a :class:`Pinned` one) recorded: its config.yaml."""
    with reading(ckpt) as held:
        return C.load_config(held.path("config.yaml"), text=held.read("config.yaml").decode("utf-8"))


def verify(ckpt) -> dict:
    """Check the marker and every file's checksum; return checksums.json's content. ``ckpt``: a path or a
    :class:`Pinned` checkpoint."""
    with reading(ckpt) as held:
        for name, digest in held.sums.items():
            if held.sha256(name) != digest:
                raise UsageError(f"{held.path(name)}: checksum mismatch; the file is corrupt")
        return held.sums


def read_state(ckpt) -> dict:
    """state.json of a checkpoint (a path or a :class:`Pinned` one)."""
    with reading(ckpt) as held:
        state = json.loads(held.read("state.json"))
    if state.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{held.dir}/state.json: format_version {state.get('format_version')}, "
                         f"this trainrun reads {FORMAT_VERSION}")
    return state


def best_of_run(run_dir: str) -> str:
    """``export --best``: the checkpoint of ``run_dir`` best by the metric checkpoint.best_metric of the
    run's config.yaml (its latest session's) names; a UsageError when none recorded it, or none a finite
    value."""
    metric = C.watched_metric(C.load_config(os.path.join(run_dir, "config.yaml")), "checkpoint.best_metric")
    ranked = best_checkpoints(checkpoints_dir(run_dir), metric, C.greater_is_better(metric))
    if not ranked:
        raise UsageError(f"{run_dir}: --best needs checkpoints that recorded {metric} (checkpoint.best_metric): "
                         f"checkpoint.keep_best, or checkpoints at eval steps")
    ckpt, value = ranked[0]
    if not math.isfinite(value):
        raise UsageError(f"{run_dir}: no checkpoint recorded a finite {metric} (the best, {ckpt}: {value})")
    return ckpt


# the graphs a checkpoint's readers run (export, evaluate, generate): they follow from the model alone, while
# the train and optimizer graphs also change with what a resume may change (micro-batch, precision, debug)
MODEL_GRAPHS = ("forward.onnx", "eval.onnx")


def check_checkpoint(ckpt, names, graphs: tuple[str, dict] | None = None, *, optimizer_states=None,
                     forced: bool = False) -> None:
    """What every reader of a checkpoint calls before it reads a tensor: ``ckpt`` against the graphs it
    is to be used with. ``graphs``: (their directory, its manifest); a checkpoint whose state.json
    records other sha256 for the model's graphs was trained with other graphs: a UsageError naming both.
    ``names``: the tensors the graphs take (parameters, then model state); ``optimizer_states``: the
    optimizer states to be read (None: optimizer.safetensors is not read). A tensor of the checkpoint
    that none of them takes is a UsageError naming it; when the user ``forced`` a change of the model or
    optimizer (``resume --force``), a warning listing what is dropped. ``ckpt``: a path or a :class:`Pinned`
    checkpoint."""
    with reading(ckpt) as held:
        _check_checkpoint(held, names, graphs, optimizer_states, forced)


def _check_checkpoint(held: Pinned, names, graphs, optimizer_states, forced) -> None:
    ckpt = held.dir
    if graphs is not None:
        graphs_dir, manifest = graphs
        saved = read_state(held).get("graphs") or {}       # checkpoints before it recorded none
        ours = manifest["files"]
        differ = [f for f in MODEL_GRAPHS if f in saved and saved[f] != ours.get(f)]
        if differ:
            raise UsageError(
                f"{ckpt} was trained with other graphs than {graphs_dir} holds (prepared again since?); "
                f"prepare the graphs of its config again: `trainrun prepare --config {ckpt}/config.yaml "
                f"--set run.output_dir={run_dir_of(ckpt)} --force`",
                [f"{f}: sha256 {saved[f]} in {ckpt}/state.json, {ours.get(f)} in {graphs_dir}/manifest.json"
                 for f in differ])
    takes = set(names)
    model = [k for k in held.header("model.safetensors")[1] if k != "__metadata__" and k not in takes]
    unused = [f"model.safetensors: {', '.join(model)}"] if model else []
    if optimizer_states is not None and "optimizer.safetensors" in held:
        keys = [k.partition("/") for k in held.header("optimizer.safetensors")[1] if k != "__metadata__"]
        dropped = [s + "/" + n for s, _, n in keys if s not in optimizer_states or n not in takes]
        states = sorted({s for s, _, n in keys if s in optimizer_states})
        moments = [f"{s}/{n}" for s in states for n in model]
        if dropped and sorted(dropped) == sorted(moments):         # the moments of those parameters
            unused.append(f"optimizer.safetensors: their {', '.join(states)}")
        elif dropped:
            unused.append(f"optimizer.safetensors: {', '.join(dropped)}")
    if not unused:
        return
    if not forced:
        raise UsageError(f"{ckpt}: holds tensors that the model does not take; the checkpoint is of another "
                         f"model", unused)
    print(f"trainrun: warning: resume --force: the model and optimizer take fewer tensors than {ckpt} holds; "
          f"dropped:\n" + "\n".join(f"  - {u}" for u in unused), file=sys.stderr, flush=True)


def tensor_spans(ckpt: Pinned, file: str, names, shapes) -> tuple[int, list[tuple[int, int]]]:
    """Where each of ``names`` (float32, ``shapes``) lies in the safetensors ``file`` of a checkpoint: (start
    of the data section, [(offset in the data section, bytes)]), from the header alone; clear errors on
    mismatch."""
    start, header = ckpt.header(file)
    path = ckpt.path(file)
    spans = []
    for name, shape in zip(names, shapes):
        t = header.get(name)
        if t is None:
            raise UsageError(f"{path}: has no tensor '{name}'; the checkpoint is of another model")
        if tuple(t["shape"]) != tuple(shape) or t["dtype"] != "F32":
            raise UsageError(f"{path}: tensor '{name}' has shape {tuple(t['shape'])} ({t['dtype']}), this "
                             f"model's is {tuple(shape)} (F32); the checkpoint is of another model")
        begin, end = t["data_offsets"]
        if end - begin != 4 * int(np.prod(shape, dtype=np.int64)):
            raise UsageError(f"{path}: tensor '{name}' spans {end - begin} bytes, not its shape's; the file is "
                             f"corrupt")
        spans.append((begin, end - begin))
    return start, spans


def load_tensors_into(ckpt: Pinned, file: str, names, shapes, flat: np.ndarray, prefix: str = "") -> None:
    """Fill ``flat`` (laid out as names/shapes, float32) from the safetensors ``file`` of a checkpoint, each
    tensor read straight into its place; clear errors on mismatch."""
    start, spans = tensor_spans(ckpt, file, [prefix + n for n in names], shapes)
    off = 0
    for (begin, nbytes) in spans:
        n = nbytes // 4
        ckpt.readinto(file, flat[off:off + n], start + begin)
        off += n


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


# --------------------------------------------------------------------------- the runner's one component

class Checkpointer:
    """Saving, committing and restoring checkpoints, on every rank of ``comm``.

    :meth:`save` writes the tensors at the step and the rest in the background;
    the write's progress rides in the runner's per-step scalar allreduce
    (:meth:`status` before it, :meth:`progress` with the reduced values after
    it), so a commit costs no collective of its own. :meth:`finish` settles
    the write in flight at the end; :meth:`restore` fills the buffers from a
    checkpoint and returns its ``state.json``.
    """

    def __init__(self, run_dir: str, comm, keep_last: int, log=print, keep_best: int = 0,
                 best_metric: str = "eval_loss"):
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world_size
        self.log = log
        self.writer = CheckpointWriter(run_dir, self.rank, self.world, keep_last, log=log, keep_best=keep_best,
                                       best_metric=best_metric)
        self.saved_step: int | None = None     # step of the newest committed checkpoint

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

    def save(self, step: int, layout, buffers: dict, meta: dict, config_yaml: str, model_state=None) -> None:
        """Write ``buffers`` ("params" and one per optimizer state) and ``model_state`` ((layout, flat)
        of the non-parameter state, or None): the tensors now, the rest in the background
        (:meth:`CheckpointWriter.start`); ``meta`` becomes state.json (``step`` and ``loader`` are required)."""
        self._settle()     # at most one write in flight
        meta = {"format_version": FORMAT_VERSION, **meta, "step": step,
                "optimizer_states": [k for k in buffers if k != "params"]}
        self.writer.start(step, layout, buffers, meta, config_yaml, model_state)

    def finish(self) -> None:
        """At the end of training: the last write committed (or its failure raised)."""
        self._settle()

    # -- restoring
    def restore(self, ckpt: str, layout, params, state: dict, model_state=None, state_range=None,
                forced: bool = False) -> dict:
        """Fill ``params``, each optimizer ``state`` buffer and ``model_state`` ((layout, flat) or None)
        (numpy or cupy) from ``ckpt`` on every rank; return its state.json. Rank 0 verifies the checksums
        and checks the tensors against the model first (:func:`check_checkpoint`; ``forced``: by
        ``resume --force``, tensors no longer taken are dropped with a warning). ``state_range``
        (lo, hi): the optimizer state buffers hold elements lo:hi of the flat layout only (a ZeRO-1 part,
        :mod:`trainrun.update`); by default all of it."""
        error, saved, held = None, None, None
        try:
            held = pin(ckpt)        # every rank reads the files it opened here
            if self.rank == 0:
                verify(held)       # once; every rank then reads the verified files
                check_checkpoint(held, layout.names + (model_state[0].names if model_state else []),
                                 optimizer_states=list(state), forced=forced)
        except TrainrunError as exc:
            error = exc
        try:
            self.comm.agree(error)
        except BaseException:
            if held is not None:
                held.close()
            raise
        try:
            saved = read_state(held)
            host = np.empty(layout.total, np.float32)
            load_tensors_into(held, "model.safetensors", layout.names, layout.shapes, host)
            from_host(params, host)
            if model_state is not None and model_state[0].names:
                sl, buf = model_state
                held_state = np.empty(sl.total, np.float32)
                load_tensors_into(held, "model.safetensors", sl.names, sl.shapes, held_state)
                from_host(buf, held_state)
            for name, buf in state.items():
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
        return saved
