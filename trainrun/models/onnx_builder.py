"""What every built-in model's graph builder shares: the opset and IR version they write, the additive
attention mask value, :class:`Graph`, a minimal node emitter (unique names, initializers, nodes), and the
decoders' last-token classification head (:func:`last_token_head`) with its sample batch."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9
MASK_VALUE = -1e9


class Graph:
    """A minimal node emitter: unique names, initializers, nodes."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs):
        self._n += 1
        base = f"{op_type}_{self._n}"
        outs = [f"{base}_out{i}" if n_out > 1 else base for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain, **attrs))
        return outs if n_out > 1 else outs[0]

    def model(self, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
        """The graph as a model of :data:`OPSET` and :data:`IR_VERSION`."""
        graph = helper.make_graph(self.nodes, name, inputs=inputs, outputs=outputs, initializer=self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="trainrun")
        model.ir_version = IR_VERSION
        return model


CLS_INPUTS = ["input_ids", "input_mask"]


def last_token_head(g: Graph, hidden: str, width: int, num_labels: int, name: str) -> onnx.ModelProto:
    """A decoder's sequence classification head (transformers' <Model>ForSequenceClassification): the last
    token's state (the last of ``input_mask``'s ones; transformers finds it as the last token that is not
    ``pad_token_id``, the same on right-padded data whose padding id appears nowhere else) of ``hidden``
    [batch, seq, width] -> ``score`` (no bias) -> ``logits`` [batch, num_labels]."""
    g.const("c_one", np.array(1, np.int64))
    g.const("c_axis1", np.array([1], np.int64))
    g.const("c_last_axis", np.array([-1], np.int64))
    last = g.op("Sub", [g.op("ReduceSum", ["input_mask", "c_axis1"], keepdims=0), "c_one"])           # [B]
    pooled = g.op("GatherND", [hidden, g.op("Unsqueeze", [last, "c_last_axis"])], batch_dims=1)     # [B, width]
    g.nodes.append(helper.make_node("Gemm", [pooled, "score.weight"], ["logits"], name="score", transB=1))
    ids = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in CLS_INPUTS]
    return g.model(name, ids, [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_labels])])


def right_padded_sample(vocab_size: int, num_labels: int, rng) -> dict[str, np.ndarray]:
    """Right-padded rows (id 0 only as padding) and their labels: a valid batch of a last-token head."""
    ids = rng.integers(1, vocab_size, (4, 16))
    mask = np.ones((4, 16), np.int64)
    for b, n in enumerate((16, 9, 3, 12)):
        ids[b, n:], mask[b, n:] = 0, 0
    return {"input_ids": ids.astype(np.int64), "input_mask": mask,
            "labels": rng.integers(0, num_labels, 4).astype(np.int64)}


def decoder_io(vocab_size: int, layers: int, kv_heads: int, head_dim: int, kv_cache: bool) -> tuple[list, list]:
    """A decoder's graph inputs and outputs: input_ids -> logits, and with ``kv_cache`` each layer's
    past/present key and value ([batch, kv_heads, positions, head_dim])."""
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab_size])]
    for i in range(layers if kv_cache else 0):
        for name in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past.{i}.{name}", TensorProto.FLOAT,
                                                        ["batch", kv_heads, "past", head_dim]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{name}", TensorProto.FLOAT,
                                                         ["batch", kv_heads, "past_seq", head_dim]))
    return inputs, outputs
