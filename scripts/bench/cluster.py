"""Scaling over a slow link (``make bench-cluster``): GPT-2 trained on 2 pretend nodes of one core
each (scripts/cluster/cluster.sh, root), one rank a node, at several link rates, against the same model on
one node alone; side by side in one run, the variants alternated within each round.

    .venv/bin/python scripts/bench/cluster.py [--models mid,gpt2-124m] [--rates off,10gbit,1gbit]
        [--rounds 3] [--data DIR] [--work runs/bench-cluster] [--output BENCHMARKS.md]

Per model (scripts/bench/common.py's shapes; micro-batch ``--micro-batch``, default 4 for mid, 2 for 124M, a
rank): one run on n1 alone (``1x1``), then at every rate each variant on n1 + n2 (``2x1``):

* ``fp32``          one allreduce after the backward pass (the behaviour before overlap_grad_reduce);
* ``fp32-overlap``  ``distributed.overlap_grad_reduce: true`` (buckets of ``--bucket-mb``);
* ``bf16``          ``distributed.reduce_dtype: bf16``, one reduction after the backward pass;
* ``bf16-overlap``  both;
* ``diloco-h10``    ``distributed.sync: diloco``, an outer step every 10 steps (and at the last): nothing
                    crosses the link between two outer steps (wire bytes/step 0: the replicas' reduction
                    has one rank).

Scaling efficiency = tokens/s on 2 nodes / (2 x tokens/s on one node); tokens/s over the steps after the
warm-up (metrics.jsonl's ``elapsed_s``), the median over rounds. ``exposed`` = the step time on 2 nodes minus
the step time alone: what the reduction (and the wire's CPU work on the node's one core) adds to a step.
Writes WORK/cluster.json and the tables between ``<!-- bench-cluster: begin/end -->`` of ``--output``
(appended under HEADING where the file has no such markers).
"""

from __future__ import annotations

import argparse
import json
import os
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
    # each node a replica of its own; the timed window of mid (steps 4-15) holds the outer steps of 10 and 15
    "diloco-h10": ["distributed.sync=diloco", "distributed.diloco.inner_steps=10"],
}
MODEL_VARIANTS = {"gpt2-124m": ["fp32", "fp32-overlap", "bf16-overlap", "diloco-h10"]}   # default: all of VARIANTS
STEPS = {"mid": (3, 12), "gpt2-124m": (2, 4)}          # (warm-up, timed) steps per run
MICRO = {"mid": 4, "gpt2-124m": 2}


def sh(args: list[str], log: Path, timeout: float = 1800) -> int:
    with open(log, "w") as fh:
        return subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout).returncode


def cluster(*args: str) -> None:
    subprocess.run([str(CLUSTER), *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def tokens_per_sec(run: Path, warmup: int, tokens_per_step: int) -> float | None:
    try:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except OSError:
        return None
    rows = [r for r in rows if "elapsed_s" in r and "step" in r]
    first = next((r for r in rows if r["step"] == warmup), None)
    if first is None or rows[-1]["step"] <= warmup:
        return None
    last = rows[-1]
    return (last["step"] - first["step"]) * tokens_per_step / (last["elapsed_s"] - first["elapsed_s"])


def one_run(work: Path, m: common.BenchModel, graphs: Path, data: str, tag: str, nodes: int, sets: list[str],
            warmup: int, steps: int, micro: int, bucket_mb: float) -> dict:
    d = work / "runs" / m.name / tag
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    shutil.copytree(graphs, d / "graphs")
    all_sets = common.run_sets(m, d, data, micro, 1, warmup, steps) + [
        "train.log_every=1", f"distributed.bucket_mb={bucket_mb}", *sets]
    argv = [str(BIN / "trainrun"), "--config", str(common.CONFIG)] + [x for s in all_sets for x in ("--set", s)]
    hosts = ",".join(f"n{i + 1}" for i in range(nodes))
    cmd = [str(CLUSTER), "mpirun", "-hosts", hosts, "-ppn", "1", "-np", str(nodes), *argv]
    t0 = time.monotonic()
    rc = sh(cmd, work / "logs" / f"{m.name}-{tag}.log")
    out = {"tag": tag, "rc": rc, "wall_s": round(time.monotonic() - t0, 2),
           "cmd": f"cluster.sh mpirun -hosts {hosts} -ppn 1 -np {nodes} trainrun ... "
                  + " ".join(f"--set {s}" for s in sets)}
    tps = tokens_per_sec(d, warmup, micro * nodes * m.seq_len)
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
             f"{results['rounds']} round(s), medians. Command: `{results['command']}`.", ""]
    for name, mres in results["models"].items():
        base = mres["1x1"]
        lines += [f"**{name}** ({mres['params'] / 1e6:.1f}M parameters, {mres['grad_mb']:.0f} MB of fp32 gradients, "
                  f"micro-batch {mres['micro']} x seq {mres['seq']} a rank; buckets of {results['bucket_mb']} MiB "
                  f"for overlap): one node alone {base:,.0f} tokens/s, {mres['step_1x1_s']:.3f} s a step"
                  + (f"; two ranks alone at once, one a node, nothing exchanged: {pair:,.0f} tokens/s "
                     f"({pair / (2 * base):.2f} of twice one alone: what the box's shared caches and memory "
                     f"take when both cores compute)" if (pair := mres.get('2 alone')) else "") + ".", "",
                  "| link | variant | tokens/s (2 nodes) | scaling efficiency | of two alone at once | step (s) | "
                  "exposed per step (s) | wire bytes/step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for rate, per in mres["2x1"].items():
            for tag, r in per.items():
                if not r.get("tokens_per_sec"):
                    lines.append(f"| {rate} | {tag} | failed (rc {r.get('rc')}) | | | | | |")
                    continue
                eff = r["tokens_per_sec"] / (2 * base)
                of_pair = f"{r['tokens_per_sec'] / pair:.2f}" if (pair := mres.get("2 alone")) else ""
                lines.append(f"| {rate} | {tag} | {r['tokens_per_sec']:,.0f} | {eff:.2f} | {of_pair} | "
                             f"{r['step_s']:.3f} | {r['step_s'] - mres['step_1x1_s']:+.3f} | "
                             f"{r.get('wire_bytes_per_step') or 0:,} |")
        lines.append("")
    lines += [END]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN in doc and END in doc:
        doc = doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + f"\n\n{HEADING}\n\n{text}\n"
    path.write_text(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mid,gpt2-124m")
    ap.add_argument("--rates", default="off,10gbit,1gbit")
    ap.add_argument("--variants", help="comma-separated names of VARIANTS (default: all of them; for 124M "
                    "those of MODEL_VARIANTS)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of mid (124M: one)")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--data", help="token dataset with a 1024 vocabulary (default: data/stdlib/train, else built)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-cluster"))
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="print the section, leave --output alone")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench-cluster: the pretend cluster needs root (network namespaces)", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    data = args.data or _dataset(work)
    results = {"machine": common.machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "rounds": f"{args.rounds} (124M: 1)", "bucket_mb": args.bucket_mb, "models": {},
               "command": "make bench-cluster" if len(sys.argv) == 1 else "scripts/bench/cluster.py "
               + " ".join(sys.argv[1:])}
    cluster("up", "2")
    try:
        for name in args.models.split(","):
            m = common.MODELS[name]
            warmup, steps = STEPS.get(name, (3, 8))
            micro = MICRO.get(name, 4)
            graphs = variants.prepare(work, m, micro, data)
            raw: dict = {"1x1": [], "2x1": {}}
            tags = args.variants.split(",") if args.variants else MODEL_VARIANTS.get(name, list(VARIANTS))
            for rnd in range(args.rounds if name == "mid" else 1):
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
                        r = one_run(work, m, graphs, data, f"{rate}-{tag}-r{rnd}", 2, VARIANTS[tag], warmup, steps,
                                    micro, args.bucket_mb)
                        print(f"{name} {rate} {tag} round {rnd}: {r['tokens_per_sec']} tokens/s "
                              f"(buckets {r.get('grad_buckets')})", flush=True)
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
        write_section(Path(args.output), text)
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
