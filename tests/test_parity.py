"""trainrun (2 MPI ranks) against an independent PyTorch run: transformers' GPT-2,
torch.optim.AdamW, the same initial weights and the same global batches."""

import fnmatch
import math
import os

import numpy as np
import torch

from trainrun import config as C
from trainrun.data import TrainLoader, open_dataset

from conftest import hf_gpt2, mpirun, read_metrics, write_config

STEPS = 50


def test_losses_match_pytorch_over_50_steps(tmp_path, byte_dataset):
    tiny = C.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "gpt2-tiny.yaml"))
    shape = {k: getattr(tiny.model.gpt2, k) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
    seq, lr, warmup, min_lr, wd = 128, 3e-3, 10, 3e-4, 0.1
    cfg_path = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model.gpt2": shape, "data.seq_len": seq, "train.max_steps": STEPS, "train.micro_batch_size": 4,
        "optimizer": {"name": "adamw", "lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": wd,
                      "eps_mode": "torch", "max_grad_norm": 1.0},
        "lr_schedule": {"name": "cosine", "warmup_steps": warmup, "min_lr": min_lr}})
    mpirun(2, "--config", cfg_path)
    train, _ = read_metrics(str(tmp_path / "run"))
    ours = [train[s]["loss"] for s in range(1, STEPS + 1)]

    # the reference: plain PyTorch on the same global batches of 8
    from safetensors.numpy import load_file
    weights = load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))
    model = hf_gpt2(shape, weights).train()
    cfg = C.load_config(cfg_path)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            continue
        (no_decay if any(fnmatch.fnmatchcase(name, pat) for pat in cfg.optimizer.no_decay) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(t):   # t = 1-based update; linear warmup, then cosine from the end of warmup to min_lr
        if t <= warmup:
            return lr * t / warmup
        x = (t - warmup) / (STEPS - warmup)
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * x))

    ds = open_dataset(os.path.join(byte_dataset, "train"), seq)
    loader = TrainLoader(ds, micro_batch=8, accum=1, rank=0, world_size=1, seed=cfg.run.seed, shuffle=True,
                         prefetch=0)
    ref = []
    for t in range(1, STEPS + 1):
        batch = loader.next_step()[0]
        for group in opt.param_groups:
            group["lr"] = lr_at(t)
        logits = model(torch.from_numpy(batch["input_ids"])).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(batch["labels"]).reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ref.append(loss.item())
    loader.close()
    np.testing.assert_allclose(ours, ref, rtol=1e-4)
    assert ours[-1] < ours[0] - 1.0
