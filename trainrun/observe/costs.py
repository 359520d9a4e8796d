"""Per-node cost of a profiled step: which nodes of the train graph cost more than their FLOPs.

``trainrun profile summarize`` reads it from the traces of ``profile: {start_step, steps}``
(:mod:`trainrun.observe.profile`). For each node of the train graph as onnxruntime ran it (its name in the
kernel events), per step on one rank (the mean over the ranks):

* **time**: its kernel time;
* **FLOPs**: :func:`trainrun.observe.flops.product_flops` at the shapes the trace records for each call
  (the node's attributes from the run's graphs where a node of that name and op is there; a node onnxruntime
  fused is read from its shapes): a matrix product's multiply-adds x 2, 0 for every other op (elementwise,
  shape, normalisation), as MFU counts them;
* **at peak**: the time those FLOPs take at the run's measured matrix-product peak (summary.json's
  ``peak_flops``, the sum over ranks measured at start-up, so one rank's share: ``peak_flops / world_size``);
* **overhead**: time - at peak (0 where a node ran at the peak or faster): what the node costs beyond its
  arithmetic. An elementwise or shape node's overhead is all of its time.

The window's first step is left out when it has more than one: it is the profiling sessions' first run
(fresh allocations, cold caches). The totals split the step into the matrix products, every other node
(with its mean time per call: the per-node cost of a short step) and the time between the kernels inside
the graph's runs (onnxruntime's executor).
"""

from __future__ import annotations

import json
import os

from .flops import PRODUCTS, product_flops

KERNEL = "_kernel_time"


def _dims(shape: dict) -> list:
    """A trace's ``{"float": [8, 128]}`` as its dims."""
    return list(next(iter(shape.values()), []))


def _gflops(flops: float | None, ms: float) -> float | None:
    """GFLOP/s of ``flops`` in ``ms`` (0 for no FLOPs; None where unknown)."""
    if flops is None or (flops and ms <= 0):
        return None
    return flops / ms / 1e6 if flops else 0.0


def _run_dir(path: str, traces: dict) -> str | None:
    """The run directory of the traces: ``path`` itself, the run's output_dir the traces name, or the folder
    above the traces' own; the first that has summary.json or graphs/."""
    meta = next(iter(traces.values()))["trainrun"]
    for d in (path, meta.get("output_dir"), os.path.dirname(os.path.abspath(path))):
        if d and (os.path.exists(os.path.join(d, "summary.json")) or os.path.isdir(os.path.join(d, "graphs"))):
            return d
    return None


def _peak(run_dir: str | None) -> tuple[float | None, str]:
    """(one rank's peak FLOP/s, where it was read or why there is none)."""
    path = os.path.join(run_dir, "summary.json") if run_dir else None
    if path is None or not os.path.exists(path):
        return None, "no summary.json beside the traces (the run has not finished): no peak, no overhead"
    try:
        with open(path) as fh:
            summary = json.load(fh)
        peak, world = summary.get("peak_flops"), int(summary.get("world_size") or 1)
    except (OSError, ValueError, TypeError) as exc:
        return None, f"{path}: unreadable ({exc}): no peak, no overhead"
    if not peak:
        return None, f"{path} has no peak_flops: no peak, no overhead"
    return peak / world, (f"summary.json's peak_flops {peak / 1e9:,.2f} GFLOP/s over {world} rank(s), "
                          f"measured at start-up")


def _attributes(run_dir: str | None, session: str) -> dict:
    """name -> (op, attributes) of the session's graph nodes: the graph onnxruntime ran (debug.save_graphs)
    over the one trainrun wrote."""
    found: dict = {}
    if run_dir is None:
        return found
    import onnx
    for sub in ("graphs", os.path.join("debug", "graphs")):
        path = os.path.join(run_dir, sub, f"{session}.onnx")
        try:
            graph = onnx.load(path, load_external_data=False).graph
        except Exception:  # noqa: BLE001 - no graph (or an unreadable one): the shapes alone
            continue
        for n in graph.node:
            if n.name:
                found[n.name] = (n.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
    return found


def _window(traces: dict) -> tuple[list[int], list[int]]:
    """(the steps counted, the steps left out)."""
    steps = next(iter(traces.values()))["trainrun"]["steps"]
    return (steps[1:], steps[:1]) if len(steps) > 1 else (list(steps), [])


def node_costs(traces: dict[int, dict], path: str, session: str = "train") -> dict:
    """The per-node cost report of ``session``'s graph in the traces found at ``path`` (a dict: what
    ``--json`` prints and :func:`render` writes out)."""
    run_dir = _run_dir(path, traces)
    peak, peak_source = _peak(run_dir)
    attrs = _attributes(run_dir, session)
    counted, left_out = _window(traces)
    nodes: dict[str, dict] = {}
    step_us = runs_us = 0.0
    flops_of: dict = {}
    for data in traces.values():
        events = data["traceEvents"]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "trainrun"
                 and e.get("tid") == 1 and (e.get("args") or {}).get("step") in counted]
        step_us += sum(t1 - t0 for t0, t1 in spans)

        for e in events:
            args = e.get("args") or {}
            if args.get("session") != session or not any(t0 <= e["ts"] <= t1 for t0, t1 in spans):
                continue
            if e.get("cat") == "Session" and e.get("name") == "model_run":
                runs_us += float(e.get("dur", 0))
            if e.get("cat") != "Node" or not e.get("name", "").endswith(KERNEL):
                continue
            name, op = e["name"][:-len(KERNEL)], args.get("op_name", "?")
            shapes = ([_dims(s) for s in args.get("input_type_shape", [])],
                      [_dims(s) for s in args.get("output_type_shape", [])])
            key = (name, op, json.dumps(shapes))
            if key not in flops_of:
                known_op, known = attrs.get(name, (None, None))
                flops_of[key] = product_flops(op, shapes[0], shapes[1][0] if shapes[1] else None,
                                              known if known_op == op else None)
            row = nodes.setdefault(name, {"name": name, "op": op, "calls": 0, "us": 0.0, "flops": 0.0})
            row["calls"] += 1
            row["us"] += float(e.get("dur", 0))
            row["flops"] = None if row["flops"] is None or flops_of[key] is None else row["flops"] + flops_of[key]
    per = max(len(traces) * len(counted), 1)          # rank-steps: the figures are per step on a rank
    rows = []
    for r in nodes.values():
        ms, flops = r["us"] / 1e3 / per, None if r["flops"] is None else r["flops"] / per
        at_peak = None if peak is None or flops is None else flops / peak * 1e3
        rows.append({"name": r["name"], "op": r["op"], "calls_per_step": r["calls"] / per, "ms": ms,
                     "flops": flops, "gflops_per_s": _gflops(flops, ms), "ms_at_peak": at_peak,
                     "overhead_ms": None if at_peak is None else max(ms - at_peak, 0.0)})
    rows.sort(key=lambda r: (-(r["overhead_ms"] if r["overhead_ms"] is not None else r["ms"]), r["name"]))
    products = [r for r in rows if r["op"] in PRODUCTS]
    others = [r for r in rows if r["op"] not in PRODUCTS]
    step_ms, runs_ms, kernel_ms = step_us / 1e3 / per, runs_us / 1e3 / per, sum(r["ms"] for r in rows)

    def part(rs):
        ms, calls = sum(r["ms"] for r in rs), sum(r["calls_per_step"] for r in rs)
        known = [r["flops"] for r in rs if r["flops"] is not None]
        return {"nodes": len(rs), "calls_per_step": calls, "ms": ms, "share_of_step": ms / step_ms if step_ms else None,
                "ms_per_call": ms / calls if calls else None, "flops": sum(known),
                "flops_unknown_nodes": len(rs) - len(known), "gflops_per_s": _gflops(sum(known), ms),
                "ms_at_peak": None if peak is None else sum(known) / peak * 1e3,
                "overhead_ms": None if peak is None else sum(r["overhead_ms"] or 0.0 for r in rs)}
    return {"session": session, "steps": counted, "left_out": left_out, "ranks": len(traces),
            "run_dir": run_dir, "peak_flops_per_rank": peak, "peak_source": peak_source,
            "step_ms": step_ms, "graph_runs_ms": runs_ms, "kernel_ms": kernel_ms,
            "between_kernels_ms": runs_ms - kernel_ms, "products": part(products), "others": part(others),
            "nodes": rows}


def _num(v, fmt: str, width: int) -> str:
    return f"{'?':>{width}}" if v is None else f"{v:>{width}{fmt}}"


def render(costs: dict, top: int) -> list[str]:
    """The report as text: the top ``top`` nodes by overhead, then the totals."""
    steps, left = costs["steps"], costs["left_out"]
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "no steps"
    why = f"; step {left[0]} left out: the profiling sessions' first run" if left else \
        " (its sessions' first run: profile 2 steps or more to leave it out)"
    peak = costs["peak_flops_per_rank"]
    lines = [f"per-node cost of the {costs['session']} graph, ms per step on a rank (mean of {costs['ranks']} "
             f"rank(s)), {span}{why}",
             f"peak {peak / 1e9:,.2f} GFLOP/s a rank ({costs['peak_source']})" if peak else costs["peak_source"]]
    rows = costs["nodes"][:top]
    by = "overhead = time - time at the peak" if peak else "time"
    lines.append(f"top {len(rows)} of {len(costs['nodes'])} nodes by {by}")
    w = min(max([len("node")] + [len(r["name"]) for r in rows]), 56)
    ow = max([len("op")] + [len(r["op"]) for r in rows])
    lines.append(f"  {'node':<{w}} {'op':<{ow}} {'calls':>5} {'ms':>9} {'MFLOP':>9} {'GFLOP/s':>8} "
                 f"{'at peak':>9} {'overhead':>9}")
    for r in rows:
        name = r["name"] if len(r["name"]) <= w else "..." + r["name"][-(w - 3):]
        lines.append(f"  {name:<{w}} {r['op']:<{ow}} {r['calls_per_step']:>5.3g} {r['ms']:>9.3f} "
                     f"{_num(None if r['flops'] is None else r['flops'] / 1e6, '.1f', 9)} "
                     f"{_num(r['gflops_per_s'], '.1f', 8)} {_num(r['ms_at_peak'], '.3f', 9)} "
                     f"{_num(r['overhead_ms'], '.3f', 9)}")
    step = costs["step_ms"] or 0.0
    share = (lambda ms: f"{ms / step:6.1%} of the step") if step else (lambda ms: "")
    p, o = costs["products"], costs["others"]
    lines.append(f"  step {step:.3f} ms; the graph's runs {costs['graph_runs_ms']:.3f} ms = "
                 f"{len(costs['nodes'])} nodes' kernels {costs['kernel_ms']:.3f} ms + "
                 f"{costs['between_kernels_ms']:.3f} ms between them")
    unknown = f" ({p['flops_unknown_nodes']} of unknown FLOPs)" if p["flops_unknown_nodes"] else ""
    lines.append(f"  matrix products {p['nodes']:>5} nodes {p['ms']:>10.3f} ms {share(p['ms'])}  "
                 f"{p['flops'] / 1e9:.3f} GFLOP{unknown} at {_num(p['gflops_per_s'], '.1f', 1)} GFLOP/s"
                 + (f", {p['ms_at_peak']:.3f} ms at the peak" if peak else ""))
    lines.append(f"  everything else {o['nodes']:>5} nodes {o['ms']:>10.3f} ms {share(o['ms'])}  "
                 f"{_num(o['ms_per_call'], '.4f', 1)} ms a call")
    if peak:
        total = p["overhead_ms"] + o["overhead_ms"]
        lines.append(f"  overhead in all             {total:>10.3f} ms {share(total)}")
    return lines
