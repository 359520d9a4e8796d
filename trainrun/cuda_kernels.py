"""Which float element types onnxruntime-training 1.19.2's CUDA provider has a kernel for, per op
(``cuda_kernels.tsv``, derived from the provider library by ``scripts/cuda_kernels.py``), and the
``prepare``-time check of a graph against it (``device: cuda``): a node with no kernel for its type
would stop the session's creation on the GPU, after the run has started. Runs without a GPU.

An op the table lacks, or lists as ``*`` (its kernel is not a template of the element type), is not
checked; the table does not tell opset versions apart."""

from __future__ import annotations

import functools
import os

import onnx
from onnx import TensorProto, shape_inference

from .errors import UsageError

FLOATS = {TensorProto.FLOAT: "float", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
          TensorProto.DOUBLE: "double"}
# the ops onnxruntime's gradient builder differentiates an op with, where a kernel may lack a type
GRADIENTS = {"Sigmoid": "SigmoidGrad", "Tanh": "TanhGrad", "Relu": "ReluGrad", "Gelu": "GeluGrad",
             "FastGelu": "FastGeluGrad", "LeakyRelu": "LeakyReluGrad", "QuickGelu": "QuickGeluGrad",
             "Softmax": "SoftmaxGrad_13", "LogSoftmax": "LogSoftmaxGrad_13", "Conv": "ConvGrad",
             "BatchNormalization": "BatchNormalizationGrad", "LayerNormalization": "LayerNormalizationGrad"}


@functools.cache
def table() -> dict[str, set[str]]:
    """op -> the float element types with a kernel ({"*"}: not checked)."""
    out = {}
    with open(os.path.join(os.path.dirname(__file__), "cuda_kernels.tsv")) as fh:
        for line in fh:
            if line.strip() and not line.startswith("#"):
                op, types = line.rstrip("\n").split("\t")
                out[op] = set(types.split(","))
    return out


def has_kernel(op: str, dtype: str) -> bool:
    types = table().get(op, {"*"})
    return "*" in types or dtype in types


def computes_in(op: str, dtype: str) -> bool:
    """Whether ``op`` and the op differentiating it both have a ``dtype`` kernel."""
    return has_kernel(op, dtype) and (op not in GRADIENTS or has_kernel(GRADIENTS[op], dtype))


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> element type, where shape inference over the graph's value_info knows it."""
    inferred = shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.graph.value_info)
             + list(inferred.graph.input) + list(inferred.graph.output)}
    return types | {t.name: t.data_type for t in model.graph.initializer}


def node_types(model: onnx.ModelProto, types: dict[str, int] | None = None) -> list[tuple[onnx.NodeProto, str]]:
    """Each node with the element type it computes in: that of its first float input or output whose
    type is known (shape inference over the graph's value_info); nodes without one are left out."""
    types = types or tensor_types(model)
    out = []
    for n in model.graph.node:
        dtype = next((FLOATS[types[t]] for t in list(n.input) + list(n.output) if types.get(t) in FLOATS), None)
        if dtype:
            out.append((n, dtype))
    return out


def check(graphs: dict[str, onnx.ModelProto], source: str) -> None:
    """UsageError naming every node of ``graphs`` (name -> graph) whose op lacks a CUDA kernel for
    its element type."""
    problems = [f"{name} graph: node '{n.name}' ({n.op_type}, {dtype})" for name, model in graphs.items()
                for n, dtype in node_types(model) if not has_kernel(n.op_type, dtype)]
    if problems:
        raise UsageError(f"{source}: device: cuda, but onnxruntime-training 1.19.2's CUDA provider has no "
                         f"kernel for these ops in these types (trainrun/cuda_kernels.tsv)", problems)
