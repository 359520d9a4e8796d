"""The runner's hooks for observability: profiling, statistics, per-rank logs, log levels.

This subpackage holds everything that watches a run: the phase timer
(:mod:`.timer`), metrics to console/JSONL/TensorBoard (:mod:`.metrics`), the
per-operator profiler (:mod:`.profile`), convergence statistics (:mod:`.stats`)
and their comparison (:mod:`.compare`), and ``trainrun doctor`` (:mod:`.doctor`).

:class:`Observer` is what the runner calls around each step; every part is off
(and costs nothing) unless its config asks for it:

* ``profile.start_step > 0``: :class:`.profile.Profiler`;
* ``debug.stats_every > 0``: :class:`.stats.StatsWriter`;
* ``run.log_level`` devinfo/verbose: a line per rank at start-up and at every
  logged step, prefixed ``[rank r]`` (ranks other than 0 say nothing below
  devinfo).

Log levels: warning (quiet: warnings and errors only), info (progress of rank
0), devinfo (+ onnxruntime's own info logs, each naming its rank and session,
and the per-rank lines), verbose (+ onnxruntime's verbose logs and a traceback
with every error).
"""

from __future__ import annotations

import os

from .profile import Profiler
from .stats import StatsWriter

PER_RANK_LEVELS = ("devinfo", "verbose")


def apply_log_level(level: str) -> None:
    """Process-wide effects of run.log_level (onnxruntime's default logger, tracebacks)."""
    if level in PER_RANK_LEVELS:           # below devinfo onnxruntime's default logger is left as it is
        import onnxruntime as ort
        ort.set_default_logger_severity(1 if level == "devinfo" else 0)    # info / verbose
    if level == "verbose":
        os.environ["TRAINRUN_TRACEBACK"] = "1"      # read by trainrun.cli for errors that end the run


def engine_options(cfg, rank: int) -> dict:
    """Extra EngineOptions: the rank in onnxruntime's log lines; where debug.save_graphs writes.
    With run.deterministic, onnxruntime's random generators are seeded with run.seed here too."""
    if cfg.run.deterministic:
        import onnxruntime as ort
        ort.set_seed(cfg.run.seed)
    extra = {"log_id": f"rank {rank}"}
    if cfg.debug.save_graphs and rank == 0:
        extra["optimized_dir"] = os.path.join(cfg.run.output_dir, "debug", "graphs")
        os.makedirs(extra["optimized_dir"], exist_ok=True)
    return extra


class Observer:
    """Calls around each step of the runner for what is configured: the profiler's window,
    statistics of due steps, per-rank log lines (devinfo). ``log(text, all_ranks)`` prints."""

    def __init__(self, cfg, rank: int, world_size: int, engine, timer, log):
        self.per_rank = cfg.run.log_level in PER_RANK_LEVELS
        self.log_every = cfg.train.log_every
        self.timer, self.log = timer, log
        self.profiler = None
        if cfg.profile.start_step:
            self.profiler = Profiler(cfg.profile, cfg.run.output_dir, rank, world_size, engine, timer)
        self.stats = None
        if cfg.debug.stats_every:
            self.stats = StatsWriter(os.path.join(cfg.run.output_dir, "stats"), rank, world_size,
                                     cfg.debug.stats_every, engine, engine.stats_outputs)
        self._last_totals: dict[str, float] = {}
        self._last_step: int | None = None

    # ------------------------------------------------------------------ around a step
    def step_begin(self, step: int) -> None:
        if self._last_step is None:
            self._last_step = step - 1
        if self.profiler:
            self.profiler.step_begin(step)

    def stats_step(self, step: int):
        """The StatsWriter when this step's statistics are due, else None."""
        if self.stats and self.stats.due(step):
            return self.stats.begin()
        return None

    def step_end(self, step: int, result: dict) -> None:
        if self.per_rank and step % self.log_every == 0:
            self._rank_line(step, result)
        if self.profiler:
            self.profiler.step_end(step)

    def close(self) -> None:
        if self.profiler:
            self.profiler.finish()
        if self.stats:
            self.stats.close()

    # ------------------------------------------------------------------ per-rank lines (devinfo)
    def _rank_line(self, step: int, result: dict) -> None:
        totals = dict(self.timer.total)
        steps = step - self._last_step
        delta = {k: v - self._last_totals.get(k, 0.0) for k, v in totals.items()}
        self._last_totals, self._last_step = totals, step
        parts = [f"{k} {delta.get(k, 0.0) * 1e3 / max(steps, 1):.1f}"
                 for k in ("data", "forward_backward", "allreduce", "optimizer") if k in delta]
        local = result.get("local_loss")
        loss = f"local loss {local:.4f} | " if local is not None else ""
        self.log(f"step {step} | {loss}ms/step: {', '.join(parts)}", all_ranks=True)
