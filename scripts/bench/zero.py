"""ZeRO-1 against stage 0, side by side in one run: peak RSS per rank and steady step time.

    .venv/bin/python scripts/bench/zero.py [--work runs/bench-zero] [--layers 12 --embd 768 --heads 12
        --seq 256 --vocab 50257 --micro-batch 2] [--warmup 3 --steps 6] [--rounds 1] [--ranks 2]
        [--intra-node mpi,shared]

Each stage runs with each ``distributed.intra_node`` of ``--intra-node`` (mpi: every rank its own
parameters, gradients allreduced over MPI; shared: one parameter copy per node, gradients summed from the
peers' shared buffers). Peak RSS counts shared pages in every rank that touches them.

GPT-2 124M by default (12 x 768, vocab 50257, seq 256, micro-batch 2 per rank), AdamW, ``--ranks`` ranks x
1 thread, the trainrun CLI (scripts/bench/trainrun_rank.py: the rank's peak RSS at exit and before its
first checkpoint). The graphs are prepared once and hard-linked into every run. Stage 0 and stage 1 run
alternately (``--rounds`` times each), so machine load hits both alike. Per run: the median step time of
the steps after ``--warmup`` (from metrics.jsonl, log_every 1) and the median ``phase_ms`` of those
steps; per rank: peak RSS of the training steps (before the end-of-run checkpoint) and of the whole run
(the checkpoint snapshot and, on rank 0, the export included). Writes WORK/zero.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BIN = common.BIN


def sh(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench-zero"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--intra-node", default="mpi", help="comma-separated distributed.intra_node values")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    m = common.BenchModel("zero", n_layer=a.layers, n_head=a.heads, n_embd=a.embd, seq_len=a.seq,
                          vocab_size=a.vocab, global_batch=a.micro_batch * a.ranks, warmup=a.warmup,
                          steps=a.steps, quick_steps=a.steps)

    data = work / "data"
    if not (data / "train").exists():     # raw bytes of the repo's own sources: token ids < any vocab
        sh([BIN / "trainrun-data", "tokens", "--input", common.ROOT / "trainrun", "--input", common.ROOT / "tests",
            "--output", data, "--bytes", "--eval-fraction", "0", "--no-progress"])
    base = common.run_sets(m, work / "prep", str(data / "train"), a.micro_batch, threads=1, warmup=a.warmup,
                           steps=a.steps) + ["train.log_every=1", f"optimizer.name={a.optimizer}"]
    sets = lambda extra: [x for s in base + extra for x in ("--set", s)]  # noqa: E731
    prep = work / "prep"
    if not (prep / "graphs" / "manifest.json").exists():
        sh([BIN / "trainrun", "prepare", "--config", common.CONFIG, *sets([])])

    results = []
    for rnd in range(a.rounds):
        for stage, intra in [(s, i) for s in (0, 1) for i in a.intra_node.split(",")]:
            out = work / f"stage{stage}-{intra}-r{rnd}"
            shutil.rmtree(out, ignore_errors=True)
            (out / "graphs").mkdir(parents=True)
            for f in (prep / "graphs").iterdir():        # the prepared graphs, hard-linked (no copy)
                os.link(f, out / "graphs" / f.name)
            rss = out / "rss"
            sh([BIN / "mpirun", "-np", a.ranks, sys.executable, common.HERE / "trainrun_rank.py", "--rss-dir", rss,
                "--", "train", "--config", common.CONFIG,
                *sets([f"run.output_dir={out}", f"distributed.zero_stage={stage}",
                       f"distributed.intra_node={intra}"])])
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steady = [r for r in rows if "loss" in r and r["step"] > a.warmup]
            step_s = statistics.median(m.tokens_per_step() / r["tokens_per_sec"] for r in steady)
            phases = sorted({k for r in steady for k in r.get("phase_ms", {})})
            phase_ms = {k: statistics.median(r["phase_ms"].get(k, 0.0) for r in steady) for k in phases}
            ranks = [json.loads((rss / f"rss-{r}.json").read_text()) for r in range(a.ranks)]
            results.append({"stage": stage, "intra_node": intra, "round": rnd, "step_s": step_s, "phase_ms": phase_ms,
                            "tokens_per_sec": m.tokens_per_step() / step_s,
                            "final_loss": steady[-1]["loss"], "ranks": ranks})
            shutil.rmtree(out / "checkpoints", ignore_errors=True)   # GBs at 124M
            (out / "model.onnx").unlink(missing_ok=True)
    report = {"machine": common.machine(), "model": common.asdict_model(m), "parameters": m.params(),
              "ranks": a.ranks, "threads_per_rank": 1, "optimizer": a.optimizer, "runs": results}
    common.write_json(work / "zero.json", report)

    print(f"\nGPT-2 {a.layers} x {a.embd}, vocab {a.vocab}, seq {a.seq}, micro-batch {a.micro_batch}, "
          f"{m.params() / 1e6:.1f}M parameters, {a.optimizer}, {a.ranks} ranks x 1 thread, "
          f"{report['machine'].get('cpu', '?')}")
    print("| stage | intra_node | round | step s | tokens/s | non-fwd/bwd ms | phases ms | peak RSS MB per rank: "
          "training (whole run) | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        other = sum(v for k, v in r["phase_ms"].items() if k != "forward_backward")
        ph = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["phase_ms"].items(), key=lambda kv: -kv[1]))
        mem = ", ".join(f"{x.get('train_peak_rss_mb', float('nan')):.0f} ({x['peak_rss_mb']:.0f})" for x in r["ranks"])
        print(f"| {r['stage']} | {r['intra_node']} | {r['round']} | {r['step_s']:.3f} | {r['tokens_per_sec']:.0f} | {other:.0f} | {ph} | "
              f"{mem} | {r['final_loss']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
