"""The graphs folders the suite runs on, prepared by trainrun itself (``trainrun prepare``).

With ``engine.static_shapes`` on (trainrun's default) the train graph is built
for one [micro_batch, seq_len], so a graphs folder serves one micro-batch only:
every folder is prepared for one (benchmark model, micro-batch, graph-shaping
``--set``s) and lives in ``WORK/graphs/<model>-<tag>-mb<micro_batch>/graphs``:

* tag ``static``: trainrun's defaults (the train graph with fixed dims);
* tag ``dynamic``: ``--set engine.static_shapes=false`` (symbolic batch/seq dims,
  trainrun's graph before the static-shape lever);
* anything else: a slug of the graph-shaping sets.

Only the sets that are baked into the graphs (what trainrun's runner compares
with a prepared manifest: model, optimizer, run.deterministic, debug, the
static shape) pick the folder; runtime keys such as engine.optimizer_kernel or
data.prefetch are left out, so a run with them still finds its graphs prepared
and does not re-prepare inside its own run.

    .venv/bin/python scripts/bench/variants.py --model mid --micro-batch 4 --dynamic   # prepare and print the folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

STATIC_OFF = "engine.static_shapes=false"
BAKED = ("model.", "optimizer.", "run.deterministic", "debug.", "engine.static_shapes", "engine.pad_products")


def graph_sets(sets) -> list[str]:
    """The sets of ``sets`` that shape the prepared graphs."""
    return [s for s in sets if s.split("=", 1)[0].startswith(BAKED)]


def tag_of(sets) -> str:
    g = graph_sets(sets)
    if not g or g == ["engine.static_shapes=true"]:
        return "static"
    if g == [STATIC_OFF]:
        return "dynamic"
    return "_".join("".join(c if c.isalnum() else "-" for c in s.split(".", 1)[-1]) for s in g)


def graphs_dir(work, model: common.BenchModel, micro_batch: int, sets=()) -> Path:
    return Path(work) / "graphs" / f"{model.name}-{tag_of(sets)}-mb{micro_batch}" / "graphs"


def prepare(work, model: common.BenchModel, micro_batch: int, data: str, sets=(), run=None) -> Path:
    """The graphs folder for ``model`` at ``micro_batch`` with the graph-shaping ``sets``, made once by
    ``trainrun prepare``. ``run(name, cmd) -> returncode`` runs the command (default: subprocess)."""
    out = graphs_dir(work, model, micro_batch, sets)
    stamp = code_stamp()
    if (out / "manifest.json").exists() and (out.parent / "code.stamp").exists() \
            and (out.parent / "code.stamp").read_text() == stamp:
        return out
    shutil.rmtree(out.parent, ignore_errors=True)
    argv = common.run_sets(model, out.parent, data, micro_batch) + graph_sets(sets)
    cmd = [str(common.BIN / "trainrun"), "prepare", "--config", str(common.CONFIG)] + \
        [x for s in argv for x in ("--set", s)]
    name = f"prepare-{out.parent.name}"
    if run is None:
        env = dict(os.environ, PYTHONPATH=str(common.ROOT))
        rc = subprocess.run(cmd, cwd=common.ROOT, env=env, stdout=subprocess.DEVNULL).returncode
    else:
        rc = run(name, cmd)
    if rc or not (out / "manifest.json").exists():
        raise SystemExit(f"trainrun prepare failed ({name}): {' '.join(cmd)}")
    (out.parent / "code.stamp").write_text(stamp)
    return out


def code_stamp() -> str:
    """A hash of trainrun's sources: a folder prepared by other code (an earlier checkout's graphs, in a
    work folder kept between bench runs) is prepared again, not measured as this code's."""
    h = hashlib.sha256()
    for f in sorted((common.ROOT / "trainrun").rglob("*.py")):
        h.update(str(f.relative_to(common.ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def build_of(graphs) -> dict:
    """The build options recorded in a graphs folder's manifest (static_shape: [mb, seq] or None)."""
    return json.loads((Path(graphs) / "manifest.json").read_text()).get("build", {})


def op_counts(path) -> dict[str, int]:
    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=list(common.MODELS))
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--dynamic", action="store_true", help=f"--set {STATIC_OFF}")
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench"))
    ap.add_argument("--data", default=str(common.ROOT / "data" / "stdlib" / "train"))
    a = ap.parse_args()
    g = prepare(a.work, common.MODELS[a.model], a.micro_batch, a.data, [STATIC_OFF] if a.dynamic else [])
    print(g, build_of(g))
