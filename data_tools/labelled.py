"""Labelled text (CSV, JSON Lines, Parquet, Arrow, datasets folders) as BERT fine-tuning samples.

Rows: each row of a ``.csv`` (a header row names the columns), ``.jsonl``/``.jsonl.gz`` (one JSON object
a line), ``.parquet`` or ``.arrow`` file (a ``datasets`` save_to_disk folder: its Arrow files) gives one
sample from its text field (and text-pair field) and its label field.

Labels (sequence classification): all integers (JSON numbers, or strings of digits in a CSV) are ids,
``num_labels`` = the largest + 1; numbers of which some are not whole make a regression (``num_labels``
1; or ``regression=True``); anything else are names, numbered in sorted order (transformers' run_glue
does the same) unless ``label_names`` gives the order. Token classification: the label field holds one
label per word of the text (a string split at whitespace, or a list), the text a string split at
whitespace or a list of words; the label goes to the word's first sub-token, the others and the special
tokens get -100 (ignored), as transformers' examples do.

Encoding: the tokenizer's own pipeline with BERT's post-processor (``[CLS] A [SEP] (B [SEP])``, type ids
0 then 1; a causal LM's tokenizer, without [CLS] and [SEP], keeps its own special tokens), truncated to ``seq_len`` longest-first (the tokenizers library's, the one transformers' fast
tokenizers call), padded with id 0. Sample tensors: ``input_ids``, ``segment_ids``, ``input_mask`` (int64
[seq_len], the names trainrun/models/bert.py takes) and ``labels`` (int64 [], float32 [] for a regression,
int64 [seq_len] for token classification).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np

from trainrun.errors import UsageError

from .corpus import arrow_batches, open_lines, parquet_file

IGNORE = -100
SUFFIXES = (".csv", ".jsonl", ".jsonl.gz", ".parquet", ".arrow")
TASKS = ("sequence_classification", "token_classification")
_INT = re.compile(r"[+-]?\d+\Z")
_BATCH_ROWS = 4096


def read_rows(path: Path, fields: list[str]):
    """(where, [value of each field]) of every row of ``path``; a missing field stops with its file and
    line (CSV, JSON Lines) or row (Parquet, Arrow)."""
    name = path.name
    if name.endswith(".csv"):
        return _csv_rows(path, fields)
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _jsonl_rows(path, fields)
    if name.endswith((".parquet", ".arrow")):
        return _table_rows(path, fields)
    raise UsageError(f"--input {path}: not a file of labelled rows ({', '.join(SUFFIXES)}, or a datasets folder)")


def _csv_rows(path: Path, fields):
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader, None)
            if header is None:
                raise UsageError(f"{path}: empty; a CSV file needs a header row naming its columns")
            missing = [f for f in fields if f not in header]
            if missing:
                raise UsageError(f"{path}:1: no column {', '.join(map(repr, missing))} "
                                 f"(its columns: {', '.join(header)})")
            cols = [header.index(f) for f in fields]
            for row in reader:
                if not row:
                    continue
                where = f"{path}:{reader.line_num}"
                if len(row) != len(header):
                    raise UsageError(f"{where}: {len(row)} values, the header names {len(header)} columns")
                yield where, [row[c] for c in cols]
        except csv.Error as exc:
            raise UsageError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"{path}: not UTF-8 text ({exc})") from None


def _jsonl_rows(path: Path, fields):
    with open_lines(path) as fh:
        for line, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            where = f"{path}:{line}"
            try:
                record = json.loads(raw)
            except ValueError as exc:
                raise UsageError(f"{where}: not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise UsageError(f"{where}: not a JSON object")
            missing = [f for f in fields if f not in record]
            if missing:
                raise UsageError(f"{where}: no field {', '.join(map(repr, missing))}")
            yield where, [record[f] for f in fields]


def _table_rows(path: Path, fields):
    if path.name.endswith(".parquet"):
        pf = parquet_file(path)
        names = pf.schema_arrow.names
        batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=[f for f in fields if f in names])
    else:
        names, batches = arrow_batches(path)
    missing = [f for f in fields if f not in names]
    if missing:
        raise UsageError(f"--input {path}: no column {', '.join(map(repr, missing))} (its columns: "
                         f"{', '.join(names)})")
    first = 0
    for batch in batches:
        columns = [batch.column(f).to_pylist() for f in fields]
        for r, values in enumerate(zip(*columns)):
            yield f"{path}: row {first + r}", list(values)
        first += batch.num_rows


def class_label_names(files: list[Path], field: str) -> list[str] | None:
    """The names of a ``datasets`` ClassLabel column ``field`` (a Sequence of one for token labels), from
    the dataset_info.json beside the Arrow files; None where there is none."""
    for folder in {p.parent for p in files if p.name.endswith(".arrow")}:
        try:
            info = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        feature = (info.get("features") or {}).get(field) if isinstance(info, dict) else None
        while isinstance(feature, dict) and feature.get("_type") in ("Sequence", "List"):
            feature = feature.get("feature")
        if isinstance(feature, list) and len(feature) == 1:
            feature = feature[0]
        if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and feature.get("names"):
            return [str(n) for n in feature["names"]]
    return None


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise UsageError(f"{where}: field '{field}' is {type(value).__name__}, not a string")
    return value


def _words(value, where: str, field: str) -> list:
    if isinstance(value, str):
        return value.split()
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                                for v in value):
        return list(value)
    raise UsageError(f"{where}: field '{field}' is {type(value).__name__}, not a string of words or a list")


class Labels:
    """The label map: ``kind`` "ids", "names" or "float"; ``names`` in id order (None for bare ids).

    ``names`` given (--label-names, or a datasets ClassLabel): a label is one of them, or an id below
    their number."""

    def __init__(self, values: list[tuple[str, object]], field: str, regression: bool, names: list[str] | None):
        self.field, self.names = field, None
        for w, v in values:
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise UsageError(f"{w}: label field '{field}' is {type(v).__name__}; a label is a name, an id "
                                 f"or a number")
        if regression:
            self.kind = "float"
            for w, v in values:
                self.to_float(v, w)
            return
        if names is not None:
            self.kind, self.names = "names", [str(n) for n in names]
            if len(set(self.names)) != len(self.names):
                raise UsageError(f"--label-names {','.join(self.names)}: a name repeats")
        else:
            as_int = [_as_int(v) for _, v in values]
            if values and all(i is not None for i in as_int):
                self.kind, self.num = "ids", max(as_int) + 1
            elif values and all(_as_float(v) is not None for _, v in values):
                self.kind = "float"
                return
            else:
                self.kind, self.names = "names", sorted({str(v) for _, v in values})
        for w, v in values:          # every label checked before anything is written
            self.to_id(v, w)

    @property
    def num_labels(self) -> int:
        return 1 if self.kind == "float" else self.num if self.kind == "ids" else len(self.names)

    def to_float(self, v, where: str) -> float:
        f = _as_float(v)
        if f is None:
            raise UsageError(f"{where}: label {v!r} of field '{self.field}' is not a number (a regression)")
        return f

    def to_id(self, v, where: str) -> int:
        if self.kind == "names":
            if not hasattr(self, "_index"):
                self._index = {n: i for i, n in enumerate(self.names)}
            i = self._index.get(str(v))
            if i is None and not isinstance(v, float):
                i = _as_int(v)
            if i is None or not 0 <= i < len(self.names):
                raise UsageError(f"{where}: label {v!r} of field '{self.field}' is not one of "
                                 f"{', '.join(self.names)} (nor an id below {len(self.names)})")
            return i
        i = _as_int(v)
        if i < 0:
            raise UsageError(f"{where}: label {v!r} of field '{self.field}' is a negative id")
        return i

    def manifest(self) -> dict:
        names = self.names if self.names is not None else [f"LABEL_{i}" for i in range(self.num_labels)]
        return {"num_labels": self.num_labels,
                "problem_type": "regression" if self.kind == "float" else "single_label_classification",
                "id2label": {str(i): n for i, n in enumerate(names)},
                "label2id": {n: i for i, n in enumerate(names)}}


def _as_int(v):
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and _INT.match(v.strip()):
        return int(v.strip())
    return None


def _as_float(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return None
        return f if np.isfinite(f) else None
    return None


def encode(rows, tokenizer, labels: Labels, task: str, seq_len: int, pair: bool):
    """Yield the samples (module doc) of ``rows``: (where, text, pair text or None, label value)."""
    rows = list(rows)
    for start in range(0, len(rows), _BATCH_ROWS):
        part = rows[start:start + _BATCH_ROWS]
        if task == "token_classification":
            encs = tokenizer.encode_batch([r[1] for r in part], is_pretokenized=True)
        elif pair:
            encs = tokenizer.encode_batch([(r[1], r[2]) for r in part])
        else:
            encs = tokenizer.encode_batch([r[1] for r in part])
        for (where, _, _, label), enc in zip(part, encs):
            n = len(enc.ids)
            sample = {}
            for name, values in (("input_ids", enc.ids), ("segment_ids", enc.type_ids),
                                 ("input_mask", enc.attention_mask)):
                arr = np.zeros(seq_len, np.int64)
                arr[:n] = values
                sample[name] = arr
            if task == "token_classification":
                ids = np.full(seq_len, IGNORE, np.int64)
                previous = None
                for t, w in enumerate(enc.word_ids):
                    if w is not None and w != previous:
                        ids[t] = labels.to_id(label[w], where)
                    previous = w
                sample["labels"] = ids
            elif labels.kind == "float":
                sample["labels"] = np.array(labels.to_float(label, where), np.float32)
            else:
                sample["labels"] = np.array(labels.to_id(label, where), np.int64)
            yield sample


def prepare_rows(raw, task: str, pair: bool, fields: list[str]):
    """(where, text, pair, label) of each raw row, the values checked; token classification: (where, words,
    None, labels) with as many labels as words."""
    out = []
    for where, values in raw:
        if task == "token_classification":
            words = _words(values[0], where, fields[0])
            tags = _words(values[-1], where, fields[-1])
            if len(tags) != len(words):
                raise UsageError(f"{where}: {len(words)} words in '{fields[0]}' but {len(tags)} labels in "
                                 f"'{fields[-1]}' (one label per word)")
            words = [str(w) for w in words]
            out.append((where, words, None, tags))
        else:
            out.append((where, _text(values[0], where, fields[0]),
                        _text(values[1], where, fields[1]) if pair else None, values[-1]))
    return out


def label_values(rows, task: str):
    """(where, label) of every label, each word's for token classification."""
    if task == "token_classification":
        return [(w, tag) for w, _, _, tags in rows for tag in tags]
    return [(w, label) for w, _, _, label in rows]
