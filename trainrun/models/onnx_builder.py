"""What every built-in model's graph builder shares: the opset and IR version they write, the additive
attention mask value, and :class:`Graph`, a minimal node emitter (unique names, initializers, nodes)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

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
