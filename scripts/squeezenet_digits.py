"""SqueezeNet 1.1 for scikit-learn's digits: the forward ONNX graph (torch-free, onnx.helper) and the data.

    python scripts/squeezenet_digits.py model --output squeezenet.onnx [--width 1.0] [--image-size 32]
                                              [--batchnorm] [--seed 0]
    python scripts/squeezenet_digits.py data --output DIR [--image-size 32] [--eval-fraction 0.2]

The network is SqueezeNet 1.1 (Iandola et al.; torchvision's ``squeezenet1_1``): conv 3x3/2 (64) + ReLU,
max-pool 3x3/2 (ceil), fire(16, 64), fire(16, 64), max-pool, fire(32, 128), fire(32, 128), max-pool,
fire(48, 192), fire(48, 192), fire(64, 256), fire(64, 256), then the classifier conv 1x1 (10 classes)
+ ReLU + global average pool. A fire module is a 1x1 "squeeze" conv + ReLU feeding a 1x1 and a 3x3
"expand" conv (+ ReLU each), concatenated on the channel axis. Changes for 8x8 digit images, one grey
channel: ``--width`` scales every channel count (1.0: the paper's); the classifier's dropout is left out
(trainrun's dropout masks would work, but the references then need the same masks); ``--batchnorm`` adds
BatchNormalization (training mode, momentum 0.9 as ONNX counts it, i.e. PyTorch's 0.1) after the first
conv and after every squeeze conv. Weights: Kaiming-uniform as torchvision's SqueezeNet (the final conv
normal(0, 0.01)), biases 0, from ``--seed``.

The data: the 1,797 digits scikit-learn ships (no download), pixel values / 16, upscaled by pixel
repetition (nearest neighbour) from 8x8 to ``--image-size`` (a multiple of 8), as ``x`` float32
[1, S, S] and ``label`` int64; a fixed seeded split (``--eval-fraction``) into DIR/train.npz and
DIR/eval.npz, for ``trainrun-data tensors``.
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np

FIRES = [(16, 64), (16, 64), "pool", (32, 128), (32, 128), "pool", (48, 192), (48, 192), (64, 256), (64, 256)]


def architecture(width: float) -> list:
    """[("conv1", out), "pool", (squeeze, expand), ...] with channel counts scaled by ``width``."""
    c = lambda n: max(1, int(round(n * width)))     # noqa: E731
    return [("conv1", c(64)), "pool"] + [x if x == "pool" else (c(x[0]), c(x[1])) for x in FIRES]


def init_weights(width: float, classes: int, batchnorm: bool, seed: int) -> dict[str, np.ndarray]:
    """Every tensor of the network by name, in graph order (float32)."""
    rng = np.random.default_rng(seed)
    w = {}

    def conv(name, cin, cout, k, final=False):
        fan_in = cin * k * k
        if final:
            w[name + ".weight"] = rng.normal(0.0, 0.01, (cout, cin, k, k)).astype(np.float32)
        else:   # kaiming_uniform_ (gain sqrt(2)): bound sqrt(6 / fan_in)
            bound = math.sqrt(6.0 / fan_in)
            w[name + ".weight"] = rng.uniform(-bound, bound, (cout, cin, k, k)).astype(np.float32)
        w[name + ".bias"] = np.zeros(cout, np.float32)

    def bn(name, c):
        w[name + ".weight"] = np.ones(c, np.float32)
        w[name + ".bias"] = np.zeros(c, np.float32)
        w[name + ".running_mean"] = np.zeros(c, np.float32)
        w[name + ".running_var"] = np.ones(c, np.float32)

    cin, i = 1, 0
    for layer in architecture(width):
        if layer == "pool":
            continue
        if layer[0] == "conv1":
            conv("features.0", cin, layer[1], 3)
            if batchnorm:
                bn("features.0.bn", layer[1])
            cin = layer[1]
            continue
        s, e = layer
        name = f"fire{i}"
        conv(name + ".squeeze", cin, s, 1)
        if batchnorm:
            bn(name + ".squeeze_bn", s)
        conv(name + ".expand1x1", s, e, 1)
        conv(name + ".expand3x3", s, e, 3)
        cin, i = 2 * e, i + 1
    conv("classifier", cin, classes, 1, final=True)
    return w


def build(width: float = 1.0, image_size: int = 32, classes: int = 10, batchnorm: bool = False, seed: int = 0,
          final_relu: bool = False):
    """The forward ONNX model: ``x`` [batch, 1, S, S] -> ``logits`` [batch, classes] (opset 17)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = init_weights(width, classes, batchnorm, seed)
    nodes = []

    def conv(name, x, k, pad, stride=1):
        out = name + ".out"
        nodes.append(helper.make_node("Conv", [x, name + ".weight", name + ".bias"], [out], name=name,
                                      kernel_shape=[k, k], pads=[pad] * 4, strides=[stride, stride]))
        return out

    def relu(x):
        nodes.append(helper.make_node("Relu", [x], [x + ".relu"], name=x + ".relu"))
        return x + ".relu"

    def bn(name, x):
        if not batchnorm:
            return x
        nodes.append(helper.make_node(
            "BatchNormalization", [x] + [f"{name}.{k}" for k in ("weight", "bias", "running_mean", "running_var")],
            [name + ".out", name + ".running_mean.new", name + ".running_var.new"], name=name,
            epsilon=1e-5, momentum=0.9, training_mode=1))
        return name + ".out"

    x, i, p = "x", 0, 0
    for layer in architecture(width):
        if layer == "pool":
            nodes.append(helper.make_node("MaxPool", [x], [f"pool{p}.out"], name=f"pool{p}", kernel_shape=[3, 3],
                                          strides=[2, 2], ceil_mode=1))
            x, p = f"pool{p}.out", p + 1
        elif layer[0] == "conv1":
            x = relu(bn("features.0.bn", conv("features.0", x, 3, 0, stride=2)))
        else:
            name = f"fire{i}"
            sq = relu(bn(name + ".squeeze_bn", conv(name + ".squeeze", x, 1, 0)))
            a = relu(conv(name + ".expand1x1", sq, 1, 0))
            b = relu(conv(name + ".expand3x3", sq, 3, 1))
            nodes.append(helper.make_node("Concat", [a, b], [name + ".out"], name=name + ".cat", axis=1))
            x, i = name + ".out", i + 1
    x = conv("classifier", x, 1, 0)
    if final_relu:
        x = relu(x)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pooled"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["logits"], name="flatten", axis=1))
    graph = helper.make_graph(
        nodes, "squeezenet1_1_digits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, image_size, image_size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="squeezenet_digits")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def digits(image_size: int = 32, eval_fraction: float = 0.2, seed: int = 0):
    """((x_train, y_train), (x_eval, y_eval)): scikit-learn's digits, /16, upscaled to image_size."""
    from sklearn.datasets import load_digits
    if image_size % 8:
        raise SystemExit(f"--image-size must be a multiple of 8, got {image_size}")
    d = load_digits()
    f = image_size // 8
    x = (d.images.astype(np.float32) / 16.0).repeat(f, axis=1).repeat(f, axis=2)[:, None]
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_eval = int(round(len(y) * eval_fraction))
    ev, tr = order[:n_eval], order[n_eval:]
    return (x[tr], y[tr]), (x[ev], y[ev])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model", help="write the forward ONNX graph")
    m.add_argument("--output", required=True)
    m.add_argument("--width", type=float, default=1.0)
    m.add_argument("--image-size", type=int, default=32)
    m.add_argument("--batchnorm", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--final-relu", action="store_true", help="keep the ReLU after the classifier conv")
    d = sub.add_parser("data", help="write DIR/train.npz and DIR/eval.npz (x, label)")
    d.add_argument("--output", required=True)
    d.add_argument("--image-size", type=int, default=32)
    d.add_argument("--eval-fraction", type=float, default=0.2)
    d.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cmd == "model":
        import onnx
        model = build(a.width, a.image_size, batchnorm=a.batchnorm, seed=a.seed, final_relu=a.final_relu)
        os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
        onnx.save(model, a.output)
        n = sum(int(np.prod(t.dims)) for t in model.graph.initializer if "running" not in t.name)
        print(f"{a.output}: SqueezeNet 1.1 x{a.width} on {a.image_size}x{a.image_size}, {n:,} parameters")
    else:
        os.makedirs(a.output, exist_ok=True)
        for split, (x, y) in zip(("train", "eval"), digits(a.image_size, a.eval_fraction, a.seed)):
            np.savez(os.path.join(a.output, f"{split}.npz"), x=x, label=y)
            print(f"{a.output}/{split}.npz: {len(y)} images {list(x.shape[1:])}")


if __name__ == "__main__":
    main()
