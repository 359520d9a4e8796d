"""onnxruntime's CPU matrix product against the contraction's length, and what graphs/strides.py's
padding is worth: one thread, products alone (MatMul sessions over bound inputs), rounds interleaved,
median GFLOP/s and ms. Two tables:

* a K sweep of one product ([M, K] x [K, N]): K a multiple of 1024 float32 (rows 4 KiB apart) against
  its neighbours;
* products trainrun's models make, plain against both operands padded by 16 zeros on K (the rewrite's
  two Pads included in the time), with M*N/(M+N), the size the rewrite's bar reads.

    .venv/bin/python scripts/bench/strides.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import common  # noqa: E402
from trainrun.graphs.strides import PAD  # noqa: E402
from trainrun.sessions import import_onnxruntime, session_options  # noqa: E402

SWEEP = (384, [960, 1008, 1024, 1040, 2048, 2064], 1536)
PRODUCTS = [   # (what, M, K, N)
    ("tiny weight gradient, 1024 tokens", 512, 1024, 128),
    ("mid weight gradient (attention projection)", 384, 1024, 384),
    ("mid weight gradient (MLP)", 384, 1024, 1536),
    ("mid weight gradient (MLP projection)", 1536, 1024, 384),
    ("GPT-2 124M MLP projection, 1024 tokens", 1024, 3072, 768),
]


def session(m: int, k: int, n: int, pad: bool):
    ort = import_onnxruntime()
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k]),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, [k, n])]
    nodes, inits, a, b = [], [], "a", "b"
    if pad:
        inits = [numpy_helper.from_array(np.array([0, 0, 0, PAD], np.int64), "pa"),
                 numpy_helper.from_array(np.array([0, 0, PAD, 0], np.int64), "pb")]
        nodes = [helper.make_node("Pad", ["a", "pa"], ["a2"]), helper.make_node("Pad", ["b", "pb"], ["b2"])]
        a, b = "a2", "b2"
    nodes.append(helper.make_node("MatMul", [a, b], ["c"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    s = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    io = s.io_binding()
    io.bind_cpu_input("a", rng.standard_normal((m, k)).astype(np.float32))
    io.bind_cpu_input("b", rng.standard_normal((k, n)).astype(np.float32))
    io.bind_output("c", "cpu")
    return s, io


def timed(cases: dict, rounds: int) -> dict:
    """Median seconds per product of each case, rounds interleaved (order reversed every other round)."""
    times = {key: [] for key in cases}
    keys = list(cases)
    for r in range(rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            s, io, flops = cases[key]
            reps = max(3, int(1e9 / flops))
            s.run_with_iobinding(io)
            t = time.perf_counter()
            for _ in range(reps):
                s.run_with_iobinding(io)
            times[key].append((time.perf_counter() - t) / reps)
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(f"{common.cpu_name()}, 1 thread, {args.rounds} interleaved rounds, medians\n")
    m, ks, n = SWEEP
    sweep = timed({k: (*session(m, k, n, False), 2.0 * m * k * n) for k in ks}, args.rounds)
    print(f"| [{m}, K] x [K, {n}] | GFLOP/s |\n|---|---:|")
    for k in ks:
        print(f"| K = {k}{' (4 KiB rows)' if k % 1024 == 0 else ''} | {2.0 * m * k * n / sweep[k] / 1e9:.1f} |")
    cases = {}
    for what, m, k, n in PRODUCTS:
        for pad in (False, True):
            cases[(what, pad)] = (*session(m, k, n, pad), 2.0 * m * k * n)
    t = timed(cases, args.rounds)
    print("\n| product | [M, K] x [K, N] | M*N/(M+N) | plain ms | padded ms | padded / plain |\n|---|---|---:|---:|---:|---:|")
    for what, m, k, n in PRODUCTS:
        a, b = t[(what, False)] * 1e3, t[(what, True)] * 1e3
        print(f"| {what} | [{m}, {k}] x [{k}, {n}] | {m * n / (m + n):.0f} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
