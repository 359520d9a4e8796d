"""The loss curve with bf16 gradients on the wire against fp32 (``distributed.reduce_dtype``), with the float32
noise floor beside it.

    .venv/bin/python scripts/bench/wire_bf16.py --data data/stdlib [--steps 1000] [--work runs/bench-wire]

configs/gpt2-tiny.yaml (0.55M parameters, seq 128, micro-batch 8 per rank, AdamW, cosine) on 2 ranks x 1
thread, each rank a node of its own (``TRAINRUN_RANKS_PER_NODE=1``: the gradients go through the inter-rank
path, the one reduce_dtype changes), three runs of ``--steps`` steps from the same initial weights and data:

* ``fp32``: the reference;
* ``bf16``: ``distributed.reduce_dtype: bf16``;
* ``fp32-1x16``: fp32 on ONE rank with one micro-batch of 16 (the same global batch and samples): the same
  training with the batch's gradients summed in another order inside the graph's matmuls, a float32-rounding
  perturbation. Its distance from ``fp32`` is the floor any perturbation reaches once training's chaos
  amplifies it. (One rank accumulating 2 micro-batches of 8 gives fp32's bits exactly: a + b on 2 ranks.)

A run whose summary.json shows ``--steps`` steps done is reused.

With ``--allreduce SIZES`` (run under mpirun, e.g. across the pretend cluster's nodes at a link rate), it
times instead ``trainrun.wire``'s fp32 and bf16 allreduce of float32 buffers of those sizes (e.g. 11.2M, the
mid model's gradients), interleaved, medians of ``--iters``:

    scripts/cluster/cluster.sh up 2 && scripts/cluster/cluster.sh rate 1gbit
    scripts/cluster/cluster.sh mpirun -hosts n1,n2 -ppn 1 -np 2 .venv/bin/python \
        scripts/bench/wire_bf16.py --allreduce 11.2M

Per run: loss every step, eval loss at every 250 steps and the end, ``wire_bytes_per_step``. Printed: the
largest per-step and the mean |loss difference| against fp32, of raw losses and of 50-step window means, the
eval losses. Writes WORK/wire_bf16.json and a markdown table for BENCHMARKS.md's by-hand section.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "gpt2-tiny.yaml"
WINDOW = 50


def train(work: Path, name: str, data: str, steps: int, ranks: int, sets: list[str]) -> dict:
    out = work / name
    done = out / "summary.json"
    if not (done.exists() and json.load(open(done)).get("final_step") == steps):
        run_trainrun(out, data, steps, ranks, sets)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    summary = json.load(open(out / "summary.json"))
    return {"loss": [loss[s] for s in range(1, steps + 1)], "eval": evals,
            "wire_bytes_per_step": summary["wire_bytes_per_step"], "tokens_per_sec": summary.get("tokens_per_sec")}


def run_trainrun(out: Path, data: str, steps: int, ranks: int, sets: list[str]) -> None:
    cmd = [str(BIN / "mpirun"), "-np", str(ranks), str(BIN / "trainrun"), "--config", str(CONFIG),
           "--set", f"run.output_dir={out}", "--set", f"data.train={data}/train", "--set", f"data.eval={data}/eval",
           "--set", f"train.max_steps={steps}", "--set", "train.log_every=1", "--set", "train.eval_every=250",
           "--set", "checkpoint.every=0", "--set", "tensorboard.enabled=false", "--set", "engine.threads=1"]
    for s in sets:
        cmd += ["--set", s]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, TRAINRUN_RANKS_PER_NODE="1"))


def windows(x: np.ndarray) -> np.ndarray:
    n = len(x) // WINDOW * WINDOW
    return x[:n].reshape(-1, WINDOW).mean(axis=1)


def time_allreduce(sizes: list[int], iters: int) -> None:
    """Under mpirun: fp32 and bf16 allreduce_ of each size, interleaved; rank 0 prints medians."""
    import time

    sys.path.insert(0, str(ROOT))
    from trainrun import wire
    from trainrun.comm import make_communicator

    comm = make_communicator("mpi", timeout_s=600)
    reducers = {d: wire.make(comm, d) for d in wire.REDUCE_DTYPES}
    for n in sizes:
        buf = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        times = {d: [] for d in reducers}
        for i in range(iters + 1):
            for d, r in reducers.items():
                comm.barrier()
                t = time.perf_counter()
                r.allreduce_(buf)
                if i:       # the first round warms up (the compiled rounding, the scratch buffers)
                    times[d].append(time.perf_counter() - t)
                buf[...] = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        if comm.rank == 0:
            med = {d: float(np.median(v)) for d, v in times.items()}
            sent = {d: r.sent_bytes // (iters + 1) for d, r in reducers.items()}
            print(f"{comm.world_size} ranks, {n:,} floats: " + ", ".join(
                f"{d} {1e3 * med[d]:.1f} ms ({sent[d]:,} bytes sent)" for d in med)
                + f"; bf16/fp32 time {med['bf16'] / med['fp32']:.2f}", flush=True)
        for r in reducers.values():
            r.sent_bytes = 0
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="a trainrun-data tokens directory (train/ and eval/) of vocab 1024")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-wire"))
    ap.add_argument("--allreduce", help="comma-separated buffer sizes (K/M suffixes): time the allreduce only")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if args.allreduce:
        scale = {"K": 10**3, "M": 10**6}
        time_allreduce([int(float(x[:-1]) * scale[x[-1]]) if x[-1] in scale else int(x)
                        for x in args.allreduce.split(",")], args.iters)
        return
    if not args.data:
        ap.error("--data is required for the loss curves")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = str(Path(args.data).resolve())
    runs = {
        "fp32": train(work, "fp32", data, args.steps, 2, ["distributed.reduce_dtype=fp32"]),
        "bf16": train(work, "bf16", data, args.steps, 2, ["distributed.reduce_dtype=bf16"]),
        "fp32-1x16": train(work, "fp32-1x16", data, args.steps, 1, ["train.micro_batch_size=16"]),
    }
    ref = np.array(runs["fp32"]["loss"])
    rows = []
    for name in ("bf16", "fp32-1x16"):
        x = np.array(runs[name]["loss"])
        d, dw = np.abs(x - ref), np.abs(windows(x) - windows(ref))
        rows.append({"run": name, "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                     "first_step_differing": int(np.argmax(d > 0)) + 1 if d.any() else None,
                     "window_max_abs_diff": float(dw.max()), "window_max_rel_diff": float((dw / windows(ref)).max()),
                     "final_eval": runs[name]["eval"].get(args.steps),
                     "wire_bytes_per_step": runs[name]["wire_bytes_per_step"]})
    result = {"steps": args.steps, "cpu": common.cpu_name(), "runs": runs, "vs_fp32": rows,
              "fp32_final_eval": runs["fp32"]["eval"].get(args.steps),
              "fp32_wire_bytes_per_step": runs["fp32"]["wire_bytes_per_step"],
              "loss_first_window": float(windows(ref)[0]), "loss_last_window": float(windows(ref)[-1])}
    with open(work / "wire_bf16.json", "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\nCPU: {result['cpu']}; {args.steps} steps; fp32 loss {result['loss_first_window']:.3f} (first "
          f"{WINDOW}-step mean) -> {result['loss_last_window']:.3f} (last), final eval "
          f"{result['fp32_final_eval']:.4f}, {result['fp32_wire_bytes_per_step']:,} wire bytes/step\n")
    print(f"| against fp32 | max abs diff, per step | mean abs diff | max abs diff of {WINDOW}-step means "
          f"(relative) | final eval loss | wire bytes per step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['max_abs_diff']:.4f} | {r['mean_abs_diff']:.4f} | {r['window_max_abs_diff']:.4f} "
              f"({100 * r['window_max_rel_diff']:.2f}%) | {r['final_eval']:.4f} | {r['wire_bytes_per_step']:,} |")


if __name__ == "__main__":
    main()
