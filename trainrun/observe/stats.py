"""Convergence statistics: per step and per rank, summaries of activations, gradients and parameters.

With ``debug.stats_every: N`` (N > 0) every rank writes, every N steps, one JSON
line to ``<output_dir>/stats/rank-<r>/stats.jsonl``::

    {"step": 7, "rank": 0, "world_size": 2,
     "scalars": {"loss": 4.93, "local_loss": 4.95, "grad_norm": 0.81, "lr": 0.003},
     "tensors": {"act/logits": {"numel": 65536, "nan": 0, "inf": 0, "min": -3.1, "max": 4.2,
                                "mean": 0.01, "std": 0.52, "norm": 133.4}, ...,
                 "grad/transformer.wte.weight": {...}, "param/transformer.wte.weight": {...}}}

* ``act/<name>``: a train-graph tensor chosen by ``debug.tensors`` (made a graph
  output at prepare time, :func:`trainrun.graphs.gradients.add_outputs`), over all micro-batches of the
  step on this rank (merged exactly, Chan et al.);
* ``grad/<param>``: the gradient the optimizer receives, i.e. the mean over
  ranks and micro-batches after the allreduce, before clipping (the same on
  every rank);
* ``param/<param>``: the parameter after this step's update.

Statistics are taken over the finite values; ``nan``/``inf`` count the others
(a non-finite scalar is written as the string "nan", "inf" or "-inf").
``std`` is the population standard deviation, ``norm`` the L2 norm, all
accumulated in float64. ``meta.json`` beside the JSONL says who wrote it.
The format is plain JSON so other frameworks can write it
(``scripts/torch_stats.py`` does for PyTorch); :mod:`trainrun.commands.compare` reads it.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os

import numpy as np

from ..errors import UsageError

FORMAT = "trainrun-stats"
FORMAT_VERSION = 1
STATS = ("min", "max", "mean", "std", "norm")
COUNTS = ("nan", "inf")
FILE = "stats.jsonl"
CHUNK = 1 << 20


# --------------------------------------------------------------------------- graph outputs (prepare time)

# --------------------------------------------------------------------------- the numbers

class Moments:
    """Count, min, max, mean and M2 (sum of squared deviations) of the finite values,
    plus the NaN/Inf counts; :meth:`merge` combines two exactly (Chan et al.)."""

    __slots__ = ("numel", "nan", "inf", "count", "min", "max", "mean", "m2")

    def __init__(self, numel=0, nan=0, inf=0, count=0, lo=math.inf, hi=-math.inf, mean=0.0, m2=0.0):
        self.numel, self.nan, self.inf, self.count = numel, nan, inf, count
        self.min, self.max, self.mean, self.m2 = lo, hi, mean, m2

    @classmethod
    def of(cls, x) -> "Moments":
        """Moments of a numpy or cupy array (any shape and numeric dtype)."""
        xp = _xp(x)
        flat = x.reshape(-1)
        if flat.dtype.kind not in "f":
            flat = flat.astype(np.float64)
        numel = int(flat.size)
        finite = xp.isfinite(flat)
        count = int(finite.sum())
        nan = inf = 0
        if count != numel:
            nan = int(xp.isnan(flat).sum())
            inf = numel - count - nan
            flat = flat[finite]
        if count == 0:
            return cls(numel, nan, inf)
        mean = float(flat.sum(dtype=np.float64)) / count
        m2 = 0.0
        for i in range(0, count, CHUNK):       # float64 deviations, a bounded temporary at a time
            d = flat[i:i + CHUNK].astype(np.float64)
            d -= mean
            m2 += float(xp.dot(d, d))
        return cls(numel, nan, inf, count, float(flat.min()), float(flat.max()), mean, m2)

    def merge(self, o: "Moments") -> "Moments":
        n = self.count + o.count
        if n == 0:
            mean, m2 = 0.0, 0.0
        else:
            delta = o.mean - self.mean
            mean = self.mean + delta * o.count / n
            m2 = self.m2 + o.m2 + delta * delta * self.count * o.count / n
        return Moments(self.numel + o.numel, self.nan + o.nan, self.inf + o.inf, n,
                       min(self.min, o.min), max(self.max, o.max), mean, m2)

    def summary(self, scale: float = 1.0) -> dict:
        """The record of one tensor; ``scale`` (> 0) multiplies every value statistic."""
        out = {"numel": self.numel, "nan": self.nan, "inf": self.inf}
        if self.count == 0:
            return {**out, **{k: None for k in STATS}}
        std = math.sqrt(max(self.m2, 0.0) / self.count)
        norm = math.sqrt(max(self.m2 + self.count * self.mean * self.mean, 0.0))
        return {**out, "min": self.min * scale, "max": self.max * scale, "mean": self.mean * scale,
                "std": std * scale, "norm": norm * scale}


def summarize(x, scale: float = 1.0) -> dict:
    return Moments.of(x).summary(scale)


def _xp(x):
    if type(x).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


# --------------------------------------------------------------------------- files

def _scalar(v) -> float | str:
    """JSON has no NaN/Infinity: non-finite scalars (a skipped step's loss) are written "nan", "inf"."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


def rank_dir(stats_dir: str, rank: int) -> str:
    return os.path.join(stats_dir, f"rank-{rank}")


class StatsFile:
    """Appends step records to ``<stats_dir>/rank-<r>/stats.jsonl`` (and writes meta.json)."""

    def __init__(self, stats_dir: str, rank: int, world_size: int, source: str = "trainrun", **meta):
        self.dir = rank_dir(stats_dir, rank)
        os.makedirs(self.dir, exist_ok=True)
        self.rank, self.world = rank, world_size
        with open(os.path.join(self.dir, "meta.json"), "w") as fh:
            json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, "source": source, "rank": rank,
                       "world_size": world_size, **meta}, fh, indent=1)
        self._fh = open(os.path.join(self.dir, FILE), "a", buffering=1)

    def write(self, step: int, scalars: dict, tensors: dict) -> None:
        record = {"step": step, "rank": self.rank, "world_size": self.world,
                  "scalars": {k: _scalar(v) for k, v in scalars.items()}, "tensors": tensors}
        self._fh.write(json.dumps(record, allow_nan=False) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_rank(path: str) -> dict[int, dict]:
    """step -> record of one rank's stats.jsonl (a later line for the same step wins: a resumed run)."""
    file = os.path.join(path, FILE)
    records = {}
    try:
        with open(file) as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    records[int(rec["step"])] = rec
                except (ValueError, KeyError, TypeError) as exc:
                    raise UsageError(f"{file}:{i}: not a statistics record ({exc})") from None
    except FileNotFoundError:
        raise UsageError(f"{file}: not found") from None
    return records


def find_ranks(path: str) -> dict[int, str]:
    """rank -> directory for a run directory, its stats/ directory or one rank-<r> directory."""
    if os.path.isfile(os.path.join(path, FILE)):
        meta = os.path.join(path, "meta.json")
        rank = 0
        if os.path.isfile(meta):
            with open(meta) as fh:
                rank = int(json.load(fh).get("rank", 0))
        return {rank: path}
    for base in (os.path.join(path, "stats"), path):
        if os.path.isdir(base):
            found = {}
            for name in os.listdir(base):
                if name.startswith("rank-") and name[5:].isdigit() \
                        and os.path.isfile(os.path.join(base, name, FILE)):
                    found[int(name[5:])] = os.path.join(base, name)
            if found:
                return dict(sorted(found.items()))
    raise UsageError(f"{path}: holds no statistics (expected stats/rank-<r>/{FILE}; "
                     f"train with debug.stats_every > 0)")


# --------------------------------------------------------------------------- the runner's side

class StatsWriter:
    """Collects and writes the statistics of the steps that are due (every ``every`` steps)."""

    def __init__(self, stats_dir: str, rank: int, world_size: int, every: int, engine, activations: list[str]):
        self.every = every
        self.engine = engine
        self.activations = activations
        self.file = StatsFile(stats_dir, rank, world_size, activations=activations,
                              params=list(engine.layout.names))
        self._acts: dict[str, Moments] = {}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def begin(self) -> "StatsWriter":
        self._acts = {}
        return self

    def micro_batch(self) -> None:
        """After each forward/backward of a due step: fold in the activations of that micro-batch."""
        for name, value in self.engine.extra_train_outputs().items():
            m = Moments.of(value)
            self._acts[name] = self._acts[name].merge(m) if name in self._acts else m

    def finish(self, step: int, grad_scale: float, scalars: dict) -> None:
        """After the update: gradients (times ``grad_scale``: the mean over ranks and micro-batches)
        and parameters, then one line to the file."""
        eng, L = self.engine, self.engine.layout
        tensors = {f"act/{n}": self._acts[n].summary() for n in self.activations if n in self._acts}
        for i, name in enumerate(L.names):
            tensors[f"grad/{name}"] = summarize(L.view(eng.grads, i), grad_scale)
        for i, name in enumerate(L.names):
            tensors[f"param/{name}"] = summarize(L.view(eng.params, i))
        self.file.write(step, scalars, tensors)

    def close(self) -> None:
        self.file.close()
