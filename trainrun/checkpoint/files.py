"""A checkpoint's files: safetensors written straight from flat buffers (the flat layout is the
concatenation of the tensors, so the data section is one sequential write; a device buffer goes through
one reused host chunk), fsync and the read-back checksums, the small JSON files."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator

import numpy as np

from ..step.flat import to_host

_CHUNK = 64 << 20
_READ_CHUNK = 4 << 20      # read back for the checksums


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
