"""YAML values into the schema's types, each checked on its own (type, range, choices), every problem
recorded with its key path."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from .model import _ADDED, ModelConfig


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Problems(list):
    def add(self, path: str, msg: str) -> None:
        self.append(f"{path}: {msg}")


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, path: str, problems: _Problems):
    """Convert a YAML value to the field type; record a problem and return None if impossible."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None:
            return None
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) > 1:     # the arm of the value's own kind: a mapping, a string, a number
            kinds = {dict: dict, str: str, int: (int, float), float: (int, float)}
            arms = [a for a in arms if isinstance(value, kinds[typing.get_origin(a) or a])
                    and not isinstance(value, bool)]
            if not arms:
                problems.add(path, f"expected a {_type_name(tp)}, got {value!r}")
                return None
        return _coerce(value, arms[0], path, problems)
    if origin is list:
        if not isinstance(value, list):
            problems.add(path, f"expected a {_type_name(tp)}, got {value!r}")
            return None
        (inner,) = typing.get_args(tp)
        out = [_coerce(v, inner, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return out
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            problems.add(path, f"expected a {_type_name(tp)}, got {value!r}")
            return None
        key_t, val_t = typing.get_args(tp)
        return {_coerce(k, key_t, path, problems): _coerce(v, val_t, f"{path}.{k}", problems)
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            problems.add(path, f"expected a mapping (section), got {value!r}")
            return tp()
        return _build(tp, value, path, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.add(path, f"expected true or false, got {value!r}")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        problems.add(path, f"expected an integer, got {value!r}")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "6e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        problems.add(path, f"expected a number, got {value!r}")
        return None
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.add(path, f"expected a string, got {value!r}")
        return None
    raise TypeError(f"unsupported config type {tp}")  # a schema bug, not user input


def _check_constraints(f: dataclasses.Field, value, path: str, problems: _Problems) -> None:
    m = f.metadata
    if value is None:
        return
    if "choices" in m and value not in m["choices"]:
        shown = ", ".join("null" if c is None else str(c) for c in m["choices"])
        problems.add(path, f"{value!r} is not one of: {shown}")
    if "min" in m and value < m["min"]:
        problems.add(path, f"must be >= {m['min']}, got {value}")
    if "max" in m and value > m["max"]:
        problems.add(path, f"must be <= {m['max']}, got {value}")
    if "gt" in m and not value > m["gt"]:
        problems.add(path, f"must be > {m['gt']}, got {value}")


def _build(cls, data: dict, prefix: str, problems: _Problems):
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    added = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if cls is ModelConfig and key in _ADDED:
            added[key] = _coerce(value, _ADDED[key], path, problems)
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            valid = ", ".join(fields)
            problems.add(path, f"unknown key{hint}; valid keys here: {valid}")
            continue
        before = len(problems)
        v = _coerce(value, hints[key], path, problems)
        if dataclasses.is_dataclass(v):   # a section: keep what parsed, its problems are recorded
            kwargs[key] = v
        elif len(problems) == before:
            _check_constraints(fields[key], v, path, problems)
            kwargs[key] = v
    out = cls(**kwargs)
    for key, section in added.items():
        setattr(out, key, section)
    return out
