"""Allreduce bandwidth of trainrun's MPI communicator versus a memcpy.

    python scripts/bench_comm.py [--np 2] [--sizes 1M,10M,50M] [--iters 10]

Run it plainly and it starts itself under ``mpirun -np N`` (the mpirun next to
this Python, else the one on PATH); run it under mpirun and it benchmarks
directly. For each float32 size it times, interleaved so drift hits both alike:

* blocking: mpi4py ``COMM_WORLD.Allreduce(IN_PLACE, ...)``, the reference;
* polled: ``Communicator.allreduce_`` (Iallreduce polled with Test(), which
  is what trainrun uses so a dead peer cannot hang it forever);
* memcpy: ``np.copyto`` of the same number of bytes, on every rank at once
  (the ranks share the machine's memory bandwidth during the allreduce too).

Bandwidths are algorithm bandwidth, bytes of the buffer / time (as in
nccl-tests' algbw); bus bandwidth = algbw x 2(n-1)/n. memcpy GB/s counts the
bytes once, although a copy reads and writes them. Times are medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))     # after site-packages: tests/conftest.py
from trainrun.comm import detect_world, make_communicator  # noqa: E402


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def launch(args: argparse.Namespace) -> int:
    """Re-run this script under mpirun."""
    mpirun = Path(sys.executable).with_name("mpirun")
    mpirun = str(mpirun) if mpirun.exists() else shutil.which("mpirun")
    if not mpirun:
        sys.exit("bench_comm: no mpirun next to this Python or on PATH")
    cmd = [mpirun, "-np", str(args.np), sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def median_ms(times: list[float]) -> float:
    return float(np.median(times)) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2, help="ranks to launch when not already under mpirun")
    ap.add_argument("--sizes", default="1M,10M,50M", help="float32 element counts, comma-separated")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per size (after 2 warm-up)")
    args = ap.parse_args()
    if detect_world()[1] == 1:
        return launch(args)

    comm = make_communicator("mpi")
    from mpi4py import MPI  # already initialised by make_communicator

    world = MPI.COMM_WORLD
    n = comm.world_size
    rows = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        buf = np.zeros(size, dtype=np.float32)
        src, dst = np.ones(size, dtype=np.float32), np.empty(size, dtype=np.float32)
        variants = {
            "blocking": lambda: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
            "polled": lambda: comm.allreduce_(buf),
            "memcpy": lambda: np.copyto(dst, src),
        }
        times = {name: [] for name in variants}
        for i in range(args.iters + 2):
            # Alternate the order so that whichever runs first after the barrier
            # (and absorbs the ranks' skew) is not always the same one.
            for name in (list(variants) if i % 2 else list(variants)[::-1]):
                world.Barrier()
                t = time.perf_counter()
                variants[name]()
                if i >= 2:
                    times[name].append(time.perf_counter() - t)
        blocking, polled, memcpy = times["blocking"], times["polled"], times["memcpy"]
        buf[:] = comm.rank + 1  # check the result once: sum of 1..n
        comm.allreduce_(buf)
        assert np.all(buf == n * (n + 1) / 2), "allreduce gave a wrong sum"
        rows.append((size, blocking, polled, memcpy))

    if comm.rank == 0:
        print(f"allreduce SUM float32, {n} ranks ({comm.local_size} on this host), median of {args.iters}; "
              f"GB/s = algbw (bytes/time), busbw = algbw x {2 * (n - 1) / n:.2f}")
        head = (f"{'floats':>8} {'MB':>6} | {'blocking ms':>11} {'GB/s':>6} | {'polled ms':>9} {'GB/s':>6} "
                f"{'ratio':>5} | {'memcpy ms':>9} {'GB/s':>6}")
        print(head)
        print("-" * len(head))
        for size, blocking, polled, memcpy in rows:
            mb = size * 4 / 1e6
            b, p, m = median_ms(blocking), median_ms(polled), median_ms(memcpy)
            print(f"{size / 1e6:>7g}M {mb:>6.0f} | {b:>11.2f} {mb / b:>6.2f} | {p:>9.2f} {mb / p:>6.2f} "
                  f"{p / b:>5.2f} | {m:>9.2f} {mb / m:>6.2f}")
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
