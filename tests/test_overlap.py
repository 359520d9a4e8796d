"""distributed.overlap_grad_reduce: the train graph cut at gradient buckets (trainrun.graphs.segments), the
buckets reduced in a background thread during the backward pass (trainrun.sync.reducer.BucketReducer); real
onnxruntime sessions, real mpirun ranks on pretend nodes."""

import json

import numpy as np
import pytest

from conftest import TRAINRUN, mpirun, read_metrics, run, write_config
from trainrun import config as C
from trainrun.step.engine import Engine, EngineOptions
from trainrun.graphs.gradients import ort_builder_missing
from trainrun.graphs.manifest import prepare
from trainrun.models.bert import sample_inputs

GPT2 = dict(n_layer=3, n_head=4, n_embd=64, n_positions=64, vocab_size=300, dropout=0.1)
BERT = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


def _gradients(out, model, shapes, batches, bucket_bytes, direct, recompute="none", static=True):
    cfg = C.from_dict({"model": model, "data": {"seq_len": 32}, "run": {"output_dir": str(out), "seed": 3},
                       "train": {"micro_batch_size": 4, "recompute": recompute},
                       "engine": {"static_shapes": static}, "optimizer": {"name": "sgd"}})
    eng = Engine(prepare(cfg), EngineOptions(threads=1, seed=3, direct_gradients=direct, bucket_bytes=bucket_bytes),
                 shapes, shapes)
    eng.load_weights()
    seen, losses = [], []

    def between(k):     # the bucket is final when the engine says so: its values are kept to compare
        lo, hi = eng.buckets[k]
        seen.append((k, eng.grads[lo:hi].copy()))
    for a, batch in enumerate(batches):
        losses.append(eng.forward_backward(batch, accumulate=a > 0, position=7 + 4 * a, between=between))
    return eng, losses, eng.grads.copy(), seen


@pytest.mark.parametrize("family,direct,recompute", [("gpt2", True, "none"), ("gpt2", True, "blocks"),
                                                     ("bert", False, "none")],
                         ids=["gpt2-dropout", "gpt2-recompute", "bert-accumulate"])
def test_segments_compute_the_whole_graphs_bits(tmp_path, family, direct, recompute):
    """The train graph cut at buckets of ~8 KB (many segments) against the whole graph in one run: the same
    loss and gradients bit for bit (GPT-2 with dropout masks as inputs, with recomputed blocks; BERT's
    accumulator graph over 2 micro-batches); every bucket reported final holds its final values then, in
    the order the buffer's end comes first, and the buckets tile the buffer."""
    rng = np.random.default_rng(0)
    if family == "gpt2":
        model, shapes = {"gpt2": GPT2}, {"input_ids": ((4, 32), np.int64), "labels": ((4, 32), np.int64)}
        batches = [{k: rng.integers(0, 300, (4, 32)) for k in shapes}]
    else:
        model = {"builtin": "bert", "bert": BERT}
        batches = [sample_inputs(C.from_dict({"model": model, "data": {"seq_len": 32}}).model.bert, 4, 32, 5, rng) for _ in range(2)]
        shapes = {k: (v.shape, v.dtype) for k, v in batches[0].items()}
    whole, ref_losses, ref, none_seen = _gradients(tmp_path / "whole", model, shapes, batches, 0, direct, recompute)
    eng, losses, got, seen = _gradients(tmp_path / "cut", model, shapes, batches, 8192, direct, recompute)
    assert len(whole.buckets) == 1 and not none_seen
    assert len(eng.buckets) >= 6 and len(eng.train_s.sessions) >= 4
    assert losses == ref_losses and np.array_equal(got, ref)
    assert [lo for lo, _ in eng.buckets][::-1][0] == 0 and eng.buckets[0][1] == ref.size
    assert all(a[0] == b[1] for a, b in zip(eng.buckets, eng.buckets[1:]))
    assert [k for k, _ in seen] == [k for _ in batches for k in range(len(eng.buckets) - 1)]
    for k, values in seen[-(len(eng.buckets) - 1):]:
        lo, hi = eng.buckets[k]
        assert np.array_equal(values, ref[lo:hi]), k


def test_a_graph_without_fixed_shapes_is_cut_too(tmp_path):
    """engine.static_shapes false: the tensors between segments have symbolic dims. Three micro-batches
    (each its own step, its own dropout masks) through the same two engines: every loss and gradient equal
    the whole graph's bit for bit, and every bucket reported final holds its final values then."""
    shapes = {"input_ids": ((4, 32), np.int64), "labels": ((4, 32), np.int64)}
    rng = np.random.default_rng(1)
    batches = [{k: rng.integers(0, 300, (4, 32)) for k in shapes} for _ in range(3)]
    whole = _gradients(tmp_path / "whole", {"gpt2": GPT2}, shapes, [], 0, True, static=False)[0]
    cut = _gradients(tmp_path / "cut", {"gpt2": GPT2}, shapes, [], 8192, True, static=False)[0]
    assert len(whole.buckets) == 1 and len(cut.buckets) >= 6
    losses = []

    def between(k):
        lo, hi = cut.buckets[k]
        seen.append((k, cut.grads[lo:hi].copy()))
    for a, batch in enumerate(batches):
        seen = []
        loss = cut.forward_backward(batch, accumulate=False, position=7 + 4 * a, between=between)
        losses.append(whole.forward_backward(batch, accumulate=False, position=7 + 4 * a))
        assert loss == losses[-1] and np.array_equal(cut.grads, whole.grads), a
        assert [k for k, _ in seen] == list(range(len(cut.buckets) - 1))
        for k, values in seen:
            lo, hi = cut.buckets[k]
            assert np.array_equal(values, whole.grads[lo:hi]), (a, k)
    assert len(set(losses)) == 3        # three different steps compared, not one thrice


@pytest.mark.parametrize("builder", ["trainrun", "onnxruntime"])
def test_a_torch_exported_cnn_is_cut_too(tmp_path, builder):
    """A residual CNN as torch's exporter writes it in training mode (BatchNorm, MaxPool, a batch dim of its
    own name), each builder's train graph cut at ~2 KB buckets: onnxruntime reports the gradients flowing
    down between segments with no shape (``[]``), and onnxruntime-training's MaxPoolGrad reads its output's
    declared shape; the segments load (they once failed, or crashed the process) and give the whole graph's
    loss and gradients bit for bit."""
    torch = pytest.importorskip("torch")
    if builder == "onnxruntime" and ort_builder_missing():
        pytest.skip(ort_builder_missing())
    nn = torch.nn
    torch.manual_seed(0)

    def conv_bn(cin, cout, act=True):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
                             *([nn.ReLU()] if act else []))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = conv_bn(8, 8), conv_bn(8, 8, act=False)

        def forward(self, x):
            return torch.relu(self.b(self.a(x)) + x)

    net = nn.Sequential(conv_bn(3, 8), nn.MaxPool2d(3, 2, 1), Block(), Block(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 5)).train()
    torch.onnx.export(net, (torch.zeros(2, 3, 16, 16),), str(tmp_path / "cnn.onnx"), input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "b"}, "logits": {0: "b"}}, opset_version=17,
                      dynamo=False, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    shapes = {"x": ((4, 3, 16, 16), np.float32), "labels": ((4,), np.int64)}
    rng = np.random.default_rng(2)
    batch = {"x": rng.normal(0, 1, (4, 3, 16, 16)).astype(np.float32), "labels": rng.integers(0, 5, 4)}
    got = []
    for name, bucket_bytes in (("whole", 0), ("cut", 2048)):
        cfg = C.from_dict({"model": {"builtin": None, "onnx": str(tmp_path / "cnn.onnx"),
                                     "loss": {"type": "cross_entropy", "logits": "logits"}},
                           "graphs": {"builder": builder}, "run": {"output_dir": str(tmp_path / name), "seed": 3},
                           "train": {"micro_batch_size": 4}, "optimizer": {"name": "sgd"}})
        eng = Engine(prepare(cfg), EngineOptions(threads=1, seed=3, direct_gradients=True,
                                                 bucket_bytes=bucket_bytes), shapes, shapes)
        eng.load_weights()
        loss = eng.forward_backward(batch, accumulate=False, position=0)
        got.append((loss, eng.grads.copy(), len(eng.buckets), len(eng.train_s.sessions)))
    (loss, ref, n_whole, _), (cut_loss, grads, n_cut, n_sessions) = got
    assert n_whole == 1 and n_cut >= 4 and n_sessions >= 3
    assert cut_loss == loss and np.array_equal(grads, ref)


def probe_engines(script: str, tmp_path, gpt2: dict, seq_len: int, micro_batch: int, bucket_sizes) -> dict:
    """``script`` run in a fresh process per bucket size (argv: the train graph's directory, the bucket bytes)
    on a GPT-2 of shape ``gpt2`` prepared once: its output's fields, by bucket size."""
    import subprocess
    import sys
    config = {"model": {"gpt2": gpt2}, "data": {"seq_len": seq_len}, "run": {"output_dir": str(tmp_path)},
              "train": {"micro_batch_size": micro_batch}, "optimizer": {"name": "sgd"}}
    graphs = prepare(C.from_dict(config))
    out = {}
    for bucket_bytes in bucket_sizes:
        proc = subprocess.run([sys.executable, "-c", script, graphs, str(bucket_bytes)], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out[bucket_bytes] = proc.stdout.split()
    return out


PEAK = """
import sys, numpy as np
from trainrun.step.engine import Engine, EngineOptions
def kib(key):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key)))
shapes = {"input_ids": ((8, 128), np.int64), "labels": ((8, 128), np.int64)}
eng = Engine(sys.argv[1], EngineOptions(threads=1, bucket_bytes=int(sys.argv[2]), direct_gradients=True), shapes, shapes)
opened = kib("VmRSS:")
batch = {k: np.random.default_rng(0).integers(0, 2048, (8, 128)) for k in shapes}
for _ in range(3):
    eng.forward_backward(batch, accumulate=False)
print(len(eng.buckets), kib("VmHWM:") - opened)
"""


def test_the_cut_graph_takes_the_memory_of_the_whole_one(tmp_path):
    """The peak memory a process adds running the train graph (VmHWM after 3 runs less the resident size
    once the sessions are open), cut into 18 segments against whole: the tensors handed between segments
    live until their last reader has run, in one arena the segments share, so the cut graph takes at most
    a quarter more (its segments each keeping an arena of their own and every handed tensor kept for
    good took 3.7 times as much)."""
    out = probe_engines(PEAK, tmp_path, dict(n_layer=4, n_head=4, n_embd=128, n_positions=128, vocab_size=2048),
                        128, 8, (0, 65536))
    grown = {b: int(fields[1]) for b, fields in out.items()}
    assert int(out[65536][0]) >= 12
    assert grown[65536] <= 1.25 * grown[0], grown


IDLE = """
import resource, statistics, sys, time, numpy as np
from trainrun.step.engine import Engine, EngineOptions
shapes = {"input_ids": ((4, 32), np.int64), "labels": ((4, 32), np.int64)}
eng = Engine(sys.argv[1], EngineOptions(threads=2, bucket_bytes=int(sys.argv[2]), direct_gradients=True), shapes, shapes)
batch = {k: np.random.default_rng(0).integers(0, 300, (4, 32)) for k in shapes}
spent = []
for _ in range(3):
    eng.forward_backward(batch, accumulate=False, position=0)
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.2)
    after = resource.getrusage(resource.RUSAGE_SELF)
    spent.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
print(len(eng.buckets), statistics.median(spent))
"""


def test_the_segments_thread_pools_stop_spinning_after_their_run(tmp_path):
    """At 2 intra-op threads every segment has a pool of its own: once a segment has run, its pool stops
    spinning (session.force_spinning_stop) rather than take the cores the next segment computes on. The
    CPU time the process spends in the 200 ms after a run of the cut graph is at most what it spends after
    the whole graph's (whose one pool spins on for a while; the segments' pools spinning on took 4-5 times
    that)."""
    out = probe_engines(IDLE, tmp_path, GPT2, 32, 4, (0, 8192))
    idle = {b: float(fields[1]) for b, fields in out.items()}
    assert int(out[8192][0]) >= 6
    assert idle[8192] <= idle[0] + 0.005, idle


BUCKETS_ON_THEIR_OWN = """
import threading
from trainrun.sync.reducer import BucketReducer

def main(comm):
    grads = np.full(1000, comm.rank + 1.0, np.float32)
    buckets = [(700, 1000), (300, 700), (0, 300)]      # from the buffer's end, as the backward pass makes them
    red = BucketReducer(comm, grads, buckets)
    assert red.buckets == buckets
    if comm.rank == 1:      # bucket 0's allreduce in flight in the background before the main thread's sum
        red.bucket_ready(0)
        time.sleep(0.5)
    total = comm.allreduce_scalars([10.0 * (comm.rank + 1)])[0]
    if comm.rank == 0:      # the other order here
        red.bucket_ready(0)
    red.bucket_ready(1)
    red.reduce()            # waits for buckets 0 and 1, reduces the rest (bucket 2) in this thread
    first = sorted(set(grads.tolist()))
    grads[:] = comm.rank + 1.0
    red.reduce()            # a step that started no bucket: the whole buffer in this thread
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("trainrun-reduce"))
    red.close()
    report(comm.rank, {"total": total, "grads": first, "whole": sorted(set(grads.tolist())),
                       "threads": threads, "after_close": any(t.name.startswith("trainrun-reduce")
                                                               for t in threading.enumerate())})

run(main, make_communicator("mpi", timeout_s=20))
"""


@pytest.mark.process
def test_buckets_reduce_on_a_communicator_of_their_own(tmp_path):
    """The overlap's one component (trainrun.sync.reducer.BucketReducer) on a plain flat buffer: a bucket's
    allreduce in its background thread and a collective of the main thread (the step's scalars) started in
    opposite orders on the two ranks: each matches its own peer, because the buckets run on a duplicate of
    the communicator; reduce() waits for the started buckets and reduces the rest; a step that starts none
    reduces the whole buffer; one background thread, gone after close()."""
    from test_comm import results, run_ranks
    rc, out, _ = run_ranks(tmp_path, 2, BUCKETS_ON_THEIR_OWN, timeout=120)
    assert rc == 0, out
    assert results(tmp_path) == [{"total": 30.0, "grads": [3.0], "whole": [3.0],
                                  "threads": ["trainrun-reduce_0"], "after_close": False}] * 2


def _train(tmp_path, data, name, ranks, **extra):
    cfg = write_config(tmp_path / f"{name}.yaml", data, **{
        "run.output_dir": str(tmp_path / name), "train.max_steps": 12, "checkpoint.every": 12,
        "model.gpt2": {"n_layer": 3, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 512},
        **extra})
    mpirun(ranks, "--config", cfg, env={"TRAINRUN_RANKS_PER_NODE": "1"})
    with open(tmp_path / name / "summary.json") as fh:
        summary = json.load(fh)
    from safetensors.numpy import load_file
    weights = load_file(str(tmp_path / name / "checkpoints" / "12" / "model.safetensors"))
    return read_metrics(str(tmp_path / name))[0], summary, weights


@pytest.mark.graphs
@pytest.mark.parametrize("dtype,accum,builder", [("fp32", 1, "auto"), ("bf16", 2, "auto"), ("fp32", 2, "trainrun")])
def test_overlapped_buckets_train_bit_for_bit_as_one_allreduce(tmp_path, byte_dataset, dtype, accum, builder):
    """2 pretend nodes of one rank: the same losses, norms and final weights, bit for bit, with the gradients
    reduced in buckets during the backward pass (0.004 MiB: a bucket every tensor or two) as with one allreduce
    after it; fp32 (a + b) and bf16 (rank-order sums of rounded values) both reduce elementwise; trainrun's
    gradient builder (its later micro-batches added by the engine before a bucket is handed on) too."""
    extra = {"distributed.reduce_dtype": dtype, "train.gradient_accumulation_steps": accum,
             "graphs.builder": builder}
    ref, ref_sum, ref_w = _train(tmp_path, byte_dataset, "one", 2, **extra)
    got, got_sum, got_w = _train(tmp_path, byte_dataset, "buckets", 2, **extra, **{
        "distributed.overlap_grad_reduce": True, "distributed.bucket_mb": 0.004})
    assert ref_sum["grad_buckets"] == 0 and got_sum["grad_buckets"] >= 8
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    for s in ref:
        assert (got[s]["loss"], got[s]["grad_norm"]) == (ref[s]["loss"], ref[s]["grad_norm"]), s
    assert ref[12]["loss"] < ref[1]["loss"]
    assert sorted(got_w) == sorted(ref_w)
    for name in ref_w:
        assert np.array_equal(got_w[name], ref_w[name]), name
    assert got_sum["wire_bytes_per_step"] == ref_sum["wire_bytes_per_step"]


@pytest.mark.ort_training
def test_statistics_steps_and_overlapped_steps_interleave(tmp_path, byte_dataset):
    """debug.stats_every 2 with debug.tensors (outputs onnxruntime allocates, read from the segment that makes
    them): the statistics steps reduce after the backward pass (they read the local gradients first), the
    others in buckets during it; statistics, losses and weights equal a run without overlap."""
    stats = {"debug.stats_every": 2, "debug.tensors": ["logits", "LayerNormalization_*_out0"],
             "run.deterministic": True}
    ref, _, ref_w = _train(tmp_path, byte_dataset, "plain", 2, **stats)
    got, got_sum, got_w = _train(tmp_path, byte_dataset, "overlap", 2, **stats, **{
        "distributed.overlap_grad_reduce": True, "distributed.bucket_mb": 0.004,
        "profile.start_step": 3, "profile.steps": 2})
    assert got_sum["grad_buckets"] >= 8
    # the profiled steps ran on sessions opened again with the profiler, every segment's ops in the trace
    trace = json.loads((tmp_path / "overlap" / "profile" / "rank-0.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    train_ops = [e for e in events if e.get("args", {}).get("session") == "train" and e.get("cat") == "Node"]
    # the forward (first segment), a layer's backward (LayerNorm's gradient: onnxruntime-training's op, or
    # trainrun's builder's ReduceMeans), the embeddings' scatter (last segment)
    backward = "LayerNormalizationGrad" if ort_builder_missing() is None else "ReduceMean"
    assert {"Softmax", backward, "ScatterElements"} <= {e["args"].get("op_name") for e in train_ops}
    assert [(got[s]["loss"], got[s]["grad_norm"]) for s in sorted(got)] == \
        [(ref[s]["loss"], ref[s]["grad_norm"]) for s in sorted(ref)]
    assert all(np.array_equal(got_w[k], ref_w[k]) for k in ref_w)
    for r in (0, 1):
        a = (tmp_path / "plain" / "stats" / f"rank-{r}" / "stats.jsonl").read_text()
        b = (tmp_path / "overlap" / "stats" / f"rank-{r}" / "stats.jsonl").read_text()
        assert a == b and len(a.splitlines()) == 6, r


def test_a_run_resumes_with_overlap_switched_on(tmp_path, byte_dataset):
    """`resume --set distributed.overlap_grad_reduce=true` (the same sums, so a key resume may change without
    --force): steps 7-12 on 2 pretend nodes with buckets give the losses of the run without them."""
    ref, _, _ = _train(tmp_path, byte_dataset, "plain", 2, **{"checkpoint.every": 6})
    cfg = write_config(tmp_path / "half.yaml", byte_dataset, **{
        "run.output_dir": str(tmp_path / "half"), "train.max_steps": 12, "checkpoint.every": 6,
        "train.stop_at": 6,
        "model.gpt2": {"n_layer": 3, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 512}})
    env = {"TRAINRUN_RANKS_PER_NODE": "1"}
    mpirun(2, "--config", cfg, env=env)
    mpirun(2, "resume", str(tmp_path / "half"), "--set", "distributed.overlap_grad_reduce=true",
           "--set", "distributed.bucket_mb=0.004", env=env)
    got = read_metrics(str(tmp_path / "half"))[0]
    assert json.load(open(tmp_path / "half" / "summary.json"))["grad_buckets"] >= 8
    assert [(got[s]["loss"], got[s]["grad_norm"]) for s in range(1, 13)] == \
        [(ref[s]["loss"], ref[s]["grad_norm"]) for s in range(1, 13)]
