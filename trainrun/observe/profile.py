"""Per-operator profiling of chosen steps, and ``trainrun profile summarize``.

``profile: {start_step: S, steps: K}`` profiles steps ``S .. S+K-1`` on every rank.

onnxruntime's profiler belongs to a session and starts when the session is
created, so trainrun does not profile its regular sessions (that would record
every step from the start, and onnxruntime stops recording after a million
events). Instead, just before step ``S`` each rank creates a second set of
train/eval/optimizer sessions with profiling on, binds them to the same flat
buffers (:meth:`trainrun.step.engine.Engine.reopen`), runs the window's steps on
them, then calls ``end_profiling()`` on each and switches back to the regular
sessions. The window therefore holds exactly those steps (with their
evaluation and checkpoint, if any); creating the sessions is timed as the
phase ``profile``, outside the window. The profiling sessions have the same
options as the regular ones, so the numbers computed do not change.

Each rank then writes ONE Chrome-trace file, ``<dir>/rank-<r>.json``
(chrome://tracing or https://ui.perfetto.dev open it): the operator events of
the three sessions (``cat: "Node"``, ``args.session`` = train/eval/optimizer)
and trainrun's own phases of each step (``cat: "trainrun"``: data, i.e. the
wait for the loader, forward_backward, allreduce, norm, optimizer, stats, log,
eval, checkpoint) on one clock, plus a ``trainrun`` key with the totals and the run's output_dir (where
``summarize`` reads summary.json's peak and the graphs for the train graph's per-node cost,
:mod:`trainrun.observe.costs`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import time
from collections import defaultdict

from ..errors import UsageError

SESSIONS = ("train", "eval", "optimizer")
TRACE_PID_BASE = 1000   # one "process" per rank in merged views


def profile_dir(profile, output_dir: str) -> str:
    """Where the traces go: ``profile.dir`` (the config's section) in the run directory ``output_dir``."""
    return os.path.join(output_dir, profile.dir or "profile")      # an absolute dir stays as it is


class Profiler:
    """Opens profiling sessions at the window's first step and writes the trace after its last (``profile``:
    the config's section; ``output_dir``: the run directory)."""

    def __init__(self, profile, output_dir: str, rank: int, world_size: int, engine, timer):
        self.first = profile.start_step
        self.last = profile.start_step + profile.steps - 1
        self.rank, self.world = rank, world_size
        self.engine = engine
        self.timer = timer
        self.dir = profile_dir(profile, output_dir)
        self.output_dir = output_dir     # summary.json's peak and the graphs, for the node costs
        self.active = False
        self.done = False
        self._old = None
        self._steps: list[tuple[int, float, float]] = []   # (step, start, end), perf_counter seconds

    def step_begin(self, step: int) -> None:
        if self.active or self.done or not self.first <= step <= self.last:
            return
        os.makedirs(self.dir, exist_ok=True)
        prefix = os.path.join(self.dir, f".rank-{self.rank}")
        opts = dataclasses.replace(self.engine.opts, profile_prefix=prefix, optimized_dir=None)
        self._old = self.engine.reopen(opts)
        timer = self.timer
        timer.mark("profile")
        # one clock for ORT's events (epoch ns) and trainrun's (perf_counter)
        self._offset_us = time.time_ns() / 1e3 - time.perf_counter() * 1e6
        self.active = True
        self._first_step = step
        timer.record_spans()
        self._t0 = timer.last_mark          # the step starts where the timer's next phase starts

    def step_end(self, step: int) -> None:
        if not self.active:
            return
        now = time.perf_counter()
        self._steps.append((step, self._t0, now))
        self._t0 = now
        if step >= self.last:
            self.finish()

    @staticmethod
    def _events(session, name: str, pid: int) -> list:
        """``session``'s profile events on trainrun's clock, tagged with the session's name."""
        events = []
        path = session.end_profiling()
        start_us = session.get_profiling_start_time_ns() / 1e3
        try:
            with open(path) as fh:
                raw = json.load(fh)
        finally:
            if path and os.path.exists(path):
                os.remove(path)
        for ev in raw:
            ev = dict(ev)
            ev["ts"] = ev.get("ts", 0) + start_us
            ev["pid"] = pid
            ev["args"] = {**ev.get("args", {}), "session": name}
            events.append(ev)
        return events

    def finish(self) -> None:
        """End the window (also when the run stops inside it): write rank-<r>.json."""
        if not self.active:
            return
        spans = self.timer.take_spans()
        eng = self.engine
        sessions = {"train": eng.train_s, "eval": eng.eval_s, "optimizer": eng.opt_s}
        events = []
        pid = TRACE_PID_BASE + self.rank
        for name, bound in sessions.items():
            if bound is None:       # the host optimizer kernel: no session (its time is the optimizer phase)
                continue
            for session in bound.sessions:      # a train graph cut into segments has one per segment
                events += self._events(session, name, pid)
        eng.restore(self._old)
        self._old = None
        for phase, t0, t1 in spans:
            events.append({"cat": "trainrun", "ph": "X", "name": phase, "pid": pid, "tid": 0,
                           "ts": t0 * 1e6 + self._offset_us, "dur": (t1 - t0) * 1e6,
                           "args": {"step": _step_of((t0 + t1) / 2, self._steps)}})
        for step, t0, t1 in self._steps:
            events.append({"cat": "trainrun", "ph": "X", "name": f"step {step}", "pid": pid, "tid": 1,
                           "ts": t0 * 1e6 + self._offset_us, "dur": (t1 - t0) * 1e6, "args": {"step": step}})
        base = min((e["ts"] for e in events), default=0.0)
        for e in events:
            e["ts"] = round(e["ts"] - base, 3)
        events.sort(key=lambda e: e["ts"])
        phases = defaultdict(float)
        for phase, t0, t1 in spans:
            phases[phase] += t1 - t0
        meta = {"rank": self.rank, "world_size": self.world, "steps": [s for s, _, _ in self._steps],
                "phase_seconds": dict(phases), "trace_start_epoch_us": base,
                "output_dir": os.path.abspath(self.output_dir)}
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {self.rank}"}})
        out = os.path.join(self.dir, f"rank-{self.rank}.json")
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms", "trainrun": meta}, fh)
        os.replace(tmp, out)
        self.active = False
        self.done = True
        self.timer.mark("profile")
        self.path = out


def _step_of(t: float, steps) -> int | None:
    for step, t0, t1 in steps:
        if t0 <= t <= t1:
            return step
    return None


# --------------------------------------------------------------------------- summarize

def _configured_dir(run_dir: str) -> str:
    """profile.dir of the run in ``run_dir`` (its config.yaml), else the default."""
    import yaml
    try:
        with open(os.path.join(run_dir, "config.yaml")) as fh:
            return (yaml.safe_load(fh).get("profile") or {}).get("dir") or "profile"
    except (OSError, AttributeError, yaml.YAMLError):
        return "profile"


def _trace_dir(path: str) -> str:
    """The folder of the rank-<r>.json traces: ``path`` itself, or a run directory's profile.dir."""
    for base in (path, os.path.join(path, _configured_dir(path)), os.path.join(path, "profile")):
        if glob.glob(os.path.join(base, "rank-*.json")):
            return base
    raise UsageError(f"{path}: no rank-<r>.json profile traces (train with profile.start_step > 0)")


def load_traces(path: str) -> dict[int, dict]:
    """rank -> trace of a profile directory, or of a run directory (its profile.dir)."""
    files = glob.glob(os.path.join(_trace_dir(path), "rank-*.json"))
    traces = {}
    for f in files:
        try:
            with open(f) as fh:
                data = json.load(fh)
            traces[int(data["trainrun"]["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{f}: not a trainrun profile trace ({exc})") from None
    return dict(sorted(traces.items()))


def operator_table(traces: dict[int, dict], by: str = "op") -> list[dict]:
    """Kernel time per (session, operator type) -- or per node with by="node" -- over every rank."""
    rows: dict[tuple, dict] = {}
    for data in traces.values():
        for ev in data["traceEvents"]:
            if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
                continue
            args = ev.get("args", {})
            key = (args.get("session", "?"),
                   args.get("op_name", "?") if by == "op" else ev["name"][:-len("_kernel_time")])
            row = rows.setdefault(key, {"session": key[0], "name": key[1], "op": args.get("op_name", "?"),
                                        "calls": 0, "total_us": 0.0, "provider": args.get("provider", "")})
            row["calls"] += 1
            row["total_us"] += float(ev.get("dur", 0))
    return sorted(rows.values(), key=lambda r: -r["total_us"])


def phase_table(traces: dict[int, dict]) -> tuple[list[str], dict[int, dict]]:
    order = ["data", "forward_backward", "allreduce", "norm", "optimizer", "allgather", "stats", "log", "eval",
             "checkpoint"]
    per_rank = {r: d["trainrun"]["phase_seconds"] for r, d in traces.items()}
    seen = {p for v in per_rank.values() for p in v}
    phases = [p for p in order if p in seen] + sorted(seen - set(order))
    return phases, per_rank


def report(path: str, by: str = "op") -> dict:
    """Everything ``trainrun profile summarize`` reports, as data (what ``--json`` prints): the window, the
    kernel time per operator (or node), the phases per rank and the train graph's per-node cost
    (:func:`trainrun.observe.costs.node_costs`)."""
    from .costs import node_costs
    traces = load_traces(path)
    first = next(iter(traces.values()))["trainrun"]
    phases, per_rank = phase_table(traces)
    n_steps = max(len(first["steps"]), 1)
    return {"path": os.path.abspath(path), "steps": first["steps"], "ranks": sorted(traces),
            "kernels": {"by": by, "rows": operator_table(traces, by)},
            "phases_ms_per_step": {str(r): {p: secs.get(p, 0.0) * 1e3 / n_steps for p in phases}
                                   for r, secs in per_rank.items()},
            "node_costs": node_costs(traces, path)}


def summarize(path: str, top: int = 15, by: str = "op") -> str:
    """:func:`report` as text: the top ``top`` operators (or nodes), the phases, the top nodes by overhead."""
    from .costs import render
    rep = report(path, by)
    steps = rep["steps"]
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "no steps"
    lines = [f"profile of {span} ({len(steps)} step(s)) on {len(rep['ranks'])} rank(s): {rep['path']}", ""]

    ops = rep["kernels"]["rows"]
    total = sum(r["total_us"] for r in ops) or 1.0
    what = "operator types" if by == "op" else "nodes"
    lines.append(f"top {min(top, len(ops))} {what} by total kernel time (all ranks; "
                 f"{total / 1e3:,.1f} ms of kernel time in all)")
    name_w = max([len("operator")] + [len(r["name"]) for r in ops[:top]])
    lines.append(f"  {'session':<9} {'operator':<{name_w}} {'calls':>7} {'total ms':>10} {'share':>6} "
                 f"{'per call us':>11}")
    for r in ops[:top]:
        lines.append(f"  {r['session']:<9} {r['name']:<{name_w}} {r['calls']:>7} {r['total_us'] / 1e3:>10.2f} "
                     f"{r['total_us'] / total:>6.1%} {r['total_us'] / r['calls']:>11.1f}")
    lines.append("")

    per_rank = rep["phases_ms_per_step"]
    phases = list(next(iter(per_rank.values())))
    lines.append("phases per rank, ms per step (trainrun's timer; data = waiting for the loader)")
    widths = [max(len(p), 8) for p in phases]
    lines.append("  rank " + " ".join(f"{p:>{w}}" for p, w in zip(phases, widths)) + f" {'total':>8}")
    for r, ms in per_rank.items():
        vals = [ms[p] for p in phases]
        lines.append(f"  {r:>4} " + " ".join(f"{v:>{w}.2f}" for v, w in zip(vals, widths)) + f" {sum(vals):>8.2f}")
    lines.append("")
    lines += render(rep["node_costs"], top)
    return "\n".join(lines)
