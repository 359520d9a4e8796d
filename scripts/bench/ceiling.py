"""The ceiling: trainrun's train graph alone, in a loop, on trainrun's flat buffers.

    .venv/bin/python scripts/bench/ceiling.py --graphs RUN/graphs --data DATA/train \
        --micro-batch 16 --seq-len 128 --threads 2 --steps 30 --out ceiling.json
    .venv/bin/mpirun -np 2 .venv/bin/python scripts/bench/ceiling.py ... --threads 1

It builds ``trainrun.step.engine.Engine`` (the same sessions, session options and
IOBinding over one flat parameter and one flat gradient buffer that the runner
uses), copies ONE real micro-batch from the dataset into the bound batch buffer
once, and then runs only the train graph: no data loading, no allreduce, no
gradient norm, no optimizer. Under mpirun every rank does that at the same
time (a barrier only every ``--window`` steps), so the ranks compete for the
machine's cores and memory as trainrun's ranks do; tokens/s is all ranks'
tokens over the slowest rank's time. Several graphs folders (comma-separated)
are timed in alternating blocks of ``--window`` steps in the same processes.
Each folder must hold graphs for ``--micro-batch`` x ``--seq-len`` (a static-shape
train graph runs that shape only; scripts/bench/variants.py prepares one per
micro-batch).

``--profile DIR`` writes an onnxruntime profile of the timed
steps and a per-op-type summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


class TrainGraphLoop:
    """trainrun's Engine on a graphs folder, with one fixed real micro-batch bound.

    A static-shape train graph (trainrun's default, ``engine.static_shapes``) runs only the
    [micro_batch, seq_len] it was prepared for: another shape is refused here, before the
    Engine would raise its UsageError. The engine is built without an optimizer: the loop never
    updates the parameters."""

    def __init__(self, graphs: str, data: str, micro_batch: int, seq_len: int, threads: int,
                 profile_prefix: str | None = None, batch_index: int = 0):
        from trainrun.data import open_dataset
        from trainrun.step.engine import Engine, EngineOptions
        from trainrun.graphs.manifest import load_manifest
        manifest = load_manifest(graphs)
        static = (manifest.get("build") or {}).get("static_shape")
        if static and list(static) != [micro_batch, seq_len]:
            raise SystemExit(f"{graphs}: its train graph is static for [micro_batch, seq_len] = {static}, "
                             f"not [{micro_batch}, {seq_len}]: prepare graphs for this micro-batch")
        self.static_shape = static
        ds = open_dataset(data, seq_len)
        batch = ds.read(np.arange(batch_index * micro_batch, (batch_index + 1) * micro_batch), ds.new_batch(micro_batch))
        shapes = {k: (v.shape, v.dtype) for k, v in batch.items()}
        # as trainrun runs it without gradient accumulation: gradients written straight into the flat buffer
        opts = EngineOptions(threads=threads, profile_prefix=profile_prefix, direct_gradients=True)
        self.engine = Engine(graphs, opts, shapes, shapes)
        self.engine.load_weights()
        self.engine.set_batch(batch)
        self.tokens = micro_batch * seq_len

    def step(self) -> float:
        """One run of the train graph (gradients overwrite the flat buffer); the loss."""
        self.engine.train_s.run()
        return float(self.engine.loss)

    def end_profile(self) -> str | None:
        sess = self.engine.train_s.session
        return sess.end_profiling() if sess.get_session_options().enable_profiling else None


def profile_summary(path: str, top: int = 12) -> list[dict]:
    """Per-op-type kernel time of an onnxruntime profile (share of all node time)."""
    events = json.loads(Path(path).read_text())
    per_type: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            per_type[op] = per_type.get(op, 0.0) + e.get("dur", 0) / 1e3
    total = sum(per_type.values()) or 1.0
    rows = sorted(per_type.items(), key=lambda kv: -kv[1])
    return [{"op": k, "ms": round(v, 2), "share": round(v / total, 4)} for k, v in rows[:top]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", required=True, help="graphs folder; several comma-separated are timed interleaved")
    ap.add_argument("--data", required=True, help="token dataset folder (one micro-batch is read once)")
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--window", type=int, default=8, help="steps per block: graphs alternate every block; "
                                                           "also the window of the best-window figure")
    ap.add_argument("--profile", help="folder for an onnxruntime profile of the timed steps")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank, world = common.launcher_rank()
    comm = None
    if world > 1:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    prefix = None
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        prefix = str(Path(args.profile) / f"ceiling_r{rank}")
    graphs = args.graphs.split(",")
    loops = [TrainGraphLoop(g, args.data, args.micro_batch, args.seq_len, args.threads, profile_prefix=prefix,
                            batch_index=rank) for g in graphs]
    for loop in loops:
        for _ in range(args.warmup):
            loop.step()
    times = [[] for _ in loops]
    elapsed = [0.0] * len(loops)
    losses = [None] * len(loops)
    block = max(1, args.window)
    done = 0
    while done < args.steps:          # blocks of `block` steps, graphs alternating, ranks in step per block
        n = min(block, args.steps - done)
        order = range(len(loops)) if (done // block) % 2 == 0 else reversed(range(len(loops)))
        for i in order:
            if comm is not None:
                comm.Barrier()
            start = time.perf_counter()
            for _ in range(n):
                t = time.perf_counter()
                losses[i] = loops[i].step()
                times[i].append(time.perf_counter() - t)
            elapsed[i] += time.perf_counter() - start
        done += n
    mine = np.array([*elapsed, common.peak_rss_mb()], np.float64)
    everyone = np.zeros((world, len(mine)), np.float64)
    if comm is not None:
        comm.Allgather(mine, everyone)
    else:
        everyone[0] = mine
    profile = None
    if args.profile and len(loops) == 1:
        path = loops[0].end_profile()
        if path:
            profile = profile_summary(path)
    if rank == 0:
        rows = []
        for i, g in enumerate(graphs):
            slowest = float(everyone[:, i].max())
            rows.append({"graphs": g, "elapsed_s": slowest,
                         "tokens_per_sec": world * args.steps * loops[i].tokens / slowest,
                         "step_ms_median": float(np.median(times[i])) * 1e3, "loss": losses[i],
                         "static_shape": loops[i].static_shape,
                         "best_window_tokens_per_sec": common.best_window(times[i], args.window, world * loops[i].tokens)})
        common.write_json(args.out, {
            "kind": "ceiling", "ranks": world, "threads": args.threads, "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "steps": args.steps, "rows": rows, **rows[0],
            "peak_rss_mb": everyone[:, -1].round(1).tolist(), "profile": profile,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
