"""The component benchmarks, by calling the repo's own scripts (scripts/bench_*.py).

    .venv/bin/python scripts/bench/extras.py data --data DATA/train --steps 3000 --out d.json
    .venv/bin/python scripts/bench/extras.py comm --sizes 550k,11.2M --iters 10 --out c.json

* data: ``bench_data.loader_rate`` (trainrun's TrainLoader on token shards) at
  each benchmark model's micro-batch, prefetch 0 and 2 -> batches/s.
* comm: ``scripts/bench_comm.py`` under mpirun -np 2 (raw blocking MPI Allreduce,
  trainrun's polled Communicator.allreduce_ and a memcpy of the same buffer);
  its table is parsed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

sys.path.insert(0, str(common.ROOT / "scripts"))


def data(path: str, steps: int) -> dict:
    import bench_data
    rows = []
    for name in ("tiny", "mid"):
        m = common.MODELS[name]
        mb = m.global_batch // 2
        for prefetch in (0, 2):
            r = bench_data.loader_rate(Path(path), steps, prefetch, seq_len=m.seq_len, mb=mb)
            rows.append({"model": name, "micro_batch": mb, "seq_len": m.seq_len, "prefetch": prefetch, **r})
            print(f"loader {mb} x {m.seq_len}, prefetch {prefetch}: {r['batches_per_s']:.0f} batches/s")
    return {"steps": steps, "rows": rows}


ROW = re.compile(r"^\s*([\d.]+)M\s+(\d+)\s*\|\s*([\d.]+)\s+([\d.]+)\s*\|\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*\|"
                 r"\s*([\d.]+)\s+([\d.]+)")


def comm(sizes: str, iters: int) -> dict:
    cmd = [sys.executable, str(common.ROOT / "scripts" / "bench_comm.py"), "--np", "2", "--sizes", sizes,
           "--iters", str(iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rows = []
    for line in proc.stdout.splitlines():
        m = ROW.match(line)
        if m:
            v = [float(x) for x in m.groups()]
            rows.append({"floats": int(round(v[0] * 1e6)), "blocking_ms": v[2], "blocking_gbps": v[3],
                         "polled_ms": v[4], "polled_gbps": v[5], "polled_over_blocking_time": v[6],
                         "memcpy_ms": v[7], "memcpy_gbps": v[8], "polled_share_of_raw_bw": v[2] / v[4]})
    print(proc.stdout)
    return {"cmd": " ".join(cmd[1:]), "rows": rows, "rc": proc.returncode, "stderr": proc.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["data", "comm"])
    ap.add_argument("--data", default=str(common.ROOT / "data" / "stdlib" / "train"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--sizes", default="550k,11.2M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.what == "data":
        result = data(args.data, args.steps)
    else:
        result = comm(args.sizes, args.iters)
    result["loadavg"] = common.loadavg()
    common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
