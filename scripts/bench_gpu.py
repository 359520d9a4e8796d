"""GPU mode of the benchmark: trainrun (device: cuda, NCCL) against PyTorch DDP with NCCL on the same
shapes, data order, schedule and optimizer (scripts/bench/torch_train.py --device cuda).

NOT YET RUN: written without a GPU at hand; no number in BENCHMARKS.md comes from it. On a GPU host:

    .venv/bin/python scripts/bench_gpu.py --model mid --gpus 1 --data DATA/train [--precision fp16]

prints one JSON line per system (tokens/s, median ms/step) and writes them to --out. trainrun runs its
default path (run.deterministic would drop graph optimisation to basic and use one thread); TF32 is on
for fp32 MatMuls on both sides (onnxruntime's CUDA provider default, use_tf32 1; torch: allow_tf32 True).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "bench"))
import common  # noqa: E402

BIN = Path(sys.executable).parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mid", choices=list(common.MODELS))
    ap.add_argument("--gpus", type=int, default=1, help="ranks, one GPU each")
    ap.add_argument("--data", required=True, help="a trainrun-data train directory")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                    help="trainrun's train.precision (the torch side stays fp32)")
    ap.add_argument("--out", default="bench_gpu.json")
    args = ap.parse_args()
    m = common.MODELS[args.model]
    micro = max(1, m.global_batch // args.gpus)
    steps = m.warmup + m.steps
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    launch = [str(BIN / "mpirun"), "-np", str(args.gpus)] if args.gpus > 1 else []
    sets = {"device": "cuda", "run.output_dir": str(work / "trainrun"),
            "model.gpt2.n_layer": m.n_layer, "model.gpt2.n_head": m.n_head, "model.gpt2.n_embd": m.n_embd,
            "model.gpt2.n_positions": m.n_positions, "model.gpt2.vocab_size": m.vocab_size,
            "data.train": args.data, "data.eval": "null", "data.seq_len": m.seq_len,
            "train.micro_batch_size": micro, "train.gradient_accumulation_steps": 1,
            "train.max_steps": steps, "train.log_every": 1, "train.precision": args.precision,
            "tensorboard.enabled": "false", "engine.threads": 1}
    cmd = launch + [str(BIN / "trainrun"), "--config", str(common.CONFIG)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    subprocess.run(cmd, check=True)
    with open(work / "trainrun" / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh if '"loss"' in line]
    timed = [r["tokens_per_sec"] for r in rows if r["step"] > m.warmup]
    results = [{"system": "trainrun", "precision": args.precision, "gpus": args.gpus,
                "tokens_per_sec_median": sorted(timed)[len(timed) // 2]}]
    torch_out = work / "torch.json"
    subprocess.run(launch + [sys.executable, str(HERE / "bench" / "torch_train.py"), "--model", args.model,
                             "--micro-batch", str(micro), "--device", "cuda", "--data", args.data,
                             "--weights", str(work / "trainrun" / "graphs" / "weights.safetensors"),
                             "--out", str(torch_out)], check=True,
                   env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29513"})   # DDP's rendezvous
    t = json.loads(torch_out.read_text())
    results.append({"system": "torch-ddp-nccl", "precision": "fp32", "gpus": args.gpus,
                    "tokens_per_sec_median": t["tokens_per_sec"], "step_ms_median": t["step_ms_median"]})
    for r in results:
        print(json.dumps(r))
    with open(args.out, "w") as fh:
        json.dump({"model": args.model, "not_yet_run_on_a_gpu_when_written": True, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
