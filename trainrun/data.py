"""Binary datasets and the per-rank training loader.

A dataset is a directory in one of two formats.

Token shards (``manifest.json`` with ``"format": "trainrun-tokens"``)
    Shard files of raw little-endian token ids (``uint16`` when the tokenizer's
    vocab_size < 65536, else ``uint32``), memory-mapped once at open. The
    manifest holds format_version, dtype, vocab_size, tokenizer_id, eos_id and
    per shard its file name, token count, sha256 and largest token id.
    The shards form one token stream; sample ``i`` is the window
    ``stream[i*L : i*L + L + 1]`` (``L = seq_len``), so windows may span shard
    boundaries; ``input_ids = window[:-1]``, ``labels = window[1:]`` (int64).

Tensor samples (``*.pb`` files, optionally with a ``"trainrun-tensors"`` manifest)
    The layout of ONNX Runtime's C++ TrainingRunner: each file a run of samples
    ``[u32 sample_bytes]([u32 tensor_bytes][TensorProto])...``, little-endian,
    where sample_bytes counts the tensor length prefixes too; each sample holds
    named tensors without a batch dimension; files are read sorted by name
    (dot-files skipped). Unlike that runner, every rank sees all files and
    takes its part of the global sample order below.

Sample order (:class:`TrainLoader`): global position ``p`` is sample
``perm(p // N)[p % N]`` of a permutation seeded by ``(seed, epoch)``; each step
takes the next ``micro_batch * accum * world_size`` positions and rank ``r``
takes its contiguous slice ``r``, micro-batch ``a`` being chunk ``a`` of it.
The stream therefore does not depend on the number of ranks, and the global
position alone (``state_dict()``) resumes it, on any number of ranks.

Every problem with the data raises :class:`trainrun.errors.UsageError` naming
the file or key.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import queue
import struct
import threading
from pathlib import Path

import numpy as np

from .errors import TrainrunError, UsageError
from .run.rundir import sha256_file

MANIFEST = "manifest.json"
TOKENS_FORMAT = "trainrun-tokens"
TENSORS_FORMAT = "trainrun-tensors"
FORMAT_VERSION = 1
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TOKEN_FEATURES = ("input_ids", "labels")

__all__ = ["open_dataset", "TrainLoader", "eval_batches", "check_train", "check_eval", "TokenDataset",
           "TensorDataset", "token_dtype_name", "outside", "MANIFEST", "TOKENS_FORMAT", "TENSORS_FORMAT",
           "FORMAT_VERSION"]


def token_dtype_name(vocab_size: int) -> str:
    """The shard dtype for a vocabulary: uint16 when vocab_size < 65536, else uint32."""
    return "uint16" if vocab_size < 65536 else "uint32"


def outside(directory, name: str) -> str | None:
    """The real path of ``directory/name`` (links followed) when it lies outside ``directory``'s, else None:
    a manifest (or a model) names files of its own folder only."""
    root, real = os.path.realpath(directory), os.path.realpath(os.path.join(directory, name))
    return real if os.path.commonpath([root, real]) != root else None


# ---------------------------------------------------------------------- helpers
def _read_manifest(directory: Path) -> dict | None:
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: not a readable JSON manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise UsageError(f"{path}: must hold a JSON object")
    return manifest


def _need(obj: dict, key: str, typ: type, where: str):
    """``obj[key]`` checked to be a ``typ`` (bool is not an int here)."""
    if key not in obj:
        raise UsageError(f"{where}: missing key '{key}'")
    value = obj[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise UsageError(f"{where}: key '{key}' must be {typ.__name__}, got {value!r}")
    return value


def _check_version(manifest: dict, where: str) -> None:
    version = _need(manifest, "format_version", int, where)
    if version != FORMAT_VERSION:
        raise UsageError(f"{where}: format_version {version} is not supported; this trainrun reads "
                         f"format_version {FORMAT_VERSION} (rebuild the dataset with this trainrun-data)")


def _listed_file(directory: Path, entry: dict, where: str) -> Path:
    """The file a manifest entry names (key 'file'), refused when it is not in ``directory``."""
    name = _need(entry, "file", str, where)
    real = outside(directory, name)
    if real is not None:
        raise UsageError(f"{where}: file '{name}' lies outside the dataset directory {directory} ({real}); "
                         f"a {MANIFEST} lists files of its own directory only")
    return directory / name


def _check_size(path: Path, expected: int, what: str) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise UsageError(f"{path}: listed in {MANIFEST} but missing") from None
    if size != expected:
        state = "truncated" if size < expected else "too long"
        raise UsageError(f"{path}: {state}: {size} bytes, {MANIFEST} says {expected} ({what})")


def _verify_sha(path: Path, digest: str) -> None:
    actual = sha256_file(path)
    if actual != digest:
        raise UsageError(f"{path}: sha256 checksum mismatch (file {actual[:16]}..., {MANIFEST} "
                         f"{digest[:16]}...): the file is corrupt or was changed after writing")


def _check_int(name: str, value, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise UsageError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------- token shards
class TokenDataset:
    """Token shards of one directory; see the module docstring for the layout."""

    kind = "tokens"
    release_every_pages = 16384     # resident shard pages (estimate) before release_pages(): 64 MiB

    def __init__(self, path: Path, manifest: dict, seq_len: int | None, vocab_limit: int | None,
                 verify: bool, vocab_key: str | None = None):
        where = str(path / MANIFEST)
        _check_version(manifest, where)
        self.path, self.manifest, self.verified = path, manifest, verify
        dtype = _need(manifest, "dtype", str, where)
        if dtype not in TOKEN_DTYPES:
            raise UsageError(f"{where}: dtype '{dtype}' is not one of {', '.join(TOKEN_DTYPES)}")
        self.dtype = TOKEN_DTYPES[dtype]
        self.vocab_size = _need(manifest, "vocab_size", int, where)
        self.eos_id = _need(manifest, "eos_id", int, where)
        self.tokenizer_id = _need(manifest, "tokenizer_id", str, where)
        shards = _need(manifest, "shards", list, where)
        self.files: list[Path] = []
        self._arrays: list[np.ndarray] = []
        self._maps: list[mmap.mmap] = []
        self._touched = 0     # pages touched (estimate) since the last release_pages()
        self._starts = [0]
        self.max_token = -1
        for i, shard in enumerate(shards):
            sw = f"{where}: shards[{i}]"
            if not isinstance(shard, dict):
                raise UsageError(f"{sw}: must be an object")
            file = _listed_file(path, shard, sw)
            n = _need(shard, "num_tokens", int, sw)
            digest = _need(shard, "sha256", str, sw)
            max_token = _need(shard, "max_token", int, sw)
            _check_size(file, n * self.dtype.itemsize, f"{n} tokens of {dtype}")
            if verify:
                _verify_sha(file, digest)
            if n == 0:
                continue
            self.files.append(file)
            with open(file, "rb") as fh:
                self._maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
            self._arrays.append(np.frombuffer(self._maps[-1], dtype=self.dtype))
            self._starts.append(self._starts[-1] + n)
            self.max_token = max(self.max_token, max_token)
        self.num_tokens = self._starts[-1]
        self._limit = vocab_limit
        if vocab_limit is not None and self.max_token >= vocab_limit:
            raise UsageError(f"{where}: token ids go up to {self.max_token} (tokenizer vocab_size "
                             f"{self.vocab_size}), not below the model's vocab_size {vocab_limit}"
                             + (f": set {vocab_key} to {max(self.vocab_size, self.max_token + 1)} or more"
                                if vocab_key else ""))
        self.seq_len = seq_len
        self.num_samples = 0
        if seq_len is not None:
            self.num_samples = (self.num_tokens - 1) // seq_len if self.num_tokens else 0
            if self.num_samples < 1:
                raise UsageError(f"{path}: {self.num_tokens} tokens are too few for one sample of "
                                 f"seq_len {seq_len} (needs {seq_len + 1})")
        self.feature_names = list(TOKEN_FEATURES)
        self.specs = {n: ((seq_len,), np.dtype(np.int64)) for n in self.feature_names}

    def new_batch(self, n: int) -> dict:
        return {name: np.empty((n, *shape), dtype) for name, (shape, dtype) in self.specs.items()}

    def read(self, indices: np.ndarray, out: dict) -> dict:
        """Fill ``out`` (from :meth:`new_batch`) with the samples ``indices``."""
        ids, labels = (out[n] for n in self.feature_names)
        L = self.seq_len
        self._touched += len(indices) * ((L + 1) * self.dtype.itemsize // mmap.PAGESIZE + 2)
        if self._touched > self.release_every_pages:
            self.release_pages()
        for row, i in enumerate(indices.tolist()):
            self._copy(ids[row], i * L)
            self._copy(labels[row], i * L + 1)
        if self._limit is not None:
            for arr, shift in ((ids, 0), (labels, 1)):
                if arr.max() >= self._limit:
                    self._bad_token(indices, arr, shift)
        return out

    def release_pages(self) -> None:
        """Unmap the shard pages read so far (they stay in the page cache), so that the
        process's resident memory stays flat over long runs instead of growing to the dataset's size."""
        self._touched = 0
        for m in self._maps:
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_DONTNEED)

    def _copy(self, dst: np.ndarray, start: int) -> None:
        """``dst[:] = stream[start : start + len(dst)]`` across shard boundaries."""
        k = bisect.bisect_right(self._starts, start) - 1
        done = 0
        while done < len(dst):
            arr, offset = self._arrays[k], start + done - self._starts[k]
            n = min(len(dst) - done, len(arr) - offset)
            dst[done:done + n] = arr[offset:offset + n]
            done += n
            k += 1

    def _bad_token(self, indices, arr, shift):
        row, col = np.argwhere(arr >= self._limit)[0]
        pos = int(indices[row]) * self.seq_len + int(col) + shift
        k = bisect.bisect_right(self._starts, pos) - 1
        raise UsageError(f"{self.files[k]}: token id {int(arr[row, col])} at token {pos - self._starts[k]} "
                         f"is not below the model's vocab_size {self._limit} (the shard does not match "
                         f"its {MANIFEST}; open with verify=True to check checksums)")


# ---------------------------------------------------------------------- tensor samples (.pb)
class TensorDataset:
    """ONNX Runtime TrainingRunner ``.pb`` files; see the module docstring for the layout."""

    kind = "tensors"

    def __init__(self, path: Path, manifest: dict | None, seq_len: int | None, vocab_limit: int | None,
                 n_positions: int | None, verify: bool):
        import onnx  # only this format needs it
        from onnx import numpy_helper
        self._proto, self._to_array = onnx.TensorProto, numpy_helper.to_array
        self.path, self.manifest, self.verified = path, manifest, verify
        self.files = self._list_files(path, manifest, verify)
        self._maps, index, self._starts = [], [], [0]
        for file in self.files:
            m, rows = self._scan(file)
            self._maps.append(m)
            index.extend(rows)
            self._starts.append(len(index))
        self.num_samples = len(index)
        if not index:
            raise UsageError(f"{path}: the .pb files hold no samples")
        width = {len(r) for r in index}
        if len(width) > 1 or 0 in width:
            raise UsageError(f"{path}: samples hold different numbers of tensors, or none ({sorted(width)})")
        self._index = np.asarray(index, dtype=np.int64)          # [num_samples, tensors, (offset, length)]
        first = self._decode(0)
        self.feature_names = list(first)
        self.specs = {n: (first[n].shape, first[n].dtype) for n in self.feature_names}
        self._limit = vocab_limit
        self.seq_len = seq_len
        ids = self.specs.get("input_ids")
        if ids is not None and ids[0]:
            length = ids[0][-1]
            if seq_len is not None and length != seq_len:
                raise UsageError(f"{self.files[0]}: samples have input_ids of length {length}, but "
                                 f"seq_len is {seq_len}; set data.seq_len to {length}")
            if n_positions is not None and length > n_positions:
                raise UsageError(f"{self.files[0]}: input_ids of length {length} are longer than the "
                                 f"model's positions (n_positions {n_positions})")
        if verify:  # no checksums in this layout's origin: decode and check every sample
            for i in range(self.num_samples):
                self._checked(i)

    @staticmethod
    def _list_files(path: Path, manifest: dict | None, verify: bool) -> list[Path]:
        if manifest is None:
            files = sorted(p for p in path.glob("*.pb") if not p.name.startswith(".") and p.is_file())
            if not files:
                raise UsageError(f"{path}: holds neither {MANIFEST} nor *.pb files; not a dataset")
            return files
        where = str(path / MANIFEST)
        _check_version(manifest, where)
        files = []
        for i, entry in enumerate(_need(manifest, "files", list, where)):
            ew = f"{where}: files[{i}]"
            if not isinstance(entry, dict):
                raise UsageError(f"{ew}: must be an object")
            file = _listed_file(path, entry, ew)
            _check_size(file, _need(entry, "num_bytes", int, ew), "bytes")
            if verify:
                _verify_sha(file, _need(entry, "sha256", str, ew))
            files.append(file)
        if not files:
            raise UsageError(f"{where}: lists no files")
        return files

    @staticmethod
    def _scan(file: Path):
        """Memory-map ``file`` and index its samples: per sample a list of (offset, length) of each tensor."""
        with open(file, "rb") as fh:
            size = fh.seek(0, 2)
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        rows, pos, unpack = [], 0, struct.Struct("<I").unpack_from
        while pos < size:
            if pos + 4 > size:
                raise UsageError(f"{file}: truncated: {size - pos} stray byte(s) at byte {pos} after "
                                 f"sample {len(rows) - 1}")
            (n,) = unpack(data, pos)
            end = pos + 4 + n
            if end > size:
                raise UsageError(f"{file}: truncated: sample {len(rows)} at byte {pos} declares {n} bytes, "
                                 f"only {size - pos - 4} remain")
            pos += 4
            tensors = []
            while pos < end:
                if pos + 4 > end or pos + 4 + unpack(data, pos)[0] > end:
                    raise UsageError(f"{file}: sample {len(rows)}: a tensor at byte {pos} overruns the "
                                     f"sample's {n} bytes (malformed length prefix)")
                m = unpack(data, pos)[0]
                tensors.append((pos + 4, m))
                pos += 4 + m
            rows.append(tensors)
        return data, rows

    def _where(self, i: int) -> tuple[Path, int, int]:
        f = bisect.bisect_right(self._starts, i) - 1
        return self.files[f], f, i - self._starts[f]

    def _decode(self, i: int) -> dict:
        """Sample ``i`` as {feature name: ndarray} in file order (names as stored)."""
        file, f, local = self._where(i)
        out = {}
        for offset, length in self._index[i].tolist():
            proto = self._proto()
            try:
                proto.ParseFromString(self._maps[f][offset:offset + length])
                arr = self._to_array(proto)
            except Exception as exc:  # noqa: BLE001 - protobuf/onnx raise assorted types
                raise UsageError(f"{file}: sample {local}: not a valid TensorProto ({exc})") from None
            if proto.name in out or not proto.name:
                raise UsageError(f"{file}: sample {local}: tensor name {proto.name!r} is empty or repeated")
            out[proto.name] = arr
        return out

    def _checked(self, i: int) -> dict:
        sample = self._decode(i)
        if set(sample) != set(self.feature_names):
            file, _, local = self._where(i)
            raise UsageError(f"{file}: sample {local} holds tensors {sorted(sample)}, the first sample "
                             f"{sorted(self.feature_names)}")
        out = {}
        for name in self.feature_names:
            arr, (shape, dtype) = sample[name], self.specs[name]
            if arr.shape != shape or arr.dtype != dtype:
                file, _, local = self._where(i)
                raise UsageError(f"{file}: sample {local}: tensor '{name}' is {arr.dtype} {list(arr.shape)}, "
                                 f"the first sample's is {dtype} {list(shape)}")
            if name == "input_ids" and self._limit is not None and arr.size and \
                    (arr.min() < 0 or arr.max() >= self._limit):
                file, _, local = self._where(i)
                raise UsageError(f"{file}: sample {local}: input_ids hold {int(arr.max())}/{int(arr.min())}, "
                                 f"outside the model's vocab_size {self._limit}")
            out[name] = arr
        return out

    def new_batch(self, n: int) -> dict:
        return {name: np.empty((n, *shape), dtype) for name, (shape, dtype) in self.specs.items()}

    def read(self, indices: np.ndarray, out: dict) -> dict:
        for row, i in enumerate(indices.tolist()):
            for name, arr in self._checked(i).items():
                out[name][row] = arr
        return out


# ---------------------------------------------------------------------- open
def open_dataset(path, seq_len: int | None, vocab_size: int | None = None, n_positions: int | None = None,
                 verify: bool = True, vocab_key: str | None = None):
    """Open a token-shard or ``.pb`` dataset directory.

    ``seq_len``: tokens per sample (for ``.pb`` data it must equal the
    ``input_ids`` length); None only to inspect token shards (no samples). ``vocab_size`` and
    ``n_positions``: the model's, to reject token ids and sequences it cannot
    take (which feature feeds which graph input is the engine's: data.inputs); ``vocab_key``: the config
    key of ``vocab_size``, which a refusal names. ``verify``: check sha256 (token shards, manifests) or
    decode every sample (``.pb`` without manifest); sizes are always checked.
    Raises :class:`UsageError` naming the file or key for every problem.
    """
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a dataset directory" if path.exists() else "dataset directory does not exist"
        raise UsageError(f"{path}: {what}")
    if seq_len is not None:
        _check_int("seq_len", seq_len, 1)
        if n_positions is not None and seq_len > n_positions:
            raise UsageError(f"seq_len {seq_len} is longer than the model's positions (n_positions "
                             f"{n_positions})")
    manifest = _read_manifest(path)
    fmt = TENSORS_FORMAT if manifest is None else manifest.get("format")
    if fmt == TOKENS_FORMAT:
        return TokenDataset(path, manifest, seq_len, vocab_size, verify, vocab_key)
    if fmt == TENSORS_FORMAT:
        return TensorDataset(path, manifest, seq_len, vocab_size, n_positions, verify)
    raise UsageError(f"{path / MANIFEST}: key 'format' is {fmt!r}, expected '{TOKENS_FORMAT}' or "
                     f"'{TENSORS_FORMAT}'")


# ---------------------------------------------------------------------- loaders
def _enough(ds, batch: int, what: str) -> int:
    if ds.num_samples < batch:
        raise UsageError(f"{ds.path}: {ds.num_samples} samples (seq_len {ds.seq_len}) are fewer than one {what}")
    return batch


def check_train(ds, micro_batch: int, accum: int, world_size: int) -> int:
    """The global batch of a training step, which ``ds`` must hold at least once."""
    batch = micro_batch * accum * world_size
    return _enough(ds, batch, f"global batch of {batch} (micro_batch {micro_batch} x accum {accum} x world_size "
                              f"{world_size}); use more data or a smaller batch")


def check_eval(ds, micro_batch: int, world_size: int) -> int:
    """The batch of an evaluation step (all ranks), which ``ds`` must hold at least once."""
    batch = micro_batch * world_size
    return _enough(ds, batch, f"eval batch of {batch} (micro_batch {micro_batch} x world_size {world_size}); "
                              f"use more data or a smaller batch")


class TrainLoader:
    """This rank's micro-batches of each step, in the rank-count-independent global order.

    ``next_step()`` returns ``accum`` dicts {feature: array [micro_batch, ...]}.
    The arrays are reused buffers: they stay valid until the next call of
    ``next_step()``; copy them to keep them. With ``prefetch`` > 0 a thread
    reads that many steps ahead.
    """

    def __init__(self, ds, micro_batch: int, accum: int = 1, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, prefetch: int = 2):
        self.ds = ds
        self.micro_batch = _check_int("micro_batch", micro_batch, 1)
        self.accum = _check_int("accum", accum, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        self.seed = _check_int("seed", seed, 0)
        self.prefetch = _check_int("prefetch", prefetch, 0)
        self.shuffle = bool(shuffle)
        if self.rank >= self.world_size:
            raise UsageError(f"rank {rank} is not below world_size {world_size}")
        self.global_batch = check_train(ds, self.micro_batch, self.accum, self.world_size)
        self._pool = [[ds.new_batch(self.micro_batch) for _ in range(self.accum)]
                      for _ in range(self.prefetch + 2)]   # enough that a buffer is never refilled in use
        self._orders: dict[int, np.ndarray] = {}
        self._position = 0       # global position of the next step the caller gets
        self._slot = 0           # pool slot of that step
        self._thread = self._queue = self._stop = None

    # -- order
    @property
    def position(self) -> int:
        return self._position

    @property
    def epoch(self) -> int:
        return self._position // self.ds.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            n = self.ds.num_samples
            order = np.arange(n, dtype=np.int64)
            if self.shuffle:
                np.random.default_rng([self.seed, epoch]).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = order
        return order

    def _indices(self, position: int, count: int) -> np.ndarray:
        """Sample indices of global positions ``position .. position + count - 1``."""
        n, parts = self.ds.num_samples, []
        while count:
            epoch, i = divmod(position, n)
            take = min(count, n - i)
            parts.append(self._order(epoch)[i:i + take])
            position, count = position + take, count - take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _first(self, position: int, a: int) -> int:
        """Global position of the first sample of this rank's micro-batch ``a`` of the step at ``position``."""
        return position + (self.rank * self.accum + a) * self.micro_batch

    def _fill(self, position: int, slot: int) -> list[dict]:
        batch = self._pool[slot]
        for a, out in enumerate(batch):
            self.ds.read(self._indices(self._first(position, a), self.micro_batch), out)
        return batch

    def sample_position(self, a: int) -> int:
        """Global position of the first sample of micro-batch ``a`` of the step ``next_step()`` returned last
        (keys per-sample randomness such as dropout masks: the same sample, the same key, on any rank count)."""
        return self._first(self._position - self.global_batch, a)

    # -- steps
    def next_step(self) -> list[dict]:
        if self.prefetch == 0:
            batch = self._fill(self._position, self._slot)
        else:
            if self._thread is None:
                self._start()
            batch = self._get()
        self._position += self.global_batch
        self._slot = (self._slot + 1) % len(self._pool)
        return list(batch)

    def _start(self) -> None:
        self._stop, self._queue = threading.Event(), queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, name="trainrun-data", daemon=True,
                                        args=(self._position, self._slot, self._stop, self._queue))
        self._thread.start()

    def _produce(self, position, slot, stop, q) -> None:
        try:
            while not stop.is_set():
                q.put(self._fill(position, slot))
                position += self.global_batch
                slot = (slot + 1) % len(self._pool)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            q.put(exc)

    def _get(self) -> list[dict]:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    self._thread = None
                    raise TrainrunError("the data loader thread stopped unexpectedly") from None
        if isinstance(item, BaseException):
            self._halt()
            raise item
        return item

    def _halt(self) -> None:
        """Stop the prefetch thread; steps it read ahead are dropped (and re-read on the next call)."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:                           # make room so a blocked put returns and sees the stop flag
                self._queue.get(timeout=0.01)
            except queue.Empty:
                pass
        self._thread = self._queue = self._stop = None

    # -- state
    def state_dict(self) -> dict:
        """The position of the next step (JSON-serialisable ints); ``epoch`` is informative."""
        return {"position": self._position, "epoch": self.epoch, "seed": self.seed,
                "shuffle": int(self.shuffle), "num_samples": self.ds.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UsageError(f"loader state must be a dict, got {type(state).__name__}")
        position = _check_int("loader state 'position'", _need(state, "position", int, "loader state"), 0)
        seed = _check_int("loader state 'seed'", _need(state, "seed", int, "loader state"), 0)
        shuffle = _need(state, "shuffle", int, "loader state")
        n = _need(state, "num_samples", int, "loader state")
        if n != self.ds.num_samples:
            raise UsageError(f"loader state 'num_samples' is {n} but {self.ds.path} has {self.ds.num_samples} "
                             f"samples (seq_len {self.ds.seq_len}); the data changed, so the saved position "
                             f"does not continue the same order")
        self._halt()
        self._position, self.seed, self.shuffle = position, seed, bool(shuffle)
        self._orders = {}

    def close(self) -> None:
        self._halt()

    def as_rank(self, rank: int, world_size: int) -> "TrainLoader":
        """This loader closed, and one of the same data and settings reading rank ``rank``'s slice of ``world_size``
        (a rank that rejoins an elastic job in a lost rank's place)."""
        self.close()
        return TrainLoader(self.ds, self.micro_batch, self.accum, rank, world_size, seed=self.seed,
                           shuffle=self.shuffle, prefetch=self.prefetch)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def eval_batches(ds, micro_batch: int, rank: int = 0, world_size: int = 1, steps: int | None = None,
                 rest: bool = False):
    """Deterministic eval micro-batches of this rank, in dataset order (no shuffle).

    Eval step ``s`` covers samples ``s*G .. s*G + G - 1`` (``G = micro_batch *
    world_size``), rank ``r`` the ``r``-th slice of ``micro_batch`` of them; all
    ranks yield the same number of batches: ``steps``, or every whole step when
    ``steps`` is None or larger. ``rest``: the samples after the whole steps too
    (when ``steps`` does not stop before them), as one last step split over the
    ranks in order, a rank's part smaller than ``micro_batch`` (none: no batch).
    Sum the results over ranks. Fresh arrays each batch.
    """
    micro_batch = _check_int("micro_batch", micro_batch, 1)
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= world_size:
        raise UsageError(f"rank {rank} is not below world_size {world_size}")
    # with ``rest`` a set smaller than one batch is evaluated as one smaller step
    group = micro_batch * world_size if rest and ds.num_samples else check_eval(ds, micro_batch, world_size)
    available = ds.num_samples // group
    n = available if steps is None else min(_check_int("steps", steps, 1), available)
    left = ds.num_samples - available * group if rest and (steps is None or steps > available) else 0
    part = range(available * group + rank * left // world_size, available * group + (rank + 1) * left // world_size)

    def batches():
        for s in range(n):
            first = s * group + rank * micro_batch
            yield ds.read(np.arange(first, first + micro_batch), ds.new_batch(micro_batch))
        if len(part):
            yield ds.read(np.arange(part.start, part.stop), ds.new_batch(len(part)))
    return batches()
