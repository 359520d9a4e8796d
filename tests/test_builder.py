"""graphs.builder: trainrun's own gradient builder wired into prepare and the engine, against
onnxruntime-training's builder on the same loss graph (real graphs, real sessions)."""

import hashlib
import json
import os
import signal
import subprocess
import time

import numpy as np
import onnx
import pytest

from trainrun import config as C
from trainrun.step.engine import Engine, EngineOptions
from trainrun.errors import UsageError
from trainrun.graphs.forward import forward_from_config
from trainrun.graphs.gradients import build_train_graph, builder, direct_gradients, ort_builder_missing
from trainrun.graphs.manifest import build_options, loss_graph, prepare, up_to_date
from trainrun.graphs.names import GRAD_SUFFIX

from conftest import MPIRUN, TRAINRUN, mpirun, rank_pids, read_metrics, run, write_config

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

TINY = {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 64, "vocab_size": 300}
SHAPES = {"input_ids": ((2, 32), np.int64), "labels": ((2, 32), np.int64)}
# the training build's ops: none may appear in a graph of trainrun's builder
TRAINING_OPS = {"InPlaceAccumulatorV2", "SoftmaxGrad", "SoftmaxGrad_13", "LayerNormalizationGrad", "SigmoidGrad",
                "SliceGrad", "GatherGrad", "GatherNDGrad", "TanhGrad", "BroadcastGradientArgs", "ConcatTraining",
                "SoftmaxCrossEntropyLossGrad", "GeluGrad", "FastGeluGrad", "ReluGrad", "YieldOp"}


def cfg_for(out, builder_name, **over):
    return C.from_dict({"model": {"gpt2": TINY}, "data": {"seq_len": 32}, "train": {"micro_batch_size": 2},
                        "run": {"output_dir": str(out), "seed": 3}, "graphs": {"builder": builder_name}, **over})


def engine(graphs_dir, **opts):
    eng = Engine(graphs_dir, EngineOptions(threads=1, **opts), SHAPES, SHAPES)
    eng.load_weights()
    return eng


def batches(n, seed=4):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 300, (2, 32)), "labels": rng.integers(0, 300, (2, 32))} for _ in range(n)]


def sha(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


@pytest.mark.ort_training
def test_trainrun_builder_prepares_gpt2_in_standard_ops(tmp_path):
    """prepare with graphs.builder trainrun: the manifest records it, the train graph is in the direct form
    (gradients as outputs, no accumulators, no training op), its gradients equal onnxruntime-training's to
    1e-5 of each tensor's largest; auto = onnxruntime where installed, with today's graphs byte for byte;
    a change of builder makes the graphs out of date."""
    ours = prepare(cfg_for(tmp_path / "ours", "trainrun"))
    auto = prepare(cfg_for(tmp_path / "auto", "auto"))
    ort_dir = prepare(cfg_for(tmp_path / "ort", "onnxruntime"))
    manifests = {k: json.load(open(os.path.join(d, "manifest.json"))) for k, d in
                 (("ours", ours), ("auto", auto), ("ort", ort_dir))}
    assert [manifests[k]["builder"] for k in ("ours", "auto", "ort")] == ["trainrun", "onnxruntime", "onnxruntime"]
    assert sha(os.path.join(auto, "train.onnx")) == sha(os.path.join(ort_dir, "train.onnx"))
    assert not up_to_date(ours, cfg_for(tmp_path / "ours", "onnxruntime"))
    assert up_to_date(ours, cfg_for(tmp_path / "ours", "trainrun"))
    assert not up_to_date(ort_dir, cfg_for(tmp_path / "ort", "trainrun"))
    assert up_to_date(ort_dir, cfg_for(tmp_path / "ort", "auto"))

    train = onnx.load(os.path.join(ours, "train.onnx"))
    ops = {n.op_type for n in train.graph.node}
    assert not ops & TRAINING_OPS, ops & TRAINING_OPS
    # standard ops, and the fused ones stock onnxruntime's CPU and CUDA providers run (graphs.fuse)
    assert {(n.domain, n.op_type) for n in train.graph.node if n.domain not in ("", "ai.onnx")} \
        <= {("com.microsoft", "FusedMatMul")}
    params = [p["name"] for p in manifests["ours"]["params"]]
    assert [o.name for o in train.graph.output] == ["loss"] + [p + GRAD_SUFFIX for p in params]
    assert not any(i.name.endswith("_buffer") or i.name == "lazy_reset_grad" for i in train.graph.input)
    same, outputs = direct_gradients(train)                 # the direct form is accepted as it is
    assert outputs == {p: p + GRAD_SUFFIX for p in params} and same == train

    a, b = engine(ours), engine(ort_dir, direct_gradients=True)
    assert np.array_equal(a.params, b.params)
    batch = batches(1)[0]
    a.grads[:] = np.nan
    la, lb = a.forward_backward(batch, accumulate=False), b.forward_backward(batch, accumulate=False)
    assert la == pytest.approx(lb, rel=1e-6)
    for i, name in enumerate(a.layout.names):
        ga, gb = a.layout.view(a.grads, i), b.layout.view(b.grads, i)
        assert np.abs(ga - gb).max() <= 1e-5 * np.abs(gb).max(), name


def test_trainrun_builder_errors(tmp_path):
    """An op trainrun's builder has no rule for: a UsageError naming the op, the node and the other builder;
    a parameter the loss does not depend on: the message of onnxruntime-training's builder; one it reads
    through an op without a gradient only (Round): that op and node named."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 3])
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, [3])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Hardmax", ["h"], ["y"], name="the_hardmax", axis=1),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, w, v],
                                                [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UsageError, match="the loss does not depend on these parameters .*: v") as err:
        build_train_graph(model, ["w", "v"], "m.onnx", builder="trainrun")
    with pytest.raises(UsageError) as err:
        build_train_graph(model, ["w"], "m.onnx", builder="trainrun")
    text = err.value.render()
    assert "m.onnx" in text and "Hardmax" in text and "the_hardmax" in text, text
    assert "graphs.builder: onnxruntime" in text, text
    # read by the loss through an op without a gradient only: that op named, not "does not depend"
    model.graph.node[1].CopyFrom(helper.make_node("Round", ["h"], ["y"], name="rnd"))
    with pytest.raises(UsageError, match=r"m.onnx: trainrun's gradient builder cannot differentiate this graph: "
                                         r"operator Round \(node 'rnd'\) has no gradient \(the only paths from w "):
        build_train_graph(model, ["w"], "m.onnx", builder="trainrun")


def test_builder_choice(tmp_path):
    """auto picks onnxruntime-training's builder exactly where it is importable; onnxruntime where it is not:
    exit 2 naming the key and what to install, nothing written; trainrun prepare says which built the graphs."""
    missing = ort_builder_missing()
    assert builder("trainrun")[0] == "trainrun"
    assert builder("auto")[0] == ("trainrun" if missing else "onnxruntime")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{output_dir: {tmp_path / 'run'}}}\ngraphs: {{builder: onnxruntime}}\n"
                   "model: {gpt2: {n_layer: 1, n_head: 2, n_embd: 32, n_positions: 32, vocab_size: 64}}\n"
                   "data: {seq_len: 16}\n")
    if missing:
        with pytest.raises(UsageError, match="graphs.builder: onnxruntime .*onnxruntime-training"):
            builder("onnxruntime")
        p = run([TRAINRUN, "prepare", "--config", str(cfg)], check=2)
        assert "graphs.builder: onnxruntime needs onnxruntime-training's gradient builder" in p.stderr
        assert "install the training extra" in p.stderr and not (tmp_path / "run/graphs").exists()
    else:
        assert builder("onnxruntime")[0] == "onnxruntime"
    p = run([TRAINRUN, "prepare", "--config", str(cfg), "--set", "graphs.builder=trainrun"], check=0)
    assert "(gradients by trainrun's own builder, graphs.builder: trainrun)" in p.stdout


@pytest.mark.parametrize("bucket_bytes", [0, 20_000])
def test_accumulation_on_the_bound_buffers(tmp_path, bucket_bytes):
    """A direct-form graph (trainrun's builder) accumulates over micro-batches in the engine: the sum in the
    gradient buffer is the same bits as each micro-batch run alone summed in numpy in the same order (what
    onnxruntime-training's InPlaceAccumulatorV2 computes: checked below on its own graph). Cut at gradient
    buckets (distributed.overlap_grad_reduce), each bucket's sum is final when it is handed on."""
    ours = engine(prepare(cfg_for(tmp_path / "ours", "trainrun")), bucket_bytes=bucket_bytes, seed=3)
    assert (len(ours.buckets) > 2) == (bucket_bytes > 0)
    micro = batches(3)
    alone = []
    for b in micro:
        ours.forward_backward(b, accumulate=False)
        alone.append(ours.grads.copy())
    want = (alone[0] + alone[1]) + alone[2]
    assert not np.array_equal(want, alone[0] * 3)
    handed = []

    def between(k):
        lo, hi = ours.buckets[k]
        handed.append((k, np.array_equal(ours.grads[lo:hi], want[lo:hi])))
    losses = [ours.forward_backward(b, accumulate=a > 0, between=between if a == 2 else None)
              for a, b in enumerate(micro)]
    assert np.array_equal(ours.grads, want)
    assert handed == [(k, True) for k in range(len(ours.buckets) - 1)]
    # the next step's first micro-batch writes the buffer again (not the scratch)
    assert ours.forward_backward(micro[0], accumulate=False) == losses[0]
    assert np.array_equal(ours.grads, alone[0])

    if ort_builder_missing() is None:       # InPlaceAccumulatorV2 sums the same way
        ort_dir = prepare(cfg_for(tmp_path / "ort", "onnxruntime"))
        acc, direct = engine(ort_dir), engine(ort_dir, direct_gradients=True)
        alone = []
        for b in micro:
            direct.forward_backward(b, accumulate=False)
            alone.append(direct.grads.copy())
        for a, b in enumerate(micro):
            acc.forward_backward(b, accumulate=a > 0)
        assert np.array_equal(acc.grads, (alone[0] + alone[1]) + alone[2])
        # and the engine's adds on the ORT direct graph give the accumulators' bits
        for a, b in enumerate(micro):
            direct.forward_backward(b, accumulate=a > 0)
        assert np.array_equal(direct.grads, acc.grads)


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_prepare_passes_on_trainrun_graphs(tmp_path, dropout):
    """prepare's passes over a train graph of trainrun's builder: train.recompute blocks (the forward in
    dependency order first: recomputed nodes, each node and tensor named once, though the blocks read
    shapes computed once before them; the same bits), debug.tensors (chosen tensors as outputs, the same
    gradients)."""
    from trainrun.graphs.recompute import recomputed_nodes
    gpt2 = dict(TINY, n_layer=3, dropout=dropout)
    shapes = {"input_ids": ((4, 32), np.int64), "labels": ((4, 32), np.int64)}
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, 300, (4, 32)) for k in shapes}
    got = {}
    for name, over in [("plain", {}), ("recompute", {"train": {"micro_batch_size": 4, "recompute": "blocks"}}),
                       ("stats", {"debug": {"stats_every": 1, "tensors": ["*ln_f*"]}})]:
        over.setdefault("train", {"micro_batch_size": 4})
        cfg = C.from_dict({"model": {"gpt2": gpt2}, "data": {"seq_len": 32}, "run": {"output_dir": str(tmp_path / name),
                           "seed": 3}, "graphs": {"builder": "trainrun"}, **over})
        graphs_dir = prepare(cfg)
        train = onnx.load(os.path.join(graphs_dir, "train.onnx"))
        assert (recomputed_nodes(train) > 0) == (name == "recompute")
        outputs = [o for n in train.graph.node for o in n.output]
        assert len(set(outputs)) == len(outputs) and len({n.name for n in train.graph.node}) == len(train.graph.node)
        eng = Engine(graphs_dir, EngineOptions(threads=1, seed=3), shapes, shapes)
        eng.load_weights()
        got[name] = (eng.forward_backward(batch, accumulate=False, position=7), eng.grads.copy())
        if name == "stats":
            assert eng.stats_outputs and all("ln_f" in n for n in eng.stats_outputs)
            assert all(np.isfinite(v).all() for v in eng.extra_train_outputs().values())
    for name in ("recompute", "stats"):
        assert got[name][0] == got["plain"][0] and np.array_equal(got[name][1], got["plain"][1]), name


def test_pad_products_on_trainrun_graphs(tmp_path):
    """engine.pad_products always on a train graph of trainrun's builder: padded products, the values of the
    unpadded graph to float32 rounding."""
    from test_strides import _gpt2, _padded
    grads = {}
    for setting in ("always", "never"):
        cfg, shape, shapes = _gpt2(tmp_path, seed=6, setting=setting)
        cfg.graphs.builder = "trainrun"
        graphs_dir = prepare(cfg)
        assert bool(_padded(onnx.load(f"{graphs_dir}/train.onnx"))) == (setting == "always")
        eng = Engine(graphs_dir, EngineOptions(threads=1), shapes, shapes)
        eng.load_weights()
        rng = np.random.default_rng(7)
        eng.forward_backward({k: rng.integers(0, shape["vocab_size"], v[0]) for k, v in shapes.items()},
                             accumulate=False)
        grads[setting] = eng.grads.copy()
    assert np.abs(grads["always"] - grads["never"]).max() <= 1e-5 * np.abs(grads["never"]).max()


def _losses(run_dir):
    train, _ = read_metrics(run_dir)
    return {s: train[s]["loss"] for s in sorted(train)}


def test_trainrun_builder_end_to_end(tmp_path, byte_dataset):
    """graphs.builder trainrun on `mpirun -np 2` (2 micro-batches a step, added by the engine): a run killed
    after a checkpoint and resumed has the undisturbed run's losses and final weights bit for
    bit; export, evaluate and generate work on it; its 10 losses are onnxruntime-training's builder's to
    1e-5; a run of onnxruntime-training's graphs resumes on trainrun's (the weights have the same names)."""
    common = {"graphs.builder": "trainrun", "train.max_steps": 10, "train.gradient_accumulation_steps": 2,
              "checkpoint.every": 5}

    def config(name, **over):
        (tmp_path / name).mkdir()
        return write_config(tmp_path / name / "c.yaml", byte_dataset, **{**common, **over})
    p = mpirun(2, "--config", config("straight"))
    assert "(gradients by trainrun's own builder: graphs.builder: trainrun)" in p.stdout
    ref = _losses(str(tmp_path / "straight/run"))
    assert sorted(ref) == list(range(1, 11)) and ref[10] < ref[1]
    manifest = json.load(open(tmp_path / "straight/run/graphs/manifest.json"))
    assert manifest["builder"] == "trainrun"

    # checkpoints at 3 and 6 (the save at 6 commits 3's first), the ranks stalled at step 7, one killed
    cfg = config("killed", **{"checkpoint.every": 3})
    proc = subprocess.Popen([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, TRAINRUN_FAULT_STALL_STEP="7"))
    committed = tmp_path / "killed/run/checkpoints/3/COMMITTED"
    deadline = time.time() + 240
    while time.time() < deadline and not committed.exists():
        time.sleep(0.2)
    try:
        assert committed.exists(), "the run never committed its step-3 checkpoint"
        os.kill(rank_pids(str(tmp_path / "killed"))[1], signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    mpirun(2, "resume", str(tmp_path / "killed/run"))
    run_dir = str(tmp_path / "killed/run")
    assert _losses(run_dir) == ref
    for f in ("model.safetensors", "optimizer.safetensors"):
        assert sha(os.path.join(run_dir, "checkpoints/10", f)) == \
            sha(str(tmp_path / "straight/run/checkpoints/10" / f)), f

    # the commands that read the run: export, evaluate, generate
    exported = str(tmp_path / "m.onnx")
    run([TRAINRUN, "export", run_dir, "--output", exported], check=0)
    assert onnx.load(exported).graph.output[0].name == "logits"
    out = str(tmp_path / "e.json")
    run([MPIRUN, "-np", "2", TRAINRUN, "evaluate", run_dir, "--data", os.path.join(byte_dataset, "eval"),
         "--batch", "8", "--output", out], check=0)
    assert json.load(open(out))["samples"] > 0
    p = run([TRAINRUN, "generate", run_dir, "--prompt", "def f(", "--max-new-tokens", "8", "--temperature", "0"],
            check=0)
    assert p.stdout.startswith("def f(")

    if ort_builder_missing() is not None:
        return
    mpirun(2, "--config", config("ort", **{"graphs.builder": "onnxruntime"}))
    theirs = _losses(str(tmp_path / "ort/run"))
    assert sorted(theirs) == sorted(ref)
    for s in ref:
        assert ref[s] == pytest.approx(theirs[s], rel=1e-5), (s, ref[s], theirs[s])
    # onnxruntime-training's graphs for 5 steps, then trainrun's
    mpirun(2, "--config", config("across", **{"graphs.builder": "onnxruntime", "train.stop_at": 5}))
    p = mpirun(2, "resume", str(tmp_path / "across/run"), "--set", "graphs.builder=trainrun")
    assert "preparing graphs" in p.stdout and "gradients by trainrun's own builder" in p.stdout
    assert json.load(open(tmp_path / "across/run/graphs/manifest.json"))["builder"] == "trainrun"
    got = _losses(str(tmp_path / "across/run"))
    assert sorted(got) == list(range(1, 11))
    for s in got:
        assert got[s] == pytest.approx(theirs[s], rel=1e-5), (s, got[s], theirs[s])


def test_a_gather_on_axis_1_before_a_gemm_differentiates_under_onnxruntimes_optimizer():
    """BERT's pooler: Gemm(Gather(h, 0, axis=1)). The gradient of a Gather on axis 1 with a scalar index
    would move dy's axes by an identity Transpose, which onnxruntime's GemmTransposeFusion folds into the
    Gemm before it as if it swapped the axes; the builder emits no identity Transpose. The gradients
    against numpy, with onnxruntime's default optimizations."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from trainrun.graphs.autodiff import differentiate
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("Gather", ["h", "first"], ["cls"], axis=1),
             helper.make_node("Gemm", ["cls", "w"], ["y"], transB=1),
             helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("h", f32, [3, 5, 4]),
                                           helper.make_tensor_value_info("w", f32, [6, 4])],
                              [helper.make_tensor_value_info("loss", f32, [])],
                              [numpy_helper.from_array(np.array(0, np.int64), "first")])
    train = differentiate(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), ["h", "w"])
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((3, 5, 4)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    sess = ort.InferenceSession(train.SerializeToString(), providers=["CPUExecutionProvider"])
    dh, dw = sess.run(["h_grad", "w_grad"], {"h": h, "w": w})
    y = h[:, 0] @ w.T
    want_dh = np.zeros_like(h)
    want_dh[:, 0] = 2 * y @ w
    np.testing.assert_allclose(dh, want_dh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, 2 * y.T @ h[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_train_graphs_of_trainrun_builder(tmp_path, precision):
    """train.precision fp16/bf16 on device cuda (prepared here, no GPU needed): trainrun's train graph keeps
    float32 gradient outputs, the fp32 islands of the cast pass (LayerNorm, Softmax, the loss) compute in
    float32, and the graph passes the CUDA provider's kernel check; fp16's loss_scale stays an input."""
    from onnx import TensorProto
    from trainrun.step import cuda_kernels
    cfg = cfg_for(tmp_path, "trainrun", train={"micro_batch_size": 2, "precision": precision}, device="cuda")
    graphs_dir = prepare(cfg)
    train = onnx.load(os.path.join(graphs_dir, "train.onnx"))
    low = TensorProto.FLOAT16 if precision == "fp16" else TensorProto.BFLOAT16
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in train.graph.output)
    ops = {n.op_type for n in train.graph.node}
    assert not ops & TRAINING_OPS and "Cast" in ops
    types = cuda_kernels.tensor_types(train)
    assert any(t == low for t in types.values())
    for n, dtype in cuda_kernels.node_types(train, types):
        if n.op_type in ("LayerNormalization", "Softmax", "LogSoftmax", "NegativeLogLikelihoodLoss"):
            assert dtype == "float", (n.name, dtype)
    assert ("loss_scale" in {i.name for i in train.graph.input}) == (precision == "fp16")


# The other runtime's venv, for the cross-runtime comparison: run under stock onnxruntime (make test) the
# variable names the training build's bin dir, run under the training build (make test-training) the stock one's.
OTHER_RUNTIME = {True: "TRAINRUN_TRAINING_BUILD", False: "TRAINRUN_STOCK_BUILD"}
HAS_BUILDER = "import onnxruntime.capi._pybind_state as s; print(hasattr(s, 'GradientGraphBuilder'))"


def test_fifty_steps_on_stock_onnxruntime_equal_the_training_builds(tmp_path, byte_dataset):
    """50 steps of graphs.builder trainrun on stock onnxruntime, `mpirun -np 2`, have the losses of the same
    config trained with graphs.builder onnxruntime on the onnxruntime-training build, to 1e-5 relative per
    step. One runtime is this venv's, the other's bin dir is named by TRAINRUN_TRAINING_BUILD (this venv
    stock) or TRAINRUN_STOCK_BUILD (this venv the training build); without it the test skips, or fails where
    TRAINRUN_REQUIRE_STOCK_COMPARISON=1 (make test-training with .venv there)."""
    here_stock = ort_builder_missing() is not None
    var = OTHER_RUNTIME[here_stock]
    other = os.environ.get(var)
    if not other:
        why = (f"{var} is not set (the other onnxruntime's venv bin dir; make test-training sets "
               f"TRAINRUN_STOCK_BUILD to .venv/bin where make setup-test made it)")
        if os.environ.get("TRAINRUN_REQUIRE_STOCK_COMPARISON") == "1":
            pytest.fail(f"TRAINRUN_REQUIRE_STOCK_COMPARISON=1 but {why}")
        pytest.skip(why)
    here = os.path.dirname(TRAINRUN)
    p = run([os.path.join(other, "python"), "-c", HAS_BUILDER], check=0)
    assert p.stdout.strip() == str(here_stock), f"{var}={other}: its onnxruntime is the same kind as this one's"
    stock, training = (here, other) if here_stock else (other, here)

    def losses(name, bin_dir, builder_name, *extra):
        (tmp_path / name).mkdir()
        cfg = write_config(tmp_path / name / "c.yaml", byte_dataset, **{
            "graphs.builder": builder_name, "train.max_steps": 50, "train.gradient_accumulation_steps": 2,
            "train.micro_batch_size": 2})
        p = run([os.path.join(bin_dir, "mpirun"), "-np", "2", os.path.join(bin_dir, "trainrun"), "--config", cfg,
                 *extra], check=0, env={"PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")})
        assert f"graphs.builder: {builder_name}" in p.stdout, p.stdout
        got = _losses(str(tmp_path / name / "run"))
        assert sorted(got) == list(range(1, 51))
        return got

    ours = losses("stock", stock, "trainrun")
    theirs = losses("training", training, "onnxruntime")
    assert ours[50] < ours[1] - 0.5                         # it trains
    worst = max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in ours)
    print(f"max relative loss difference over 50 steps: {worst:.2e}")
    for s in ours:
        assert ours[s] == pytest.approx(theirs[s], rel=1e-5), (s, ours[s], theirs[s])
