"""The TrainingRunner end to end, with real `mpirun` processes."""

import glob
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import (MPIRUN, TRAINRUN, TRAINRUN_DATA, mpirun, rank_pids, read_metrics, run, synthetic_text_dir,
                      write_config)
from trainrun import checkpoint as K
from trainrun.run import rundir


def losses(run_dir, key="loss"):
    train, _ = read_metrics(run_dir)
    return np.array([train[s][key] for s in sorted(train)])


@pytest.mark.graphs
def test_two_ranks_equal_one_rank_and_accumulation(tmp_path, byte_dataset):
    """The mean over ranks and micro-batches: SGD without clipping moves the weights in proportion to
    the gradient, so a wrong averaging factor (1, 1/accum only, 1/world only) changes the losses from
    step 2 and the logged gradient norm from step 1. Also: the ONNX optimizer graph with symbolic
    shapes trains as the default host kernel with static shapes does."""
    runs = {}
    graph = {"engine.optimizer_kernel": "graph", "engine.static_shapes": False}
    sgd = {"optimizer": {"name": "sgd", "lr": 0.15, "momentum": 0.9, "max_grad_norm": 0.0}}
    for name, n, mb, acc, extra in [("w1", 1, 8, 1, {}), ("w2", 2, 4, 1, {}), ("acc", 1, 4, 2, {}),
                                    ("graph", 1, 8, 1, graph)]:
        d = tmp_path / name
        d.mkdir()
        cfg = write_config(d / "c.yaml", byte_dataset, **{"train.micro_batch_size": mb,
                                                          "train.gradient_accumulation_steps": acc, **sgd, **extra})
        mpirun(n, "--config", cfg)
        runs[name] = losses(str(d / "run")), losses(str(d / "run"), "grad_norm")
    assert len(runs["w1"][0]) == 20
    assert runs["w1"][0][-1] < runs["w1"][0][0] - 1.0
    for name in ("w2", "acc", "graph"):
        for ours, ref in zip(runs[name], runs["w1"]):
            np.testing.assert_allclose(ours, ref, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_bitwise_identical_on_all_ranks_every_step(tmp_path, byte_dataset, world):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 6, "checkpoint.every": 1, "checkpoint.keep_last": 100})
    mpirun(world, "--config", cfg)
    ckpts = sorted(glob.glob(str(tmp_path / "run" / "checkpoints" / "*")), key=lambda p: int(os.path.basename(p)))
    assert [int(os.path.basename(c)) for c in ckpts] == list(range(1, 7))
    previous = None
    for c in ckpts:
        digests = {json.load(open(os.path.join(c, f"rank-{r}.json")))["params_sha256"] for r in range(world)}
        assert len(digests) == 1, f"ranks disagree at {c}"
        assert digests != previous          # and the parameters did change
        previous = digests


def test_summary_metrics_and_tensorboard(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 10, "train.log_every": 5, "train.eval_every": 5, "tensorboard.enabled": True,
        "train.sample_prompt": "def f(\n"})
    t0 = time.perf_counter()
    proc = mpirun(2, "--config", cfg)
    wall = time.perf_counter() - t0
    out = tmp_path / "run"
    train, evals = read_metrics(str(out))
    assert sorted(train) == [5, 10] and sorted(evals) == [5, 10]
    for row in train.values():
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "samples_per_sec", "elapsed_s"):
            assert key in row
        assert row["samples_per_sec"] > 0
        assert row["tokens_per_sec"] == pytest.approx(row["samples_per_sec"] * 32, rel=1e-12)
        # mean ms per step of each phase since the last log
        assert {"data", "forward_backward", "allreduce", "norm", "optimizer"} <= set(row["phase_ms"])
        assert all(v > 0 for v in row["phase_ms"].values()), row["phase_ms"]
    assert "eval" not in train[5]["phase_ms"] and "eval" in train[10]["phase_ms"]   # step 5's eval: after its log
    assert evals[10]["eval_perplexity"] == pytest.approx(math.exp(evals[10]["eval_loss"]), rel=1e-6)
    assert "2 rank(s)" in proc.stdout and "global batch 8" in proc.stdout and "done: 10 steps" in proc.stdout
    assert " tok/s | " in proc.stdout and " | perplexity " in proc.stdout           # a language model's numbers
    # at info the config shows what differs from the defaults, one line per section, a newline kept in its line
    config = proc.stdout.split("config (what differs from the defaults")[1].split("trainrun: t |")[0]
    assert '  train: micro_batch_size=4, max_steps=10, eval_every=5, eval_steps=2, log_every=5, ' \
           'sample_prompt="def f(\\n"\n' in config, config
    assert "bert" not in config and "n_layer" not in config and "adamw" not in config      # defaults not shown
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10 and set(summary["phase_shares"]) >= {"forward_backward", "allreduce", "optimizer"}
    # start-up (process start -> first step: the imports count) and the end (last step -> summary: the final
    # checkpoint and model.onnx), within the command's wall time together with the steps
    assert 0.5 < summary["startup_s"] and 0 < summary["end_s"], summary
    assert summary["startup_s"] + summary["time_s"] + summary["end_s"] < wall, (summary, wall)
    assert f"start-up {summary['startup_s']:.1f} s, after the last step {summary['end_s']:.1f} s" in proc.stdout
    tags = _tensorboard_tags(glob.glob(str(out / "tensorboard" / "events.*")))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/samples_per_sec",
            "eval/loss", "eval/perplexity", "time/forward_backward_ms", "time/optimizer_ms"} <= tags


def _tensorboard_events(files):
    """The events of TensorBoard event files, file by file in the order written (TFRecord framing: u64 length,
    u32 crc, data, u32 crc)."""
    import struct
    from tensorboardX.proto import event_pb2
    for f in sorted(files):      # events.out.tfevents.<seconds>.<host>...: the order of creation
        data = open(f, "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            yield event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4


def _tensorboard_tags(files):
    """Scalar tags in TensorBoard event files."""
    return {v.tag for event in _tensorboard_events(files) for v in event.summary.value}


def _tensorboard_scalars(files):
    """{tag: [step, ...]} as TensorBoard shows them: a SessionLog START at step s discards the events read
    before it at steps >= s (tensorboard's EventAccumulator, the purge step of tensorboardX's writers)."""
    from tensorboardX.proto.event_pb2 import SessionLog
    seen = []
    for event in _tensorboard_events(files):
        if event.HasField("session_log") and event.session_log.status == SessionLog.START:
            seen = [(tag, step) for tag, step in seen if step < event.step]
        seen += [(v.tag, event.step) for v in event.summary.value]
    out = {}
    for tag, step in seen:
        out.setdefault(tag, []).append(step)
    return out


def test_refuses_to_overwrite_a_run_with_checkpoints(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 2})
    mpirun(1, "--config", cfg)
    proc = mpirun(2, "--config", cfg, check=2)
    assert "trainrun resume" in proc.stderr and proc.stderr.count("already holds checkpoints") == 1


def test_every_dataset_is_checked_at_start_up(tmp_path, byte_dataset):
    """An eval set of 7 samples holds an evaluation's batch on one rank (4) but not on two (2 x 4): the
    start-up says so (exit 2) before step 1 and before anything is written, not the evaluation after
    the last step (which lost every step); `config validate` (one rank) finds it valid."""
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_bytes(bytes(range(33, 127)) * 2 + b"x" * 42)      # 230 bytes
    run([TRAINRUN_DATA, "tokens", "--input", str(tmp_path / "text"), "--output", str(tmp_path / "small"),
         "--bytes", "--eval-fraction", "0", "--no-progress"], check=0)
    small = str(tmp_path / "small" / "train")              # 231 tokens: 7 samples of 32 + 1
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"data.eval": small, "train.max_steps": 3})
    proc = mpirun(2, "--config", cfg, check=2)
    assert (f"data.eval: {small}: 7 samples (seq_len 32) are fewer than one eval batch of 8 (micro_batch 4 x "
            f"world_size 2)") in proc.stderr, proc.stderr
    assert proc.stderr.count("fewer than one") == 1       # agreed by the ranks: rank 0 reports it
    assert not os.path.exists(tmp_path / "run")           # no step taken, no graph built
    run([TRAINRUN, "config", "validate", "--config", cfg], check=0)


def test_ranks_with_different_configs_fail_fast(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset)
    proc = run([MPIRUN, "-np", "1", TRAINRUN, "--config", cfg, ":",
                "-np", "1", TRAINRUN, "--config", cfg, "--set", "optimizer.lr=0.1"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "rank 1 has a different config than rank 0" in proc.stderr


def test_killed_rank_ends_the_job(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 100000,
                                                             "distributed.timeout_s": 20})
    proc = subprocess.Popen([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    assert metrics.exists(), "training never started"
    victim = rank_pids(str(tmp_path))[1]
    os.kill(victim, signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=120)      # a hang raises TimeoutExpired
    finally:
        proc.kill()
    assert proc.returncode != 0
    # the launcher saw the killed rank itself (not rank 0 timing out in a collective) and ended the job
    assert f"PID {victim} " in out and "EXIT CODE: 9" in out, out[-2000:]


def test_gpt2_tiny_learns_python_source(tmp_path):
    """configs/gpt2-tiny.yaml as the demo runs it: 2 ranks, 500 steps on Python source with a 1024-token
    BPE; the eval loss ends below half of ln(vocab) and still falls after step 100 (seen: 1.61 -> 1.30).
    The demo trains on the running Python's standard library; the test uses the seeded synthetic source
    instead, the same bytes on every Python (the stdlib changes between versions)."""
    data = tmp_path / "source"
    text = synthetic_text_dir(str(tmp_path / "text"), max_bytes=4_000_000)
    run([TRAINRUN_DATA, "tokens", "--input", text, "--output", str(data),
         "--train-bpe", "1024", "--include", "*.py", "--no-progress"], check=0, timeout=300)
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "gpt2-tiny.yaml")
    mpirun(2, "--config", config, "--set", f"run.output_dir={tmp_path / 'run'}",
           "--set", f"data.train={data / 'train'}", "--set", f"data.eval={data / 'eval'}", timeout=600)
    _, evals = read_metrics(str(tmp_path / "run"))
    first, last = evals[min(evals)]["eval_loss"], evals[max(evals)]["eval_loss"]
    assert max(evals) == 500
    assert last < 0.5 * math.log(1024) and last < first - 0.1, (first, last)


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, byte_dataset):
    # an absurd learning rate blows the weights up after the first update: every later gradient is NaN
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "optimizer.lr": 1e12, "optimizer.max_grad_norm": 0.0, "lr_schedule": {"name": "constant"},
        "train.max_steps": 50, "checkpoint.every": 1})
    proc = mpirun(2, "--config", cfg, check=1)
    assert proc.stderr.count("8 steps in a row had non-finite gradients") == 1   # rank 0 alone reports
    assert "update skipped" in proc.stdout
    train, _ = read_metrics(str(tmp_path / "run"))
    last = max(train)
    assert train[last]["skipped_steps"] >= 7 and last <= 9
    # the checkpoint of the last finite update (the step before the streak), possibly still being written
    # in the background when the streak stops the run, is committed before the stop; none during the streak
    ckpts = sorted(int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit())
    assert max(ckpts, default=0) == last - 7, ckpts
    assert os.path.exists(tmp_path / "run" / "checkpoints" / str(last - 7) / "COMMITTED")


def test_an_evaluation_that_fails_commits_the_trained_steps_first(tmp_path, byte_dataset):
    """A dataset that breaks at the evaluation, on one rank: rank 1's first eval sample holds a token id beyond
    the vocabulary (the manifest's checksum updated to match, so start-up accepts the shard). With eval only at
    the end, both ranks commit a checkpoint of the last trained step first; then the job exits 2 naming the
    rank and the shard (rank 0 alone reports), its summary.json written."""
    data = tmp_path / "data"
    shutil.copytree(byte_dataset, data)
    manifest = json.loads((data / "eval" / "manifest.json").read_text())
    shard = data / "eval" / manifest["shards"][0]["file"]
    tokens = np.fromfile(shard, manifest["dtype"])
    tokens[4 * 32 + 5] = 65535          # sample 4: rank 1's first (micro-batch 4 x 2 ranks, seq_len 32)
    tokens.tofile(shard)
    manifest["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (data / "eval" / "manifest.json").write_text(json.dumps(manifest))
    cfg = write_config(tmp_path / "c.yaml", str(data), **{"train.max_steps": 6})     # checkpoint.every 0
    proc = mpirun(2, "--config", cfg, check=2, timeout=120)
    run_dir = tmp_path / "run"
    assert f"rank 1: {shard}: token id 65535 at token 133 is not below the model's vocab_size 512" in proc.stderr
    assert f"checkpoint {run_dir / 'checkpoints' / '6'} committed first" in proc.stderr, proc.stderr
    assert proc.stderr.count("token id 65535") == 1 and "Traceback" not in proc.stderr
    ckpt = rundir.resolve_checkpoint(str(run_dir))
    assert ckpt == str(run_dir / "checkpoints" / "6")
    K.verify(ckpt)
    assert max(read_metrics(str(run_dir))[0]) == 6
    summary = json.loads((run_dir / "summary.json").read_text())     # a session that committed: summed up
    assert summary["steps"] == summary["final_step"] == 6 and "token id 65535" in summary["stopped"], summary


def test_stop_at_prints_the_resume_command(tmp_path, byte_dataset):
    """A run ended by train.stop_at says how to continue it, as a stop signal does."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 6, "train.stop_at": 3})
    run_dir = tmp_path / "run"
    proc = run([TRAINRUN, "--config", cfg], check=0)
    assert f"stopped at train.stop_at 3 of train.max_steps 6; checkpoint {run_dir / 'checkpoints' / '3'} " \
           f"committed. Continue with `trainrun resume {run_dir}`" in proc.stdout, proc.stdout


def test_a_resume_with_nothing_to_train_keeps_the_model(tmp_path, byte_dataset):
    """A resume from an older checkpoint with train.max_steps at that step trains nothing: it says so and
    leaves model.onnx (of step 6, newer than that checkpoint), metrics.jsonl and summary.json as they are.
    With model.onnx missing, a resume at the last step exports it again, the same bytes, and still leaves
    summary.json."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 6, "checkpoint.every": 3})
    run_dir = tmp_path / "run"
    run([TRAINRUN, "--config", cfg], check=0)
    model, metrics = (run_dir / "model.onnx").read_bytes(), (run_dir / "metrics.jsonl").read_text()
    summary = (run_dir / "summary.json").read_text()
    assert json.loads(summary)["steps"] == 6
    proc = run([TRAINRUN, "resume", str(run_dir / "checkpoints" / "3"), "--set", "train.max_steps=3"], check=0)
    assert f"nothing to train: the run is at step 3, it ends at step 3 (train.max_steps 3); " \
           f"{run_dir / 'model.onnx'} not exported again" in proc.stdout, proc.stdout
    assert (run_dir / "model.onnx").read_bytes() == model
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert (run_dir / "summary.json").read_text() == summary
    os.remove(run_dir / "model.onnx")
    proc = run([TRAINRUN, "resume", str(run_dir)], check=0)
    assert f"nothing to train: the run is at step 6, it ends at step 6 (train.max_steps 6); " \
           f"{run_dir / 'model.onnx'} is missing: exporting it" in proc.stdout, proc.stdout
    assert (run_dir / "model.onnx").read_bytes() == model
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert (run_dir / "summary.json").read_text() == summary


def test_metrics_and_tensorboard_after_a_crash_hold_every_step_once(tmp_path, byte_dataset):
    """A run that crashes at step 12 (step 8's checkpoint write hangs, so step 12's save gives up after
    distributed.timeout_s) logged steps 5..12 after its last committed checkpoint, 4; resumed, it trains
    them again. metrics.jsonl then holds every step once (the lost lines removed, the redone ones kept),
    TensorBoard likewise (its purge step)."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 16, "checkpoint.every": 4, "train.eval_every": 5, "tensorboard.enabled": True,
        "distributed.timeout_s": 3})
    run_dir = tmp_path / "run"
    proc = run([TRAINRUN, "--config", cfg], check=1, env={"TRAINRUN_FAULT_STALL_CHECKPOINT": "8"})
    assert "the checkpoint write of step 8" in proc.stderr, proc.stderr
    assert rundir.resolve_checkpoint(str(run_dir)) == str(run_dir / "checkpoints" / "4")
    tb = glob.glob(str(run_dir / "tensorboard" / "events.*"))
    assert _tensorboard_scalars(tb)["train/loss"] == list(range(1, 13))
    proc = run([TRAINRUN, "resume", str(run_dir)], check=0)
    assert "metrics.jsonl: 10 line(s) after step 4 removed" in proc.stdout, proc.stdout     # 8 steps, 2 evals
    with open(run_dir / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 17))
    assert [r["step"] for r in rows if "eval_loss" in r] == [5, 10, 15, 16]
    scalars = _tensorboard_scalars(glob.glob(str(run_dir / "tensorboard" / "events.*")))
    assert scalars["train/loss"] == list(range(1, 17))
    assert scalars["eval/loss"] == [5, 10, 15, 16]


def test_label_smoothing_trains_and_reports_plain_perplexity(tmp_path, byte_dataset):
    """model.loss.label_smoothing 0.1 on the built-in GPT-2, 2 ranks: the train and eval losses are the
    smoothed loss (above the plain cross-entropy once the model is confident), eval_ce is the plain one
    and perplexity its exp; the run learns."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 20, "train.eval_every": 10, "model.loss.label_smoothing": 0.1})
    mpirun(2, "--config", cfg)
    train, evals = read_metrics(str(tmp_path / "run"))
    assert sorted(evals) == [10, 20]
    for row in evals.values():
        assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_ce"]), rel=1e-6)
        assert row["eval_loss"] > row["eval_ce"] + 0.05, row
    assert train[20]["loss"] < train[1]["loss"] - 0.5


def test_what_follows_a_step():
    """step_end, the decisions after a step (a 12-step run: log_every 2, eval_every 4, checkpoint.every 3,
    keep_best 1, sample_every 6): each named, in the loop's order."""
    from trainrun import config as C
    from trainrun.run.runner import step_end
    cfg = C.load_config(None, ["train.max_steps=12", "train.log_every=2", "train.eval_every=4",
                               "checkpoint.every=3", "checkpoint.keep_best=1", "train.sample_every=6"])

    def plan(step, stop=False, has_eval=True, end=12):
        p = step_end(cfg, step, end, stop, has_eval)
        return {k for k, v in vars(p).items() if v}

    assert plan(1) == set()
    assert plan(2) == {"log"}
    assert plan(3) == {"evaluate", "checkpoint"}                  # keep_best ranks it: not counted by patience
    assert plan(4) == {"log", "evaluate", "patience"}
    assert plan(6) == {"log", "evaluate", "checkpoint", "sample"}
    assert plan(8) == {"log", "evaluate", "patience"}
    assert plan(12) == {"last", "log", "evaluate", "patience", "checkpoint", "sample"}
    assert plan(11, end=11) == {"last", "log", "evaluate", "checkpoint"}       # train.stop_at 11
    # a stop: a checkpoint and a line, no evaluation nor sample; on the last step the run finishes instead
    assert plan(5, stop=True) == {"stop", "log", "checkpoint"}
    assert plan(6, stop=True) == {"stop", "log", "checkpoint"}
    assert plan(12, stop=True) == plan(12)
    assert plan(4, has_eval=False) == {"log"} and plan(12, has_eval=False) == {"last", "log", "checkpoint", "sample"}
