"""``trainrun-data``: build and check the binary datasets that ``trainrun`` reads.

Exit codes: 0 success, 2 usage error or bad data (the cause named), 1 any other
failure (one line; the traceback with TRAINRUN_TRACEBACK=1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import numpy as np

from trainrun.data import MANIFEST, open_dataset
from trainrun.errors import TrainrunError, UsageError

from .corpus import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, Corpus, find_files, read_documents
from .encode import EOS_TOKEN
from .writers import TensorShardWriter, TokenShardWriter

CHUNK_BYTES = 8 << 20        # text tokenized per batch call
WORKER_BYTES = 4 << 20       # at least this much text per tokenizer process (by default)


class _Group(click.Group):
    """Turns our errors into their exit code and a message, without a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except TrainrunError as exc:
            click.echo(exc.render().replace("trainrun:", "trainrun-data:", 1), err=True)
            ctx.exit(exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - the contract's one-line cause
            if os.environ.get("TRAINRUN_TRACEBACK") == "1":
                raise
            click.echo(f"trainrun-data: error: {type(exc).__name__}: {exc}", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Build and check trainrun's binary datasets (token shards, .pb tensor samples)."""


def _size(text: str) -> int:
    """'100M' -> 100_000_000 (suffixes k, M, G)."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a count like 1000000 or 100M") from None


def _prepare_output(out: Path, names: list[str], overwrite: bool) -> None:
    existing = [n for n in names if (out / n).exists()]
    if existing and not overwrite:
        raise UsageError(f"{out}: already holds {', '.join(existing)}; pass --overwrite to replace")
    for n in existing:
        shutil.rmtree(out / n) if (out / n).is_dir() else (out / n).unlink()
    out.mkdir(parents=True, exist_ok=True)


def _text_inputs(command):
    """--input PATH..., positional PATHs and --output DIR: the text-corpus commands' common options."""
    for option in reversed([
            click.option("--input", "inputs", multiple=True, metavar="PATH",
                         help="Text file, record file (.jsonl, .jsonl.gz, .parquet, .arrow), directory (walked; "
                              "one written by datasets' save_to_disk: its records) or glob ('**' recursive); "
                              "repeatable."),
            click.argument("more_inputs", nargs=-1, metavar="[PATH]..."),
            click.option("--output", required=True, type=click.Path(file_okay=False),
                         help="Dataset directory to create.")]):
        command = option(command)
    return command


def _record_inputs(command):
    """--text-field, --skip-bad, --split: how the text-corpus commands read records."""
    for option in reversed([
            click.option("--text-field", default="text", show_default=True,
                         help="The field (.jsonl, .jsonl.gz) or column (.parquet, .arrow, a datasets folder) "
                              "holding each record's text."),
            click.option("--skip-bad", is_flag=True,
                         help="Skip records that are not JSON or lack a string --text-field, and the unreadable "
                              "rest of a truncated file (counted) instead of stopping."),
            click.option("--split", help="The split to read of a DatasetDict folder (datasets' save_to_disk).")]):
        command = option(command)
    return command


# ---------------------------------------------------------------------- tokens
@main.command()
@_text_inputs
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, dir_okay=False),
              help="Use this tokenizer.json (e.g. GPT-2's).")
@click.option("--train-bpe", type=int, metavar="VOCAB_SIZE", help="Train a byte-level BPE of this size.")
@click.option("--bytes", "use_bytes", is_flag=True, help="Raw UTF-8 bytes (vocab 257, EOS 256).")
@click.option("--chars", "use_chars", is_flag=True,
              help="Characters: a vocabulary of the documents' distinct characters (EOS 0), as nanoGPT's "
                   "shakespeare_char; written to DIR/tokenizer.json for --tokenizer on more text.")
@click.option("--eos", default=EOS_TOKEN, show_default=True, help="End-of-document token (--tokenizer).")
@click.option("--eval-fraction", type=float, default=0.01, show_default=True,
              help="Fraction of documents (by content hash) for DIR/eval; 0 for none.")
@click.option("--shard-size", default="100M", show_default=True, help="Tokens per shard file (k/M/G suffixes).")
@click.option("--include", multiple=True, default=DEFAULT_INCLUDE, show_default=True,
              help="File name patterns taken from directories.")
@click.option("--exclude", multiple=True, default=DEFAULT_EXCLUDE, show_default=True,
              help="File and directory names skipped in directories.")
@click.option("--workers", type=click.IntRange(min=1),
              help="Tokenizer processes (default: one per core, one per 4 MB of text at most).")
@_record_inputs
@click.option("--overwrite", is_flag=True, help="Replace a dataset already in --output.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def tokens(inputs, more_inputs, output, tokenizer_path, train_bpe, use_bytes, use_chars, eos, eval_fraction, shard_size,
           include, exclude, workers, text_field, skip_bad, split, overwrite, progress):
    """Tokenize text into token shards: DIR/train, DIR/eval, DIR/tokenizer.json.

    Each text file is a document; each record of a .jsonl, .jsonl.gz, .parquet or
    .arrow file or of a datasets save_to_disk folder (its --text-field) is one.
    Every document is framed by the special tokens its tokenizer's post-processor adds (Llama's BOS) and
    followed by the end-of-document token (once). The same input and
    options give the same bytes, whatever the number of workers.
    """
    from tqdm import tqdm
    if sum([tokenizer_path is not None, train_bpe is not None, use_bytes, use_chars]) != 1:
        raise UsageError("choose exactly one of --tokenizer FILE, --train-bpe VOCAB_SIZE, --bytes, --chars")
    inputs = list(inputs) + list(more_inputs)
    if not inputs:
        raise UsageError("--input: give at least one file, directory or glob")
    shard_tokens = _size(shard_size)
    t0 = time.perf_counter()
    files = find_files(inputs, include, exclude, split)
    scan = tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True, desc="reading",
                disable=not progress)
    corpus = Corpus(files, text_field, skip_bad, progress=scan.update)
    scan.close()
    train_docs, eval_docs = corpus.split(eval_fraction)
    out = Path(output)
    _prepare_output(out, ["train", "eval", "tokenizer.json"], overwrite)
    encoder = _make_encoder(tokenizer_path, train_bpe, use_chars, eos, corpus, train_docs, progress)
    if encoder.tokenizer_json is not None:
        (out / "tokenizer.json").write_text(encoder.tokenizer_json, encoding="utf-8")
    worker_args = ["--bytes"] if use_bytes else ["--tokenizer", str(out / "tokenizer.json"), "--eos", eos]
    t1 = time.perf_counter()
    total = int(corpus.size.sum())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    summary = []
    for split, docs in (("train", train_docs), ("eval", eval_docs)):
        if not len(docs):
            continue
        writer = TokenShardWriter(out / split, encoder.vocab_size, shard_tokens)
        for ids in _encode_files(corpus, docs, encoder, worker_args, workers, out, bar):
            writer.add(ids)
        m = writer.close(eos_id=encoder.eos_id, tokenizer_id=encoder.tokenizer_id, num_documents=len(docs),
                         tokenizer_file="../tokenizer.json" if encoder.tokenizer_json is not None else None)
        summary.append(f"{split}: {len(docs)} documents, {m['num_tokens']:,} tokens, "
                       f"{len(m['shards'])} shard(s)")
    bar.close()
    t2 = time.perf_counter()
    click.echo(f"{out}: {len(files)} files, {len(corpus)} documents ({corpus.empty} empty skipped"
               f"{', ' + corpus.skipped if corpus.bad else ''}), "
               f"{total / 1e6:.1f} MB of text")
    for line in summary:
        click.echo("  " + line)
    click.echo(f"  tokenizer: {encoder.tokenizer_id} (vocab_size {encoder.vocab_size}, eos_id {encoder.eos_id})")
    click.echo(f"  time: {t2 - t0:.1f} s (tokenizer {t1 - t0:.1f} s, tokenizing {total / 1e6 / (t2 - t1):.1f} MB/s)")


def _make_encoder(tokenizer_path, train_bpe, use_chars, eos, corpus, train_docs, progress):
    from .encode import BytesEncoder, TokenizerEncoder, char_tokenizer, load_tokenizer, train_bpe as train
    if use_chars:      # every document's characters, the eval split's too (nanoGPT: the whole text)
        return TokenizerEncoder(char_tokenizer(read_documents(corpus.files, corpus.refs(range(len(corpus))),
                                                              corpus.field)))
    if tokenizer_path:
        return TokenizerEncoder(load_tokenizer(tokenizer_path), eos)
    if train_bpe is not None:
        docs = read_documents(corpus.files, corpus.refs(train_docs), corpus.field)
        return TokenizerEncoder(train(docs, train_bpe, progress, length=len(train_docs)))
    return BytesEncoder()


def _batches(sizes, limit=CHUNK_BYTES):
    """Consecutive groups of documents of about ``limit`` bytes: (count, bytes)."""
    count, size = 0, 0
    for n in sizes:
        count, size = count + 1, size + int(n)
        if size >= limit:
            yield count, size
            count, size = 0, 0
    if count:
        yield count, size


def _encode_in_process(files, refs, sizes, field, encoder, report):
    """Token ids of the documents ``refs``, each framed by the encoder's ``start`` and ``end`` ids (the
    tokenizer's special tokens, the end-of-document id), as a stream of arrays."""
    texts = read_documents(files, refs, field)
    for count, size in _batches(sizes):
        for ids in encoder.encode([next(texts) for _ in range(count)]):
            if len(encoder.start):
                yield encoder.start
            yield ids
            yield encoder.end
        report(size)


def _encode_files(corpus, docs, encoder, worker_args, workers, out: Path, bar):
    """As :func:`_encode_in_process`, on ``workers`` processes, each a contiguous share of the documents."""
    sizes = corpus.size[docs]
    if workers is None:
        workers = min(len(os.sched_getaffinity(0)), max(1, int(sizes.sum()) // WORKER_BYTES))
    if workers == 1 or len(docs) == 1:
        yield from _encode_in_process(corpus.files, corpus.refs(docs), sizes, corpus.field, encoder, bar.update)
        return
    with tempfile.TemporaryDirectory(dir=out, prefix=".tokens-") as tmp:
        procs, results = [], []
        try:
            for k, share in enumerate(_shares(sizes, workers)):
                listing, err = Path(tmp) / f"{k}.files", open(Path(tmp) / f"{k}.err", "w+")
                listing.write_text(json.dumps({"files": [str(p) for p in corpus.files], "field": corpus.field,
                                               "refs": corpus.refs(docs[share]), "sizes": sizes[share].tolist()}),
                                   encoding="utf-8")
                results.append(Path(tmp) / f"{k}.tokens")
                cmd = [sys.executable, "-m", "trainrun.data_tools.cli", "encode-part", "--files", str(listing),
                       "--output", str(results[-1]), *worker_args]
                procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                               env=dict(os.environ, RAYON_NUM_THREADS="1")), err))
            _follow_progress([p for p, _ in procs], bar)
            for proc, err in procs:
                if proc.wait() != 0:
                    err.seek(0)
                    raise TrainrunError(f"a tokenizer worker failed: {err.read().strip()[-800:]}")
        finally:
            for proc, err in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                err.close()
        for result in results:       # read in 64 MB pieces (a memory map would count all of it as resident)
            with open(result, "rb") as fh:
                while chunk := fh.read(4 << 24):
                    yield np.frombuffer(chunk, np.dtype("<i4"))


def _follow_progress(procs, bar) -> None:
    """Advance ``bar`` by the byte counts the workers print, until all have closed their output."""
    lock = threading.Lock()

    def follow(proc):
        for line in proc.stdout:
            with lock:
                bar.update(int(line))
    readers = [threading.Thread(target=follow, args=(p,), daemon=True) for p in procs]
    for t in readers:
        t.start()
    for t in readers:
        t.join()


def _shares(sizes, n):
    """Documents of ``sizes`` cut into ``n`` contiguous shares of about equal bytes (slices)."""
    total = np.cumsum(sizes)
    cuts = np.searchsorted(total, total[-1] * np.arange(1, n) / n)
    bounds = [0, *cuts.tolist(), len(sizes)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@main.command("encode-part", hidden=True)
@click.option("--files", "listing", required=True, help="JSON: files, field, refs (file index, place), sizes.")
@click.option("--output", required=True, help="Token ids (int32, little-endian), EOS after each document.")
@click.option("--tokenizer", "tokenizer_path")
@click.option("--eos", default=EOS_TOKEN)
@click.option("--bytes", "use_bytes", is_flag=True)
def encode_part(listing, output, tokenizer_path, eos, use_bytes):
    """Worker of `tokens`: encode the listed documents; print the bytes done after each batch."""
    from .encode import BytesEncoder, TokenizerEncoder, load_tokenizer
    encoder = BytesEncoder() if use_bytes else TokenizerEncoder(load_tokenizer(tokenizer_path), eos)
    job = json.loads(Path(listing).read_text(encoding="utf-8"))
    files = [Path(p) for p in job["files"]]
    with open(output, "wb") as fh:
        for ids in _encode_in_process(files, job["refs"], job["sizes"], job["field"], encoder,
                                      lambda n: print(n, flush=True)):
            fh.write(ids.astype("<i4").tobytes())


# ---------------------------------------------------------------------- tensors
@main.command()
@click.option("--input", "inputs", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False),
              help=".npz file (one array per feature) or .npy file (one feature, named after the file); "
                   "repeatable.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Directory for the .pb files.")
@click.option("--samples-per-file", type=int, default=10000, show_default=True)
@click.option("--rename", multiple=True, metavar="OLD=NEW", help="Store array OLD under the tensor name NEW.")
@click.option("--overwrite", is_flag=True, help="Replace .pb files and manifest already in --output.")
def tensors(inputs, output, samples_per_file, rename, overwrite):
    """Write .npz / .npy arrays as tensor samples in ONNX Runtime's .pb layout (+ manifest.json).

    Sample i holds row i of every array, named after the array. Each .npz is a table of samples
    (several .npz: their samples one after the other); the .npy files together form one table, each
    file a feature named after its file name (x.npy -> x), all of one length.
    """
    names = dict(r.split("=", 1) for r in rename if "=" in r)
    if len(names) != len(rename):
        raise UsageError(f"--rename: expected OLD=NEW, got {list(rename)}")
    tables = [(p, _read_npz(p)) for p in inputs if not p.endswith(".npy")]
    npy = [p for p in inputs if p.endswith(".npy")]
    if npy:
        stems = [Path(p).stem for p in npy]
        if len(set(stems)) != len(stems):
            raise UsageError(f"--input: .npy files name their feature by file name; these repeat one: {npy}")
        tables.append((", ".join(npy), {s: _read_array(p) for s, p in zip(stems, npy)}))
    tables = [(path, {names.get(k, k): a for k, a in arrays.items()}) for path, arrays in tables]
    first = None
    for path, arrays in tables:       # every problem found before anything is written
        lengths = {k: (len(a) if a.ndim else None) for k, a in arrays.items()}
        if not arrays or None in lengths.values() or len(set(lengths.values())) != 1:
            raise UsageError(f"--input {path}: needs arrays with one common first dimension, got {lengths}")
        spec = {k: f"{a.dtype} {list(a.shape[1:])}" for k, a in arrays.items()}
        if first is not None and spec != first[1]:
            raise UsageError(f"--input {path}: its samples hold {spec}, those of {first[0]} {first[1]}")
        first = first or (path, spec)
    out = Path(output)
    old = [p.name for p in out.glob("*.pb")] + ([MANIFEST] if (out / MANIFEST).exists() else [])
    _prepare_output(out, old, overwrite)
    writer = TensorShardWriter(out, samples_per_file)
    for path, arrays in tables:
        for i in range(len(next(iter(arrays.values())))):
            writer.add({k: a[i] for k, a in arrays.items()})
    m = writer.close()
    feats = ", ".join(f"{k} {v['dtype']} {v['shape']}" for k, v in m["features"].items())
    click.echo(f"{out}: {m['num_samples']} samples in {len(m['files'])} file(s); {feats}")


def _read_npz(path: str) -> dict:
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise UsageError(f"--input {path}: not a readable .npz of plain arrays ({exc})") from None


def _read_array(path: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
        if not isinstance(arr, np.ndarray):
            raise ValueError("not an .npy array")
    except (OSError, ValueError) as exc:
        raise UsageError(f"--input {path}: not a readable .npy of a plain array ({exc})") from None
    return arr


# ---------------------------------------------------------------------- bert
@main.command()
@_text_inputs
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, dir_okay=False),
              help="A BERT WordPiece tokenizer.json ([PAD] = 0, [CLS], [SEP], [MASK]).")
@click.option("--train-wordpiece", type=int, metavar="VOCAB_SIZE", help="Train an uncased WordPiece of this size.")
@click.option("--seq-len", type=click.IntRange(min=8), default=128, show_default=True, help="Tokens per sample.")
@click.option("--max-predictions", type=click.IntRange(min=1), default=20, show_default=True,
              help="Masked positions per sample at most.")
@click.option("--masked-lm-prob", type=click.FloatRange(0, 1, min_open=True), default=0.15, show_default=True)
@click.option("--dupe-factor", type=click.IntRange(min=1), default=5, show_default=True,
              help="Passes over the documents, each with other masks and pairs.")
@click.option("--short-seq-prob", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="Probability of a shorter target length.")
@click.option("--seed", type=click.IntRange(min=0), default=12345, show_default=True)
@click.option("--eval-fraction", type=float, default=0.01, show_default=True,
              help="Fraction of documents (files, records; by content hash) for DIR/eval; 0 for none.")
@click.option("--samples-per-file", type=click.IntRange(min=1), default=10000, show_default=True)
@click.option("--include", multiple=True, default=DEFAULT_INCLUDE, show_default=True,
              help="File name patterns taken from directories.")
@click.option("--exclude", multiple=True, default=DEFAULT_EXCLUDE, show_default=True,
              help="File and directory names skipped in directories.")
@_record_inputs
@click.option("--overwrite", is_flag=True, help="Replace a dataset already in --output.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def bert(inputs, more_inputs, output, tokenizer_path, train_wordpiece, seq_len, max_predictions, masked_lm_prob,
         dupe_factor, short_seq_prob, seed, eval_fraction, samples_per_file, include, exclude, text_field, skip_bad,
         split, overwrite, progress):
    """BERT pre-training samples (masked LM + next sentence) in ONNX Runtime's .pb layout:
    DIR/train, DIR/eval, DIR/tokenizer.json.

    Input as Google's create_pretraining_data.py reads it: one sentence per line, a blank
    line between documents; each text file, and each record's --text-field (of a .jsonl,
    .jsonl.gz, .parquet or .arrow file or a datasets save_to_disk folder), as such a file.
    Same input and options, same bytes.
    """
    from .bert import Vocab, documents, instances, train_wordpiece as train, with_template
    from .encode import load_tokenizer
    if (tokenizer_path is None) == (train_wordpiece is None):
        raise UsageError("choose exactly one of --tokenizer FILE, --train-wordpiece VOCAB_SIZE")
    inputs = list(inputs) + list(more_inputs)
    if not inputs:
        raise UsageError("--input: give at least one file, directory or glob")
    files = find_files(inputs, include, exclude, split)
    corpus = Corpus(files, text_field, skip_bad)
    parts = dict(zip(("train", "eval"), (corpus.refs(docs) for docs in corpus.split(eval_fraction))))
    texts = lambda part: read_documents(files, parts[part], text_field)    # noqa: E731
    if tokenizer_path:
        tokenizer, where = load_tokenizer(tokenizer_path), f"--tokenizer {tokenizer_path}"
    else:
        tokenizer = train(lambda: texts("train"), train_wordpiece, progress, length=len(parts["train"]))
        where = "--train-wordpiece"
    tokenizer.no_truncation()
    tokenizer.no_padding()
    vocab = Vocab(tokenizer, where)
    with_template(tokenizer, vocab)
    splits = {}
    for part, refs in parts.items():
        if refs:
            docs = documents(texts(part), tokenizer)
            if not docs:
                raise UsageError(f"--input: the {part} documents ({files[refs[0][0]]} ...) hold no text")
            splits[part] = docs
    out = Path(output)
    _prepare_output(out, ["train", "eval", "tokenizer.json"], overwrite)
    summary = []
    with tempfile.TemporaryDirectory(dir=out, prefix=".bert-") as tmp:    # nothing half-written in out
        for split, docs in splits.items():
            writer = TensorShardWriter(Path(tmp) / split, samples_per_file)
            seed_of_split = seed if split == "train" else seed + 1
            for sample in instances(docs, vocab, seq_len, max_predictions, masked_lm_prob, short_seq_prob,
                                    dupe_factor, seed_of_split):
                writer.add(sample)
            if writer.num_samples == 0:
                raise UsageError(f"--input: the {split} documents make no sample (each needs two non-empty parts)")
            m = writer.close(tokenizer_file="../tokenizer.json", vocab_size=vocab.size, seq_len=seq_len,
                             max_predictions=max_predictions, masked_lm_prob=masked_lm_prob, dupe_factor=dupe_factor,
                             short_seq_prob=short_seq_prob, seed=seed_of_split)
            summary.append(f"{split}: {len(docs)} documents, {m['num_samples']:,} samples in {len(m['files'])} file(s)")
        (Path(tmp) / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
        for name in ["tokenizer.json", *splits]:
            os.replace(Path(tmp) / name, out / name)
    click.echo(f"{out}: {len(files)} files ({len(corpus)} texts, {corpus.empty} empty skipped"
               f"{', ' + corpus.skipped if corpus.bad else ''})")
    for line in summary:
        click.echo("  " + line)
    click.echo(f"  tokenizer: vocab_size {vocab.size} ([PAD] 0, [CLS] {vocab.cls}, [SEP] {vocab.sep}, "
               f"[MASK] {vocab.mask}); seq_len {seq_len}, max_predictions {max_predictions}")


# ---------------------------------------------------------------------- labelled
@main.command()
@click.option("--input", "inputs", multiple=True, required=True, metavar="PATH",
              help="A .csv (header row), .jsonl, .jsonl.gz, .parquet or .arrow file, a datasets save_to_disk "
                   "folder, a directory (walked) or glob; repeatable.")
@click.option("--eval-input", "eval_inputs", multiple=True, metavar="PATH",
              help="The eval rows, as --input (then --eval-fraction is not used); repeatable.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Dataset directory to create.")
@click.option("--text-field", required=True, help="The column / field of the text (token classification: "
                                                  "of the words, a string or a list).")
@click.option("--text-pair-field", help="The column / field of the second text of a pair.")
@click.option("--label-field", required=True, help="The column / field of the label (token classification: "
                                                   "one per word, a string or a list).")
@click.option("--tokenizer", "tokenizer_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A BERT WordPiece tokenizer.json ([PAD] = 0, [CLS], [SEP]), or a causal LM's without [CLS] and "
                   "[SEP] (GPT-2's, SmolLM2's: its own special tokens).")
@click.option("--seq-len", type=click.IntRange(min=4), default=128, show_default=True,
              help="Tokens per sample (longer texts truncated, longest first).")
@click.option("--task", type=click.Choice(("sequence_classification", "token_classification")),
              default="sequence_classification", show_default=True)
@click.option("--regression", is_flag=True, help="The labels are numbers to predict (num_labels 1), even when "
                                                 "all are whole.")
@click.option("--label-names", metavar="A,B,...", help="The label names in id order (default: sorted, or "
                                                        "a datasets ClassLabel's).")
@click.option("--eval-fraction", type=float, default=0.1, show_default=True,
              help="Fraction of the rows (by hash of their text) for DIR/eval without --eval-input; 0 for none.")
@click.option("--split", help="The split to read of a DatasetDict folder given to --input.")
@click.option("--eval-split", help="The split to read of a DatasetDict folder given to --eval-input.")
@click.option("--overwrite", is_flag=True, help="Replace a dataset already in --output.")
def labelled(inputs, eval_inputs, output, text_field, text_pair_field, label_field, tokenizer_path, seq_len, task,
             regression, label_names, eval_fraction, split, eval_split, overwrite):
    """Labelled text as fine-tuning samples (.pb): DIR/train, DIR/eval, DIR/tokenizer.json.

    Each row gives input_ids, segment_ids, input_mask and labels ([CLS] text [SEP]
    (pair [SEP]), or a causal LM tokenizer's own special tokens, truncated
    longest-first, padded with 0). The label map is saved in the manifests (id2label,
    label2id, num_labels, problem_type).
    """
    import hashlib
    from .bert import Vocab, with_template
    from .encode import load_tokenizer
    from .labelled import Labels, class_label_names, encode, label_values, prepare_rows, read_rows
    if task == "token_classification" and (text_pair_field or regression):
        raise UsageError("--task token_classification: takes neither --text-pair-field nor --regression")
    if regression and label_names:
        raise UsageError("--regression: takes no --label-names")
    fields = [text_field, *([text_pair_field] if text_pair_field else []), label_field]
    include = ("*.csv", "*.jsonl", "*.jsonl.gz", "*.parquet", "*.arrow")
    files = {"train": find_files(list(inputs), include, DEFAULT_EXCLUDE, split)}
    if eval_inputs:
        files["eval"] = find_files(list(eval_inputs), include, DEFAULT_EXCLUDE, eval_split)
    elif eval_split:
        raise UsageError("--eval-split: needs --eval-input")
    rows = {part: prepare_rows((r for f in fs for r in read_rows(f, fields)), task, bool(text_pair_field), fields)
            for part, fs in files.items()}
    if not rows["train"]:
        raise UsageError(f"--input: {len(files['train'])} file(s) with no row")
    if not eval_inputs:
        if not 0 <= eval_fraction < 1:
            raise UsageError(f"--eval-fraction {eval_fraction}: must be in [0, 1)")
        keys = [hashlib.sha256(json.dumps(r[1:3], ensure_ascii=False).encode()).digest()[:8] for r in rows["train"]]
        chosen = set(sorted(range(len(keys)), key=keys.__getitem__)[:int(np.ceil(eval_fraction * len(keys)))])
        if len(chosen) == len(keys):
            raise UsageError(f"--eval-fraction {eval_fraction}: {len(keys)} row(s) leave none to train on")
        rows = {"train": [r for i, r in enumerate(rows["train"]) if i not in chosen],
                "eval": [r for i, r in enumerate(rows["train"]) if i in chosen]}
    names = label_names.split(",") if label_names else class_label_names(
        [f for fs in files.values() for f in fs], label_field)
    labels = Labels([v for part in rows.values() for v in label_values(part, task)], label_field, regression,
                    names)
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.no_padding()
    if tokenizer.token_to_id("[CLS]") is None and tokenizer.token_to_id("[SEP]") is None:
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)     # a causal LM's: its own special tokens
    else:
        vocab = Vocab(tokenizer, f"--tokenizer {tokenizer_path}")
        with_template(tokenizer, vocab)
        vocab_size = vocab.size
    tokenizer.enable_truncation(max_length=seq_len, strategy="longest_first")
    out = Path(output)
    _prepare_output(out, ["train", "eval", "tokenizer.json"], overwrite)
    summary = []
    with tempfile.TemporaryDirectory(dir=out, prefix=".labelled-") as tmp:    # nothing half-written in out
        for part, part_rows in rows.items():
            if not part_rows:
                continue
            writer = TensorShardWriter(Path(tmp) / part, 10000)
            for sample in encode(part_rows, tokenizer, labels, task, seq_len, bool(text_pair_field)):
                writer.add(sample)
            m = writer.close(tokenizer_file="../tokenizer.json", vocab_size=vocab_size, seq_len=seq_len, task=task,
                             text_field=text_field, text_pair_field=text_pair_field, label_field=label_field,
                             **labels.manifest())
            summary.append(f"{part}: {m['num_samples']:,} samples in {len(m['files'])} file(s)")
        tokenizer.no_truncation()
        (Path(tmp) / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
        for name in ["tokenizer.json", *[p for p in rows if rows[p]]]:
            os.replace(Path(tmp) / name, out / name)
    n_files = sum(map(len, files.values()))
    kind = {"float": "regression", "ids": "label ids", "names": "label names"}[labels.kind]
    click.echo(f"{out}: {n_files} file(s), {task}, {labels.num_labels} label(s) ({kind}), seq_len {seq_len}")
    for line in summary:
        click.echo("  " + line)


# ---------------------------------------------------------------------- inspect
@main.command()
@click.argument("directory", type=click.Path())
@click.option("--seq-len", type=int, help="Also count the samples of token shards at this seq_len.")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Check sha256 checksums.")
def inspect(directory, seq_len, verify):
    """Summarize a dataset directory and verify it (exit 2 naming the bad file)."""
    ds = open_dataset(directory, seq_len, verify=verify)
    m = ds.manifest or {}
    if ds.kind == "tokens":
        click.echo(f"{ds.path}: token shards (format {m['format']} v{m['format_version']}, {m['dtype']})")
        click.echo(f"  tokenizer: {ds.tokenizer_id} file {m.get('tokenizer_file')}, vocab_size {ds.vocab_size}, "
                   f"eos_id {ds.eos_id}, largest id {ds.max_token}")
        click.echo(f"  tokens: {ds.num_tokens:,} in {len(m['shards'])} shard(s), "
                   f"{m.get('num_documents', '?')} documents")
        if seq_len:
            click.echo(f"  samples: {ds.num_samples:,} at seq_len {seq_len}")
        what = f"sha256 of {len(m['shards'])} shard(s) verified" if verify else "sizes checked (--no-verify)"
    else:
        layout = "with manifest" if ds.manifest else "ONNX Runtime layout, no manifest"
        click.echo(f"{ds.path}: tensor samples (.pb, {layout}): {ds.num_samples:,} samples in {len(ds.files)} file(s)")
        for name, (shape, dtype) in ds.specs.items():
            click.echo(f"  {name}: {dtype} {list(shape)}")
        what = ("sha256 verified, " if ds.manifest and verify else "") + \
               ("every sample decoded" if verify else "structure checked (--no-verify)")
    click.echo(f"  checks: {what}: OK")


if __name__ == "__main__":       # the tokenizer workers run as  python -m trainrun.data_tools.cli
    main()
