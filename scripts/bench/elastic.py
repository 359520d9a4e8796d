"""Elastic training through node failures (``make bench-cluster``): a tiny GPT-2 on 3 pretend nodes of
scripts/cluster/cluster.sh (root), one rank a node, on Open MPI's fault tolerance (``distributed.elastic``, the
elastic venv: ``make setup-elastic``), for M minutes with a node's ranks killed every K s and the node taken back R s
later (``trainrun rejoin``), and the same run without faults; one after the other (the box's cores are shared).

    .venv/bin/python scripts/bench/elastic.py [--minutes 20] [--kill-every 120] [--relaunch-after 30]
        [--sync every_step|diloco] [--work runs/bench-elastic] [--output BENCHMARKS.md] [--no-write]

A kill is ``cluster.sh kill NODE trainrun``: SIGKILL to every trainrun process of a node other than rank 0's n1
(the one of n2 and n3 that holds ranks, in turn); mpirun's daemon there lives (docs/distributed.md: with Open MPI
5.0's runtime a daemon's death ends the job). The relaunch is the node back (its namespaces and address never
left) and ``trainrun rejoin RUN``, asked again until the step lines say 3 replicas (one rank a request). Reported:

* tokens/s of the faulted run / tokens/s of the fault-free run, each its tokens trained (the step lines'
  ``replicas`` x a replica's tokens a step) over its training time (the last step line's ``elapsed_s``);
* kill -> next step: from the SIGKILL to the first step line with fewer replicas (the survivors' next step);
* relaunch -> first step: from ``trainrun rejoin`` to the first step line with 3 replicas again.

Writes WORK/elastic.json and the section between ``<!-- bench-elastic: begin/end -->`` of ``--output`` (appended
under HEADING where the file has no such markers).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import common

ROOT, BIN = common.ROOT, common.BIN
CLUSTER = ROOT / "scripts" / "cluster" / "cluster.sh"
VENV = Path(os.environ.get("TRAINRUN_ELASTIC_VENV") or ROOT / ".venv-elastic")
ENV = {**os.environ, "TRAINRUN_CLUSTER_PREFIX": os.environ.get("TRAINRUN_CLUSTER_PREFIX", "trbe"),
       "TRAINRUN_CLUSTER_DIR": os.environ.get("TRAINRUN_CLUSTER_DIR", "/tmp/trainrun-bench-elastic"),
       "OMPIRUN": str(VENV / "bin" / "mpirun")}
NODES = ["n1", "n2", "n3"]
BEGIN, END = "<!-- bench-elastic: begin -->", "<!-- bench-elastic: end -->"
HEADING = "### Elastic training through node failures (`make bench-cluster`, `scripts/bench/elastic.py`)"
SEQ, MICRO = 64, 4


def cluster(*args: str) -> str:
    out = subprocess.run([str(CLUSTER), *args], check=True, cwd=ROOT, env=ENV, capture_output=True, text=True)
    return out.stdout


def rows(run: Path) -> list[dict]:
    """metrics.jsonl's whole step lines (the last line may be half-written while the job runs)."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except OSError:
        return []
    lines = text.splitlines()[:None if text.endswith("\n") else -1]
    return [r for r in map(json.loads, lines) if "loss" in r and "replicas" in r]


def config(work: Path, name: str, data: str, minutes: float, sync: str) -> Path:
    import yaml
    cfg = {"run": {"name": name, "output_dir": str(work / name), "seed": 5},
           "model": {"builtin": "gpt2", "gpt2": {"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": SEQ,
                                                 "vocab_size": 512}},
           "data": {"train": data, "seq_len": SEQ},
           "train": {"micro_batch_size": MICRO, "max_steps": 10_000_000, "max_time": int(minutes * 60), "log_every": 1},
           "optimizer": {"name": "adamw", "lr": 1e-3}, "lr_schedule": {"name": "constant", "warmup_steps": 10},
           "checkpoint": {"every": 0}, "tensorboard": {"enabled": False}, "engine": {"threads": 1},
           "distributed": {"elastic": True}}
    if sync == "diloco":
        cfg["distributed"].update(sync="diloco", diloco={"inner_steps": 20, "group": 1})
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(cfg: Path, log: Path) -> subprocess.Popen:
    cmd = [str(CLUSTER), "ompi", "--with-ft", "ulfm", "--map-by", "node:OVERSUBSCRIBE",
           "--host", ",".join(f"{n}:1" for n in NODES), "-np", str(len(NODES)), "-x", f"PYTHONPATH={ROOT}",
           str(VENV / "bin" / "trainrun"), "--config", str(cfg)]
    fh = open(log, "w")
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV, start_new_session=True)


def ranks_on(node: str) -> int:
    out = cluster("exec", node, "sh", "-c", "for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline 2>/dev/null; "
                  "echo; done | grep -c '[/]bin/trainrun' || true")
    return int(out.strip() or 0)


def wait_rows(run: Path, proc: subprocess.Popen, what, timeout: float) -> dict | None:
    """The first step line from now on for which ``what(row)`` holds, polled every 20 ms; None past ``timeout`` or
    at the end."""
    deadline, seen = time.monotonic() + timeout, len(rows(run))
    while time.monotonic() < deadline and proc.poll() is None:
        rs = rows(run)
        for r in rs[seen:]:
            if what(r):
                return r
        seen = len(rs)
        time.sleep(0.02)
    return None


def faulted(work: Path, cfg: Path, kill_every: float, relaunch_after: float) -> dict:
    run, log = work / "faulted", work / "faulted.log"
    proc = start(cfg, log)
    events, turn = [], 0
    try:
        if wait_rows(run, proc, lambda r: True, 300) is None:
            raise SystemExit(f"bench-elastic: the faulted run did not start (see {log})")
        next_kill = time.monotonic() + kill_every
        while proc.poll() is None:
            if time.monotonic() < next_kill:
                time.sleep(0.2)
                continue
            victims = [n for n in (NODES[1:] if turn % 2 == 0 else NODES[:0:-1]) if ranks_on(n)]
            turn += 1
            if not victims:
                next_kill += kill_every
                continue
            before = rows(run)[-1]["replicas"]
            t_kill = time.time()
            cluster("kill", victims[0], "/bin/trainrun")
            row = wait_rows(run, proc, lambda r: r["replicas"] < before, kill_every)
            ev = {"node": victims[0], "killed_at": t_kill, "to_next_step_s": time.time() - t_kill if row else None}
            time.sleep(max(0.0, t_kill + relaunch_after - time.time()))
            if proc.poll() is not None:
                break
            t_back = time.time()
            ev["to_first_step_s"] = None
            while proc.poll() is None and time.time() - t_back < kill_every:     # one rank back a request
                now = rows(run)[-1]["replicas"]
                subprocess.run([str(BIN / "trainrun"), "rejoin", str(run)], capture_output=True, env=ENV)
                if wait_rows(run, proc, lambda r: r["replicas"] > now, 30) is not None and \
                        rows(run)[-1]["replicas"] == len(NODES):
                    ev["to_first_step_s"] = time.time() - t_back
                    break
            events.append(ev)
            print(f"bench-elastic: killed {ev['node']}: next step {ev['to_next_step_s']}, back {ev['to_first_step_s']}",
                  flush=True)
            next_kill = t_kill - time.time() + time.monotonic() + kill_every
        rc = finish(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"rc": rc, "events": events, **throughput(run)}


def finish(proc: subprocess.Popen, log: Path) -> int:
    """The job's exit status once its ranks are done (``done:`` or the train.max_time line in ``log``); an mpirun
    still there 30 s later (across nodes, Open MPI's mpirun stayed after ranks that stopped with exit 75) is
    killed, the status then the ranks' 75."""
    said = ("trainrun: stopped by train.max_time", "\ndone: ")
    while proc.poll() is None and not any(s in log.read_text(errors="replace") for s in said):
        time.sleep(1)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 75


def throughput(run: Path) -> dict:
    rs = rows(run)
    tokens = sum(r["replicas"] for r in rs) * MICRO * SEQ
    return {"steps": len(rs), "tokens": tokens, "train_s": rs[-1]["elapsed_s"] if rs else None,
            "tokens_per_sec": tokens / rs[-1]["elapsed_s"] if rs and rs[-1]["elapsed_s"] else None,
            "final_loss": statistics.fmean(r["loss"] for r in rs[-20:]) if rs else None}


def fault_free(work: Path, cfg: Path) -> dict:
    run, log = work / "fault-free", work / "fault-free.log"
    proc = start(cfg, log)
    try:
        rc = finish(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if rc not in (0, 75) or not rows(run):
        raise SystemExit(f"bench-elastic: the fault-free run failed (exit {rc}; see {log})")
    return {"rc": rc, **throughput(run)}


def render(r: dict) -> str:
    a, b = r["faulted"], r["fault_free"]
    kills = [e["to_next_step_s"] for e in a["events"] if e["to_next_step_s"] is not None]
    backs = [e["to_first_step_s"] for e in a["events"] if e["to_first_step_s"] is not None]
    def span(xs):
        return f"{statistics.median(xs):.2f} s (median; {min(xs):.2f}-{max(xs):.2f})" if xs else "n/a"
    ratio = a["tokens_per_sec"] / b["tokens_per_sec"] if a["tokens_per_sec"] and b["tokens_per_sec"] else None
    return "\n".join([
        BEGIN,
        f"`{r['command']}`, started {r['started']}, on {r['cpu']} ({os.cpu_count()} cores shared by the 3 nodes); "
        f"{r['sync']}, a tiny GPT-2 (2 x 64, seq {SEQ}, micro-batch {MICRO}), 3 nodes x 1 rank on Open MPI's ULFM; "
        f"{r['minutes']} min each, a node's ranks killed every {r['kill_every']} s and taken back "
        f"{r['relaunch_after']} s later (`trainrun rejoin`).",
        "",
        "| run | steps | tokens | train s | tokens/s | mean loss, last 20 steps |",
        "|---|---|---|---|---|---|",
        *[f"| {name} | {x['steps']:,} | {x['tokens']:,} | {x['train_s']:.0f} | {x['tokens_per_sec']:,.0f} | "
          f"{x['final_loss']:.3f} |" for name, x in (("fault-free", b), ("faulted", a))],
        "",
        f"- tokens/s, faulted / fault-free: **{ratio:.3f}**" if ratio else "- tokens/s ratio: n/a",
        f"- kills: {len(a['events'])}; kill -> the survivors' next step: {span(kills)}",
        f"- relaunch (`trainrun rejoin`) -> the node's first step: {span(backs)} ({len(backs)} of "
        f"{len(a['events'])} back)",
        END])


def dataset(work: Path) -> str:
    out = work / "data"
    if not (out / "train" / "manifest.json").exists():
        subprocess.run([str(BIN / "trainrun-data"), "tokens", "--input", sysconfig.get_paths()["stdlib"], "--output",
                        str(out), "--bytes", "--include", "*.py", "--no-progress", "--overwrite"], check=True,
                       stdout=subprocess.DEVNULL)
    return str(out / "train")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--kill-every", type=float, default=120)
    ap.add_argument("--relaunch-after", type=float, default=30)
    ap.add_argument("--sync", choices=["every_step", "diloco"], default="every_step")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-elastic"))
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="print the section, leave --output alone")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench-elastic: the pretend cluster needs root")
    if not (VENV / "bin" / "mpirun").exists():
        raise SystemExit(f"bench-elastic: no Open MPI venv at {VENV}: make setup-elastic")
    work = Path(args.work)
    if work.exists():
        import shutil
        shutil.rmtree(work)
    work.mkdir(parents=True)
    data = dataset(work)
    result = {"command": "python scripts/bench/elastic.py " + " ".join(sys.argv[1:]),
              "started": time.strftime("%Y-%m-%d %H:%M"), "cpu": common.cpu_name(), "sync": args.sync,
              "minutes": args.minutes, "kill_every": args.kill_every, "relaunch_after": args.relaunch_after}
    cluster("up", str(len(NODES)))
    try:
        result["fault_free"] = fault_free(work, config(work, "fault-free", data, args.minutes, args.sync))
        result["faulted"] = faulted(work, config(work, "faulted", data, args.minutes, args.sync), args.kill_every,
                                    args.relaunch_after)
    finally:
        cluster("down")
    (work / "elastic.json").write_text(json.dumps(result, indent=1))
    text = render(result)
    print(text)
    if not args.no_write:
        common.write_section(args.output, text, BEGIN, END, HEADING)
    return 0 if {result["faulted"]["rc"], result["fault_free"]["rc"]} <= {0, 75} else 1     # 75: train.max_time


if __name__ == "__main__":
    sys.exit(main())
