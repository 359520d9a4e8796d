"""A run directory's layout, and finding its checkpoints::

    <run>/config.yaml                 the resolved config of the run
    <run>/graphs/                     the prepared graphs and their manifest.json (trainrun.graphs)
    <run>/checkpoints/<step>/         committed checkpoints (trainrun.checkpoint), each with a COMMITTED marker
    <run>/model.onnx                  the inference model exported at the end

Files are identified by :func:`sha256_file` (the graphs in their manifest, a checkpoint's checksums).
This module imports nothing of trainrun but errors.
"""

from __future__ import annotations

import hashlib
import json
import os

from .errors import UsageError

GRAPHS = "graphs"
CHECKPOINTS = "checkpoints"
COMMITTED = "COMMITTED"


def sha256_file(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def umask() -> int:
    """The process's umask, read without setting it (Linux's /proc/self/status): ``os.umask`` changes it
    for a moment, in which another thread's new file (a checkpoint written in the background) would get
    the wrong mode."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o077)
    os.umask(current)
    return current


def as_created(path: str) -> str:
    """``path`` (a folder or file from a writer with a private mode of its own: tempfile.mkdtemp's 0700,
    safetensors' 0600) given the mode ``mkdir``/``open`` would have: 0777/0666 less the umask. On the
    staged name, before it is renamed into place: the rename stays the one atomic step."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask())
    return path


def graphs_dir(run_dir: str) -> str:
    return os.path.join(run_dir, GRAPHS)


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def _steps(ckpt_root: str) -> list[int]:
    if not os.path.isdir(ckpt_root):
        return []
    return sorted(int(d) for d in os.listdir(ckpt_root) if d.isdigit())


def complete_checkpoints(ckpt_root: str) -> list[str]:
    """Committed checkpoint directories, oldest first."""
    return [os.path.join(ckpt_root, str(s)) for s in _steps(ckpt_root)
            if os.path.exists(os.path.join(ckpt_root, str(s), COMMITTED))]


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a run directory (latest complete one) or a checkpoint path."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, COMMITTED)):
        return path
    if os.path.isdir(checkpoints_dir(path)):
        done = complete_checkpoints(checkpoints_dir(path))
        if not done:
            raise UsageError(f"{path}: no complete checkpoint under checkpoints/")
        return done[-1]
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "state.json")):
        raise UsageError(f"{path}: checkpoint is incomplete (no {COMMITTED} marker); "
                         f"use an earlier one or the run directory")
    raise UsageError(f"{path}: neither a run directory with checkpoints nor a checkpoint")


def best_checkpoints(ckpt_root: str) -> list[str]:
    """Committed checkpoints that recorded the metric checkpoint.best_metric names (state.json
    ``best_metric``: name, value, greater_is_better; older ones: ``eval_loss``), best first (the later
    step first among equals)."""
    ranked = []
    for ckpt in complete_checkpoints(ckpt_root):
        try:
            with open(os.path.join(ckpt, "state.json")) as fh:
                state = json.load(fh)
        except (OSError, ValueError):
            continue
        best = state.get("best_metric") or {"value": state.get("eval_loss"), "greater_is_better": False}
        if best.get("value") is not None:
            value = -best["value"] if best.get("greater_is_better") else best["value"]
            ranked.append((value, -int(os.path.basename(ckpt)), ckpt))
    return [c for _, _, c in sorted(ranked)]


def run_dir_of(ckpt: str) -> str:
    """The run directory holding a checkpoint (<run>/checkpoints/<step>)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
