"""Print trainrun's requirements from pyproject.toml, one per line, for ``pip install`` next to
``pip install --no-deps -e .``: the dependencies and the named extras, their markers evaluated for the
running Python.

    python scripts/requirements.py [--without NAME]... [EXTRA ...]

An extra that brings an onnxruntime distribution (training: onnxruntime-training; gpu: its CUDA build;
gpu-cu12: onnxruntime-gpu) replaces the default's stock ``onnxruntime``, and one that pins ``onnx``
replaces the default's onnx: every onnxruntime build installs the ``onnxruntime`` import package, so two
cannot share a venv, and an extra cannot take a dependency away (``make test-training``, ``make test-gpu``).
--without: leave these distributions out (``make test-py313``: the test extra without torch and
transformers, whose tests skip there).

Needs Python >= 3.11 (tomllib) and ``packaging``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirements(extras=(), without=()) -> list[str]:
    """The requirement strings (markers dropped) that apply here, in pyproject's order."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"pyproject.toml has no extra {', '.join(unknown)} (it has {', '.join(optional)})")
    env = default_environment()
    skip = {canonicalize_name(n) for n in without}
    def applies(lines):
        for line in lines:
            req = Requirement(line)
            if canonicalize_name(req.name) not in skip and (req.marker is None or req.marker.evaluate(env)):
                req.marker = None
                yield req

    def family(req):   # onnxruntime, onnxruntime-training, onnxruntime-gpu: one family, as onnx is its own
        name = canonicalize_name(req.name)
        return "onnxruntime" if name.startswith("onnxruntime") else name

    extra = [r for e in extras for r in applies(optional[e])]
    replaced = {family(r) for r in extra} & {"onnxruntime", "onnx"}
    out = []
    for req in [*(r for r in applies(project["dependencies"]) if family(r) not in replaced), *extra]:
        if str(req) not in out:
            out.append(str(req))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("extras", nargs="*")
    ap.add_argument("--without", action="append", default=[], metavar="NAME", help="leave out (repeatable)")
    args = ap.parse_args(argv)
    sys.stdout.write("".join(r + "\n" for r in requirements(args.extras, args.without)))


if __name__ == "__main__":
    main()
