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


def find_files(inputs, include=DEFAULT_INCLUDE, exclude=DEFAULT_EXCLUDE) -> list[Path]:
    """Files named by ``inputs``: files as given, directories walked (file names matching
    ``include``, skipping names matching ``exclude``), glob patterns (``**`` recursive) expanded.
    Sorted by path, duplicates removed."""
    found: set[str] = set()
    for item in inputs:
        if glob.has_magic(item):
            matches = [m for m in glob.glob(item, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise UsageError(f"--input {item}: the pattern matches no files")
            found.update(matches)
        elif os.path.isdir(item):
            found.update(_walk(item, include, exclude))
        elif os.path.isfile(item):
            found.add(item)
        else:
            raise UsageError(f"--input {item}: no such file or directory")
    if not found:
        raise UsageError(f"--input {' '.join(inputs)}: no files matching --include {' '.join(include)}")
    return [Path(p) for p in sorted(found)]


def _walk(root: str, include, exclude):
    skip = lambda name: any(fnmatch(name, pat) for pat in exclude)  # noqa: E731
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip(d)]
        for name in filenames:
            if not skip(name) and any(fnmatch(name, pat) for pat in include):
                yield os.path.join(dirpath, name)


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def split_eval(files: list[Path], fraction: float) -> tuple[list[Path], list[Path], int]:
    """(train files, eval files, number of empty files skipped).

    Eval takes ``ceil(fraction * documents)`` documents: those with the smallest
    sha256 of their content, so the split depends on neither paths nor order.
    """
    if not 0 <= fraction < 1:
        raise UsageError(f"--eval-fraction {fraction}: must be in [0, 1)")
    keys, empty = {}, 0
    for path in files:
        data = path.read_bytes()
        if data:
            keys[path] = (hashlib.sha256(data).digest(), str(path))
        else:
            empty += 1
    docs = [p for p in files if p in keys]
    n_eval = math.ceil(fraction * len(docs))
    if docs and n_eval >= len(docs):
        raise UsageError(f"--eval-fraction {fraction}: {len(docs)} document(s) leave none to train on")
    chosen = set(sorted(docs, key=keys.__getitem__)[:n_eval])
    return [p for p in docs if p not in chosen], [p for p in docs if p in chosen], empty


# ------------------------------------------------------------------ records: .jsonl, .jsonl.gz, .parquet
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def is_records(path: Path) -> bool:
    """A file of records (one document each) rather than one document."""
    return path.name.endswith(RECORD_SUFFIXES)


def _open_lines(path: Path):
    import gzip
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _jsonl_records(path: Path, field: str, bad):
    """(line number, text) of each good record; ``bad(where, why)`` for the others (blank lines skipped),
    and once where the file cannot be read on (a truncated or corrupt .gz): the lines before count."""
    import json
    import zlib
    line = 0
    with _open_lines(path) as fh:
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


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"--input {path}: reading .parquet needs pyarrow: pip install 'trainrun[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors are of several types
        raise UsageError(f"--input {path}: not a readable Parquet file ({exc})") from None


def _parquet_records(path: Path, field: str, bad):
    """(row index in the file, text) of each good row; ``bad`` names row group and row of the others."""
    pf = _parquet_file(path)
    if field not in pf.schema_arrow.names:
        raise UsageError(f"--input {path}: no column '{field}' (its columns: {', '.join(pf.schema_arrow.names)}); "
                         f"choose one with --text-field")
    first = 0
    for g in range(pf.num_row_groups):
        values = pf.read_row_group(g, columns=[field]).column(0).to_pylist()
        for r, value in enumerate(values):
            if isinstance(value, str):
                yield first + r, value
            else:
                bad(f"{path}: row group {g}, row {r}", f"column '{field}' is {type(value).__name__}, not a string")
        first += len(values)


def records(path: Path, field: str, bad):
    return (_parquet_records if path.name.endswith(".parquet") else _jsonl_records)(path, field, bad)


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

    def split(self, fraction: float):
        """(train, eval) document indices: eval the ``ceil(fraction * documents)`` documents of smallest
        hash (ties in file order), as :func:`split_eval`: independent of paths, order and file kind."""
        import numpy as np
        if not 0 <= fraction < 1:
            raise UsageError(f"--eval-fraction {fraction}: must be in [0, 1)")
        n_eval = math.ceil(fraction * len(self))
        if len(self) and n_eval >= len(self):
            raise UsageError(f"--eval-fraction {fraction}: {len(self)} document(s) leave none to train on")
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
