"""Checkpoints, exact resume on any rank count, crash safety and export; real processes."""

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import MPIRUN, TRAINRUN, hf_gpt2, mpirun, rank_pids, read_metrics, run, write_config


def losses(run_dir, key="loss"):
    train, _ = read_metrics(run_dir)
    return {s: train[s][key] for s in sorted(train)}


def model_bytes(ckpt):
    with open(os.path.join(ckpt, "model.safetensors"), "rb") as fh:
        return fh.read()


def test_exact_resume_same_and_other_rank_counts(tmp_path, byte_dataset):
    """Bitwise at one intra-op thread per rank (write_config pins engine.threads: 1; see the next test)."""
    common = {"train.max_steps": 40, "train.micro_batch_size": 6, "checkpoint.every": 20}
    straight = tmp_path / "straight"
    straight.mkdir()
    mpirun(2, "--config", write_config(straight / "c.yaml", byte_dataset, **common))
    ref = losses(str(straight / "run"))
    assert sorted(ref) == list(range(1, 41))

    split = tmp_path / "split"
    split.mkdir()
    mpirun(2, "--config", write_config(split / "c.yaml", byte_dataset, **{**common, "train.stop_at": 20}))
    assert sorted(losses(str(split / "run"))) == list(range(1, 21))
    mpirun(2, "resume", str(split / "run"), "--set", "train.stop_at=0")
    got = losses(str(split / "run"))
    assert got == ref                                         # identical at every step
    ref_norm = losses(str(straight / "run"), "grad_norm")
    assert losses(str(split / "run"), "grad_norm") == ref_norm
    assert model_bytes(str(split / "run/checkpoints/40")) == model_bytes(str(straight / "run/checkpoints/40"))

    # the same run continued by 1 rank (2 micro-batches of 6) and by 3 ranks (micro-batch 4); AdamW
    # ignores a constant factor on the gradient and clipping is active, so the losses alone would not
    # see a wrong averaging over ranks or micro-batches: the logged gradient norm (before clipping) does
    for world, sets in [(1, ["train.gradient_accumulation_steps=2"]), (3, ["train.micro_batch_size=4"])]:
        other = tmp_path / f"w{world}"
        shutil.copytree(split / "run", other / "run")
        shutil.rmtree(other / "run/checkpoints/40")
        (other / "run/metrics.jsonl").write_text("")
        args = ["resume", str(other / "run/checkpoints/20"), "--set", "train.stop_at=0"]
        for s in sets:
            args += ["--set", s]
        mpirun(world, *args)
        cont = losses(str(other / "run"))
        assert sorted(cont) == list(range(21, 41))
        # step 21 runs on the restored weights: only the order of the sums over ranks differs (float32
        # rounding, ~1e-7). Later steps: AdamW's m / sqrt(v) amplifies that rounding step by step (trainrun
        # vs PyTorch drifted to 2.5e-4 by step 25 on one machine), so the curve gets 1e-3; a wrong data
        # position or a lost optimizer state moves the losses by more than 1e-2.
        assert cont[21] == pytest.approx(ref[21], rel=1e-5)
        np.testing.assert_allclose([cont[s] for s in cont], [ref[s] for s in cont], rtol=1e-3)
        norm = losses(str(other / "run"), "grad_norm")
        assert norm[21] == pytest.approx(ref_norm[21], rel=1e-4), f"{world} rank(s)"   # a wrong scale: >= 1.5x
        np.testing.assert_allclose([norm[s] for s in norm], [ref_norm[s] for s in norm], rtol=1e-3,
                                   err_msg=f"{world} rank(s)")


def test_resume_at_two_threads_continues_within_float32_rounding(tmp_path, byte_dataset):
    """At 2 intra-op threads a run is not bitwise reproducible even without resuming: onnxruntime's CPU
    GatherGrad (the embedding's gradient) adds rows under a mutex in thread-arrival order, so the
    summation order of repeated tokens changes run to run. What holds: the resumed run follows the
    straight one to float32 rounding (measured: 1.3e-7 relative on the loss over 40 steps), far
    inside 1e-4, while a resume that lost any state (moments, data position, step) is off by >1e-3."""
    common = {"train.max_steps": 20, "train.micro_batch_size": 12, "checkpoint.every": 10, "engine.threads": 2}
    straight, split = tmp_path / "straight", tmp_path / "split"
    for d, extra in [(straight, {}), (split, {"train.stop_at": 10})]:
        d.mkdir()
        mpirun(1, "--config", write_config(d / "c.yaml", byte_dataset, **common, **extra))
    proc = mpirun(1, "resume", str(split / "run"), "--set", "train.stop_at=0")
    assert "1 rank(s) x 2 thread(s)" in proc.stdout
    ref, got = losses(str(straight / "run")), losses(str(split / "run"))
    assert sorted(got) == sorted(ref) == list(range(1, 21))
    np.testing.assert_allclose([got[s] for s in range(11, 21)], [ref[s] for s in range(11, 21)], rtol=1e-4)
    _, ev_ref = read_metrics(str(straight / "run"))
    _, ev_got = read_metrics(str(split / "run"))
    assert ev_got[20]["eval_loss"] == pytest.approx(ev_ref[20]["eval_loss"], rel=1e-4)


def test_keep_last_and_resume_refusals(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 8, "checkpoint.every": 2,
                                                             "checkpoint.keep_last": 2})
    mpirun(2, "--config", cfg)
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(ck)) == ["6", "8"]
    for c in ("6", "8"):
        files = set(os.listdir(ck / c))
        assert {"model.safetensors", "optimizer.safetensors", "state.json", "config.yaml", "checksums.json",
                "COMMITTED", "rank-0.json", "rank-1.json"} == files
    state = json.loads((ck / "8" / "state.json").read_text())
    assert state["step"] == 8 and state["world_size"] == 2 and state["loader"]
    # params loadable by the safetensors library itself, with our names
    from safetensors.numpy import load_file
    tensors = load_file(str(ck / "8" / "model.safetensors"))
    assert "transformer.wte.weight" in tensors and tensors["transformer.wte.weight"].shape == (512, 32)
    opt = load_file(str(ck / "8" / "optimizer.safetensors"))
    assert "exp_avg/transformer.wte.weight" in opt and "exp_avg_sq/transformer.wte.weight" in opt

    proc = mpirun(1, "resume", str(tmp_path / "run"), "--set", "model.gpt2.n_embd=64", check=2)
    assert "model.gpt2.n_embd" in proc.stderr and "--force" in proc.stderr
    proc = mpirun(1, "resume", str(tmp_path / "run"), "--set", "train.max_steps=9", check=2)
    assert "global batch would change from 8" in proc.stderr


def test_interrupted_prune_leaves_nothing_that_looks_committed(tmp_path, byte_dataset, monkeypatch):
    """keep_last deletes old checkpoints; a Ctrl-C in the middle of that delete (seen in the SIGINT test:
    a checkpoint with COMMITTED but without optimizer.safetensors) must not leave a damaged directory
    that still counts as committed. The delete is cut after its first file, as a signal would."""
    from trainrun import checkpoint as K
    from trainrun.run import rundir
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 4, "checkpoint.every": 1,
                                                             "checkpoint.keep_last": 10})
    mpirun(1, "--config", cfg)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(root)) == ["1", "2", "3", "4"]

    class Cut(Exception):
        """Stands for the signal that ends the process in the middle of the delete."""

    def rmtree_cut_short(path, ignore_errors=False):
        victim = sorted(f for f in os.listdir(path) if f != rundir.COMMITTED)[0]
        os.remove(os.path.join(path, victim))       # one file gone, COMMITTED (if still there) stays
        raise Cut
    monkeypatch.setattr(K.write.shutil, "rmtree", rmtree_cut_short)
    writer = K.CheckpointWriter(str(tmp_path / "run"), rank=0, world_size=1, keep_last=1)
    with pytest.raises(Cut):
        writer._prune()
    monkeypatch.undo()
    for ckpt in rundir.complete_checkpoints(str(root)):   # whatever still counts as committed is intact
        K.verify(ckpt)
    K.cleanup(str(root), log=lambda _: None)         # the next start removes what the cut delete left
    assert all(d.isdigit() for d in os.listdir(root)), os.listdir(root)
    assert rundir.resolve_checkpoint(str(tmp_path / "run")) == str(root / "4")


def test_reads_of_a_run_that_prunes_every_step(tmp_path, byte_dataset):
    """export, evaluate, generate and model.init_from (prepare, config validate) read a run that commits and
    prunes a checkpoint every step (keep_last 1): each read pins the files it reads (a run directory's latest,
    or the newest when that was pruned first), or, for a checkpoint named by the user and pruned before it was
    opened, says so and names the newest."""
    from trainrun.run.stopping import STOPPED_EXIT
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 100000, "checkpoint.every": 1, "checkpoint.keep_last": 1, "train.log_every": 1000})
    rd = str(tmp_path / "run")
    ck = tmp_path / "run" / "checkpoints"
    proc = subprocess.Popen([TRAINRUN, "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (ck.exists() and any(d.isdigit() for d in os.listdir(ck))):
            time.sleep(0.1)
        reads = []          # (command, what it reads: the run directory or a checkpoint named, its result)
        for i in range(3):
            named = str(ck / max((d for d in os.listdir(ck) if d.isdigit()), key=int))
            init = lambda source, out: write_config(    # noqa: E731 - a run started from the pruning run's weights
                tmp_path / f"{out}.yaml", byte_dataset, **{"model.init_from": source,
                                                            "run.output_dir": str(tmp_path / out)})
            for cmd, source in (
                    ([TRAINRUN, "export", rd, "--output", str(tmp_path / f"r{i}.onnx")], rd),
                    ([TRAINRUN, "export", named, "--output", str(tmp_path / f"n{i}.onnx")], named),
                    ([TRAINRUN, "evaluate", rd, "--data", os.path.join(byte_dataset, "eval"), "--steps", "1"], rd),
                    ([TRAINRUN, "generate", rd, "--prompt", "a", "--max-new-tokens", "2"], rd),
                    ([TRAINRUN, "generate", named, "--prompt", "a", "--max-new-tokens", "2"], named),
                    ([TRAINRUN, "prepare", "--config", init(rd, f"p{i}")], rd),
                    ([TRAINRUN, "config", "validate", "--config", init(named, f"v{i}")], named)):
                reads.append((cmd, source, run(cmd)))
        assert proc.poll() is None, "the run ended before the reads did: they raced nothing"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == STOPPED_EXIT, out
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", out).group(1))
    assert stopped > 20, out          # it pruned as the reads ran
    for cmd, source, r in reads:
        text = r.stdout + r.stderr
        assert "Traceback" not in text and "incomplete" not in text and "FileNotFound" not in text, (cmd, text)
        if source == rd:     # the latest: whatever is pruned, a complete one is read
            assert r.returncode == 0, (cmd, text)
        elif r.returncode:
            assert r.returncode == 2, (cmd, text)
            newest = re.search(rf"{re.escape(source)}: (pruned while being read|not there: pruned) \(.*\); the "
                               r"newest checkpoint is (\S+)", r.stderr)
            assert newest, (cmd, text)
            assert int(os.path.basename(newest.group(2))) > int(os.path.basename(source))
    for verb in ("export", "generate", "validate"):
        assert any(r.returncode for cmd, source, r in reads if source != rd and verb in cmd), \
            f"no named checkpoint was pruned while {verb} read it"


@pytest.mark.parametrize("damage", ["flip", "missing", "other_model"])
def test_damaged_checkpoint_is_named(tmp_path, byte_dataset, damage):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 2})
    mpirun(1, "--config", cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "2"
    if damage == "flip":       # the weights: resume and export read them (the optimizer's alone: the next test)
        _flip(ckpt / "model.safetensors")
        expected = "model.safetensors: checksum mismatch; the file is corrupt; no other checkpoint of"
    elif damage == "missing":
        os.remove(ckpt / "model.safetensors")
        expected = "model.safetensors: missing"
    else:   # a checkpoint of a wider model, complete and valid in itself
        other = tmp_path / "other"
        other.mkdir()
        mpirun(1, "--config", write_config(other / "c.yaml", byte_dataset, **{
            "train.max_steps": 2, "model.gpt2": {"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 32,
                                                  "vocab_size": 512}}))
        foreign = tmp_path / "run" / "checkpoints" / "3"
        shutil.copytree(other / "run/checkpoints/2", foreign)
        proc = run([TRAINRUN, "export", str(foreign), "--output", str(tmp_path / "m.onnx")], check=2)
        assert f"{foreign} was trained with other graphs than" in proc.stderr and "eval.onnx: sha256" in proc.stderr
        shutil.rmtree(foreign)
        # our run forced onto the other shape cannot load our tensors
        proc = mpirun(1, "resume", str(tmp_path / "run"), "--force", "--set", "model.gpt2.n_embd=64",
                      "--set", "train.max_steps=4", check=2)
        assert "model.safetensors: tensor 'transformer.wte.weight' has shape (512, 32)" in proc.stderr
        assert "Traceback" not in proc.stderr
        return
    proc = mpirun(1, "resume", str(tmp_path / "run"), "--set", "train.max_steps=4", check=2)
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    proc = run([TRAINRUN, "export", str(ckpt), "--output", str(tmp_path / "m.onnx")], check=2)
    assert expected in proc.stderr


def _flip(path) -> None:
    """One bit of ``path``'s middle byte flipped on disk (in a safetensors file: a tensor's data)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _named_command(stderr: str, verb: str) -> list:
    """The `trainrun VERB ...` command an error names between backquotes, runnable here."""
    found = re.search(rf"`(trainrun {verb} [^`]*)`", stderr)
    assert found, stderr
    return [TRAINRUN, *shlex.split(found.group(1))[1:]]


def test_a_corrupt_checkpoint_names_the_newest_intact_one_and_the_command_that_uses_it(tmp_path, byte_dataset):
    """The latest checkpoint's bytes damaged on disk: `resume` and `export` exit 2 naming the file, the run's
    newest intact checkpoint and the exact command that uses it (the user's --set and --output kept), and
    that command works. `export` checks only what it reads: a damaged optimizer.safetensors stops `resume`,
    not `export`."""
    from trainrun import checkpoint as K
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 4, "checkpoint.every": 2})
    run([TRAINRUN, "--config", cfg], check=0)
    rd, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _flip(ck / "4" / "optimizer.safetensors")
    proc = run([TRAINRUN, "export", str(rd), "--output", str(tmp_path / "a.onnx")], check=0)
    assert f"from {ck / '4'}" in proc.stdout, proc.stdout

    proc = run([TRAINRUN, "resume", str(rd), "--set", "train.max_steps=6"], check=2)
    assert (f"{ck / '4' / 'optimizer.safetensors'}: checksum mismatch; the file is corrupt; the run's newest intact "
            f"checkpoint is {ck / '2'}: use it with `trainrun resume {ck / '2'} --set train.max_steps=6`"
            ) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    again = _named_command(proc.stderr, "resume")
    branch = tmp_path / "branch"        # a branch copies the checkpoint: checked as it is copied, not committed
    proc = run([TRAINRUN, "resume", str(rd), "--set", f"run.output_dir={branch}"], check=2)
    assert (f"{ck / '4' / 'optimizer.safetensors'}: checksum mismatch; the file is corrupt; the run's newest intact "
            f"checkpoint is {ck / '2'}: use it with `trainrun resume {ck / '2'} --set run.output_dir={branch}`"
            ) in proc.stderr, proc.stderr
    assert not glob.glob(str(branch / "checkpoints" / "*")) and not glob.glob(str(branch / "checkpoints" / ".*"))
    run(again, check=0)
    train, _ = read_metrics(str(rd))
    assert sorted(train) == list(range(1, 7))
    for step in ("2", "4", "6"):         # 4 written again by the resumed run
        K.verify(str(ck / step))

    _flip(ck / "6" / "model.safetensors")
    out = str(tmp_path / "b.onnx")
    proc = run([TRAINRUN, "export", str(rd), "--output", out], check=2)
    assert (f"{ck / '6' / 'model.safetensors'}: checksum mismatch; the file is corrupt; the run's newest intact "
            f"checkpoint is {ck / '4'}: use it with `trainrun export {ck / '4'} --output {out}`") in proc.stderr, \
        proc.stderr
    proc = run(_named_command(proc.stderr, "export"), check=0)
    assert f"exported {out} from {ck / '4'}" in proc.stdout, proc.stdout


def _digests(root) -> dict:
    """sha256 of every file under ``root``, by relative path (links and folders named too)."""
    import hashlib
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            out[rel] = "dir" if os.path.isdir(path) and not os.path.islink(path) else \
                hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def test_resume_into_another_output_dir_branches_and_leaves_the_run_as_it_is(tmp_path, byte_dataset):
    """`resume RUN/checkpoints/4 --set run.output_dir=NEW` on 2 ranks, with another learning rate (--force):
    RUN byte for byte as it was (every file's sha256, no file added or removed); NEW a complete run
    directory that starts at step 4 (its config, graphs, checkpoint 4 = RUN's, metrics.jsonl = RUN's up to
    step 4 and then its own, TensorBoard likewise, its checkpoints, model.onnx and summary.json); NEW
    resumable on its own by `trainrun resume NEW`. Branching into NEW again, or into a folder inside RUN, is
    refused (exit 2) and writes nothing."""
    from test_runner import _tensorboard_scalars
    from trainrun import checkpoint as K
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 8, "checkpoint.every": 2, "checkpoint.keep_last": 4, "train.eval_every": 4,
        "tensorboard.enabled": True})
    mpirun(2, "--config", cfg)
    rd, new = tmp_path / "run", tmp_path / "branch"
    before = _digests(rd)
    assert {"checkpoints/2/COMMITTED", "checkpoints/8/COMMITTED", "model.onnx", "metrics.jsonl"} <= set(before)

    proc = mpirun(2, "resume", str(rd / "checkpoints" / "4"), "--set", f"run.output_dir={new}", "--force",
                  "--set", "optimizer.lr=1e-4")
    assert _digests(rd) == before, "the run branched from was written"
    assert f"resumed from {new / 'checkpoints' / '4'} at step 4" in proc.stdout, proc.stdout
    # NEW: a run of its own from step 4 on
    assert sorted(os.listdir(new / "checkpoints")) == ["4", "6", "8"]
    assert _digests(new / "checkpoints" / "4") == _digests(rd / "checkpoints" / "4")
    for step in ("4", "6", "8"):
        K.verify(str(new / "checkpoints" / step))
    saved = K.read_config(str(new / "checkpoints" / "8"))
    assert saved.run.output_dir == str(new) and saved.optimizer.lr == 1e-4
    import yaml
    recorded = yaml.safe_load((new / "config.yaml").read_text())
    assert recorded["run"]["output_dir"] == str(new) and recorded["optimizer"]["lr"] == 1e-4
    assert (new / "model.onnx").exists() and (new / "summary.json").exists() and (new / "graphs").is_dir()
    ours, our_evals = read_metrics(str(new))
    theirs, their_evals = read_metrics(str(rd))
    assert sorted(ours) == list(range(1, 9)) and sorted(our_evals) == [4, 8]
    assert [ours[s] for s in range(1, 5)] == [theirs[s] for s in range(1, 5)] and our_evals[4] == their_evals[4]
    assert ours[5]["loss"] == theirs[5]["loss"]         # step 5 runs on checkpoint 4's weights, the same batch
    assert ours[5]["lr"] != theirs[5]["lr"]
    assert _tensorboard_scalars(glob.glob(str(new / "tensorboard" / "events.*")))["train/loss"] == list(range(1, 9))

    # NEW already a run: refused; a folder inside RUN: refused; nothing written anywhere
    branched = _digests(new)
    for out, says in ((new, f"run.output_dir {new} already holds checkpoints; a resume into another run "
                            f"directory starts a new run there: continue that one with `trainrun resume {new}`, "
                            f"or choose another run.output_dir"),
                      (rd / "sub", f"run.output_dir {rd / 'sub'} is inside {rd}, the run resumed from")):
        proc = mpirun(2, "resume", str(rd), "--set", f"run.output_dir={out}", check=2)
        assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert _digests(rd) == before and _digests(new) == branched

    # NEW resumes on its own; RUN stays as it was
    mpirun(2, "resume", str(new), "--set", "train.max_steps=10")
    assert sorted(os.listdir(new / "checkpoints"), key=int) == ["4", "6", "8", "10"]
    ours, _ = read_metrics(str(new))
    assert sorted(ours) == list(range(1, 11))
    assert _digests(rd) == before


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 20, "checkpoint.every": 4})
    env = dict(os.environ, TRAINRUN_FAULT_STALL_CHECKPOINT="8")
    proc = subprocess.Popen([MPIRUN, "-np", "2", TRAINRUN, "--config", cfg], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ck = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ck / ".staging-8" / "model.safetensors").exists():
        time.sleep(0.1)
    try:
        assert (ck / ".staging-8" / "model.safetensors").exists(), "the stalled write never started"
        time.sleep(0.5)
        os.kill(rank_pids(str(tmp_path))[1], signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert (ck / "4" / "COMMITTED").exists() and not (ck / "8").exists()
    proc = mpirun(2, "resume", str(tmp_path / "run"))
    assert "removing stale checkpoint staging directory" in proc.stdout
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    assert not (ck / ".staging-8").exists() and (ck / "20" / "COMMITTED").exists()


def test_disk_full_during_save(tmp_path, byte_dataset):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        # the model (~0.1M params) needs ~1.2 MB per checkpoint with its Adam moments: the third does not fit
        cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
            "run.output_dir": str(mnt / "run"), "train.max_steps": 6, "checkpoint.every": 2,
            "checkpoint.keep_last": 5})
        proc = mpirun(2, "--config", cfg, check=1)
        assert "No space left on device" in proc.stderr
        assert "checkpoint at step" in proc.stderr
        ck = mnt / "run" / "checkpoints"
        done = [d for d in os.listdir(ck) if (ck / d / "COMMITTED").exists()]
        assert done, "no older checkpoint survived"
        assert not [d for d in os.listdir(ck) if d.startswith(".staging")]
        for d in done:   # intact: they verify
            run([TRAINRUN, "export", str(ck / d), "--output", str(tmp_path / f"m{d}.onnx")], check=0)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


class _Average:
    """A stateful part with array state of its own, as a new one would be added: its registration is all the
    checkpoint needs (a running average of the parameters, optimizer.safetensors ``average/``, and its count)."""

    def __init__(self, n: int):
        self.buf, self.count = np.zeros(n, np.float32), 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]

    def full_state(self) -> dict:
        return {"average": self.buf}

    def restore_state(self, saved: dict) -> dict:
        return {"average": self.buf}


class _Counters:
    """A part without a key: its own keys of state.json, handed the whole of it and the checkpoint back."""

    def __init__(self, updates: int = 0):
        self.updates, self.given = updates, None

    def state_dict(self) -> dict:
        return {"updates": self.updates, "skipped_steps": 0}

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        self.updates, self.given = state["updates"], (state["step"], ckpt)


def test_registered_parts_are_what_a_checkpoint_saves_and_restores(tmp_path):
    """Checkpointer.register drives save and restore: each part's ``state_dict`` under its key of state.json
    (null for a part the run has not; a part without a key writes keys of its own), its ``full_state`` as
    optimizer.safetensors tensors after the optimizer's; a restore into fresh parts fills the buffers their
    ``restore_state`` names and hands each its entry back, bit for bit; a part the checkpoint holds nothing
    of (registered since) is left as it is. Real components (early stopping, the fp16 loss scaler), real
    files."""
    from safetensors.numpy import load_file
    from trainrun import checkpoint as K
    from trainrun.comm import SingleProcess
    from trainrun.run.stopping import EarlyStopping
    from trainrun.step.flat import FlatLayout
    from trainrun.step.precision import LossScaler
    n = 1000
    layout = FlatLayout(["a", "b"], [(10, 40), (n - 400,)], [0, 400], n)
    rng = np.random.default_rng(0)
    params, exp_avg = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)

    def parts(updates=0):
        return [(None, _Counters(updates)), ("average", _Average(n)),
                ("early_stopping", EarlyStopping(3, 0.0, "eval_accuracy")), ("loss_scaler", LossScaler(init_scale=2.0 ** 10, growth_interval=2)), ("absent", None)]

    saving = parts(updates=7)
    (_, average), (_, stopping), (_, scaler) = saving[1:4]
    average.buf[...], average.count = rng.standard_normal(n, dtype=np.float32), 5
    for step, accuracy in ((1, 0.5), (2, 0.75), (3, 0.5)):
        stopping.update(step, {"eval_accuracy": accuracy})
    for finite in (True, False, True):
        scaler.update(finite)
    ck = K.Checkpointer(str(tmp_path / "run"), SingleProcess(60.0), keep_last=1)
    for key, part in saving:
        ck.register(key, part)
    ck.save(3, layout, {"params": params, "exp_avg": exp_avg}, {"loader": {"position": 0}, "eval": None},
            "config: {}\n")
    ck.finish()
    ckpt = os.path.join(str(tmp_path / "run"), "checkpoints", "3")
    K.verify(ckpt)
    state = K.read_state(ckpt)
    assert state["updates"] == 7 and state["skipped_steps"] == 0 and state["eval"] is None
    assert state["average"] == {"count": 5} and state["absent"] is None
    assert state["early_stopping"] == {"metric": "eval_accuracy", "best": 0.75, "best_step": 2,
                                       "evals_since_best": 1}
    assert state["loss_scaler"] == {"scale": 2.0 ** 9, "good_steps": 1}
    assert state["optimizer_states"] == ["exp_avg", "average"]
    saved = load_file(os.path.join(ckpt, "optimizer.safetensors"))
    assert np.array_equal(np.concatenate([saved["average/a"].reshape(-1), saved["average/b"]]), average.buf)

    restoring = parts() + [("registered_since", EarlyStopping(3, 0.0, "eval_accuracy"))]
    ck = K.Checkpointer(str(tmp_path / "run"), SingleProcess(60.0), keep_last=1)
    for key, part in restoring:
        ck.register(key, part)
    got_params, got_exp_avg = np.zeros(n, np.float32), np.zeros(n, np.float32)
    assert ck.restore(ckpt, layout, got_params, {"exp_avg": got_exp_avg}) == state
    assert np.array_equal(got_params, params) and np.array_equal(got_exp_avg, exp_avg)
    (_, counters), (_, average2), (_, stopping2), (_, scaler2) = restoring[:4]
    assert counters.updates == 7 and counters.given == (3, ckpt)
    assert np.array_equal(average2.buf, average.buf) and average2.count == 5
    assert stopping2.state_dict() == stopping.state_dict()
    assert (scaler2.scale, scaler2.good_steps, float(scaler2.graph_input)) == (2.0 ** 9, 1, 2.0 ** 9)
    assert restoring[-1][1].state_dict() == {"metric": "eval_accuracy", "best": None, "best_step": None,
                                             "evals_since_best": 0}
    # a key registered again: its new part in the old one's place (what a save writes and load_keyed fills)
    rebuilt = EarlyStopping(3, 0.0, "eval_accuracy")
    ck.register("early_stopping", rebuilt)
    assert [k for k, _ in ck.parts] == [k for k, _ in restoring]
    assert ck.entries()["early_stopping"] == rebuilt.state_dict() != stopping.state_dict()
    ck.load_keyed(state)
    assert rebuilt.state_dict() == stopping.state_dict()


def test_checkpoint_write_holds_its_step_without_a_copy_of_the_buffers(tmp_path):
    """The tensors are written at the step (training changes the buffers right after start()), without a
    snapshot of the buffers in the process: Python's allocations stay below half of them."""
    import hashlib
    import tracemalloc

    from safetensors.numpy import load_file
    from trainrun import checkpoint as K
    from trainrun.step.flat import FlatLayout
    n = 2 << 20
    layout = FlatLayout(["a", "b"], [(n // 4, 2), (n // 2,)], [0, n // 2], n)
    rng = np.random.default_rng(0)
    buffers = {k: rng.standard_normal(n, dtype=np.float32) for k in ("params", "exp_avg", "exp_avg_sq")}
    saved = {k: v.copy() for k, v in buffers.items()}
    writer = K.CheckpointWriter(str(tmp_path / "run"), rank=0, world_size=1, keep_last=1)
    meta = {"format_version": K.FORMAT_VERSION, "step": 1, "loader": {"position": 0}}
    tracemalloc.start()
    try:
        writer.start(1, layout, buffers, meta, "config: {}\n")
        for v in buffers.values():      # the next step, while the files are synced in the background
            v += 1.0
        writer.wait()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert writer.status() == (1.0, 0.0), writer.error_text()
    ckpt = writer.commit()
    K.verify(ckpt)
    model, opt = load_file(os.path.join(ckpt, "model.safetensors")), load_file(os.path.join(ckpt, "optimizer.safetensors"))
    assert np.array_equal(model["a"].reshape(-1), saved["params"][:n // 2])
    assert np.array_equal(model["b"], saved["params"][n // 2:])
    for s in ("exp_avg", "exp_avg_sq"):
        assert np.array_equal(np.concatenate([opt[f"{s}/a"].reshape(-1), opt[f"{s}/b"]]), saved[s])
    with open(os.path.join(ckpt, "rank-0.json")) as fh:
        assert json.load(fh)["params_sha256"] == hashlib.sha256(saved["params"].tobytes()).hexdigest()
    assert peak < 3 * n * 4 / 2, peak


@pytest.mark.torch
def test_export_matches_transformers_and_runs_in_plain_onnxruntime(tmp_path, byte_dataset):
    # non-default LayerNorm epsilon (transformers must agree) and initialisation scale
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 512,
             "layer_norm_epsilon": 1e-3}
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 5, "model.gpt2": {
        **shape, "initializer_range": 0.05}})
    mpirun(2, "--config", cfg)
    from safetensors.numpy import load_file
    initial = load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))
    assert 0.045 < initial["transformer.wte.weight"].std() < 0.055        # 16,384 draws of N(0, 0.05)
    ckpt = tmp_path / "run" / "checkpoints" / "5"
    assert (tmp_path / "run" / "model.onnx").exists()           # exported at the end of training
    proc = run([TRAINRUN, "export", str(ckpt), "--output", str(tmp_path / "m.onnx")], check=0)
    assert "max |logits - eval graph|" in proc.stdout

    import onnx
    import onnxruntime as ort
    import torch
    m = onnx.load(str(tmp_path / "m.onnx"))
    assert not any(n.domain == "com.microsoft" for n in m.graph.node)     # standard ONNX only
    assert [i.name for i in m.graph.input] == ["input_ids"]
    hf = hf_gpt2(shape, load_file(str(ckpt / "model.safetensors"))).eval()
    ids = np.random.default_rng(0).integers(0, 512, (3, 32))
    ours = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"input_ids": ids})[0]
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - ref).max() < 1e-4

    # the newest plain onnxruntime, in a venv of its own, runs it
    venv = tmp_path / "plain"
    run([sys.executable, "-m", "venv", str(venv)], check=0, timeout=120)
    pip = run([str(venv / "bin/pip"), "install", "-q", "onnxruntime", "numpy"], timeout=600)
    if pip.returncode != 0:
        pytest.skip(f"cannot install plain onnxruntime from the package index: {pip.stderr[-300:]}")
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "ref.npy", ref)
    script = ("import numpy as np, onnxruntime as ort, sys; s = ort.InferenceSession(sys.argv[1]); "
              "out = s.run(['logits'], {'input_ids': np.load(sys.argv[2])})[0]; "
              "print(ort.__version__, float(np.abs(out - np.load(sys.argv[3])).max()))")
    proc = run([str(venv / "bin/python"), "-c", script, str(tmp_path / "m.onnx"), str(tmp_path / "ids.npy"),
                str(tmp_path / "ref.npy")], check=0)
    version, diff = proc.stdout.split()
    assert not version.startswith("1.19") and float(diff) < 1e-4
