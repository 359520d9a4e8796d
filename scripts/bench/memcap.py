"""Peak RSS per rank, trainrun against PyTorch DDP, over GPT-2 shapes: which fits under a per-rank cap.

    .venv/bin/python scripts/bench/memcap.py [--work runs/bench-memcap] [--shapes 12x768,12x1024,24x1024]
        [--heads-dim 64] [--seq 256 --vocab 50257 --micro-batch 2] [--cap-mb 6144] [--stage 1] [--ranks 2]

Per shape (depth x width, n_head = width / ``--heads-dim``), one after the other on the same machine:

* trainrun (its graphs prepared by the run itself on rank 0, or with ``--prepare-first`` by
  ``trainrun prepare`` in a process of its own before), ``--ranks`` ranks x 1 thread, ``distributed.zero_stage`` ``--stage``, AdamW, 3 steps with a
  checkpoint at step 2 (a periodic one, written while step 3 runs) and the end-of-run checkpoint and
  export at step 3: the whole-run peak RSS of every rank (scripts/bench/trainrun_rank.py), the rank that
  writes the checkpoints and exports included, and the peak of the training steps before the first
  checkpoint;
* PyTorch DDP (scripts/bench/torch_train.py: transformers GPT2LMHeadModel, AdamW, gloo), the same ranks,
  batch and data, 1 untimed + 2 timed steps, its own initialisation (no weights file loaded): peak RSS
  per rank at the end.

A shape fits when every rank's peak is at most ``--cap-mb``. Once a side exceeds the cap the larger
shapes are skipped for it (``--shapes`` ascending). Writes WORK/memcap.json and prints a table.
Memory only: the step times of a few steps on a loaded machine mean nothing here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BIN = common.BIN


def sh(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def model(layers: int, width: int, a) -> common.BenchModel:
    return common.BenchModel(f"{layers}x{width}", n_layer=layers, n_head=width // a.heads_dim, n_embd=width,
                             seq_len=a.seq, vocab_size=a.vocab, global_batch=a.micro_batch * a.ranks, warmup=1,
                             steps=2, quick_steps=2)


def run_trainrun(m: common.BenchModel, a, work: Path, data: Path) -> dict:
    out = work / f"trainrun-{m.name}"
    shutil.rmtree(out, ignore_errors=True)
    sets = common.run_sets(m, out, str(data / "train"), a.micro_batch, threads=1, warmup=1, steps=2) + [
        "optimizer.name=adamw", f"distributed.zero_stage={a.stage}", "checkpoint.every=2", "train.log_every=1"]
    rss = out / "rss"
    if a.prepare_first:     # the graphs built by `trainrun prepare` in a process of its own, as zero.py does
        sh([BIN / "trainrun", "prepare", "--config", common.CONFIG, *[x for s in sets for x in ("--set", s)]],
           stdout=subprocess.DEVNULL)
    sh([BIN / "mpirun", "-np", a.ranks, sys.executable, common.HERE / "trainrun_rank.py", "--rss-dir", rss, "--",
        "train", "--config", common.CONFIG, *[x for s in sets for x in ("--set", s)]])
    ranks = [json.loads((rss / f"rss-{r}.json").read_text()) for r in range(a.ranks)]
    exported = (out / "model.onnx").exists()
    shutil.rmtree(out, ignore_errors=True)          # GBs of checkpoints and graphs
    return {"peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
            "train_peak_rss_mb": [r.get("train_peak_rss_mb") for r in ranks], "exported": exported}


def run_ddp(m: common.BenchModel, a, work: Path, data: Path) -> dict:
    out = work / f"ddp-{m.name}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sh([BIN / "torchrun", "--nproc_per_node", a.ranks, "--master_port", 29500 + os.getpid() % 500,
        Path(__file__).resolve(), "--ddp-worker", json.dumps(common.asdict_model(m)), "--",
        "--model", m.name, "--micro-batch", a.micro_batch, "--threads", 1, "--warmup", 1, "--steps", 2,
        "--data", data / "train", "--out", out], env=env)
    return {"peak_rss_mb": json.loads(out.read_text())["peak_rss_mb"]}


def ddp_worker(argv: list[str]) -> None:
    """A torchrun rank: torch_train.py with this script's shape registered as a model."""
    import torch_train
    fields = json.loads(argv[0])
    m = common.BenchModel(**{k: fields[k] for k in common.BenchModel.__dataclass_fields__})
    common.MODELS[m.name] = m
    sys.argv = ["torch_train.py", *argv[2:]]
    torch_train.main()


def main() -> int:
    if sys.argv[1:2] == ["--ddp-worker"]:
        ddp_worker(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench-memcap"))
    ap.add_argument("--shapes", default="12x768,12x1024,16x1024,24x1024", help="depth x width, ascending")
    ap.add_argument("--heads-dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stage", type=int, default=1, help="trainrun's distributed.zero_stage")
    ap.add_argument("--cap-mb", type=float, default=6144.0)
    ap.add_argument("--sides", default="trainrun,ddp")
    ap.add_argument("--prepare-first", action="store_true",
                    help="trainrun: prepare the graphs in a process of its own first (else the run prepares them: "
                         "rank 0's peak includes building the graphs)")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not (data / "train").exists():     # raw bytes of the repo's own sources: token ids < any vocab
        sh([BIN / "trainrun-data", "tokens", "--input", common.ROOT / "trainrun", "--input", common.ROOT / "tests",
            "--output", data, "--bytes", "--eval-fraction", "0", "--no-progress"])
    sides = {"trainrun": run_trainrun, "ddp": run_ddp}
    over = set()
    rows = []
    for shape in a.shapes.split(","):
        layers, width = (int(x) for x in shape.split("x"))
        m = model(layers, width, a)
        row = {"shape": m.name, "n_layer": layers, "n_embd": width, "n_head": m.n_head, "parameters": m.params()}
        for side in a.sides.split(","):
            if side in over:
                row[side] = None
                continue
            row[side] = sides[side](m, a, work, data)
            if max(row[side]["peak_rss_mb"]) > a.cap_mb:
                over.add(side)
        rows.append(row)
        common.write_json(work / "memcap.json", {"machine": common.machine(), "seq": a.seq, "vocab": a.vocab,
                                                 "prepare_first": a.prepare_first,
                                                 "micro_batch": a.micro_batch, "ranks": a.ranks,
                                                 "zero_stage": a.stage, "cap_mb": a.cap_mb, "rows": rows})
    print(f"\nGPT-2 at seq {a.seq}, vocab {a.vocab}, micro-batch {a.micro_batch}, {a.ranks} ranks x 1 thread, AdamW; "
          f"trainrun zero_stage {a.stage}; peak RSS MB per rank (cap {a.cap_mb:.0f})")
    print("| shape | parameters | trainrun whole run | trainrun training steps | PyTorch DDP | fits: trainrun / DDP |")
    print("|---|---|---|---|---|---|")
    fmt = lambda v: ", ".join(f"{x:.0f}" for x in v) if v else "-"  # noqa: E731
    for r in rows:
        t, d = r.get("trainrun"), r.get("ddp")
        fits = lambda x: "-" if not x else ("yes" if max(x["peak_rss_mb"]) <= a.cap_mb else "no")  # noqa: E731
        print(f"| {r['shape']} | {r['parameters'] / 1e6:.0f}M | {fmt(t and t['peak_rss_mb'])} | "
              f"{fmt(t and t['train_peak_rss_mb'])} | {fmt(d and d['peak_rss_mb'])} | {fits(t)} / {fits(d)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
