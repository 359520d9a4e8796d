"""Finding the documents of a text corpus and splitting off an eval set, deterministically.

A document is one file, read as UTF-8 (invalid bytes become U+FFFD).
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
from fnmatch import fnmatch
from pathlib import Path

from trainrun.errors import UsageError

DEFAULT_INCLUDE = ("*.txt", "*.md", "*.rst", "*.py")
DEFAULT_EXCLUDE = ("__pycache__", "site-packages", "dist-packages", ".*")


def find_files(inputs, include=DEFAULT_INCLUDE, exclude=DEFAULT_EXCLUDE, split=None) -> list[Path]:
    """Files named by ``inputs``: files as given, directories walked (file names matching
    ``include``, skipping names matching ``exclude``), glob patterns (``**`` recursive) expanded;
    a folder of Hugging Face ``datasets``' ``save_to_disk``: its Arrow files (of the split ``split``
    of a DatasetDict, :func:`hf_dataset_files`). Sorted by path, duplicates removed."""
    found: set[str] = set()
    taken_split = False
    for item in inputs:
        if glob.has_magic(item):
            matches = [m for m in glob.glob(item, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise UsageError(f"--input {item}: the pattern matches no files")
            found.update(matches)
        elif os.path.isdir(item) and (data := hf_dataset_files(item, split)) is not None:
            found.update(data)
            taken_split = taken_split or os.path.isfile(os.path.join(item, "dataset_dict.json"))
        elif os.path.isdir(item):
            found.update(_walk(item, include, exclude))
        elif os.path.isfile(item):
            found.add(item)
        else:
            raise UsageError(f"--input {item}: no such file or directory")
    if split is not None and not taken_split:
        raise UsageError(f"--split {split}: no --input is a DatasetDict folder (datasets' save_to_disk of splits)")
    if not found:
        raise UsageError(f"--input {' '.join(inputs)}: no files matching --include {' '.join(include)}")
    return [Path(p) for p in sorted(found)]


def hf_dataset_files(folder: str, split: str | None) -> list[str] | None:
    """The Arrow files of a folder written by ``datasets``' ``save_to_disk`` (its ``state.json`` lists them);
    of a DatasetDict folder (``dataset_dict.json``), those of its split ``split`` (of its one split without
    ``split``). None for any other folder."""
    import json
    root = Path(folder)
    plain = lambda name: isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name  # noqa: E731

    def read(name):
        try:
            return json.loads((root / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--input {folder}: {name} is not readable JSON ({exc})") from None
    if (root / "dataset_dict.json").is_file():
        splits = read("dataset_dict.json")
        splits = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(splits, list) or not splits or not all(map(plain, splits)):
            raise UsageError(f"--input {folder}: dataset_dict.json names no splits (a 'splits' list of folders)")
        if split is None and len(splits) > 1:
            raise UsageError(f"--input {folder}: a DatasetDict of the splits {', '.join(splits)}; "
                             f"choose one with --split")
        if split is not None and split not in splits:
            raise UsageError(f"--split {split}: --input {folder} has the splits {', '.join(splits)}")
        files = hf_dataset_files(str(root / (split or splits[0])), None)
        if files is None:
            raise UsageError(f"--input {folder}: its split {split or splits[0]} has no state.json")
        return files
    if not (root / "state.json").is_file():
        return None
    state = read("state.json")
    try:
        names = [d["filename"] for d in state["_data_files"]]
    except (TypeError, KeyError):
        names = []
    if not names or not all(plain(n) and n.endswith(".arrow") for n in names):
        raise UsageError(f"--input {folder}: state.json lists no Arrow files of the folder ('_data_files')")
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise UsageError(f"--input {folder}: state.json lists {', '.join(missing)}, not in the folder")
    return [str(root / n) for n in names]


def _walk(root: str, include, exclude):
    skip = lambda name: any(fnmatch(name, pat) for pat in exclude)  # noqa: E731
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip(d)]
        for name in filenames:
            if not skip(name) and any(fnmatch(name, pat) for pat in include):
                yield os.path.join(dirpath, name)


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


# ------------------------------------------------------------------ records: .jsonl, .jsonl.gz, .parquet, .arrow
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".arrow")


def is_records(path: Path) -> bool:
    """A file of records (one document each) rather than one document."""
    return path.name.endswith(RECORD_SUFFIXES)


def open_lines(path: Path):
    import gzip
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _jsonl_records(path: Path, field: str, bad):
    """(line number, text) of each good record; ``bad(where, why)`` for the others (blank lines skipped),
    and once where the file cannot be read on (a truncated or corrupt .gz): the lines before count."""
    import json
    import zlib
    line = 0
    with open_lines(path) as fh:
        try:
            for line, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except ValueError as exc:
                    bad(f"{path}:{line}", f"not JSON ({exc})")
                    continue
                if not isinstance(record, dict) or field not in record:
                    bad(f"{path}:{line}", f"no field '{field}'")
                elif not isinstance(record[field], str):
                    bad(f"{path}:{line}", f"field '{field}' is {type(record[field]).__name__}, not a string")
                else:
                    yield line, record[field]
        except (EOFError, OSError, zlib.error) as exc:     # gzip's: cut short, not gzip, corrupt
            bad(f"{path}:{line + 1}", f"unreadable from here on, the file is truncated or corrupt "
                                      f"({type(exc).__name__}: {exc})")


def _pyarrow(path: Path):
    try:
        import pyarrow
    except ImportError:
        raise UsageError(f"--input {path}: reading {path.suffix} files needs pyarrow: "
                         f"pip install 'trainrun[parquet]'") from None
    return pyarrow


def parquet_file(path: Path):
    _pyarrow(path)
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors are of several types
        raise UsageError(f"--input {path}: not a readable Parquet file ({exc})") from None


def _parquet_records(path: Path, field: str, bad):
    """(row index in the file, text) of each good row; ``bad`` names row group and row of the others."""
    pf = parquet_file(path)
    chunks = ((lambda r, _, g=g: f"row group {g}, row {r}", pf.read_row_group(g, columns=[field]).column(0))
              for g in range(pf.num_row_groups))
    return _column_records(path, field, pf.schema_arrow.names, chunks, bad)


def arrow_batches(path: Path):
    """(column names, record batches) of an Arrow IPC file, in the file layout or the stream layout
    ``datasets`` writes (memory-mapped)."""
    pa = _pyarrow(path)
    try:
        source = pa.memory_map(str(path))
        layout = pa.ipc.open_file if source.read(6) == b"ARROW1" else pa.ipc.open_stream
        source.seek(0)
        reader = layout(source)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors are of several types
        raise UsageError(f"--input {path}: not a readable Arrow IPC file ({exc})") from None
    batches = (reader.get_batch(b) for b in range(reader.num_record_batches)) if layout is pa.ipc.open_file \
        else reader
    return reader.schema.names, batches


def _arrow_records(path: Path, field: str, bad):
    """(row index in the file, text) of each good row of an Arrow IPC file (:func:`arrow_batches`, this one
    column read); ``bad`` names the row."""
    names, batches = arrow_batches(path)
    chunks = ((lambda _, i: f"row {i}", batch.column(field)) for batch in batches)
    return _column_records(path, field, names, chunks, bad)


def _column_records(path: Path, field: str, names, chunks, bad):
    """(row index in the file, text) of each string of column ``field`` in ``chunks``: (where(row in the
    chunk, row in the file), column) pairs; ``bad`` for the other values, and once where the file cannot be
    read on (the rows before count)."""
    if field not in names:
        raise UsageError(f"--input {path}: no column '{field}' (its columns: {', '.join(names)}); "
                         f"choose one with --text-field")
    first = 0
    try:
        for where, column in chunks:
            values = column.to_pylist()
            for r, value in enumerate(values):
                if isinstance(value, str):
                    yield first + r, value
                else:
                    bad(f"{path}: {where(r, first + r)}", f"column '{field}' is {type(value).__name__}, not a string")
            first += len(values)
    except (OSError, ValueError) as exc:     # pyarrow's ArrowInvalid / ArrowIOError: cut short, corrupt
        bad(f"{path}: row {first}", f"unreadable from here on, the file is truncated or corrupt "
                                    f"({type(exc).__name__}: {exc})")


def records(path: Path, field: str, bad):
    if path.name.endswith(".parquet"):
        return _parquet_records(path, field, bad)
    return (_arrow_records if path.name.endswith(".arrow") else _jsonl_records)(path, field, bad)


class Corpus:
    """The documents of ``files`` in order: a text file is one document (read as :func:`read_text`), a
    record file (:data:`RECORD_SUFFIXES`) one document per record, its field ``field``.

    One streaming pass notes, per non-empty document, its file, place in the file (line or row; -1 for
    a text file), UTF-8 size and the first 8 bytes of the sha256 of its UTF-8 text, in compact arrays.
    A bad record raises :class:`UsageError` naming file and line (Parquet: row group and row), or with
    ``skip_bad`` is counted (:attr:`bad`, :attr:`first_bad`). Empty documents are counted (:attr:`empty`)."""

    def __init__(self, files: list[Path], field: str = "text", skip_bad: bool = False, progress=None):
        import array
        self.files, self.field = files, field
        self.empty, self.bad, self.first_bad = 0, 0, None
        file_idx, where, size, key = array.array("i"), array.array("q"), array.array("q"), array.array("Q")

        def bad(at, why):
            if not skip_bad:
                raise UsageError(f"{at}: {why} (--skip-bad skips such records)")
            self.bad += 1
            self.first_bad = self.first_bad or f"{at}: {why}"

        def add(fi, w, data: bytes):
            if progress:
                progress(len(data))
            if not data:
                self.empty += 1
                return
            file_idx.append(fi)
            where.append(w)
            size.append(len(data))
            key.append(int.from_bytes(hashlib.sha256(data).digest()[:8], "big"))

        for fi, path in enumerate(files):
            if is_records(path):
                for w, text in records(path, field, bad):
                    add(fi, w, text.encode("utf-8"))
            else:
                add(fi, -1, path.read_bytes())
        import numpy as np
        self.file_idx, self.where = np.frombuffer(file_idx, np.int32), np.frombuffer(where, np.int64)
        self.size, self.key = np.frombuffer(size, np.int64), np.frombuffer(key, np.uint64)

    def __len__(self) -> int:
        return len(self.key)

    @property
    def skipped(self) -> str:
        """'' or what ``skip_bad`` skipped: how many records, the first named."""
        return f"{self.bad} bad record(s) skipped (the first: {self.first_bad})" if self.bad else ""

    def split(self, fraction: float):
        """(train, eval) document indices: eval the ``ceil(fraction * documents)`` documents of smallest
        hash (ties in file order): independent of paths, order and file kind."""
        import numpy as np
        if not 0 <= fraction < 1:
            raise UsageError(f"--eval-fraction {fraction}: must be in [0, 1)")
        if not len(self):
            raise UsageError(f"--input: the {len(self.files)} file(s) found "
                             + (f"hold no good document: {self.skipped}" if self.bad else "are all empty"))
        n_eval = math.ceil(fraction * len(self))
        if len(self) and n_eval >= len(self):
            raise UsageError(f"--eval-fraction {fraction}: {len(self)} document(s) leave none to train on (each "
                             f"text file is one document, each record of a .jsonl / .parquet file one): pass "
                             f"more files, --eval-fraction 0 (no eval set), or split the text into files (e.g. "
                             f"`mkdir DIR && split -l 1000 --additional-suffix=.txt FILE DIR/part-`, then "
                             f"--input DIR)")
        chosen = np.zeros(len(self), bool)
        chosen[np.argsort(self.key, kind="stable")[:n_eval]] = True
        return np.flatnonzero(~chosen), np.flatnonzero(chosen)

    def refs(self, idx) -> list[list[int]]:
        """[file index, place] of documents ``idx`` (what :func:`read_documents` takes)."""
        return [[int(self.file_idx[i]), int(self.where[i])] for i in idx]


def read_documents(files: list[Path], refs, field: str):
    """The texts of the documents ``refs`` ([file index, place], in file order), each record file
    streamed once (its bad records were named or skipped by :class:`Corpus` already)."""
    i = 0
    while i < len(refs):
        fi = refs[i][0]
        path = files[fi]
        if not is_records(path):
            yield read_text(path)
            i += 1
            continue
        wanted = []
        while i < len(refs) and refs[i][0] == fi:
            wanted.append(refs[i][1])
            i += 1
        want = set(wanted)
        for w, text in records(path, field, lambda at, why: None):
            if w in want:
                yield text
                if w == wanted[-1]:
                    break
