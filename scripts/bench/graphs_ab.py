"""The train graphs of prepared graphs folders, side by side in one process: one thread each, the same
random micro-batch and weights, rounds interleaved (order reversed every other round), median ms a step.
For comparing what two versions of trainrun's graph building make of one config:

    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old .venv/bin/python -m trainrun.cli prepare --config C.yaml --set run.output_dir=/tmp/a
    .venv/bin/trainrun prepare --config C.yaml --set run.output_dir=/tmp/b
    .venv/bin/python scripts/bench/graphs_ab.py /tmp/a/graphs /tmp/b/graphs [--rounds 16 --steps 40]

Each graph runs as the engine runs it without accumulation (gradients as outputs,
graphs.gradients.direct_gradients) under trainrun's session options; ids are drawn below the token
embedding's rows. --check also compares the folders' outputs (the largest difference relative to each
output's largest value), for rewrites meant to keep the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def session(folder: str, threads: int):
    import numpy as np
    import onnx
    from trainrun.graphs.gradients import direct_gradients
    from trainrun.sessions import import_onnxruntime, session_options
    ort = import_onnxruntime()
    model, _ = direct_gradients(onnx.load(str(Path(folder) / "train.onnx")))
    s = ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    rows = min((i.shape[0] for i in s.get_inputs() if i.type == "tensor(float)" and len(i.shape) == 2), default=2)
    feeds = {}
    for i in s.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = rng.integers(0, rows, shape).astype(np.int64) if i.type == "tensor(int64)" else \
            (rng.standard_normal(shape) * 0.1).astype(np.float32)
    io = s.io_binding()
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    for o in s.get_outputs():
        io.bind_output(o.name, "cpu")
    return s, io, feeds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="graphs folders (trainrun prepare's <output_dir>/graphs)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40, help="timed steps a round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check", action="store_true", help="compare the folders' outputs to the first's")
    args = ap.parse_args()
    import numpy as np
    runs = [session(f, args.threads) for f in args.folders]
    if args.check:
        outs = [dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds))) for s, _, feeds in runs]
        for folder, out in zip(args.folders[1:], outs[1:]):
            worst = max(float(np.abs(outs[0][k] - v).max() / (np.abs(outs[0][k]).max() + 1e-30)) for k, v in out.items())
            print(f"{folder}: largest relative difference to {args.folders[0]}: {worst:.2e}")
    times = [[] for _ in runs]
    for r in range(args.rounds):
        order = list(range(len(runs)))[::-1 if r % 2 else 1]
        for k in order:
            s, io, _ = runs[k]
            for _ in range(3):
                s.run_with_iobinding(io)
            t = time.perf_counter()
            for _ in range(args.steps):
                s.run_with_iobinding(io)
            times[k].append((time.perf_counter() - t) / args.steps * 1e3)
    base = statistics.median(times[0])
    for folder, ts in zip(args.folders, times):
        med = statistics.median(ts)
        print(f"{folder}: median {med:.2f} ms a step (min {min(ts):.2f}, max {max(ts):.2f}; {med / base:.3f} of the first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
