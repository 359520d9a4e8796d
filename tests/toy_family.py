"""A third model family, defined in this one file and added through the registry's public function: a
bag-of-tokens language model (each position's logits from its own token's embedding, a ReLU and a
dense head). ``tests/test_model_family.py`` imports it into the trainrun processes it starts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from trainrun.config import opt
from trainrun.models.onnx_builder import Graph
from trainrun.models.registry import Family, register


@dataclass
class ToyConfig:
    vocab_size: int = opt(512, min=2)
    """Vocabulary size."""
    width: int = opt(16, min=1)
    """Width of the embedding."""
    context: int = opt(64, min=1)
    """Longest sequence (the model itself has no positions)."""

    CONFIG_JSON_SHAPE = ()          # no transformers config.json to read it from
    POSITIONS = "context"

    def problems(self) -> list[tuple[str, str]]:
        return [("width", f"must be even, got {self.width}")] if self.width % 2 else []


def param_specs(cfg: ToyConfig) -> dict:
    return {"toy.embed.weight": ((cfg.vocab_size, cfg.width), "normal"),
            "toy.head.weight": ((cfg.width, cfg.vocab_size), "normal"),
            "toy.head.bias": ((cfg.vocab_size,), "zeros")}


def init_weights(cfg: ToyConfig, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s, dtype=np.float32) * np.float32(0.1) if init == "normal"
                else np.zeros(s, np.float32)) for n, (s, init) in param_specs(cfg).items()}


def build(cfg: ToyConfig, weights: dict):
    g = Graph()
    for name, value in weights.items():
        g.const(name, value)
    h = g.op("Relu", [g.op("Gather", ["toy.embed.weight", "input_ids"], axis=0)])
    g.nodes.append(helper.make_node("Add", [g.op("MatMul", [h, "toy.head.weight"]), "toy.head.bias"], ["logits"],
                                    name="logits"))
    return g.model("toy", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", cfg.vocab_size])])


FAMILY = register(Family(name="toy", section=ToyConfig, build=build, init_weights=init_weights,
                         param_specs=param_specs, inputs=("input_ids",), logits="logits"))
