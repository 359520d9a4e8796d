"""``model.init_from``: start a built-in model from pretrained weights.

Sources: a transformers ``save_pretrained`` directory (config.json + model.safetensors), a bare
``.safetensors`` file, or a trainrun run/checkpoint directory (its model.safetensors; weights only,
the optimizer starts fresh). Tensor names are transformers': with or without the family's prefix
(the base model's, e.g. GPT2Model's vs GPT2LMHeadModel's); the tied heads are the embedding (and bias)
they are tied to (the family's :class:`~trainrun.models.registry.Transformers`). Every shape is checked.
Parameters a file does not hold keep their fresh initialisation only when they are heads the source
model may lack (the family's ``optional`` prefixes); any other missing parameter is an error. Tensors of the file that are no parameter here
(buffers such as ``attn.bias`` or ``position_ids``) are ignored.

The config side (config.json's shape fields fill ``model.<family>``, or must agree with it) is
config.load._fill_from_init_from and :func:`trainrun.validity.config_problems`.
"""

from __future__ import annotations

import os

import numpy as np

from safetensors import SafetensorError
from safetensors.numpy import load_file

from .checkpoint import Pinned, is_step_dir, pin, tensor_spans
from .errors import UsageError
from .models import registry
from .rundir import COMMITTED, checkpoints_dir

FILE = "model.safetensors"      # a trainrun checkpoint's weights


def _source(path: str) -> tuple[str, Pinned | None]:
    """(the .safetensors file ``path`` names, None), or for a trainrun run/checkpoint directory (its
    model.safetensors, its checkpoint held open: the run may prune it as it trains)."""
    if os.path.isfile(path):
        return path, None
    if os.path.isfile(os.path.join(path, "model.safetensors")) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.join(path, "model.safetensors"), None
    if not (os.path.isdir(checkpoints_dir(path)) or os.path.isfile(os.path.join(path, "state.json"))
            or os.path.exists(os.path.join(path, COMMITTED)) or is_step_dir(path)):
        raise UsageError(f"model.init_from: {path}: neither a .safetensors file, a transformers save_pretrained "
                         f"directory (config.json + model.safetensors) nor a trainrun run/checkpoint "
                         f"directory")
    try:
        held = pin(path)
    except UsageError as exc:
        raise UsageError(f"model.init_from: {exc.message}") from None
    return held.path(FILE), held


def _fit(shapes: dict[str, tuple], tensors: dict[str, tuple], file: str, family) -> tuple[dict, list[str]]:
    """The file's tensors (name -> shape) that fill the model's parameters (name -> shape): ({our name:
    the file's name}, problems: a shape that differs, parameters the file holds no tensor for)."""
    hf = (registry.get(family) if isinstance(family, str) else family).transformers   # None: the model's own names
    prefix, tied, optional = (hf.prefix, hf.tied, hf.optional) if hf else ("", {}, ())
    found: dict[str, str] = {}
    for name in tensors:
        ours = tied.get(name, name)
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
    """The problems :func:`load_into` would find, from the file's header alone (names and shapes; no
    tensor read): what ``trainrun config validate`` and training's start-up report."""
    from safetensors import SafetensorError, safe_open
    file = path
    try:
        file, held = _source(path)
        if held is not None:
            with held:
                tensors = _shapes(held.header(FILE)[1])
        else:
            with safe_open(file, framework="numpy") as fh:
                tensors = {name: fh.get_slice(name).get_shape() for name in fh.keys()}
    except UsageError as exc:
        return [exc.message.removeprefix("model.init_from: ")]
    except (OSError, SafetensorError, ValueError) as exc:
        return [f"{file}: not a readable .safetensors file ({exc})"]
    return _fit(shapes, tensors, file, family)[1]


def _shapes(header: dict) -> dict[str, tuple]:
    return {name: tuple(t["shape"]) for name, t in header.items() if name != "__metadata__"}


def load_into(weights: dict[str, np.ndarray], path: str, family) -> dict[str, np.ndarray]:
    """``weights`` (our names and shapes, freshly initialised) with every tensor ``path`` provides."""
    file, held = _source(path)
    if held is not None:
        with held:
            found = _fitting(weights, _shapes(held.header(FILE)[1]), file, family)
            start, spans = tensor_spans(held, FILE, list(found.values()), [weights[n].shape for n in found])
            out = dict(weights)
            for ours, (begin, _) in zip(found, spans):
                out[ours] = np.empty(weights[ours].shape, np.float32)
                held.readinto(FILE, out[ours], start + begin)
        return out
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError, ValueError) as exc:
        raise UsageError(f"model.init_from: {file}: not a readable .safetensors file ({exc})") from None
    found = _fitting(weights, {n: v.shape for n, v in tensors.items()}, file, family)
    out = dict(weights)
    for ours, name in found.items():
        out[ours] = np.ascontiguousarray(tensors[name], dtype=np.float32)
    return out


def _fitting(weights: dict[str, np.ndarray], tensors: dict[str, tuple], file: str, family) -> dict[str, str]:
    found, problems = _fit({n: w.shape for n, w in weights.items()}, tensors, file, family)
    if problems:
        raise UsageError(f"model.init_from: {file} does not fit model.{family}", problems)
    return found
