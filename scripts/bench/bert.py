"""BERT pre-training (configs/bert-tiny.yaml: 2 layers, hidden 128, seq 128) against PyTorch DDP, tokens/s.

    .venv/bin/python scripts/bench/bert.py [--steps 60] [--rounds 3] [--out runs/bench-bert] [--profile]

Both train the same model from the same initial weights on the same batches: trainrun's built-in BERT
(`mpirun -np 2 trainrun --config configs/bert-tiny.yaml`, 1 thread a rank) and transformers'
`BertForPreTraining` (erf GELU, no dropout, the MLM decoder tied) under `torchrun --nproc_per_node 2`
(DistributedDataParallel, gloo, 1 thread a rank), both with AdamW (lr 2e-3 constant, betas (0.9, 0.98),
eps 1e-6, weight decay 0.01), clipping at 1.0, global batch 32 (16 a rank). The data are the recipe's:
`trainrun-data bert` on the top-level stdlib modules (WordPiece 2048, 20 predictions a sample); with
data.shuffle off step t takes samples 32 (t-1) .. 32 t - 1, rank r its r-th 16, and PyTorch reads the same
.pb files (trainrun's reader, in that order) into transformers' labels (-100 except at the masked positions).
PyTorch runs twice a round: transformers' model as a user gets it (the MLM head at every position), and
the same modules with the MLM head at the masked positions only, as trainrun's graph (and ORT's and
NVIDIA's BERT) does: like for like.
tokens/s = 32 x 128 x timed steps / time between the end of step WARM and the last step (trainrun:
metrics.jsonl's elapsed_s; PyTorch: perf_counter around the same steps); rounds alternate the two, and
the ratio is the median of the per-round ratios. The final losses of both are printed as a sanity check
(same start, same data: they agree to a few percent). Then the forward+backward alone at 1 thread, the
three interleaved step by step in one process (load hits them alike). `--profile`: one more trainrun run profiles
steps 30-34 with onnxruntime's profiler (`trainrun profile summarize`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(HERE))
import common  # noqa: E402

WARM = 10
RANK_BATCH = 16
OPT = dict(lr=2e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)


def torch_rank(args) -> None:
    """One DDP rank (run by torchrun): time steps WARM+1 .. steps; rank 0 writes tokens/s to args.result."""
    import torch
    import torch.distributed as dist
    from safetensors.numpy import load_file
    from transformers import BertConfig, BertForPreTraining
    from transformers.utils import logging as hf_logging

    from trainrun.data import open_dataset
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = json.loads(args.shape)
    net = BertForPreTraining(BertConfig(**shape))
    weights = load_file(args.weights)
    missing = net.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False).missing_keys
    assert set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}, missing

    class MaskedHead(torch.nn.Module):
        """transformers' BertForPreTraining with its MLM head at the masked positions only (trainrun's loss:
        mean over the used prediction slots, id 0 = unused, + the NSP loss)."""

        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, input_ids, token_type_ids, attention_mask, masked_lm_positions, masked_lm_ids,
                    next_sentence_label):
            seq, pooled = self.net.bert(input_ids=input_ids, token_type_ids=token_type_ids,
                                        attention_mask=attention_mask, return_dict=False)[:2]
            at = seq.gather(1, masked_lm_positions[..., None].expand(-1, -1, seq.shape[-1]))
            mlm, nsp = self.net.cls(at, pooled)
            ce = torch.nn.functional.cross_entropy
            return ce(mlm.reshape(-1, mlm.shape[-1]), masked_lm_ids.reshape(-1), ignore_index=0) + ce(
                nsp, next_sentence_label)

    model = torch.nn.parallel.DistributedDataParallel(net if args.head == "full" else MaskedHead(net))
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    ds = open_dataset(args.data, 128, verify=False)
    feeds = []                           # converted up front: trainrun's loader prefetches too
    for t in range(args.steps):          # data.shuffle off: step t+1 takes samples 32 t .. 32 t + 31
        first = (t * world + rank) * RANK_BATCH
        b = ds.read(np.arange(first, first + RANK_BATCH) % ds.num_samples, ds.new_batch(RANK_BATCH))
        labels = np.full(b["input_ids"].shape, -100, np.int64)
        rows = np.arange(len(labels))[:, None].repeat(b["masked_lm_ids"].shape[1], 1)
        used = b["masked_lm_ids"] != 0
        labels[rows[used], b["masked_lm_positions"][used]] = b["masked_lm_ids"][used]
        feeds.append({"input_ids": b["input_ids"], "token_type_ids": b["segment_ids"],
                      "attention_mask": b["input_mask"], "next_sentence_label": b["next_sentence_labels"],
                      **({"labels": labels} if args.head == "full" else
                         {"masked_lm_positions": b["masked_lm_positions"], "masked_lm_ids": b["masked_lm_ids"]})})
    feeds = [{k: torch.from_numpy(np.ascontiguousarray(v, np.int64)) for k, v in f.items()} for f in feeds]
    def loss_at(t):
        out = model(**feeds[t - 1])
        return out.loss if args.head == "full" else out

    elapsed, last = common.ddp_timed_steps(model, opt, args.steps, WARM, loss_at)
    final = torch.tensor([last])
    dist.all_reduce(final)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"tokens_per_s": (args.steps - WARM) * world * RANK_BATCH * 128
                                                 / elapsed, "final_loss": float(final) / world}))
    dist.destroy_process_group()


def compute_only(work: Path, shape: dict, iters: int = 30) -> dict:
    """Forward + backward alone, 1 thread, one process, the three interleaved step by step (so that a shared
    machine's load hits them alike): trainrun's train graph on its Engine, transformers' model (head at every
    position) and the masked-head form, on one batch of the data; medians of ms a step after 5 untimed."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    from trainrun.data import open_dataset
    from trainrun.step.engine import Engine, EngineOptions
    from trainrun.models.bert import INPUTS
    torch.set_num_threads(1)
    ds = open_dataset(work / "data" / "train", 128, verify=False)
    batch = ds.read(np.arange(RANK_BATCH), ds.new_batch(RANK_BATCH))
    shapes = {k: (batch[k].shape, np.int64) for k in INPUTS}
    eng = Engine(str(work / "graphs"), EngineOptions(threads=1), shapes, shapes)
    eng.load_weights()
    net = BertForPreTraining(BertConfig(**shape))
    tb = {k: torch.from_numpy(np.ascontiguousarray(v, np.int64)) for k, v in batch.items()}
    labels = torch.full(tb["input_ids"].shape, -100)
    for b in range(RANK_BATCH):
        used = tb["masked_lm_ids"][b] != 0
        labels[b, tb["masked_lm_positions"][b][used]] = tb["masked_lm_ids"][b][used]
    ce = torch.nn.functional.cross_entropy

    def full():
        return net(input_ids=tb["input_ids"], token_type_ids=tb["segment_ids"], attention_mask=tb["input_mask"],
                   labels=labels, next_sentence_label=tb["next_sentence_labels"]).loss

    def masked():
        seq, pooled = net.bert(input_ids=tb["input_ids"], token_type_ids=tb["segment_ids"],
                               attention_mask=tb["input_mask"], return_dict=False)[:2]
        mlm, nsp = net.cls(seq.gather(1, tb["masked_lm_positions"][..., None].expand(-1, -1, seq.shape[-1])), pooled)
        return ce(mlm.reshape(-1, mlm.shape[-1]), tb["masked_lm_ids"].reshape(-1), ignore_index=0) + ce(
            nsp, tb["next_sentence_labels"])

    def torch_step(loss_fn):
        net.zero_grad(set_to_none=True)
        loss_fn().backward()

    steps = {"trainrun": lambda: eng.forward_backward(batch, accumulate=False),
             "torch": lambda: torch_step(full), "torch_masked_head": lambda: torch_step(masked)}
    ms = {k: [] for k in steps}
    for _ in range(iters):
        for k, f in steps.items():
            t = time.perf_counter()
            f()
            ms[k].append(1e3 * (time.perf_counter() - t))
    return {k: float(np.median(v[5:])) for k, v in ms.items()}


def trainrun_sets(work: Path, run_dir: Path, steps: int) -> dict:
    return {"run.output_dir": run_dir, "data.train": work / "data" / "train", "data.eval": "null",
            "data.shuffle": "false", "train.max_steps": steps, "train.log_every": 5,
            "train.micro_batch_size": RANK_BATCH, "train.gradient_accumulation_steps": 1,
            "lr_schedule.name": "constant", "lr_schedule.warmup_steps": 0, "checkpoint.every": 0,
            "tensorboard.enabled": "false", "engine.threads": 1, "optimizer.lr": OPT["lr"],
            "optimizer.betas": json.dumps(list(OPT["betas"])), "optimizer.eps": OPT["eps"],
            "optimizer.weight_decay": OPT["weight_decay"], "optimizer.max_grad_norm": 1.0}


def trainrun_cmd(sub: str, sets: dict) -> list[str]:
    cmd = [str(BIN / "trainrun"), *([sub] if sub else []), "--config", str(ROOT / "configs" / "bert-tiny.yaml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def env() -> dict:
    return dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1")


def trainrun_once(work: Path, steps: int, profile: bool = False) -> dict:
    run_dir = work / ("profiled" if profile else "trainrun")
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    sets = trainrun_sets(work, run_dir, steps)
    if profile:
        sets |= {"profile.start_step": 30, "profile.steps": 5}
    subprocess.run([str(BIN / "mpirun"), "-np", "2", *trainrun_cmd("", sets), "--log-level", "warning"],
                   check=True, env=env())
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    el = {r["step"]: r["elapsed_s"] for r in rows if "loss" in r}
    return {"tokens_per_s": (steps - WARM) * 2 * RANK_BATCH * 128 / (el[steps] - el[WARM]),
            "final_loss": [r["loss"] for r in rows if r.get("step") == steps and "loss" in r][0],
            "run_dir": str(run_dir)}


def torch_once(work: Path, steps: int, shape: dict, head: str) -> dict:
    result = work / "torch.json"
    subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29532", __file__,
                    "--torch-rank", "--head", head, "--data", str(work / "data" / "train"), "--steps", str(steps),
                    "--weights", str(work / "graphs" / "weights.safetensors"), "--shape", json.dumps(shape),
                    "--result", str(result)], check=True, env=env(), timeout=600,
                   stdout=open(work / f"torch-{head}.log", "w"), stderr=subprocess.STDOUT)
    return json.loads(result.read_text())


def prepare(work: Path) -> dict:
    """The recipe's data (once) and trainrun's initial weights; returns the model shape for transformers."""
    if not (work / "data" / "train").is_dir():
        stdlib = sysconfig.get_paths()["stdlib"]
        subprocess.run([str(BIN / "trainrun-data"), "bert", "--input", f"{stdlib}/*.py", "--output",
                        str(work / "data"), "--train-wordpiece", "2048", "--seq-len", "128", "--max-predictions", "20",
                        "--dupe-factor", "1", "--eval-fraction", "0.02", "--no-progress"], check=True, env=env())
    graphs = work / "graphs"
    subprocess.run(["rm", "-rf", str(graphs)], check=True)
    subprocess.run(trainrun_cmd("prepare", trainrun_sets(work, work / "prepared", 1)), check=True, env=env(),
                   capture_output=True)
    os.replace(work / "prepared" / "graphs", graphs)
    from trainrun import config as C
    bert = C.load_config(str(ROOT / "configs" / "bert-tiny.yaml")).model.bert
    return {k: getattr(bert, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "intermediate_size", "max_position_embeddings", "type_vocab_size",
                                          "hidden_act", "layer_norm_eps", "hidden_dropout_prob",
                                          "attention_probs_dropout_prob")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-bert"))
    ap.add_argument("--profile", action="store_true", help="one more trainrun run with onnxruntime's profiler")
    ap.add_argument("--torch-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--head", choices=["full", "masked"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_rank:
        return torch_rank(args)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    shape = prepare(work)
    ours, theirs, like = [], [], []
    for r in range(args.rounds):         # alternate, so that load on a shared machine hits all alike
        ours.append(trainrun_once(work, args.steps))
        theirs.append(torch_once(work, args.steps, shape, "full"))
        like.append(torch_once(work, args.steps, shape, "masked"))
        print(f"round {r + 1}: trainrun {ours[-1]['tokens_per_s']:,.0f} tokens/s, PyTorch DDP "
              f"{theirs[-1]['tokens_per_s']:,.0f} tokens/s (ratio {ours[-1]['tokens_per_s'] / theirs[-1]['tokens_per_s']:.2f}), "
              f"with the MLM head at the masked positions {like[-1]['tokens_per_s']:,.0f} tokens/s "
              f"(ratio {ours[-1]['tokens_per_s'] / like[-1]['tokens_per_s']:.2f})", flush=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
    like_ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, like)]
    summary = {"steps": args.steps, "timed_steps": args.steps - WARM, "global_batch": 2 * RANK_BATCH, "seq_len": 128,
               "shape": shape, "trainrun_tokens_per_s": [a["tokens_per_s"] for a in ours],
               "ddp_tokens_per_s": [b["tokens_per_s"] for b in theirs], "ratios": ratios,
               "median_ratio": float(np.median(ratios)),
               "ddp_masked_head_tokens_per_s": [b["tokens_per_s"] for b in like], "masked_head_ratios": like_ratios,
               "median_masked_head_ratio": float(np.median(like_ratios)),
               "final_loss": {"trainrun": ours[-1]["final_loss"], "ddp": theirs[-1]["final_loss"],
                              "ddp_masked_head": like[-1]["final_loss"]},
               "loadavg": os.getloadavg()[0], "started": started}
    summary["compute_only_ms"] = compute_only(work, shape)
    print("forward+backward alone, 1 thread, interleaved (ms a step, median): " +
          ", ".join(f"{k} {v:.1f}" for k, v in summary["compute_only_ms"].items()), flush=True)
    if args.profile:
        prof = trainrun_once(work, 40, profile=True)
        out = subprocess.run([str(BIN / "trainrun"), "profile", "summarize", prof["run_dir"], "--top", "8"],
                             capture_output=True, text=True)
        summary["profile"] = out.stdout or out.stderr
        print(summary["profile"])
    (work / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"median: trainrun {np.median(summary['trainrun_tokens_per_s']):,.0f} tokens/s, PyTorch DDP "
          f"{np.median(summary['ddp_tokens_per_s']):,.0f} tokens/s, trainrun/DDP {summary['median_ratio']:.2f}x "
          f"(2 ranks x 1 thread, global batch 32 x 128); with the MLM head at the masked positions "
          f"{np.median(summary['ddp_masked_head_tokens_per_s']):,.0f} tokens/s, trainrun/DDP "
          f"{summary['median_masked_head_ratio']:.2f}x; final loss trainrun {summary['final_loss']['trainrun']:.4f}, "
          f"DDP {summary['final_loss']['ddp']:.4f} / {summary['final_loss']['ddp_masked_head']:.4f}")


if __name__ == "__main__":
    main()
