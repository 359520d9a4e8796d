"""The fine-tuning recipe (README "Fine-tuning"): pre-train a tiny BERT with trainrun, fine-tune it on the
chatterbot-corpus topics, and compare with the same fine-tune from random weights and with two baselines.

    .venv/bin/python scripts/recipe_topics.py [--work runs/topics] [--pretrain-steps 3000]

1. Pre-training text: Python's own documentation topics (`pydoc_data.topics`: 79 topics, 465 kB of English
   prose, on every Python; one file a topic) and chatterbot-corpus's English statements of every topic, without
   their topics and without the eval split's statements; `trainrun-data bert --train-wordpiece 2048 --seq-len 64`.
2. Pre-training: `mpirun -np 2 trainrun --config configs/bert-tiny.yaml` (masked LM + next sentence).
3. `trainrun export RUN --format transformers`: a BertForPreTraining folder.
4. Labelled data: scripts/chatterbot_topics.py's CSV (chatterbot-corpus 1.3.3, the test extra), split 80/20 by
   a hash of the text, `trainrun-data labelled` with the pre-training's tokenizer.
5. Fine-tune: `mpirun -np 2 trainrun --config configs/bert-topics.yaml` with model.init_from the folder of 3;
   again without it (random weights); each exported with --format transformers.
6. Baselines on the same split: the majority topic; TF-IDF + logistic regression (scikit-learn).

Needs the test extra's chatterbot-corpus (`make setup-test`; the venv `make demo` makes lacks it) and, for the
TF-IDF row, scikit-learn (without it the row is left out, said). Prints a line as each step starts (each step's
own output goes to WORK/logs/<step>.log), then a table (eval accuracy and macro F1 of the best checkpoint, by
eval_accuracy), and writes WORK/results.json.

The figures depend on the installed Python: its documentation topics are part of the pre-training text, so
another Python version pre-trains on other text (and BLAS and thread counts change the rounding); a run
differs from the README's table by a few points of accuracy.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


INSTALL = "`make setup-test` installs it with the test extra, or `.venv/bin/pip install {}`"
NO_SKLEARN = ("scikit-learn is not installed: the TF-IDF + logistic regression row will be left out "
              "(`make setup-test` installs it)")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def say(text: str, **kw) -> None:
    print(f"recipe_topics: {text}", flush=True, **kw)


def sh(*cmd, log: Path) -> float:
    say(f"{log.stem} (its output: {log})")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(map(str, cmd)) + "\n")
        fh.flush()
        proc = subprocess.run([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}"))
    if proc.returncode:
        raise SystemExit(f"recipe_topics: {cmd[0]} ... failed ({proc.returncode}); see {log}")
    return time.perf_counter() - t0


def in_eval(text: str) -> bool:
    """The 20% eval split: by a hash of the statement's text (whitespace-normalised, as the CSV has it)."""
    return int.from_bytes(hashlib.sha256(" ".join(text.split()).encode()).digest()[:4], "big") % 5 == 0


def best_eval(run: Path) -> dict:
    evals = [json.loads(line) for line in open(run / "metrics.jsonl")]
    evals = [r for r in evals if "eval_accuracy" in r]
    return max(evals, key=lambda r: (r["eval_accuracy"], -r["step"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "topics")
    ap.add_argument("--pretrain-steps", type=int, default=3000)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    if not installed("chatterbot_corpus"):
        say("chatterbot-corpus is not installed (its statements are the labelled set): "
            + INSTALL.format("chatterbot-corpus==1.3.3"), file=sys.stderr)
        if not installed("sklearn"):
            say(f"note: {NO_SKLEARN}", file=sys.stderr)
        return 2
    if not installed("sklearn"):
        say(f"note: {NO_SKLEARN}")
    w = args.work.resolve()
    w.mkdir(parents=True, exist_ok=True)
    logs = w / "logs"
    logs.mkdir(exist_ok=True)
    say(f"work folder {w}; each step's output in {logs}/ (all of it takes several minutes on 2 cores)")
    mpirun = [BIN / "mpirun", "-np", str(args.ranks), BIN / "trainrun"]
    times = {}

    # 1. pre-training text and data: Python's documentation topics, and chatterbot-corpus's English statements
    # (every topic, no labels) except those of the eval split (task-adaptive pre-training on text the
    # fine-tune may see; the eval statements stay unseen)
    import pydoc_data.topics
    sys.path.insert(0, str(ROOT / "scripts"))
    import chatterbot_topics
    text = w / "pretrain-text"
    shutil.rmtree(text, ignore_errors=True)
    text.mkdir()
    for name, body in sorted(pydoc_data.topics.topics.items()):
        (text / f"{name}.txt").write_text(body, encoding="utf-8")
    by_topic: dict[str, list[str]] = {}
    for statement, topic in chatterbot_topics.statements(chatterbot_topics.corpus_dir() / "english"):
        if not in_eval(statement):
            by_topic.setdefault(topic, []).append(statement)
    for topic, lines in by_topic.items():      # a document every 8 statements (next-sentence pairs in it)
        docs = ["\n".join(lines[i:i + 8]) for i in range(0, len(lines), 8)]
        (text / f"chatterbot-{topic}.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    times["pretrain_data_s"] = sh(BIN / "trainrun-data", "bert", "--input", text, "--output", w / "pretrain-data",
                                  "--train-wordpiece", "2048", "--seq-len", "64", "--max-predictions", "10",
                                  "--dupe-factor", "5", "--eval-fraction", "0.05", "--overwrite", "--no-progress",
                                  log=logs / "pretrain-data.log")
    # 2-3. pre-training and its transformers folder
    pre = w / "pretrain-run"
    shutil.rmtree(pre, ignore_errors=True)
    times["pretrain_s"] = sh(*mpirun, "--config", ROOT / "configs" / "bert-tiny.yaml",
                             "--set", f"run.output_dir={pre}", "--set", f"data.train={w / 'pretrain-data' / 'train'}",
                             "--set", f"data.eval={w / 'pretrain-data' / 'eval'}", "--set", "data.seq_len=64",
                             "--set", f"train.max_steps={args.pretrain_steps}",
                             log=logs / "pretrain.log")
    shutil.rmtree(w / "pretrained-hf", ignore_errors=True)
    sh(BIN / "trainrun", "export", pre, "--format", "transformers", "--output", w / "pretrained-hf",
       log=logs / "pretrain-export.log")
    pre_summary = json.loads((pre / "summary.json").read_text())

    # 4. the labelled set, split 80/20 by a hash of the text
    sh(BIN / "python", ROOT / "scripts" / "chatterbot_topics.py", "--output", w / "topics.csv",
       log=logs / "topics-csv.log")
    rows = list(csv.DictReader(open(w / "topics.csv", encoding="utf-8")))
    split = {"train": [], "eval": []}
    for r in rows:
        split["eval" if in_eval(r["text"]) else "train"].append(r)
    for part, rs in split.items():
        with open(w / f"topics-{part}.csv", "w", newline="", encoding="utf-8") as fh:
            out = csv.DictWriter(fh, fieldnames=["text", "label"])
            out.writeheader()
            out.writerows({"text": r["text"], "label": r["label"]} for r in rs)
    sh(BIN / "trainrun-data", "labelled", "--input", w / "topics-train.csv", "--eval-input", w / "topics-eval.csv",
       "--text-field", "text", "--label-field", "label", "--tokenizer", w / "pretrain-data" / "tokenizer.json",
       "--seq-len", "64", "--output", w / "topics-data", "--overwrite", log=logs / "topics-data.log")

    # 5. fine-tunes: from the pre-trained folder, and from random weights
    results = {}
    for name, init in (("from trainrun's pre-training", w / "pretrained-hf"), ("from random weights", None)):
        tag = "finetune-pretrained" if init else "finetune-random"
        run = w / tag
        shutil.rmtree(run, ignore_errors=True)
        sets = ["--set", f"run.output_dir={run}", "--set", f"data.train={w / 'topics-data' / 'train'}",
                "--set", f"data.eval={w / 'topics-data' / 'eval'}"]
        if init:
            sets += ["--set", f"model.init_from={init}"]
        wall = sh(*mpirun, "--config", ROOT / "configs" / "bert-topics.yaml", *sets, log=logs / f"{tag}.log")
        sh(BIN / "trainrun", "export", run, "--best", "--format", "transformers", "--output", w / f"{tag}-hf",
           log=logs / f"{tag}-export.log")
        best = best_eval(run)
        results[name] = {"eval_accuracy": best["eval_accuracy"], "eval_f1": best["eval_f1"], "step": best["step"],
                         "wall_s": round(wall, 1), "steps": json.loads((run / "summary.json").read_text())["steps"]}

    # 6. baselines on the same split
    train_y, eval_y = [r["label"] for r in split["train"]], [r["label"] for r in split["eval"]]
    majority = max(set(train_y), key=train_y.count)
    base = {"majority topic": {"eval_accuracy": sum(y == majority for y in eval_y) / len(eval_y)}}
    if installed("sklearn"):
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import accuracy_score, f1_score
        vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)
        clf = LogisticRegression(max_iter=2000, C=10.0).fit(vec.fit_transform([r["text"] for r in split["train"]]),
                                                            train_y)
        pred = clf.predict(vec.transform([r["text"] for r in split["eval"]]))
        base["TF-IDF + logistic regression"] = {"eval_accuracy": accuracy_score(eval_y, pred),
                                                 "eval_f1": f1_score(eval_y, pred, average="macro")}
    report = {"rows": {"train": len(split["train"]), "eval": len(split["eval"])},
              "labels": sorted(set(train_y)), "pretraining": {"steps": pre_summary["steps"],
              "final_eval": pre_summary.get("final_eval"), "wall_s": round(times["pretrain_s"], 1)},
              "finetune": results, "baselines": base}
    (w / "results.json").write_text(json.dumps(report, indent=1))
    print(f"topics: {len(split['train'])} train / {len(split['eval'])} eval statements, "
          f"{len(report['labels'])} labels; pre-training {pre_summary['steps']} steps in {times['pretrain_s']:.0f} s")
    print("| model | eval accuracy | eval macro F1 |\n|---|---|---|")
    for name, r in {**{f"BERT fine-tuned {k}": v for k, v in results.items()}, **base}.items():
        f1 = f"{r['eval_f1']:.3f}" if "eval_f1" in r else "–"
        print(f"| {name} | {r['eval_accuracy']:.1%} | {f1} |")
    if not installed("sklearn"):
        print(f"(the TF-IDF row is left out: {NO_SKLEARN.split(': ')[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
