"""Dataset formats and the per-rank loader (trainrun.data) on real files."""

import json
import os
import struct
import tracemalloc

import numpy as np
import pytest
from onnx import numpy_helper

from trainrun.data import TrainLoader, eval_batches, open_dataset
from trainrun.data_tools.writers import TensorShardWriter, TokenShardWriter
from trainrun.errors import UsageError

from conftest import TRAINRUN_DATA, run


def make_tokens(path, tokens, vocab=1000, shard_tokens=7):
    writer = TokenShardWriter(path, vocab, shard_tokens)
    writer.add(tokens)
    writer.close(eos_id=0, tokenizer_id="test")
    return path


def sample_ids(batch, seq_len):
    """Sample index of each row, for a dataset whose tokens are 0, 1, 2, ..."""
    return (batch["input_ids"][:, 0] // seq_len).tolist()


@pytest.fixture
def counting(tmp_path):
    """Tokens 0..200 (seq_len 4 -> 50 samples) over shards of 7 tokens, so windows cross shards."""
    return open_dataset(make_tokens(tmp_path / "d", np.arange(201)), 4)


def global_stream(ds, steps, mb, accum, world, **kw):
    """Sample ids of each step's global batch, gathered over all ranks (rank order)."""
    loaders = [TrainLoader(ds, mb, accum, rank=r, world_size=world, seed=3, **kw) for r in range(world)]
    out = []
    for _ in range(steps):
        out.append([i for ld in loaders for b in ld.next_step() for i in sample_ids(b, ds.seq_len)])
    for ld in loaders:
        ld.close()
    return out


# ---------------------------------------------------------------------- formats
def test_token_round_trip_across_shards(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, 103)
    ds = open_dataset(make_tokens(tmp_path / "d", tokens), 5, vocab_size=1000)
    assert ds.num_samples == 20 and ds.feature_names == ["input_ids", "labels"]
    assert len(ds.files) == 15 and np.array_equal(np.fromfile(ds.files[0], "<u2"), tokens[:7])
    batch = ds.read(np.arange(20), ds.new_batch(20))
    for i in range(20):
        assert batch["input_ids"][i].tolist() == tokens[5 * i:5 * i + 5].tolist()
        assert batch["labels"][i].tolist() == tokens[5 * i + 1:5 * i + 6].tolist()
    assert batch["input_ids"].dtype == np.int64


def test_large_vocab_uses_uint32(tmp_path):
    tokens = np.array([0, 65535, 65536, 69999, 5, 7, 11])
    ds = open_dataset(make_tokens(tmp_path / "d", tokens, vocab=70000), 3)
    assert ds.manifest["dtype"] == "uint32"
    b = ds.read(np.arange(2), ds.new_batch(2))
    assert b["input_ids"].tolist() == [[0, 65535, 65536], [69999, 5, 7]]


def test_tensor_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(10, 3, 2)).astype(np.float32), rng.integers(0, 9, 10)
    writer = TensorShardWriter(tmp_path / "t", samples_per_file=4)
    for i in range(10):
        writer.add({"x": x[i], "y": y[i]})
    writer.close()
    ds = open_dataset(tmp_path / "t", None)
    assert ds.num_samples == 10 and len(ds.files) == 3 and ds.feature_names == ["x", "y"]
    b = ds.read(np.arange(10), ds.new_batch(10))
    assert np.array_equal(b["x"], x) and np.array_equal(b["y"], y)


def ort_sample(tensors):
    """A sample in ONNX Runtime's layout, built here from the format description."""
    blobs = [numpy_helper.from_array(a, n).SerializeToString() for n, a in tensors]
    body = b"".join(struct.pack("<I", len(b)) + b for b in blobs)
    return struct.pack("<I", len(body)) + body


def test_reads_onnxruntime_layout(tmp_path):
    d = tmp_path / "pb"
    d.mkdir()
    ids = np.arange(24, dtype=np.int64).reshape(4, 6)
    # samples 2, 3 in b.pb, 0, 1 in a.pb (files are read sorted); feature order varies per sample
    (d / "b.pb").write_bytes(ort_sample([("input_ids", ids[2]), ("labels", ids[2] + 1)]) +
                             ort_sample([("labels", ids[3] + 1), ("input_ids", ids[3])]))
    (d / "a.pb").write_bytes(ort_sample([("input_ids", ids[0]), ("labels", ids[0] + 1)]) +
                             ort_sample([("input_ids", ids[1]), ("labels", ids[1] + 1)]))
    (d / ".partial.pb").write_bytes(b"\x01")     # dot-files and other files are not data
    (d / "notes.txt").write_text("x")
    ds = open_dataset(d, 6, vocab_size=100, n_positions=6)
    assert ds.num_samples == 4 and [f.name for f in ds.files] == ["a.pb", "b.pb"]
    with TrainLoader(ds, 2, 1, shuffle=False, prefetch=0) as loader:
        first, second = loader.next_step()[0], loader.next_step()[0]
    assert first["input_ids"].tolist() == ids[:2].tolist() and second["labels"].tolist() == (ids[2:] + 1).tolist()


# ---------------------------------------------------------------------- order and ranks
def test_rank_slices_same_stream_for_1_2_3_ranks(counting):
    """Global batch 12 as 1x12, 1x6x2, 2x6, 2x3x2, 3x4, 3x2x2 (ranks x micro x accum): one stream."""
    configs = [(12, 1, 1), (6, 2, 1), (6, 1, 2), (3, 2, 2), (4, 1, 3), (2, 2, 3)]
    streams = [global_stream(counting, 9, mb, k, w) for mb, k, w in configs]
    for s in streams[1:]:
        assert s == streams[0]
    flat = [i for step in streams[0] for i in step]          # 108 positions: epochs 0, 1 and part of 2
    assert sorted(flat[:50]) == list(range(50)) and sorted(flat[50:100]) == list(range(50))
    assert flat[:50] != list(range(50)) and flat[:50] != flat[50:100]     # shuffled, reshuffled per epoch
    assert flat[48:60] == streams[0][4]                                   # step 4 crosses the epoch end


def test_rank_slices_are_disjoint_contiguous_chunks(counting):
    whole = global_stream(counting, 5, 12, 1, 1)
    for world in (2, 3):
        mb = 12 // world
        for r in range(world):
            with TrainLoader(counting, mb, 1, rank=r, world_size=world, seed=3) as ld:
                for step in range(5):
                    assert sample_ids(ld.next_step()[0], 4) == whole[step][r * mb:(r + 1) * mb]


def test_seed_and_no_shuffle(counting):
    assert global_stream(counting, 2, 10, 1, 1, shuffle=False) == [list(range(10)), list(range(10, 20))]
    with TrainLoader(counting, 10, seed=4) as other:
        assert sample_ids(other.next_step()[0], 4) != global_stream(counting, 1, 10, 1, 1)[0]


def test_resume_restores_next_batch_on_any_rank_count(counting):
    expected = global_stream(counting, 8, 6, 1, 2)
    with TrainLoader(counting, 6, 1, rank=1, world_size=2, seed=3) as ld:
        for _ in range(5):
            ld.next_step()
        state = json.loads(json.dumps(ld.state_dict()))
    assert state["position"] == 60 and state["epoch"] == 1
    for mb, k, world in ((6, 1, 2), (4, 1, 3), (12, 1, 1), (2, 2, 3)):
        loaders = [TrainLoader(counting, mb, k, rank=r, world_size=world, seed=99) for r in range(world)]
        for ld in loaders:
            ld.next_step()                       # already running: restoring rewinds it
            ld.load_state_dict(state)
        for step in (5, 6, 7):
            got = [i for ld in loaders for b in ld.next_step() for i in sample_ids(b, 4)]
            assert got == expected[step], (mb, k, world, step)
        for ld in loaders:
            ld.close()


def test_prefetch_yields_the_synchronous_batches(counting):
    def take(prefetch):
        with TrainLoader(counting, 3, 2, rank=1, world_size=2, seed=7, prefetch=prefetch) as ld:
            return [{k: v.copy() for k, v in b.items()} for _ in range(30) for b in ld.next_step()]
    sync, ahead = take(0), take(3)
    assert len(sync) == 60
    for a, b in zip(sync, ahead):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_no_memory_growth_per_batch(tmp_path):
    ds = open_dataset(make_tokens(tmp_path / "d", np.arange(20000) % 1000, shard_tokens=3000), 128)
    with TrainLoader(ds, 8, 2, seed=1, prefetch=2) as ld:
        for _ in range(100):
            ld.next_step()
        tracemalloc.start()
        try:
            for _ in range(100):
                ld.next_step()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(2000):
                ld.next_step()
            growth = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert growth < 64 * 1024, growth


def mapped_kb(directory) -> int:
    """Resident kB of this process's mappings of files under ``directory`` (/proc/self/smaps): the
    shard pages themselves, whatever the filesystem (page cache on disk file systems, shmem on tmpfs,
    which /proc's RssFile alone does not count) and whatever else the process maps meanwhile."""
    total, ours = 0, False
    prefix = os.path.realpath(directory) + os.sep
    with open("/proc/self/smaps") as fh:
        for line in fh:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):      # a mapping's header line
                parts = line.split(maxsplit=5)
                ours = len(parts) == 6 and parts[5].strip().startswith(prefix)
            elif ours and first == "Rss:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux /proc/self/smaps")
@pytest.mark.parametrize("release", [True, False])
def test_resident_shard_pages_stay_bounded(tmp_path, release):
    """Reading 8 MB of shards: with page release on, the mapped pages in RSS stay far below that;
    without it, they are all resident (so the measurement does see them on this filesystem)."""
    ds = open_dataset(make_tokens(tmp_path / "d", np.arange(1 << 22) % 1000, shard_tokens=1 << 20), 512)
    ds.release_every_pages = 256 if release else 1 << 30          # 1 MiB, or never
    with TrainLoader(ds, 16, shuffle=False, prefetch=0) as loader:
        before = mapped_kb(tmp_path / "d")
        for _ in range(ds.num_samples // 16):
            loader.next_step()
        growth = mapped_kb(tmp_path / "d") - before
    assert (growth < 3000) if release else (growth > 6000), growth


def test_eval_batches_deterministic_disjoint_slices(counting):
    for world, mb in ((1, 6), (2, 3), (3, 2)):
        per_rank = [[sample_ids(b, 4) for b in eval_batches(counting, mb, r, world, steps=3)] for r in range(world)]
        steps = [[i for r in range(world) for i in per_rank[r][s]] for s in range(3)]
        assert steps == [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]
    assert len(list(eval_batches(counting, 8, 0, 2, steps=100))) == 3        # 50 // 16 whole steps
    a = [b["labels"].copy() for b in eval_batches(counting, 4, 1, 2)]
    assert all(np.array_equal(x, y["labels"]) for x, y in zip(a, eval_batches(counting, 4, 1, 2)))


# ---------------------------------------------------------------------- bad input
def raises(match, fn, *args, **kw):
    with pytest.raises(UsageError, match=match) as info:
        fn(*args, **kw)
    return str(info.value)


@pytest.fixture
def tokdir(tmp_path):
    return make_tokens(tmp_path / "tok", np.arange(100) % 50, vocab=1000, shard_tokens=40)


def edit_manifest(directory, **changes):
    path = directory / "manifest.json"
    m = json.loads(path.read_text())
    m.update(changes)
    for k, v in changes.items():
        if v is None:
            del m[k]
    path.write_text(json.dumps(m))


def test_missing_directory_or_file_or_no_data(tmp_path):
    raises("does not exist", open_dataset, tmp_path / "nope", 8)
    (tmp_path / "f.bin").write_bytes(b"")
    raises("is a file", open_dataset, tmp_path / "f.bin", 8)
    (tmp_path / "empty").mkdir()
    raises("neither manifest.json nor", open_dataset, tmp_path / "empty", 8)


def test_missing_and_truncated_shard(tokdir):
    shard = tokdir / "shard-00001.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    for verify in (True, False):
        raises(r"shard-00001.bin: truncated: 78 bytes, manifest.json says 80", open_dataset, tokdir, 8, verify=verify)
    shard.unlink()
    raises("shard-00001.bin: listed in manifest.json but missing", open_dataset, tokdir, 8)


def test_checksum_mismatch(tokdir):
    shard = tokdir / "shard-00002.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    raises("shard-00002.bin: sha256 checksum mismatch", open_dataset, tokdir, 8)
    assert open_dataset(tokdir, 8, verify=False).num_samples == 12


def test_manifest_problems(tokdir):
    edit_manifest(tokdir, format_version=2)
    raises("format_version 2 is not supported", open_dataset, tokdir, 8)
    edit_manifest(tokdir, format_version=1, dtype=None)
    raises("missing key 'dtype'", open_dataset, tokdir, 8)
    edit_manifest(tokdir, dtype="float32")
    raises("dtype 'float32'", open_dataset, tokdir, 8)
    edit_manifest(tokdir, format="parquet")
    raises("'format' is 'parquet'", open_dataset, tokdir, 8)
    (tokdir / "manifest.json").write_text("{not json")
    raises("manifest.json: not a readable JSON manifest", open_dataset, tokdir, 8)


def test_manifest_files_outside_the_dataset_directory_are_refused(tokdir, tmp_path):
    """A listed file with the right size and sha256 that is not the directory's own -- ../x, an absolute
    path, a link out -- is refused by name, not read as the dataset's."""
    pb = tmp_path / "pb"
    writer = TensorShardWriter(pb, samples_per_file=2)
    for i in range(4):
        writer.add({"x": np.full(3, i, np.float32)})
    writer.close()
    for d, key in ((tokdir, "shards"), (pb, "files")):
        m = json.loads((d / "manifest.json").read_text())
        name = m[key][1]["file"]
        os.replace(d / name, tmp_path / name)
        for listed in (f"../{name}", str(tmp_path / name)):
            m[key][1]["file"] = listed
            (d / "manifest.json").write_text(json.dumps(m))
            p = run([TRAINRUN_DATA, "inspect", str(d)], check=2)
            assert f"manifest.json: {key}[1]: file '{listed}' lies outside the dataset directory {d}" in p.stderr
        os.symlink(tmp_path / name, d / name)
        m[key][1]["file"] = name
        (d / "manifest.json").write_text(json.dumps(m))
        raises(rf"{key}\[1\]: file '{name}' lies outside the dataset directory .*\({tmp_path / name}\)",
               open_dataset, d, 8 if d == tokdir else None)


def test_tokens_beyond_vocab(tokdir):
    raises("token ids go up to 49 .* not below the model's vocab_size 40", open_dataset, tokdir, 8, vocab_size=40)
    assert open_dataset(tokdir, 8, vocab_size=50).num_samples == 12


def test_corrupt_token_found_while_reading(tmp_path):
    """With verify=False the checksum is not read; a bad id still stops the loader, naming the shard."""
    d = make_tokens(tmp_path / "d", np.arange(100) % 50, shard_tokens=40)
    shard = d / "shard-00001.bin"
    data = np.fromfile(shard, "<u2")
    data[5] = 60000
    data.tofile(shard)
    ds = open_dataset(d, 8, vocab_size=1000, verify=False)
    with TrainLoader(ds, 12, shuffle=False, prefetch=2) as loader:
        raises(r"shard-00001.bin: token id 60000 at token 5 is not below the model's vocab_size 1000",
               loader.next_step)


def test_sequence_and_batch_limits(tokdir):
    raises("seq_len 64 is longer than the model's positions .n_positions 32", open_dataset, tokdir, 64, n_positions=32)
    raises("100 tokens are too few for one sample of seq_len 100", open_dataset, tokdir, 100)
    ds = open_dataset(tokdir, 8)
    raises(r"12 samples .* fewer than one global batch of 16 \(micro_batch 4 x accum 2 x world_size 2\)",
           TrainLoader, ds, 4, 2, rank=0, world_size=2)
    raises("fewer than one eval batch of 16", eval_batches, ds, 8, 0, 2)
    raises("rank 2 is not below world_size 2", TrainLoader, ds, 2, rank=2, world_size=2)
    loader = TrainLoader(ds, 4)
    raises("'num_samples' is 99", loader.load_state_dict, dict(loader.state_dict(), num_samples=99))
    raises("missing key 'position'", loader.load_state_dict, {"seed": 0})


def test_bad_pb_files(tmp_path):
    d = tmp_path / "pb"
    d.mkdir()
    good = ort_sample([("input_ids", np.arange(6)), ("labels", np.arange(6))])
    (d / "a.pb").write_bytes(good + good[:-3])
    raises(r"a.pb: truncated: sample 1 at byte \d+ declares", open_dataset, d, 6, verify=False)
    (d / "a.pb").write_bytes(good + ort_sample([("input_ids", np.arange(5)), ("labels", np.arange(6))]))
    raises(r"a.pb: sample 1: tensor 'input_ids' is int64 \[5\], the first sample's is int64 \[6\]", open_dataset, d, 6)
    labels = numpy_helper.from_array(np.arange(6), "labels").SerializeToString()
    body = struct.pack("<I", 4) + b"\xff" * 4 + struct.pack("<I", len(labels)) + labels
    (d / "a.pb").write_bytes(good + struct.pack("<I", len(body)) + body)
    raises("a.pb: sample 1: not a valid TensorProto", open_dataset, d, 6)
    (d / "a.pb").write_bytes(good)
    raises("input_ids of length 6, but seq_len is 8", open_dataset, d, 8)
    raises("input_ids hold 5/0, outside the model's vocab_size 5", open_dataset, d, 6, vocab_size=5)


@pytest.mark.parametrize("world,accum", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_sample_position_is_the_global_position_of_the_micro_batch(counting, world, accum):
    """Unshuffled, the sample at global position x is sample x mod n: sample_position(a) names the first
    sample of micro-batch a on every rank, and a step's micro-batches tile k*G .. k*G+G-1 (keys of dropout)."""
    mb = 3
    loaders = [TrainLoader(counting, mb, accum, rank=r, world_size=world, shuffle=False, prefetch=1)
               for r in range(world)]
    G = mb * accum * world
    for k in range(12):                        # 12 steps cross epochs (50 samples)
        starts = []
        for ld in loaders:
            for a, batch in enumerate(ld.next_step()):
                starts.append(ld.sample_position(a))
                assert sample_ids(batch, 4)[0] == starts[-1] % counting.num_samples
        assert sorted(starts) == list(range(k * G, k * G + G, mb))
    for ld in loaders:
        ld.close()
