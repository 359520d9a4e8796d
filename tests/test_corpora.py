"""`trainrun-data tokens` (and `bert`) on JSON Lines (.jsonl, .jsonl.gz), Parquet, Arrow files and folders
written by Hugging Face datasets' save_to_disk: the same documents as text files give the same dataset bytes,
whatever the workers; bad records named (file:line, row group and row, row), nothing written, or skipped and
counted with --skip-bad."""

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


# ---------------------------------------------------------------------- Hugging Face datasets, Arrow files
def _save(dataset, path, **kwargs):
    dataset.save_to_disk(str(path), **kwargs)
    return path


def test_a_datasets_folder_and_arrow_files_give_the_bytes_of_the_jsonl(docs, tmp_path):
    """A save_to_disk folder (3 Arrow files), its Arrow files globbed, an Arrow file in the IPC file layout
    and a DatasetDict's split: the bytes of the same records as JSON Lines. A DatasetDict of several splits
    without --split, an unknown split, --split without a DatasetDict: exit 2 naming the splits."""
    import pyarrow as pa
    from datasets import Dataset, DatasetDict
    _, texts = docs
    test_texts = texts[::3]
    for name, records in (("all", texts), ("test", test_texts)):
        _tokens([_jsonl(tmp_path / f"{name}.jsonl", [{"id": i, "body": t} for i, t in enumerate(records)])],
                tmp_path / f"want_{name}", "--text-field", "body")
    want = {name: tree_bytes(tmp_path / f"want_{name}") for name in ("all", "test")}
    ds = Dataset.from_dict({"id": list(range(len(texts))), "body": texts})
    folder = _save(ds, tmp_path / "saved", num_shards=3)
    table = pa.table({"id": list(range(len(texts))), "body": texts})
    with pa.ipc.new_file(str(tmp_path / "c.arrow"), table.schema) as fh:
        fh.write_table(table, max_chunksize=7)
    dd = _save(DatasetDict({"train": ds, "test": Dataset.from_dict({"body": test_texts})}), tmp_path / "dd")
    for name, inputs, extra, expect in [
            ("hf", [folder], ["--workers", "2"], "all"),
            ("globbed", [folder / "data-*.arrow"], ["--workers", "1"], "all"),
            ("file_layout", [tmp_path / "c.arrow"], ["--workers", "3"], "all"),
            ("split", [dd], ["--split", "test"], "test")]:
        p = _tokens(inputs, tmp_path / name, "--text-field", "body", *extra)
        assert f"{len(texts if expect == 'all' else test_texts)} documents" in p.stdout, name
        assert tree_bytes(tmp_path / name) == want[expect], name
    for extra, message in [([], f"--input {dd}: a DatasetDict of the splits train, test; choose one with --split"),
                           (["--split", "validation"], f"--split validation: --input {dd} has the splits train, test")]:
        p = _tokens([dd], tmp_path / "no", "--text-field", "body", *extra, check=2)
        assert message in p.stderr and "Traceback" not in p.stderr and not (tmp_path / "no").exists()
    p = _tokens([folder], tmp_path / "no", "--text-field", "body", "--split", "test", check=2)
    assert "--split test: no --input is a DatasetDict folder" in p.stderr
    p = _tokens([folder], tmp_path / "no", check=2)          # --text-field names a column it lacks
    assert f"{folder / 'data-00000-of-00003.arrow'}: no column 'text' (its columns: id, body)" in p.stderr


def test_bert_reads_a_datasets_split_as_its_text_files(docs, tmp_path):
    """`bert`: each record's text as one text file would be: a DatasetDict's split and the same texts as
    files give the same samples; --skip-bad skips a null, counted."""
    from datasets import Dataset, DatasetDict
    _, texts = docs
    texts = texts[:12]
    os.makedirs(tmp_path / "files")
    for i, t in enumerate(texts):
        (tmp_path / "files" / f"{i:03d}.txt").write_text(t, encoding="utf-8")
    args = ["--train-wordpiece", "200", "--seq-len", "32", "--dupe-factor", "1", "--eval-fraction", "0.2",
            "--no-progress"]
    run([TRAINRUN_DATA, "bert", "--input", str(tmp_path / "files"), "--output", str(tmp_path / "want"), *args],
        check=0)
    dd = _save(DatasetDict({"train": Dataset.from_dict({"body": [*texts[:5], None, *texts[5:]]}),
                            "test": Dataset.from_dict({"body": ["x"]})}), tmp_path / "dd", num_shards={"train": 2})
    cmd = [TRAINRUN_DATA, "bert", "--input", str(dd), "--split", "train", "--text-field", "body",
           "--output", str(tmp_path / "got"), *args]
    p = run(cmd, check=2)
    where = f"{dd / 'train' / 'data-00000-of-00002.arrow'}: row 5: column 'body' is NoneType, not a string"
    assert where in p.stderr and "--skip-bad" in p.stderr and not (tmp_path / "got").exists()
    p = run(cmd + ["--skip-bad"], check=0)
    assert f"2 files (12 texts, 0 empty skipped, 1 bad record(s) skipped (the first: {where}))" in p.stdout
    assert tree_bytes(tmp_path / "got") == tree_bytes(tmp_path / "want")


def test_a_truncated_arrow_file_is_named_or_its_readable_rows_kept(docs, tmp_path):
    from datasets import Dataset
    _, texts = docs
    folder = _save(Dataset.from_dict({"text": texts[:8]}), tmp_path / "hf", num_shards=2)
    last = folder / "data-00001-of-00002.arrow"
    last.write_bytes(last.read_bytes()[:-100])
    p = _tokens([folder], tmp_path / "out", check=2)
    assert f"{last}: row 0: unreadable from here on, the file is truncated or corrupt (" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()
    p = _tokens([folder], tmp_path / "out", "--skip-bad")
    assert "4 documents" in p.stdout and f"1 bad record(s) skipped (the first: {last}: row 0: unreadable" in p.stdout
