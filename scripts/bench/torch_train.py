"""What a user would pick instead: transformers' GPT2LMHeadModel (or LlamaForCausalLM) + torch.optim.AdamW,
single process or DistributedDataParallel (gloo), on trainrun's data and batches.

    # DDP, 2 ranks x 1 thread
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 scripts/bench/torch_train.py \
        --model tiny --micro-batch 8 --threads 1 --out ddp.json
    # single process, 2 threads
    .venv/bin/python scripts/bench/torch_train.py --model tiny --micro-batch 16 --threads 2 --out sp.json

Same model (transformers GPT-2, gelu_new, no dropout, tied LM head, default
attention implementation) starting from trainrun's initial weights
(``--weights`` = a prepared graphs folder's weights.safetensors), same data
order (trainrun's TrainLoader: same seed, rank slices and prefetch), same
step: forward, mean cross-entropy, backward (DDP allreduces gradient buckets
during it), clip_grad_norm_(1.0), AdamW (betas 0.9/0.95, eps 1e-8, weight
decay 0.1 except biases and LayerNorms), the learning rate set every step.
Timed per phase with perf_counter; the first ``--warmup`` steps are not timed.

``--lora R`` (with ``--llama``): PEFT's LoRA instead, ``get_peft_model(model, LoraConfig(r=R,
lora_alpha=--lora-alpha, target_modules=--lora-targets, lora_dropout=0))`` on the loaded base weights, the
adapters started from ``--weights``' ``<module>.lora_A.weight`` / ``lora_B.weight`` (a ``model.lora`` run's
weights.safetensors holds the adapters alone: give the base's file too), AdamW over the trainable parameters only (DDP then reduces their gradients
alone). The output records the optimizer's state bytes (every tensor of ``opt.state`` after the last step)
and the trainable parameters' gradient bytes, what DDP's buckets carry each step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(common.MODELS), help="a GPT-2 shape (or --llama)")
    ap.add_argument("--llama", metavar="CONFIG", help="in place of GPT-2: transformers' LlamaForCausalLM (attention "
                    "SDPA) of this trainrun config's model.llama (e.g. configs/smollm2-135m.yaml), at --seq-len")
    ap.add_argument("--seq-len", type=int, help="--llama: the sequence length")
    ap.add_argument("--micro-batch", type=int, required=True, help="sequences per rank per step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, help="timed steps (default: the model's)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default: the model's)")
    ap.add_argument("--window", type=int, help="steps per window of the best-window figure (default: warmup)")
    ap.add_argument("--data", default=str(common.ROOT / "data" / "stdlib" / "train"))
    ap.add_argument("--weights", action="append", help="trainrun's weights.safetensors (else transformers' own "
                    "init); repeatable, e.g. --lora: the full run's (the base) and the model.lora run's (the adapters)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=4, help="trainrun's cosine schedule: warmup steps")
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--lora", type=int, metavar="R", help="--llama: PEFT's LoRA of rank R on the frozen model")
    ap.add_argument("--lora-alpha", type=float, default=32.0, help="--lora: PEFT's lora_alpha")
    ap.add_argument("--lora-targets", default="q_proj,v_proj", help="--lora: target_modules, comma-separated")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: DDP with NCCL, rank r on GPU local_rank (GPU mode, NOT YET RUN on a GPU)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if (args.model is None) == (args.llama is None) or (args.llama and not (args.seq_len and args.steps)):
        ap.error("give --model, or --llama with --seq-len and --steps")
    if args.lora and not args.llama:
        ap.error("--lora needs --llama")
    if args.llama:
        from trainrun.config import load_config
        section = load_config(args.llama).model.llama
        m = argparse.Namespace(seq_len=args.seq_len, vocab_size=section.vocab_size, steps=args.steps, warmup=0)
    else:
        m = common.MODELS[args.model]
    steps = args.steps or m.steps
    warmup = m.warmup if args.warmup is None else args.warmup

    import torch
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
    from trainrun.config import LRScheduleConfig
    from trainrun.data import TrainLoader, open_dataset
    from trainrun.step.schedule import learning_rate
    hf_logging.set_verbosity_error()

    rank, world = common.launcher_rank()
    cuda = args.device == "cuda"
    dev = torch.device("cpu")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", rank)))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True       # as onnxruntime's CUDA provider (use_tf32 1) on Ampere+
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.manual_seed(args.seed)
    if args.llama:
        from transformers import LlamaConfig, LlamaForCausalLM
        c = section
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.kv_heads, head_dim=c.heads_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias, mlp_bias=c.mlp_bias, attn_implementation="sdpa"))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                                           n_positions=m.n_positions, vocab_size=m.vocab_size, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
                                           bos_token_id=0, eos_token_id=0))
    w = {}
    if args.weights:
        from safetensors.numpy import load_file
        w = {k: v for f in args.weights for k, v in load_file(f).items()}
        if args.lora and all(".lora_" in k for k in w):
            raise SystemExit(f"torch_train: {args.weights} hold adapters only: give the base weights too")
        model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items() if ".lora_" not in k}, strict=False)
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules=args.lora_targets.split(",")))
        theirs = {k: torch.from_numpy(v) for k, v in w.items() if ".lora_" in k}
        if theirs:      # trainrun's "<module>.lora_A.weight" is peft's "base_model.model.<module>.lora_A.default.weight"
            mine = {"base_model.model." + k.replace(".weight", ".default.weight"): v for k, v in theirs.items()}
            own = dict(model.named_parameters())
            missing = [k for k in mine if k not in own] + [k for k in own if ".lora_" in k and k not in mine]
            if missing:
                raise SystemExit(f"torch_train: the adapters of {args.weights} are not peft's: {missing[:4]}")
            model.load_state_dict(mine, strict=False)
    model.to(dev).train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if p.ndim >= 2]
    no_decay = [p for n, p in trainable if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model

    ds = open_dataset(args.data, m.seq_len)
    loader = TrainLoader(ds, micro_batch=args.micro_batch, accum=1, rank=rank, world_size=world, seed=args.seed)
    schedule = LRScheduleConfig(name="cosine", warmup_steps=args.lr_warmup, min_lr=args.min_lr)
    n_step = [0]
    phases = {"data": 0.0, "forward": 0.0, "backward": 0.0, "clip": 0.0, "optimizer": 0.0}
    step_ms, losses = [], []

    def sync():     # per-phase times on the GPU need the queued kernels finished
        if cuda:
            torch.cuda.synchronize()

    def step(timed: bool):
        t0 = time.perf_counter()
        batch = loader.next_step()[0]
        x, y = torch.from_numpy(batch["input_ids"]).to(dev), torch.from_numpy(batch["labels"]).to(dev)
        sync()
        t1 = time.perf_counter()
        logits = net(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, m.vocab_size), y.reshape(-1))
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], 1.0)
        sync()
        t4 = time.perf_counter()
        n_step[0] += 1
        for group in opt.param_groups:
            group["lr"] = learning_rate(n_step[0], args.lr, warmup + steps, schedule)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t5 = time.perf_counter()
        if timed:
            for k, a, b in (("data", t0, t1), ("forward", t1, t2), ("backward", t2, t3), ("clip", t3, t4),
                            ("optimizer", t4, t5)):
                phases[k] += b - a
            step_ms.append((t5 - t0) * 1e3)
        losses.append(loss.item())

    for _ in range(warmup):
        step(False)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(True)
    if world > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start
    loader.close()
    rss = torch.tensor([common.peak_rss_mb(), common.vm_peak_mb() or 0.0], dtype=torch.float64, device=dev)
    all_rss = [torch.zeros_like(rss) for _ in range(world)]
    if world > 1:
        dist.all_gather(all_rss, rss)
    else:
        all_rss = [rss]
    total = sum(phases.values()) or 1.0
    if rank == 0:
        common.write_json(args.out, {
            "kind": ("ddp" if world > 1 else "torch") + ("-cuda" if cuda else ""), "device": args.device, "ranks": world, "threads": args.threads,
            "micro_batch": args.micro_batch, "steps": steps, "elapsed_s": elapsed,
            "tokens_per_sec": steps * world * args.micro_batch * m.seq_len / elapsed,
            "step_ms_median": float(np.median(step_ms)),
            "best_window_tokens_per_sec": common.best_window([t / 1e3 for t in step_ms], args.window or max(1, warmup),
                                                             world * args.micro_batch * m.seq_len),
            "phase_shares": {k: round(v / total, 4) for k, v in phases.items()},
            "peak_rss_mb": [round(float(r[0].item()), 1) for r in all_rss],
            "vm_peak_mb": [round(float(r[1].item()), 1) for r in all_rss],
            "first_loss": losses[0], "final_loss": losses[-1], "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "torch": torch.__version__, "trainable_params": sum(p.numel() for _, p in trainable),
            "grad_allreduce_bytes": sum(p.numel() * p.element_size() for _, p in trainable) if world > 1 else 0,
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for st in opt.state.values()
                                         for t in st.values() if torch.is_tensor(t)),
            **({"lora": {"r": args.lora, "alpha": args.lora_alpha, "targets": args.lora_targets.split(",")}}
               if args.lora else {}),
        })
    # destroy_process_group() can wait forever for a peer that already left (seen with gloo):
    # everything is written, so leave without tearing down
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
