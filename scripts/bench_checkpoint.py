"""Checkpoint write speed against the disk's own sequential write speed, in one run.

For a model of P parameters with Adam (3 float32 buffers: params, exp_avg,
exp_avg_sq) it measures, alternating, repeated:

* dd:        `dd if=/dev/zero bs=64M count=.. conv=fsync` of the same number of bytes;
* trainrun:  CheckpointWriter.start() (the part the training step waits for: the
             tensor files written from the buffers into the page cache) and the
             background part (fsync, checksums read back, the small files), until
             it reports done;
* memcpy:    np.copyto of the same buffers (what a snapshot copy would cost instead).

Usage: python scripts/bench_checkpoint.py [--params 50e6] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

from trainrun.checkpoint import CheckpointWriter
from trainrun.step.flat import FlatLayout


def dd_mb_s(path: str, nbytes: int) -> float:
    count = max(1, nbytes // (64 << 20))
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t
    os.remove(path)
    return count * 64 * (1 << 20) / dt / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo's runs/)")
    args = ap.parse_args()

    n = int(args.params)
    base = args.dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=base)
    # a GPT-2-like spread of tensor sizes
    shapes, left, i = [], n, 0
    while left > 0:
        size = min(left, [768 * 3072, 768 * 768, 768][i % 3])
        shapes.append((size,))
        left -= size
        i += 1
    layout = FlatLayout([f"t{i}" for i in range(len(shapes))], shapes,
                        list(np.cumsum([0] + [s[0] for s in shapes[:-1]])), n)
    rng = np.random.default_rng(0)
    buffers = {k: rng.standard_normal(n, dtype=np.float32) for k in ("params", "exp_avg", "exp_avg_sq")}
    nbytes = 3 * n * 4
    meta = {"format_version": 1, "step": 0, "updates": 0, "skipped_steps": 0, "loader": {"position": 0},
            "world_size": 1, "global_batch": 1}
    writer = CheckpointWriter(work, rank=0, world_size=1, keep_last=1, log=lambda *_: None)
    copy_of = {k: np.empty_like(v) for k, v in buffers.items()}

    dd, write, block, memcpy = [], [], [], []
    for r in range(args.repeat):
        dd.append(dd_mb_s(os.path.join(work, "dd.bin"), nbytes))
        meta["step"] = r + 1
        t0 = time.perf_counter()
        writer.start(r + 1, layout, buffers, meta, "config: {}\n")
        t1 = time.perf_counter()
        writer.wait()
        t2 = time.perf_counter()
        assert writer.status() == (1.0, 0.0), writer.error_text()
        writer.commit()
        block.append(t1 - t0)
        write.append(nbytes / (t2 - t0) / 1e6)
        t = time.perf_counter()
        for k, v in buffers.items():
            np.copyto(copy_of[k], v)
        memcpy.append(time.perf_counter() - t)
    shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    load = os.getloadavg()[0]
    print(f"checkpoint of {n / 1e6:.0f}M params + Adam moments = {nbytes / 1e9:.2f} GB, {args.repeat} runs, "
          f"load {load:.1f}, disk of {base}")
    print(f"{'':28}{'median':>10}{'min':>10}{'max':>10}")
    for name, vals, unit in [("dd sequential write", dd, "MB/s"), ("trainrun checkpoint write", write, "MB/s"),
                             ("step blocked (tensors written)", [b * 1e3 for b in block], "ms"),
                             ("memcpy of the same buffers", [m * 1e3 for m in memcpy], "ms")]:
        print(f"{name:28}{med(vals):>10.0f}{min(vals):>10.0f}{max(vals):>10.0f}  {unit}")
    print(f"write speed / dd: {med(write) / med(dd):.2f}   blocked / memcpy: {med(block) / med(memcpy):.2f}")


if __name__ == "__main__":
    main()
