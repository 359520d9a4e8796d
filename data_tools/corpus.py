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
