"""The frozen weights of a graphs folder (the manifest's ``frozen``: model.frozen's weights, model.lora's
base): graph inputs as the parameters are, their values in the folder's frozen.safetensors, which ``prepare``
writes (:mod:`trainrun.graphs.manifest`). This module is the file's one reader: held open as a checkpoint's
files are (:class:`trainrun.checkpoint.Held`), each tensor found from its header (float32 and the manifest's
shape, or a clear error: :func:`trainrun.checkpoint.tensor_spans`), then read into the engine's frozen buffer
(:func:`read_into`) or streamed and mapped by export and evaluate (:func:`spans`).
"""

from __future__ import annotations

import numpy as np

from .. import checkpoint as K
from ..step.flat import FlatLayout
from .manifest import FROZEN_FILE


def layout(manifest: dict) -> FlatLayout:
    """Where each frozen weight lives in the frozen flat buffer."""
    return FlatLayout.from_manifest({"params": manifest.get("frozen", [])})


def held(graphs_dir: str, manifest: dict) -> K.Held:
    """The graphs folder with its frozen.safetensors held open (when the run has frozen weights)."""
    return K.Held(graphs_dir, [FROZEN_FILE] if manifest.get("frozen") else [])


def spans(graphs: K.Held, manifest: dict) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, byte offset in frozen.safetensors, bytes) of each frozen weight, in the buffer's order
    (``graphs``: :func:`held`)."""
    L = layout(manifest)
    if not L.names:
        return []
    start, found = K.tensor_spans(graphs, FROZEN_FILE, L.names, L.shapes)
    return [(n, tuple(s), start + off, size) for n, s, (off, size) in zip(L.names, L.shapes, found)]


def read_into(graphs_dir: str, manifest: dict, flat: np.ndarray) -> None:
    """Fill ``flat`` (a host float32 buffer laid out as :func:`layout`) with the frozen weights of the graphs
    folder, each read straight into its place."""
    L = layout(manifest)
    with held(graphs_dir, manifest) as graphs:
        for i, (_, _, offset, _) in enumerate(spans(graphs, manifest)):
            lo = L.offsets[i]
            graphs.readinto(FROZEN_FILE, flat[lo:lo + int(np.prod(L.shapes[i], dtype=np.int64))], offset)
