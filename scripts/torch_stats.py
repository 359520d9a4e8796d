"""A PyTorch reference run that writes trainrun's statistics format, for `trainrun compare`.

    python scripts/torch_stats.py RUN_DIR --output REF_DIR [--steps N] [--every K]
    trainrun compare RUN_DIR REF_DIR --rtol 1e-3

RUN_DIR is a trainrun run of the built-in GPT-2 (its config.yaml, initial
weights graphs/weights.safetensors and graphs/train.onnx are read). This
script trains transformers' GPT2LMHeadModel (gelu_new, dropout 0) from the same
initial weights on the same global batches, with torch.optim.AdamW/Adam/SGD, the
same gradient clipping and learning-rate schedule, and writes
REF_DIR/stats/rank-0/stats.jsonl with trainrun's names. The sample order, the
schedule and the statistics come from scripts/reference.py, written from the
documented rules and not imported from trainrun, so that a defect in trainrun's
loader, schedule or statistics shows up as a difference:

* scalar/loss, local_loss, grad_norm (before clipping), lr;
* grad/<param> (the mean gradient), param/<param> (after the update);
* act/<onnx name>: the train graph's tensors that correspond to a module of
  the PyTorch model, found through the parameter names in train.onnx: the
  output and the input of every LayerNormalization (ln_1, ln_2, ln_f), the
  output of every MLP GELU (mlp.act), and logits. By default those the run
  recorded (its stats/rank-0/meta.json), else all of them.

Activations cover the whole global batch, so compare them with a 1-rank run
(`--rank 0`); gradients, parameters and the loss compare with any rank count.
Needs torch and transformers (the test extra). Run trainrun with
run.deterministic: true (no float-reordering graph rewrites) and model.gpt2.dropout 0.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys


def onnx_module_map(train_onnx: str) -> dict[str, tuple[str, str]]:
    """ONNX tensor name -> (torch module name, "in" | "out") for the mappable activations."""
    import onnx
    graph = onnx.load(train_onnx, load_external_data=False).graph
    out = {"logits": ("lm_head", "out")}
    for node in graph.node:
        if node.op_type == "LayerNormalization" and len(node.input) > 1 and node.input[1].endswith(".weight"):
            module = node.input[1][:-len(".weight")]                 # transformer.h.0.ln_1
            out.setdefault(node.output[0], (module, "out"))
            out.setdefault(node.input[0], (module, "in"))
        elif node.output and node.output[0].endswith(".mlp.act"):       # the GELU's output, by name
            out.setdefault(node.output[0], (node.output[0], "out"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--output", required=True, help="Directory to write (stats/rank-0/ inside).")
    ap.add_argument("--steps", type=int, default=None, help="Steps to train (default: the run's max_steps).")
    ap.add_argument("--every", type=int, default=None, help="Statistics every N steps (default: the run's "
                    "debug.stats_every, or 1).")
    ap.add_argument("--tensors", nargs="*", default=None, help="ONNX tensor name patterns to record.")
    args = ap.parse_args(argv)

    import torch
    from safetensors.numpy import load_file
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import numpy as np

    import reference as R           # scripts/reference.py, beside this script
    from trainrun import config as C

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    cfg = C.load_config(os.path.join(args.run_dir, "config.yaml"))
    if cfg.model.builtin != "gpt2":
        sys.exit("torch_stats.py: only the built-in GPT-2 has a PyTorch twin (model.builtin: gpt2)")
    g, o = cfg.model.gpt2, cfg.optimizer
    if g.dropout > 0:
        print(f"torch_stats.py: warning: the run used dropout {g.dropout}; the reference runs without",
              file=sys.stderr)
    every = args.every or cfg.debug.stats_every or 1

    weights = load_file(os.path.join(args.run_dir, "graphs", "weights.safetensors"))
    hf = GPT2Config(n_layer=g.n_layer, n_head=g.n_head, n_embd=g.n_embd, n_positions=g.n_positions,
                    vocab_size=g.vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    activation_function="gelu_new", layer_norm_epsilon=g.layer_norm_epsilon,
                    bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(hf)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
    model.train()
    params = {n: p for n, p in model.named_parameters() if n in weights}

    # activations: which ONNX names, hooked on which modules
    mapping = onnx_module_map(os.path.join(args.run_dir, "graphs", "train.onnx"))
    patterns = args.tensors
    if patterns is None:
        meta = os.path.join(args.run_dir, "stats", "rank-0", "meta.json")
        patterns = json.load(open(meta)).get("activations", []) if os.path.isfile(meta) else ["*"]
    wanted = [n for n in mapping if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    acts: dict[str, list] = {}           # the activations of every micro-batch of the step
    modules = dict(model.named_modules())

    def hook(onnx_name, where):
        def fn(module, inputs, output=None):
            t = inputs[0] if where == "in" else (output[0] if isinstance(output, tuple) else output)
            acts.setdefault(onnx_name, []).append(t.detach().numpy().ravel().copy())
        return fn

    collecting = [False]
    for name in wanted:
        module_name, where = mapping[name]
        f = hook(name, where)
        if where == "in":
            modules[module_name].register_forward_pre_hook(lambda m, i, f=f: f(m, i) if collecting[0] else None)
        else:
            modules[module_name].register_forward_hook(lambda m, i, out, f=f: f(m, i, out) if collecting[0] else None)

    # the optimizer, as trainrun's
    decay = [p for n, p in params.items() if not any(fnmatch.fnmatchcase(n, pat) for pat in o.no_decay)]
    no_decay = [p for n, p in params.items() if any(fnmatch.fnmatchcase(n, pat) for pat in o.no_decay)]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if o.name in ("adamw", "adam"):
        if o.eps_mode != "torch" or not o.bias_correction:
            sys.exit("torch_stats.py: torch.optim has no eps_mode: ort / bias_correction: false")
        opt = (torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam)(
            groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    elif o.name == "sgd":
        opt = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    else:
        sys.exit(f"torch_stats.py: optimizer {o.name} has no torch.optim twin")

    meta = os.path.join(args.run_dir, "stats", "rank-0", "meta.json")
    world = json.load(open(meta)).get("world_size", 1) if os.path.isfile(meta) else 1
    accum = cfg.train.gradient_accumulation_steps
    mb = cfg.train.micro_batch_size * world          # a step's samples, in accum micro-batches
    from trainrun.data import open_dataset
    total = cfg.train.total_steps(open_dataset(cfg.data.train, cfg.data.seq_len).num_samples, mb * accum)
    steps = args.steps or total
    batches = R.global_batches(cfg.data.train, cfg.data.seq_len, mb * accum, cfg.run.seed, cfg.data.shuffle)
    s = cfg.lr_schedule
    out_dir = os.path.join(args.output, "stats", "rank-0")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "meta.json"), "w") as fh:
        json.dump({"format": "trainrun-stats", "format_version": 1, "source": "torch", "rank": 0, "world_size": 1,
                   "activations": wanted, "params": list(params),
                   "reference_for": os.path.abspath(args.run_dir)}, fh, indent=1)
    ignore = cfg.model.loss.ignore_index
    with open(os.path.join(out_dir, "stats.jsonl"), "w") as out:
        for step in range(1, steps + 1):
            due = step % every == 0
            collecting[0] = due
            acts.clear()
            lr = R.learning_rate(step, o.lr, total, s.name, s.warmup_steps, s.min_lr, s.power)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            loss_sum = 0.0
            ids, labels = next(batches)
            for a in range(accum):
                logits = model(torch.from_numpy(ids[a * mb:(a + 1) * mb])).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         torch.from_numpy(labels[a * mb:(a + 1) * mb]).reshape(-1),
                                                         ignore_index=ignore)
                (loss / accum).backward()
                loss_sum += loss.item()
            tensors = {}
            if due:      # the mean gradient, before clipping (as trainrun records it)
                tensors = {f"act/{n}": R.summary(np.concatenate(acts[n])) for n in wanted if n in acts}
                for n, p in params.items():
                    tensors[f"grad/{n}"] = R.summary(p.grad.detach().numpy())
            max_norm = o.max_grad_norm if o.max_grad_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm))
            opt.step()
            if due:
                for n, p in params.items():
                    tensors[f"param/{n}"] = R.summary(p.detach().numpy())
                loss = loss_sum / accum
                scalars = {"loss": loss, "local_loss": loss, "grad_norm": grad_norm, "lr": lr}
                out.write(json.dumps({"step": step, "rank": 0, "world_size": 1, "scalars": scalars,
                                      "tensors": tensors}) + "\n")
    print(f"torch_stats.py: {steps} steps, statistics every {every} in {os.path.join(args.output, 'stats')} "
          f"({len(wanted)} activations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
