"""SmolLM2-135M (configs/smollm2-135m.yaml) against PyTorch DDP with transformers' LlamaForCausalLM (SDPA):
one run each, 2 ranks x 1 thread, seq 512, micro-batch 1 per rank; writes its BENCHMARKS.md section alone
(report.merge keeps the others).

    .venv/bin/python scripts/bench/smollm2.py [--work runs/bench/smollm2] [--warmup 2 --steps 3]

Data: raw UTF-8 bytes of a few standard-library packages (`trainrun-data tokens --bytes`: token ids below the
vocabulary; what the tokens are does not change a step's time). trainrun: ``mpirun -np 2 trainrun --config
configs/smollm2-135m.yaml --set ...`` through trainrun_rank.py (peak RSS per rank during the training steps);
tokens/s = median of metrics.jsonl's per-step tokens/s after the warm-up. DDP: torch_train.py ``--llama`` on
the same data, data order and initial weights (the run's weights.safetensors); tokens/s from its median step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import report  # noqa: E402

SECTION = "## SmolLM2-135M against PyTorch DDP"
CONFIG = common.ROOT / "configs" / "smollm2-135m.yaml"
SEQ, RANKS, MICRO = 512, 2, 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench" / "smollm2"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--output", default=str(common.ROOT / "BENCHMARKS.md"))
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    data = work / "data"
    subprocess.run([str(common.BIN / "trainrun-data"), "tokens", "--input", str(lib / "email"), str(lib / "json"),
                    "--output", str(data), "--bytes", "--eval-fraction", "0", "--no-progress"], check=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = [open("/proc/loadavg").read().split()[0]]
    run = work / "run"
    sets = [f"run.output_dir={run}", f"data.train={data / 'train'}", "data.eval=null", f"data.seq_len={SEQ}",
            f"train.micro_batch_size={MICRO}", "train.gradient_accumulation_steps=1",
            f"train.max_steps={args.warmup + args.steps}", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=0", "tensorboard.enabled=false", "engine.threads=1", "lr_schedule.warmup_steps=2"]
    t0 = time.perf_counter()
    subprocess.run([str(common.BIN / "mpirun"), "-np", str(RANKS), sys.executable, str(common.HERE / "trainrun_rank.py"),
                    "--rss-dir", str(work), "--", "--config", str(CONFIG)] + [x for s in sets for x in ("--set", s)],
                   check=True, timeout=1800)
    ours = {"wall_s": round(time.perf_counter() - t0, 1)}
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [r for r in recs if "tokens_per_sec" in r and r.get("step", 0) > args.warmup]
    ours["tokens_per_sec"] = statistics.median(r["tokens_per_sec"] for r in steady)
    rss = [common.read_json(p) for p in sorted(work.glob("rss-*.json"))]
    ours["train_rss_mb"] = [r.get("train_peak_rss_mb", r["peak_rss_mb"]) for r in rss]
    load.append(open("/proc/loadavg").read().split()[0])
    out_json = work / "ddp.json"
    t0 = time.perf_counter()
    subprocess.run([str(common.BIN / "torchrun"), "--nproc_per_node", str(RANKS), "--master_port", "29731",
                    str(common.HERE / "torch_train.py"), "--llama", str(CONFIG), "--seq-len", str(SEQ),
                    "--micro-batch", str(MICRO), "--threads", "1", "--warmup", str(args.warmup),
                    "--steps", str(args.steps), "--data", str(data / "train"),
                    "--weights", str(run / "graphs" / "weights.safetensors"), "--out", str(out_json)],
                   check=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    r = common.read_json(out_json)
    ddp = {"wall_s": round(time.perf_counter() - t0, 1), "tokens_per_sec": RANKS * MICRO * SEQ / (r["step_ms_median"] / 1e3),
           "train_rss_mb": r["peak_rss_mb"], "attn": r["attn_implementation"]}
    load.append(open("/proc/loadavg").read().split()[0])
    common.write_json(work / "results.json", {"trainrun": ours, "ddp": ddp, "load": load, "started": started,
                                              "machine": common.machine()})
    ratio = ours["tokens_per_sec"] / ddp["tokens_per_sec"]
    rss_ok = max(ours["train_rss_mb"]) <= min(ddp["train_rss_mb"])
    old = Path(args.output).read_text() if Path(args.output).exists() else ""
    m = common.machine()
    section = [SECTION + "\n",
               f"configs/smollm2-135m.yaml's model (576 wide, 30 layers, 9 query heads on 3 key/value heads, "
               f"vocabulary 49152 tied), seq {SEQ}, micro-batch {MICRO} per rank, 2 ranks x 1 thread, AdamW; "
               f"{args.warmup} warm-up steps then {args.steps} timed, one run each (trainrun first), started "
               f"{started} on {m.get('cpu')}, {m.get('cores')} cores, SHARED with other jobs (1-minute load "
               f"average {', '.join(load)} before, between and after): a rough figure, not a standing claim. "
               f"`.venv/bin/python scripts/bench/smollm2.py`.\n",
               "| setup | tokens/s | peak RSS per rank (MB, training steps) | run wall time (s) |",
               "|---|---|---|---|",
               f"| trainrun | {ours['tokens_per_sec']:.1f} | {' / '.join(f'{x:.0f}' for x in ours['train_rss_mb'])} | "
               f"{ours['wall_s']} (graphs prepared, end checkpoint and export included) |",
               f"| PyTorch DDP, LlamaForCausalLM ({ddp['attn']}) | {ddp['tokens_per_sec']:.1f} | "
               f"{' / '.join(f'{x:.0f}' for x in ddp['train_rss_mb'])} | {ddp['wall_s']} |",
               "",
               f"trainrun / DDP: {ratio:.2f}x tokens/s (target 1.3x); peak RSS per rank "
               f"{'at most' if rss_ok else 'above'} DDP's.\n"]
    head = [report.HEADLINE + "\n", "| claim | measured | met | section |", "|---|---|---|---|",
            f"| SmolLM2-135M at seq 512, 2x1: >= 1.3x PyTorch DDP tokens/s, peak RSS <= DDP's | {ratio:.2f}x, "
            f"{max(ours['train_rss_mb']):.0f} vs {min(ddp['train_rss_mb']):.0f} MB | "
            f"{'yes' if ratio >= 1.3 and rss_ok else '**no**'} (one loaded run) | [{SECTION[3:]}]({report.anchor(SECTION)}) |", ""]
    pre = report._sections(old)[0] if old else "# trainrun benchmarks\n\n"
    new = pre.rstrip("\n") + "\n\n" + "\n".join(head) + "\n" + "\n".join(section)
    Path(args.output).write_text(report.merge(old, new))
    print(json.dumps({"trainrun": ours, "ddp": ddp, "ratio": ratio, "load": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
