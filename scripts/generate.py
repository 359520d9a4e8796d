"""Sample text from an exported trainrun GPT-2 with plain onnxruntime (greedy or top-k)."""

import argparse

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=128, help="the model's n_positions")
    args = ap.parse_args()

    tok = Tokenizer.from_file(args.tokenizer)
    sess = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    ids = tok.encode(args.prompt).ids
    rng = np.random.default_rng(args.seed)
    for _ in range(args.tokens):
        window = ids[-args.context:]
        logits = sess.run(["logits"], {"input_ids": np.array([window], np.int64)})[0][0, -1]
        if args.top_k <= 1:
            nxt = int(logits.argmax())
        else:
            top = np.argsort(logits)[-args.top_k:]
            p = np.exp(logits[top] - logits[top].max())
            nxt = int(rng.choice(top, p=p / p.sum()))
        ids.append(nxt)
    print("---- sample ----")
    print(tok.decode(ids))
    print("----------------")


if __name__ == "__main__":
    main()
