"""Variants of trainrun's built-in GPT-2 graph, built by rewriting the ONNX that
trainrun's own code produces (trainrun/models/gpt2.py is not modified).

A variant is a rewrite of the forward ModelProto returned by
``trainrun.models.gpt2.build_gpt2``; :func:`prepare_variant` runs trainrun's
``graphs.prepare`` with that rewrite hooked in, so the train / eval / forward /
optimizer graphs, the weights and the manifest come out exactly as trainrun
makes them, and the real ``trainrun`` CLI can train from that graphs folder.

GELU forms (the MLP activation; ``x = c_fc(h)`` before the bias in the graph):

* ``fastgelu``   trainrun today: ``com.microsoft.FastGelu(x, bias)``; its gradient
                 is FastGeluGrad, a scalar std::tanh loop, one thread.
* ``tanh``       gelu_new from primitive ops, ``0.5 y (1 + tanh(k (y + 0.044715 y^3)))``
                 with ``y = x + bias``: Mul/Add/Tanh and their gradients.
* ``sigmoid``    the same function written as ``y * sigmoid(2k (y + 0.044715 y^3))``
                 (``0.5 (1 + tanh z) = sigmoid(2z)`` exactly): fewer nodes.
* ``erf``        ``com.microsoft.Gelu(x + bias)`` (exact erf GELU, NOT gelu_new).
* ``biasgelu``   ``com.microsoft.BiasGelu(x, bias)`` (erf, NOT gelu_new).
* ``onnx20``     ONNX opset-20 ``Gelu(approximate="tanh")``.

``static``: the data inputs and logits get fixed dimensions [micro_batch, seq]
instead of symbolic ones (combine with a GELU form as ``sigmoid+static``).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401 - puts the repo on sys.path

ROOT = common.ROOT
GELU_FORMS = ("fastgelu", "tanh", "sigmoid", "erf", "biasgelu", "onnx20")
K = math.sqrt(2.0 / math.pi)


def _const(model: onnx.ModelProto, name: str, value: float) -> str:
    if not any(t.name == name for t in model.graph.initializer):
        model.graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), name))
    return name


def rewrite_gelu(model: onnx.ModelProto, form: str) -> onnx.ModelProto:
    """Replace every com.microsoft.FastGelu(x, bias) node by ``form``; returns a new model."""
    if form not in GELU_FORMS:
        raise ValueError(f"unknown GELU form {form!r}; choose from {GELU_FORMS}")
    if form == "fastgelu":
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    nodes = []
    for node in model.graph.node:
        if not (node.op_type == "FastGelu" and node.domain == "com.microsoft"):
            nodes.append(node)
            continue
        x, bias = node.input[0], node.input[1]
        out = node.output[0]
        p = node.name + "/"

        def mk(op, ins, name, domain="", **attrs):
            nodes.append(helper.make_node(op, ins, [p + name], name=p + name, domain=domain, **attrs))
            return p + name

        if form == "biasgelu":
            nodes.append(helper.make_node("BiasGelu", [x, bias], [out], name=p + "biasgelu", domain="com.microsoft"))
            continue
        y = mk("Add", [x, bias], "biased")
        if form == "erf":
            nodes.append(helper.make_node("Gelu", [y], [out], name=p + "gelu", domain="com.microsoft"))
        elif form == "onnx20":
            nodes.append(helper.make_node("Gelu", [y], [out], name=p + "gelu", approximate="tanh"))
        elif form == "tanh":
            y2 = mk("Mul", [y, y], "y2")
            y3 = mk("Mul", [y2, y], "y3")
            inner = mk("Add", [y, mk("Mul", [y3, _const(model, "gelu_c3", 0.044715)], "c3y3")], "inner")
            t = mk("Tanh", [mk("Mul", [inner, _const(model, "gelu_k", K)], "scaled")], "tanh")
            one_plus = mk("Add", [t, _const(model, "gelu_one", 1.0)], "one_plus")
            half_y = mk("Mul", [y, _const(model, "gelu_half", 0.5)], "half_y")
            nodes.append(helper.make_node("Mul", [half_y, one_plus], [out], name=p + "out"))
        elif form == "sigmoid":
            # y * sigmoid(y * (2k + 2k*0.044715*y^2))
            y2 = mk("Mul", [y, y], "y2")
            poly = mk("Add", [mk("Mul", [y2, _const(model, "gelu_b", 2 * K * 0.044715)], "by2"),
                              _const(model, "gelu_a", 2 * K)], "poly")
            s = mk("Sigmoid", [mk("Mul", [y, poly], "z")], "sigmoid")
            nodes.append(helper.make_node("Mul", [y, s], [out], name=p + "out"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if form == "onnx20":
        for imp in model.opset_import:
            if imp.domain in ("", "ai.onnx"):
                imp.version = 20
    return model


def make_static(model: onnx.ModelProto, micro_batch: int, seq_len: int) -> onnx.ModelProto:
    """Fixed [micro_batch, seq_len] data inputs and logits (the forward graph only)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for vi in list(model.graph.input) + list(model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if len(dims) >= 2 and (dims[0].dim_param or dims[1].dim_param):
            dims[0].dim_value, dims[1].dim_value = micro_batch, seq_len
    return model


def rewrite(model: onnx.ModelProto, variant: str, micro_batch: int | None = None,
            seq_len: int | None = None) -> onnx.ModelProto:
    """Apply a variant name like ``sigmoid`` or ``sigmoid+static`` to a forward graph."""
    for part in variant.split("+"):
        if part == "static":
            model = make_static(model, micro_batch, seq_len)
        elif part not in ("", "base"):
            model = rewrite_gelu(model, part)
    return model


@contextlib.contextmanager
def hooked_builder(variant: str, micro_batch: int | None = None, seq_len: int | None = None):
    """While active, trainrun's build_gpt2 returns the rewritten graph."""
    from trainrun.models import gpt2
    original = gpt2.build_gpt2

    def build(cfg, weights):
        return rewrite(original(cfg, weights), variant, micro_batch, seq_len)

    gpt2.build_gpt2 = build
    try:
        yield
    finally:
        gpt2.build_gpt2 = original


def prepare_variant(config_path: str, overrides: list[str], out_dir: str, variant: str,
                    micro_batch: int | None = None, seq_len: int | None = None) -> str:
    """trainrun's ``prepare`` for ``config_path`` + ``overrides`` into ``out_dir`` with ``variant``."""
    from trainrun import config as C
    from trainrun import graphs as G
    cfg = C.load_config(config_path, list(overrides))
    with hooked_builder(variant, micro_batch, seq_len):
        return G.prepare(cfg, out_dir)


def op_counts(path: str) -> dict[str, int]:
    model = onnx.load(path, load_external_data=False)
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def forward_model(gpt2_shape: dict, variant: str, weights: dict, micro_batch=None, seq_len=None) -> onnx.ModelProto:
    from trainrun import config as C
    from trainrun.models.gpt2 import build_gpt2
    return rewrite(build_gpt2(C.GPT2Config(**gpt2_shape), weights), variant, micro_batch, seq_len)


if __name__ == "__main__":   # smoke: op types of each variant's forward graph
    from trainrun import config as C
    from trainrun.models.gpt2 import init_weights
    shape = dict(n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=97)
    w = init_weights(C.GPT2Config(**shape), 0)
    for v in GELU_FORMS:
        m = forward_model(shape, v, w)
        print(v, sorted({n.op_type for n in m.graph.node}))
    os.environ.get("X")
