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

import glob
import os
import sys

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file

from conftest import ROOT, TRAINRUN, TRAINRUN_DATA, mpirun, read_metrics, run
from test_runner import _tensorboard_tags

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import squeezenet_digits as SQ  # noqa: E402  (the model and data builder of the recipe)


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
def test_the_recipe_commands_make_their_folders(tmp_path):
    """docs/models.md's first two recipe commands in a fresh directory (data/digits does not exist yet)."""
    with open(os.path.join(ROOT, "docs", "models.md"), encoding="utf-8") as fh:
        lines = [line.split("#")[0].split() for line in fh if line.startswith("python scripts/squeezenet_digits.py")]
    assert [line[2] for line in lines] == ["model", "data"]
    for line in lines:
        run([sys.executable, os.path.join(ROOT, line[1]), *line[2:]], cwd=str(tmp_path), check=0)
    assert onnx.load(str(tmp_path / "data" / "digits" / "squeezenet.onnx")).graph.node
    assert sorted(os.listdir(tmp_path / "data" / "digits")) == ["eval.npz", "squeezenet.onnx", "train.npz"]


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


WIDTH, SIZE, STEPS, WINDOW, LR = 0.25, 24, 20, 1, 0.05
FROZEN = ["features.0.*"]         # conv1 and its BatchNorm's scale/bias: not trained; its statistics still move


@pytest.mark.graphs
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.torch
def test_squeezenet_matches_pytorch_on_the_same_batches(tmp_path, digits, world):
    """20 SGD steps (global batch 16: 1 rank x 16 or 2 ranks x 8, each normalising by its own batch) against
    PyTorch float64. From the SAME state a step is the same computation in another order, so the reference
    restarts from trainrun's checkpoint (weights and BatchNorm statistics, checkpointed every step) before
    every step (WINDOW 1): the loss is held to 1e-5, the weights and statistics to 1e-3 of the step's change
    (one step was seen within 1.4e-4). Windows of several steps compare float32 drift amplified by
    training (BatchNorm over 8 images at 1x1 is sensitive): five steps were seen within 2e-3 of the change
    on one CPU and at 3.4e-2 on another, so the bound would be a machine's. Then the final evaluation's loss
    and accuracy against the reference in eval mode; the 2-rank run resumed from step 10 on 1 rank (16
    images a micro-batch) continues from the checkpoint's statistics."""
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
            loss, w = reference_step(w, trained, x_tr, y_tr, t, world)
            bound = 1e-5 if t == start + 1 else 1e-4
            assert train[t]["loss"] == pytest.approx(loss, rel=bound), (t, train[t]["loss"], loss)
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
    if world == 1:
        return
    # resume the 2-rank run from step 10 on 1 rank (16 images a micro-batch): the checkpoint's statistics
    # are restored, so step 11 is the reference's step from checkpoint 10 on one rank
    resumed = tmp_path / "resumed"
    import shutil
    shutil.copytree(out, resumed)
    for t in range(11, STEPS + 1):
        shutil.rmtree(resumed / "checkpoints" / str(t))
    (resumed / "metrics.jsonl").write_text("")
    run([TRAINRUN, "resume", str(resumed / "checkpoints" / "10"), "--set", "train.micro_batch_size=16",
         "--set", "train.max_steps=11"], check=0)
    loss, w = reference_step({k: torch.tensor(v) for k, v in state_at(10).items()}, trained, x_tr, y_tr, 11, 1)
    assert read_metrics(str(resumed))[0][11]["loss"] == pytest.approx(loss, rel=1e-5)
    got = load_file(str(resumed / "checkpoints" / "11" / "model.safetensors"))
    for k in checked:
        change = np.abs(w[k].numpy() - state_at(10)[k]).max()
        assert np.abs(got[k] - w[k].numpy()).max() <= 1e-3 * change, k


def reference_step(w, trained, x, y, t, world):
    """Step ``t`` (global batch 16, rank r its r-th slice, each normalising by its own batch) from state ``w``:
    (loss, new state): SGD on the trained weights; each rank's running-statistics update, then their mean."""
    import torch
    micro = 16 // world
    p = {k: v.clone().requires_grad_(k in trained) for k, v in w.items()}
    losses, rank_stats = [], []
    for r in range(world):
        part = slice((t - 1) * 16 + r * micro, (t - 1) * 16 + (r + 1) * micro)
        stats = {}
        logits = torch_squeezenet(p, WIDTH, torch.tensor(x[part], dtype=torch.float64), True, stats)
        losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(y[part])))
        rank_stats.append(stats)
    loss = sum(losses) / world
    loss.backward()
    w = dict(w)
    with torch.no_grad():
        for k in trained:
            w[k] = p[k] - LR * p[k].grad
        for name in rank_stats[0]:
            for j, key in enumerate(("running_mean", "running_var")):
                new = [0.9 * w[f"{name}.{key}"] + 0.1 * s[name][j] for s in rank_stats]
                w[f"{name}.{key}"] = sum(new) / world
    return loss.item(), w


# ------------------------------------------------------------------------------------------- other models
def mlp(path, out_dim, own_loss=False, seed=0, opset=17, shuffled=False):
    """x [b, 6] -> tanh -> out [b, out_dim]; with ``own_loss`` the graph also takes int64 ``y`` [b] and
    outputs its own loss ``nll``, the mean cross-entropy written out (LogSoftmax, OneHot; onnxruntime has no
    gradient of NegativeLogLikelihoodLoss) plus 1e-3 * sum(w2^2), and its own accuracy sums. ``shuffled``:
    the nodes stored in an order that is not topological (valid ONNX for onnxruntime, not for onnx's
    checker; some of onnxruntime's own test models are stored so)."""
    rng = np.random.default_rng(seed)
    w = {"w1": rng.normal(0, 0.5, (6, 16)).astype(np.float32), "b1": np.zeros(16, np.float32),
         "w2": rng.normal(0, 0.5, (16, out_dim)).astype(np.float32), "b2": np.zeros(out_dim, np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Tanh", ["h1"], ["h2"]), helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
             helper.make_node("Add", ["h3", "b2"], ["out"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 6])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", out_dim])]
    if own_loss:
        consts = {"depth": np.array([5], np.int64), "onoff": np.array([0.0, 1.0], np.float32),
                  "l2": np.array(1e-3, np.float32)}
        nodes += [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v)) for k, v in consts.items()]
        nodes += [helper.make_node("LogSoftmax", ["out"], ["logp"], axis=1),
                  helper.make_node("OneHot", ["y", "depth", "onoff"], ["onehot"], axis=1),
                  helper.make_node("Mul", ["logp", "onehot"], ["picked"]),
                  helper.make_node("ReduceSum", ["picked"], ["total"], keepdims=0),
                  helper.make_node("Size", ["y"], ["count"]),
                  helper.make_node("Cast", ["count"], ["countf"], to=TensorProto.FLOAT),
                  helper.make_node("Div", ["total", "countf"], ["mean_logp"]),
                  helper.make_node("Mul", ["w2", "w2"], ["w2sq"]),
                  helper.make_node("ReduceSum", ["w2sq"], ["w2norm"], keepdims=0),
                  helper.make_node("Mul", ["w2norm", "l2"], ["penalty"]),
                  helper.make_node("Sub", ["penalty", "mean_logp"], ["nll"]),
                  helper.make_node("ArgMax", ["out"], ["pred"], axis=1, keepdims=0),
                  helper.make_node("Equal", ["pred", "y"], ["hit"]),
                  helper.make_node("Cast", ["hit"], ["hitf"], to=TensorProto.FLOAT),
                  helper.make_node("ReduceSum", ["hitf"], ["metric/own_accuracy/sum"], keepdims=0),
                  helper.make_node("Size", ["y"], ["n"]),
                  helper.make_node("Cast", ["n"], ["metric/own_accuracy/count"], to=TensorProto.FLOAT)]
        inputs.append(helper.make_tensor_value_info("y", TensorProto.INT64, ["b"]))
        outputs = [helper.make_tensor_value_info("nll", TensorProto.FLOAT, []),
                   helper.make_tensor_value_info("metric/own_accuracy/sum", TensorProto.FLOAT, []),
                   helper.make_tensor_value_info("metric/own_accuracy/count", TensorProto.FLOAT, [])] + outputs
    if shuffled:        # consumers before their producers
        nodes = nodes[::-1]
    g = helper.make_graph(nodes, "mlp", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return w


def np_forward(w, x):
    return np.tanh(x.astype(np.float64) @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]


def small_run(tmp_path, model, data_dir, **sections):
    cfg = {"run": {"name": "u", "output_dir": str(tmp_path / "run")},
           "model": {"builtin": None, "onnx": str(tmp_path / "m.onnx"), **model},
           "data": {"train": data_dir + "/train", "eval": data_dir + "/eval", "shuffle": False, "prefetch": 0},
           "train": {"micro_batch_size": 8, "max_steps": 30, "eval_every": 0, "eval_steps": 2, "log_every": 1},
           "optimizer": {"name": "adamw", "lr": 0.03, "max_grad_norm": 0.0}, "lr_schedule": {"name": "constant"},
           "checkpoint": {"every": 0}, "tensorboard": {"enabled": False}, "engine": {"threads": 1}}
    for k, v in sections.items():
        cfg[k].update(v)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "c.yaml")


def test_external_data_outside_the_model_folder_is_refused(tmp_path, tabular):
    """A weight file that is a link out of the model's folder: exit 2 naming the tensor and the path, nothing
    prepared (onnx would follow the link: another file's bytes would be the weights); a link inside the
    folder is read."""
    data, _ = tabular
    w = mlp(tmp_path / "plain.onnx", 5)
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save_model(onnx.load(str(tmp_path / "plain.onnx")), str(folder / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    os.replace(folder / "weights.bin", folder / "real.bin")
    os.symlink("real.bin", folder / "weights.bin")
    cfg = small_run(tmp_path, {"onnx": str(folder / "m.onnx"), "loss": {"logits": "out"}}, data,
                    data={"inputs": {"labels": "y"}})
    try:        # onnx 1.17 reads a linked data file; later releases refuse any link, saying so
        onnx.load(str(folder / "m.onnx"))
        links_read = True
    except Exception as exc:        # noqa: BLE001 - onnx's own error type differs between releases
        assert "symbolic link" in str(exc), exc
        links_read = False
    if links_read:
        run([TRAINRUN, "prepare", "--config", cfg], check=0)
        weights = load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))
        assert all(np.array_equal(weights[k], v) for k, v in w.items())
    else:
        p = run([TRAINRUN, "prepare", "--config", cfg], check=2)
        assert "model.onnx: cannot load" in p.stderr and "symbolic link" in p.stderr and "Traceback" not in p.stderr

    (tmp_path / "other.bin").write_bytes(os.urandom((folder / "real.bin").stat().st_size))
    (folder / "weights.bin").unlink()
    os.symlink(tmp_path / "other.bin", folder / "weights.bin")
    cfg = small_run(tmp_path, {"onnx": str(folder / "m.onnx"), "loss": {"logits": "out"}}, data,
                    run={"output_dir": str(tmp_path / "run2")}, data={"inputs": {"labels": "y"}})
    p = run([TRAINRUN, "--config", cfg], check=2)
    assert (f"tensor 'w1' has its external data in 'weights.bin', which is {tmp_path / 'other.bin'}, outside "
            f"the model's folder {folder}") in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "run2" / "graphs").exists()    # refused at start


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    """x [6] float32 with a class label (5 classes, argmax of a linear rule) and a 3-value float target."""
    root = tmp_path_factory.mktemp("tabular")
    rng = np.random.default_rng(11)
    rule, reg = rng.normal(0, 1, (6, 5)), rng.normal(0, 0.5, (6, 3))
    arrays = {}
    for split, n in (("train", 320), ("eval", 64)):
        x = rng.normal(0, 1, (n, 6)).astype(np.float32)
        arrays[split] = {"x": x, "y": np.argmax(x @ rule, 1).astype(np.int64),
                         "target": np.tanh(x @ reg).astype(np.float32)}
        np.savez(root / f"{split}.npz", **arrays[split])
        tensors(root / f"{split}.npz", root / split)
    return str(root), arrays


@pytest.mark.graphs
def test_graph_with_its_own_loss_trains_on_two_ranks(tmp_path, tabular):
    """model.loss.output: the graph's scalar output is the loss; its own metric outputs are reported; the
    first step's loss is the graph's formula on the initial weights (NumPy), and the loss falls. The graph's
    nodes are stored in reverse (not topological) order, which onnxruntime accepts: so do training and
    the export of the inference model at the run's end."""
    data, arrays = tabular
    w = mlp(tmp_path / "m.onnx", 5, own_loss=True, shuffled=True)
    mpirun(2, "--config", small_run(tmp_path, {"loss": {"output": "nll"}}, data))
    train, evals = read_metrics(str(tmp_path / "run"))
    x, y = arrays["train"]["x"][:16], arrays["train"]["y"][:16]
    logits = np_forward(w, x)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    nll = -logp[np.arange(16), y]
    penalty = 1e-3 * (w["w2"].astype(np.float64) ** 2).sum()
    assert train[1]["loss"] == pytest.approx((nll[:8].mean() + nll[8:].mean()) / 2 + penalty, rel=1e-5)
    assert train[30]["loss"] < 0.5 * train[1]["loss"]
    assert evals[30]["eval_own_accuracy"] > 0.6 and "eval_accuracy" not in evals[30]
    # the exported model is an inference model: the user's graph with the trained weights without its loss,
    # its metrics and the labels input only they read; --with-loss keeps the loss (and takes y)
    import onnxruntime as ort
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "30" / "model.safetensors"))
    sess = ort.InferenceSession(str(tmp_path / "run" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"] and [o.name for o in sess.get_outputs()] == ["out"]
    ex, ey = arrays["eval"]["x"][:16], arrays["eval"]["y"][:16]
    out, = sess.run(None, {"x": ex})
    assert np.abs(out - np_forward(trained, ex)).max() < 1e-4
    run([TRAINRUN, "export", str(tmp_path / "run"), "--with-loss", "--output", str(tmp_path / "loss.onnx")], check=0)
    sess = ort.InferenceSession(str(tmp_path / "loss.onnx"), providers=["CPUExecutionProvider"])
    assert {i.name for i in sess.get_inputs()} == {"x", "y"}
    loss, = sess.run(["loss"], {"x": ex, "y": ey})
    logits = np_forward(trained, ex)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert float(loss) == pytest.approx(1e-3 * (trained["w2"].astype(np.float64) ** 2).sum()
                                        - logp[np.arange(16), ey].mean(), rel=1e-5)


@pytest.mark.graphs
@pytest.mark.parametrize("loss", ["mse", "l1"])
def test_regression_trains_on_two_ranks_with_eval_mse_and_mae(tmp_path, tabular, loss):
    """mse / l1 against float targets (data.inputs maps the loss's labels input to the feature `target`):
    the first loss and the final eval mse and mae equal NumPy's on the initial / final weights. A regression
    gets samples/s and its eval metrics, no tokens/s nor perplexity (console, metrics.jsonl, TensorBoard)."""
    data, arrays = tabular
    w0 = mlp(tmp_path / "m.onnx", 3)
    proc = mpirun(2, "--config", small_run(tmp_path, {"loss": {"type": loss, "logits": "out"}}, data,
                                           data={"inputs": {"labels": "target"}}, checkpoint={"every": 30},
                                           tensorboard={"enabled": True}))
    train, evals = read_metrics(str(tmp_path / "run"))
    assert " samples/s | " in proc.stdout and " | mse " in proc.stdout and " | mae " in proc.stdout
    assert "tok/s" not in proc.stdout and "tokens" not in proc.stdout and "perplexity" not in proc.stdout, proc.stdout
    assert train[1]["samples_per_sec"] > 0 and "tokens_per_sec" not in train[1]
    assert "eval_perplexity" not in evals[30]
    tags = _tensorboard_tags(glob.glob(str(tmp_path / "run" / "tensorboard" / "events.*")))
    assert {"train/samples_per_sec", "eval/loss", "eval/mse", "eval/mae"} <= tags
    assert not {"train/tokens_per_sec", "eval/perplexity"} & tags
    err = np_forward(w0, arrays["train"]["x"][:16]) - arrays["train"]["target"][:16]
    per = err ** 2 if loss == "mse" else np.abs(err)
    assert train[1]["loss"] == pytest.approx((per[:8].mean() + per[8:].mean()) / 2, rel=1e-5)
    assert train[30]["loss"] < 0.5 * train[1]["loss"]
    w = {k: v.astype(np.float64) for k, v in load_file(str(tmp_path / "run/checkpoints/30/model.safetensors")).items()}
    err = np_forward(w, arrays["eval"]["x"][:32]) - arrays["eval"]["target"][:32]
    assert evals[30]["eval_mse"] == pytest.approx((err ** 2).mean(), rel=1e-4)
    assert evals[30]["eval_mae"] == pytest.approx(np.abs(err).mean(), rel=1e-4)
    assert "eval_accuracy" not in evals[30]


@pytest.mark.graphs
@pytest.mark.parametrize("layout", ["classes_axis1", "sequence_last"])
@pytest.mark.torch
def test_cross_entropy_layouts_weights_and_accuracy_match_pytorch(tmp_path, layout):
    """class_axis 1 ([N, C, d], ONNX's layout) and -1 ([N, S, V]), with class weights and ignore_index: the
    eval graph's loss against torch's cross_entropy(weight, ignore_index), its top-1/top-5 sums against
    NumPy's over the counted labels; a label out of range is a named UsageError at the batch."""
    import torch
    from trainrun import config as C
    from trainrun.graphs.manifest import prepare
    from trainrun.step.engine import Engine, EngineOptions
    from trainrun.errors import UsageError
    C_, S = 7, 5
    axis = 1 if layout == "classes_axis1" else -1
    shape_out = ["b", C_, S] if axis == 1 else ["b", S, C_]
    rng = np.random.default_rng(2)
    wt = rng.normal(0, 1, (3, C_)).astype(np.float32)
    perm = [0, 2, 1] if axis == 1 else [0, 1, 2]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Transpose", ["h"], ["logits"], perm=perm)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", S, 3])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape_out)],
                          [numpy_helper.from_array(wt, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "m.onnx"))
    weights = [0.5, 1.0, 2.0, 1.5, 1.0, 0.25, 3.0]
    cfg = C.from_dict({"model": {"builtin": None, "onnx": str(tmp_path / "m.onnx"),
                                 "loss": {"class_axis": axis, "weights": weights, "ignore_index": -1}},
                       "train": {"micro_batch_size": 4}, "run": {"output_dir": str(tmp_path / "run")}})
    graphs = prepare(cfg)
    shapes = {"x": ((4, S, 3), np.float32), "labels": ((4, S), np.int64)}
    eng = Engine(graphs, EngineOptions(threads=1), shapes, shapes)
    eng.load_weights()
    x = rng.normal(0, 1, (4, S, 3)).astype(np.float32)
    y = rng.integers(0, C_, (4, S))
    y[0, 1] = y[2, 3] = -1
    loss = eng.evaluate({"x": x, "labels": y})
    logits = torch.tensor(x.astype(np.float64)) @ torch.tensor(wt.astype(np.float64))      # [4, S, C]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, C_), torch.tensor(y).reshape(-1),
                                            weight=torch.tensor(weights, dtype=torch.float64), ignore_index=-1)
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    got = {k.split("/")[1] + "/" + k.split("/")[2]: float(v) for k, v in eng.eval_metrics.items()}
    flat, labels = logits.reshape(-1, C_).numpy(), y.reshape(-1)
    valid = labels != -1
    top5 = np.argsort(-flat, 1)[:, :5]
    assert got == {"accuracy/sum": float((flat.argmax(1) == labels)[valid].sum()), "accuracy/count": valid.sum(),
                   "top5_accuracy/sum": float((top5 == labels[:, None]).any(1)[valid].sum()),
                   "top5_accuracy/count": valid.sum()}
    y[3, 4] = C_
    with pytest.raises(UsageError, match=f"feature 'labels' .graph input 'labels'. holds label {C_}: not a class "
                                         f"of the {C_} .0..{C_ - 1}. nor model.loss.ignore_index .-1."):
        eng.forward_backward({"x": x, "labels": y}, accumulate=False)


@pytest.mark.graphs
@pytest.mark.parametrize("case", ["axis1_weights", "last_weights", "vocab_split"])
@pytest.mark.torch
def test_label_smoothing_matches_torch(tmp_path, case):
    """model.loss.label_smoothing against torch.nn.functional.cross_entropy(label_smoothing=...) in float64,
    with ignore_index: class axis 1 and -1 with class weights, and 1100 classes (past SPLIT_MIN_CLASSES,
    where prepare rewrites the cross-entropy and its gradient into their cheap forms). The train graph's
    loss and gradient, the eval graph's loss and its ``ce`` metric (the unsmoothed cross-entropy)."""
    import torch
    from trainrun import config as C
    from trainrun.step.engine import Engine, EngineOptions
    from trainrun.step.feeding import eval_results
    from trainrun.graphs.manifest import prepare
    C_, S, s = (1100, 3, 0.1) if case == "vocab_split" else (7, 5, 0.2)
    axis = 1 if case == "axis1_weights" else -1
    rng = np.random.default_rng(4)
    wt = rng.normal(0, 3, (3, C_)).astype(np.float32)   # confident logits: smoothing matters
    perm = [0, 2, 1] if axis == 1 else [0, 1, 2]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Transpose", ["h"], ["logits"], perm=perm)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", S, 3])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                         ["b", C_, S] if axis == 1 else ["b", S, C_])],
                          [numpy_helper.from_array(wt, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "m.onnx"))
    weights = [] if case == "vocab_split" else [0.5, 1.0, 2.0, 1.5, 1.0, 0.25, 3.0]
    cfg = C.from_dict({"model": {"builtin": None, "onnx": str(tmp_path / "m.onnx"),
                                 "loss": {"class_axis": axis, "weights": weights, "ignore_index": -1,
                                          "label_smoothing": s}},
                       "train": {"micro_batch_size": 4}, "run": {"output_dir": str(tmp_path / "run")}})
    graphs = prepare(cfg)
    train = onnx.load(os.path.join(graphs, "train.onnx"))
    ops = {n.op_type for n in train.graph.node}
    if case == "vocab_split":   # the cheap forms of the plain loss and its gradient serve the smoothed loss too
        assert "LogSoftmax" in ops and not {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"} & ops, ops
    shapes = {"x": ((4, S, 3), np.float32), "labels": ((4, S), np.int64)}
    eng = Engine(graphs, EngineOptions(threads=1), shapes, shapes)
    eng.load_weights()
    x = rng.normal(0, 1, (4, S, 3)).astype(np.float32)
    y = rng.integers(0, C_, (4, S))
    y[0, 1] = y[2, 2] = -1
    w = torch.tensor(wt.astype(np.float64), requires_grad=True)
    logits = (torch.tensor(x.astype(np.float64)) @ w).reshape(-1, C_)
    kw = dict(weight=torch.tensor(weights, dtype=torch.float64) if weights else None, ignore_index=-1)
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(y).reshape(-1), label_smoothing=s, **kw)
    ref.backward()
    plain = torch.nn.functional.cross_entropy(logits, torch.tensor(y).reshape(-1), **kw).item()
    assert abs(ref.item() - plain) > 1e-3 * plain       # smoothing changes the loss

    loss = eng.forward_backward({"x": x, "labels": y}, accumulate=False)
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    grad = eng.layout.unflatten(eng.grads)["w"]
    assert np.abs(grad - w.grad.numpy()).max() <= 1e-5 * np.abs(w.grad.numpy()).max()
    assert eng.evaluate({"x": x, "labels": y}) == pytest.approx(ref.item(), rel=1e-5)
    ce = float(eng.eval_metrics["metric/ce/sum"]) / float(eng.eval_metrics["metric/ce/count"])
    assert ce == pytest.approx(plain, rel=1e-5)
    result = eval_results(loss, {k: float(v) for k, v in eng.eval_metrics.items()})
    assert result["perplexity"] == pytest.approx(np.exp(plain), rel=1e-5)



class TorchClassifier:
    """x [b, 6] -> Linear(6, 16) -> LayerNorm -> tanh -> Linear(16, 5) -> a loss, in PyTorch: ``cross_entropy``
    returns F.cross_entropy(scores, y) only; ``nll_log_softmax`` returns F.nll_loss(F.log_softmax(scores), y)
    and the scores. torch.onnx.export writes either loss as one SoftmaxCrossEntropyLoss node with one output,
    the LayerNorm (opset 17) as one LayerNormalization node with one output."""

    def __init__(self, kind, seed=0):
        import torch
        torch.manual_seed(seed)
        self.kind = kind
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 5))

    def module(self):
        import torch
        F, net, kind = torch.nn.functional, self.net, self.kind

        class Classifier(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, x, y):
                scores = self.net(x)
                if kind == "cross_entropy":
                    return F.cross_entropy(scores, y)
                return F.nll_loss(F.log_softmax(scores, 1), y), scores
        return Classifier()

    def export(self, path):
        import torch
        outputs = ["loss"] if self.kind == "cross_entropy" else ["loss", "scores"]
        x, y = torch.zeros(4, 6), torch.zeros(4, dtype=torch.int64)
        torch.onnx.export(self.module(), (x, y), str(path), input_names=["x", "y"], output_names=outputs,
                          dynamic_axes={"x": {0: "b"}, "y": {0: "b"}, **({"scores": {0: "b"}} if len(outputs) > 1
                                                                         else {})},
                          opset_version=17, dynamo=False)
        written = {n.op_type: list(n.output) for n in onnx.load(str(path)).graph.node}
        assert "LogSoftmax" not in written and written["SoftmaxCrossEntropyLoss"] == ["loss"], written
        assert len(written["LayerNormalization"]) == 1         # no log_prob, no mean: how torch writes them


@pytest.mark.graphs
@pytest.mark.parametrize("kind", ["cross_entropy", "nll_log_softmax"])
@pytest.mark.torch
def test_torch_exported_classifier_with_its_cross_entropy_trains_on_two_ranks(tmp_path, tabular, kind):
    """A classifier exported by torch.onnx.export whose output is its own cross-entropy (model.loss.output):
    trained with SGD on 2 ranks, each step's loss equals PyTorch's (float64, the same batches in the data's
    order, the same initial weights) and so do the final weights. The run's model.onnx: the scores without
    the loss; for a model that returns its loss only, the graph with its loss (said)."""
    import onnxruntime as ort
    import torch
    data, arrays = tabular
    model = TorchClassifier(kind)
    model.export(tmp_path / "m.onnx")
    steps, lr = 10, 0.3
    proc = mpirun(2, "--config", small_run(tmp_path, {"loss": {"output": "loss"}}, data,
                                           train={"max_steps": steps}, optimizer={"name": "sgd", "lr": lr}))
    sess = ort.InferenceSession(str(tmp_path / "run" / "model.onnx"), providers=["CPUExecutionProvider"])
    if kind == "cross_entropy":
        assert ("note: the model's outputs are its loss 'loss' and metrics only: "
                f"{tmp_path / 'run' / 'model.onnx'} is the graph with its loss") in proc.stdout
        assert {i.name for i in sess.get_inputs()} == {"x", "y"} and "loss" in [o.name for o in sess.get_outputs()]
    else:
        assert [i.name for i in sess.get_inputs()] == ["x"] and [o.name for o in sess.get_outputs()] == ["scores"]
    train, _ = read_metrics(str(tmp_path / "run"))
    ref = model.module().double()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    x, y = torch.tensor(arrays["train"]["x"], dtype=torch.float64), torch.tensor(arrays["train"]["y"])
    expected = []
    for t in range(steps):
        out = ref(x[16 * t:16 * (t + 1)], y[16 * t:16 * (t + 1)])
        loss = out if kind == "cross_entropy" else out[0]
        expected.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [train[t + 1]["loss"] for t in range(steps)] == pytest.approx(expected, rel=1e-4)
    assert expected[-1] < 0.8 * expected[0]
    trained = load_file(str(tmp_path / "run" / "checkpoints" / str(steps) / "model.safetensors"))
    for name, p in ref.named_parameters():
        assert np.abs(trained[name] - p.detach().numpy()).max() < 1e-5, name


BAD = {
    # case: (model section, data section, feature arrays replaced, world, expected message parts)
    "feature_dtype": ({}, {}, {"x": lambda a: a["x"].astype(np.float64)}, 2,
                      ["feature 'x' (float64, per sample [6]) does not fit graph input 'x' (float32, per sample [6]"]),
    "feature_shape": ({}, {}, {"x": lambda a: np.concatenate([a["x"], a["x"][:, :2]], 1)}, 1,
                      ["feature 'x' (float32, per sample [8]) does not fit graph input 'x' (float32, per sample [6]"]),
    "unfed_input": ({}, {}, {"y": None}, 1,
                    ["graph input 'labels' <- feature 'labels': not in the dataset (its features: x, target)"]),
    "unknown_data_input": ({}, {"inputs": {"nope": "y", "labels": "y"}}, {}, 1,
                           ["data.inputs: 'nope' not a data input of the model (its data inputs: x, labels)"]),
    "label_out_of_range": ({}, {"inputs": {"labels": "y"}}, {"y": lambda a: np.where(np.arange(len(a["y"])) == 21, 5,
                                                                                    a["y"])}, 2,
                           ["feature 'y' (graph input 'labels') holds label 5: not a class of the 5 (0..4)"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_data_for_the_graph_is_named_and_exits_2(tmp_path, tabular, case):
    """Each mismatch between the data and the graph: exit 2 and a message naming the feature and the input;
    on 2 ranks too (start-up checks agree on every rank; a bad label found in one rank's batch ends the job)."""
    model, data_section, replace, world, expected = BAD[case]
    _, arrays = tabular
    mlp(tmp_path / "m.onnx", 5)
    for split, a in arrays.items():
        a = dict(a, target=a["target"])
        for k, f in replace.items():
            a = {n: v for n, v in a.items() if n != k} if f is None else dict(a, **{k: f(a)})
        np.savez(tmp_path / f"{split}.npz", **a)
        tensors(tmp_path / f"{split}.npz", tmp_path / "d" / split)
    cfg = small_run(tmp_path, {"loss": {"logits": "out"}, **model}, str(tmp_path / "d"),
                    data={"inputs": {"labels": "y"}, **data_section} if "y" not in replace or replace["y"] else
                    data_section)
    proc = mpirun(world, "--config", cfg, check=2) if world > 1 else run([TRAINRUN, "--config", cfg], check=2)
    for part in expected:
        assert part in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def conv_model(path, scale, seed=0):
    """x [b, 2, 8] -> Conv (4 channels, width 3) -> x ``cs`` [4, 1] -> + ``cb`` [4, 1] -> Flatten: out [b, 24],
    the conv weights (and so the outputs) scaled by ``scale``. The exported model holds the weights as
    initializers, which onnxruntime folds (the scale and bias into the conv); the eval graph takes them as
    inputs: the same outputs to float32 rounding, several units where they are ~1e8."""
    rng = np.random.default_rng(seed)
    w = {"cw": (rng.normal(0, 1, (4, 2, 3)) * scale).astype(np.float32),
         "cs": rng.uniform(0.5, 2, (4, 1)).astype(np.float32),
         "cb": (rng.normal(0, 0.1, (4, 1)) * scale).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "cw"], ["c"]), helper.make_node("Mul", ["c", "cs"], ["m"]),
             helper.make_node("Add", ["m", "cb"], ["a"]), helper.make_node("Flatten", ["a"], ["out"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 2, 8])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 24])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


def np_conv_model(w, x):
    """conv_model's output in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    windows = np.stack([x[:, :, t:t + 3] for t in range(6)], axis=2).astype(np.float64)     # [b, 2, 6, 3]
    return (np.einsum("bitk,cik->bct", windows, w["cw"]) * w["cs"] + w["cb"]).reshape(len(x), 24)


@pytest.mark.parametrize("scale", [1.0, 1e7])
def test_export_check_is_relative_to_the_outputs_magnitude(tmp_path, scale):
    """The end-of-run check of the export against the eval graph allows 1e-4 + 1e-5 x the largest |output|:
    a model whose outputs are ~1e8 (several units of float32 rounding apart between the export's folded
    weights and the eval graph) finishes its run with exit 0 and an export that equals NumPy's float64
    forward to 1e-6 of the outputs; the same run's forward graph with one weight 0.1% off is refused by
    `trainrun export` (exit 1, naming the output), whatever the scale."""
    import onnxruntime as ort
    rng = np.random.default_rng(4)
    for split, n in (("train", 32), ("eval", 16)):
        x = rng.normal(0, 1, (n, 2, 8)).astype(np.float32)
        np.savez(tmp_path / f"{split}.npz", x=x, target=(rng.normal(0, 3, (n, 24)) * scale).astype(np.float32))
        tensors(tmp_path / f"{split}.npz", tmp_path / split)
    conv_model(tmp_path / "m.onnx", scale)
    cfg = small_run(tmp_path, {"loss": {"type": "mse", "logits": "out"}}, str(tmp_path),
                    data={"inputs": {"labels": "target"}}, train={"max_steps": 2})
    p = run([TRAINRUN, "--config", cfg], check=0)
    diff = float(p.stdout.split("max |logits - eval graph| = ")[1].split()[0])
    run_dir = tmp_path / "run"
    trained = load_file(str(run_dir / "checkpoints" / "2" / "model.safetensors"))
    x = np.load(tmp_path / "eval.npz")["x"]
    sess = ort.InferenceSession(str(run_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    ref = np_conv_model(trained, x)
    assert np.abs(sess.run(["out"], {"x": x})[0] - ref).max() <= 1e-6 * np.abs(ref).max()
    if scale > 1:       # what an absolute bound of 1e-4 refused (exit 1 after a successful run)
        assert 1e-4 < diff <= 1e-5 * np.abs(ref).max(), (diff, np.abs(ref).max())

    forward = onnx.load(str(run_dir / "graphs" / "forward.onnx"))       # cs 0.1% off: a wrong weight
    mul = next(nd for nd in forward.graph.node if nd.op_type == "Mul")
    mul.input[list(mul.input).index("cs")] = "cs_wrong"
    forward.graph.node.insert(0, helper.make_node("Mul", ["cs", "off"], ["cs_wrong"]))
    forward.graph.node.insert(0, helper.make_node("Constant", [], ["off"],
                                                  value=numpy_helper.from_array(np.array(1.001, np.float32))))
    onnx.save(forward, str(run_dir / "graphs" / "forward.onnx"))
    p = run([TRAINRUN, "export", str(run_dir), "--output", str(tmp_path / "wrong.onnx")], check=1)
    assert "the exported model differs from the eval graph by" in p.stderr and "in 'out'" in p.stderr, p.stderr
