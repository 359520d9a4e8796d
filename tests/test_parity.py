"""trainrun (2 MPI ranks) against an independent PyTorch run: transformers' GPT-2 and torch.optim.AdamW,
fed the global batches of the documented sample order and the documented learning-rate schedule,
both computed by scripts/reference.py from the dataset files, not by trainrun's loader or schedule.

What float32 can promise on any machine, and so what is asserted:

* From the SAME weights and optimizer state, one step is the same computation in another summation
  order: the loss agrees to a few float32 roundings (seen: 2e-7 relative; bound 1e-5). So every 5
  steps the reference restarts from trainrun's checkpoint (weights and AdamW moments) and the first
  step of each window is held to that bound. The gradient norm is trainrun's float32 dot product of
  the whole gradient buffer (0.55M values; BLAS sdot, whose blocking differs between CPUs): its
  rounding is about sqrt(N) * eps = 5e-5 relative (seen: 4e-5), so it gets 1e-3.
* Two correct float32 runs drift apart over steps (training amplifies rounding differences; over 50
  steps one machine saw 2.5e-4 relative in the loss, another 1e-5), so the other steps of a window
  (at most 4 steps of drift) get 1e-4 on the loss and 1e-3 on the gradient norm, and the change of
  the parameters over the window must match to 1e-3 of its size. A wrong sample, a wrong learning
  rate in any step (an off-by-one in warmup alone moves the update by 1/t, over 2%), a wrong
  gradient scale or update rule is far beyond these bounds.
* The logged learning rate equals the reference schedule to float32 precision.
"""

import os
import sys

import pytest

from trainrun import config as C

from conftest import ROOT, adamw_windows, hf_gpt2, mpirun, read_metrics, write_config

torch = pytest.importorskip("torch", reason="needs torch (the test extra), not installed here")

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reference as R  # noqa: E402  (scripts/reference.py: the independent twins)

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

STEPS, WINDOW = 50, 5


def test_each_step_matches_pytorch_from_the_same_weights(tmp_path, byte_dataset):
    tiny = C.load_config(os.path.join(ROOT, "configs", "gpt2-tiny.yaml"))
    shape = {k: getattr(tiny.model.gpt2, k) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
    seq, lr, warmup, min_lr, wd, seed = 128, 3e-3, 10, 3e-4, 0.1, 5
    cfg_path = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model.gpt2": shape, "data.seq_len": seq, "train.max_steps": STEPS, "train.micro_batch_size": 4,
        "run.seed": seed, "checkpoint": {"every": WINDOW, "keep_last": STEPS},
        "optimizer": {"name": "adamw", "lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": wd,
                      "eps_mode": "torch", "max_grad_norm": 1.0},
        "lr_schedule": {"name": "cosine", "warmup_steps": warmup, "min_lr": min_lr}})
    mpirun(2, "--config", cfg_path)
    run_dir = tmp_path / "run"
    train, _ = read_metrics(str(run_dir))
    assert sorted(train) == list(range(1, STEPS + 1))
    batches = R.global_batches(os.path.join(byte_dataset, "train"), seq, 8, seed)

    def loss_of(model):
        ids, labels = next(batches)
        logits = model(torch.from_numpy(ids)).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(labels).reshape(-1))

    worst = adamw_windows(run_dir, C.load_config(cfg_path), train, WINDOW, lambda params: hf_gpt2(shape, params),
                          loss_of, lambda t: R.learning_rate(t, lr, STEPS, "cosine", warmup, min_lr))
    assert worst["first_loss"] <= 1e-5 and worst["loss"] <= 1e-4, worst
    assert worst["first_grad_norm"] <= 1e-3 and worst["grad_norm"] <= 1e-3, worst
    assert worst["update"] <= 1e-3, worst
    assert train[STEPS]["loss"] < train[1]["loss"] - 1.0
