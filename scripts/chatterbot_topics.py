"""A labelled text set from the chatterbot-corpus package: English dialog statements by topic, as CSV.

    pip install chatterbot-corpus==1.3.3          # 350 kB, BSD-3-Clause, the YAML files inside the wheel
    python scripts/chatterbot_topics.py --output topics.csv [--min-count 100] [--language english]
    trainrun-data labelled --input topics.csv --text-field text --label-field label ...

chatterbot-corpus (gunthercox/chatterbot-corpus) ships its corpus inside the package, nothing fetched
at run time: ``chatterbot_corpus/data/<language>/<topic>.yml``, each a list of conversations (lists of
statements). English has 21 topics and 4,419 statements (version 1.3.3), most of them in a few topics
(tech_support 2,100, trivia 608, coding 368, emotion 255, ai 210, conversations 129, psychology 127, ...).

Every statement is a row (``text``, ``label`` = its file's topic). A statement found under two topics
("Hello", "What is your name?") says nothing of either and is left out, and a repeated one is kept once;
topics with fewer than ``--min-count`` statements left are dropped. Rows are written sorted by (label,
text), so the same package gives the same file.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
from collections import Counter, defaultdict
from pathlib import Path

import yaml


def corpus_dir() -> Path:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or spec.origin is None:
        raise SystemExit("chatterbot_topics.py: the chatterbot-corpus package is not installed "
                         "(pip install chatterbot-corpus==1.3.3), or give --corpus DIR")
    return Path(spec.origin).parent / "data"


def statements(folder: Path) -> list[tuple[str, str]]:
    """(text, topic) of every statement of the topic files in ``folder``."""
    rows = []
    for path in sorted(folder.glob("*.yml")):
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh) or {}
        for conversation in doc.get("conversations") or []:
            for s in conversation or []:
                if isinstance(s, str) and " ".join(s.split()):
                    rows.append((" ".join(s.split()), path.stem))
    return rows


def topic_rows(rows, min_count: int) -> list[tuple[str, str]]:
    topics = defaultdict(set)
    for text, topic in rows:
        topics[text].add(topic)
    unique = sorted({(text, topic) for text, topic in rows if len(topics[text]) == 1}, key=lambda r: (r[1], r[0]))
    counts = Counter(topic for _, topic in unique)
    return [r for r in unique if counts[r[1]] >= min_count]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="The CSV file to write (columns text, label).")
    p.add_argument("--min-count", type=int, default=100, help="Drop topics with fewer statements.")
    p.add_argument("--language", default="english", help="The corpus folder (english, german, ...).")
    p.add_argument("--corpus", help="chatterbot_corpus/data (default: the installed package's).")
    args = p.parse_args(argv)
    folder = Path(args.corpus or corpus_dir()) / args.language
    if not folder.is_dir():
        raise SystemExit(f"chatterbot_topics.py: no folder {folder}")
    rows = topic_rows(statements(folder), args.min_count)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "label"])
        w.writerows(rows)
    counts = Counter(topic for _, topic in rows)
    print(f"{args.output}: {len(rows)} statements, {len(counts)} topics: "
          + ", ".join(f"{t} {n}" for t, n in counts.most_common()))


if __name__ == "__main__":
    main()
