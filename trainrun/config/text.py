"""The config as text: plain or commented YAML (``config show``, the run's config.yaml), what differs from the
defaults, and docs/configuration.md (``make docs``), all from the schema's field docstrings."""

from __future__ import annotations

import ast
import dataclasses
import typing
import inspect
import json
from typing import Any

import yaml

from .model import _ADDED, ModelConfig
from .schema import Config


def to_dict(cfg) -> dict:
    out = dataclasses.asdict(cfg)
    model, d = (cfg.model, out["model"]) if isinstance(cfg, Config) else (cfg, out)
    if isinstance(model, ModelConfig):     # the sections of added families
        d.update({name: dataclasses.asdict(getattr(model, name)) for name in _ADDED})
    return out


def to_yaml(cfg, *, comments: bool = False) -> str:
    """The resolved config as YAML; with comments, every field's docstring above it."""
    if not comments:
        return yaml.safe_dump(to_dict(cfg), sort_keys=False)
    lines: list[str] = []
    _yaml_commented(cfg, 0, lines)
    return "\n".join(lines) + "\n"


def changed_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted names of the leaves whose values differ between two :func:`to_dict` results."""
    out = []
    for k in a:
        path = f"{prefix}{k}"
        if isinstance(a[k], dict) and isinstance(b[k], dict) and a[k].keys() == b[k].keys():
            out += changed_keys(a[k], b[k], path + ".")
        elif a[k] != b[k]:
            out.append(path)
    return out


def to_text_changed(cfg) -> str:
    """What differs from the defaults, one line per section, each value as JSON (one line even for a
    string holding a newline), e.g. ``  train: max_steps=50, sample_prompt="def f\\n"``."""
    sections: dict[str, list[str]] = {}
    mine = to_dict(cfg)
    for key in changed_keys(to_dict(Config()), mine):
        section, _, rest = key.partition(".")
        value = mine
        for part in key.split("."):
            value = value[part]
        value = json.dumps(value)
        sections.setdefault(section, []).append(f"{rest}={value}" if rest else value)
    return "".join(f"  {k}: {', '.join(v)}\n" for k, v in sections.items())


def _yaml_commented(obj, indent: int, lines: list[str]) -> None:
    docs = field_docs(type(obj))
    pad = "  " * indent
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        doc = docs.get(f.name)
        if doc:
            lines.append(f"{pad}# {doc}")
        if dataclasses.is_dataclass(v):
            lines.append(f"{pad}{f.name}:")
            _yaml_commented(v, indent + 1, lines)
        else:
            if isinstance(v, list):     # a list of sections (optimizer.groups): plain mappings
                v = [dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x for x in v]
            dumped = yaml.safe_dump({f.name: v}, default_flow_style=True, sort_keys=False, width=10_000).strip()
            if dumped.startswith("{") and dumped.endswith("}"):
                dumped = dumped[1:-1]
            lines.append(f"{pad}{dumped}")


# --------------------------------------------------------------------------- docs

def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal after each field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def markdown_reference() -> str:
    """docs/configuration.md: every key of the schema with its default, allowed values and docstring
    (the texts ``trainrun config show`` prints); ``make docs`` writes it."""
    sections: list[tuple[str, Any]] = []

    def nullable(obj, f):
        """The section class of a field that is null or a section (model.lora), else None."""
        hint = typing.get_type_hints(type(obj))[f.name]
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        return arms[0] if typing.get_origin(hint) is typing.Union and len(arms) == 1 \
            and dataclasses.is_dataclass(arms[0]) else None

    def walk(obj, prefix):
        sections.append((prefix, obj))
        for f in dataclasses.fields(obj):
            if dataclasses.is_dataclass(getattr(obj, f.name)):
                walk(getattr(obj, f.name), f"{prefix}{f.name}.")
            elif getattr(obj, f.name) is None and nullable(obj, f):     # its keys' defaults when given
                walk(nullable(obj, f)(), f"{prefix}{f.name}.")

    walk(Config(), "")

    def flow(v):
        return yaml.safe_dump(v, default_flow_style=True, width=10_000).removesuffix("...\n").strip()

    def allowed(m):
        parts = [", ".join(f"`{flow(c)}`" for c in m["choices"])] if "choices" in m else []
        parts += [f"{op} {flow(m[k])}" for k, op in (("min", ">="), ("gt", ">"), ("max", "<=")) if k in m]
        if "path" in m:
            parts.append("an existing " + {"file": "file", "dir": "directory"}.get(m["path"], "path"))
        return "; ".join(parts)

    def anchor(prefix):
        return prefix.rstrip(".").replace(".", "") or "top-level-keys"

    lines = ["# Configuration reference", "",
             "Generated from the schema (the dataclasses of `trainrun/config/`) by `make docs`; do not edit",
             "by hand. `trainrun config show --config FILE` prints the same texts as comments above the",
             "resolved values; `--set key.path=value` overrides any key. Relative dataset, model and run",
             "paths are resolved against the config file's folder.", "", "Contents:", ""]
    for prefix, _ in sections:
        name = prefix.rstrip(".") or "top-level keys"
        lines.append(f"- [`{name}`](#{anchor(prefix)})" if prefix else f"- [{name}](#{anchor(prefix)})")
    for prefix, obj in sections:
        docs = field_docs(type(obj))
        lines += ["", f"## `{prefix.rstrip('.')}`" if prefix else "## Top-level keys", "",
                  "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            doc = docs.get(f.name, "").replace("|", "\\|")
            if dataclasses.is_dataclass(v):
                lines.append(f"| `{prefix}{f.name}` | [section](#{anchor(prefix + f.name)}) | | {doc} |")
            elif v is None and nullable(obj, f):
                lines.append(f"| `{prefix}{f.name}` | `null` | a [section](#{anchor(prefix + f.name)}) | {doc} |")
            else:
                lines.append(f"| `{prefix}{f.name}` | `{flow(v)}` | {allowed(f.metadata)} | {doc} |")
    return "\n".join(lines) + "\n"
