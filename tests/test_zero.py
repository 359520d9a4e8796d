"""ZeRO-1 (distributed.zero_stage: 1): the same training as stage 0, 1/N of the optimizer state per rank,
checkpoints that resume across stages and rank counts."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import mpirun, mpirun_probe, read_metrics, write_config

STEPS = 50
PIECE = 1000     # stage 1's checkpoints gather the optimizer state in pieces this small: the tiny model's parts
                 # and tensors then end inside pieces, on every rank count


def _train(tmp_path, data, name, ranks, stage, optimizer, **extra):
    cfg = write_config(tmp_path / f"{name}.yaml", data, **{
        "run.output_dir": str(tmp_path / name), "train.max_steps": STEPS, "train.micro_batch_size": 2,
        "distributed.zero_stage": stage, "optimizer": optimizer, "checkpoint": {"every": 10, "keep_last": 2},
        **extra})
    mpirun_probe(ranks, "--config", cfg, gather_piece=PIECE)
    return read_metrics(str(tmp_path / name))[0], str(tmp_path / name)


ADAMW = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "max_grad_norm": 1.0}
# LAMB with a gradient clip that is active: the global norm from the parts' sums decides it
LAMB = {"name": "lamb", "lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 0.5}


@pytest.mark.parametrize("ranks,optimizer,builder", [(2, ADAMW, "auto"), (3, LAMB, "auto"), (2, LAMB, "auto"),
                                                     (3, ADAMW, "auto"), (2, ADAMW, "trainrun")],
                         ids=["2-adamw", "3-lamb", "2-lamb", "3-adamw", "2-adamw-trainrun-builder"])
def test_stage1_losses_equal_stage0(tmp_path, byte_dataset, ranks, optimizer, builder):
    """50 steps on 2 and 3 ranks: stage 1's losses and gradient norms are stage 0's (1e-6), and its final
    weights too. The tiny GPT-2 (about 26k parameters) is cut into parts inside tensors on every rank
    count here, so LAMB's trust ratio needs the sums of squares combined over ranks. The same on the
    train graph of trainrun's gradient builder (graphs.builder)."""
    ref, ref_dir = _train(tmp_path, byte_dataset, "s0", ranks, 0, optimizer, **{"graphs.builder": builder})
    got, got_dir = _train(tmp_path, byte_dataset, "s1", ranks, 1, optimizer, **{"graphs.builder": builder})
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in ref:
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-6, (s, got[s]["loss"], ref[s]["loss"])
        # summed in another order (per part; and on 3 ranks MPI's reduce-scatter adds the ranks' gradients
        # in another order than its allreduce): float32 rounding, carried on by the clip factor and AdamW's
        # 1/sqrt(v); a part missing from the norm would be off by far more
        assert abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) <= 1e-3 * ref[s]["grad_norm"], s
    assert any(ref[s]["grad_norm"] > optimizer["max_grad_norm"] for s in ref)    # clipping took part
    a = load_file(os.path.join(ref_dir, "checkpoints", str(STEPS), "model.safetensors"))
    b = load_file(os.path.join(got_dir, "checkpoints", str(STEPS), "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-4, err_msg=k)
    # the saved moments are full tensors by name, as stage 0 saves them
    oa = load_file(os.path.join(ref_dir, "checkpoints", str(STEPS), "optimizer.safetensors"))
    ob = load_file(os.path.join(got_dir, "checkpoints", str(STEPS), "optimizer.safetensors"))
    assert oa.keys() == ob.keys() and {k.split("/")[0] for k in oa} == {"exp_avg", "exp_avg_sq"}
    for k in oa:
        assert oa[k].shape == ob[k].shape
        np.testing.assert_allclose(ob[k], oa[k], rtol=1e-3, atol=1e-6, err_msg=k)


def test_resume_across_stages_and_rank_counts(tmp_path, byte_dataset):
    """A stage-1 checkpoint (moments gathered on rank 0, full tensors by name) continues with stage 0 on 2
    ranks as the uninterrupted stage-0 run does (1e-6), and with stage 1 on 1 rank; a stage-0 checkpoint
    continues with stage 1 on 3 ranks (the global batch kept: 6)."""
    common = {"train.max_steps": 30, "train.micro_batch_size": 3, "checkpoint.every": 15,
              "checkpoint.keep_last": 5, "optimizer": ADAMW}

    def start(name, stage, **extra):
        cfg = write_config(tmp_path / f"{name}.yaml", byte_dataset, **{
            **common, "run.output_dir": str(tmp_path / name), "distributed.zero_stage": stage, **extra})
        mpirun_probe(2, "--config", cfg, gather_piece=PIECE)
        return tmp_path / name

    straight = start("straight", 0)
    ref = read_metrics(str(straight))[0]
    split = start("split", 1, **{"train.stop_at": 15})
    assert sorted(read_metrics(str(split))[0]) == list(range(1, 16))

    def resume(src, name, world, sets):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        for d in ("30",):
            shutil.rmtree(dst / "checkpoints" / d, ignore_errors=True)
        (dst / "metrics.jsonl").write_text("")
        args = ["resume", str(dst / "checkpoints" / "15"), "--set", "train.stop_at=0"]
        for s in sets:
            args += ["--set", s]
        mpirun(world, *args)
        got = read_metrics(str(dst))[0]
        assert sorted(got) == list(range(16, 31)), name
        return got

    to0 = resume(split, "to0", 2, ["distributed.zero_stage=0"])
    for s in to0:
        assert abs(to0[s]["loss"] - ref[s]["loss"]) <= 1e-6, (s, to0[s]["loss"], ref[s]["loss"])
    # other rank counts: the sums over ranks in another order (float32 rounding), amplified step by step by
    # AdamW's m / sqrt(v) (see test_checkpoint.py); lost or misplaced moments move the losses by > 1e-2
    for name, src, world, sets in [("to1x1", split, 1, ["train.gradient_accumulation_steps=2"]),
                                   ("s0to1x3", straight, 3, ["distributed.zero_stage=1", "train.micro_batch_size=2"])]:
        got = resume(src, name, world, sets)
        assert got[16]["loss"] == pytest.approx(ref[16]["loss"], rel=1e-5), name
        np.testing.assert_allclose([got[s]["loss"] for s in got], [ref[s]["loss"] for s in got], rtol=1e-3,
                                   err_msg=name)


def test_optimizer_state_is_split_over_ranks(tmp_path, byte_dataset):
    """Each rank reports the part it updates and the optimizer state it holds: stage 1's parts tile the
    parameters and each holds 1/3 of stage 0's state (AdamW: 2 x 4 bytes per parameter). Over MPI alone
    (intra_node: mpi; tests/test_shared.py splits it within a node)."""
    held = {}
    for stage in (0, 1):
        cfg = write_config(tmp_path / f"{stage}.yaml", byte_dataset, **{
            "run.output_dir": str(tmp_path / str(stage)), "train.max_steps": 2, "run.log_level": "devinfo",
            "distributed.zero_stage": stage, "distributed.intra_node": "mpi"})
        out = mpirun(3, "--config", cfg).stdout
        held[stage] = sorted(
            (int(r), int(lo), int(hi), int(n), int(b.replace(",", "")))
            for r, lo, hi, n, b in re.findall(r"\[rank (\d)\] zero stage \d: this rank updates parameters "
                                              r"(\d+):(\d+) of (\d+) and holds ([\d,]+) bytes", out))
    n = held[0][0][3]
    assert held[0] == [(r, 0, n, n, 8 * n) for r in range(3)]
    assert [h[1:3] for h in held[1]] == [(0, held[1][1][1]), (held[1][1][1], held[1][2][1]), (held[1][2][1], n)]
    for r, lo, hi, _, nbytes in held[1]:
        assert abs((hi - lo) - n / 3) <= 1 and nbytes == 8 * (hi - lo)


# the second block at half the lr, the position embedding decayed 2.0 (its rows past data.seq_len get no
# gradient: their step 1 is the decay alone); layer decay 0.8 over the 2 blocks
GROUPS = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "max_grad_norm": 1.0, "layer_decay": 0.8,
          "groups": [{"params": "transformer.h.1.*", "lr_scale": 0.5},
                     {"params": "transformer.wpe.*", "weight_decay": 2.0}]}


def _group_of(name):
    """(lr, weight decay) of a parameter of the 2-block GPT-2 under GROUPS, by the documented rule written
    out here: embeddings 0.8 ** 3, block i 0.8 ** (2 - i), ln_f 1; no_decay's defaults take biases and
    LayerNorms out of the decay."""
    depth = 3 if name.startswith(("transformer.wte.", "transformer.wpe.")) else \
        2 - int(name.split(".")[2]) if name.startswith("transformer.h.") else 0
    lr = 3e-3 * (0.5 if name.startswith("transformer.h.1.") else 1.0) * 0.8 ** depth
    wd = 2.0 if name.startswith("transformer.wpe.") else 0.0 if ("bias" in name or ".ln_" in name) else 0.1
    return lr, wd


def test_groups_and_layer_decay_train_alike_on_stage_0_and_zero_1(tmp_path, byte_dataset):
    """optimizer.groups and layer_decay in real runs on 2 ranks: ZeRO-1 (parts cut inside tensors, the
    host kernel per part) loses as stage 0 does over 10 steps (1e-6), and its first update of each tensor
    is AdamW's at that tensor's own lr and decay: p1 = p0 (1 - lr wd) - lr m/(sqrt(v) + eps), whose
    largest step is lr where |g| >> eps, and exactly the decay on wpe's rows that see no gradient."""
    runs = {}
    for stage in (0, 1):
        name = f"groups{stage}"
        cfg = write_config(tmp_path / f"{name}.yaml", byte_dataset, **{
            "run.output_dir": str(tmp_path / name), "train.max_steps": 10, "train.micro_batch_size": 2,
            "model.gpt2.n_positions": 64, "distributed.zero_stage": stage, "optimizer": GROUPS,
            "lr_schedule": {"name": "constant"}, "checkpoint": {"every": stage, "keep_last": 10}})
        mpirun(2, "--config", cfg)
        runs[stage] = read_metrics(str(tmp_path / name))[0]
    assert sorted(runs[1]) == sorted(runs[0]) == list(range(1, 11))
    for s in runs[0]:
        assert abs(runs[1][s]["loss"] - runs[0][s]["loss"]) <= 1e-6, s
    assert runs[1][1]["lr"] == pytest.approx(3e-3, rel=1e-6)

    p0 = load_file(str(tmp_path / "groups1" / "graphs" / "weights.safetensors"))
    p1 = load_file(str(tmp_path / "groups1" / "checkpoints" / "1" / "model.safetensors"))
    lrs = set()
    for name, before in p0.items():
        lr, wd = _group_of(name)
        step = p1[name].astype(np.float64) - before * (1 - lr * wd)
        assert abs(np.abs(step).max() / lr - 1) < 2e-2, (name, np.abs(step).max(), lr)
        lrs.add(round(lr, 9))
    assert len(lrs) == 4        # 3e-3 x 0.8^3 (embeddings), x 0.8^2 (h.0), x 0.5 x 0.8 (h.1), x 1 (ln_f)
    unseen = slice(32, 64)      # positions past data.seq_len: no gradient, the decay alone
    lr, wd = _group_of("transformer.wpe.weight")
    wpe0, wpe1 = p0["transformer.wpe.weight"][unseen], p1["transformer.wpe.weight"][unseen]
    np.testing.assert_allclose(wpe1, wpe0 * (1 - lr * wd), rtol=1e-6)


def _peaks(out: str) -> dict[int, int]:
    """Each rank's whole-run peak RSS in bytes, from rank_probe.py's lines."""
    return {int(r): int(kb) * 1024 for r, kb in re.findall(r"PEAK_RSS_KB (\d+) (\d+)", out)}


def test_zero1_checkpoints_keep_rank0_peak_below_stage0(tmp_path, byte_dataset):
    """rank 0 writes every checkpoint; with ZeRO-1 it gathers the moments from the other ranks piece by piece
    as it writes them, never a whole state. Measured over the whole run (getrusage's peak RSS: training, a
    checkpoint every step, the end-of-run export) at 2 ranks, on a model whose AdamW moments dominate the
    rest (4 blocks of width 512: 12.6M parameters, 2 x 50 MB of moments): at stage 1 rank 0 peaks less than a
    quarter of the moments above rank 1 (which gathers nothing; gathering a whole state, half the moments,
    is far more), and below stage 0's rank 0, which holds all the moments, by at least a quarter of them.
    The moments stage 1 saves piece by piece are those stage 0 saves (within rounding)."""
    peaks = {}
    for stage in (0, 1):
        cfg = write_config(tmp_path / f"{stage}.yaml", byte_dataset, **{
            "run.output_dir": str(tmp_path / str(stage)), "train.max_steps": 2, "checkpoint.every": 1,
            "train.micro_batch_size": 2, "data.seq_len": 16, "distributed.zero_stage": stage,
            "distributed.intra_node": "mpi",
            "model.gpt2": {"n_layer": 4, "n_head": 8, "n_embd": 512, "n_positions": 16, "vocab_size": 512}})
        if stage:        # the same graphs: prepared once
            shutil.copytree(tmp_path / "0" / "graphs", tmp_path / "1" / "graphs", copy_function=os.link)
        out = mpirun_probe(2, "--config", cfg, timeout=600)
        peaks[stage] = _peaks(out.stdout)
        assert sorted(peaks[stage]) == [0, 1], out.stdout
    n = json.load(open(tmp_path / "0" / "graphs" / "manifest.json"))["num_params"]
    moments = 2 * 4 * n
    print(f"whole-run peak RSS, MB: stage 0 rank 0 {peaks[0][0] / 1e6:.1f}, rank 1 {peaks[0][1] / 1e6:.1f}; "
          f"stage 1 rank 0 {peaks[1][0] / 1e6:.1f}, rank 1 {peaks[1][1] / 1e6:.1f}; moments {moments / 1e6:.1f}")
    assert peaks[1][0] - peaks[1][1] < moments / 4, (peaks, moments)
    assert peaks[0][0] - peaks[1][0] >= moments / 4, (peaks, moments)
    oa = load_file(str(tmp_path / "0" / "checkpoints" / "2" / "optimizer.safetensors"))
    ob = load_file(str(tmp_path / "1" / "checkpoints" / "2" / "optimizer.safetensors"))
    assert oa.keys() == ob.keys()
    for k in oa:
        np.testing.assert_allclose(ob[k], oa[k], rtol=1e-3, atol=1e-6, err_msg=k)
