"""`trainrun-data labelled` as a real subprocess: encodings against transformers' BertTokenizerFast, the same
rows as CSV / JSON Lines / Parquet / a datasets folder, regression, token classification, bad input."""

import csv
import json
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, TRAINRUN_DATA, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reference as R  # noqa: E402  (reads the .pb files without trainrun)

SEQ = 24
WORDS = ("the parser reads a line and the tokenizer splits it into words while the model learns "
         "what every label means from many short and long examples of text").split()
NAMES = ["entailment", "neutral", "contradiction"]


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS, n)).capitalize() + rng.choice([".", "!", "?", ", then more."])


def _rows(n=40, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = _sentence(rng, int(rng.integers(1, 30))), _sentence(rng, int(rng.integers(1, 12)))
        if i == 3:
            a = 'quoted, "with commas"\nand a second line'          # CSV quoting and a newline in a field
        rows.append({"premise": a, "hypothesis": b, "label": NAMES[i % 3], "score": round(float(rng.random()) * 5, 2)})
    return rows


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A WordPiece trained as `trainrun-data bert --train-wordpiece` does, saved without a post-processor."""
    from trainrun.data_tools.bert import train_wordpiece
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_wordpiece(lambda: [" ".join(WORDS)] * 3 + ["Quoted, with commas and a second line!?"], 120, False) \
        .save(str(path))
    return str(path)


def _write_csv(path, rows, fields):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(fields)
        for r in rows:
            w.writerow([r[f] for f in fields])


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _labelled(inputs, out, tokenizer, *more, check=0):
    args = [a for p in inputs for a in ("--input", str(p))]
    return run([TRAINRUN_DATA, "labelled", *args, "--tokenizer", tokenizer, "--seq-len", str(SEQ), "--output",
                str(out), *more], check=check)


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


def _bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.torch
def test_pairs_match_transformers_and_every_format_gives_the_same_bytes(tmp_path, tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import BertTokenizerFast
    rows = _rows()
    pair = ["--text-field", "premise", "--text-pair-field", "hypothesis", "--label-field", "label",
            "--eval-fraction", "0.25"]
    _write_csv(tmp_path / "rows.csv", rows, ["label", "premise", "hypothesis", "score"])
    _labelled([tmp_path / "rows.csv"], tmp_path / "csv", tokenizer, *pair)
    # every row once, split by content hash; each encoded as transformers encodes the pair
    hf = BertTokenizerFast(tokenizer_file=str(tmp_path / "csv" / "tokenizer.json"))
    by_text = {}
    for r in rows:
        enc = hf(r["premise"], r["hypothesis"], truncation=True, max_length=SEQ, padding="max_length")
        by_text[tuple(enc["input_ids"])] = (enc, r["label"])
    m = _manifest(tmp_path / "csv" / "train")
    assert m["id2label"] == {"0": "contradiction", "1": "entailment", "2": "neutral"}       # sorted names
    assert m["num_labels"] == 3 and m["problem_type"] == "single_label_classification" and m["seq_len"] == SEQ
    samples = R.tensor_samples(str(tmp_path / "csv" / "train")) + R.tensor_samples(str(tmp_path / "csv" / "eval"))
    assert len(samples) == len(rows) and len(R.tensor_samples(str(tmp_path / "csv" / "eval"))) == 10
    truncated = 0
    for s in samples:
        enc, label = by_text[tuple(s["input_ids"].tolist())]
        assert s["segment_ids"].tolist() == enc["token_type_ids"]
        assert s["input_mask"].tolist() == enc["attention_mask"]
        assert s["labels"].dtype == np.int64 and s["labels"].shape == () and m["id2label"][str(s["labels"])] == label
        truncated += int(s["input_mask"].all())
    assert truncated > 5          # longest-first truncation met (and agreed with transformers)

    # the same rows as JSON Lines, Parquet and a datasets folder (labels as ClassLabel ids): the same bytes
    _write_jsonl(tmp_path / "rows.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=7)
    features = datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=sorted(NAMES)), "score": datasets.Value("float")})
    ds = datasets.Dataset.from_list([dict(r, label=sorted(NAMES).index(r["label"])) for r in rows], features=features)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(str(tmp_path / "hf"))
    expected = {part: _bytes(tmp_path / "csv" / part) for part in ("train", "eval")}
    for name, inputs, more in [("jsonl", [tmp_path / "rows.jsonl"], []),
                               ("parquet", [tmp_path / "rows.parquet"], []),
                               ("hf", [tmp_path / "hf"], ["--split", "train"])]:
        _labelled(inputs, tmp_path / f"from-{name}", tokenizer, *pair, *more)
        assert {part: _bytes(tmp_path / f"from-{name}" / part) for part in ("train", "eval")} == expected, name

    # --eval-input and --eval-split: the eval rows from another split of the datasets folder
    _labelled([tmp_path / "rows.jsonl"], tmp_path / "evalin", tokenizer, *pair, "--eval-input", str(tmp_path / "hf"),
              "--eval-split", "test")
    assert len(R.tensor_samples(str(tmp_path / "evalin" / "train"))) == len(rows)
    ev = R.tensor_samples(str(tmp_path / "evalin" / "eval"))
    assert len(ev) == 5 and [int(s["labels"]) for s in ev] == [sorted(NAMES).index(r["label"]) for r in rows[:5]]


def test_regression_ids_and_label_names(tmp_path, tokenizer):
    rows = _rows(12, seed=1)
    _write_jsonl(tmp_path / "r.jsonl", rows)
    one = ["--text-field", "premise", "--eval-fraction", "0"]
    _labelled([tmp_path / "r.jsonl"], tmp_path / "reg", tokenizer, *one, "--label-field", "score")
    m = _manifest(tmp_path / "reg" / "train")
    assert m["num_labels"] == 1 and m["problem_type"] == "regression" and not (tmp_path / "reg" / "eval").exists()
    got = [s["labels"] for s in R.tensor_samples(str(tmp_path / "reg" / "train"))]
    assert all(g.dtype == np.float32 and g.shape == () for g in got)
    assert [float(g) for g in got] == [float(np.float32(r["score"])) for r in rows]
    # whole numbers: ids unless --regression
    _write_jsonl(tmp_path / "i.jsonl", [dict(r, stars=i % 4 + 1) for i, r in enumerate(rows)])
    _labelled([tmp_path / "i.jsonl"], tmp_path / "ids", tokenizer, *one, "--label-field", "stars")
    m = _manifest(tmp_path / "ids" / "train")
    assert m["num_labels"] == 5 and m["id2label"]["4"] == "LABEL_4"
    assert [int(s["labels"]) for s in R.tensor_samples(str(tmp_path / "ids" / "train"))] == [i % 4 + 1 for i in range(12)]
    proc = _labelled([tmp_path / "i.jsonl"], tmp_path / "ids", tokenizer, *one, "--label-field", "stars", "--regression",
                     check=2)
    assert "already holds train, tokenizer.json; pass --overwrite" in proc.stderr
    _labelled([tmp_path / "i.jsonl"], tmp_path / "ids", tokenizer, *one, "--label-field", "stars", "--regression",
              "--overwrite")
    assert _manifest(tmp_path / "ids" / "train")["num_labels"] == 1
    # --label-names: the order of the ids, names and ids both taken
    _write_jsonl(tmp_path / "n.jsonl", [dict(r, label=r["label"] if i % 2 else NAMES.index(r["label"]))
                                        for i, r in enumerate(rows)])
    _labelled([tmp_path / "n.jsonl"], tmp_path / "names", tokenizer, *one, "--label-field", "label",
              "--label-names", ",".join(NAMES + ["other"]))
    m = _manifest(tmp_path / "names" / "train")
    assert m["label2id"] == {"entailment": 0, "neutral": 1, "contradiction": 2, "other": 3}
    assert [int(s["labels"]) for s in R.tensor_samples(str(tmp_path / "names" / "train"))] == [i % 3 for i in range(12)]


@pytest.mark.torch
def test_token_classification_labels_first_subtokens_as_transformers_examples(tmp_path, tokenizer):
    from transformers import BertTokenizerFast
    rng = np.random.default_rng(3)
    tags = ["O", "B-X", "I-X"]
    rows = []
    for i in range(10):
        words = [str(w) for w in rng.choice(WORDS + ["unparseable", "tokenizers!"], int(rng.integers(2, 20)))]
        labels = [str(t) for t in rng.choice(tags, len(words))]
        rows.append({"tokens": words if i % 2 else " ".join(words), "ner": labels if i % 2 else " ".join(labels)})
    _write_jsonl(tmp_path / "ner.jsonl", rows)
    _labelled([tmp_path / "ner.jsonl"], tmp_path / "ner", tokenizer, "--task", "token_classification",
              "--text-field", "tokens", "--label-field", "ner", "--eval-fraction", "0")
    m = _manifest(tmp_path / "ner" / "train")
    assert m["task"] == "token_classification" and m["id2label"] == {"0": "B-X", "1": "I-X", "2": "O"}
    hf = BertTokenizerFast(tokenizer_file=str(tmp_path / "ner" / "tokenizer.json"))
    samples = R.tensor_samples(str(tmp_path / "ner" / "train"))
    split_subtokens = 0
    for r, s in zip(rows, samples):
        words = r["tokens"] if isinstance(r["tokens"], list) else r["tokens"].split()
        labels = r["ner"] if isinstance(r["ner"], list) else r["ner"].split()
        enc = hf(words, is_split_into_words=True, truncation=True, max_length=SEQ, padding="max_length")
        want, previous = [], None          # transformers' run_ner.py, label_all_tokens=False
        for w in enc.word_ids():
            want.append(-100 if w is None or w == previous else sorted(tags).index(labels[w]))
            split_subtokens += int(w is not None and w == previous)
            previous = w
        assert s["input_ids"].tolist() == enc["input_ids"] and s["labels"].tolist() == want
    assert split_subtokens > 0
    # a datasets folder of word lists and ClassLabel tag ids: the names (in the ClassLabel's order) from its
    # dataset_info.json, the same sub-tokens labelled
    import datasets
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner": datasets.Sequence(datasets.ClassLabel(names=tags))})
    as_lists = [{"tokens": r["tokens"] if isinstance(r["tokens"], list) else r["tokens"].split(),
                 "ner": [tags.index(t) for t in (r["ner"] if isinstance(r["ner"], list) else r["ner"].split())]}
                for r in rows]
    datasets.Dataset.from_list(as_lists, features=features).save_to_disk(str(tmp_path / "hf"))
    _labelled([tmp_path / "hf"], tmp_path / "ner-hf", tokenizer, "--task", "token_classification",
              "--text-field", "tokens", "--label-field", "ner", "--eval-fraction", "0")
    assert _manifest(tmp_path / "ner-hf" / "train")["id2label"] == {"0": "O", "1": "B-X", "2": "I-X"}
    relabel = np.array([tags.index(n) for n in sorted(tags)])         # sorted-name ids -> ClassLabel ids
    for s, t in zip(samples, R.tensor_samples(str(tmp_path / "ner-hf" / "train"))):
        assert (t["input_ids"] == s["input_ids"]).all()
        assert t["labels"].tolist() == [-100 if v == -100 else int(relabel[v]) for v in s["labels"]]


def test_bad_input_is_named_and_nothing_is_written(tmp_path, tokenizer):
    good = _rows(6)
    cases = {
        "nofield.jsonl": ("".join(json.dumps(r) + "\n" for r in good[:2]) + json.dumps({"premise": "x"}) + "\n",
                          ["--label-field", "label"], "nofield.jsonl:3: no field 'label'"),
        "notjson.jsonl": (json.dumps(good[0]) + "\n{oops\n", ["--label-field", "label"], "notjson.jsonl:2: not JSON"),
        "ragged.csv": ("premise,label\na,neutral\nb,neutral,extra\n", ["--label-field", "label"],
                       "ragged.csv:3: 3 values, the header names 2 columns"),
        "nocol.csv": ("premise,tag\na,x\n", ["--label-field", "label"], "nocol.csv:1: no column 'label'"),
        "unknown.jsonl": ("".join(json.dumps(r) + "\n" for r in good), ["--label-field", "label", "--label-names",
                          "entailment,neutral"], "unknown.jsonl:3: label 'contradiction' of field 'label' is not one of"),
        "float.jsonl": (json.dumps(dict(good[0], score="high")) + "\n", ["--label-field", "score", "--regression"],
                        "float.jsonl:1: label 'high' of field 'score' is not a number"),
        "list.jsonl": (json.dumps(dict(good[0], premise=["a"])) + "\n", ["--label-field", "label"],
                       "list.jsonl:1: field 'premise' is list, not a string"),
        "words.jsonl": (json.dumps({"premise": "two words", "label": "O"}) + "\n",
                        ["--label-field", "label", "--task", "token_classification"],
                        "words.jsonl:1: 2 words in 'premise' but 1 labels in 'label'"),
    }
    for name, (text, more, message) in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        out = tmp_path / ("out-" + name)
        proc = _labelled([tmp_path / name], out, tokenizer, "--text-field", "premise", "--eval-fraction", "0", *more,
                         check=2)
        assert message in proc.stderr, (name, proc.stderr)
        assert not (out / "train").exists() and not (out / "tokenizer.json").exists()


def test_the_chatterbot_topics_recipe_data(tmp_path):
    """scripts/chatterbot_topics.py: the statements of chatterbot-corpus (a test dependency) by topic,
    each statement under one topic, the same file twice; `labelled` turns it into 6 classes."""
    from trainrun.data_tools.bert import train_wordpiece
    script = os.path.join(ROOT, "scripts", "chatterbot_topics.py")
    for name in ("a.csv", "b.csv"):
        out = run([sys.executable, script, "--output", str(tmp_path / name)], check=0).stdout
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    with open(tmp_path / "a.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    topics = {}
    for r in rows:
        topics.setdefault(r["text"], set()).add(r["label"])
    assert all(len(t) == 1 for t in topics.values()) and len(topics) == len(rows) > 1000
    counts = {t: sum(r["label"] == t for r in rows) for t in {r["label"] for r in rows}}
    assert min(counts.values()) >= 100 and len(counts) >= 5 and "tech_support" not in counts, out  # 20 statements x 105
    train_wordpiece(lambda: [r["text"] for r in rows], 800, False).save(str(tmp_path / "tok.json"))
    _labelled([tmp_path / "a.csv"], tmp_path / "topics", str(tmp_path / "tok.json"), "--text-field", "text",
              "--label-field", "label", "--eval-fraction", "0.2")
    m = _manifest(tmp_path / "topics" / "train")
    assert m["id2label"] == {str(i): t for i, t in enumerate(sorted(counts))}
    assert m["num_samples"] + _manifest(tmp_path / "topics" / "eval")["num_samples"] == len(rows)


def test_the_topics_recipe_names_a_missing_package_before_any_work(tmp_path):
    """scripts/recipe_topics.py where chatterbot-corpus and scikit-learn cannot be imported (as in the venv
    `make demo` makes; here each made unimportable in the script's own process): exit 2 before anything is
    written, naming the package, why the recipe needs it and the install step; scikit-learn's absence said
    as the baseline row it leaves out."""
    script, work = os.path.join(ROOT, "scripts", "recipe_topics.py"), tmp_path / "work"
    hide = ("import runpy, sys; sys.modules['chatterbot_corpus'] = sys.modules['sklearn'] = None; "
            f"sys.argv = ['recipe_topics.py', '--work', {str(work)!r}]; runpy.run_path({script!r}, run_name='__main__')")
    proc = run([sys.executable, "-c", hide], check=2)
    assert ("recipe_topics: chatterbot-corpus is not installed (its statements are the labelled set): "
            "`make setup-test` installs it with the test extra, or `.venv/bin/pip install chatterbot-corpus==1.3.3`"
            in proc.stderr), proc.stderr
    assert ("recipe_topics: note: scikit-learn is not installed: the TF-IDF + logistic regression row will be "
            "left out (`make setup-test` installs it)" in proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and not work.exists()


def test_a_causal_lm_tokenizer_keeps_its_own_special_tokens(tmp_path):
    """A byte-level BPE with a BOS post-processor and no [CLS] / [SEP] (as SmolLM2's and Llama's, for their
    sequence classifiers): each sample is the tokenizer's own encoding (BOS then the text), truncated to
    --seq-len, padded with 0 (input_mask says where the text ends), its tokenizer.json written unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<|endoftext|>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(tmp_path / "bpe.json"))
    rows = _rows(12)
    _write_jsonl(tmp_path / "rows.jsonl", rows)
    _labelled([tmp_path / "rows.jsonl"], tmp_path / "out", str(tmp_path / "bpe.json"), "--text-field", "premise",
              "--label-field", "label", "--eval-fraction", "0")
    samples = R.tensor_samples(str(tmp_path / "out" / "train"))
    written = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert len(samples) == len(rows)
    for row, s in zip(rows, samples):
        ids = tok.encode(row["premise"]).ids[:SEQ]
        assert ids[0] == tok.token_to_id("<s>") and written.encode(row["premise"]).ids == tok.encode(row["premise"]).ids
        n = len(ids)
        assert list(s["input_ids"][:n]) == ids and not s["input_ids"][n:].any(), (row, s["input_ids"])
        assert list(s["input_mask"]) == [1] * n + [0] * (SEQ - n) and not s["segment_ids"].any()
        assert int(s["labels"]) == sorted(NAMES).index(row["label"])
    assert _manifest(tmp_path / "out" / "train")["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
