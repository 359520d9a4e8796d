"""Levers on trainrun's train graph, measured side by side in one process.

    .venv/bin/python scripts/bench/levers.py timing --model mid --threads 1 \
        --variants static,dynamic,static@nospin --rounds 6 --out timing.json
    .venv/bin/python scripts/bench/levers.py profile --model mid --threads 1 --variants static,dynamic
    .venv/bin/python scripts/bench/levers.py scaling --model mid --micro-batch 8 --variants static,dynamic

A variant is ``GRAPH[@OPTIONS]``: GRAPH is ``static`` (trainrun's train graph,
built for the micro-batch: engine.static_shapes on, the default) or
``dynamic`` (``--set engine.static_shapes=false``: symbolic batch/seq dims),
both prepared by ``trainrun prepare`` (scripts/bench/variants.py); OPTIONS
are onnxruntime session-option changes joined by ``:`` (``basic`` /
``extended`` / ``disabled`` graph optimization, ``nospin`` = no intra-op
spinning, ``nomempattern``, ``noarena``, ``daz``).

timing: every variant gets its own Engine over the same real micro-batch; the
variants' steps are interleaved (order reversed every round) so that a shared
machine's load hits them alike; median/min/max ms per step.
profile: onnxruntime's per-op kernel time of each variant's train graph.
scaling: the same at 1 and 2 threads, per op: which ops do not parallelise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import variants as V  # noqa: E402

GRAPHS = {"static": [], "dynamic": [V.STATIC_OFF]}
OPTION_SETS = {
    "": {},
    "basic": {"graph_optimization": "basic"},
    "extended": {"graph_optimization": "extended"},
    "disabled": {"graph_optimization": "disabled"},
    "nospin": {"session_config": {"session.intra_op.allow_spinning": "0"}},
    "daz": {"session_config": {"session.set_denormal_as_zero": "1"}},
    "nomempattern": {"mem_pattern": False},
    "noarena": {"arena": False},
}


def graphs_for(model: common.BenchModel, graph: str, work: Path, data: str, micro_batch: int) -> str:
    """The prepared graphs folder of ``graph`` (static/dynamic) for ``micro_batch`` (made once per work folder)."""
    if graph not in GRAPHS:
        raise SystemExit(f"unknown graph {graph!r}: choose from {', '.join(GRAPHS)}")
    return str(V.prepare(work, model, micro_batch, data, GRAPHS[graph]))


def split_variant(name: str) -> tuple[str, dict]:
    graph, _, opts = name.partition("@")
    merged: dict = {}
    for o in filter(None, opts.split(":")):
        for k, v in OPTION_SETS[o].items():
            if k == "session_config":
                merged.setdefault(k, {}).update(v)
            else:
                merged[k] = v
    return graph or "static", merged


# --------------------------------------------------------------------------- timing
def timing(model: common.BenchModel, names: list[str], threads: int, micro_batch: int, rounds: int,
           work: Path, data: str, warmup: int = 2) -> dict:
    from ceiling import TrainGraphLoop
    loops = {}
    for name in names:
        graph, opts = split_variant(name)
        loops[name] = TrainGraphLoop(graphs_for(model, graph, work, data, micro_batch), data, micro_batch,
                                     model.seq_len, threads, **opts)
    for loop in loops.values():
        for _ in range(warmup):
            loop.step()
    times = {n: [] for n in names}
    losses = {}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            losses[n] = loops[n].step()
            times[n].append((time.perf_counter() - t) * 1e3)
    base = common.summarize(times[names[0]])["median"]
    tokens = micro_batch * model.seq_len
    return {"model": model.name, "threads": threads, "micro_batch": micro_batch, "rounds": rounds,
            "loadavg": common.loadavg(),
            "variants": {n: {**common.summarize(times[n]), "tokens_per_sec": tokens / (common.summarize(times[n])["median"] / 1e3),
                             "speedup_vs_first": base / common.summarize(times[n])["median"], "loss": losses[n]}
                         for n in names}}


def profile(model: common.BenchModel, names: list[str], threads: int, micro_batch: int, steps: int,
            work: Path, data: str) -> dict:
    from ceiling import TrainGraphLoop, profile_summary
    out = {}
    prof_dir = work / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        graph, opts = split_variant(name)
        prefix = str(prof_dir / f"{model.name}-{name.replace('@', '_').replace(':', '_')}-t{threads}")
        loop = TrainGraphLoop(graphs_for(model, graph, work, data, micro_batch), data, micro_batch, model.seq_len,
                              threads, profile_prefix=prefix, **opts)
        t = time.perf_counter()
        for _ in range(steps):
            loop.step()
        ms = (time.perf_counter() - t) / steps * 1e3
        path = loop.end_profile()
        ops = profile_summary(path, top=1000)
        for o in ops:
            o["ms_per_step"] = round(o["ms"] / steps, 2)
        out[name] = {"step_ms": ms, "steps": steps, "ops": ops[:12], "file": path,
                     "all_ms_per_step": {o["op"]: o["ms_per_step"] for o in ops}}
    return out


def scaling(model: common.BenchModel, names: list[str], micro_batch: int, steps: int, work: Path, data: str) -> dict:
    """Per-op kernel time at 1 and 2 threads (onnxruntime profile): which ops do not parallelise."""
    from ceiling import TrainGraphLoop
    prof_dir = work / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        graph, opts = split_variant(name)
        per: dict = {}
        for threads in (1, 2):
            prefix = str(prof_dir / f"scaling-{model.name}-{name.replace('@', '_').replace(':', '_')}-t{threads}")
            loop = TrainGraphLoop(graphs_for(model, graph, work, data, micro_batch), data, micro_batch, model.seq_len,
                                  threads, profile_prefix=prefix, **opts)
            loop.step()                      # allocation run: in the profile, but the same for both
            for _ in range(steps):
                loop.step()
            per[threads] = {o["op"]: o["ms"] / (steps + 1) for o in __import__("ceiling").profile_summary(
                loop.end_profile(), top=1000)}
        t1, t2 = sum(per[1].values()), sum(per[2].values())
        ops = sorted(per[2], key=lambda o: -per[2][o])
        out[name] = {"ms_1t": t1, "ms_2t": t2, "speedup": t1 / t2,
                     "ops": [{"op": o, "ms_1t": per[1].get(o, 0.0), "ms_2t": per[2][o],
                              "speedup": per[1].get(o, 0.0) / per[2][o] if per[2][o] else None,
                              "share_2t": per[2][o] / t2} for o in ops[:14]],
                     "all": {o: [round(per[1].get(o, 0.0), 2), round(per[2].get(o, 0.0), 2)]
                             for o in set(per[1]) | set(per[2])}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["timing", "profile", "scaling"])
    ap.add_argument("--model", default="tiny", choices=list(common.MODELS))
    ap.add_argument("--variants", default="static,dynamic")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, help="default: the per-rank batch at 2 ranks x threads/1")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench"))
    ap.add_argument("--data", default=str(common.ROOT / "data" / "stdlib" / "train"))
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(args.work)
    names = args.variants.split(",")
    model = common.MODELS[args.model]
    mb = args.micro_batch or model.global_batch // 2 * (1 if args.threads == 1 else 2)
    if args.what == "timing":
        result = timing(model, names, args.threads, mb, args.rounds, work, args.data)
        for k, v in result["variants"].items():
            print(f"{k:28s} median {v['median']:8.1f} ms  min {v['min']:8.1f}  max {v['max']:8.1f}  "
                  f"x{v['speedup_vs_first']:.3f}")
    elif args.what == "scaling":
        result = scaling(model, names, args.micro_batch or model.global_batch, args.steps, work, args.data)
        for k, v in result.items():
            print(k, f"1 thread {v['ms_1t']:.0f} ms, 2 threads {v['ms_2t']:.0f} ms, x{v['speedup']:.2f}",
                  [(o["op"], round(o["speedup"] or 0, 2), round(o["share_2t"], 3)) for o in v["ops"][:8]])
    else:
        result = profile(model, names, args.threads, mb, args.steps, work, args.data)
        for k, v in result.items():
            print(k, f"{v['step_ms']:.1f} ms/step", [(o["op"], o["share"]) for o in v["ops"][:8]])
    if args.out:
        common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
