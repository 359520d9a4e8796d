"""distributed.sync: diloco on real `mpirun` ranks: replicas of one rank each (group 1), so no pretend cluster
is needed; the pretend cluster's test is in test_cluster.py."""

import glob
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import mpirun, mpirun_probe, read_metrics, write_config


def _weights(path):
    return np.concatenate([t.ravel() for _, t in sorted(load_file(path).items())])


def _checkpoint_weights(run_dir, step):
    return _weights(os.path.join(run_dir, "checkpoints", str(step), "model.safetensors"))


def test_one_inner_step_outer_lr_one_equals_every_step_data_parallel(tmp_path, byte_dataset):
    """Inner SGD, inner_steps 1, outer lr 1, momentum 0: each replica steps w - lr g_j, the outer step sets
    w - mean_j(lr g_j): every-step data parallel's SGD step. Equal to float32 rounding: the two paths round
    at different points (the replica's step, the mean of the outer gradients and the outer step against the
    sum of the gradients and one step), each rounding within 2^-24 of the weights' scale (about 1: a
    LayerNorm's weight), so a step adds at most 2 eps = 2^-22 of it (measured: 1.2e-7 after step 1, 2.4e-7 by
    step 6; the relative difference of the whole weight vectors 4e-8 after step 1, 1.0e-7 after 6)."""
    common = {"train.max_steps": 6, "checkpoint.every": 1, "checkpoint.keep_last": 100,
              "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.0, "max_grad_norm": 0.0, "weight_decay": 0.0}}
    runs = {}
    for name, extra in [("every_step", {}),
                        ("diloco", {"distributed.sync": "diloco",
                                    "distributed.diloco": {"inner_steps": 1, "group": 1,
                                                           "outer": {"lr": 1.0, "momentum": 0.0,
                                                                     "nesterov": False}}})]:
        d = tmp_path / name
        d.mkdir()
        said = mpirun(2, "--config", write_config(d / "c.yaml", byte_dataset, **common, **extra)).stdout
        runs[name] = str(d / "run")
        # DiLoCo from the initial weights, each outer step waiting for the exchange: the start-up advice says
        # both, in one line; every-step training has none
        advice = [line for line in said.splitlines() if "advice" in line]
        assert len(advice) == (name == "diloco"), said
        if advice:
            assert "from the initial weights DiLoCo" in advice[0] and "each outer step waits for the whole model" \
                in advice[0] and "`trainrun resume RUN --force --set distributed.sync=diloco`" in advice[0], advice
    start = _weights(os.path.join(runs["diloco"], "graphs", "weights.safetensors"))
    for step in range(1, 7):
        ref, got = _checkpoint_weights(runs["every_step"], step), _checkpoint_weights(runs["diloco"], step)
        assert np.abs(ref - start).max() > 1e-4            # the weights did move
        scale = max(1.0, np.abs(ref).max())
        assert np.abs(got - ref).max() <= 2 * np.finfo(np.float32).eps * scale * step, step
        assert np.linalg.norm(got - ref) <= 1e-7 * step * np.linalg.norm(ref), step
    ref_train, _ = read_metrics(runs["every_step"])
    got_train, _ = read_metrics(runs["diloco"])
    np.testing.assert_allclose([got_train[s]["loss"] for s in range(1, 7)],
                               [ref_train[s]["loss"] for s in range(1, 7)], rtol=1e-6)


def test_diloco_starts_from_an_every_step_checkpoint(tmp_path, byte_dataset):
    """``resume --force --set distributed.sync=diloco`` of an every-step run's checkpoint: the replicas start
    from its weights (the round's global weights) and inner optimizer state, the outer momentum zero. With
    inner SGD, inner_steps 1, outer lr 1 and momentum 0 the continued run is every-step training's own steps
    (to float32 rounding, as in the test above); its checkpoints then hold the outer state."""
    from conftest import MPIRUN, TRAINRUN, run
    sgd = {"name": "sgd", "lr": 0.2, "momentum": 0.0, "max_grad_norm": 0.0, "weight_decay": 0.0}
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 6, "checkpoint.every": 1,
                                                              "checkpoint.keep_last": 100, "optimizer": sgd})
    mpirun(2, "--config", cfg)
    every = str(tmp_path / "run")
    got_dir = str(tmp_path / "diloco")
    mpirun(2, "--config", cfg, "--set", "train.max_steps=3", "--set", "run.output_dir=" + got_dir)
    sets = ["train.max_steps=6", "distributed.sync=diloco", "distributed.diloco.group=1",
            "distributed.diloco.inner_steps=1", "distributed.diloco.outer.lr=1", "distributed.diloco.outer.momentum=0",
            "distributed.diloco.outer.nesterov=false"]
    args = [MPIRUN, "-np", "2", TRAINRUN, "resume", got_dir, *[a for s in sets for a in ("--set", s)]]
    proc = run(args, check=2)       # a change of the synchronisation is not the same run: --force
    assert "distributed.sync: 'every_step' -> 'diloco'" in proc.stderr, proc.stderr
    proc = run(args + ["--force"])
    assert "resumed from" in proc.stdout and "diloco: 2 replicas of 1 rank(s)" in proc.stdout, proc.stdout
    # warm-started as the measurements advise: the advice is about the blocking exchange alone
    assert "each outer step waits for the whole model" in proc.stdout, proc.stdout
    assert "from the initial weights" not in proc.stdout, proc.stdout
    for step in range(4, 7):
        ref, got = _checkpoint_weights(every, step), _checkpoint_weights(got_dir, step)
        assert np.abs(ref - _checkpoint_weights(every, 3)).max() > 1e-5
        scale = max(1.0, np.abs(ref).max())
        assert np.abs(got - ref).max() <= 2 * np.finfo(np.float32).eps * scale * step, step
        saved = json.loads(open(os.path.join(got_dir, "checkpoints", str(step), "state.json")).read())
        assert saved["diloco"]["round_start"] == step and saved["diloco"]["replicas"] == 2
    outer = load_file(os.path.join(got_dir, "checkpoints", "6", "optimizer.safetensors"))
    assert any(k.startswith("outer_weights/") for k in outer) and any(k.startswith("outer_momentum/") for k in outer)


def test_every_step_resumes_a_mid_round_checkpoint_from_its_global_weights(tmp_path, byte_dataset):
    """``resume --force --set distributed.sync=every_step`` of a DiLoCo checkpoint taken mid-round (stop_at 4,
    in the round 3..6): the resumed run's first step starts from the checkpoint's global weights (its
    optimizer.safetensors ``outer_weights/``, what export and evaluate read), not from its parameters (replica
    0's), on every rank; the outer state it drops is said in one short line, not listed tensor by tensor."""
    from conftest import mpirun_probe
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 8, "train.stop_at": 4, "train.micro_batch_size": 2, "distributed.sync": "diloco",
        "distributed.diloco": {"inner_steps": 3, "group": 1}})
    mpirun(2, "--config", cfg)
    run_dir = str(tmp_path / "run")
    ckpt = os.path.join(run_dir, "checkpoints", "4")
    assert json.load(open(os.path.join(ckpt, "state.json")))["diloco"]["mid_round"] is True
    rec = tmp_path / "first"
    rec.mkdir()
    proc = mpirun_probe(2, "resume", run_dir, "--force", "--set", "distributed.sync=every_step", env={"TRAINRUN_PROBE_FIRST_DIR": str(rec)})
    names = [p["name"] for p in json.load(open(os.path.join(run_dir, "graphs", "manifest.json")))["params"]]
    outer = load_file(os.path.join(ckpt, "optimizer.safetensors"))
    replica0 = load_file(os.path.join(ckpt, "model.safetensors"))
    global_weights = np.concatenate([outer["outer_weights/" + n].ravel() for n in names])
    assert not np.array_equal(global_weights, np.concatenate([replica0[n].ravel() for n in names]))
    for r in range(2):
        assert np.array_equal(np.load(rec / f"rank{r}_first.npy"), global_weights), r
    said = [line for line in proc.stderr.splitlines() if "DiLoCo" in line or "outer_" in line or "dropped" in line]
    assert len(said) == 1 and len(said[0]) < 300, said
    assert "continues from its global weights" in said[0], said


def test_the_defaults_are_those_docs_distributed_md_shows():
    """docs/distributed.md shows distributed.diloco's keys at their defaults: the schema's (the outer step the
    measured best, lr 1 without momentum; the exchange waited for unless streamed)."""
    import dataclasses
    import re

    import yaml
    from conftest import ROOT
    from trainrun import config as C
    text = open(os.path.join(ROOT, "docs", "distributed.md")).read()
    section = text.split("(`distributed.sync: diloco`)", 1)[1]
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))["distributed"]["diloco"]
    defaults = dataclasses.asdict(C.from_dict({}).distributed.diloco)
    assert shown == defaults
    assert defaults["outer"] == {"lr": 1.0, "momentum": 0.0, "nesterov": False}


def _reference_outer(start, replicas_by_step, lr, mu, nesterov):
    """DiLoCo's outer step in NumPy (float64), torch.optim.SGD's momentum (dampening 0): the global weights
    after each outer step, from the replicas' weights before it."""
    weights, buf, out = start.astype(np.float64), None, {}
    for step in sorted(replicas_by_step):
        g = np.mean([weights - w.astype(np.float64) for w in replicas_by_step[step]], axis=0)
        if mu:
            buf = g.copy() if buf is None else mu * buf + g
            g = g + mu * buf if nesterov else buf
        weights = weights - lr * g
        out[step] = weights
    return out


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_steps_match_a_numpy_reference(tmp_path, byte_dataset, nesterov):
    """Three replicas, outer SGD with momentum 0.9 (Nesterov or not), inner AdamW, an outer step every 2 steps
    and at the last (step 7, a round of one step): each rank records its replica's weights before every
    outer step and the new weights after it (tests/rank_probe.py); the new weights are the reference's, from
    the recorded replicas, to float32 rounding (momentum sums 4 rounds: 1e-6 of the weights' scale), equal on
    every replica, and the run's final weights. Evaluations run on the global weights: between two outer
    steps the eval loss does not move."""
    rec = tmp_path / "outer"
    rec.mkdir()
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 7, "train.eval_every": 1, "train.micro_batch_size": 2,
        "distributed.sync": "diloco",
        "distributed.diloco": {"inner_steps": 2, "group": 1,
                               "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": nesterov}}})
    mpirun_probe(3, "--config", cfg, env={"TRAINRUN_PROBE_OUTER_DIR": str(rec)})
    steps = sorted({int(os.path.basename(p).split("_step")[1].split("_")[0]) for p in glob.glob(str(rec / "*.npy"))})
    assert steps == [2, 4, 6, 7]
    run_dir = str(tmp_path / "run")
    start = _weights(os.path.join(run_dir, "graphs", "weights.safetensors"))
    before = {s: [np.load(rec / f"rank{r}_step{s}_before.npy") for r in range(3)] for s in steps}
    after = {s: [np.load(rec / f"rank{r}_step{s}_after.npy") for r in range(3)] for s in steps}
    # the flat buffer's order is the manifest's, the safetensors' sorted: compare in the flat order
    import json
    names = [p["name"] for p in json.load(open(os.path.join(run_dir, "graphs", "manifest.json")))["params"]]
    init = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
    start = np.concatenate([init[n].ravel() for n in names])
    ref = _reference_outer(start, before, 0.7, 0.9, nesterov)
    scale = np.abs(start).max()
    for s in steps:
        assert not np.array_equal(before[s][0], before[s][1])          # the replicas trained apart
        for r in range(3):
            assert np.array_equal(after[s][r], after[s][0])           # every replica takes the new weights
        assert np.abs(after[s][0] - ref[s]).max() <= 1e-6 * scale, s
    final = load_file(os.path.join(run_dir, "checkpoints", "7", "model.safetensors"))
    assert np.array_equal(np.concatenate([final[n].ravel() for n in names]), after[7][0])
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "outer_bytes" in r]
    assert [r["step"] for r in rows] == steps
    n = start.size
    for row in rows:        # fp32 over 3 replicas: reduce-scatter + allgather, (P-1)/P of the buffer each
        assert row["outer_bytes"] == 2 * 4 * n * 2 // 3
        assert row["outer_wait_s"] >= 0 and 0 < row["outer_drift"] < 1
    _, evals = read_metrics(run_dir)
    assert evals[3]["eval_loss"] == evals[2]["eval_loss"] and evals[5]["eval_loss"] == evals[4]["eval_loss"]
    assert evals[4]["eval_loss"] != evals[3]["eval_loss"]


def test_kill_and_resume_mid_round_is_the_undisturbed_run(tmp_path, byte_dataset):
    """bf16 outer gradients on the wire, Nesterov, an outer step every 3 steps: the job killed (SIGKILL to the
    launcher's processes) while step 10's checkpoint is written, so the last committed one is step 5's
    (mid-round: each replica's own weights, the outer state, the round's start), and resumed gives the
    losses, evaluations, outer-step logs and final weights of the run nobody stopped, bit for bit. A resume
    onto 4 replicas is refused naming the key."""
    import json
    import signal
    import subprocess
    import time

    from conftest import MPIRUN, TRAINRUN, run
    common = {"train.max_steps": 12, "train.eval_every": 4, "checkpoint.every": 5,
              "distributed.sync": "diloco",
              "distributed.diloco": {"inner_steps": 3, "group": 1, "outer_dtype": "bf16",
                                     "outer": {"lr": 0.5, "momentum": 0.8, "nesterov": True}}}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    mpirun(2, "--config", write_config(straight / "c.yaml", byte_dataset, **common))
    cfg = write_config(killed / "c.yaml", byte_dataset, **common)
    proc = subprocess.Popen([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, TRAINRUN_FAULT_STALL_CHECKPOINT="10"))
    ck = killed / "run" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (ck / ".staging-10" / "model.safetensors").exists():
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert (ck / "5" / "COMMITTED").exists() and not (ck / "10").exists()
    state = json.load(open(killed / "run" / "checkpoints" / "5" / "state.json"))
    assert state["diloco"] == {"round_start": 3, "replicas": 2, "group": 1, "rounds": 1, "mid_round": True,
                               "in_flight": None}
    assert {"outer_weights", "outer_momentum", "replica1_weights", "replica1_exp_avg", "replica1_exp_avg_sq"} <= set(
        state["optimizer_states"])
    refused = run([MPIRUN, "-np", "4", TRAINRUN, "resume", str(killed / "run"), "--set",
                   "train.micro_batch_size=2"], check=2)
    assert "distributed.diloco.group" in refused.stderr and "saved by 2 replicas" in refused.stderr, refused.stderr
    mpirun(2, "resume", str(killed / "run"))
    rows = {}
    for name, d in (("straight", straight), ("killed", killed)):
        lines = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
        rows[name] = [{k: v for k, v in r.items() if k not in ("elapsed_s", "phase_ms", "samples_per_sec",
                                                               "tokens_per_sec", "mfu", "outer_wait_s", "outer_s")}
                      for r in lines]
    assert rows["killed"] == rows["straight"]
    assert [r["step"] for r in rows["straight"] if "outer_bytes" in r] == [3, 6, 9, 12]
    assert [r["step"] for r in rows["straight"] if "eval_loss" in r] == [4, 8, 12]
    final = [open(d / "run" / "checkpoints" / "12" / "model.safetensors", "rb").read() for d in (straight, killed)]
    assert final[0] == final[1]


def _assert_exports_global_weights(run_dir, step, exported, eval_data, tmp_path):
    """Checkpoint ``step`` was taken mid-round: its parameters are replica 0's, its optimizer.safetensors'
    ``outer_weights/`` the global weights the run evaluates. ``exported`` (the run's model.onnx, written at
    that step) and an offline ``trainrun export`` of the checkpoint give the eval graph's logits on the global
    weights (to float32 rounding: 1e-5), not on replica 0's; ``trainrun evaluate`` of the checkpoint gives the
    eval loss the run logged at that step (the same samples: eval_steps batches of micro_batch_size x 4); the
    transformers export holds them too."""
    import json

    import onnxruntime as ort

    from conftest import TRAINRUN, run
    ckpt = os.path.join(run_dir, "checkpoints", str(step))
    assert json.load(open(os.path.join(ckpt, "state.json")))["diloco"]["mid_round"] is True
    replica0 = load_file(os.path.join(ckpt, "model.safetensors"))
    outer = {k.split("/", 1)[1]: v for k, v in load_file(os.path.join(ckpt, "optimizer.safetensors")).items()
             if k.startswith("outer_weights/")}
    assert outer.keys() == replica0.keys()
    assert max(np.abs(outer[n] - replica0[n]).max() for n in outer) > 1e-3     # the replica moved in the round
    ids = np.random.default_rng(0).integers(0, 512, (2, 32)).astype(np.int64)
    eval_graph = ort.InferenceSession(os.path.join(run_dir, "graphs", "eval.onnx"), providers=["CPUExecutionProvider"])
    feeds = {i.name: ids for i in eval_graph.get_inputs() if i.name in ("input_ids", "labels")}

    def logits_of(weights):
        return eval_graph.run(["logits"], {**feeds, **weights})[0]

    want, replica = logits_of(outer), logits_of(replica0)
    assert np.abs(want - replica).max() > 1e-3
    offline = str(tmp_path / f"step{step}.onnx")
    out = run([TRAINRUN, "export", ckpt, "--output", offline]).stdout
    assert "DiLoCo's global weights (checkpoint taken mid-round; its parameters are replica 0's)" in out, out
    folder = str(tmp_path / f"step{step}-hf")
    out = run([TRAINRUN, "export", ckpt, "--format", "transformers", "--output", folder]).stdout
    assert "DiLoCo's global weights (checkpoint taken mid-round; its parameters are replica 0's)" in out, out
    hf = load_file(os.path.join(folder, "model.safetensors"))
    assert hf.keys() >= outer.keys() and all(np.array_equal(hf[n], outer[n]) for n in outer)
    for path in (exported, offline):
        got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["logits"], {"input_ids": ids})[0]
        assert np.abs(got - want).max() <= 1e-5, path
    _, evals = read_metrics(run_dir)
    res = str(tmp_path / f"eval{step}.json")
    run([TRAINRUN, "evaluate", ckpt, "--data", eval_data, "--steps", "2", "--batch", "8", "--output", res])
    assert json.load(open(res))["loss"] == pytest.approx(evals[step]["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("layout", ["node_shared", "zero1"])
def test_replicas_of_two_ranks_stop_and_resume_exactly(tmp_path, byte_dataset, layout):
    """4 ranks as 2 replicas of 2: each a pretend node whose ranks share the parameters (group 0: the node;
    each rank keeps the outer state of its slice), or 2 ranks on nodes of their own with ZeRO-1 between them
    (group 2; each rank its ZeRO part). Stopped mid-round (train.stop_at 4, in the round 3..6) and resumed: the
    losses, evaluations and final weights of the straight run, bit for bit; the outer step sends this rank's
    part of the model only (fp32: 2 x (P-1)/P of it, P = 2 replicas). The stop's checkpoint, mid-round,
    exports the global weights, the stored parts of every rank reassembled (:func:`_assert_exports_global_weights`)."""
    import json
    per_node, extra = {"node_shared": ("2", {}),
                       "zero1": ("1", {"distributed.zero_stage": 1, "distributed.diloco.group": 2})}[layout]
    env = {"TRAINRUN_RANKS_PER_NODE": per_node}
    common = {"train.max_steps": 8, "train.micro_batch_size": 2, "train.eval_every": 4, "checkpoint.every": 4,
              "distributed.sync": "diloco", "distributed.diloco.inner_steps": 3, **extra}
    straight, split = tmp_path / "straight", tmp_path / "split"
    for d, more in ((straight, {}), (split, {"train.stop_at": 4})):
        d.mkdir()
        proc = mpirun(4, "--config", write_config(d / "c.yaml", byte_dataset, **common, **more), env=env)
    assert "diloco: 2 replicas of 2 rank(s)" in proc.stdout
    assert "DiLoCo's global weights" in proc.stdout, proc.stdout        # model.onnx at the stop, mid-round
    _assert_exports_global_weights(str(split / "run"), 4, str(split / "run" / "model.onnx"),
                                   os.path.join(byte_dataset, "eval"), tmp_path)
    mpirun(4, "resume", str(split / "run"), env=env)
    rows = {}
    for d in (straight, split):
        lines = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
        rows[d] = [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "eval_loss", "outer_drift",
                                                        "outer_bytes")} for r in lines]
    assert rows[split] == rows[straight]
    n = sum(t.size for t in load_file(str(straight / "run" / "graphs" / "weights.safetensors")).values())
    part = [r["outer_bytes"] for r in rows[straight] if "outer_bytes" in r]
    assert len(part) == 3 and all(abs(b - 4 * n // 2) <= 8 for b in part), (part, n)
    final = [open(d / "run" / "checkpoints" / "8" / "model.safetensors", "rb").read() for d in (straight, split)]
    assert final[0] == final[1]


def test_refusals_name_the_key(tmp_path, byte_dataset):
    """Exit 2 naming the key: keys against each other (config validate), the model's tensors, one replica at
    launch (2 ranks, group 2), one rank."""
    from conftest import TRAINRUN, run
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"distributed.sync": "diloco",
                                                              "distributed.diloco.group": 1})
    cases = [
        (["distributed.diloco.outer.nesterov=true"], "distributed.diloco.outer.nesterov: needs "
                                                  "distributed.diloco.outer.momentum > 0"),
        (["distributed.diloco.inner_steps=4", "distributed.diloco.overlap_steps=2", "distributed.diloco.fragments=2"],
         "distributed.diloco.overlap_steps: 2 must be less than distributed.diloco.inner_steps / fragments (4 / 2)"),
        (["distributed.diloco.inner_steps=4", "distributed.diloco.fragments=5"],
         "distributed.diloco.fragments: 5 fragments take their turns within a round of distributed.diloco."
         "inner_steps (4) steps: at most that many"),
        (["distributed.diloco.overlap_steps=1"], "distributed.diloco.overlap_steps: overlaps the exchange of one "
                                                 "fragment"),
        (["distributed.diloco.inner_steps=2000", "distributed.diloco.fragments=1000"],
         "distributed.diloco.fragments: 1000 fragments of whole tensors, but the model has 28 parameter tensors"),
        (["device=cuda"], "distributed.sync: diloco runs on the CPU over MPI"),
    ]
    for sets, message in cases:
        args = [a for s in sets for a in ("--set", s)]
        proc = run([TRAINRUN, "config", "validate", "--config", cfg, *args], check=2)
        assert message in proc.stderr, (sets, proc.stderr)
    proc = mpirun(2, "--config", cfg, "--set", "distributed.diloco.group=2", check=2)
    assert "distributed.diloco.group: 2 gives one replica of 2 rank(s) on 2 rank(s)" in proc.stderr, proc.stderr
    proc = run([TRAINRUN, "--config", cfg], check=2)
    assert "distributed.sync: diloco needs several replicas; this run has 1 rank(s)" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_doctor_estimates_the_inner_steps_a_link_needs(tmp_path, byte_dataset):
    """`trainrun doctor` with a diloco config on 2 pretend nodes: one outer gradient's bytes (fp32, and half
    with bf16) at the inter-node allreduce's measured rate against an inner step's computation (the phases
    of the run directory's last metrics line): the inner steps that keep the link under 5% of the time. On
    one node there is no link to estimate for."""
    import math
    import re

    from conftest import MPIRUN, TRAINRUN, run
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 3})
    mpirun(2, "--config", cfg)
    n = sum(t.size for t in load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors")).values())
    doctor = [MPIRUN, "-np", "2", TRAINRUN, "doctor", "--config", cfg, "--size-mb", "1", "--iters", "2",
              "--set", "distributed.sync=diloco"]
    for dtype, nbytes in (("fp32", 4 * n), ("bf16", 2 * n)):
        out = run(doctor + ["--set", f"distributed.diloco.outer_dtype={dtype}"], check=0,
                  env={"TRAINRUN_RANKS_PER_NODE": "1"}).stdout
        line = next(line for line in out.splitlines() if line.split()[:2] == ["PASS", "diloco"])
        assert f"an outer gradient of {n:,} parameters ({dtype}: {nbytes:,} bytes)" in line, line
        found = re.search(r"takes ~([\d.]+) ms .* computes ~([\d.]+) ms .*inner_steps >= (\d+) ", line)
        assert found, line
        link, step, need = found.groups()
        link, step, need = float(link), float(step), int(need)
        assert max(1, math.ceil((link - 0.05) / (0.05 * (step + 0.05)))) <= need \
            <= max(1, math.ceil((link + 0.05) / (0.05 * (step - 0.05)))), line
    out = run(doctor, check=0).stdout
    assert "SKIP  diloco      one node: no link between nodes to estimate for" in out, out


@pytest.mark.parametrize("overlap", [0, 1])
def test_streaming_fragments_match_a_numpy_reference(tmp_path, byte_dataset, overlap):
    """fragments 2 of whole tensors (trainrun.sync.diloco.fragments), inner_steps 4: fragment 0's outer step 2
    steps into each round, fragment 1's at its end, the run's last step (11) all of it. With overlap_steps 1
    each exchange starts at its step and is applied one step later: the fragment's new global weights plus
    what the replica learned meanwhile. Each rank records its weights around every step's call; a NumPy
    reference of the algorithm from the recorded replicas gives every step's new weights to float32
    rounding (1e-6 of the weights' scale), on both replicas; the log has one line per exchange, its drift the
    reference's (the replicas' outer gradients sent against the fragment's global weights)."""
    import json
    from trainrun.sync.diloco import fragments
    rec = tmp_path / "outer"
    rec.mkdir()
    k = {"inner_steps": 4, "group": 1, "fragments": 2, "overlap_steps": overlap,
         "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 11, "train.micro_batch_size": 2,
                                                             "distributed.sync": "diloco", "distributed.diloco": k})
    said = mpirun_probe(2, "--config", cfg, env={"TRAINRUN_PROBE_OUTER_DIR": str(rec),
                                                 "TRAINRUN_PROBE_OUTER_ALL": "1"}).stdout
    # the start-up advice: from the initial weights; a fragment's exchange waited for only without the overlap
    assert "from the initial weights DiLoCo" in said, said
    assert ("each outer step waits for a fragment" in said) == (not overlap), said
    run_dir = str(tmp_path / "run")
    manifest = json.load(open(os.path.join(run_dir, "graphs", "manifest.json")))["params"]
    init = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
    start = np.concatenate([init[p["name"]].ravel() for p in manifest]).astype(np.float64)
    sizes = [int(np.prod(p["shape"])) for p in manifest]
    frags = fragments(list(np.cumsum([0] + sizes[:-1])), sum(sizes), 2)
    assert len(frags) == 2 and 0 < frags[0][1] < sum(sizes)
    before = {s: [np.load(rec / f"rank{r}_step{s}_before.npy") for r in range(2)] for s in range(1, 12)}
    after = {s: [np.load(rec / f"rank{r}_step{s}_after.npy") for r in range(2)] for s in range(1, 12)}
    weights, momentum, sent, drifts = start.copy(), np.zeros_like(start), {}, {}

    def drift(own, w):          # root mean square over replicas of ||replica - global|| / ||global||
        return np.sqrt(np.mean([np.sum(d * d) for d in own]) / np.sum(w * w))

    def outer(a, b, g):
        momentum[a:b] = 0.9 * momentum[a:b] + g
        weights[a:b] -= 0.7 * (g + 0.9 * momentum[a:b])

    for step in range(1, 12):
        mine = [w.astype(np.float64) for w in before[step]]
        due = [f for f, o in enumerate((2, 0)) if step % 4 == o]
        if overlap and step - 1 in sent and step < 11 + 1:          # apply the exchange started a step ago
            (a, b), own = sent.pop(step - 1)
            old = weights[a:b].copy()
            outer(a, b, np.mean([d for d in own], axis=0))
            for r in range(2):
                mine[r][a:b] += own[r] - old + weights[a:b]
        if step == 11:
            own = [weights - m for m in mine]
            drifts[step] = drift(own, weights)
            outer(0, len(start), np.mean(own, axis=0))
            mine = [weights.copy() for _ in mine]
        elif due and overlap:
            a, b = frags[due[0]]
            sent[step] = ((a, b), [weights[a:b] - m[a:b] for m in mine])
            drifts[step + 1] = drift(sent[step][1], weights[a:b])
        elif due:
            a, b = frags[due[0]]
            own = [weights[a:b] - m[a:b] for m in mine]
            drifts[step] = drift(own, weights[a:b])
            outer(a, b, np.mean(own, axis=0))
            for m in mine:
                m[a:b] = weights[a:b]
        for r in range(2):
            assert np.abs(after[step][r] - mine[r]).max() <= 1e-6 * np.abs(start).max(), (step, r)
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "outer_bytes" in r]
    assert [r["step"] for r in rows] == ([3, 5, 7, 9, 11] if overlap else [2, 4, 6, 8, 10, 11])
    np.testing.assert_allclose([r["outer_drift"] for r in rows], [drifts[r["step"]] for r in rows], rtol=1e-5)


def test_stop_with_a_fragment_in_flight_and_resume_exactly(tmp_path, byte_dataset):
    """fragments 2, overlap_steps 1: stopped at step 6 (train.stop_at) while fragment 0's exchange started
    there is in flight: the checkpoint waits for its sums and holds them with each replica's own outer
    gradient (state.json names the exchange); the resumed run applies it at step 7 and ends bit for bit
    the run nobody stopped (losses, drift, evaluations, final weights; the stopped session's own evaluation
    at its last step aside)."""
    import json
    common = {"train.max_steps": 11, "train.eval_every": 5, "checkpoint.every": 3, "distributed.sync": "diloco",
              "distributed.diloco": {"inner_steps": 4, "group": 1, "fragments": 2, "overlap_steps": 1}}
    straight, split = tmp_path / "straight", tmp_path / "split"
    for d, more in ((straight, {}), (split, {"train.stop_at": 6})):
        d.mkdir()
        mpirun(2, "--config", write_config(d / "c.yaml", byte_dataset, **common, **more))
    state = json.load(open(split / "run" / "checkpoints" / "6" / "state.json"))
    assert state["diloco"]["in_flight"][:2] == [0, 6], state["diloco"]
    assert {"outer_sent", "outer_summed", "replica1_outer_sent"} <= set(state["optimizer_states"])
    resumed = mpirun(2, "resume", str(split / "run"))
    assert "advice" not in resumed.stdout, resumed.stdout      # the regime the measurements advise: nothing to say
    rows = {}
    for d in (straight, split):
        lines = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
        rows[d] = [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "eval_loss", "outer_drift")}
                   for r in lines if not (d == split and r["step"] == 6 and "eval_loss" in r)]   # stop_at's
    assert rows[split] == rows[straight]
    final = [open(d / "run" / "checkpoints" / "11" / "model.safetensors", "rb").read() for d in (straight, split)]
    assert final[0] == final[1]


def test_replicas_step_on_their_own_between_world_steps(tmp_path, byte_dataset):
    """With DiLoCo the step's scalars are summed over the world only where the world must agree (log_every 3
    here: steps 3, 6 and the last, 8; no evaluation, checkpoint or sample between); between them each replica
    sums its own. A non-finite gradient on replica 1 at step 2 makes replica 1 alone skip its update: replica
    0 logs no skipped step and the run goes on (every-step training skips on every rank). Without the fault
    the metrics lines at the world steps are the ones of the same run summing over the world at every step
    (log_every 1): the world's mean loss, replica 0's gradient norm, the outer steps and the final weights,
    bit for bit."""
    common = {"train.max_steps": 8, "distributed.sync": "diloco",
              "distributed.diloco": {"inner_steps": 4, "group": 1}}
    runs = {}
    for name, extra, env in (("every", {"train.log_every": 1}, None), ("third", {"train.log_every": 3}, None),
                             ("nan", {"train.log_every": 3}, {"TRAINRUN_FAULT_NAN_GRAD": "1:2"})):
        d = tmp_path / name
        d.mkdir()
        mpirun(2, "--config", write_config(d / "c.yaml", byte_dataset, **common, **extra), env=env)
        runs[name] = str(d / "run")
    every, _ = read_metrics(runs["every"])
    third, _ = read_metrics(runs["third"])
    assert sorted(third) == [3, 6, 8]
    for step in (3, 6, 8):
        assert (third[step]["loss"], third[step]["grad_norm"]) == (every[step]["loss"], every[step]["grad_norm"])
    outer = {name: [(r["step"], r["outer_bytes"], r["outer_drift"])
                    for r in map(json.loads, open(os.path.join(runs[name], "metrics.jsonl"))) if "outer_bytes" in r]
             for name in ("every", "third")}
    assert outer["third"] == outer["every"] and [s for s, *_ in outer["every"]] == [4, 8]
    assert _checkpoint_weights(runs["third"], 8).tobytes() == _checkpoint_weights(runs["every"], 8).tobytes()
    nan, _ = read_metrics(runs["nan"])
    assert [nan[s]["skipped_steps"] for s in (3, 6, 8)] == [0, 0, 0]
    assert all(np.isfinite(nan[s]["loss"]) for s in (3, 6, 8))


POLL_PROBE = """
import threading, time
import numpy as np
from trainrun.sync import diloco
from trainrun.comm.mpi import MPICommunicator

def wakeups(t):
    for line in open(f"/proc/self/task/{t.native_id}/status"):
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split()[1])

comm = MPICommunicator()
buf = np.ones(1000, np.float32)
ex = diloco.exchange(comm, buf, [(0, 1000)], "fp32")
if comm.rank == 1:
    time.sleep(1.5)                 # the other replica's fragment comes late: rank 0's exchange waits
ex.bucket_ready(0)
time.sleep(0.1)
(t,) = [t for t in threading.enumerate() if t.name.startswith("trainrun-reduce")]
w0, t0 = wakeups(t), time.monotonic()
while not ex._pending[-1].done():
    time.sleep(0.01)
w1, t1 = wakeups(t), time.monotonic()
ex.wait()
assert np.all(buf == 2.0)
if comm.rank == 0:
    print(f"WAKEUPS {w1 - w0} {t1 - t0:.3f}", flush=True)
ex.close()
comm.close()
"""


def test_an_exchange_in_flight_polls_every_few_milliseconds(tmp_path):
    """overlap_steps' background exchange (fp32) waits for the other replica polling every
    diloco.EXCHANGE_POLL_S, not every 100 us as the gradient buckets' does: its thread shares the node's cores
    with the inner steps for the whole exchange (a link's seconds). The other replica's fragment comes 1.5 s
    late: rank 0's thread wakes (voluntary context switches, /proc) at most twice per poll period meanwhile,
    and the sums are right."""
    import sys
    from conftest import MPIRUN, run
    script = tmp_path / "poll.py"
    script.write_text(POLL_PROBE)
    out = run([MPIRUN, "-np", "2", sys.executable, str(script)], check=0).stdout
    wakes, waited = out.split("WAKEUPS ")[1].split()[:2]
    assert float(waited) > 0.5, out
    from trainrun.sync import diloco
    assert int(wakes) / float(waited) <= 2 / diloco.EXCHANGE_POLL_S, out
