"""A PyTorch stand-in for nanoGPT's train.py on its CPU shakespeare_char recipe, for machines without a
nanoGPT checkout (scripts/bench/charlm.py runs nanoGPT itself when given --nanogpt DIR).

Written here after nanoGPT's published recipe and loop, not copied: transformers' GPT-2 (4 layers x 4 heads
x 128, context 64, no dropout) in one process with torch's threads; every iteration one batch of 12 random
windows of data/train.bin (uint16, as nanoGPT stores them), forward, backward, clip_grad_norm_(1.0), AdamW
(lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on the 2-D parameters), the learning rate of nanoGPT's
schedule (linear warm-up over 100, cosine to 1e-4 at 2000); iterations 0..2000 as nanoGPT counts them; every
250 the mean loss of 20 batches of train and of val, and a torch.save checkpoint when val improved.

    .venv/bin/python scripts/bench/charlm_torch.py --data DIR --vocab 257 --out-dir OUT --json result.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def main() -> int:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder with train.bin and val.bin (uint16 tokens)")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1337)
    block, batch, eval_iters, eval_interval = 64, 12, 20, 250
    lr_max, lr_min, warmup = 1e-3, 1e-4, 100
    data = {s: np.memmap(os.path.join(args.data, f"{s}.bin"), dtype=np.uint16, mode="r") for s in ("train", "val")}
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=block, n_embd=128, n_layer=4, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
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
        logits = model(input_ids=x).logits
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
