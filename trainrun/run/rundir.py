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
import math
import os

from ..errors import UsageError

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


def recorded_metric(state: dict, metric: str) -> float | None:
    """The value of eval metric ``metric`` a checkpoint's state.json recorded (its ``eval`` metrics; or its
    ``best_metric`` of that name; ``eval_loss`` of checkpoints that recorded nothing else), None if none."""
    value = (state.get("eval") or {}).get(metric)
    best = state.get("best_metric") or {}
    if value is None and best.get("name") == metric:
        value = best.get("value")
    if value is None and metric == "eval_loss" and not state.get("eval") and not best:
        value = state.get("eval_loss")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def best_checkpoints(ckpt_root: str, metric: str, greater_is_better: bool) -> list[tuple[str, float]]:
    """(checkpoint, value) of the committed checkpoints that recorded eval metric ``metric``
    (:func:`recorded_metric`), best first: finite values by value (the highest first when
    ``greater_is_better``), the later step first among equals; a value that is not finite (NaN, inf) ranks
    after every finite one, whatever the direction. Checkpoints that recorded another metric only are not
    ranked: values of two metrics never compare."""
    ranked = []
    for ckpt in complete_checkpoints(ckpt_root):
        try:
            with open(os.path.join(ckpt, "state.json")) as fh:
                value = recorded_metric(json.load(fh), metric)
        except (OSError, ValueError):
            continue
        if value is not None:
            finite = math.isfinite(value)
            key = (-value if greater_is_better else value) if finite else 0.0
            ranked.append(((not finite, key, -int(os.path.basename(ckpt))), ckpt, value))
    return [(c, v) for _, c, v in sorted(ranked)]


def run_dir_of(ckpt: str) -> str:
    """The run directory holding a checkpoint (<run>/checkpoints/<step>)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
