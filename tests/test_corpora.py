"""`trainrun-data tokens` on JSON Lines (.jsonl, .jsonl.gz) and Parquet: the same documents as text files give
the same dataset bytes, whatever the workers; bad records named (file:line, row group and row), nothing
written, or skipped and counted with --skip-bad."""

import gzip
import json
import os

import pytest

from conftest import TRAINRUN_DATA, run, synthetic_text_dir
from test_data_tools import tree_bytes


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """The same 30-odd documents as text files (sorted names: their order) and as a list of texts."""
    root = tmp_path_factory.mktemp("corpora")
    text = synthetic_text_dir(str(root / "text"), max_bytes=150_000, seed=3)
    (root / "text" / "zz_unicode.txt").write_text("caf\u00e9 \u2014 \U0001F600 \"quoted\"\n", encoding="utf-8")
    names = sorted(os.listdir(text))
    return root, [(root / "text" / n).read_text(encoding="utf-8") for n in names]


def _tokens(inputs, out, *extra, check=0):
    return run([TRAINRUN_DATA, "tokens", *[a for i in inputs for a in ("--input", str(i))], "--output", str(out),
                "--train-bpe", "300", "--eval-fraction", "0.1", "--no-progress", *extra], check=check)


def _jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as fh:
        for r in records:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_jsonl_gz_and_parquet_give_the_bytes_of_the_text_files(docs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    root, texts = docs
    _tokens([root / "text"], tmp_path / "from_text")
    want = tree_bytes(tmp_path / "from_text")
    records = [{"id": i, "body": t} for i, t in enumerate(texts)]
    jsonl = _jsonl(tmp_path / "c.jsonl", records)
    gz = _jsonl(tmp_path / "c.jsonl.gz", records, opener=gzip.open)
    pq.write_table(pa.table({"id": list(range(len(texts))), "body": texts}), tmp_path / "c.parquet", row_group_size=7)
    for name, inputs, extra in [("jsonl", [jsonl], ["--workers", "1"]), ("jsonl_w3", [jsonl], ["--workers", "3"]),
                                ("gz", [gz], ["--workers", "2"]), ("parquet", [tmp_path / "c.parquet"], ["--workers", "3"])]:
        p = _tokens(inputs, tmp_path / name, "--text-field", "body", *extra)
        assert f"{len(texts)} documents" in p.stdout
        assert tree_bytes(tmp_path / name) == want, name
    # text files and records mixed in one call: the first half as files, the rest as records
    half = len(texts) // 2
    os.makedirs(tmp_path / "some")
    for i, t in enumerate(texts[:half]):
        (tmp_path / "some" / f"a{i:03d}.txt").write_text(t, encoding="utf-8")
    rest = _jsonl(tmp_path / "zz.jsonl", [{"text": t} for t in texts[half:]])
    _tokens([tmp_path / "some", rest], tmp_path / "mixed")
    assert tree_bytes(tmp_path / "mixed") == want


@pytest.mark.parametrize("case", ["not json", "no field", "not a string", "parquet null"])
def test_bad_records_are_named_and_nothing_is_written(case, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = [{"text": f"document {i}\n" * 20} for i in range(12)]
    if case == "parquet null":
        path = tmp_path / "c.parquet"
        values = [g["text"] for g in good]
        values[9] = None
        pq.write_table(pa.table({"text": values}), path, row_group_size=4)
        where = f"{path}: row group 2, row 1"
    else:
        bad = {"not json": '{"text": "unfinished', "no field": {"title": "x"}, "not a string": {"text": 42}}[case]
        path = _jsonl(tmp_path / "c.jsonl", good[:4] + [bad] + good[4:])
        where = f"{path}:5"
    out = tmp_path / "out"
    p = _tokens([path], out, check=2)
    assert where in p.stderr and "--skip-bad" in p.stderr
    assert not out.exists() or not any(out.iterdir())
    p = _tokens([path], out, "--skip-bad")
    assert "1 bad record(s) skipped" in p.stdout and where in p.stdout
    assert f"{11 if case == 'parquet null' else 12} documents" in p.stdout     # the null replaced a good row


def test_a_truncated_jsonl_gz_is_named_or_its_readable_records_kept(tmp_path):
    """A .jsonl.gz cut short stops with exit 2 naming the file and the line where it breaks off; --skip-bad
    keeps the records before the break and counts the rest as one bad record; with no record left, the
    error says how many were skipped."""
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for i in range(12):
            fh.write(json.dumps({"text": f"document {i}\n" * 20}) + "\n")
            if i == 7:
                fh.flush()                   # the first 8 records decodable from the bytes so far
                cut = path.stat().st_size
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    out = tmp_path / "out"
    p = _tokens([path], out, check=2)
    assert f"{path}:9: unreadable from here on, the file is truncated or corrupt (EOFError" in p.stderr
    assert "Traceback" not in p.stderr and (not out.exists() or not any(out.iterdir()))
    p = _tokens([path], out, "--skip-bad")
    assert "8 documents" in p.stdout and f"1 bad record(s) skipped (the first: {path}:9: unreadable" in p.stdout
    path.write_bytes(data[:5])
    bad = _jsonl(tmp_path / "bad.jsonl", ["not json", {"title": "x"}])
    p = _tokens([path, bad], tmp_path / "none", "--skip-bad", check=2)
    assert f"the 2 file(s) found hold no good document: 3 bad record(s) skipped (the first: {bad}:1:" in p.stderr


def test_a_parquet_file_without_the_column_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["a b c"] * 5}), tmp_path / "c.parquet")
    p = _tokens([tmp_path / "c.parquet"], tmp_path / "out", check=2)
    assert "no column 'text'" in p.stderr and "content" in p.stderr
