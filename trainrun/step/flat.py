"""The flat buffers: every parameter (and every optimizer state, every model state) back to back in ONE
contiguous float32 array, on the host (NumPy) or the GPU (cupy).

:class:`FlatLayout` says where each tensor lives; :func:`to_host` / :func:`from_host` copy a whole buffer
(or a part of it) between either kind of array and the host; :func:`norm_sq` is the squared L2 norm of a
host buffer. The engine, the update component, checkpoints, export and generate share them; this module
imports nothing of trainrun.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NORM_CHUNK = 1 << 16


@dataclass
class FlatLayout:
    """Where each parameter lives in the flat buffers."""
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    total: int

    @classmethod
    def from_manifest(cls, manifest: dict) -> "FlatLayout":
        names, shapes, offsets, off = [], [], [], 0
        for p in manifest["params"]:
            names.append(p["name"])
            shapes.append(tuple(p["shape"]))
            offsets.append(off)
            off += int(np.prod(p["shape"], dtype=np.int64))
        return cls(names, shapes, offsets, off)

    def view(self, flat: np.ndarray, i: int) -> np.ndarray:
        n = int(np.prod(self.shapes[i], dtype=np.int64))
        return flat[self.offsets[i]:self.offsets[i] + n].reshape(self.shapes[i])

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {n: self.view(flat, i) for i, n in enumerate(self.names)}


def is_cupy(arr) -> bool:
    return type(arr).__module__.startswith("cupy")


def to_host(buf, out: np.ndarray) -> None:
    """Copy a numpy or cupy buffer into the host array ``out``."""
    if is_cupy(buf):
        buf.get(out=out)
    else:
        np.copyto(out, buf)


def from_host(buf, src: np.ndarray) -> None:
    """Copy the host array ``src`` into a numpy or cupy buffer."""
    if is_cupy(buf):
        buf.set(np.ascontiguousarray(src, dtype=buf.dtype))
    else:
        np.copyto(buf, src, casting="same_kind")


def norm_sq(g: np.ndarray) -> float:
    """Squared L2 norm of a flat float32 NumPy buffer: float32 dots of 64Ki-element chunks summed in float64."""
    return sum(float(np.dot(c, c)) for c in (g[i:i + _NORM_CHUNK] for i in range(0, g.size, _NORM_CHUNK)))

