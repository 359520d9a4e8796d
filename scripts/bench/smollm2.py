"""SmolLM2-135M (configs/smollm2-135m.yaml) against PyTorch DDP with transformers' LlamaForCausalLM (SDPA),
full fine-tuning and LoRA: one run each, 2 ranks x 1 thread, seq 512, micro-batch 1 per rank; writes its
BENCHMARKS.md section alone (report.merge keeps the others).

    .venv/bin/python scripts/bench/smollm2.py [--work runs/bench/smollm2] [--warmup 2 --steps 3] [--output FILE]

Data: raw UTF-8 bytes of a few standard-library packages (`trainrun-data tokens --bytes`: token ids below the
vocabulary; what the tokens are does not change a step's time). Four runs, in this order: trainrun (``mpirun -np 2
trainrun --config configs/smollm2-135m.yaml --set ...`` through trainrun_rank.py: peak RSS per rank during the
training steps), then torch_train.py ``--llama`` (DDP) on the same data, data order and initial weights (the run's
weights.safetensors); then both again with LoRA: trainrun's ``model.lora`` (r 16, alpha 32, no dropout, the
family's default targets q_proj and v_proj, PEFT's default for Llama) and torch_train.py ``--lora 16`` (peft's
get_peft_model with the same LoraConfig, the base weights and adapters trainrun started from).

tokens/s: trainrun the median of metrics.jsonl's per-step tokens/s after the warm-up, DDP from its median step.
Optimizer state: trainrun the tensor bytes of the end checkpoint's optimizer.safetensors, DDP every tensor of
torch's ``opt.state``. Gradient bytes reduced per step: trainrun the bytes of the rank's flat fp32 gradient buffer
that the step's one reduction covers (trainrun_rank.py reads it off the engine; on one node the ranks sum it by
reading each other's shared-memory buffers, so summary.json's ``wire_bytes_per_step``, kept in results.json, is
0 there), DDP the trainable parameters' gradient bytes its buckets allreduce.
The 1-minute load average is read before any run (before the data too) and after each: above LOAD_SHARED
before, the box was shared and the section says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from safetensors.numpy import load_file

from trainrun.graphs.lora import digest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import report  # noqa: E402

SECTION = "## SmolLM2-135M against PyTorch DDP"
CONFIG = common.ROOT / "configs" / "smollm2-135m.yaml"
SEQ, RANKS, MICRO = 512, 2, 1
LORA = {"r": 16, "alpha": 32.0}
LORA_TARGETS = ("q_proj", "v_proj")      # PEFT's default for Llama, trainrun's model.lora default for llama
LOAD_SHARED = 1.3                        # 2 cores: an idle box reads well under this; the runs load it to 2
LR_WARMUP = 2                            # both sides: the recipe's lr 3e-3, cosine to 0 after 2 warm-up steps
GOALS = {"full": 1.3, "lora": 1.5, "lora_share": 0.02}


def load1() -> float:
    return common.loadavg()[0]


def tensor_bytes(path: Path) -> int:
    """The bytes of every tensor of a safetensors file (from its header)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def trainrun(work: Path, data: Path, args, extra: list[str]) -> dict:
    work.mkdir(parents=True)
    run = work / "run"
    sets = [f"run.output_dir={run}", f"data.train={data / 'train'}", "data.eval=null", f"data.seq_len={SEQ}",
            f"train.micro_batch_size={MICRO}", "train.gradient_accumulation_steps=1",
            f"train.max_steps={args.warmup + args.steps}", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=0", "tensorboard.enabled=false", "engine.threads=1",
            f"lr_schedule.warmup_steps={LR_WARMUP}",
            *extra]
    t0 = time.perf_counter()
    subprocess.run([str(common.BIN / "mpirun"), "-np", str(RANKS), sys.executable, str(common.HERE / "trainrun_rank.py"),
                    "--rss-dir", str(work), "--", "--config", str(CONFIG)] + [x for s in sets for x in ("--set", s)],
                   check=True, timeout=1800)
    out = {"wall_s": round(time.perf_counter() - t0, 1)}
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [r for r in recs if "tokens_per_sec" in r and r.get("step", 0) > args.warmup]
    out["tokens_per_sec"] = statistics.median(r["tokens_per_sec"] for r in steady)
    out["first_loss"] = next(r["loss"] for r in recs if r.get("step") == 1)
    rss = [common.read_json(p) for p in sorted(work.glob("rss-*.json"))]
    out["train_rss_mb"] = [r.get("train_peak_rss_mb", r["peak_rss_mb"]) for r in rss]
    out["grad_bytes_per_step"] = rss[0]["grad_buffer_bytes"]
    out["wire_bytes_per_step"] = common.read_json(run / "summary.json")["wire_bytes_per_step"]
    ckpt = max((p for p in (run / "checkpoints").iterdir() if (p / "optimizer.safetensors").exists()),
               key=lambda p: p.stat().st_mtime)
    out["optimizer_state_bytes"] = tensor_bytes(ckpt / "optimizer.safetensors")
    out["weights"] = [str(run / "graphs" / "weights.safetensors")]
    out["base_sha256"] = (common.read_json(run / "graphs" / "manifest.json").get("lora") or {}).get("base_sha256")
    return out


def ddp(work: Path, data: Path, args, weights: list[str], extra: list[str]) -> dict:
    out_json = work / "ddp.json"
    t0 = time.perf_counter()
    subprocess.run([str(common.BIN / "torchrun"), "--nproc_per_node", str(RANKS), "--master_port", "29731",
                    str(common.HERE / "torch_train.py"), "--llama", str(CONFIG), "--seq-len", str(SEQ),
                    "--micro-batch", str(MICRO), "--threads", "1", "--warmup", str(args.warmup),
                    "--steps", str(args.steps), "--data", str(data / "train"), *(x for w in weights for x in ("--weights", w)),
                    "--lr-warmup", str(LR_WARMUP), "--min-lr", "0", "--out", str(out_json), *extra],
                   check=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    r = common.read_json(out_json)
    return {"wall_s": round(time.perf_counter() - t0, 1),
            "tokens_per_sec": RANKS * MICRO * SEQ / (r["step_ms_median"] / 1e3), "train_rss_mb": r["peak_rss_mb"],
            "attn": r["attn_implementation"], "grad_bytes_per_step": r["grad_allreduce_bytes"],
            "optimizer_state_bytes": r["optimizer_state_bytes"], "trainable_params": r["trainable_params"],
            "first_loss": r["first_loss"]}


def mb(x: int) -> str:
    return f"{x / 1e6:.1f}" if x >= 1e5 else f"{x / 1e6:.3f}"


def rss_cell(r: dict) -> str:
    return " / ".join(f"{x:.0f}" for x in r["train_rss_mb"])


def render(R: dict, args, old: str) -> str:
    """The headline table (this section's rows) and the section, merged into ``old``."""
    full, lora, load, m = R["full"], R["lora"], R["load"], R["machine"]
    ratio = {k: R[k]["trainrun"]["tokens_per_sec"] / R[k]["ddp"]["tokens_per_sec"] for k in ("full", "lora")}
    rss_ok = {k: max(R[k]["trainrun"]["train_rss_mb"]) <= min(R[k]["ddp"]["train_rss_mb"]) for k in ("full", "lora")}
    share = {k: lora["trainrun"][k] / full["trainrun"][k] if full["trainrun"][k] else float("inf")
             for k in ("optimizer_state_bytes", "grad_bytes_per_step")}
    shared = load[0] > LOAD_SHARED
    loads = ", ".join(f"{x:.2f}" for x in load)
    box = (f"SHARED with other jobs (1-minute load average {load[0]:.2f} before any run, above {LOAD_SHARED}): "
           f"rough figures, not a standing claim" if shared else
           f"idle before the runs (1-minute load average {load[0]:.2f}, at most {LOAD_SHARED})")
    lora_desc = (f"LoRA r {LORA['r']}, alpha {LORA['alpha']:g}, no dropout, on {' and '.join(LORA_TARGETS)} "
                 f"(PEFT's default for Llama; {lora['ddp']['trainable_params']:,} trainable parameters)")
    rows = []
    for k, label in (("full", "full fine-tuning"), ("lora", f"LoRA r {LORA['r']}")):
        ours, theirs = R[k]["trainrun"], R[k]["ddp"]
        torch_label = "PyTorch DDP" + (" + peft" if k == "lora" else "") + f", LlamaForCausalLM ({theirs['attn']})"
        for who, r, extra in (("trainrun", ours, " (graphs prepared, end checkpoint and export included)"),
                              (torch_label, theirs, "")):
            rows.append(f"| {label} | {who} | {r['tokens_per_sec']:.1f} | {rss_cell(r)} | "
                        f"{mb(r['optimizer_state_bytes'])} | {mb(r['grad_bytes_per_step'])} | {r['wall_s']}{extra} |")
    section = [SECTION + "\n",
               f"configs/smollm2-135m.yaml's model (576 wide, 30 layers, 9 query heads on 3 key/value heads, "
               f"vocabulary 49152 tied), seq {SEQ}, micro-batch {MICRO} per rank, 2 ranks x 1 thread, AdamW; full "
               f"fine-tuning, then {lora_desc}, the same on both sides; {args.warmup} warm-up steps then "
               f"{args.steps} timed, one run each (trainrun first), started {R['started']} on {m.get('cpu')}, "
               f"{m.get('cores')} cores, {box}. 1-minute load average {loads} before any run and after each "
               f"(trainrun full, DDP full, trainrun LoRA, DDP LoRA). `.venv/bin/python scripts/bench/smollm2.py`.\n",
               "Optimizer state: trainrun the end checkpoint's optimizer.safetensors (tensor bytes), PyTorch "
               "`opt.state`'s tensors. Gradient bytes reduced per step: trainrun the rank's flat fp32 gradient "
               "buffer, which the step's one reduction covers (on one node by reading the other rank's "
               "shared-memory buffer: nothing on a wire), PyTorch the trainable parameters' gradients DDP's "
               "buckets allreduce.\n",
               "| training | setup | tokens/s | peak RSS per rank (MB, training steps) | optimizer state (MB) | "
               "gradient bytes reduced per step (MB) | run wall time (s) |",
               "|---|---|---|---|---|---|---|", *rows, "",
               f"Full fine-tuning: trainrun / DDP {ratio['full']:.2f}x tokens/s (target {GOALS['full']}x); peak RSS "
               f"per rank {'at most' if rss_ok['full'] else 'above'} DDP's.",
               f"LoRA r {LORA['r']}: trainrun / DDP + peft {ratio['lora']:.2f}x tokens/s (target {GOALS['lora']}x); "
               f"peak RSS per rank {'at most' if rss_ok['lora'] else 'above'} DDP + peft's; trainrun's optimizer "
               f"state {100 * share['optimizer_state_bytes']:.2f}% and gradient bytes reduced per step "
               f"{100 * share['grad_bytes_per_step']:.2f}% of its full fine-tuning's (target under "
               f"{100 * GOALS['lora_share']:.0f}%).\n"]
    lora_ok = ratio["lora"] >= GOALS["lora"] and max(share.values()) < GOALS["lora_share"]
    how = "(one run on a shared box)" if shared else "(one run)"
    link = f"[{SECTION[3:]}]({report.anchor(SECTION)})"
    head = [report.HEADLINE + "\n", "| claim | measured | met | section |", "|---|---|---|---|",
            f"| SmolLM2-135M at seq 512, 2x1: >= {GOALS['full']}x PyTorch DDP tokens/s, peak RSS <= DDP's | "
            f"{ratio['full']:.2f}x, {max(full['trainrun']['train_rss_mb']):.0f} vs "
            f"{min(full['ddp']['train_rss_mb']):.0f} MB | "
            f"{'yes' if ratio['full'] >= GOALS['full'] and rss_ok['full'] else '**no**'} {how} | {link} |",
            f"| SmolLM2-135M LoRA r {LORA['r']} at seq 512, 2x1: >= {GOALS['lora']}x PyTorch DDP + peft tokens/s; "
            f"optimizer state and gradient bytes reduced < {100 * GOALS['lora_share']:.0f}% of full "
            f"fine-tuning's | {ratio['lora']:.2f}x; {100 * share['optimizer_state_bytes']:.2f}% and "
            f"{100 * share['grad_bytes_per_step']:.2f}% (peak RSS {max(lora['trainrun']['train_rss_mb']):.0f} vs "
            f"{min(lora['ddp']['train_rss_mb']):.0f} MB) | {'yes' if lora_ok else '**no**'} {how} | {link} |", ""]
    pre = report._sections(old)[0] if old else "# trainrun benchmarks\n\n"
    new = pre.rstrip("\n") + "\n\n" + "\n".join(head) + "\n" + "\n".join(section)
    return report.merge(old, new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench" / "smollm2"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--output", default=str(common.ROOT / "BENCHMARKS.md"))
    args = ap.parse_args()
    load = [load1()]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    data = work / "data"
    subprocess.run([str(common.BIN / "trainrun-data"), "tokens", "--input", str(lib / "email"), str(lib / "json"),
                    "--output", str(data), "--bytes", "--eval-fraction", "0", "--no-progress"], check=True)
    lora_sets = [f"model.lora.r={LORA['r']}", f"model.lora.alpha={LORA['alpha']}", "model.lora.dropout=0.0"]
    lora_args = ["--lora", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]), "--lora-targets", ",".join(LORA_TARGETS)]
    R = {"started": started, "machine": common.machine(), "load": load}
    for k, sets, extra in (("full", [], []), ("lora", lora_sets, lora_args)):
        ours = trainrun(work / k, data, args, sets)
        load.append(load1())
        weights = ours["weights"]
        if k == "lora":     # its weights.safetensors holds the adapters; the frozen base is the full run's start
            full = R["full"]["trainrun"]["weights"]
            if digest(load_file(full[0])) != ours["base_sha256"]:
                raise SystemExit(f"smollm2: the model.lora run's base weights are not {full[0]}")
            weights = full + weights
        theirs = ddp(work / k, data, args, weights, extra)
        load.append(load1())
        R[k] = {"trainrun": ours, "ddp": theirs}
    common.write_json(work / "results.json", R)
    old = Path(args.output).read_text() if Path(args.output).exists() else ""
    Path(args.output).write_text(render(R, args, old))
    print(json.dumps({k: R[k] for k in ("full", "lora", "load")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
