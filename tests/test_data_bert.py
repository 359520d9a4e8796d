"""`trainrun-data bert` as a real subprocess: the samples' invariants, determinism, bad input."""

import json
import os
import sys

import numpy as np
import pytest

from conftest import ROOT, TRAINRUN_DATA, run, synthetic_text_dir
from test_data_tools import tree_bytes

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reference as R  # noqa: E402  (reads the .pb files without trainrun)

MLM_PROB, PER_FILE = 0.2, 200
ARGS = ["--seq-len", "64", "--max-predictions", "8", "--masked-lm-prob", str(MLM_PROB), "--dupe-factor", "2",
        "--short-seq-prob", "0.2", "--seed", "7", "--eval-fraction", "0.1", "--samples-per-file", str(PER_FILE),
        "--no-progress"]
# the text dir also holds notes.src (not a default suffix) and skip/ (*.py, taken by default): these pick
# exactly the top-level *.py and notes.src, as the globs of test_same_bytes_... do
PICK = ["--include", "*.py", "--include", "*.src", "--exclude", "skip", "--exclude", "__pycache__"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    text = root / "text"
    synthetic_text_dir(str(text), max_bytes=120_000)
    (text / "notes.src").write_text("".join(f"Note {i} says the parser reads a line.\nIt ends here.\n\n"
                                            for i in range(40)))
    synthetic_text_dir(str(text / "skip"), max_bytes=5_000, seed=1)
    run([TRAINRUN_DATA, "bert", "--input", str(text), "--output", str(root / "a"),
         "--train-wordpiece", "600", *PICK, *ARGS], check=0)
    return root


def test_samples_are_bert_pretraining_pairs(built):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(built / "a" / "tokenizer.json"))
    cls, sep, mask = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]"))
    assert tok.token_to_id("[PAD]") == 0
    samples = R.tensor_samples(str(built / "a" / "train"))
    assert len(samples) > 500 and len(R.tensor_samples(str(built / "a" / "eval"))) > 10
    files = json.loads((built / "a" / "train" / "manifest.json").read_text())["files"]    # --samples-per-file
    assert [f["num_samples"] for f in files] == [PER_FILE] * (len(samples) // PER_FILE) + (
        [len(samples) % PER_FILE] if len(samples) % PER_FILE else [])
    replaced = kept = masked = 0
    for s in samples:
        ids, seg, inmask = s["input_ids"], s["segment_ids"], s["input_mask"]
        n = int(inmask.sum())
        assert ids.shape == (64,) and s["masked_lm_positions"].shape == (8,) and s["next_sentence_labels"].shape == ()
        assert (inmask[:n] == 1).all() and (inmask[n:] == 0).all() and (ids[n:] == 0).all() and (seg[n:] == 0).all()
        seps = np.flatnonzero(ids[:n] == sep)
        used = s["masked_lm_ids"] != 0
        k = int(used.sum())
        pos = s["masked_lm_positions"][used]
        # [CLS] A [SEP] B [SEP], segment 0 then 1; a masked [SEP] would break this, none is ever chosen
        assert ids[0] == cls and seps[-1] == n - 1 and len(seps) >= 2
        a_end = seps[-2] if ids[seps[-2]] == sep and (seg[:seps[-2] + 1] == 0).all() else None
        assert a_end is not None and (seg[a_end + 1:n] == 1).all() and a_end >= 2 and n - 1 - a_end >= 2
        assert k == min(8, max(1, round(n * MLM_PROB)))
        assert (s["masked_lm_positions"][~used] == 0).all() and (np.diff(pos) > 0).all()
        assert ((pos > 0) & (pos < n - 1) & (pos != a_end)).all()
        at = ids[pos]
        masked += int((at == mask).sum())
        kept += int((at == s["masked_lm_ids"][used]).sum())
        replaced += int(((at != mask) & (at != s["masked_lm_ids"][used])).sum())
    total = masked + kept + replaced
    # 80/10/10 (a random replacement may draw the original token: it then counts as kept)
    assert abs(masked / total - 0.8) < 0.03 and abs(kept / total - 0.1) < 0.03 and abs(replaced / total - 0.1) < 0.03
    labels = np.array([int(s["next_sentence_labels"]) for s in samples])
    assert set(labels) == {0, 1} and 0.4 < labels.mean() < 0.75       # > 1/2: one-sentence chunks pair randomly


def test_same_bytes_with_the_written_tokenizer_and_any_thread_count(built, tmp_path):
    out = tmp_path / "b"
    globs = [str(built / "text" / "*.py"), str(built / "text" / "*.src")]     # the files PICK chose
    run([TRAINRUN_DATA, "bert", "--input", *globs, "--output", str(out),
         "--tokenizer", str(built / "a" / "tokenizer.json"), *ARGS], check=0, env={"RAYON_NUM_THREADS": "1"})
    same = tree_bytes(out)
    assert same == tree_bytes(built / "a")
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert manifest["seq_len"] == 64 and manifest["tokenizer_file"] == "../tokenizer.json"
    # another seed: other samples, replacing the dataset in place (--overwrite)
    run([TRAINRUN_DATA, "bert", "--input", str(built / "text"), "--output", str(out), "--overwrite", *PICK,
         "--tokenizer", str(built / "a" / "tokenizer.json"), *[("8" if a == "7" else a) for a in ARGS]], check=0)
    again = tree_bytes(out)
    files = json.loads(again[os.path.join("train", "manifest.json")])["files"]
    assert {k for k in again if k.startswith("train")} == {os.path.join("train", n) for n in
                                                           ["manifest.json"] + [f["file"] for f in files]}
    assert again["tokenizer.json"] == same["tokenizer.json"] and again != same


def test_trained_wordpiece_is_the_same_bytes_in_another_process(built, tmp_path):
    # tokenizers' trainer numbered the "##" tokens in the order of its (Rust) hash maps, seeded anew in
    # each process whatever PYTHONHASHSEED says: other ids, other samples
    out = tmp_path / "b"
    run([TRAINRUN_DATA, "bert", "--input", str(built / "text"), "--output", str(out), "--train-wordpiece", "600",
         *PICK, *ARGS], check=0, env={"PYTHONHASHSEED": "1"})
    assert tree_bytes(out) == tree_bytes(built / "a")


@pytest.mark.torch
def test_tokenizer_adds_cls_and_sep_as_the_samples_hold_them(built, tmp_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    path = built / "a" / "tokenizer.json"
    raw = Tokenizer.from_file(str(path))
    cls, sep = raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]")
    a, b = (raw.encode(t, add_special_tokens=False).ids for t in ("Hello world.", "The parser reads a line."))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert tok("Hello world.")["input_ids"] == [cls, *a, sep]
    pair = tok("Hello world.", "The parser reads a line.", return_token_type_ids=True)   # as a sample holds them
    assert pair["input_ids"] == [cls, *a, sep, *b, sep]
    assert pair["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    # a --tokenizer without a post-processor gets BERT's
    spec = json.loads(path.read_text())
    spec["post_processor"] = None
    (tmp_path / "plain.json").write_text(json.dumps(spec))
    run([TRAINRUN_DATA, "bert", "--input", str(built / "text" / "notes.src"), "--output", str(tmp_path / "o"),
         "--tokenizer", str(tmp_path / "plain.json"), "--eval-fraction", "0", "--no-progress"], check=0)
    assert (tmp_path / "o" / "tokenizer.json").read_bytes() == path.read_bytes()


def test_bad_input_is_named_and_nothing_is_written(built, tmp_path):
    out = tmp_path / "o"
    # a GPT-2-style byte-level BPE has no [CLS]/[SEP]/[MASK]
    run([TRAINRUN_DATA, "tokens", "--input", str(built / "text"), "--output", str(tmp_path / "bpe"),
         "--train-bpe", "300", "--no-progress"], check=0)
    bpe = str(tmp_path / "bpe" / "tokenizer.json")
    p = run([TRAINRUN_DATA, "bert", "--input", str(built / "text"), "--output", str(out), "--tokenizer", bpe], check=2)
    assert bpe in p.stderr and "[CLS]" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    p = run([TRAINRUN_DATA, "bert", "--input", str(tmp_path / "blank.txt"), "--output", str(out),
             "--train-wordpiece", "100", "--eval-fraction", "0"], check=2)
    assert "hold no text" in p.stderr and not out.exists()
    p = run([TRAINRUN_DATA, "bert", "--input", str(built / "text"), "--output", str(built / "a"),
             "--train-wordpiece", "100"], check=2)
    assert "--overwrite" in p.stderr
    p = run([TRAINRUN_DATA, "bert", "--input", str(built / "text"), "--output", str(out)], check=2)
    assert "exactly one of" in p.stderr
