"""nanoGPT's CPU shakespeare_char recipe, start to finished model: trainrun (configs/shakespeare-char.yaml,
`mpirun -np 2`) beside nanoGPT itself (--nanogpt DIR: a nanoGPT checkout, run as its README says: one
process, torch's threads, `train.py config/train_shakespeare_char.py` with the CPU overrides) or, without a
checkout, beside scripts/bench/charlm_torch.py (stand-ins written here, labelled so in the output; --stand-in
picks: `nanogpt`, nanoGPT's own model as its model.py describes it, bias-free, the closer one and the default;
`gpt2`, transformers' GPT-2, the model trainrun trains; `nanogpt,gpt2` both).

Any text: split 90/10 by characters as nanoGPT splits input.txt, character level for both sides over the
text's distinct characters (nanoGPT's prepare.py; `trainrun-data tokens --chars`), so the two train on the
same characters and their eval losses compare. Rounds alternate the two commands; the wall time
is the command's, from launch to exit (trainrun: graphs built, 2000 steps, 9 evaluations, checkpoints,
model.onnx exported; nanoGPT: 2001 iterations, 9 evaluations of train and val, ckpt.pt when val improved).

    .venv/bin/python scripts/bench/charlm.py [--text input.txt] [--nanogpt ~/nanoGPT | --stand-in nanogpt,gpt2]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIG = common.ROOT / "configs" / "shakespeare-char.yaml"
NANOGPT_CPU = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
               "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
               "--lr_decay_iters=2000", "--dropout=0.0"]


def default_text() -> Path:
    import pydoc_data.topics
    return Path(pydoc_data.topics.__file__)     # 756 kB of English prose, on every Python


def prepare_data(text_path: Path, work: Path) -> tuple[Path, Path, Path, int]:
    """trainrun's train and eval datasets, nanoGPT's data folder and the vocabulary size (nanoGPT's),
    from the same 90/10 split. Both are character level over the whole text's characters, as nanoGPT's
    data/shakespeare_char/prepare.py makes them: nanoGPT's ids are the characters' ranks in code point
    order; trainrun's (`trainrun-data tokens --chars`, then --tokenizer for each split) the same ranks + 1
    (its end-of-document token is id 0, so its vocabulary is one larger)."""
    import numpy as np
    text = text_path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    cut = int(len(text) * 0.9)
    parts = {"train": text[:cut], "val": text[cut:]}
    ng = work / "nanogpt-data" / "charlm"
    ng.mkdir(parents=True, exist_ok=True)
    tool = str(common.BIN / "trainrun-data")
    (work / "all.txt").write_text(text, encoding="utf-8")
    subprocess.run([tool, "tokens", "--input", str(work / "all.txt"), "--output", str(work / "chars"), "--chars",
                    "--eval-fraction", "0", "--overwrite"], check=True, capture_output=True)
    datasets = {}
    for split, part in parts.items():
        (work / f"{split}.txt").write_text(part, encoding="utf-8")
        out = work / f"data-{split}"
        subprocess.run([tool, "tokens", "--input", str(work / f"{split}.txt"), "--output", str(out), "--tokenizer",
                        str(work / "chars" / "tokenizer.json"), "--eval-fraction", "0", "--overwrite"], check=True,
                       capture_output=True)
        datasets[split] = out / "train"
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(ng / ("train.bin" if split == "train" else "val.bin"))
    with open(ng / "meta.pkl", "wb") as fh:      # nanoGPT reads its vocabulary size from here
        pickle.dump({"vocab_size": len(chars), "stoi": stoi, "itos": dict(enumerate(chars))}, fh)
    return datasets["train"], datasets["val"], ng, len(chars)


def timed(cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, check=True, env=env)
    return time.perf_counter() - t0


def run_trainrun(work: Path, tag: str, train: Path, val: Path, ranks: int, iters: int, vocab: int) -> dict:
    out = work / "runs" / tag
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["mpirun", "-np", str(ranks), str(common.BIN / "trainrun"), "--config", str(CONFIG),
           "--set", f"run.output_dir={out}", "--set", f"data.train={train}", "--set", f"data.eval={val}",
           "--set", f"train.micro_batch_size={12 // ranks}", "--set", f"train.max_steps={iters}",
           "--set", f"model.gpt2.vocab_size={vocab + 1}"]
    wall = timed(cmd, work, work / f"{tag}.log", env=dict(os.environ, PATH=f"{common.BIN}:{os.environ['PATH']}"))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [r for r in rows if "eval_loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "model.onnx").exists(), "no model.onnx"
    return {"wall_s": wall, "eval_loss": evals[-1]["eval_loss"], "best_eval_loss": min(r["eval_loss"] for r in evals),
            "startup_s": summary.get("startup_s"), "command": " ".join(cmd)}


STAND_INS = {"nanogpt": "stand-in: nanoGPT's model (charlm_torch.py --arch nanogpt)",
             "gpt2": "stand-in: transformers' GPT-2 (charlm_torch.py --arch gpt2)"}


def run_nanogpt(work: Path, tag: str, nanogpt: Path | None, ng_data: Path, iters: int, vocab: int,
                arch: str | None) -> dict:
    """nanoGPT itself (``nanogpt``: its checkout) or else the stand-in of model ``arch``."""
    out = work / "runs" / tag
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if nanogpt:         # nanoGPT reads data/<dataset>/ from its working directory: a folder of links
        cwd = work / "nanogpt-cwd"
        if not cwd.exists():
            cwd.mkdir()
            for name in ("train.py", "model.py", "configurator.py", "config"):
                (cwd / name).symlink_to(nanogpt.resolve() / name)
            (cwd / "data").mkdir()
            (cwd / "data" / "charlm").symlink_to(ng_data.resolve())
        cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_CPU,
               f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--dataset=charlm", f"--out_dir={out}"]
        wall = timed(cmd, cwd, work / f"{tag}.log")
        vals = [float(line.split("val loss")[1].strip().split()[0].rstrip(","))
                for line in open(work / f"{tag}.log") if "val loss" in line]
        return {"wall_s": wall, "eval_loss": vals[-1], "best_eval_loss": min(vals), "command": " ".join(cmd)}
    cmd = [sys.executable, str(Path(__file__).with_name("charlm_torch.py")), "--data", str(ng_data),
           "--vocab", str(vocab), "--iters", str(iters), "--out-dir", str(out), "--json", str(out / "result.json"),
           "--arch", arch]
    wall = timed(cmd, work, work / f"{tag}.log")
    res = json.loads((out / "result.json").read_text())
    vals = [e["val"] for e in res["evals"]]
    return {"wall_s": wall, "eval_loss": vals[-1], "best_eval_loss": min(vals), "startup_s": res["start_s"],
            "threads": res["threads"], "command": " ".join(cmd)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", type=Path, help="any text file (default: Python's pydoc_data/topics.py)")
    ap.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (else the PyTorch stand-ins)")
    ap.add_argument("--stand-in", default="nanogpt", help="without --nanogpt: which stand-ins, comma-separated "
                    "(nanogpt: nanoGPT's own model; gpt2: transformers' GPT-2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2, choices=[1, 2, 3, 4, 6, 12])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--work", type=Path, default=common.ROOT / "runs" / "bench" / "charlm")
    args = ap.parse_args()
    arches = [] if args.nanogpt else [a.strip() for a in args.stand_in.split(",") if a.strip()]
    if any(a not in STAND_INS for a in arches) or not (args.nanogpt or arches):
        ap.error(f"--stand-in: a comma-separated list of {', '.join(STAND_INS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    text = args.text or default_text()
    train, val, ng_data, vocab = prepare_data(text, args.work)
    others = {"nanoGPT": None} if args.nanogpt else {STAND_INS[a]: a for a in arches}
    results = {"trainrun": [], **{o: [] for o in others}}
    names = list(results)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:    # each goes first in turn
            if name == "trainrun":
                res = run_trainrun(args.work, f"trainrun-r{r}", train, val, args.ranks, args.iters, vocab)
            else:
                res = run_nanogpt(args.work, f"{others[name] or 'nanogpt-itself'}-r{r}", args.nanogpt, ng_data,
                                  args.iters, vocab, others[name])
            results[name].append(res)
            print(f"round {r} {name}: {res['wall_s']:.1f} s, eval loss {res['eval_loss']:.4f}", flush=True)
    ratios = {o: [x["wall_s"] / t["wall_s"] for t, x in zip(results["trainrun"], results[o])] for o in others}
    report = {"machine": common.machine(), "text": str(text), "iters": args.iters, "ranks": args.ranks,
              "results": results, "wall_ratio_median": {o: statistics.median(v) for o, v in ratios.items()},
              "wall_ratios": ratios}
    (args.work / "results.json").write_text(json.dumps(report, indent=1))
    med = lambda name, key: statistics.median(x[key] for x in results[name])  # noqa: E731
    print(f"\n{report['machine'].get('cpu', '')}: {args.rounds} rounds, {args.iters} iterations, text {text.name}")
    for name in results:
        print(f"  {name}: wall {med(name, 'wall_s'):.1f} s (median), final eval loss {med(name, 'eval_loss'):.4f}")
    for o, v in ratios.items():
        print(f"  {o} wall / trainrun wall: {statistics.median(v):.2f}x (per round: "
              + ", ".join(f"{x:.2f}" for x in v) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
