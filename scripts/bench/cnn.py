"""SqueezeNet 1.1 on the digits (configs/squeezenet-digits.yaml): trainrun against PyTorch DDP, samples/s.

    .venv/bin/python scripts/bench/cnn.py [--steps 200] [--rounds 3] [--out runs/bench-cnn]

Both train the same network (scripts/squeezenet_digits.py: BatchNorm, width 1, 32x32, from the same
initial weights) on the same batches (data.shuffle off: step t takes images 64 (t-1) .. 64 t - 1 of the
training set, rank r its r-th 32) with AdamW (lr 3e-3 constant, weight decay 0.01, clipping at 1.0), 2 ranks
x 1 thread: trainrun by `mpirun -np 2 trainrun`, PyTorch by `torchrun --nproc_per_node 2` (DDP, gloo, its
default BatchNorm buffer broadcast). Samples/s are taken between the end of step 20 and the last step
(trainrun: metrics.jsonl's elapsed_s; PyTorch: perf_counter around the same steps), rounds alternating the
two. A last trainrun run profiles steps 30-32 with onnxruntime's profiler and prints the operator shares
(`trainrun profile summarize`), to show where the step goes (the convolution kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import common  # noqa: E402
import squeezenet_digits as SQ  # noqa: E402

WARM = 20


def torch_rank(args) -> None:
    """One DDP rank (run by torchrun): time steps WARM+1 .. steps; rank 0 writes samples/s to args.result."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    class Fire(nn.Module):
        def __init__(self, cin, s, e):
            super().__init__()
            self.squeeze, self.squeeze_bn = nn.Conv2d(cin, s, 1), nn.BatchNorm2d(s, eps=1e-5, momentum=0.1)
            self.expand1x1, self.expand3x3 = nn.Conv2d(s, e, 1), nn.Conv2d(s, e, 3, padding=1)

        def forward(self, x):
            x = F.relu(self.squeeze_bn(self.squeeze(x)))
            return torch.cat([F.relu(self.expand1x1(x)), F.relu(self.expand3x3(x))], 1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            arch = SQ.architecture(1.0)
            c1 = arch[0][1]
            self.conv1, self.bn1 = nn.Conv2d(1, c1, 3, stride=2), nn.BatchNorm2d(c1)
            layers, cin, i = [], c1, 0
            for layer in arch[1:]:
                if layer == "pool":
                    layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
                else:
                    layers.append(Fire(cin, *layer))
                    self.add_module(f"fire{i}", layers[-1])
                    cin, i = 2 * layer[1], i + 1
            self.layers = layers
            self.classifier = nn.Conv2d(cin, 10, 1)

        def forward(self, x):
            x = F.relu(self.bn1(self.conv1(x)))
            for layer in self.layers:
                x = layer(x)
            return self.classifier(x).mean((2, 3))

    net = Net()
    w = SQ.init_weights(1.0, 10, True, 0)
    rename = {"features.0.": "conv1.", "features.0.bn.": "bn1."}
    state = {}
    for k, v in w.items():
        for a, b in sorted(rename.items(), key=lambda kv: -len(kv[0])):
            if k.startswith(a):
                k = b + k[len(a):]
                break
        state[k] = torch.from_numpy(v.copy())
    net.load_state_dict(state, strict=False)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = np.load(args.data)
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["label"])
    n = len(y)

    def loss_at(t):
        idx = [(64 * (t - 1) + 32 * rank + j) % n for j in range(32)]
        return F.cross_entropy(model(x[idx]), y[idx])

    elapsed, _ = common.ddp_timed_steps(model, opt, args.steps, WARM, loss_at)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"samples_per_s": (args.steps - WARM) * 64 / elapsed}))
    dist.destroy_process_group()


def trainrun_once(work: Path, steps: int, profile: bool = False) -> dict:
    run_dir = work / ("profiled" if profile else "trainrun")
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    sets = {"run.output_dir": run_dir, "model.onnx": work / "squeezenet.onnx", "data.train": work / "train",
            "data.eval": "null", "data.shuffle": "false", "train.max_steps": steps, "train.log_every": 10,
            "lr_schedule.name": "constant", "lr_schedule.warmup_steps": 0, "checkpoint.every": 0,
            "tensorboard.enabled": "false", "engine.threads": 1, "optimizer.weight_decay": 0.01}
    if profile:
        sets |= {"profile.start_step": 30, "profile.steps": 3}
    cmd = [str(BIN / "mpirun"), "-np", "2", str(BIN / "trainrun"), "--config",
           str(ROOT / "configs" / "squeezenet-digits.yaml"), "--log-level", "warning"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    subprocess.run(cmd, check=True, env=dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}"))
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    el = {r["step"]: r["elapsed_s"] for r in rows if "loss" in r}
    return {"samples_per_s": (steps - WARM) * 64 / (el[steps] - el[WARM]), "run_dir": str(run_dir)}


def torch_once(work: Path, steps: int) -> dict:
    result = work / "torch.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29531", __file__,
                    "--torch-rank", "--data", str(work / "train.npz"), "--steps", str(steps),
                    "--result", str(result)], check=True, env=env, capture_output=True)
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-cnn"))
    ap.add_argument("--torch-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_rank:
        return torch_rank(args)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    import onnx
    onnx.save(SQ.build(batchnorm=True), str(work / "squeezenet.onnx"))
    (x, y), _ = SQ.digits(32)
    np.savez(work / "train.npz", x=x, label=y)
    subprocess.run([str(BIN / "trainrun-data"), "tensors", "--input", str(work / "train.npz"), "--output",
                    str(work / "train"), "--overwrite"], check=True, capture_output=True)
    ours, theirs = [], []
    for r in range(args.rounds):         # alternate, so that load on a shared machine hits both alike
        ours.append(trainrun_once(work, args.steps)["samples_per_s"])
        theirs.append(torch_once(work, args.steps)["samples_per_s"])
        print(f"round {r + 1}: trainrun {ours[-1]:,.0f} samples/s, PyTorch DDP {theirs[-1]:,.0f} samples/s, "
              f"ratio {ours[-1] / theirs[-1]:.2f}", flush=True)
    ratios = [a / b for a, b in zip(ours, theirs)]
    summary = {"steps": args.steps, "timed_steps": args.steps - WARM, "trainrun_samples_per_s": ours,
               "ddp_samples_per_s": theirs, "median_ratio": float(np.median(ratios)),
               "started": time.strftime("%Y-%m-%d %H:%M"), "loadavg": os.getloadavg()[0]}
    print(f"median: trainrun {np.median(ours):,.0f} samples/s, PyTorch DDP {np.median(theirs):,.0f} samples/s, "
          f"trainrun/DDP {np.median(ratios):.2f}x (2 ranks x 1 thread, global batch 64)")
    prof = trainrun_once(work, 40, profile=True)
    out = subprocess.run([str(BIN / "trainrun"), "profile", "summarize", prof["run_dir"]], capture_output=True,
                         text=True)
    print(out.stdout or out.stderr)
    summary["profile"] = out.stdout
    (work / "results.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
