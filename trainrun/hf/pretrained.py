"""``model.init_from``: start a built-in model from pretrained weights.

Sources: a transformers ``save_pretrained`` directory (config.json + model.safetensors, or sharded:
model.safetensors.index.json and its shards; float32, float16 or bfloat16 tensors, read as float32), a bare
``.safetensors`` file, or a trainrun run/checkpoint directory (its model.safetensors; weights only,
the optimizer starts fresh). Tensor names are transformers': with or without the family's prefix
(the base model's, e.g. GPT2Model's vs GPT2LMHeadModel's); the tied heads are the embedding (and bias)
they are tied to (the family's :class:`~trainrun.models.registry.Transformers`). Every shape is checked.
Parameters a file does not hold keep their fresh initialisation only when they are heads the source
model may lack (the family's ``optional`` prefixes); any other missing parameter is an error. Tensors of the file that are no parameter here
(buffers such as ``attn.bias`` or ``position_ids``) are ignored.

The config side (config.json's shape fields fill ``model.<family>``, or must agree with it) is
config.load._fill_from_init_from and :func:`trainrun.run.validity.config_problems`.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..checkpoint import Pinned, is_step_dir, pin, tensor_spans
from ..errors import UsageError
from ..models import registry
from ..run.rundir import COMMITTED, checkpoints_dir

FILE = "model.safetensors"      # a trainrun checkpoint's weights


INDEX = "model.safetensors.index.json"      # a sharded save_pretrained's {tensor: shard file}
_FLOATS = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def _source(path: str) -> tuple[list[str], Pinned | None]:
    """([the .safetensors file ``path`` names, or a transformers folder's model.safetensors or its index's
    shards], None), or for a trainrun run/checkpoint directory ([its model.safetensors], its checkpoint held
    open: the run may prune it as it trains)."""
    if os.path.isfile(path):
        return [path], None
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, INDEX)):
        index = os.path.join(path, INDEX)
        try:
            with open(index, encoding="utf-8") as fh:
                shards = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"model.init_from: {index}: not a safetensors index with a weight_map ({exc})") from None
        return [os.path.join(path, shard) for shard in shards], None
    if os.path.isfile(os.path.join(path, "model.safetensors")) and os.path.isfile(os.path.join(path, "config.json")):
        return [os.path.join(path, "model.safetensors")], None
    if not (os.path.isdir(checkpoints_dir(path)) or os.path.isfile(os.path.join(path, "state.json"))
            or os.path.exists(os.path.join(path, COMMITTED)) or is_step_dir(path)):
        raise UsageError(f"model.init_from: {path}: neither a .safetensors file, a transformers save_pretrained "
                         f"directory (config.json + model.safetensors or {INDEX} and its shards) nor a trainrun "
                         f"run/checkpoint directory")
    try:
        held = pin(path)
    except UsageError as exc:
        raise UsageError(f"model.init_from: {exc.message}") from None
    return [held.path(FILE)], held


def _header(file: str) -> tuple[int, dict]:
    """(where a .safetensors file's data start, {tensor: its dtype, shape and data_offsets})."""
    try:
        with open(file, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size <= os.fstat(fh.fileno()).st_size - 8:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(fh.read(size))
        tensors = {name: t for name, t in header.items() if name != "__metadata__"}
        for t in tensors.values():
            t["shape"] = tuple(t["shape"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UsageError(f"model.init_from: {file}: not a readable .safetensors file ({exc})") from None
    return 8 + size, tensors


def _read(file: str, start: int, name: str, t: dict) -> np.ndarray:
    """Tensor ``name`` (header entry ``t``) of ``file`` as float32: F32 as it is, F16 / F64 / BF16 converted."""
    begin, end = t["data_offsets"]
    raw = np.fromfile(file, np.uint8, count=end - begin, offset=start + begin)
    if t["dtype"] == "BF16":        # the upper half of a float32
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(t["shape"])
    if t["dtype"] not in _FLOATS:
        raise UsageError(f"model.init_from: {file}: tensor '{name}' is {t['dtype']}, not a floating-point type")
    return raw.view(_FLOATS[t["dtype"]]).astype(np.float32).reshape(t["shape"])


def _label(files: list[str]) -> str:
    return files[0] if len(files) == 1 else os.path.join(os.path.dirname(files[0]), INDEX)


def _headers(files: list[str]) -> dict[str, tuple[str, int, dict]]:
    """{tensor: (its file, where that file's data start, its header entry)} over ``files``."""
    out = {}
    for file in files:
        start, tensors = _header(file)
        out.update({name: (file, start, t) for name, t in tensors.items()})
    return out


def _fit(shapes: dict[str, tuple], tensors: dict[str, tuple], file: str, family) -> tuple[dict, list[str]]:
    """The file's tensors (name -> shape) that fill the model's parameters (name -> shape): ({our name:
    the file's name}, problems: a shape that differs, parameters the file holds no tensor for)."""
    hf = (registry.get(family) if isinstance(family, str) else family).transformers   # None: the model's own names
    prefix, tied, optional = (hf.prefix, hf.tied, hf.optional) if hf else ("", {}, ())
    found: dict[str, str] = {}
    for name in tensors:
        ours = name if name in shapes else tied.get(name, name)     # a head that is a parameter is not tied
        if prefix and ours not in shapes and prefix + ours in shapes:
            ours = prefix + ours
        if ours in shapes and (ours not in found or name == ours):   # the tensor itself wins over its tied twin
            found[ours] = name
    problems = [f"'{name}' is {list(tensors[name])} in {file}, the model's '{ours}' is {list(shapes[ours])}"
                for ours, name in found.items() if tuple(tensors[name]) != tuple(shapes[ours])]
    missing = [n for n in shapes if n not in found and not (optional and n.startswith(optional))]
    if missing:
        problems.append(f"{file} holds no tensor for {len(missing)} parameter(s) of the model: "
                        f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return found, problems


def check(shapes: dict[str, tuple], path: str, family) -> list[str]:
    """The problems :func:`load_into` would find, from the files' headers alone (names and shapes; no
    tensor read): what ``trainrun config validate`` and training's start-up report."""
    try:
        files, held = _source(path)
        if held is not None:
            with held:
                tensors = _shapes(held.header(FILE)[1])
        else:
            tensors = {name: t["shape"] for name, (_, _, t) in _headers(files).items()}
    except UsageError as exc:
        return [exc.message.removeprefix("model.init_from: ")]
    return _fit(shapes, tensors, _label(files), family)[1]


def _shapes(header: dict) -> dict[str, tuple]:
    return {name: tuple(t["shape"]) for name, t in header.items() if name != "__metadata__"}


def load_into(weights: dict[str, np.ndarray], path: str, family) -> dict[str, np.ndarray]:
    """``weights`` (our names and shapes, freshly initialised) with every tensor ``path`` provides."""
    files, held = _source(path)
    if held is not None:
        with held:
            found = _fitting(weights, _shapes(held.header(FILE)[1]), files[0], family)
            start, spans = tensor_spans(held, FILE, list(found.values()), [weights[n].shape for n in found])
            out = dict(weights)
            for ours, (begin, _) in zip(found, spans):
                out[ours] = np.empty(weights[ours].shape, np.float32)
                held.readinto(FILE, out[ours], start + begin)
        return out
    headers = _headers(files)
    found = _fitting(weights, {name: t["shape"] for name, (_, _, t) in headers.items()}, _label(files), family)
    out = dict(weights)
    for ours, name in found.items():
        out[ours] = np.ascontiguousarray(_read(*headers[name][:2], name, headers[name][2]))
    return out


def _fitting(weights: dict[str, np.ndarray], tensors: dict[str, tuple], file: str, family) -> dict[str, str]:
    found, problems = _fit({n: w.shape for n, w in weights.items()}, tensors, file, family)
    if problems:
        raise UsageError(f"model.init_from: {file} does not fit model.{family}", problems)
    return found
