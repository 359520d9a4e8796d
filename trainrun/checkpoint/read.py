"""Reading a checkpoint: held open while it is read (:class:`Pinned`, :func:`pin`), its checksums, state and
config, checked against the graphs it is read with, its tensors read into flat buffers; ``export --best``'s
choice."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import struct
import sys

import numpy as np

from .. import config as C
from ..errors import UsageError
from ..run.rundir import (
    COMMITTED, best_checkpoints, checkpoints_dir, complete_checkpoints, resolve_checkpoint, run_dir_of,
)
from .files import _READ_CHUNK

FORMAT_VERSION = 1


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


class Held(Pinned):
    """Files of a folder that is no checkpoint (the graphs' frozen.safetensors) held open and read as a
    checkpoint's are (:func:`tensor_spans`, a memory map); no marker nor checksums to check."""

    def __init__(self, folder: str, names):
        self.dir, self._fds, self.sums = folder, {}, {}
        d = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            for name in names:
                self._open(name, d)
        except FileNotFoundError:
            self.close()
            raise UsageError(f"{os.path.join(folder, name)}: not found (prepare the graphs again)") from None
        finally:
            os.close(d)


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
            if is_step_dir(named) and not os.path.exists(named):
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


def is_step_dir(path: str) -> bool:
    """Whether ``path`` names a checkpoint of a run (``<run>/checkpoints/<step>``), there or not."""
    path = os.path.abspath(path)
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


def verify(ckpt, files=None, retry=None) -> dict:
    """Check the marker and the checksums of ``files`` (the names of the files the caller reads; None: every
    file); return checksums.json's content. ``ckpt``: a path or a :class:`Pinned` checkpoint. ``retry``: the
    command that would read another checkpoint instead, given its path: a mismatch then names the run's newest
    intact checkpoint (those files checked) and that command."""
    with reading(ckpt) as held:
        for name, digest in held.sums.items():
            if (files is None or name in files) and held.sha256(name) != digest:
                raise mismatch(held, name, files, retry)
        return held.sums


def mismatch(held: Pinned, name: str, files=None, retry=None) -> UsageError:
    """The error of file ``name`` of a checkpoint whose sha256 is not the one its checksums.json records
    (``files``, ``retry``: see :func:`verify`)."""
    return UsageError(f"{held.path(name)}: checksum mismatch; the file is corrupt"
                      + (_way_forward(held.dir, files, retry) if retry else ""))


def _way_forward(ckpt: str, files, retry) -> str:
    """What to do about corrupt checkpoint ``ckpt``: the newest other committed checkpoint of its run whose
    ``files`` are intact, with the command ``retry(it)`` that uses it; or that the run holds none."""
    if not is_step_dir(ckpt):
        return ""
    for other in reversed(complete_checkpoints(os.path.dirname(ckpt))):
        if other == ckpt:
            continue
        try:
            verify(other, files)
        except (UsageError, OSError):    # corrupt too, or pruned meanwhile
            continue
        return f"; the run's newest intact checkpoint is {other}: use it with `{retry(other)}`"
    return f"; no other checkpoint of {run_dir_of(ckpt)} is intact"


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
                     forced: bool = False, lora_base: str | None = None) -> None:
    """What every reader of a checkpoint calls before it reads a tensor: ``ckpt`` against the graphs it
    is to be used with. ``graphs``: (their directory, its manifest); a checkpoint whose state.json
    records other sha256 for the model's graphs was trained with other graphs: a UsageError naming both.
    ``names``: the tensors the graphs take (parameters, then model state); ``optimizer_states``: the
    optimizer states to be read (None: optimizer.safetensors is not read). A tensor of the checkpoint
    that none of them takes is a UsageError naming it; when the user ``forced`` a change of the model or
    optimizer (``resume --force``), a warning listing what is dropped. ``lora_base``: the sha256 of the
    model.lora base weights the tensors are to be used with (the manifest's, when ``graphs`` is given): a
    checkpoint whose adapters were trained on others is a UsageError, forced or not. ``ckpt``: a path or a
    :class:`Pinned` checkpoint."""
    with reading(ckpt) as held:
        _check_checkpoint(held, names, graphs, optimizer_states, forced,
                          lora_base=lora_base)


def _check_checkpoint(held: Pinned, names, graphs, optimizer_states, forced, lora_base) -> None:
    ckpt = held.dir
    if graphs is not None:
        lora_base = (graphs[1].get("lora") or {}).get("base_sha256")
    base = read_state(held).get("lora_base")
    if base != lora_base and (base or lora_base):
        raise UsageError(f"{ckpt}: its LoRA adapters were trained on other base weights than this model's "
                         f"(model.lora, model.init_from): base weights sha256 {base or 'none (no model.lora)'} "
                         f"in {ckpt}/state.json, {lora_base or 'none (no model.lora)'} now")
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
