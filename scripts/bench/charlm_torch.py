"""A PyTorch stand-in for nanoGPT's train.py on its CPU shakespeare_char recipe, for machines without a
nanoGPT checkout (scripts/bench/charlm.py runs nanoGPT itself when given --nanogpt DIR).

Written here after nanoGPT's published recipe and loop, not copied: a GPT of 4 layers x 4 heads x 128,
context 64, no dropout, in one process with torch's threads: ``--arch gpt2`` is transformers' GPT-2 (biases,
tanh GELU: the model trainrun's recipe trains), ``--arch nanogpt`` nanoGPT's variant of it as its model.py
describes it (its recipe's ``bias=False``: Linear and LayerNorm without biases; exact GELU; attention through
scaled_dot_product_attention with is_causal; the head tied to the token embedding; N(0, 0.02) weights, the
residual projections' scaled by 1/sqrt(2 layers)), written here from that description; every iteration one batch of 12 random
windows of data/train.bin (uint16, as nanoGPT stores them), forward, backward, clip_grad_norm_(1.0), AdamW
(lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on the 2-D parameters), the learning rate of nanoGPT's
schedule (linear warm-up over 100, cosine to 1e-4 at 2000); iterations 0..2000 as nanoGPT counts them; every
250 the mean loss of 20 batches of train and of val, and a torch.save checkpoint when val improved.

    .venv/bin/python scripts/bench/charlm_torch.py --data DIR --vocab 257 --out-dir OUT --json result.json [--arch nanogpt]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def NanoGPTLike(vocab: int, block: int, n_layer: int, n_head: int, width: int):
    """nanoGPT's GPT with bias=False (see the module's text): token + position embeddings, pre-LayerNorm blocks
    of causal self-attention and a 4x GELU MLP, a final LayerNorm and the tied head; logits of every position."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
            self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
            self.fc, self.fc_proj = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2)
                       for z in self.qkv(self.ln_1(x)).split(width, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, c)
            x = x + self.proj(y)
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(width, bias=False)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return F.linear(self.ln_f(x), self.wte.weight)

    return GPT()


def main() -> int:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder with train.bin and val.bin (uint16 tokens)")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--arch", choices=["gpt2", "nanogpt"], default="gpt2")
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.manual_seed(1337)
    block, batch, eval_iters, eval_interval = 64, 12, 20, 250
    lr_max, lr_min, warmup = 1e-3, 1e-4, 100
    data = {s: np.memmap(os.path.join(args.data, f"{s}.bin"), dtype=np.uint16, mode="r") for s in ("train", "val")}
    if args.arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=block, n_embd=128, n_layer=4,
                                           n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        logits_of = lambda x: model(input_ids=x).logits  # noqa: E731
    else:
        model = NanoGPTLike(args.vocab, block, n_layer=4, n_head=4, width=128)
        logits_of = model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr_max, betas=(0.9, 0.99), eps=1e-8)

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - block, (batch,))
        x = torch.stack([torch.from_numpy(d[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(d[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        return x, y

    def loss_of(x, y):
        logits = logits_of(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    @torch.no_grad()
    def estimate():
        model.eval()
        out = {s: float(np.mean([loss_of(*get_batch(s)).item() for _ in range(eval_iters)])) for s in data}
        model.train()
        return out

    def lr_at(it):
        if it < warmup:
            return lr_max * (it + 1) / (warmup + 1)
        if it > args.iters:
            return lr_min
        ratio = (it - warmup) / (args.iters - warmup)
        return lr_min + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr_max - lr_min)

    os.makedirs(args.out_dir, exist_ok=True)
    best, evals, t_first = 1e9, [], None
    x, y = get_batch("train")
    for it in range(args.iters + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        if it % eval_interval == 0 or it == args.iters:
            losses = estimate()
            evals.append({"iter": it, **losses})
            if losses["val"] < best:
                best = losses["val"]
                if it > 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": it},
                               os.path.join(args.out_dir, "ckpt.pt"))
        if t_first is None:
            t_first = time.perf_counter()
        loss = loss_of(x, y)
        x, y = get_batch("train")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()             # nanoGPT prints the loss every iteration (log_interval 1)
    with open(args.json, "w") as fh:
        json.dump({"evals": evals, "threads": torch.get_num_threads(), "start_s": t_first - t_start,
                   "wall_s_inside": time.perf_counter() - t_start}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
