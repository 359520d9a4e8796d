"""Independent twins of trainrun's data order, learning-rate schedule and tensor statistics, for the
references (tests/test_parity.py, scripts/torch_stats.py) that check trainrun against PyTorch.

Written from the documented rules, never by importing trainrun: a reference that reused trainrun's
loader, schedule or statistics would share their defects and could not see them.

* Data (trainrun/data.py, "Token shards", "Tensor samples" and "Sample order"; .pb files decoded here with
  struct + onnx, see tensor_samples): the shards listed in manifest.json are
  one stream of little-endian token ids; sample ``i`` is ``stream[i*L : i*L + L + 1]`` with
  ``input_ids = window[:-1]``, ``labels = window[1:]``; there are ``(tokens - 1) // L`` samples.
  Global position ``p`` is sample ``perm(p // N)[p % N]``, ``perm(e)`` being ``arange(N)`` shuffled
  in place by ``np.random.default_rng([seed, e])`` (not shuffled with data.shuffle false); step ``s``
  (0-based) takes positions ``s*G .. s*G + G - 1`` of the global batch ``G``.
* Schedule (trainrun/step/schedule.py, docs/design.md): ``t`` = 1-based update; linear warmup ``lr * t / warmup``;
  then progress ``x = (t - warmup) / (max_steps - warmup)`` clipped to [0, 1] and constant ``lr``,
  linear ``min_lr + (lr - min_lr)(1 - x)``, poly ``... (1 - x) ** power``, cosine
  ``... 0.5 (1 + cos(pi x))``.
* Statistics (trainrun/stats.py): over the finite values, float64: min, max, mean, population std,
  L2 norm; ``numel``, ``nan``, ``inf`` counts.

Only NumPy here (torch stays with the callers).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

_DTYPES = {"uint16": "<u2", "uint32": "<u4"}


def token_stream(dataset_dir: str) -> np.ndarray:
    """The whole token stream of a trainrun token-shard directory, read with NumPy."""
    with open(os.path.join(dataset_dir, "manifest.json")) as fh:
        manifest = json.load(fh)
    assert manifest["format"] == "trainrun-tokens", manifest.get("format")
    dtype = np.dtype(_DTYPES[manifest["dtype"]])
    parts = [np.fromfile(os.path.join(dataset_dir, s["file"]), dtype=dtype) for s in manifest["shards"]]
    return np.concatenate(parts).astype(np.int64)


def sample_order(n: int, seed: int, shuffle: bool = True):
    """Yield the sample index of global positions 0, 1, 2, ... of a dataset of ``n`` samples."""
    position = 0
    while True:
        perm = np.arange(n, dtype=np.int64)
        if shuffle:
            np.random.default_rng([seed, position // n]).shuffle(perm)
        yield from perm.tolist()
        position += n


def global_batches(dataset_dir: str, seq_len: int, global_batch: int, seed: int, shuffle: bool = True):
    """Yield (input_ids, labels), int64 [global_batch, seq_len], of steps 1, 2, ... in trainrun's order."""
    stream = token_stream(dataset_dir)
    order = sample_order((len(stream) - 1) // seq_len, seed, shuffle)
    while True:
        windows = np.stack([stream[i * seq_len:i * seq_len + seq_len + 1]
                            for i in (next(order) for _ in range(global_batch))])
        yield windows[:, :-1], windows[:, 1:]


def tensor_samples(dataset_dir: str) -> list[dict]:
    """Every sample ({name: array}) of a directory of ONNX Runtime .pb files, in file-name order:
    each file ``[u32 n]([u32 m][TensorProto])...`` little-endian (decoded with onnx's numpy_helper)."""
    import struct

    from onnx import TensorProto, numpy_helper
    samples = []
    for name in sorted(f for f in os.listdir(dataset_dir) if f.endswith(".pb") and not f.startswith(".")):
        with open(os.path.join(dataset_dir, name), "rb") as fh:
            data = fh.read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack_from("<I", data, pos)
            end, pos, sample = pos + 4 + n, pos + 4, {}
            while pos < end:
                (m,) = struct.unpack_from("<I", data, pos)
                t = TensorProto()
                t.ParseFromString(data[pos + 4:pos + 4 + m])
                sample[t.name] = numpy_helper.to_array(t)
                pos += 4 + m
            samples.append(sample)
    return samples


def tensor_batches(dataset_dir: str, global_batch: int, seed: int, shuffle: bool = True):
    """Yield {name: array [global_batch, ...]} of steps 1, 2, ... of a .pb dataset in trainrun's order."""
    samples = tensor_samples(dataset_dir)
    order = sample_order(len(samples), seed, shuffle)
    while True:
        chosen = [samples[next(order)] for _ in range(global_batch)]
        yield {k: np.stack([s[k] for s in chosen]) for k in chosen[0]}


def learning_rate(t: int, lr: float, max_steps: int, name: str = "constant", warmup_steps: int = 0,
                  min_lr: float = 0.0, power: float = 1.0) -> float:
    if warmup_steps and t <= warmup_steps:
        return lr * t / warmup_steps
    if name == "constant":
        return lr
    x = min(1.0, max(0.0, (t - warmup_steps) / max(1, max_steps - warmup_steps)))
    shape = {"linear": lambda: 1.0 - x, "poly": lambda: (1.0 - x) ** power,
             "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * x))}[name]()
    return min_lr + (lr - min_lr) * shape


def summary(x) -> dict:
    """trainrun's statistics record of one tensor (all values of ``x``)."""
    x = np.asarray(x).reshape(-1)
    finite = x[np.isfinite(x)].astype(np.float64)
    nan = int(np.isnan(x).sum())
    out = {"numel": int(x.size), "nan": nan, "inf": int(x.size - finite.size - nan)}
    if not finite.size:
        return {**out, "min": None, "max": None, "mean": None, "std": None, "norm": None}
    return {**out, "min": float(finite.min()), "max": float(finite.max()), "mean": float(finite.mean()),
            "std": float(finite.std()), "norm": float(np.sqrt(np.dot(finite, finite)))}
