"""``opt``: a schema field with the checks of its one key in its metadata: ``min``, ``max``, ``gt``,
``choices`` (applied by :mod:`trainrun.config.coerce`) and ``path`` (made absolute by
:mod:`trainrun.config.load`); :mod:`trainrun.config.text` writes them into the reference."""

from __future__ import annotations

import dataclasses
from dataclasses import field


def opt(default=dataclasses.MISSING, *, factory=None, min=None, max=None, gt=None,
        choices=None, path=None):
    """A dataclass field with validation metadata.

    ``path``: ``"file"`` or ``"dir"`` when the value names something that must exist.
    """
    meta = {k: v for k, v in dict(min=min, max=max, gt=gt, choices=choices, path=path).items()
            if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
