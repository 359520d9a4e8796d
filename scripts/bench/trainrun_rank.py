"""One trainrun rank as the benchmark launches it: ``trainrun`` itself (its CLI,
in this process), plus the peak RSS of the rank written at exit.

    .venv/bin/mpirun -np 2 .venv/bin/python scripts/bench/trainrun_rank.py \
        --rss-dir DIR -- --config FILE --set ...

is ``mpirun -np 2 trainrun --config FILE --set ...`` with DIR/rss-<rank>.json
written at exit.

``--code DIR`` runs the trainrun package found in DIR (e.g. an older commit's
``git archive``) instead of this checkout's, in this process's Python and venv.
``--phases`` (with ``--rss-dir``) writes DIR/phases-<rank>.json: for every
completed step, the milliseconds its phase timer charged to each phase between
the start of that step and the start of the next (what ``phase_ms`` in
metrics.jsonl shows, for code versions that do not log it).

Besides the peak RSS of the whole run, the peak RSS reached before the first
checkpoint is written (``train_peak_rss_mb``: the training steps alone; the
end-of-run checkpoint snapshot and, on rank 0, the export come after it) is
recorded when trainrun's runner has a ``TrainingRunner.save`` method to hook; with it the bytes of the
rank's flat gradient buffer (``grad_buffer_bytes``: what the step's gradient reduction covers).
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _runner():
    """trainrun's runner module: this checkout's trainrun/run/runner.py, or an older commit's (``--code``)
    runner, at the top of the package before the modules were packages."""
    import importlib
    import trainrun
    # decided by the package's own folder: an editable install's finder would find this checkout's
    # trainrun/run/ for an older package that has none
    here = Path(trainrun.__path__[0])
    return importlib.import_module("trainrun.run.runner" if (here / "run" / "runner.py").exists() else "trainrun.runner")


def record_phases(path: Path) -> None:
    """Hook TrainingRunner.train_step: at the start of each step, the phase timer's totals since the start
    of the previous one are that step's phase times; written to ``path`` at exit."""
    runner = _runner()
    steps: list = []
    prev: dict = {}
    original = runner.TrainingRunner.train_step

    def train_step(self, *a, **kw):
        total = dict(self.timer.total)
        if prev.get("total") is not None and all(v >= prev["total"].get(k, 0.0) for k, v in total.items()):
            steps.append({"step": prev["step"], "phase_ms": {k: round(1e3 * (v - prev["total"].get(k, 0.0)), 3)
                                                             for k, v in total.items()
                                                             if v > prev["total"].get(k, 0.0)}})
        prev.update(total=total, step=self.step + 1)
        return original(self, *a, **kw)
    runner.TrainingRunner.train_step = train_step
    atexit.register(lambda: common.write_json(path, {"steps": steps}))


def _own_subpackages(code: Path) -> None:
    """kernels/ and data_tools/ sit at the top of the repo and install as trainrun.kernels and
    trainrun.data_tools (pyproject's package-dir): the editable install maps them to this checkout's, so an
    older commit's trainrun would import today's. Map them to the older commit's own folders."""
    import importlib.util
    for sub in ("kernels", "data_tools"):
        init = code / sub / "__init__.py"
        if init.exists():
            spec = importlib.util.spec_from_file_location(f"trainrun.{sub}", init,
                                                          submodule_search_locations=[str(code / sub)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[f"trainrun.{sub}"] = module
            spec.loader.exec_module(module)


def main() -> None:
    argv = sys.argv[1:]
    sep = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:sep], argv[sep + 1:]
    rss_dir, code, phases = None, None, False
    i = 0
    while i < len(own):
        if own[i] == "--rss-dir":
            rss_dir = own[i + 1]
            i += 2
        elif own[i] == "--code":
            code = own[i + 1]
            i += 2
        elif own[i] == "--phases":
            phases = True
            i += 1
        else:
            raise SystemExit(f"trainrun_rank: unknown option {own[i]}")
    if code:       # ahead of this checkout (common put it first on sys.path) and of an editable install
        sys.path.insert(0, str(Path(code).resolve()))
        _own_subpackages(Path(code).resolve())
    rank, _ = common.launcher_rank()
    marks: dict = {}
    if rss_dir:
        atexit.register(lambda: common.write_json(Path(rss_dir) / f"rss-{rank}.json",
                                                  {"rank": rank, "peak_rss_mb": round(common.peak_rss_mb(), 1),
                                                   "vm_peak_mb": common.vm_peak_mb(), **marks}))
        if phases:
            record_phases(Path(rss_dir) / f"phases-{rank}.json")
        try:
            runner = _runner()
            original_save = runner.TrainingRunner.save

            def save(self, *a, **kw):
                marks.setdefault("train_peak_rss_mb", round(common.peak_rss_mb(), 1))
                grads = getattr(getattr(self, "engine", None), "grads", None)
                if grads is not None:
                    marks.setdefault("grad_buffer_bytes", int(grads.nbytes))
                return original_save(self, *a, **kw)
            runner.TrainingRunner.save = save
        except (ImportError, AttributeError):
            pass
    sys.argv = ["trainrun", *rest]
    from trainrun.cli import main as trainrun_main
    trainrun_main()


if __name__ == "__main__":
    main()
