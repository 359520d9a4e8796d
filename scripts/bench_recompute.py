"""Activation recomputation (train.recompute): peak memory and time per token by micro-batch, with and
without, side by side.

Each (mode, micro-batch) runs in its own process: prepare the graphs, open the engine (parameters,
gradients and Adam's two moments allocated and touched, as a training rank holds them), one warm-up
forward/backward, then ``--steps`` timed ones on random tokens. Reported: the process's peak RSS, the
median time per step and per token, and the largest micro-batch whose peak stays under ``--cap-gb``.

The issue's target (GPT-2 124M, seq 1024, 6 GB per rank; the defaults):
    .venv/bin/python scripts/bench_recompute.py --batches 1,2,4,6,8,12,16 --cap-gb 6
A smaller one for a loaded 2-core machine:
    .venv/bin/python scripts/bench_recompute.py --n-layer 6 --n-embd 384 --n-head 6 --seq 512 \\
        --vocab 8192 --batches 1,2,4,8 --cap-gb 1.5 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, resource, sys, time
import numpy as np
from trainrun import config as C, graphs as G
from trainrun.engine import Engine, EngineOptions
a = json.loads(sys.argv[1])
B, S = a["batch"], a["seq"]
cfg = C.from_dict({"model": {"gpt2": {"n_layer": a["n_layer"], "n_head": a["n_head"], "n_embd": a["n_embd"],
                   "n_positions": S, "vocab_size": a["vocab"], "dropout": 0.0}}, "data": {"seq_len": S},
                   "train": {"micro_batch_size": B, "recompute": a["mode"]}, "run": {"output_dir": a["out"]}})
shapes = {"input_ids": ((B, S), np.int64), "labels": ((B, S), np.int64)}
eng = Engine(G.prepare(cfg), EngineOptions(threads=a["threads"]), shapes, shapes)
eng.load_weights()
moments = [np.ones(eng.params.size, np.float32) for _ in range(2)]      # Adam's m and v, touched
rng = np.random.default_rng(0)
batch = {k: rng.integers(0, a["vocab"], (B, S)) for k in shapes}
eng.forward_backward(batch, accumulate=False)
times = []
for _ in range(a["steps"]):
    t = time.perf_counter()
    eng.forward_backward(batch, accumulate=False)
    times.append(time.perf_counter() - t)
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "step_s": float(np.median(times))}))
"""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--modes", default="none,blocks")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cap-gb", type=float, default=6.0)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per (mode, micro-batch)")
    args = ap.parse_args()

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as out:
                spec = {"mode": mode, "batch": batch, "seq": args.seq, "n_layer": args.n_layer,
                        "n_embd": args.n_embd, "n_head": args.n_head, "vocab": args.vocab,
                        "threads": args.threads, "steps": args.steps, "out": out}
                res = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True,
                                     text=True, timeout=args.timeout)
            if res.returncode != 0:     # e.g. killed for memory: recorded, the sweep goes on
                rows.append((mode, batch, None, None))
                print(f"{mode} b={batch}: failed ({res.returncode}): {res.stderr.strip()[-300:]}", file=sys.stderr)
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append((mode, batch, r["peak_mb"], r["step_s"]))
            print(f"{mode} b={batch}: peak {r['peak_mb']:.0f} MB, {r['step_s']:.2f} s/step", file=sys.stderr)

    print(f"GPT-2 {args.n_layer} layers, d {args.n_embd}, {args.n_head} heads, vocab {args.vocab}, seq {args.seq}; "
          f"{args.threads} threads; CPU: {cpu_model()}; median of {args.steps} forward/backward steps\n")
    print("| micro-batch | recompute | peak RSS (MB) | s/step | ms/token | time/token vs none |")
    print("|---|---|---|---|---|---|")
    base = {b: s for m, b, _, s in rows if m == "none" and s}
    for mode, batch, peak, step in rows:
        if peak is None:
            print(f"| {batch} | {mode} | failed | | | |")
            continue
        ratio = f"{step / base[batch]:.2f}x" if batch in base else ""
        print(f"| {batch} | {mode} | {peak:.0f} | {step:.2f} | {1000 * step / (batch * args.seq):.3f} | {ratio} |")
    cap = args.cap_gb * 1024
    largest = {m: max([b for mm, b, p, _ in rows if mm == m and p is not None and p <= cap], default=0)
               for m in args.modes.split(",")}
    print(f"\nlargest micro-batch under {args.cap_gb:g} GB: " + ", ".join(f"{m} {b}" for m, b in largest.items()))


if __name__ == "__main__":
    main()
