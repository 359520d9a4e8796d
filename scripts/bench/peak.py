"""The machine's measured peak float32 FLOP/s: a large square matmul.

    .venv/bin/python scripts/bench/peak.py [--n 2048] [--repeats 6] --out peak.json

Measured with onnxruntime's MatMul (MLAS, what trainrun's graphs use) and
torch.mm (MKL/oneDNN, what PyTorch uses), at 1 thread and at all cores; each
timing is repeated and the best is taken (the peak is what the machine can do,
not what a shared machine did on average; the median is reported beside it).
MFU in BENCHMARKS.md divides a run's model FLOP/s by the best of these at all cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def ort_matmul(n: int, threads: int, repeats: int) -> list[float]:
    import onnxruntime as ort
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    c = np.empty((n, n), np.float32)
    binding = sess.io_binding()
    binding.bind_cpu_input("a", a)
    binding.bind_cpu_input("b", b)
    binding.bind_output("c", "cpu", 0, np.float32, [n, n], c.ctypes.data)
    sess.run_with_iobinding(binding)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run_with_iobinding(binding)
        out.append(2.0 * n ** 3 / (time.perf_counter() - t))
    return out


def torch_matmul(n: int, threads: int, repeats: int) -> list[float]:
    import torch
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        out.append(2.0 * n ** 3 / (time.perf_counter() - t))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    result = {"n": args.n, "cores": cores, "loadavg_before": common.loadavg()}
    for threads in sorted({1, cores}):
        for name, fn in (("onnxruntime", ort_matmul), ("torch", torch_matmul)):
            vals = fn(args.n, threads, args.repeats)
            result[f"{name}_t{threads}"] = {"best_gflops": max(vals) / 1e9, "median_gflops": float(np.median(vals)) / 1e9}
            print(f"{name:12s} {threads} thread(s): best {max(vals) / 1e9:7.1f} GFLOP/s, "
                  f"median {np.median(vals) / 1e9:7.1f}")
    result["peak_gflops"] = max(result[f"{n}_t{cores}"]["best_gflops"] for n in ("onnxruntime", "torch"))
    result["peak_gflops_1core"] = max(result[f"{n}_t1"]["best_gflops"] for n in ("onnxruntime", "torch"))
    result["loadavg_after"] = common.loadavg()
    print(f"peak: {result['peak_gflops']:.1f} GFLOP/s on {cores} cores ({result['peak_gflops_1core']:.1f} on one)")
    if args.out:
        common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
