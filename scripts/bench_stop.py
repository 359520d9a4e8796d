"""Time from SIGTERM to a committed checkpoint, as a cluster would stop a job.

Starts `mpirun -np R trainrun` on a GPT-2 (default: 124M, seq 256, micro-batch 2, as in issue 17's
measurements) over a byte-level dataset made from the files under --text (default: the running
Python's standard library), waits until --after steps are logged, sends SIGTERM to mpirun, and
reports: the time until the job exited, the time trainrun itself printed (signal -> checkpoint
committed, on rank 0), the job's exit status (75: stopped, resumable) and whether the checkpoint
verifies. SLURM's KillWait (30 s by default) is the budget.

Usage: python scripts/bench_stop.py [--ranks 2] [--layers 12] [--embd 768] [--after 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

import yaml

BIN = os.path.dirname(sys.executable)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--after", type=int, default=3, help="logged steps before the signal")
    ap.add_argument("--text", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="bench_stop_")
    data = os.path.join(work, "data")
    if not os.path.exists(os.path.join(data, "train")):
        subprocess.run([os.path.join(BIN, "trainrun-data"), "tokens", "--input", args.text, "--output", data,
                        "--bytes", "--include", "*.py", "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    run_dir = os.path.join(work, "run")
    cfg = {"run": {"output_dir": run_dir},
           "model": {"builtin": "gpt2", "gpt2": {"n_layer": args.layers, "n_head": args.heads, "n_embd": args.embd,
                                                  "n_positions": args.seq, "vocab_size": 50304}},
           "data": {"train": os.path.join(data, "train"), "seq_len": args.seq},
           "train": {"micro_batch_size": args.micro_batch, "max_steps": 100000, "log_every": 1},
           "checkpoint": {"every": 100000}, "engine": {"threads": 1}, "tensorboard": {"enabled": False}}
    path = os.path.join(work, "c.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(cfg, fh)
    subprocess.run([os.path.join(BIN, "trainrun"), "prepare", "--config", path], check=True,
                   stdout=subprocess.DEVNULL)
    log = open(os.path.join(work, "job.log"), "w+")
    proc = subprocess.Popen([os.path.join(BIN, "mpirun"), "-np", str(args.ranks), os.path.join(BIN, "trainrun"),
                             "--config", path], stdout=log, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    while not os.path.exists(metrics) or len(open(metrics).read().splitlines()) < args.after:
        if proc.poll() is not None:
            sys.exit(f"the job ended early ({proc.returncode}); see {log.name}")
        time.sleep(0.1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    total = time.monotonic() - sent
    log.seek(0)
    text = log.read()
    said = re.search(r"stopped by SIGTERM after step (\d+); checkpoint (\S+) committed ([\d.]+) s after", text)
    verified = "no checkpoint"
    if said:
        from trainrun import checkpoint as K
        K.verify(said.group(2))
        verified = "verifies"
    n = 12 * args.layers * args.embd ** 2 + 50304 * args.embd
    print(f"GPT-2 ~{n / 1e6:.0f}M parameters, {args.ranks} ranks x 1 thread, seq {args.seq}, micro-batch "
          f"{args.micro_batch}: exit {code}; signal -> committed (rank 0's own clock) "
          f"{said.group(3) if said else '?'} s (step {said.group(1) if said else '?'}); signal -> job exited "
          f"{total:.1f} s; checkpoint {verified}")


if __name__ == "__main__":
    main()
