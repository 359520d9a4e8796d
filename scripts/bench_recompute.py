"""Activation recomputation (train.recompute): peak memory and time per token by micro-batch, with and
without, side by side.

Per micro-batch, one process prepares the graphs of every mode; then each mode trains in its own process:
the engine opened (parameters, gradients and Adam's two moments allocated and touched, as a training
rank holds them), one warm-up forward/backward, then ``--steps`` timed ones on random tokens. Reported:
that process's peak RSS, the median time per step and per token, and the largest micro-batch whose peak
stays under ``--cap-gb``. ``--paired``: the modes also run in one process, steps alternating, so that
on a shared machine both see the same load (its times are the ones to compare there).

The issue's target (GPT-2 124M, seq 1024, 6 GB per rank; the defaults):
    .venv/bin/python scripts/bench_recompute.py --batches 1,2,4,6,8,12,16 --cap-gb 6
A smaller one for a loaded 2-core machine:
    .venv/bin/python scripts/bench_recompute.py --n-layer 6 --n-embd 384 --n-head 6 --seq 512 \\
        --vocab 8192 --batches 1,2,4,8 --cap-gb 1.5 --steps 2 --threads 2 --paired
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import common  # noqa: E402

_PREPARE = r"""
import json, sys
from trainrun import config as C
from trainrun.graphs.manifest import prepare
a = json.loads(sys.argv[1])
for mode in a["modes"]:
    cfg = C.from_dict({"model": {"gpt2": {"n_layer": a["n_layer"], "n_head": a["n_head"], "n_embd": a["n_embd"],
                       "n_positions": a["seq"], "vocab_size": a["vocab"], "dropout": 0.0}},
                       "data": {"seq_len": a["seq"]}, "train": {"micro_batch_size": a["batch"], "recompute": mode},
                       "run": {"output_dir": a["out"] + "/" + mode}})
    prepare(cfg)
"""

# train: the engines of the given modes (graphs prepared by _PREPARE), steps alternating between them
_TRAIN = r"""
import json, resource, sys, time
import numpy as np
from trainrun.engine import Engine, EngineOptions
a = json.loads(sys.argv[1])
B, S = a["batch"], a["seq"]
shapes = {"input_ids": ((B, S), np.int64), "labels": ((B, S), np.int64)}
engines, moments = {}, []
for mode in a["modes"]:
    eng = engines[mode] = Engine(a["out"] + "/" + mode + "/graphs", EngineOptions(threads=a["threads"]), shapes,
                                 shapes)
    eng.load_weights()
    moments += [np.ones(eng.params.size, np.float32) for _ in range(2)]      # Adam's m and v, touched
rng = np.random.default_rng(0)
batch = {k: rng.integers(0, a["vocab"], (B, S)) for k in shapes}
times = {m: [] for m in engines}
cpu = {m: [] for m in engines}       # the process's CPU time: less sensitive than wall time to other jobs
for i in range(a["steps"] + 1):       # the first step of each: warm-up
    for mode, eng in engines.items():
        t, c = time.perf_counter(), time.process_time()
        eng.forward_backward(batch, accumulate=False)
        times[mode].append(time.perf_counter() - t)
        cpu[mode].append(time.process_time() - c)
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "step_s": {m: float(np.median(t[1:])) for m, t in times.items()},
                  "cpu_s": {m: float(np.median(t[1:])) for m, t in cpu.items()}}))
"""


def child(code: str, spec: dict, timeout: int):
    res = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                         timeout=timeout)
    if res.returncode != 0:
        return None, f"exit {res.returncode}: {res.stderr.strip()[-300:]}"
    return json.loads(res.stdout.strip().splitlines()[-1]) if code is _TRAIN else {}, None


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
    ap.add_argument("--paired", action="store_true",
                    help="also time the modes in one process, steps alternating (fair on a shared machine)")
    args = ap.parse_args()

    modes = args.modes.split(",")
    rows, paired = [], {}
    for batch in [int(b) for b in args.batches.split(",")]:
        with tempfile.TemporaryDirectory() as out:
            spec = {"modes": modes, "batch": batch, "seq": args.seq, "n_layer": args.n_layer, "n_embd": args.n_embd,
                    "n_head": args.n_head, "vocab": args.vocab, "threads": args.threads, "steps": args.steps,
                    "out": out}
            _, err = child(_PREPARE, spec, args.timeout)
            for mode in modes:          # the peak of a rank training this mode alone
                r, err = (None, err) if err else child(_TRAIN, {**spec, "modes": [mode]}, args.timeout)
                rows.append((mode, batch, r and r["peak_mb"], r and r["step_s"][mode]))
                print(f"{mode} b={batch}: " + (err or f"peak {r['peak_mb']:.0f} MB, {r['step_s'][mode]:.2f} s/step"),
                      file=sys.stderr)
            if args.paired and not err:   # both in one process, steps alternating: the same load for both
                r, err = child(_TRAIN, spec, args.timeout)
                if r:
                    paired[batch] = r
                print(f"paired b={batch}: {err or r}", file=sys.stderr)

    print(f"GPT-2 {args.n_layer} layers, d {args.n_embd}, {args.n_head} heads, vocab {args.vocab}, seq {args.seq}; "
          f"{args.threads} threads; CPU: {common.cpu_name()}; median of {args.steps} forward/backward steps\n")
    print("| micro-batch | recompute | peak RSS (MB) | s/step | ms/token | time/token vs none |"
          + (" paired s/step | paired vs none | paired CPU s/step | paired CPU vs none |" if paired else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|---|" if paired else ""))
    base = {b: s for m, b, _, s in rows if m == "none" and s}
    for mode, batch, peak, step in rows:
        if peak is None:
            print(f"| {batch} | {mode} | failed | | | |" + (" | | | |" if paired else ""))
            continue
        ratio = f"{step / base[batch]:.2f}x" if batch in base else ""
        line = f"| {batch} | {mode} | {peak:.0f} | {step:.2f} | {1000 * step / (batch * args.seq):.3f} | {ratio} |"
        if paired:
            p = paired.get(batch, {"step_s": {}, "cpu_s": {}})
            for k in ("step_s", "cpu_s"):
                v = p[k]
                line += f" {v[mode]:.2f} | {v[mode] / v['none']:.2f}x |" if mode in v and "none" in v else " | |"
        print(line)
    cap = args.cap_gb * 1024
    largest = {m: max([b for mm, b, p, _ in rows if mm == m and p is not None and p <= cap], default=0)
               for m in args.modes.split(",")}
    print(f"\nlargest micro-batch under {args.cap_gb:g} GB: " + ", ".join(f"{m} {b}" for m, b in largest.items()))


if __name__ == "__main__":
    main()
