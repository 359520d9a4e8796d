"""Print trainrun's requirements from pyproject.toml, one per line, for ``pip install`` next to
``pip install --no-deps -e .``: the dependencies and the named extras, their markers evaluated for the
running Python.

    python scripts/requirements.py [--stock] [--without NAME]... [EXTRA ...]

--stock: the onnxruntime stack Python 3.13 gets (stock ``onnxruntime`` and an onnx it reads) on this
Python too: every marker is evaluated as on Python 3.13. onnxruntime-training and stock onnxruntime both
install the ``onnxruntime`` import package, so they cannot share a venv, and an extra cannot take a
dependency away: ``make test-stock`` installs this list instead.
An extra that brings ``onnxruntime-gpu`` (gpu-cu12) replaces the CPU build: the list then holds no other
onnxruntime distribution.
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
STOCK_PYTHON = "3.13"


def requirements(extras=(), stock=False, without=()) -> list[str]:
    """The requirement strings (markers dropped) that apply here, in pyproject's order."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"pyproject.toml has no extra {', '.join(unknown)} (it has {', '.join(optional)})")
    env = default_environment()
    if stock:
        env.update(python_version=STOCK_PYTHON, python_full_version=f"{STOCK_PYTHON}.0")
    skip = {canonicalize_name(n) for n in without}
    out = []
    for line in [*project["dependencies"], *(r for e in extras for r in optional[e])]:
        req = Requirement(line)
        if canonicalize_name(req.name) in skip or (req.marker and not req.marker.evaluate(env)):
            continue
        req.marker = None
        if str(req) not in out:
            out.append(str(req))
    if any(Requirement(r).name == "onnxruntime-gpu" for r in out):
        out = [r for r in out if Requirement(r).name == "onnxruntime-gpu"
               or not Requirement(r).name.startswith("onnxruntime")]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("extras", nargs="*")
    ap.add_argument("--stock", action="store_true", help=f"the onnxruntime stack of Python {STOCK_PYTHON}")
    ap.add_argument("--without", action="append", default=[], metavar="NAME", help="leave out (repeatable)")
    args = ap.parse_args(argv)
    sys.stdout.write("".join(r + "\n" for r in requirements(args.extras, args.stock, args.without)))


if __name__ == "__main__":
    main()
