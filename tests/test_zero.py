"""ZeRO-1 (distributed.zero_stage: 1): the same training as stage 0, 1/N of the optimizer state per rank,
checkpoints that resume across stages and rank counts."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import mpirun, read_metrics, run, TRAINRUN, write_config

STEPS = 50


def _train(tmp_path, data, name, ranks, stage, optimizer, **extra):
    cfg = write_config(tmp_path / f"{name}.yaml", data, **{
        "run.output_dir": str(tmp_path / name), "train.max_steps": STEPS, "train.micro_batch_size": 2,
        "distributed.zero_stage": stage, "optimizer": optimizer, **extra})
    mpirun(ranks, "--config", cfg)
    return read_metrics(str(tmp_path / name))[0], str(tmp_path / name)


ADAMW = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "max_grad_norm": 1.0}
# LAMB with a gradient clip that is active: the global norm from the parts' sums decides it
LAMB = {"name": "lamb", "lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 0.5}


@pytest.mark.parametrize("ranks,optimizer", [(2, ADAMW), (3, LAMB), (2, LAMB), (3, ADAMW)],
                         ids=["2-adamw", "3-lamb", "2-lamb", "3-adamw"])
def test_stage1_losses_equal_stage0(tmp_path, byte_dataset, ranks, optimizer):
    """50 steps on 2 and 3 ranks: stage 1's losses and gradient norms are stage 0's (1e-6), and its final
    weights too. The tiny GPT-2 (about 26k parameters) is cut into parts inside tensors on every rank
    count here, so LAMB's trust ratio needs the sums of squares combined over ranks."""
    ref, ref_dir = _train(tmp_path, byte_dataset, "s0", ranks, 0, optimizer)
    got, got_dir = _train(tmp_path, byte_dataset, "s1", ranks, 1, optimizer)
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
