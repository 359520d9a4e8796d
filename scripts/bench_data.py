"""Data pipeline benchmark: tokenizing throughput, the stdlib dataset build, loader batches/s.

    .venv/bin/python scripts/bench_data.py [--steps 20000] [--json OUT.json]

Targets: BPE tokenizing >= 5 MB/s of text per core; the
loader >= ~1500 batches/s of 8 x 128 tokens (100x what a gpt2-tiny step takes).
Prints one line per figure and, with --json, writes them all.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def tokenize_rate(threads: int, vocab: int) -> dict:
    """MB/s of stdlib text through TokenizerEncoder and through the plain library, in a fresh process
    (the tokenizers thread pool reads RAYON_NUM_THREADS once)."""
    code = f"""
import json, time, sysconfig
from trainrun.data_tools.corpus import find_files, read_text
from trainrun.data_tools.encode import TokenizerEncoder, train_bpe
texts = [read_text(p) for p in find_files([sysconfig.get_paths()["stdlib"]])]
mb = sum(len(t.encode()) for t in texts) / 1e6
tok = train_bpe(texts[::10], {vocab}, progress=False)
enc = TokenizerEncoder(tok)
t, c = time.perf_counter(), time.process_time()
for i in range(0, len(texts), 500):
    enc.encode(texts[i:i + 500])
ours, ours_cpu = mb / (time.perf_counter() - t), mb / (time.process_time() - c)
t, c = time.perf_counter(), time.process_time()
tok.encode_batch_fast(texts, add_special_tokens=False)
lib, lib_cpu = mb / (time.perf_counter() - t), mb / (time.process_time() - c)
print(json.dumps({{"mb": mb, "ours": ours, "ours_per_cpu_s": ours_cpu, "library": lib, "library_per_cpu_s": lib_cpu}}))
"""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_stdlib(out: Path, vocab: int) -> dict:
    stdlib = sysconfig.get_paths()["stdlib"]
    t, c = time.perf_counter(), _children_cpu()
    proc = subprocess.run([str(BIN / "trainrun-data"), "tokens", "--input", stdlib, "--output", str(out),
                           "--train-bpe", str(vocab), "--no-progress"], check=True, capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - t, _children_cpu() - c
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"seconds": seconds, "cpu_seconds": cpu, "bytes": size, "report": proc.stdout.strip()}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def loader_rate(path: Path, steps: int, prefetch: int, seq_len: int = 128, mb: int = 8) -> dict:
    from trainrun.data import TrainLoader, open_dataset
    ds = open_dataset(path, seq_len)
    with TrainLoader(ds, mb, 1, seed=0, prefetch=prefetch) as loader:
        for _ in range(200):
            loader.next_step()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        for _ in range(steps):
            loader.next_step()
        rate = steps / (time.perf_counter() - t)
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"batches_per_s": rate, "max_rss_growth_kb": rss1 - rss0}


def pb_copy(src: Path, dst: Path, seq_len: int = 128, n: int = 4000) -> Path:
    """The first n samples of a token dataset as .pb tensor samples (ONNX Runtime layout)."""
    import numpy as np
    from trainrun.data import open_dataset
    from trainrun.data_tools.writers import TensorShardWriter
    ds = open_dataset(src, seq_len)
    batch = ds.read(np.arange(n), ds.new_batch(n))
    writer = TensorShardWriter(dst, 1000)
    for i in range(n):
        writer.add({k: v[i] for k, v in batch.items()})
    writer.close()
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocab for the tokenizing figures")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    results = {"cores": cores}

    for threads in sorted({1, cores}):
        r = tokenize_rate(threads, args.vocab)
        results[f"tokenize_{threads}_threads"] = r
        print(f"tokenize BPE-{args.vocab}, {threads} library thread(s): {r['ours']:.1f} MB/s, "
              f"{r['ours_per_cpu_s']:.1f} MB per CPU-second (tokenizers encode_batch alone: {r['library']:.1f} MB/s, "
              f"{r['library_per_cpu_s']:.1f} MB per CPU-second) on {r['mb']:.1f} MB")

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "stdlib"
        b = build_stdlib(data, 1024)
        results["stdlib_build"] = b
        print(f"trainrun-data tokens on the stdlib (BPE 1024, {cores} cores): {b['seconds']:.1f} s "
              f"({b['cpu_seconds']:.1f} CPU-s), dataset {b['bytes'] / 1e6:.1f} MB\n    " +
              b["report"].replace("\n", "\n    "))
        for prefetch in (0, 2):
            r = loader_rate(data / "train", args.steps, prefetch)
            results[f"loader_tokens_prefetch{prefetch}"] = r
            print(f"loader, token shards, 8 x 128, prefetch {prefetch}: {r['batches_per_s']:.0f} batches/s "
                  f"(max RSS growth over {args.steps} steps: {r['max_rss_growth_kb']} kB)")
        pb = pb_copy(data / "train", Path(tmp) / "pb")
        r = loader_rate(pb, min(args.steps, 5000), 2)
        results["loader_pb_prefetch2"] = r
        print(f"loader, .pb tensor samples, 8 x 128, prefetch 2: {r['batches_per_s']:.0f} batches/s")

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
