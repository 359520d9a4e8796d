"""Dropout masks from trainrun's own random stream.

The train graph takes each Dropout's mask as an input (:func:`trainrun.graphs.dropout_nodes.dropout_masks`);
:class:`DropoutMasks` fills those buffers for one micro-batch as a pure function of
(``run.seed``, global sample position): sample ``j`` of a micro-batch whose first sample has
global position ``P`` draws all its masks, in the manifest's order, from one SFC64 stream keyed
by ``SeedSequence([seed, P + j])`` (with a tag that no other stream of trainrun uses). So:

* the masks of a sample do not depend on the rank count, the micro-batch size or the
  accumulation steps (2 ranks x micro-batch b == 1 rank x 2 micro-batches of b);
* no two samples of a run share a stream, hence no two ranks draw the same masks;
* a resumed run continues with the same masks: the loader's position is all the state.

Each mask takes the next ceil(n/4) 64-bit draws of the sample's stream, read as n 16-bit ones;
an element is kept when its draw is >= round(p * 2^16) (the ratio is resolved to 1/65536) and
then holds 1/(1-p); its cost: docs/design.md ("Small costs per step"). NumPy's bit generators' raw streams and SeedSequence
are stable across NumPy versions (NEP 19), so are the masks. Pure NumPy: no onnxruntime.
"""

from __future__ import annotations

import numpy as np

_TAG = 0x64726F70      # "drop": keeps these streams apart from the data order's [seed, epoch]
_BITS = 16


class DropoutMasks:
    """The mask buffers of one micro-batch of ``micro_batch`` samples.

    ``spec``: the manifest's ``dropout`` entry; ``sizes``: {symbol: size} of its dims."""

    def __init__(self, spec: dict, sizes: dict, seed: int):
        self.seed = int(seed)
        self.buffers: dict[str, np.ndarray] = {}
        self._parts = []       # (buffer, elements per sample, threshold, kept value)
        for m in spec["masks"]:
            shape = tuple(sizes[d] if isinstance(d, str) else int(d) for d in m["shape"])
            buf = np.zeros(shape, np.dtype(m["dtype"]))
            self.buffers[m["name"]] = buf
            threshold = np.uint16(min(round(m["ratio"] * (1 << _BITS)), (1 << _BITS) - 1))
            self._parts.append((buf, int(np.prod(shape[1:], dtype=np.int64)), threshold,
                                buf.dtype.type(1.0 / (1.0 - m["ratio"]))))
        self.micro_batch = next(iter(self.buffers.values())).shape[0] if self.buffers else 0

    def fill(self, position: int) -> None:
        """The masks of the micro-batch whose first sample has global position ``position``."""
        for j in range(self.micro_batch):
            bits = np.random.SFC64(np.random.SeedSequence([_TAG, self.seed, position + j]))
            for buf, n, threshold, kept in self._parts:     # each mask: the next ceil(n / 4) 64-bit draws
                draws = bits.random_raw(-(-n // 4)).astype("<u8", copy=False).view("<u2")  # same on any byte order
                out = buf[j].reshape(-1)
                np.greater_equal(draws[:n], threshold, out=out)
                if buf.dtype != np.bool_:
                    out *= kept
