"""Mixed precision (``train.precision``) in the graphs: the Casts that make the loss graph compute in
fp16/bf16 on float32 parameters, and fp16's ``loss_scale`` input (the scale itself is run-time state,
:mod:`trainrun.step.precision`)."""

from __future__ import annotations

import copy

import onnx
from onnx import TensorProto, helper, shape_inference

from ..step import cuda_kernels
from .names import LOSS, LOSS_SCALE
from .onnx_edit import fresh

# Mixed precision (train.precision): these ops, and the loss, compute in float32 on float32 inputs
FP32_OPS = {"LayerNormalization", "Softmax", "LogSoftmax", "SoftmaxCrossEntropyLoss",
            "NegativeLogLikelihoodLoss", "ReduceMean", "Pow", "Sqrt", "Div", "Constant"}


PRECISIONS = {"fp32": None, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def cast_pass(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """The loss graph computing in ``precision`` (fp16/bf16) on float32 inputs (``model`` for fp32).

    Each float32 graph input (the parameters, the dropout masks) is followed by a Cast to the compute
    type, so the parameter buffers stay float32 and their gradients come back to float32 through
    Cast's gradient. :data:`FP32_OPS` (LayerNorm, Softmax, the loss, decomposed-norm arithmetic, and
    Constants) keep float32: their float inputs are cast up and their outputs cast down where a
    low-precision op reads them; so do the values computed from integers and constants alone (positions,
    rotary angles, masks). Another Cast to float32 in the graph casts to the compute type instead.
    Float32 initializers get a Cast too (onnxruntime folds it). Graph outputs keep their types."""
    low = PRECISIONS[precision]
    if low is None:
        return model
    suffix = {TensorProto.FLOAT16: "/fp16", TensorProto.BFLOAT16: "/bf16"}[low]
    inferred = shape_inference.infer_shapes(model)
    floats = {v.name for v in list(inferred.graph.value_info) + list(inferred.graph.input)
              + list(inferred.graph.output) if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    floats |= {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}

    # values of integers and constants alone (positions, rotary angles, masks): float32, a few per step, and
    # exact where the compute type is not (an integer above 256 in bf16, above 2048 in fp16)
    varying = {i.name for i in model.graph.input if i.name in floats}
    for n in model.graph.node:
        if varying.intersection(n.input):
            varying.update(n.output)

    def keeps_fp32(n) -> bool:     # and the ops that, or whose gradient, lack a kernel in the compute type
        return n.op_type in FP32_OPS or not cuda_kernels.computes_in(n.op_type, cuda_kernels.FLOATS[low]) \
            or not varying.intersection(n.input)
    low_made = {n.output[i] for n in model.graph.node if not keeps_fp32(n) for i in range(len(n.output))
                if n.output[i] in floats}
    casts, made = [], {}

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in made:
            made[key] = name + (suffix if to == low else "/fp32")
            casts.append(helper.make_node("Cast", [name], [made[key]], to=to, name=f"cast{made[key]}"))
        return made[key]

    nodes = []
    for n in model.graph.node:
        n = copy.deepcopy(n)
        keep = keeps_fp32(n)
        for i, t in enumerate(n.input):
            if t not in floats:
                continue
            if keep and t in low_made:
                n.input[i] = cast(t, TensorProto.FLOAT)
            elif not keep and t not in low_made:
                n.input[i] = cast(t, low)
        if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT and not keep:
            n.attribute[0].i = low
        nodes.append(n)
    # every Cast goes right after the tensor it reads is made (inputs first)
    producers = {o: i for i, n in enumerate(nodes) for o in n.output}
    placed: dict[int, list] = {}
    for c in casts:
        placed.setdefault(producers.get(c.input[0], -1), []).append(c)
    ordered = placed.get(-1, [])
    for i, n in enumerate(nodes):
        ordered.append(n)
        ordered.extend(placed.get(i, []))
    # a low-precision graph output: computed under another name, cast back to float32 under its own
    for o in model.graph.output:
        if o.name in low_made:
            inner = o.name + suffix
            for n in ordered:
                n.input[:] = [inner if x == o.name else x for x in n.input]
                n.output[:] = [inner if x == o.name else x for x in n.output]
            ordered.append(helper.make_node("Cast", [inner], [o.name], to=TensorProto.FLOAT,
                                            name=f"cast{o.name}"))
    return fresh(model, ordered, list(model.graph.input), list(model.graph.output),
                  list(model.graph.initializer))


def restore_fp32(train: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """The train graph with :data:`FP32_OPS` and their gradients computing in float32 again where
    onnxruntime's pre-training optimisation moved them to the compute type (its PropagateCastOps
    drops fp16 Cast -> Softmax -> Cast): Casts around each such node, as :func:`cast_pass` put them."""
    low = PRECISIONS[precision]
    if low is None:
        return train
    ops = FP32_OPS | {cuda_kernels.GRADIENTS[op] for op in FP32_OPS if op in cuda_kernels.GRADIENTS}
    types = cuda_kernels.tensor_types(train)
    wrong = {n.name for n, dtype in cuda_kernels.node_types(train, types)
             if n.op_type in ops and dtype == cuda_kernels.FLOATS[low]}
    if not wrong:
        return train
    nodes = []
    for n in train.graph.node:
        if n.name not in wrong:
            nodes.append(n)
            continue
        n = copy.deepcopy(n)
        for i, t in enumerate(n.input):
            if types.get(t) == low:
                nodes.append(helper.make_node("Cast", [t], [f"{t}/fp32/{n.name}"], to=TensorProto.FLOAT,
                                              name=f"cast{t}/fp32/{n.name}"))
                n.input[i] = f"{t}/fp32/{n.name}"
        outs = [o for o in n.output if types.get(o) == low]
        n.output[:] = [f"{o}/fp32" if o in outs else o for o in n.output]
        nodes.append(n)
        nodes += [helper.make_node("Cast", [f"{o}/fp32"], [o], to=low, name=f"cast{o}") for o in outs]
    return fresh(train, nodes, list(train.graph.input), list(train.graph.output), list(train.graph.initializer),
                  train.graph.value_info)


def scale_loss(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """fp16: the loss output multiplied by a float32 scalar input ``loss_scale`` (dynamic loss scaling,
    :mod:`trainrun.step.precision`), so the gradients are scaled too; other precisions: ``model``."""
    if precision != "fp16":
        return model
    nodes = list(model.graph.node)
    for n in nodes:
        n.output[:] = [LOSS + "/unscaled" if o == LOSS else o for o in n.output]
    nodes.append(helper.make_node("Mul", [LOSS + "/unscaled", LOSS_SCALE], [LOSS], name="loss_scaled"))
    inputs = list(model.graph.input) + [helper.make_tensor_value_info(LOSS_SCALE, TensorProto.FLOAT, [])]
    return fresh(model, nodes, inputs, list(model.graph.output), list(model.graph.initializer))
