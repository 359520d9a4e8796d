"""Observability, for real: statistics + compare, deterministic runs, log levels, profiling,
graph dumps, doctor and the PyTorch reference; real `mpirun -np 2`, onnxruntime and files."""

import glob
import json
import os
import shutil
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import MPIRUN, ROOT, TRAINRUN, mpirun, read_metrics, run, write_config

from trainrun import config as C
from trainrun.graphs.gradients import ort_builder_missing
from trainrun.graphs.manifest import load_manifest, prepare
from trainrun.graphs.names import ACC_OUT_SUFFIX, GRAD_SUFFIX, LOSS, MASK_PREFIX
from trainrun.errors import UsageError
from trainrun.run.validity import load_config

STEPS = 10
STATS = {"debug.stats_every": 1, "debug.tensors": ["logits", "LayerNormalization_*_out0"],
         "run.deterministic": True, "model.gpt2.dropout": 0.1, "train.max_steps": STEPS, "train.log_every": 5}


def stats_lines(run_dir, rank):
    with open(os.path.join(run_dir, "stats", f"rank-{rank}", "stats.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def final_digest(run_dir, rank):
    ckpt = os.path.join(run_dir, "checkpoints", str(STEPS))
    return json.load(open(os.path.join(ckpt, f"rank-{rank}.json")))["params_sha256"]


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory, byte_dataset):
    """The same deterministic run (dropout 0.1, on) twice on 2 ranks, with statistics of every
    step: once at --log-level warning, once at devinfo."""
    out = {}
    for name, level in (("a", "warning"), ("b", "devinfo")):
        d = tmp_path_factory.mktemp(name)
        cfg = write_config(d / "c.yaml", byte_dataset, **STATS)
        out[name] = (str(d / "run"), mpirun(2, "--config", cfg, "--log-level", level), cfg)
    return out


def test_deterministic_runs_are_bitwise_identical(twin_runs):
    (a, _, _), (b, _, _) = twin_runs["a"], twin_runs["b"]
    la, lb = read_metrics(a)[0], read_metrics(b)[0]
    assert sorted(la) == sorted(lb) == [5, 10]
    assert [la[s]["loss"] for s in la] == [lb[s]["loss"] for s in lb]                 # exact, not approx
    assert la[10]["loss"] < la[5]["loss"]
    for r in (0, 1):
        assert final_digest(a, r) == final_digest(b, r) == final_digest(a, 0)
        assert open(os.path.join(a, "stats", f"rank-{r}", "stats.jsonl")).read() == \
            open(os.path.join(b, "stats", f"rank-{r}", "stats.jsonl")).read()
    # dropout is on, from trainrun's masks: no Dropout node, a mask input per Dropout
    train = onnx.load(os.path.join(a, "graphs", "train.onnx")).graph
    assert not [n for n in train.node if n.op_type == "Dropout"]
    assert len([i for i in train.input if i.name.startswith(MASK_PREFIX)]) == 7
    proc = run([TRAINRUN, "compare", a, b, "--rtol", "0"], check=0)
    assert "no divergence" in proc.stdout
    # --max-rows: 10 steps, at most 8 rows (steps and "..."): the first ones, the last, a gap
    out = run([TRAINRUN, "compare", a, b, "--rtol", "0", "--max-rows", "8"], check=0).stdout
    rows = [line.split()[0] for line in out.split("per step")[1].splitlines()[2:] if line.strip()]
    assert len(rows) <= 8 and "..." in rows, rows
    steps = [int(r) for r in rows if r != "..."]
    assert steps[:5] == [1, 2, 3, 4, 5] and steps[-1] == STEPS and len(steps) < STEPS


def test_statistics_per_step_and_rank(twin_runs):
    run_dir = twin_runs["a"][0]
    r0, r1 = stats_lines(run_dir, 0), stats_lines(run_dir, 1)
    assert [x["step"] for x in r0] == [x["step"] for x in r1] == list(range(1, STEPS + 1))
    names = list(r0[0]["tensors"])
    acts = [n for n in names if n.startswith("act/")]
    assert acts[-1] == "act/logits" and len(acts) == 1 + 5          # 2 blocks x ln_1/ln_2 + ln_f, in graph order
    manifest = load_manifest(os.path.join(run_dir, "graphs"))
    params = [p["name"] for p in manifest["params"]]
    assert [n for n in names if n.startswith("grad/")] == [f"grad/{p}" for p in params]
    assert [n for n in names if n.startswith("param/")] == [f"param/{p}" for p in params]
    logits = r0[0]["tensors"]["act/logits"]
    assert logits["numel"] == 4 * 32 * 512 and logits["nan"] == logits["inf"] == 0
    assert logits["min"] <= logits["mean"] <= logits["max"] and logits["std"] > 0
    for x0, x1 in zip(r0, r1):
        # after the allreduce every rank holds the same gradient and parameters, but its own activations
        assert {k: v for k, v in x0["tensors"].items() if not k.startswith("act/")} == \
            {k: v for k, v in x1["tensors"].items() if not k.startswith("act/")}
        assert x0["tensors"]["act/logits"] != x1["tensors"]["act/logits"]
        assert x0["scalars"]["loss"] == x1["scalars"]["loss"] != x0["scalars"]["local_loss"]
    # the numbers are right: the parameters of the last step against the checkpoint itself
    from safetensors.numpy import load_file
    weights = load_file(os.path.join(run_dir, "checkpoints", str(STEPS), "model.safetensors"))
    for name in ("transformer.wte.weight", "transformer.h.1.mlp.c_fc.bias"):
        w, s = weights[name].astype(np.float64), r0[-1]["tensors"][f"param/{name}"]
        np.testing.assert_allclose([s["min"], s["max"], s["mean"], s["std"], s["norm"]],
                                   [w.min(), w.max(), w.mean(), w.std(), np.linalg.norm(w)], rtol=1e-6)
    # grad_norm in the statistics is the logged one: the norm over all gradient tensors. The statistics
    # sum in float64, the logged norm is a float32 dot product over the whole buffer (~44k values here,
    # rounding ~ sqrt(N) * eps = 1.3e-5 relative, more or less by the BLAS's blocking): 1e-4.
    grad_norm = np.sqrt(sum(r0[-1]["tensors"][f"grad/{p}"]["norm"] ** 2 for p in params))
    assert grad_norm == pytest.approx(read_metrics(run_dir)[0][STEPS]["grad_norm"], rel=1e-4)


def test_log_levels(twin_runs):
    _, quiet, _ = twin_runs["a"]
    _, loud, _ = twin_runs["b"]
    assert quiet.stdout == ""                                           # warning: nothing on stdout
    out = loud.stdout
    for r in (0, 1):                                                   # devinfo: every rank, each line named
        assert f"[rank {r}] host " in out
        assert f"[rank {r}] step 5 | local loss " in out and f"[rank {r}] step 10 | local loss " in out
    assert "[rank 0] trainrun: t | 2 rank(s)" in out
    assert "[rank 0] resolved config:" in out and "[rank 0]   bert:" in out       # devinfo: the whole config
    assert "[I:onnxruntime:rank 1 train," in loud.stderr             # onnxruntime's own info logs, per rank


def test_compare_finds_a_planted_divergence(twin_runs, tmp_path):
    """The same run with another floor of the cosine decay: the learning rates part after the 5 warmup
    steps, so compare must name step 6."""
    a, _, cfg = twin_runs["a"]
    b = str(tmp_path / "run")
    mpirun(2, "--config", cfg, "--set", f"run.output_dir={b}", "--set", "lr_schedule.min_lr=0.001")
    proc = run([TRAINRUN, "compare", a, b], check=1)
    out = proc.stdout
    assert "first divergence: step 6 rank 0, scalar/lr" in out, out
    rows = {int(line.split()[0]): line.split() for line in out.split("per step")[1].splitlines()
            if line.strip() and line.split()[0].isdigit()}
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert all(rows[s][1] == "0" for s in range(1, 6)) and all(rows[s][1] != "0" for s in range(6, STEPS + 1))
    # the parameters only: the update of step 6 is the first to differ
    proc = run([TRAINRUN, "compare", a, b, "--tensors", "param/*", "--rank", "1"], check=1)
    assert "first divergence: step 6, param/" in proc.stdout
    # the loss of step 6 was computed before that update: identical
    proc = run([TRAINRUN, "compare", a, b, "--tensors", "scalar/loss", "--rtol", "0"], check=1)
    assert "first divergence: step 7" in proc.stdout
    # --atol: the learning rates differ by less than 0.001 - 0.0001 (the two floors): within atol 1e-3,
    # not within the default 0
    lr = [TRAINRUN, "compare", a, b, "--tensors", "scalar/lr", "--rtol", "0"]
    assert "first divergence: step 6 rank 0, scalar/lr" in run(lr, check=1).stdout
    proc = run([*lr, "--atol", "1e-3"], check=0)
    assert "no divergence" in proc.stdout and "atol 0.001" in proc.stdout


def test_compare_usage_errors(twin_runs, tmp_path):
    a = twin_runs["a"][0]
    proc = run([TRAINRUN, "compare", a, str(tmp_path)], check=2)
    assert "holds no statistics" in proc.stderr and "debug.stats_every" in proc.stderr
    proc = run([TRAINRUN, "compare", a, a, "--tensors", "nothing/*"], check=2)
    assert "no tensor in common matching nothing/*" in proc.stderr


def test_statistics_off_adds_nothing_and_bad_patterns_are_named(tmp_path, byte_dataset):
    cfg = C.load_config(write_config(tmp_path / "c.yaml", byte_dataset, **{
        "debug.tensors": ["logits"], "run.output_dir": str(tmp_path / "off")}))
    prepare(cfg)
    outputs = [o.name for o in onnx.load(str(tmp_path / "off" / "graphs" / "train.onnx")).graph.output]
    manifest = load_manifest(str(tmp_path / "off" / "graphs"))
    # per parameter its accumulator's flag (onnxruntime-training's builder) or its gradient (trainrun's)
    suffix = ACC_OUT_SUFFIX if manifest["builder"] == "onnxruntime" else GRAD_SUFFIX
    assert outputs == [LOSS] + [p["name"] + suffix for p in manifest["params"]]
    cfg.debug.stats_every, cfg.run.output_dir = 3, str(tmp_path / "on")
    prepare(cfg)
    on = [o.name for o in onnx.load(str(tmp_path / "on" / "graphs" / "train.onnx")).graph.output]
    assert on == outputs + ["logits"]
    cfg.debug.tensors = ["logits", "no_such_tensor*"]
    with pytest.raises(UsageError) as err:
        prepare(cfg)
    assert "debug.tensors" in err.value.message and "'no_such_tensor*'" in err.value.message
    with pytest.raises(UsageError) as err:
        load_config(str(tmp_path / "c.yaml"), ["profile.start_step=21"])
    assert any(p.startswith("profile.start_step: 21 is after the last step") for p in err.value.problems)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, byte_dataset):
    d = tmp_path_factory.mktemp("prof")
    cfg = write_config(d / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "train.gradient_accumulation_steps": 2, "train.eval_every": 4,
        "checkpoint.every": 4, "profile.start_step": 3, "profile.steps": 2, "debug.save_graphs": True,
        "profile.dir": "traces",                # relative: inside run.output_dir
        "engine.optimizer_kernel": "graph"})   # the optimizer session profiled too
    mpirun(2, "--config", cfg)
    return str(d / "run")


def test_profile_covers_exactly_the_window_on_every_rank(profiled):
    files = sorted(os.listdir(os.path.join(profiled, "traces")))
    assert files == ["rank-0.json", "rank-1.json"]              # one per rank; onnxruntime's own files merged
    assert not os.path.exists(os.path.join(profiled, "profile"))    # profile.dir, not the default
    for r in (0, 1):
        trace = json.load(open(os.path.join(profiled, "traces", f"rank-{r}.json")))
        events = trace["traceEvents"]
        runs = {}
        for e in events:
            if e.get("cat") == "Session" and e["name"] == "model_run":
                runs[e["args"]["session"]] = runs.get(e["args"]["session"], 0) + 1
        # steps 3 and 4: 2 micro-batches each; the eval of step 4 (eval_steps 2 x 2 micro-batches)
        assert runs == {"train": 4, "optimizer": 2, "eval": 4}
        assert trace["trainrun"]["rank"] == r and trace["trainrun"]["steps"] == [3, 4]
        steps = [e["name"] for e in events if e.get("cat") == "trainrun" and e["name"].startswith("step ")]
        assert steps == ["step 3", "step 4"]
        phases = {e["name"] for e in events if e.get("cat") == "trainrun" and not e["name"].startswith("step ")}
        assert {"data", "forward_backward", "allreduce", "optimizer", "eval", "checkpoint"} <= phases
        kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        assert kernels and all(e["ts"] >= 0 and e["dur"] >= 0 for e in kernels)
        # onnxruntime's events and trainrun's phases share one clock: the kernels lie inside the steps
        step_spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("step ")]
        assert all(any(t0 <= k["ts"] <= t1 for t0, t1 in step_spans) for k in kernels)
    train, evals = read_metrics(profiled)
    assert sorted(train) == list(range(1, 7)) and sorted(evals) == [4, 6]   # training went on after the window
    assert "profile" in json.load(open(os.path.join(profiled, "summary.json")))["phase_shares"]


def test_profile_summarize(profiled):
    traces = os.path.join(profiled, "traces")
    proc = run([TRAINRUN, "profile", "summarize", traces, "--top", "5"], check=0)
    out = proc.stdout
    assert "profile of steps 3-4 (2 step(s)) on 2 rank(s)" in out
    table = out.split("top 5 operator types")[1].split("phases per rank")[0]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    # which session tops a tiny model's profile is down to timing noise (seen: eval's loss op)
    assert len(rows) == 5 and {r[0] for r in rows} <= {"train", "eval", "optimizer"}
    assert "train" in {r[0] for r in rows}
    totals = [float(r[3]) for r in rows]
    assert totals == sorted(totals, reverse=True) and totals[0] > 0
    phase_rows = out.split("phases per rank")[1].split("\n\n")[0].splitlines()
    header = phase_rows[1].split()
    assert header[:5] == ["rank", "data", "forward_backward", "allreduce", "norm"]
    assert [line.split()[0] for line in phase_rows[2:]] == ["0", "1"]
    # --by node: the rows name nodes of the graphs onnxruntime ran (debug.save_graphs), not operator types;
    # given the run directory, summarize finds the traces in the run's profile.dir ("traces")
    out = run([TRAINRUN, "profile", "summarize", profiled, "--top", "5", "--by", "node"], check=0).stdout
    table = out.split("top 5 nodes by total kernel time")[1].split("phases per rank")[0]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert len(rows) == 5
    for session, node, *_ in rows:
        graph = onnx.load(os.path.join(profiled, "debug", "graphs", f"{session}.onnx")).graph
        if node not in {n.name for n in graph.node}:
            # a node onnxruntime left unnamed (the body of an inlined function, e.g. NegativeLogLikelihoodLoss's
            # Where nodes) is profiled as "<op>_<node index>"; which rows reach the top 5 is timing noise
            op, _, index = node.rpartition("_")
            assert index.isdigit() and any(n.op_type == op and not n.name for n in graph.node), (session, node)
        assert node not in {n.op_type for n in graph.node}
    assert run([TRAINRUN, "profile", "summarize", os.path.dirname(profiled)], check=2).stderr.count("no rank-") == 1


def test_profile_node_costs(profiled, tmp_path):
    """`profile summarize`'s per-node cost of the train graph (--json and text): each node's time per step on a
    rank, its FLOPs from the trace's shapes, its time at the run's measured peak and the overhead beyond it;
    the times add up to the kernel time the traces hold, the FLOPs to the model FLOPs MFU counts."""
    from trainrun.observe.flops import PRODUCTS
    rep = json.loads(run([TRAINRUN, "profile", "summarize", profiled, "--json"], check=0).stdout)
    costs = rep["node_costs"]
    summary = json.load(open(os.path.join(profiled, "summary.json")))
    # the window's first step (the profiling sessions' first run) left out
    assert (costs["session"], costs["steps"], costs["left_out"], costs["ranks"]) == ("train", [4], [3], 2)
    peak = costs["peak_flops_per_rank"]
    assert peak == pytest.approx(summary["peak_flops"] / 2) and "peak_flops" in costs["peak_source"]
    kernel_us = runs_us = step_us = 0.0          # read here from the traces: train session, step 4, both ranks
    for r in (0, 1):
        events = json.load(open(os.path.join(profiled, "traces", f"rank-{r}.json")))["traceEvents"]
        step = next(e for e in events if e["name"] == "step 4")
        mine = [e for e in events if (e.get("args") or {}).get("session") == "train"
                and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        kernel_us += sum(e["dur"] for e in mine if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))
        runs_us += sum(e["dur"] for e in mine if e.get("cat") == "Session" and e["name"] == "model_run")
        step_us += step["dur"]
    nodes = costs["nodes"]
    assert sum(n["ms"] for n in nodes) == pytest.approx(kernel_us / 2e3, rel=1e-9)
    assert costs["kernel_ms"] == pytest.approx(kernel_us / 2e3, rel=1e-9) and kernel_us > 0
    assert costs["graph_runs_ms"] == pytest.approx(runs_us / 2e3) and costs["step_ms"] == pytest.approx(step_us / 2e3)
    assert costs["kernel_ms"] <= costs["graph_runs_ms"] <= costs["step_ms"]
    p, o = costs["products"], costs["others"]
    assert p["ms"] + o["ms"] == pytest.approx(costs["kernel_ms"]) and p["nodes"] + o["nodes"] == len(nodes)
    assert o["ms_per_call"] == pytest.approx(o["ms"] / o["calls_per_step"])
    assert {n["calls_per_step"] for n in nodes} == {2.0}            # 2 micro-batches a step
    ops = {n["op"] for n in nodes}
    assert {"MatMul", "Gemm"} <= ops and {"Add", "Mul", "Transpose"} <= ops
    for n in nodes:
        if n["op"] in PRODUCTS:
            assert n["flops"] > 0 and 0 < n["gflops_per_s"] < 100 * peak / 1e9, n
            assert n["ms_at_peak"] == pytest.approx(n["flops"] / peak * 1e3), n
        else:
            assert n["flops"] == 0 and n["ms_at_peak"] == 0 and n["overhead_ms"] == n["ms"], n
        assert n["overhead_ms"] == pytest.approx(max(n["ms"] - n["ms_at_peak"], 0.0)) and n["overhead_ms"] >= 0, n
    overheads = [n["overhead_ms"] for n in nodes]
    assert overheads == sorted(overheads, reverse=True)
    assert p["flops_unknown_nodes"] == 0
    # the products' FLOPs, from the shapes onnxruntime ran, are what MFU counts from the forward graph
    # (3 x its products: every product's two gradients), per rank and step; a graph that multiplies more
    # than the model needs (a bias gradient as a product) would move this
    assert p["flops"] * 2 == pytest.approx(summary["model_flops_per_step"], rel=0.02)
    # the text: the same nodes in the same order, then the totals
    out = run([TRAINRUN, "profile", "summarize", profiled, "--top", "4"], check=0).stdout
    section = out.split("per-node cost of the train graph")[1]
    assert "step 4; step 3 left out" in section.splitlines()[0]
    assert f"top 4 of {len(nodes)} nodes by overhead" in section
    rows = section.split(" overhead\n")[1].splitlines()[:4]
    assert [r.split()[0] for r in rows] == [n["name"] if len(n["name"]) <= 56 else "..." + n["name"][-53:]
                                            for n in nodes[:4]]
    assert f"matrix products {p['nodes']:>5} nodes" in section and "everything else" in section
    # traces whose run is gone: no peak (said), times and FLOPs still
    moved = tmp_path / "moved"
    moved.mkdir()
    for r in (0, 1):
        trace = json.load(open(os.path.join(profiled, "traces", f"rank-{r}.json")))
        trace["trainrun"]["output_dir"] = str(tmp_path / "gone")
        json.dump(trace, open(moved / f"rank-{r}.json", "w"))
    rep = json.loads(run([TRAINRUN, "profile", "summarize", str(moved), "--json"], check=0).stdout)["node_costs"]
    assert rep["peak_flops_per_rank"] is None and "no summary.json" in rep["peak_source"]
    assert all(n["overhead_ms"] is None for n in rep["nodes"]) and rep["products"]["flops"] == p["flops"]
    assert "no summary.json" in run([TRAINRUN, "profile", "summarize", str(moved)], check=0).stdout


def test_save_graphs_writes_what_onnxruntime_runs(profiled):
    nodes = {}
    for name in ("train", "eval", "optimizer"):
        optimized = onnx.load(os.path.join(profiled, "debug", "graphs", f"{name}.onnx"))
        original = onnx.load(os.path.join(profiled, "graphs", f"{name}.onnx"))
        nodes[name] = (len(optimized.graph.node), len(original.graph.node))
    # onnxruntime folded constants and shapes away (e.g. the optimizer's Expand of scalars)
    assert nodes["train"][0] < nodes["train"][1] and nodes["optimizer"][0] < nodes["optimizer"][1]
    assert not os.path.exists(os.path.join(profiled, "debug", "graphs", "forward.onnx"))


def test_doctor_passes_on_two_ranks(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset)
    train = os.path.join(byte_dataset, "train")
    proc = run([MPIRUN, "-np", "2", TRAINRUN, "doctor", "--config", cfg, "--size-mb", "4", "--iters", "3",
                "--set", f"data.eval={train}"], check=0, timeout=120)
    out = proc.stdout
    assert "(median of 3)" in out                                                # --iters
    assert any(line.split()[:3] == ["PASS", "data.eval", f"{train}:"] for line in out.splitlines()), out  # --set
    assert out.splitlines()[0].startswith("trainrun doctor: 2 rank(s) on 1 node(s) (")     # training's nodes
    assert out.splitlines()[0].endswith(": rank(s) 0, 1)") and "MPI library: MPICH" in out
    assert not glob.glob(str(tmp_path / "run" / ".doctor-*"))   # the probe file is removed
    assert f"onnxruntime {ort.__version__}" in out and "CPUExecutionProvider" in out
    for check in ("versions", "allreduce", "bandwidth", "config", "run_dir", "data.train", "data.eval", "builder"):
        assert any(line.split()[:2] == ["PASS", check] for line in out.splitlines()), (check, out)
    assert any(line.split()[:2] == ["SKIP", "graphs"] for line in out.splitlines())     # not prepared yet
    # the gradient builder prepare would use (graphs.builder auto), and why
    builder_line = next(line for line in out.splitlines() if line.split()[:2] == ["PASS", "builder"])
    assert ("trainrun's own (graphs.builder: auto, and onnxruntime-training's builder is not available"
            if ort_builder_missing() else
            "onnxruntime-training's (graphs.builder: auto, and onnxruntime-training is installed)") in builder_line
    proc = run([MPIRUN, "-np", "2", TRAINRUN, "doctor", "--config", cfg, "--size-mb", "1", "--iters", "1",
                "--set", "graphs.builder=trainrun"], check=0, timeout=120)
    assert "trainrun's own (graphs.builder: trainrun); same on all 2 rank(s)" in proc.stdout
    assert "GB/s" in out
    assert [line.split()[0] for line in out.splitlines() if "cpu," in line] == ["0", "1"]


def test_doctor_names_the_failing_check(tmp_path, byte_dataset):
    """Two 'hosts' (HOME differs per rank) whose copies of the training data differ by one byte."""
    for home in ("h0", "h1"):
        shutil.copytree(byte_dataset, tmp_path / home / "data")
    shard = sorted(glob.glob(str(tmp_path / "h1" / "data" / "train" / "*.bin")))[0]
    with open(shard, "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 1]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {output_dir: ~/run}\ndata: {train: ~/data/train, eval: ~/data/eval, seq_len: 32}\n")
    args = [TRAINRUN, "doctor", "--config", str(cfg), "--size-mb", "1"]
    proc = run([MPIRUN, "-np", "1", "-env", "HOME", str(tmp_path / "h0"), *args, ":",
                "-np", "1", "-env", "HOME", str(tmp_path / "h1"), *args], check=1, timeout=120)
    assert "doctor: check(s) failed: run_dir, data.train" in proc.stderr
    assert f"{tmp_path / 'h0' / 'run'}: rank(s) 1 (" in proc.stderr     # ~/run is not one shared path
    assert "rank 1 differs from rank 0: different content: shard-" in proc.stderr
    assert any(line.split()[:2] == ["PASS", "data.eval"] for line in proc.stdout.splitlines())


def test_verbose_prints_tracebacks(tmp_path, byte_dataset):
    """run.log_level: verbose in the config file (not only --log-level) shows the traceback of an error."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "run.log_level": "verbose", "optimizer.lr": 1e30, "lr_schedule": {"name": "constant"},
        "train.max_steps": 12, "debug.stats_every": 1})
    proc = run([TRAINRUN, "--config", cfg], check=1)
    assert "Traceback (most recent call last)" in proc.stderr
    assert "8 steps in a row had non-finite gradients" in proc.stderr.splitlines()[-1]
    # the statistics of those steps say where the non-finite values are
    lines = stats_lines(str(tmp_path / "run"), 0)
    assert [x["step"] for x in lines] == list(range(1, 9))       # step 9 raised before its statistics
    first, last = lines[0], lines[-1]
    assert first["scalars"]["loss"] < 10 and all(t["nan"] == t["inf"] == 0 for t in first["tensors"].values())
    assert last["scalars"]["loss"] == "nan" and last["scalars"]["grad_norm"] == "inf"
    grads = [t for n, t in last["tensors"].items() if n.startswith("grad/")]
    assert all(t["nan"] == t["numel"] and t["mean"] is None for t in grads)


def test_pytorch_reference_statistics_match(tmp_path, byte_dataset):
    """scripts/torch_stats.py (transformers GPT-2) writes the same format; compare finds no divergence."""
    pytest.importorskip("transformers")
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{**STATS, "model.gpt2.dropout": 0.0,
                                                             "train.max_steps": 6, "debug.tensors": [
        "logits", "LayerNormalization_*_out0", "transformer.h.*.mlp.act"]})
    mpirun(1, "--config", cfg)
    ref = str(tmp_path / "ref")
    proc = run([sys.executable, os.path.join(ROOT, "scripts", "torch_stats.py"), str(tmp_path / "run"),
                "--output", ref], check=0)
    assert "(8 activations)" in proc.stdout                 # logits, 5 LayerNorms, 2 GELUs
    proc = run([TRAINRUN, "compare", str(tmp_path / "run"), ref, "--rtol", "1e-4"], check=0)
    assert "no divergence" in proc.stdout and "6 common step(s)" in proc.stdout
    # and it is not vacuous: the two differ at float32 rounding level
    proc = run([TRAINRUN, "compare", str(tmp_path / "run"), ref, "--rtol", "0"], check=1)
    assert "first divergence: step 1" in proc.stdout


def test_moments_merge_exactly_and_count_non_finite_values():
    """The statistics of a step's micro-batches merged = those of the whole batch; NaN/Inf counted apart."""
    from trainrun.observe.stats import Moments, summarize
    x = np.random.default_rng(0).standard_normal(3_000_003).astype(np.float32) * 3 + 1
    x[[5, 70, 2_000_000]] = [np.nan, np.inf, -np.inf]
    finite = x[np.isfinite(x)].astype(np.float64)
    whole = summarize(x)
    assert (whole["numel"], whole["nan"], whole["inf"]) == (x.size, 1, 2)
    np.testing.assert_allclose([whole[k] for k in ("min", "max", "mean", "std", "norm")],
                               [finite.min(), finite.max(), finite.mean(), finite.std(), np.linalg.norm(finite)],
                               rtol=1e-12)
    parts = Moments.of(x[:1000]).merge(Moments.of(x[1000:2_500_000])).merge(Moments.of(x[2_500_000:]))
    merged = parts.summary()
    assert merged.keys() == whole.keys()
    np.testing.assert_allclose([merged[k] for k in whole], [whole[k] for k in whole], rtol=1e-12)
    big = summarize(np.array([3e38, -3e38], np.float32))         # float32 extremes: no overflow
    assert big["std"] == pytest.approx(3e38, rel=1e-6) and big["mean"] == 0.0
    assert summarize(np.full(4, np.nan, np.float32))["mean"] is None


def gpt2_forward_flops(shape: dict, batch: int, seq: int) -> int:
    """GPT-2's forward matrix-product FLOPs, counted by hand: per token and layer the q/k/v, projection and
    MLP products (12 d^2 multiply-adds) and attention's two products over the whole sequence (2 T d), the
    tied LM head (V d) once; 2 FLOPs a multiply-add."""
    L, d, V = shape["n_layer"], shape["n_embd"], shape["vocab_size"]
    return 2 * batch * seq * (L * (12 * d * d + 2 * seq * d) + V * d)


def test_mfu_in_log_lines_and_summary(twin_runs):
    """MFU: the model FLOPs of a step are GPT-2's own count (3 x forward, every rank's micro-batch), the
    peak is both ranks' measured one, and the log lines, metrics.jsonl and summary.json carry it."""
    run_dir, proc, cfg_path = twin_runs["a"]
    cfg = C.load_config(cfg_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    shape = {"n_layer": cfg.model.gpt2.n_layer, "n_embd": cfg.model.gpt2.n_embd,
             "vocab_size": cfg.model.gpt2.vocab_size}
    expected = 3 * gpt2_forward_flops(shape, cfg.train.micro_batch_size, cfg.data.seq_len) * 2   # 2 ranks
    assert summary["model_flops_per_step"] == expected, (summary, expected)
    assert summary["peak_flops"] > 1e8, summary            # two ranks' measured MatMul peak
    whole = summary["model_flops_per_step"] * summary["steps"] / summary["time_s"] / summary["peak_flops"]
    assert summary["mfu"] == pytest.approx(whole, rel=0.01)     # time_s is rounded to the ms
    train, _ = read_metrics(run_dir)
    assert all(0 < r["mfu"] for r in train.values()), train
    _, proc_b, _ = twin_runs["b"]       # info and above print the line: "| mfu 12.3% |"
    assert "| mfu " in proc_b.stdout and "%" in proc_b.stdout.split("| mfu ")[1].split("|")[0]


def test_flops_of_convolutions_and_products():
    """The forward FLOPs of Conv (groups, strides), ConvTranspose, Gemm (transposed A) and a batched MatMul
    against the multiply-adds counted from each op's definition; the backward's: a product once more for
    each operand the gradient flows to (computed from a trained weight: data and frozen weights have none)."""
    from onnx import TensorProto, helper
    from trainrun.observe.flops import backward_flops
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1], group=2),
             helper.make_node("ConvTranspose", ["c", "wt"], ["t"], strides=[2, 2]),
             helper.make_node("Flatten", ["t"], ["f"]),
             helper.make_node("Gemm", ["ft", "g"], ["y"], transA=1),
             helper.make_node("MatMul", ["p", "q"], ["z"])]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, ["b", 4, 9, 9]),
                                           vi("ft", TensorProto.FLOAT, [5, 3]),
                                           vi("p", TensorProto.FLOAT, ["b", 3, 7, 6]),
                                           vi("q", TensorProto.FLOAT, [6, 8])],
                              [vi("y", TensorProto.FLOAT, None), vi("z", TensorProto.FLOAT, None),
                               vi("f", TensorProto.FLOAT, None)],
                              [helper.make_tensor(n, TensorProto.FLOAT, dims, [0.0] * int(np.prod(dims)))
                               for n, dims in (("w", [6, 2, 3, 3]), ("wt", [6, 3, 2, 2]), ("g", [5, 10]))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    b = 2
    conv = 2 * (b * 6 * 5 * 5) * (2 * 3 * 3)              # output [2, 6, 5, 5], 2 input channels a group
    convt = 2 * (b * 6 * 5 * 5) * (3 * 2 * 2)             # each input element through 3 x 2 x 2 weights
    gemm = 2 * (3 * 10) * 5                               # A^T [3, 5] @ [5, 10]
    matmul = 2 * (b * 3 * 7 * 8) * 6
    shapes = {"x": (b, 4, 9, 9), "p": (b, 3, 7, 6)}
    assert backward_flops(model, shapes, ()) == conv + convt + gemm + matmul        # nothing trained: forward
    # every weight trained: the data operands x, ft and p get no gradient; c does (computed from w)
    assert backward_flops(model, shapes, {"w", "wt", "g", "q"}) == 2 * conv + 3 * convt + 2 * gemm + 2 * matmul
    # w and q trained, wt and g frozen (LoRA's base): c still gets its gradient, wt and g none
    assert backward_flops(model, shapes, {"w", "q"}) == 2 * conv + 2 * convt + gemm + 2 * matmul
    assert backward_flops(model, {}, {"w"}) is None     # batch dims unknown: no count, no MFU


@pytest.mark.parametrize("trans_a, batch_a", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_fused_matmul_flops_with_and_without_its_attributes(trans_a, batch_a):
    """A FusedMatMul's contracted dim, from its attributes or (a node onnxruntime fused, seen in a profile)
    from its shapes alone, for every layout of A and B: onnxruntime's own kernel gives the output's shape."""
    from onnx import TensorProto, helper
    from trainrun.observe.flops import product_flops
    b1, b2, m, k, n = 2, 3, 4, 5, 6                      # all different: a wrong dim shows
    shape_a = {(0, 0): [b1, b2, m, k], (1, 0): [b1, b2, k, m], (0, 1): [m, b1, b2, k], (1, 1): [k, b1, b2, m]}
    shape_b = {(0, 0): [b1, b2, k, n], (1, 0): [b1, b2, n, k], (0, 1): [k, b1, b2, n], (1, 1): [n, b1, b2, k]}
    for (trans_b, batch_b), sb in shape_b.items():
        attrs = {"transA": trans_a, "transBatchA": batch_a, "transB": trans_b, "transBatchB": batch_b}
        sa = shape_a[trans_a, batch_a]
        vi = helper.make_tensor_value_info
        graph = helper.make_graph([helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft",
                                                    **attrs)], "g",
                                  [vi("a", TensorProto.FLOAT, sa), vi("b", TensorProto.FLOAT, sb)],
                                  [vi("y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 9
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        out = list(sess.run(None, {"a": np.ones(sa, np.float32), "b": np.ones(sb, np.float32)})[0].shape)
        assert out == [b1, b2, m, n], attrs
        want = 2 * b1 * b2 * m * n * k
        assert product_flops("FusedMatMul", [sa, sb], out, attrs) == want, attrs
        assert product_flops("FusedMatMul", [sa, sb], out, None) == want, attrs
    assert product_flops("Gemm", [[k, m], [k, n]], [m, n], None) == 2 * m * n * k      # transA, from the shapes
    assert product_flops("Add", [[m, n], [n]], [m, n], None) == 0


def test_a_writer_taking_over_drops_the_lost_writers_cut_line_and_writes_its_own_event_file(tmp_path):
    """distributed.elastic, rank 0 lost: the survivor that takes over the writing (Metrics.take_over) removes the
    line the lost writer left cut short (the lines before it stand), appends its own, and writes TensorBoard to
    an event file of its own beside the lost writer's; before it takes over it writes nothing."""
    from tensorboardX.event_file_writer import EventsWriter
    from trainrun.observe.metrics import Metrics
    (tmp_path / "tensorboard").mkdir()
    lost = EventsWriter(str(tmp_path / "tensorboard" / "events"))
    lost.close()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n{"step": 3, "lo')
    values = {"loss": 2.25, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 100.0}
    m = Metrics(str(tmp_path), enabled=False, tensorboard=True, quiet=True, total_steps=5)
    m.log(3, values)
    assert (tmp_path / "metrics.jsonl").read_text().endswith('"lo')
    m.take_over(str(tmp_path), 3, tensorboard=True)
    m.log(4, values)
    m.close()
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 4] and lines[-1]["loss"] == 2.25
    files = os.listdir(tmp_path / "tensorboard")
    mine = [f for f in files if f.endswith(f".{os.getpid()}")]
    assert len(files) == 2 and len(mine) == 1       # the lost writer's file untouched (its header alone)
    size = {f: os.path.getsize(tmp_path / "tensorboard" / f) for f in files}
    assert size[mine[0]] > 2 * min(size.values())   # the new writer's: a header and step 4's scalars
