"""A config from YAML and ``--set`` overrides: read, coerced (:mod:`trainrun.config.coerce`), filled from
``model.init_from``'s config.json, handed to the checks across keys (``checks``), its paths made absolute."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Optional

import yaml

from ..errors import UsageError
from .coerce import _build, _Problems
from .model import FAMILIES, ModelConfig, config_json_values
from .schema import Config, _set


def path_fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        p = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(v):
            yield from path_fields(v, p)
        elif "path" in f.metadata and isinstance(v, dict):     # named paths (data.eval: {NAME: DIR})
            for name, one in v.items():
                yield f"{p}.{name}", one, f.metadata["path"]
        elif "path" in f.metadata:
            yield p, v, f.metadata["path"]


def resolve_path(value: str, base_dir: str) -> str:
    value = os.path.expanduser(value)
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(base_dir, value))


def init_from_config_json(m: ModelConfig, base_dir: str) -> tuple[str, dict | str] | None:
    """(model.init_from's config.json, its object or why it is none) when there is one to read."""
    if not m.init_from or m.builtin not in FAMILIES:
        return None
    file = os.path.join(resolve_path(m.init_from, base_dir), "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as fh:
            source = json.load(fh)
    except (OSError, ValueError) as exc:
        return file, str(exc)
    return file, source if isinstance(source, dict) else f"a {type(source).__name__}"


def _fill_from_init_from(cfg: Config, data: dict, base_dir: str) -> None:
    """model.<builtin> from model.init_from's config.json when the config gives no such section (that a
    given one agrees with it is :mod:`trainrun.run.validity`'s check)."""
    found = init_from_config_json(cfg.model, base_dir)
    m = cfg.model
    if found is None or not isinstance(found[1], dict) or \
            (isinstance(data.get("model"), dict) and data["model"].get(m.builtin) is not None):
        return
    section = m.family_section()
    for key, value in config_json_values(section, found[1]).items():
        setattr(section, key, value)


# --------------------------------------------------------------------------- overrides

def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UsageError(f"--set {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UsageError(f"--set {text!r}: bad key path {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides; a relative path given on the command line is
    relative to the current directory (paths in the file are relative to the file)."""
    path_keys = {dotted for dotted, _, _ in path_fields(Config())} | {"run.output_dir"}
    for text in overrides:
        keys, value = parse_override(text)
        named = ".".join(keys[:-1]) in path_keys      # data.eval.NAME=DIR
        if (".".join(keys) in path_keys or named) and isinstance(value, str) and value:
            value = os.path.abspath(os.path.expanduser(value))
        if ".".join(keys) == "logging.mlflow.tracking_uri" and isinstance(value, str) and _is_local_path(value):
            value = os.path.abspath(os.path.expanduser(value))
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
    return data


# --------------------------------------------------------------------------- entry points

def read_yaml(path: str, text: str | None = None) -> dict:
    """The mapping of a YAML config file (``text``: its content, already read)."""
    try:
        if text is not None:
            data = yaml.safe_load(text)
        else:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise UsageError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


Checks = Callable[[Config, str, bool], list]
"""``checks(cfg, base_dir, need_data)``: the problems (``"key: message"``) across keys and of the files
keys name, on a config built from what parsed (:func:`trainrun.run.validity.config_problems`)."""


def from_dict(data: dict, *, base_dir: str = ".", source: str = "config", need_data: bool = False,
              checks: Optional[Checks] = None) -> Config:
    """Build a Config, each value coerced and range-checked, and run ``checks`` on it; raise UsageError
    listing every problem. Without ``checks`` only the schema's own (one key at a time) are made:
    :func:`trainrun.run.validity.load_config` passes the checks across keys."""
    problems = _Problems()
    cfg = _build(Config, data, "", problems)
    _fill_from_init_from(cfg, data, base_dir)
    if checks is not None:
        # Checks across keys run too (on the values that parsed), skipping those of a key already reported
        # and those that name one: a comparison with a rejected value only repeats its problem.
        bad = {p.split(":", 1)[0] for p in problems}
        named = re.compile("|".join(rf"(?<![\w.]){re.escape(k)}(?!\w)" for k in bad if "." in k) or "(?!)")
        problems += [p for p in checks(cfg, base_dir, need_data)
                     if p.split(":", 1)[0] not in bad and not named.search(p)]
    if problems:
        raise UsageError(f"{source}: {len(problems)} problem(s) in the configuration", problems)
    return cfg


def load_config(path: Optional[str], overrides: list[str] = (), *, need_data: bool = False,
                checks: Optional[Checks] = None, text: Optional[str] = None) -> Config:
    """Load a YAML config (or only defaults when path is None), apply ``--set`` overrides, validate
    (the schema, and ``checks``: see :func:`from_dict`). ``text``: the file's content, already read
    (``path`` then names it).

    Relative paths in the config are resolved against the config file's directory
    and stored absolute, so the resolved config works from any directory.
    """
    data = read_yaml(path, text) if path else {}
    data = apply_overrides(data, list(overrides))
    base_dir = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    cfg = from_dict(data, base_dir=base_dir, source=path or "config", need_data=need_data, checks=checks)
    absolutize(cfg, base_dir)
    return cfg


def absolutize(cfg: Config, base_dir: str) -> None:
    """Make every path of the config absolute (relative to base_dir)."""
    for dotted, value, _kind in list(path_fields(cfg)):
        if value is not None:
            _set(cfg, dotted, resolve_path(value, base_dir))
    cfg.run.output_dir = resolve_path(cfg.run.output_dir, base_dir)
    if cfg.logging.mlflow.tracking_uri and _is_local_path(cfg.logging.mlflow.tracking_uri):
        cfg.logging.mlflow.tracking_uri = resolve_path(cfg.logging.mlflow.tracking_uri, base_dir)


def _is_local_path(uri: str) -> bool:
    """A tracking URI that names a folder by a plain path (no scheme such as file:, http:, sqlite:)."""
    return ":" not in uri and uri != "databricks"
