"""`trainrun-data` as a real subprocess, and the tokenizer short cut against the tokenizers library."""

import hashlib
import json
import math
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from conftest import TRAINRUN_DATA, run, synthetic_text_dir
from trainrun.data import TrainLoader, open_dataset
from trainrun.data_tools.encode import TokenizerEncoder, train_bpe

TRICKY = [
    "def f(x):\n    return x's  \n\n\t\tcan't won't I'm we'll they've you'd He'S\n",
    "a  b   c\n \n  \r\n\x0b\x0c x\x1c\x1dy \x1e z\x1f\x00\x7f end   ",
    "x\n\x1c\x1d\n  \x1f  y\t\x1e",             # \x1c-\x1f: whitespace to Python's re, not to GPT-2's
    "12345 x1y2 3.14e-5 0x1F __init__ --flag=1 ''' \"\"\" ~!@#$%^&*()_+{}|:<>? ",
    "trailing spaces then newline   \n",
    "   leading spaces",
    "naïve café — «quoted» ½ ² Ⅻ 中文字符 emoji 🙂 a\u00a0b c\u2003d e\u0301 tab\tend",
    "mixed ascii line\nünïcödé line\n    indented ascii line\n\u3000ideographic space\n  x",
    "special <|endoftext|> inside the text",
    "",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small corpus: synthetic Python-like modules plus tricky files; .pyc, __pycache__ and .bin are skipped."""
    root = tmp_path_factory.mktemp("corpus")
    synthetic_text_dir(str(root / "lib"), max_bytes=150_000)
    (root / "notes").mkdir()
    for i, text in enumerate(TRICKY):
        (root / "notes" / f"t{i}.txt").write_text(text, encoding="utf-8")
    (root / "notes" / "latin1.txt").write_bytes("caf\xe9 bad utf-8\n".encode("latin-1"))
    (root / "lib" / "__pycache__").mkdir()
    (root / "lib" / "__pycache__" / "skip.py").write_text("not me")
    (root / "notes" / "skip.bin").write_bytes(b"\x00\x01")
    return root


def corpus_docs(root):
    """(path, bytes) of the files trainrun-data takes from ``root``, in its order (sorted paths)."""
    paths = sorted(str(p) for p in root.rglob("*") if p.is_file() and p.suffix in (".txt", ".py")
                   and "__pycache__" not in p.parts)
    return [(p, open(p, "rb").read()) for p in paths]


def expected_split(docs, fraction):
    """Eval = the ceil(fraction * n) non-empty documents with the smallest sha256 of their content."""
    docs = [(p, d) for p, d in docs if d]
    n_eval = math.ceil(fraction * len(docs))
    chosen = {p for p, d in sorted(docs, key=lambda x: (hashlib.sha256(x[1]).digest(), x[0]))[:n_eval]}
    return [d for p, d in docs if p not in chosen], [d for p, d in docs if p in chosen]


def shard_tokens(directory):
    m = json.loads((directory / "manifest.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[m["dtype"]]
    return m, np.concatenate([np.fromfile(directory / s["file"], dtype) for s in m["shards"]])


def tree_bytes(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------- tokens
def test_tokens_bytes_round_trip(corpus, tmp_path):
    out = tmp_path / "ds"
    proc = run([TRAINRUN_DATA, "tokens", "--input", str(corpus), "--output", str(out), "--bytes",
                "--eval-fraction", "0.2", "--shard-size", "10k"], check=0)
    assert "tokenizing" in proc.stderr                       # the progress bar
    train, evals = expected_split(corpus_docs(corpus), 0.2)
    for split, docs in (("train", train), ("eval", evals)):
        m, tokens = shard_tokens(out / split)
        expected = np.concatenate([np.append(np.frombuffer(d.decode("utf-8", "replace").encode(), np.uint8), 256)
                                   for d in docs])
        assert np.array_equal(tokens, expected), split
        assert m["vocab_size"] == 257 and m["eos_id"] == 256 and m["num_documents"] == len(docs)
    assert len(m["shards"]) >= 1 and len(shard_tokens(out / "train")[0]["shards"]) > 5
    assert not (out / "tokenizer.json").exists()


def test_tokens_chars_is_character_level_and_its_tokenizer_serves_more_text(corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, workers in ((a, "1"), (b, "2")):
        run([TRAINRUN_DATA, "tokens", "--input", str(corpus), "--output", str(out), "--chars", "--eval-fraction",
             "0.2", "--workers", workers, "--no-progress"], check=0)
    assert tree_bytes(a) == tree_bytes(b)
    docs = [d.decode("utf-8", "replace") for _, d in corpus_docs(corpus)]
    chars = sorted(set("".join(docs)))              # the eval split's characters too
    train, evals = expected_split(corpus_docs(corpus), 0.2)
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    for split, part in (("train", train), ("eval", evals)):
        m, tokens = shard_tokens(a / split)
        assert m["vocab_size"] == len(chars) + 1 and m["eos_id"] == 0, split
        texts = [d.decode("utf-8", "replace") for d in part]
        assert tok.decode(tokens.tolist(), skip_special_tokens=False) == "".join(t + "<|endoftext|>" for t in texts)
        plain = [t for t in texts if "<|endoftext|>" not in t]      # the special token's text is one token
        expected = np.concatenate([[chars.index(c) + 1 for c in t] + [0] for t in plain])
        assert np.array_equal(np.concatenate([tokens[:0]] + _documents(tokens, texts, plain)), expected), split
    # its tokenizer.json on another text: the same ids; a character it never saw becomes the EOS token
    (tmp_path / "more.txt").write_text("def x\u2603", encoding="utf-8")
    run([TRAINRUN_DATA, "tokens", "--input", str(tmp_path / "more.txt"), "--output", str(tmp_path / "m"),
         "--tokenizer", str(a / "tokenizer.json"), "--eval-fraction", "0", "--no-progress"], check=0)
    _, more = shard_tokens(tmp_path / "m" / "train")
    assert more.tolist() == [chars.index(c) + 1 for c in "def x"] + [0, 0]
    proc = run([TRAINRUN_DATA, "tokens", "--input", str(corpus), "--output", str(tmp_path / "c"), "--chars",
                "--bytes"], check=2)
    assert "--chars" in proc.stderr


def _documents(tokens, texts, plain):
    """The token runs (each ending in EOS 0) of the documents ``plain`` among ``texts``."""
    ends = np.flatnonzero(tokens == 0)
    out, start, k = [], 0, 0
    for t in texts:
        n = t.count("<|endoftext|>") + 1                 # EOS ids: the document's own special tokens + its end
        stop = ends[k + n - 1] + 1
        if t in plain:
            out.append(tokens[start:stop])
        start, k = stop, k + n
    return out


def test_tokens_bpe_deterministic_and_decodes(corpus, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, workers in ((a, "1"), (b, "3")):       # 3 tokenizer processes: the same bytes
        run([TRAINRUN_DATA, "tokens", "--input", str(corpus), "--output", str(out), "--train-bpe", "600",
             "--workers", workers, "--no-progress"], check=0)
    assert tree_bytes(a) == tree_bytes(b)
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    m, tokens = shard_tokens(a / "train")
    train, _ = expected_split(corpus_docs(corpus), 0.01)
    text = tok.decode(tokens.tolist(), skip_special_tokens=False)
    assert text == "".join(d.decode("utf-8", "replace") + "<|endoftext|>" for d in train)
    assert m["tokenizer_id"] == "sha256:" + hashlib.sha256((a / "tokenizer.json").read_bytes()).hexdigest()
    # the saved tokenizer, loaded with --tokenizer, gives the same shards; globs, the same files
    globs = [os.path.join(str(corpus), "lib", "*.py"), os.path.join(str(corpus), "notes", "*.txt")]
    run([TRAINRUN_DATA, "tokens", "--input", *globs, "--output", str(c), "--tokenizer",
         str(a / "tokenizer.json"), "--no-progress"], check=0)
    assert tree_bytes(c) == tree_bytes(a)
    # another end-of-document token of the same tokenizer (--eos); one it lacks is named
    d = tmp_path / "d"
    run([TRAINRUN_DATA, "tokens", "--input", str(corpus), "--output", str(d), "--tokenizer",
         str(a / "tokenizer.json"), "--eos", "e", "--no-progress"], check=0)
    m_d, tokens_d = shard_tokens(d / "train")
    assert m_d["eos_id"] == tok.token_to_id("e") != m["eos_id"]
    assert np.count_nonzero(tokens_d == m_d["eos_id"]) > np.count_nonzero(tokens == m_d["eos_id"])
    proc = run([TRAINRUN_DATA, "tokens", "--input", str(corpus), "--output", str(tmp_path / "e"), "--tokenizer",
                str(a / "tokenizer.json"), "--eos", "<nope>", "--no-progress"], check=2)
    assert "the tokenizer has no end-of-document token '<nope>'" in proc.stderr


def test_tokens_add_the_special_tokens_of_the_tokenizers_post_processor(corpus, tmp_path):
    """A tokenizer whose post-processor frames each text (Llama 2's ``<s> $A``, Llama 3's BOS, a template
    with BOS and EOS): each document is its encoding with the special tokens added, then the end-of-document
    token unless the template already ended it with that one; 1 or 2 tokenizer processes, the same bytes."""
    from tokenizers import processors
    docs = [d.decode("utf-8", "replace") for _, d in corpus_docs(corpus)]
    tok = train_bpe(docs, 400, progress=False, length=len(docs))
    tok.add_special_tokens(["<s>", "</s>"])
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    train, _ = expected_split(corpus_docs(corpus), 0.01)
    texts = [d.decode("utf-8", "replace") for d in train]
    for template, end in (("<s> $A </s>", []), ("<s> $A", [eos])):
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", bos),
                                                                                             ("</s>", eos)])
        tok.save(str(tmp_path / "tokenizer.json"))
        outs = [tmp_path / f"{template}-{workers}" for workers in ("1", "2")]
        for out, workers in zip(outs, ("1", "2")):
            run([TRAINRUN_DATA, "tokens", "--input", str(corpus), "--output", str(out), "--tokenizer",
                 str(tmp_path / "tokenizer.json"), "--eos", "</s>", "--workers", workers, "--no-progress"], check=0)
        assert tree_bytes(outs[0]) == tree_bytes(outs[1]), template
        m, tokens = shard_tokens(outs[0] / "train")
        expected = [i for t in texts for i in tok.encode(t).ids + end]
        assert tokens.tolist() == expected, template
        assert expected[0] == bos and expected[-1] == eos and m["eos_id"] == eos
        assert np.count_nonzero(tokens == bos) == np.count_nonzero(tokens == eos) == len(texts)


def test_tokens_positional_inputs_and_exclude(corpus, tmp_path):
    """Inputs as arguments; --exclude replaces the default exclusions: excluding notes leaves lib."""
    a, b = tmp_path / "a", tmp_path / "b"
    run([TRAINRUN_DATA, "tokens", str(corpus), "--exclude", "notes", "--exclude", "__pycache__", "--output",
         str(a), "--bytes", "--no-progress"], check=0)
    run([TRAINRUN_DATA, "tokens", "--input", str(corpus / "lib"), "--output", str(b), "--bytes", "--no-progress"],
        check=0)
    assert tree_bytes(a) == tree_bytes(b)
    assert shard_tokens(a / "train")[0]["num_documents"] == len(corpus_docs(corpus / "lib")) - 1   # eval: 1


def test_fast_path_matches_the_library(corpus):
    texts = TRICKY + [d.decode("utf-8", "replace") for _, d in corpus_docs(corpus)]
    tok = train_bpe(texts, 400, progress=False)
    enc = TokenizerEncoder(tok)
    assert enc.fast
    for chunk in (texts, texts[::-1]):           # cold and warm piece cache
        got = enc.encode(chunk)
        ref = tok.encode_batch(chunk, add_special_tokens=False)
        assert [g.tolist() for g in got] == [r.ids for r in ref]
    other = Tokenizer.from_str(tok.to_str())       # another split: no short cut, the library's path
    other.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    slow = TokenizerEncoder(other)
    assert not slow.fast
    ref = other.encode_batch(TRICKY, add_special_tokens=False)
    assert [g.tolist() for g in slow.encode(TRICKY)] == [r.ids for r in ref]


# ---------------------------------------------------------------------- a source corpus through the loader
def test_source_corpus_dataset_trains_through_the_loader(tmp_path):
    src = synthetic_text_dir(str(tmp_path / "lib"), max_bytes=400_000)
    out = tmp_path / "ds"
    run([TRAINRUN_DATA, "tokens", "--input", src, "--output", str(out), "--train-bpe", "512", "--no-progress"],
        check=0)
    proc = run([TRAINRUN_DATA, "inspect", str(out / "train"), "--seq-len", "64"], check=0)
    assert "sha256 of 1 shard(s) verified: OK" in proc.stdout and "vocab_size 512" in proc.stdout
    ds = open_dataset(out / "train", 64, vocab_size=512, n_positions=64)
    _, stream = shard_tokens(out / "train")
    windows = {tuple(stream[i * 64:i * 64 + 65]) for i in range(ds.num_samples)}
    with TrainLoader(ds, 4, 2, rank=1, world_size=2, seed=0) as loader:
        micro = loader.next_step()
    assert len(micro) == 2 and micro[0]["input_ids"].shape == (4, 64)
    for b in micro:
        for ids, labels in zip(b["input_ids"], b["labels"]):
            assert tuple(ids) + (labels[-1],) in windows and np.array_equal(ids[1:], labels[:-1])


# ---------------------------------------------------------------------- tensors and inspect
def test_tensors_from_npz_and_inspect(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (7, 16))
    np.savez(tmp_path / "a.npz", input_ids=ids[:4], mask=np.ones((4, 16), np.float32))
    np.savez(tmp_path / "b.npz", input_ids=ids[4:], mask=np.ones((3, 16), np.float32))
    out = tmp_path / "pb"
    proc = run([TRAINRUN_DATA, "tensors", "--input", str(tmp_path / "a.npz"), "--input", str(tmp_path / "b.npz"),
                "--output", str(out), "--samples-per-file", "3", "--rename", "mask=attention_mask"], check=0)
    assert "7 samples in 3 file(s)" in proc.stdout
    ds = open_dataset(out, 16, vocab_size=100)
    assert ds.feature_names == ["input_ids", "attention_mask"]
    assert np.array_equal(ds.read(np.arange(7), ds.new_batch(7))["input_ids"], ids)
    proc = run([TRAINRUN_DATA, "inspect", str(out)], check=0)
    assert "7 samples in 3 file(s)" in proc.stdout and "input_ids: int64 [16]" in proc.stdout
    part = out / "part-00001.pb"
    part.write_bytes(part.read_bytes()[:-1] + b"\x00")
    proc = run([TRAINRUN_DATA, "inspect", str(out)], check=2)
    assert "part-00001.pb: sha256 checksum mismatch" in proc.stderr and "Traceback" not in proc.stderr
    proc = run([TRAINRUN_DATA, "inspect", str(out), "--no-verify"], check=0)    # sizes only: they hold
    assert "7 samples in 3 file(s)" in proc.stdout
    proc = run([TRAINRUN_DATA, "tensors", "--input", str(tmp_path / "a.npz"), "--output", str(out), "--overwrite"],
               check=0)                                  # replaces every old .pb file and the manifest
    assert sorted(p.name for p in out.glob("*.pb")) == ["part-00000.pb"]
    assert "4 samples in 1 file(s)" in run([TRAINRUN_DATA, "inspect", str(out)], check=0).stdout
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 2)), y=np.zeros(4))
    proc = run([TRAINRUN_DATA, "tensors", "--input", str(tmp_path / "bad.npz"), "--output", str(tmp_path / "o")],
               check=2)
    assert "one common first dimension" in proc.stderr


def test_tensors_from_npy_files(tmp_path):
    """.npy files are the features of one table, each named after its file; bad ones are named, exit 2,
    and nothing is written."""
    rng = np.random.default_rng(1)
    x, label = rng.normal(size=(5, 1, 4, 4)).astype(np.float32), rng.integers(0, 10, 5)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "label.npy", label)
    out = tmp_path / "pb"
    proc = run([TRAINRUN_DATA, "tensors", "--input", str(tmp_path / "x.npy"), "--input", str(tmp_path / "label.npy"),
                "--output", str(out), "--rename", "label=y"], check=0)
    assert "5 samples in 1 file(s)" in proc.stdout
    ds = open_dataset(out, None)
    b = ds.read(np.arange(5), ds.new_batch(5))
    assert ds.feature_names == ["x", "y"] and np.array_equal(b["x"], x) and np.array_equal(b["y"], label)
    np.save(tmp_path / "short.npy", label[:4])
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}] * 5, dtype=object), allow_pickle=True)
    (tmp_path / "z.npz").write_bytes(b"not a zip")
    for bad, message in [(["x.npy", "short.npy"], "one common first dimension"),
                         (["obj.npy"], "obj.npy: not a readable .npy of a plain array"),
                         (["x.npy", "z.npz"], "z.npz: not a readable .npz")]:
        proc = run([TRAINRUN_DATA, "tensors", *[a for f in bad for a in ("--input", str(tmp_path / f))],
                    "--output", str(tmp_path / "o")], check=2)
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "o").exists()


def test_inspect_and_tokens_usage_errors(corpus, tmp_path):
    out = tmp_path / "ds"
    run([TRAINRUN_DATA, "tokens", "--input", str(corpus / "notes"), "--output", str(out), "--bytes",
         "--no-progress"], check=0)
    shard = out / "train" / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    one_file = next(p for p in sorted((corpus / "notes").iterdir()) if p.is_file())
    for cmd, message in [
        (["inspect", str(out / "train")], "shard-00000.bin: truncated"),
        (["inspect", str(tmp_path / "missing")], "missing: dataset directory does not exist"),
        (["tokens", "--input", str(corpus), "--output", str(out), "--bytes"], "pass --overwrite"),
        (["tokens", "--input", str(corpus), "--output", str(tmp_path / "x"), "--bytes", "--train-bpe", "300"],
         "choose exactly one of"),
        (["tokens", "--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "x"), "--bytes"],
         "nothing: no such file or directory"),
        (["tokens", "--input", str(corpus), "--output", str(tmp_path / "x"), "--train-bpe", "100"],
         "at least 257"),
        # one text file is one document: the default eval fraction takes it, and the message says what to do
        (["tokens", "--input", str(one_file), "--output", str(tmp_path / "x"), "--bytes"],
         "--eval-fraction 0.01: 1 document(s) leave none to train on (each text file is one document, each "
         "record of a .jsonl / .parquet file one): pass more files, --eval-fraction 0 (no eval set), or "
         "split the text into files (e.g. `mkdir DIR && split -l 1000 --additional-suffix=.txt FILE DIR/part-`, "
         "then --input DIR)"),
    ]:
        proc = run([TRAINRUN_DATA, *cmd], check=2)
        assert message in proc.stderr and "Traceback" not in proc.stderr, (cmd, proc.stderr)
    run([TRAINRUN_DATA, "tokens", "--input", str(corpus / "notes"), "--output", str(out), "--bytes", "--overwrite",
         "--no-progress"], check=0)
    run([TRAINRUN_DATA, "inspect", str(out / "train")], check=0)      # the truncated shard was replaced
