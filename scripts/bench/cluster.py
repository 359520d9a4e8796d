"""Scaling over a slow link (``make bench-cluster``): GPT-2 trained on 2 pretend nodes of one core
each (scripts/cluster/cluster.sh, root), one rank a node, at several link rates, against the same model on
one node alone; side by side in one run, the variants alternated within each round.

    .venv/bin/python scripts/bench/cluster.py [--models mid,gpt2-124m] [--rates off,10gbit,1gbit,100mbit]
        [--variants fp32,diloco-h100-f4-o2-bf16] [--micro-batch 4 | mid=1,gpt2-124m=2]
        [--steps 3:12 | mid=3:12,gpt2-124m=2:4] [--rounds 3 | mid=3,gpt2-124m=1] [--data DIR] [--work runs/bench-cluster]
        [--output BENCHMARKS.md]

Per model (scripts/bench/common.py's shapes; micro-batch ``--micro-batch``, default 4 for mid, 2 for 124M, a
rank; ``--steps`` WARM-UP:TIMED steps, default 3:12 for mid, 2:4 for 124M): one run on n1 alone (``1x1``),
then at every rate (tc tbf rates: ``1gbit``, ``100mbit``...; ``off``: unshaped) each variant on n1 + n2 (``2x1``):

* ``fp32``          one allreduce after the backward pass (the behaviour before overlap_grad_reduce);
* ``fp32-overlap``  ``distributed.overlap_grad_reduce: true`` (buckets of ``--bucket-mb``);
* ``bf16``          ``distributed.reduce_dtype: bf16``, one reduction after the backward pass;
* ``bf16-overlap``  both;
* ``diloco-hH[-fF][-oT][-bf16]``  ``distributed.sync: diloco``, each node a replica: an outer step every H
                    steps (``inner_steps``), streamed in F fragments (``fragments``, default 1), each exchange
                    overlapped with T inner steps (``overlap_steps``, default 0), bf16 outer gradients on the
                    wire (``outer_dtype``, default fp32); e.g. ``diloco-h10``, ``diloco-h100-f4-o2-bf16``.
                    Nothing crosses the link between two exchanges (wire bytes/step 0: the replicas'
                    reduction has one rank).

Scaling efficiency = tokens/s on 2 nodes / (2 x tokens/s on one node); tokens/s over the timed steps after the
warm-up (metrics.jsonl's ``elapsed_s``), the median over rounds. ``exposed`` = the step time on 2 nodes minus
the step time alone: what the reduction (and the wire's CPU work on the node's one core) adds to a step.

The timed window of a DiLoCo variant is the steady state of its rounds: a fragment's exchange starts every
P = H / F steps (one of them every P steps, round after round), so the window is a whole number of periods,
the timed steps rounded up to a multiple of P, and it starts after a warm-up of whole periods, at least the
warm-up asked for and T steps (so that it holds as many exchanges applied as started); a metrics line comes
every P steps (where a DiLoCo step sums its scalars over the world); the run's last step, where every
fragment is synchronised at once, comes one step after the window and is not timed. With F > 1 the fragments differ in size by up to a
tensor: a window of a multiple of H holds each once. The DiLoCo sub-table gives, from metrics.jsonl's
``outer_*`` records in the window, the bytes rank 0 sent per round (H steps) and the mean time the ranks
waited for the link per exchange (``outer_wait_s``: with overlap, what the link took beyond T steps).

Writes WORK/cluster.json and the tables between ``<!-- bench-cluster: begin/end -->`` of ``--output``
(appended under HEADING where the file has no such markers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
import variants

ROOT, BIN, HERE = common.ROOT, common.BIN, common.HERE
CLUSTER = ROOT / "scripts" / "cluster" / "cluster.sh"
BEGIN, END = "<!-- bench-cluster: begin -->", "<!-- bench-cluster: end -->"
HEADING = "## Across 2 nodes over a slow link (`make bench-cluster`)"
VARIANTS = {
    "fp32": ["distributed.overlap_grad_reduce=false"],
    "fp32-overlap": ["distributed.overlap_grad_reduce=true"],
    "bf16": ["distributed.reduce_dtype=bf16", "distributed.overlap_grad_reduce=false"],
    "bf16-overlap": ["distributed.reduce_dtype=bf16", "distributed.overlap_grad_reduce=true"],
}
DEFAULT_VARIANTS = [*VARIANTS, "diloco-h10"]
MODEL_VARIANTS = {"gpt2-124m": ["fp32", "fp32-overlap", "bf16-overlap", "diloco-h10"]}   # default: DEFAULT_VARIANTS
STEPS = {"mid": (3, 12), "gpt2-124m": (2, 4)}          # (warm-up, timed) steps per run
MICRO = {"mid": 4, "gpt2-124m": 2}
ROUNDS = {"mid": 3, "gpt2-124m": 1}
DILOCO = re.compile(r"diloco-h(?P<h>[1-9][0-9]*)(?:-f(?P<f>[1-9][0-9]*))?(?:-o(?P<o>[1-9][0-9]*))?(?P<bf16>-bf16)?")


def diloco_of(tag: str) -> dict | None:
    """The DiLoCo settings a variant's name gives (inner_steps H, fragments F, overlap_steps T, outer_dtype),
    None for an every-step variant; SystemExit for a name that is neither."""
    if tag in VARIANTS:
        return None
    m = DILOCO.fullmatch(tag)
    if not m:
        raise SystemExit(f"bench-cluster: unknown variant {tag!r}: one of {', '.join(VARIANTS)} or "
                         f"diloco-hH[-fF][-oT][-bf16] (e.g. diloco-h100-f4-o2-bf16)")
    return {"H": int(m["h"]), "F": int(m["f"] or 1), "T": int(m["o"] or 0), "dtype": "bf16" if m["bf16"] else "fp32"}


def variant_sets(tag: str) -> list[str]:
    """The ``--set`` overrides of variant ``tag``."""
    k = diloco_of(tag)
    if k is None:
        return VARIANTS[tag]
    return ["distributed.sync=diloco", f"distributed.diloco.inner_steps={k['H']}",
            f"distributed.diloco.fragments={k['F']}", f"distributed.diloco.overlap_steps={k['T']}",
            f"distributed.diloco.outer_dtype={k['dtype']}"]


def window(tag: str, warmup: int, steps: int) -> tuple[int, int, int, int]:
    """(warm-up, timed steps, run steps, log_every) of variant ``tag``: every-step variants as given, a
    metrics line every step; DiLoCo's in whole periods P = H / F: the warm-up at least ``warmup`` and T, the
    timed steps at least ``steps``, a metrics line every P steps (a DiLoCo step sums its scalars over the
    world only at a metrics line), and one step after the window (the run's last, which synchronises the
    whole model)."""
    k = diloco_of(tag)
    if k is None:
        return warmup, steps, warmup + steps, 1
    period = max(1, k["H"] // k["F"])
    warm = period * math.ceil(max(warmup, k["T"], 1) / period)
    timed = period * math.ceil(steps / period)
    return warm, timed, warm + timed + 1, period


def per_model(text: str | None, default: dict, parse) -> dict:
    """``--micro-batch`` / ``--steps`` / ``--rounds``: one value for every model, or ``model=value`` pairs over ``default``."""
    out = dict(default)
    if not text:
        return out
    if "=" not in text:
        return {name: parse(text) for name in common.MODELS}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in common.MODELS:
            raise SystemExit(f"bench-cluster: unknown model {name!r} in {text!r}: one of {', '.join(common.MODELS)}")
        out[name] = parse(value)
    return out


def steps_of(text: str) -> tuple[int, int]:
    warm, _, timed = text.partition(":")
    try:
        return int(warm), int(timed)
    except ValueError:
        raise SystemExit(f"bench-cluster: --steps takes WARM-UP:TIMED (e.g. 3:12), got {text!r}") from None


def sh(args: list[str], log: Path, timeout: float = 1800) -> int:
    with open(log, "w") as fh:
        return subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout).returncode


def cluster(*args: str) -> None:
    subprocess.run([str(CLUSTER), *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def metrics(run: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except OSError:
        return []


def tokens_per_sec(run: Path, warmup: int, tokens_per_step: int, end: int | None = None) -> float | None:
    """Tokens/s over steps ``warmup`` + 1 .. ``end`` (default: the last step logged)."""
    rows = [r for r in metrics(run) if "elapsed_s" in r and "step" in r]
    first = next((r for r in rows if r["step"] == warmup), None)
    last = next((r for r in rows if r["step"] == end), None) if end else (rows[-1] if rows else None)
    if first is None or last is None or last["step"] <= warmup:
        return None
    return (last["step"] - first["step"]) * tokens_per_step / (last["elapsed_s"] - first["elapsed_s"])


def outer_records(run: Path, warmup: int, end: int) -> list[dict]:
    """The DiLoCo exchanges (metrics.jsonl's ``outer_*`` lines) logged at steps ``warmup`` + 1 .. ``end``."""
    return [r for r in metrics(run) if "outer_bytes" in r and warmup < r["step"] <= end]


def one_run(work: Path, m: common.BenchModel, graphs: Path, data: str, tag: str, nodes: int, sets: list[str],
            warmup: int, steps: int, micro: int, bucket_mb: float, run_steps: int | None = None,
            log_every: int = 1) -> dict:
    """One run of ``nodes`` nodes timed over steps ``warmup`` + 1 .. ``warmup + steps`` (``run_steps``: the
    run's length when longer), a metrics line every ``log_every`` steps."""
    d = work / "runs" / m.name / tag
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    shutil.copytree(graphs, d / "graphs")
    all_sets = common.run_sets(m, d, data, micro, 1, warmup, (run_steps or warmup + steps) - warmup) + [
        f"train.log_every={log_every}", f"distributed.bucket_mb={bucket_mb}", *sets]
    argv = [str(BIN / "trainrun"), "--config", str(common.CONFIG)] + [x for s in all_sets for x in ("--set", s)]
    hosts = ",".join(f"n{i + 1}" for i in range(nodes))
    cmd = [str(CLUSTER), "mpirun", "-hosts", hosts, "-ppn", "1", "-np", str(nodes), *argv]
    t0 = time.monotonic()
    rc = sh(cmd, work / "logs" / f"{m.name}-{tag}.log")
    out = {"tag": tag, "rc": rc, "wall_s": round(time.monotonic() - t0, 2),
           "cmd": f"cluster.sh mpirun -hosts {hosts} -ppn 1 -np {nodes} trainrun ... "
                  + " ".join(f"--set {s}" for s in sets)}
    tps = tokens_per_sec(d, warmup, micro * nodes * m.seq_len, warmup + steps)
    outer = outer_records(d, warmup, warmup + steps)
    if outer:
        out.update(outer_bytes=sum(r["outer_bytes"] for r in outer), outer_steps=len(outer), timed_steps=steps,
                   warmup=warmup, outer_wait_s=statistics.mean(r["outer_wait_s"] for r in outer))
    try:
        summary = json.loads((d / "summary.json").read_text())
        out.update(wire_bytes_per_step=summary.get("wire_bytes_per_step"), grad_buckets=summary.get("grad_buckets"),
                   final_loss=summary.get("final_loss"), phase_shares=summary.get("phase_shares"))
    except OSError:
        pass
    out["tokens_per_sec"] = tps
    for junk in ("checkpoints", "model.onnx", "graphs"):
        p = d / junk
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return out


def pair_run(work: Path, m: common.BenchModel, graphs: Path, data: str, tag: str, warmup: int, steps: int,
             micro: int) -> dict:
    """One rank alone on n1 and one alone on n2 at the same time, no gradients exchanged: the two cores
    busy at once, as in a 2-node run (shared caches and memory bandwidth); tokens/s summed."""
    procs, dirs = [], []
    for node in ("n1", "n2"):
        d = work / "runs" / m.name / f"{tag}-{node}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copytree(graphs, d / "graphs")
        sets = common.run_sets(m, d, data, micro, 1, warmup, steps) + ["train.log_every=1"]
        argv = [str(BIN / "trainrun"), "--config", str(common.CONFIG)] + [x for s in sets for x in ("--set", s)]
        log = open(work / "logs" / f"{m.name}-{tag}-{node}.log", "w")
        procs.append(subprocess.Popen([str(CLUSTER), "mpirun", "-hosts", node, "-np", "1", *argv], cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT))
        dirs.append(d)
    rcs = [p.wait(timeout=1800) for p in procs]
    tps = [tokens_per_sec(d, warmup, micro * m.seq_len) for d in dirs]
    for d in dirs:
        for junk in ("checkpoints", "model.onnx", "graphs"):
            p = d / junk
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return {"tag": tag, "rc": max(rcs), "tokens_per_sec": sum(tps) if all(tps) else None, "each": tps}


def render(results: dict) -> str:
    mach = results["machine"]
    lines = [BEGIN,
             f"{mach.get('cpu')}, {mach.get('cores')} cores ({mach.get('hypervisor', 'bare metal')}): 2 pretend nodes "
             f"(scripts/cluster/cluster.sh: network namespaces, one core each, a veth per node shaped by tc tbf), one "
             f"rank a node, 1 thread; against one rank alone on node n1. {results['when']}, "
             f"rounds: {results['rounds']}, medians. Command: `{results['command']}`.", ""]
    for name, mres in results["models"].items():
        base = mres["1x1"]
        lines += [f"**{name}** ({mres['params'] / 1e6:.1f}M parameters, {mres['grad_mb']:.0f} MB of fp32 gradients, "
                  f"micro-batch {mres['micro']} x seq {mres['seq']} a rank; buckets of {results['bucket_mb']} MiB "
                  f"for overlap): one node alone {base:,.0f} tokens/s, {mres['step_1x1_s']:.3f} s a step"
                  + (f"; two ranks alone at once, one a node, nothing exchanged: {pair:,.0f} tokens/s "
                     f"({pair / (2 * base):.2f} of twice one alone: what the box's shared caches and memory "
                     f"take when both cores compute)" if (pair := mres.get('2 alone')) else "") + ".", "",
                  "| link | variant | tokens/s (2 nodes) | scaling efficiency (rounds' range) | of two alone at once | step (s) | "
                  "exposed per step (s) | wire bytes/step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        rows = [(rate, tag, r) for rate, per in mres["2x1"].items() for tag, r in per.items()]
        every = [x for x in rows if diloco_of(x[1]) is None]
        local = [x for x in rows if diloco_of(x[1]) is not None]
        if not every:
            lines = lines[:-2]
        for rate, tag, r in every:
            if not r.get("tokens_per_sec"):
                lines.append(f"| {rate} | {tag} | failed (rc {r.get('rc')}) | | | | | |")
                continue
            lines.append(f"| {rate} | {tag} | {_shared_cells(r, base, mres)} | {r.get('wire_bytes_per_step') or 0:,} |")
        if local:
            lines += [""] if lines[-1] else []
            lines += ["DiLoCo (`distributed.sync: diloco`, each node a replica; H inner steps a round, F fragments, "
                      "each exchange overlapped with T inner steps): the timed window is a whole number of periods "
                      "H / F after a warm-up of whole periods (at least T steps), a metrics line every period, the "
                      "run's last step (the whole model synchronised) after the window; outer bytes: what rank 0 sent per round of H steps; wait: the ranks' mean time "
                      "waiting for the link per exchange (metrics.jsonl's `outer_wait_s`).", "",
                      "| link | variant | H | F | T | outer dtype | timed steps | tokens/s (2 nodes) | scaling efficiency "
                      "(rounds' range) | of two alone at once | step (s) | exposed per step (s) | outer bytes per round | "
                      "wait per exchange (s) |", "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for rate, tag, r in local:
                k = diloco_of(tag)
                head = f"| {rate} | {tag} | {k['H']} | {k['F']} | {k['T']} | {k['dtype']} | {r.get('timed_steps', '')} |"
                if not r.get("tokens_per_sec"):
                    lines.append(f"{head} failed (rc {r.get('rc')}) | | | | | | |")
                    continue
                per_round = (f"{r['outer_bytes'] * k['H'] / r['timed_steps']:,.0f}" if r.get("outer_bytes") else "")
                wait = f"{r['outer_wait_s']:.3f}" if r.get("outer_wait_s") is not None else ""
                lines.append(f"{head} {_shared_cells(r, base, mres)} | {per_round} | {wait} |")
        lines.append("")
    lines += [END]
    return "\n".join(lines)


def _shared_cells(r: dict, base: float, mres: dict) -> str:
    """tokens/s, scaling efficiency, of two alone at once, step and exposed per step: a 2-node row's cells."""
    of_pair = f"{r['tokens_per_sec'] / pair:.3f}" if (pair := mres.get("2 alone")) else ""
    each = r.get("all_tokens_per_sec") or []
    spread = f" ({min(each) / (2 * base):.3f}-{max(each) / (2 * base):.3f})" if len(each) > 1 else ""
    return (f"{r['tokens_per_sec']:,.0f} | {r['tokens_per_sec'] / (2 * base):.3f}{spread} | {of_pair} | {r['step_s']:.3f} | "
            f"{r['step_s'] - mres['step_1x1_s']:+.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mid,gpt2-124m")
    ap.add_argument("--rates", default="off,10gbit,1gbit", help="tc tbf rates (1gbit, 100mbit, ...) or off")
    ap.add_argument("--variants", help="comma-separated variants: names of VARIANTS or diloco-hH[-fF][-oT][-bf16] "
                    "(default: VARIANTS and diloco-h10; for 124M those of MODEL_VARIANTS)")
    ap.add_argument("--micro-batch", help="micro-batch a rank: N for every model, or model=N pairs "
                    f"(default {','.join(f'{k}={v}' for k, v in MICRO.items())})")
    ap.add_argument("--steps", help="WARM-UP:TIMED steps a run: for every model, or model=W:T pairs (default "
                    f"{','.join(f'{k}={w}:{t}' for k, (w, t) in STEPS.items())}; other models 3:8; DiLoCo "
                    "variants round the window up to whole periods, see above)")
    ap.add_argument("--rounds", help="rounds a model: N for every model, or model=N pairs (default "
                    f"{','.join(f'{k}={v}' for k, v in ROUNDS.items())}; other models 1)")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--data", help="token dataset with a 1024 vocabulary (default: data/stdlib/train, else built)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-cluster"))
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="print the section, leave --output alone")
    args = ap.parse_args()
    micro_of = per_model(args.micro_batch, MICRO, int)
    steps_by = per_model(args.steps, STEPS, steps_of)
    rounds_of = per_model(args.rounds, ROUNDS, int)
    for tag in (args.variants or "").split(","):
        if tag:
            diloco_of(tag)           # an unknown name refused before the cluster is made
    if os.geteuid() != 0:
        print("bench-cluster: the pretend cluster needs root (network namespaces)", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    data = args.data or _dataset(work)
    results = {"machine": common.machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "rounds": ", ".join(f"{k} {rounds_of.get(k, 1)}" for k in args.models.split(",")), "bucket_mb": args.bucket_mb, "models": {},
               "command": "make bench-cluster" if len(sys.argv) == 1 else "scripts/bench/cluster.py "
               + " ".join(sys.argv[1:])}
    cluster("up", "2")
    try:
        for name in args.models.split(","):
            m = common.MODELS[name]
            warmup, steps = steps_by.get(name, (3, 8))
            micro = micro_of.get(name, 4)
            graphs = variants.prepare(work, m, micro, data)
            raw: dict = {"1x1": [], "2x1": {}}
            tags = args.variants.split(",") if args.variants else MODEL_VARIANTS.get(name, DEFAULT_VARIANTS)
            for rnd in range(rounds_of.get(name, 1)):
                cluster("rate", "off")
                r = one_run(work, m, graphs, data, f"1x1-r{rnd}", 1, [], warmup, steps, micro, args.bucket_mb)
                print(f"{name} 1x1 round {rnd}: {r['tokens_per_sec']} tokens/s", flush=True)
                raw["1x1"].append(r)
                r = pair_run(work, m, graphs, data, f"2-alone-r{rnd}", warmup, steps, micro)
                print(f"{name} two alone at once round {rnd}: {r['tokens_per_sec']} tokens/s", flush=True)
                raw.setdefault("2 alone", []).append(r)
                for rate in args.rates.split(","):
                    cluster("rate", rate)
                    for tag in tags:
                        warm, timed, length, log_every = window(tag, warmup, steps)
                        r = one_run(work, m, graphs, data, f"{rate}-{tag}-r{rnd}", 2, variant_sets(tag), warm, timed,
                                    micro, args.bucket_mb, length, log_every)
                        print(f"{name} {rate} {tag} round {rnd}: {r['tokens_per_sec']} tokens/s "
                              f"(buckets {r.get('grad_buckets')}"
                              + (f", {r['outer_steps']} exchanges in {r['timed_steps']} timed steps, waiting "
                                 f"{r['outer_wait_s']:.3f} s each" if r.get("outer_steps") else "") + ")", flush=True)
                        raw["2x1"].setdefault(rate, {}).setdefault(tag, []).append(r)
            tps_step = micro * m.seq_len
            base = statistics.median(r["tokens_per_sec"] for r in raw["1x1"] if r["tokens_per_sec"])
            both = [r["tokens_per_sec"] for r in raw.get("2 alone", []) if r["tokens_per_sec"]]
            pair = statistics.median(both) if both else None
            per_rate = {}
            for rate, per in raw["2x1"].items():
                per_rate[rate] = {}
                for tag, rs in per.items():
                    ok = [r["tokens_per_sec"] for r in rs if r["tokens_per_sec"]]
                    best = dict(rs[-1])
                    best["tokens_per_sec"] = statistics.median(ok) if ok else None
                    waits = [r["outer_wait_s"] for r in rs if r.get("outer_wait_s") is not None]
                    if waits:
                        best["outer_wait_s"] = statistics.median(waits)
                    best["all_tokens_per_sec"] = ok
                    if ok:
                        best["step_s"] = 2 * tps_step / best["tokens_per_sec"]
                    per_rate[rate][tag] = best
            results["models"][name] = {"params": m.params(), "grad_mb": 4 * m.params() / 1e6, "micro": micro,
                                       "seq": m.seq_len, "1x1": base, "step_1x1_s": tps_step / base,
                                       "2 alone": pair,
                                       "all_1x1": [r["tokens_per_sec"] for r in raw["1x1"]], "2x1": per_rate,
                                       "raw": raw}
            common.write_json(work / "cluster.json", results)
    finally:
        cluster("down")
    text = render(results)
    print(text)
    if not args.no_write:
        common.write_section(args.output, text, BEGIN, END, HEADING)
    return 0


def _dataset(work: Path) -> str:
    shared = ROOT / "data" / "stdlib" / "train"
    if (shared / "manifest.json").exists() and json.loads((shared / "manifest.json").read_text()).get("vocab_size") == 1024:
        return str(shared)
    out = work / "data"
    if not (out / "train" / "manifest.json").exists():
        import sysconfig
        rc = sh([str(BIN / "trainrun-data"), "tokens", "--input", sysconfig.get_paths()["stdlib"], "--output", str(out),
                 "--train-bpe", "1024", "--include", "*.py", "--no-progress", "--overwrite"], work / "logs" / "data.log")
        if rc:
            raise SystemExit(f"bench-cluster: building the dataset failed (see {work / 'logs' / 'data.log'})")
    return str(out / "train")


if __name__ == "__main__":
    sys.exit(main())
