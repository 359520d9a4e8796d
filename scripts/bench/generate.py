"""Generation speed: trainrun's attention-cache graph (``trainrun generate``'s loop) vs transformers'
``generate``, GPT-2 124M shape (random weights: speed does not depend on them), greedy, same
prompt and token count, same thread count, alternating rounds; also the full-window path (no cache).

    .venv/bin/python scripts/bench/generate.py [--new 128] [--prompt 32] [--rounds 3] [--threads 2]

Prints tokens/s (new tokens / wall time of the whole call, prompt pass included) and whether the
greedy tokens agree.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from trainrun.config import GPT2Config  # noqa: E402
from trainrun.generate import Decoder, generate  # noqa: E402
from trainrun.sessions import session_options  # noqa: E402
from trainrun.models.gpt2 import build_gpt2, init_weights  # noqa: E402

GPT2_124M = dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-full", action="store_true", help="skip the full-window (no cache) path")
    args = ap.parse_args()

    import onnxruntime as ort
    import torch
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel
    torch.set_num_threads(args.threads)
    cfg = GPT2Config(**GPT2_124M)
    w = init_weights(cfg, 0)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()

    def session(kv):
        return ort.InferenceSession(build_gpt2(cfg, w, kv_cache=kv).SerializeToString(),
                                    session_options(args.threads), providers=["CPUExecutionProvider"])
    ours = {"trainrun (cache)": Decoder(session(True), cfg.n_positions)}
    if not args.no_full:
        ours["trainrun (no cache)"] = Decoder(session(False), cfg.n_positions)
    hf = GPT2LMHeadModel(HFConfig(**GPT2_124M, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=False)
    hf.tie_weights()

    def run_ours(dec):
        return generate(dec, prompt, args.new, np.random.default_rng(0), temperature=0)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=args.new, min_new_tokens=args.new,
                              do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    setups = {**{k: (lambda d=d: run_ours(d)) for k, d in ours.items()}, "transformers generate": run_hf}
    for fn in setups.values():       # warm-up (and the tokens)
        fn()
    tokens = {k: fn() for k, fn in setups.items()}
    times = {k: [] for k in setups}
    for r in range(args.rounds):
        order = list(setups)[r % len(setups):] + list(setups)[:r % len(setups)]
        for k in order:
            t0 = time.perf_counter()
            setups[k]()
            times[k].append(time.perf_counter() - t0)
    print(f"GPT-2 124M shape, prompt {args.prompt} tokens, {args.new} new tokens, greedy, {args.threads} threads, "
          f"torch {torch.__version__}, onnxruntime {ort.__version__}, best of {args.rounds}")
    for k in setups:
        best = min(times[k])
        print(f"  {k:24s} {args.new / best:8.1f} tokens/s  ({best:.2f} s)")
    ref = tokens["transformers generate"]
    for k in ours:
        same = next((i for i, (a, b) in enumerate(zip(tokens[k], ref)) if a != b), len(ref))
        print(f"  {k}: greedy tokens equal transformers' for the first {same} of {len(ref)}")


if __name__ == "__main__":
    main()
