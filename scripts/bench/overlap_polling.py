"""How a background thread should wait on its collectives while the main thread computes (the choice behind
``trainrun.comm.QUIET_SLEEP_S``, distributed.overlap_grad_reduce). Run under mpirun across the pretend
cluster's nodes (one core each) at a link rate:

    scripts/cluster/cluster.sh up 2 && scripts/cluster/cluster.sh rate 1gbit
    scripts/cluster/cluster.sh mpirun -hosts n1,n2 -ppn 1 -np 2 .venv/bin/python scripts/bench/overlap_polling.py

Each rank: ``--mb`` MB of float32 (default 45, the mid model's gradients) cut into ``--buckets`` buckets,
allreduced through ``trainrun.wire`` (fp32 and bf16) by a background thread while the main thread runs
about ``--compute`` seconds of single-threaded matmuls. Per way of waiting: ``spin`` (the main thread's
policy: Test() back to back), polls every 20, 100 and 300 us, and the main thread's back-off (10 us
doubling to 1 ms). Printed (rank 0, medians of ``--repeats``): the compute alone, the reduction alone
(main thread, spinning) and both together; both = compute alone means the reduction is hidden.

With ``--wakeups`` (one process, no MPI): what a thread that only sleeps and wakes costs the compute beside it
on this machine, by the length of its sleeps (a virtual machine pays a timer exit at every wake-up).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

import common  # noqa: F401  (trainrun importable)
from trainrun import comm as C
from trainrun import wire

WAYS = {"spin": None, "poll 20us": 2e-5, "poll 100us": 1e-4, "poll 300us": 3e-4, "back-off to 1ms": "backoff"}


def matmuls(seconds: float):
    """(compute(k): k single-threaded 384x1536 @ 1536x1536 matmuls, their seconds; the k that takes about
    ``seconds``)."""
    a = np.random.rand(384, 1536).astype(np.float32)
    b = np.random.rand(1536, 1536).astype(np.float32)

    def compute(k: int) -> float:
        t = time.perf_counter()
        for _ in range(k):
            a @ b
        return time.perf_counter() - t

    return compute, max(1, int(50 * seconds / compute(50)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=45.0)
    ap.add_argument("--buckets", type=int, default=10)
    ap.add_argument("--compute", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wakeups", action="store_true")
    args = ap.parse_args()
    if args.wakeups:
        wakeups(args)
        return
    comm = C.MPICommunicator(120)
    n = int(args.mb * 1e6 / 4)
    g = np.ones(n, np.float32)
    compute, k = matmuls(args.compute)
    cuts = [i * n // args.buckets for i in range(args.buckets + 1)]

    def reduce_all(w) -> None:
        for lo, hi in zip(cuts, cuts[1:]):
            w.allreduce_(g[lo:hi])

    def background(w, way) -> None:
        if isinstance(way, float):
            C.wait_quietly()
        reduce_all(w)

    saved = C.SPIN_S, C.QUIET_SLEEP_S
    for dtype in ("fp32", "bf16"):
        w = wire.make(comm, dtype)
        alone, reduce = [], []
        for _ in range(args.repeats):
            comm.barrier()
            alone.append(compute(k))
            comm.barrier()
            t0 = time.perf_counter()
            reduce_all(w)
            reduce.append(time.perf_counter() - t0)
        rows = {}
        for name, way in WAYS.items():
            both = []
            for _ in range(args.repeats):
                if isinstance(way, float):
                    C.QUIET_SLEEP_S = way
                C.SPIN_S = 0.0 if way == "backoff" else 1e9 if way is None else saved[0]
                comm.barrier()
                t0 = time.perf_counter()
                th = threading.Thread(target=background, args=(w, way))
                th.start()
                compute(k)
                th.join()
                both.append(time.perf_counter() - t0)
                C.SPIN_S, C.QUIET_SLEEP_S = saved
            rows[name] = statistics.median(both)
        if comm.rank == 0:
            print(f"{dtype}: compute alone {statistics.median(alone):.3f} s, reduction alone "
                  f"{statistics.median(reduce):.3f} s; both, by the way the thread waits: "
                  + ", ".join(f"{k_} {v:.3f} s" for k_, v in rows.items()), flush=True)
    comm.close()


def wakeups(args) -> None:
    compute, k = matmuls(args.compute)
    times: dict = {}
    for _ in range(max(args.repeats, 5)):
        for sleep in (0.0, 1e-4, 3e-4, 1e-3):
            stop, woke = [False], [0]

            def sleeper():
                while not stop[0]:
                    woke[0] += 1
                    time.sleep(sleep)
            th = threading.Thread(target=sleeper) if sleep else None
            if th:
                th.start()
            took = compute(k)
            stop[0] = True
            if th:
                th.join()
            times.setdefault(sleep, []).append((took, woke[0] / took))
    alone = statistics.median(t for t, _ in times[0.0])
    print(f"compute alone {alone:.3f} s; beside a thread sleeping " + ", ".join(
        f"{s * 1e6:.0f} us: {statistics.median(t for t, _ in v) / alone:.2f}x "
        f"({statistics.median(w for _, w in v):,.0f} wake-ups/s)" for s, v in times.items() if s), flush=True)


if __name__ == "__main__":
    main()
