"""The run's tokenizer: recorded in the run directory at train start, read by generate and export.

A token dataset's ``manifest.json`` names its tokenizer (``tokenizer_file``, relative to the split
directory, or the raw-bytes tokenizer) and its end-of-document id. At train start rank 0 copies the
tokenizer.json of ``data.train`` to ``<run>/tokenizer.json`` and writes ``<run>/tokenizer_info.json``
(``{"tokenizer": "tokenizer.json" | "bytes", "tokenizer_id": ID, "eos_id": N, "data": DIR}``), so that
the run keeps working after the dataset moves. Datasets without a tokenizer (tensor samples) record nothing.

A tokenizer's identity (:func:`mismatch`): ``bytes``, or ``sha256:<hex>`` of its tokenizer.json (token
shards record it as ``tokenizer_id``; other datasets, runs and transformers folders: of the file). Two
different files that give every token the same id (a tokenizer.json saved again, or given a template)
are the same tokenizer to the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from ..errors import UsageError

RUN_FILE = "tokenizer.json"
INFO_FILE = "tokenizer_info.json"
BYTES = "bytes"            # data_tools' tokenizer_id of raw UTF-8 bytes (ids 0-255, end of document 256)


def _dataset_manifest(data_dir: str) -> dict | None:
    try:
        with open(os.path.join(data_dir, "manifest.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class Text:
    """Encode/decode for a run: a ``tokenizers`` tokenizer.json or raw bytes; ``eos_id`` may be None."""

    def __init__(self, tokenizer, eos_id: int | None, path: str | None):
        self.tokenizer, self.eos_id, self.path = tokenizer, eos_id, path

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _load_json_tokenizer(path: str):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise UsageError(f"{path}: not a readable tokenizer.json ({exc})") from None


def _dataset_tokenizer(data_dir: str) -> tuple[str | None, dict | None]:
    """(tokenizer.json path or None, info as in INFO_FILE) of a dataset; info None without a tokenizer."""
    manifest = _dataset_manifest(data_dir) or {}
    file = manifest.get("tokenizer_file")
    info = {"eos_id": manifest.get("eos_id"), "data": os.path.abspath(data_dir)}
    if file and os.path.isfile(os.path.join(data_dir, file)):
        path = os.path.normpath(os.path.join(data_dir, file))
        return path, {**info, "tokenizer": RUN_FILE, "tokenizer_id": manifest.get("tokenizer_id") or _file_id(path)}
    if manifest.get("tokenizer_id") == BYTES:
        return None, {**info, "tokenizer": BYTES, "tokenizer_id": BYTES}
    return None, None


def _file_id(path: str) -> str:
    with open(path, "rb") as fh:
        return "sha256:" + hashlib.sha256(fh.read()).hexdigest()


def _model_tokenizer(source: str) -> tuple[str | None, str | None]:
    """(identity, tokenizer.json or None) of a model: a trainrun run or checkpoint directory (what the run
    recorded), a transformers folder (its tokenizer.json); (None, None) where none is known."""
    source = os.path.abspath(source)
    if os.path.isfile(os.path.join(source, "state.json")):      # a checkpoint: <run>/checkpoints/<step>
        source = os.path.dirname(os.path.dirname(source))
    info = run_info(source)
    path = os.path.join(source, RUN_FILE)
    if info is not None:
        if info.get("tokenizer") == BYTES:
            return BYTES, None
        if info.get("tokenizer") == RUN_FILE and os.path.isfile(path):
            return info.get("tokenizer_id") or _file_id(path), path
        return None, None
    if os.path.isdir(source) and os.path.isfile(path):
        return _file_id(path), path
    return None, None


def _vocab(path: str) -> dict | None:
    try:
        return _load_json_tokenizer(path).get_vocab(with_added_tokens=True)
    except UsageError:
        return None


def mismatch(model: str, data_dir: str) -> str | None:
    """Why the token ids of ``data_dir`` are not those the ``model`` (a run, checkpoint or transformers
    folder) was trained on, or None: the same tokenizer, or either side's unknown."""
    model_id, model_file = _model_tokenizer(model)
    data_file, info = _dataset_tokenizer(data_dir)
    if model_id is None or info is None or model_id == info["tokenizer_id"]:
        return None
    if model_file and data_file:
        a, b = _vocab(model_file), _vocab(data_file)
        if a is None or b is None or a == b:
            return None
        differs = f"{len(a):,} and {len(b):,} tokens" if len(a) != len(b) else \
            f"{sum(a.get(t) != i for t, i in b.items()):,} of {len(b):,} tokens with other ids"
        return (f"the data's tokenizer ({data_file}) is not the model's ({model_file}): {differs}")
    name = lambda file: f"the tokenizer {file}" if file else "raw bytes"     # noqa: E731
    return f"the data's tokens are {name(data_file)}, the model's {name(model_file)}"


def record(data_dir: str, run_dir: str) -> bool:
    """Copy ``data_dir``'s tokenizer into ``run_dir`` (see the module doc); False when it has none."""
    path, info = _dataset_tokenizer(data_dir)
    if info is None:
        return False
    if path:
        tmp = os.path.join(run_dir, RUN_FILE + ".tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, os.path.join(run_dir, RUN_FILE))
    tmp = os.path.join(run_dir, INFO_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(info, fh, indent=1)
    os.replace(tmp, os.path.join(run_dir, INFO_FILE))
    return True


def for_data(data_dir: str) -> Text:
    """A dataset's own tokenizer (its manifest's tokenizer_file or raw bytes)."""
    path, info = _dataset_tokenizer(data_dir)
    if info is None:
        raise UsageError(f"{data_dir}: the dataset names no tokenizer (manifest.json tokenizer_file)")
    return Text(_load_json_tokenizer(path) if path else None, info["eos_id"], path)


def run_info(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, INFO_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def for_run(run_dir: str, given: str | None = None, eos_token: str = "<|endoftext|>") -> Text:
    """The run's tokenizer (``given``: a tokenizer.json that replaces it)."""
    info = run_info(run_dir) or {}
    if given:
        tok = _load_json_tokenizer(given)
        eos = tok.token_to_id(eos_token)
        return Text(tok, eos if eos is not None else info.get("eos_id"), given)
    if info.get("tokenizer") == BYTES:
        return Text(None, info.get("eos_id"), None)
    if info.get("tokenizer") == RUN_FILE:
        path = os.path.join(run_dir, RUN_FILE)
        return Text(_load_json_tokenizer(path), info.get("eos_id"), path)
    raise UsageError(f"{run_dir}: the run recorded no tokenizer ({INFO_FILE}, written at train start from "
                     f"data.train's manifest); name one with --tokenizer FILE")

