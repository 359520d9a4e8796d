"""A model exported by either of torch's ONNX exporters trains as torch trains it (graphs/exporters.py).

A small CNN (Conv -> BatchNorm2d -> ReLU, a Linear over the last axis of a 3-D tensor, Dropout(p=0), a
registered buffer added to the scores) in train() mode, exported by the legacy exporter (dynamo=False,
TrainingMode.TRAINING) and by the dynamo exporter (optimize=False; optimize=True without the BatchNorm),
trains one SGD step (lr 1) through the real CLI: the step's change of every weight in the checkpoint is
torch autograd's gradient in training mode (float64, the same batch), the BatchNorm's running mean is
torch's, the buffer does not move, and the start-up line says what trains and what is frozen and why."""

import importlib.util

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from conftest import TRAINRUN, TRAINRUN_DATA, optional, run

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

torch = optional("torch")
onnx = optional("onnx")

N, CLASSES = 8, 3


def make_net(batchnorm: bool, seed=0):
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4) if batchnorm else torch.nn.Identity()
            self.fc = torch.nn.Linear(16, CLASSES)
            self.drop = torch.nn.Dropout(0.0)
            self.register_buffer("shift", torch.randn(CLASSES))

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))                      # [b, 4, 4, 4]
            h = self.drop(h.reshape(h.shape[0], 4, 16))
            return self.fc(h).mean(1) + self.shift                     # a Linear over the last axis

    net = Net().train()
    with torch.no_grad():       # running statistics away from their initial 0 / 1
        if batchnorm:
            net.bn.running_mean.uniform_(-0.5, 0.5)
            net.bn.running_var.uniform_(0.5, 2.0)
            net.bn.weight.uniform_(0.5, 1.5)
            net.bn.bias.uniform_(-0.2, 0.2)
    return net


def export(net, path, how):
    if how != "legacy" and importlib.util.find_spec("onnxscript") is None:
        pytest.skip("torch.onnx.export(dynamo=True) needs onnxscript (the test extra), not installed here")
    x = torch.zeros(N, 1, 4, 4)
    if how == "legacy":
        torch.onnx.export(net, (x,), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, opset_version=17, input_names=["x"], output_names=["scores"])
    else:
        torch.onnx.export(net, (x,), str(path), dynamo=True, optimize=how == "dynamo_optimized",
                          input_names=["x"], output_names=["scores"])


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (4 * N, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, CLASSES, 4 * N).astype(np.int64)
    np.savez(root / "train.npz", x=x, labels=y)
    run([TRAINRUN_DATA, "tensors", "--input", str(root / "train.npz"), "--output", str(root / "train")], check=0)
    return root, x, y


def train_one_step(tmp_path, images, model, frozen=(), check=0, trainable=()):
    root, _, _ = images
    cfg = {"run": {"name": "x", "output_dir": str(tmp_path / "run")},
           "model": {"builtin": None, "onnx": str(model), "frozen": list(frozen), "trainable": list(trainable),
                     "loss": {"logits": "scores", "labels": "labels"}},
           "data": {"train": str(root / "train"), "shuffle": False, "prefetch": 0},
           "train": {"micro_batch_size": N, "max_steps": 1, "eval_every": 0, "log_every": 1},
           "optimizer": {"name": "sgd", "lr": 1.0, "max_grad_norm": 0.0}, "lr_schedule": {"name": "constant"},
           "checkpoint": {"every": 1}, "tensorboard": {"enabled": False}, "engine": {"threads": 1}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return run([TRAINRUN, "train", "--config", str(tmp_path / "c.yaml")], check=check, timeout=600)


def torch_gradients(images, batchnorm: bool):
    """The net in float64 after torch autograd's backward of the first batch's loss."""
    _, x, y = images
    ref = make_net(batchnorm).double()
    loss = torch.nn.functional.cross_entropy(ref(torch.tensor(x[:N], dtype=torch.float64)), torch.tensor(y[:N]))
    loss.backward()
    return ref


CASES = {"legacy": True, "dynamo": True, "dynamo_optimized": False}


@pytest.mark.parametrize("how", sorted(CASES))
@pytest.mark.torch
def test_exported_cnn_trains_with_torchs_training_mode_gradients(tmp_path, images, how):
    batchnorm = CASES[how]
    net = make_net(batchnorm)
    export(net, tmp_path / "m.onnx", how)
    graph = onnx.load(str(tmp_path / "m.onnx"))
    if how == "dynamo":      # what the exporter writes: the BatchNorm in inference form
        bn = [n for n in graph.graph.node if n.op_type == "BatchNormalization"]
        assert len(bn) == 1 and not any(a.name == "training_mode" and a.i for a in bn[0].attribute)
    if how == "dynamo_optimized":   # the Linear's weight folded transposed under another name
        assert "fc.weight" not in {t.name for t in graph.graph.initializer}
    before = {k: v.detach().double().clone() for k, v in net.state_dict().items()}
    # the legacy exporter does not say which tensors are buffers: model.frozen does
    proc = train_one_step(tmp_path, images, tmp_path / "m.onnx", frozen=["shift"] if how == "legacy" else ())

    _, x, y = images
    ref = torch_gradients(images, batchnorm)
    got = load_file(str(tmp_path / "run" / "checkpoints" / "1" / "model.safetensors"))
    params = dict(ref.named_parameters())
    states = {"bn.running_mean", "bn.running_var"} if batchnorm else set()
    assert sorted(got) == sorted(set(params) | states)      # torch's names; the buffer is no parameter
    for name, p in params.items():
        grad = before[name].numpy() - got[name]                 # SGD, lr 1
        want = p.grad.numpy()
        assert np.abs(grad - want).max() <= 1e-5 * np.abs(want).max() + 1e-6, (name, grad, want)
    if batchnorm:       # training mode: the batch's statistics normalise and update the running ones
        h = ref.conv(torch.tensor(x[:N], dtype=torch.float64)).detach()
        mean, var = h.mean((0, 2, 3)).numpy(), h.var((0, 2, 3), unbiased=False).numpy()
        np.testing.assert_allclose(got["bn.running_mean"], 0.9 * before["bn.running_mean"].numpy() + 0.1 * mean,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["bn.running_var"], 0.9 * before["bn.running_var"].numpy() + 0.1 * var,
                                   rtol=1e-5, atol=1e-6)
    why = "model.frozen" if how == "legacy" else "a buffer (torch.export)"
    assert (f"trained: {len(params)} tensors, {sum(p.numel() for p in params.values()):,} elements; "
            f"frozen: 1 tensors, {CLASSES} elements ({why}: shift)") in proc.stdout
    exported = {t.name: t for t in onnx.load(str(tmp_path / "run" / "model.onnx")).graph.initializer}
    from onnx import numpy_helper
    assert np.array_equal(numpy_helper.to_array(exported["shift"]), before["shift"].float().numpy())


@pytest.mark.torch
def test_batchnorm_folded_by_the_exporters_optimizer_is_refused(tmp_path, images):
    """dynamo=True with its default optimize=True folds a training-mode BatchNorm into the Conv before it
    (no BatchNormalization left, the conv's weights no longer torch's): refused, naming the file, the node
    and the module, with the export that works; nothing prepared."""
    export(make_net(True), tmp_path / "m.onnx", "dynamo_optimized")
    ops = [n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node]
    assert "BatchNormalization" not in ops and "Conv" in ops
    proc = train_one_step(tmp_path, images, tmp_path / "m.onnx", check=2)
    assert f"{tmp_path / 'm.onnx'}: node '" in proc.stderr
    assert "holds torch's BatchNorm 'bn' in training mode" in proc.stderr and "optimize=False" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "graphs").exists()


@pytest.mark.torch
def test_model_trainable_trains_the_tensors_it_lists_and_model_frozen_does_not(tmp_path, images):
    """model.trainable (a name and a pattern) with model.frozen (which wins where both match): the tensors listed
    and not frozen move in the checkpoint by torch's gradients, the others are in no checkpoint and reach the
    exported model bit for bit; the start-up line names both reasons. A pattern that matches no parameter exits 2
    naming the key, the pattern and the model's parameters."""
    from onnx import numpy_helper
    net = make_net(False)
    export(net, tmp_path / "m.onnx", "legacy")
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}
    proc = train_one_step(tmp_path, images, tmp_path / "m.onnx", frozen=["conv.bias"],
                          trainable=["fc.*", "conv.weight", "conv.bias"])
    got = load_file(str(tmp_path / "run" / "checkpoints" / "1" / "model.safetensors"))
    assert sorted(got) == ["conv.weight", "fc.bias", "fc.weight"]
    ref = dict(torch_gradients(images, False).named_parameters())
    for name in got:
        grad, want = before[name].double().numpy() - got[name], ref[name].grad.numpy()
        assert np.abs(grad - want).max() <= 1e-5 * np.abs(want).max() + 1e-6, name
    exported = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "run" / "model.onnx")).graph.initializer}
    for name in ("conv.bias", "shift"):
        assert np.array_equal(exported[name], before[name].numpy()), name
    assert not np.array_equal(exported["conv.weight"], before["conv.weight"].numpy())
    assert ("trained: 3 tensors, 87 elements; frozen: 2 tensors, 7 elements (not in model.trainable: shift; "
            "model.frozen: conv.bias)") in proc.stdout

    (tmp_path / "run2").mkdir()
    bad = train_one_step(tmp_path / "run2", images, tmp_path / "m.onnx", trainable=["fc.*", "conv.w"], check=2)
    assert (f"model.trainable: 'conv.w' matches no parameter of {tmp_path / 'm.onnx'} (its parameters: shift, "
            "conv.weight, conv.bias, fc.weight, fc.bias)") in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "run2" / "run" / "graphs").exists()
