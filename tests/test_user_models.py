"""A user's own models through ``mpirun trainrun``: SqueezeNet 1.1 with BatchNorm on scikit-learn's digits
(the recipe, PyTorch parity on 1 and 2 ranks), a graph that computes its own loss, regression losses,
the cross-entropy layouts and metrics, and the bad inputs of each (a named error, exit 2).

References: PyTorch float64 (torch.nn.functional ops written out here, the network from the builder's
architecture list only) fed the batches of the documented order (``data.shuffle: false``: step t takes
samples G (t-1) .. G t - 1, rank r its r-th slice); NumPy for metrics. BatchNorm's running statistics
follow ONNX's definition (population variance of the batch; new = 0.9 old + 0.1 batch), and with 2 ranks
trainrun averages them over ranks before every checkpoint and evaluation (checkpoint.every 1 here: after
every step) -- the reference does the same.
"""

import json
import math
import os
import sys

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file

from conftest import ROOT, TRAINRUN, TRAINRUN_DATA, mpirun, read_metrics, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import squeezenet_digits as SQ  # noqa: E402  (the model and data builder of the recipe)

pytest.importorskip("sklearn")


def tensors(npz, out, *extra):
    run([TRAINRUN_DATA, "tensors", "--input", str(npz), "--output", str(out), *extra], check=0)
    return str(out)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """{size: (root, (train x, y), (eval x, y))} for 32x32 (the recipe) and 24x24 (parity) images."""
    out = {}
    for size in (32, 24):
        root = tmp_path_factory.mktemp(f"digits{size}")
        (tr, ev) = SQ.digits(size)
        for split, (x, y) in (("train", tr), ("eval", ev)):
            np.savez(root / f"{split}.npz", x=x, label=y)
            tensors(root / f"{split}.npz", root / split)
        out[size] = (root, tr, ev)
    return out


def recipe_config(tmp_path, model_path, data_root, **over):
    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "squeezenet-digits.yaml")))
    cfg["run"]["output_dir"] = str(tmp_path / "run")
    cfg["model"]["onnx"] = str(model_path)
    cfg["data"].update(train=str(data_root / "train"), eval=str(data_root / "eval"))
    for key, value in over.items():
        section, name = key.split(".", 1)
        cfg[section][name] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# ------------------------------------------------------------------------------------------- the recipe
def test_squeezenet_digits_recipe_on_two_ranks(tmp_path, digits):
    """The recipe (shortened to 150 steps) on 2 ranks reaches >= 0.9 eval accuracy; the exported model,
    run by a plain InferenceSession, gives that accuracy on the same eval images, and holds the
    checkpoint's BatchNorm statistics."""
    root, _, (x_eval, y_eval) = digits[32]
    onnx.save(SQ.build(batchnorm=True), str(tmp_path / "sq.onnx"))
    cfg = recipe_config(tmp_path, tmp_path / "sq.onnx", root, **{"train.max_steps": 150, "train.eval_every": 75,
                                                                  "checkpoint.every": 0})
    proc = mpirun(2, "--config", cfg, timeout=600)
    train, evals = read_metrics(str(tmp_path / "run"))
    assert sorted(evals) == [75, 150]
    final = evals[150]
    assert final["eval_accuracy"] >= 0.9 and final["eval_top5_accuracy"] >= final["eval_accuracy"]
    assert "accuracy" in proc.stdout
    import onnxruntime as ort
    sess = ort.InferenceSession(str(tmp_path / "run" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"]
    n = 5 * 64                 # eval_steps x global batch: the first n eval images, in order
    logits = sess.run(["logits"], {"x": x_eval[:n]})[0]
    correct = int((logits.argmax(1) == y_eval[:n]).sum())
    assert abs(correct - final["eval_accuracy"] * n) <= 1      # one near-tie may round the other way
    exported = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "run" / "model.onnx")).graph.initializer}
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "150" / "model.safetensors"))
    stats = [k for k in saved if "running" in k]
    assert len(stats) == 2 * 9 and all(np.array_equal(exported[k], saved[k]) for k in stats)
    assert not np.allclose(saved["features.0.bn.running_var"], 1.0)      # updated by training


# ------------------------------------------------------------------------------------------- parity
def torch_squeezenet(w, width, x, train, stats=None):
    """The network of scripts/squeezenet_digits.py in PyTorch float64 (functional, weights ``w``).
    ``train``: BatchNorm normalises by the batch's statistics and ``stats`` collects each BatchNorm's
    (batch mean, population variance); else by the running statistics in ``w``."""
    import torch.nn.functional as F

    def bn(name, h):
        if f"{name}.weight" not in w:
            return h
        if train:
            mean, var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
            stats[name] = (mean.detach(), var.detach())
        else:
            mean, var = w[f"{name}.running_mean"], w[f"{name}.running_var"]
        return (h - mean[None, :, None, None]) / (var[None, :, None, None] + 1e-5).sqrt() \
            * w[f"{name}.weight"][None, :, None, None] + w[f"{name}.bias"][None, :, None, None]

    def conv(name, h, pad=0, stride=1):
        return F.conv2d(h, w[name + ".weight"], w[name + ".bias"], stride=stride, padding=pad)

    i = 0
    for layer in SQ.architecture(width):
        if layer == "pool":
            x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        elif layer[0] == "conv1":
            x = F.relu(bn("features.0.bn", conv("features.0", x, stride=2)))
        else:
            s = F.relu(bn(f"fire{i}.squeeze_bn", conv(f"fire{i}.squeeze", x)))
            x = torch_cat(F.relu(conv(f"fire{i}.expand1x1", s)), F.relu(conv(f"fire{i}.expand3x3", s, pad=1)))
            i += 1
    return conv("classifier", x).mean((2, 3))


def torch_cat(a, b):
    import torch
    return torch.cat([a, b], 1)


WIDTH, SIZE, STEPS, WINDOW, LR = 0.25, 24, 20, 5, 0.05
FROZEN = ["features.0.*"]         # conv1 and its BatchNorm's scale/bias: not trained; its statistics still move


@pytest.mark.parametrize("world", [1, 2])
def test_squeezenet_matches_pytorch_on_the_same_batches(tmp_path, digits, world):
    """20 SGD steps (global batch 16: 1 rank x 16 or 2 ranks x 8, each normalising by its own batch) against
    PyTorch float64. From the SAME state a step is the same computation in another order: every 5 steps
    the reference restarts from trainrun's checkpoint (weights and BatchNorm statistics); the first step of
    a window is held to 1e-5, the others (float32 drift amplified by training over <= 4 steps) to 1e-4 on
    the loss; the weights and statistics (checkpointed every step) to 1e-3 of their change after the first
step of a window, 1e-2 after the others (one step was seen within 1.4e-4, five within 2e-3: BatchNorm over
8 images at 1x1 is sensitive). Then the
    final evaluation's loss and accuracy against the reference in eval mode."""
    import torch
    root, (x_tr, y_tr), (x_ev, y_ev) = digits[SIZE]
    onnx.save(SQ.build(WIDTH, SIZE, batchnorm=True, seed=3), str(tmp_path / "sq.onnx"))
    micro = 16 // world
    cfg = recipe_config(tmp_path, tmp_path / "sq.onnx", root, **{
        "model.frozen": FROZEN, "data.shuffle": False, "data.prefetch": 0,
        "train.micro_batch_size": micro, "train.max_steps": STEPS, "train.eval_every": 0, "train.eval_steps": 2,
        "train.log_every": 1, "optimizer.name": "sgd", "optimizer.lr": LR, "optimizer.weight_decay": 0.0,
        "optimizer.max_grad_norm": 0.0, "lr_schedule.name": "constant", "lr_schedule.warmup_steps": 0,
        "checkpoint.every": 1, "checkpoint.keep_last": STEPS, "tensorboard.enabled": False})
    data = yaml.safe_load(open(cfg))
    data["engine"] = {"threads": 1}
    open(cfg, "w").write(yaml.safe_dump(data))
    mpirun(world, "--config", cfg, timeout=600)
    out = tmp_path / "run"
    train, evals = read_metrics(str(out))
    assert sorted(train) == list(range(1, STEPS + 1))

    def state_at(step):
        f = out / ("graphs/weights.safetensors" if step == 0 else f"checkpoints/{step}/model.safetensors")
        got = {k: v.astype(np.float64) for k, v in load_file(str(f)).items()}
        return {**model_init, **got}       # frozen tensors (not in trainrun's files): the model's own

    model_init = {t.name: numpy_helper.to_array(t).astype(np.float64)
                  for t in onnx.load(str(tmp_path / "sq.onnx")).graph.initializer}

    initial = state_at(0)
    trained = [k for k in initial if "running" not in k and not k.startswith("features.0.")]
    no_gradient = [k for k in trained if k.endswith(".bias") and k[:-5] + "_bn.weight" in initial]
    checked = [k for k in trained if k not in no_gradient] + [k for k in initial if "running" in k]
    for start in range(0, STEPS, WINDOW):
        w = {k: torch.tensor(v) for k, v in state_at(start).items()}
        for t in range(start + 1, start + WINDOW + 1):
            p = {k: v.clone().requires_grad_(k in trained) for k, v in w.items()}
            rows = slice((t - 1) * 16, t * 16)
            losses, rank_stats = [], []
            for r in range(world):
                part = slice(rows.start + r * micro, rows.start + (r + 1) * micro)
                stats = {}
                logits = torch_squeezenet(p, WIDTH, torch.tensor(x_tr[part], dtype=torch.float64), True, stats)
                losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(y_tr[part])))
                rank_stats.append(stats)
            loss = sum(losses) / world
            loss.backward()
            bound = 1e-5 if t == start + 1 else 1e-4
            assert train[t]["loss"] == pytest.approx(loss.item(), rel=bound), (t, train[t]["loss"], loss.item())
            with torch.no_grad():
                for k in trained:
                    w[k] = p[k] - LR * p[k].grad
                for name in rank_stats[0]:      # each rank's own update, then the mean over ranks
                    for j, key in enumerate(("running_mean", "running_var")):
                        new = [0.9 * w[f"{name}.{key}"] + 0.1 * s[name][j] for s in rank_stats]
                        w[f"{name}.{key}"] = sum(new) / world
            got, before = state_at(t), state_at(start)
            bound = 1e-3 if t == start + 1 else 1e-2
            for k in checked:
                change = np.abs(w[k].numpy() - before[k]).max()
                assert np.abs(got[k] - w[k].numpy()).max() <= bound * change, (k, t)
            for k in no_gradient:      # a bias that BatchNorm follows: its exact gradient is 0
                assert np.abs(got[k] - before[k]).max() <= 1e-6, (k, t)
        for k in initial:
            if k.startswith("features.0.") and "running" not in k:
                assert np.array_equal(state_at(start + WINDOW)[k], initial[k]), k
    # the final evaluation: 2 eval steps of ``micro`` images per rank, BatchNorm by the running statistics
    n = 2 * micro * world
    with torch.no_grad():
        w = {k: torch.tensor(v) for k, v in state_at(STEPS).items()}
        logits = torch_squeezenet(w, WIDTH, torch.tensor(x_ev[:n], dtype=torch.float64), False)
        per_batch = [torch.nn.functional.cross_entropy(logits[i:i + micro], torch.tensor(y_ev[i:i + micro])).item()
                     for i in range(0, n, micro)]
    assert evals[STEPS]["eval_loss"] == pytest.approx(np.mean(per_batch), rel=1e-5)
    assert evals[STEPS]["eval_accuracy"] == (logits.numpy().argmax(1) == y_ev[:n]).sum() / n
