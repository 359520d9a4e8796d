"""What a logged step costs: the ``log`` phase of a real run with ``train.log_every: 1``.

Trains a small GPT-2 (1 rank, 1 thread, 3 layers, d 48) for ``--steps`` steps,
logging every step to the console, metrics.jsonl and TensorBoard, and reads the
per-phase totals the runner writes to ``summary.json``. Repeats ``--rounds``
times and prints the median ms per step of the log phase and of the whole step.

    python scripts/bench_log.py [--steps 400] [--rounds 3] [--trainrun PATH]

The dataset is built once under ``--work`` from generated text (no network,
no dependence on the running Python's files).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys

BIN = os.path.dirname(sys.executable)

CONFIG = """run: {{name: bench-log, output_dir: {run}, seed: 1, log_level: info}}
model:
  builtin: gpt2
  gpt2: {{n_layer: 3, n_head: 4, n_embd: 48, n_positions: 64, vocab_size: 512, dropout: 0.0}}
data: {{train: {data}/train, eval: null, seq_len: 64}}
train: {{micro_batch_size: 4, max_steps: {steps}, log_every: 1}}
checkpoint: {{every: 0}}
engine: {{threads: 1}}
"""


def make_data(work: str) -> str:
    data = os.path.join(work, "data")
    if os.path.exists(os.path.join(data, "train", "manifest.json")):
        return data
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(2000)]
    text_dir = os.path.join(work, "text")
    os.makedirs(text_dir, exist_ok=True)
    for d in range(40):
        with open(os.path.join(text_dir, f"doc{d}.txt"), "w") as fh:
            fh.write(" ".join(rng.choice(words) for _ in range(5000)))
    subprocess.run([os.path.join(BIN, "trainrun-data"), "tokens", "--input", text_dir, "--output", data,
                    "--train-bpe", "512", "--eval-fraction", "0.05"], check=True, capture_output=True)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default="/tmp/trainrun-bench-log")
    ap.add_argument("--trainrun", default=os.path.join(BIN, "trainrun"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    data = make_data(a.work)
    run = os.path.join(a.work, "run")
    cfg = os.path.join(a.work, "config.yaml")
    with open(cfg, "w") as fh:
        fh.write(CONFIG.format(run=run, data=data, steps=a.steps))
    log_ms, step_ms = [], []
    for _ in range(a.rounds):
        shutil.rmtree(run, ignore_errors=True)
        subprocess.run([a.trainrun, "--config", cfg], check=True, capture_output=True)
        with open(os.path.join(run, "summary.json")) as fh:
            s = json.load(fh)
        per_step = s["time_s"] / s["steps"] * 1e3
        step_ms.append(per_step)
        log_ms.append(s["phase_shares"].get("log", 0.0) * per_step)
    print(f"log phase: median {statistics.median(log_ms):.3f} ms per logged step "
          f"({', '.join(f'{x:.3f}' for x in log_ms)}); step: median {statistics.median(step_ms):.2f} ms; "
          f"log share {statistics.median(log_ms) / statistics.median(step_ms):.1%}")


if __name__ == "__main__":
    main()
