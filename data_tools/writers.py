"""Writers of the two dataset formats read by :mod:`trainrun.data`.

Both stream: shard files are written as data arrives and the manifest last, so
a directory without ``manifest.json`` is an unfinished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from trainrun.data import (FORMAT_VERSION, MANIFEST, TENSORS_FORMAT, TOKEN_DTYPES, TOKENS_FORMAT,
                           token_dtype_name)
from trainrun.errors import UsageError

U32_MAX = 2**32 - 1


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as stable JSON (sorted keys), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class _ShardFile:
    """One open output file with a running sha256 and byte count."""

    def __init__(self, path: Path):
        self.path, self.fh, self.sha, self.bytes = path, open(path, "wb"), hashlib.sha256(), 0

    def write(self, data) -> None:
        self.fh.write(data)
        self.sha.update(data)
        self.bytes += len(memoryview(data).cast("B"))

    def close(self) -> str:
        self.fh.close()
        return self.sha.hexdigest()


class TokenShardWriter:
    """Streams token ids into ``shard-NNNNN.bin`` files of ``shard_tokens`` tokens each.

    ``close(eos_id=, tokenizer_id=, **more)`` writes ``manifest.json``.
    """

    def __init__(self, directory, vocab_size: int, shard_tokens: int):
        if shard_tokens < 1:
            raise UsageError(f"shard size must be at least 1 token, got {shard_tokens}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.vocab_size, self.shard_tokens = vocab_size, shard_tokens
        self.dtype_name = token_dtype_name(vocab_size)
        self.dtype = TOKEN_DTYPES[self.dtype_name]
        self.shards: list[dict] = []
        self._file: _ShardFile | None = None
        self._count = self._max = 0

    def add(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids outside [0, {self.vocab_size}): {ids.min()}..{ids.max()}")
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None:
                self._file = _ShardFile(self.dir / f"shard-{len(self.shards):05d}.bin")
            take = min(ids.size, self.shard_tokens - self._count)
            part, ids = ids[:take], ids[take:]
            self._file.write(np.ascontiguousarray(part))
            self._count += take
            self._max = max(self._max, int(part.max()))
            if self._count == self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        if self._file is None:
            return
        digest = self._file.close()
        self.shards.append({"file": self._file.path.name, "num_tokens": self._count, "sha256": digest,
                            "max_token": self._max})
        self._file, self._count, self._max = None, 0, 0

    def close(self, *, eos_id: int, tokenizer_id: str, **meta) -> dict:
        self._finish_shard()
        manifest = {"format": TOKENS_FORMAT, "format_version": FORMAT_VERSION, "dtype": self.dtype_name,
                    "byte_order": "little", "vocab_size": self.vocab_size, "eos_id": eos_id,
                    "tokenizer_id": tokenizer_id,
                    "num_tokens": sum(s["num_tokens"] for s in self.shards), "shards": self.shards, **meta}
        write_json(self.dir / MANIFEST, manifest)
        return manifest


def encode_sample(tensors: dict) -> bytes:
    """One sample in ONNX Runtime's .pb layout: ``[u32 n]([u32 m][TensorProto])...``."""
    from onnx import numpy_helper
    parts = []
    for name, arr in tensors.items():
        blob = numpy_helper.from_array(np.asarray(arr), name).SerializeToString()   # keeps 0-d
        parts += [struct.pack("<I", len(blob)), blob]
    body = b"".join(parts)
    if len(body) > U32_MAX:
        raise UsageError(f"a sample of {len(body)} bytes does not fit the format's u32 length")
    return struct.pack("<I", len(body)) + body


class TensorShardWriter:
    """Streams samples ({name: array without batch dim}) into ``part-NNNNN.pb`` files.

    Every sample must have the names, dtypes and shapes of the first.
    ``close()`` writes a ``trainrun-tensors`` manifest with checksums.
    """

    def __init__(self, directory, samples_per_file: int):
        if samples_per_file < 1:
            raise UsageError(f"samples per file must be at least 1, got {samples_per_file}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.samples_per_file = samples_per_file
        self.files: list[dict] = []
        self.features: dict | None = None
        self._file: _ShardFile | None = None
        self._count = 0

    def add(self, sample: dict) -> None:
        spec = {k: {"dtype": np.asarray(v).dtype.name, "shape": list(np.shape(v))} for k, v in sample.items()}
        if self.features is None:
            self.features = spec
        elif spec != self.features:
            raise UsageError(f"sample {self.num_samples} has tensors {spec}, the first sample {self.features}")
        if self._file is None:
            self._file = _ShardFile(self.dir / f"part-{len(self.files):05d}.pb")
        self._file.write(encode_sample(sample))
        self._count += 1
        if self._count == self.samples_per_file:
            self._finish_file()

    @property
    def num_samples(self) -> int:
        return sum(f["num_samples"] for f in self.files) + self._count

    def _finish_file(self) -> None:
        if self._file is None:
            return
        nbytes, digest = self._file.bytes, self._file.close()
        self.files.append({"file": self._file.path.name, "num_samples": self._count, "num_bytes": nbytes,
                           "sha256": digest})
        self._file, self._count = None, 0

    def close(self, **meta) -> dict:
        self._finish_file()
        manifest = {"format": TENSORS_FORMAT, "format_version": FORMAT_VERSION, "features": self.features or {},
                    "num_samples": self.num_samples, "files": self.files, **meta}
        write_json(self.dir / MANIFEST, manifest)
        return manifest
