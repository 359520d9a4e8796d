"""Which float element types the CUDA provider of the onnxruntime in use has a kernel for, per op (a
table per build, derived from its provider library by ``scripts/cuda_kernels.py``: ``cuda_kernels.tsv``
for onnxruntime-training 1.19.2's CUDA 11.8 build, ``cuda_kernels_gpu.tsv`` for stock onnxruntime-gpu
1.26.0, the last CUDA 12 build; :func:`table` takes the one of :func:`trainrun.step.cuda.stack`), and the
``prepare``-time check of a graph against it (``device: cuda``): a node with no kernel for its type
would stop the session's creation on the GPU, after the run has started. Runs without a GPU.

An op the table lacks, or lists as ``*`` (its kernel is not a template of the element type), is not
checked; the table does not tell opset versions apart. Another onnxruntime-gpu release than the table's
is checked against the table's."""

from __future__ import annotations

import functools
import os

import onnx
from onnx import TensorProto, shape_inference

from ..errors import UsageError

FLOATS = {TensorProto.FLOAT: "float", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
          TensorProto.DOUBLE: "double"}
# the ops onnxruntime's gradient builder differentiates an op with, where a kernel may lack a type
GRADIENTS = {"Sigmoid": "SigmoidGrad", "Tanh": "TanhGrad", "Relu": "ReluGrad", "Gelu": "GeluGrad",
             "FastGelu": "FastGeluGrad", "LeakyRelu": "LeakyReluGrad", "QuickGelu": "QuickGeluGrad",
             "Softmax": "SoftmaxGrad_13", "LogSoftmax": "LogSoftmaxGrad_13", "Conv": "ConvGrad",
             "BatchNormalization": "BatchNormalizationGrad", "LayerNormalization": "LayerNormalizationGrad"}


TABLES = {11: "cuda_kernels.tsv", 12: "cuda_kernels_gpu.tsv"}


@functools.cache
def _read(name: str) -> tuple[str, dict[str, set[str]]]:
    build, out = "?", {}
    with open(os.path.join(os.path.dirname(__file__), name)) as fh:
        for line in fh:
            if line.startswith("#"):
                build = line.split(" kernel in ", 1)[1].split(" (")[0] if " kernel in " in line else build
            elif line.strip():
                op, types = line.rstrip("\n").split("\t")
                out[op] = set(types.split(","))
    return build, out


def table_file() -> str:
    """The table of the installed onnxruntime's CUDA build (a CUDA 13 build: the CUDA 12 table)."""
    from .cuda import stack
    return TABLES.get(stack(), TABLES[12])


def build() -> str:
    """The onnxruntime build :func:`table` was derived from (e.g. ``onnxruntime-gpu 1.26.0``)."""
    return _read(table_file())[0]


def table() -> dict[str, set[str]]:
    """op -> the float element types with a kernel ({"*"}: not checked)."""
    return _read(table_file())[1]


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
        raise UsageError(f"{source}: device: cuda, but {build()}'s CUDA provider has no kernel for these ops "
                         f"in these types (trainrun/step/{table_file()})", problems)
