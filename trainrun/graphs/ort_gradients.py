"""The train graph by onnxruntime-training's gradient builder (``graphs.builder: onnxruntime``): its
gradients accumulated in place (com.microsoft InPlaceAccumulatorV2), and the rewrites of its output
(tanh-GELU's gradient by hand, tied embedding gradients by ScatterElements, weight gradients without
transA); the builder's failures explained."""

from __future__ import annotations

import copy
import re

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import TensorProto, helper

from ..errors import UsageError
from .names import ACC_OUT_SUFFIX, BUFFER_SUFFIX, GRAD_SUFFIX, LOSS, RESET
from .onnx_edit import const, fresh, opset


def independent(source: str, missing: list[str]) -> UsageError:
    """The error of a parameter the loss does not depend on (either builder)."""
    return UsageError(f"{source}: the loss does not depend on these parameters (freeze them with "
                      f"model.frozen): {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")


def ort_train_graph(loss_model: onnx.ModelProto, params: list[str], source: str, keep=()) -> onnx.ModelProto:
    """Gradients of ``loss`` w.r.t. ``params`` (already graph inputs) by onnxruntime-training's builder,
    accumulated in place; the outputs ``keep`` (e.g. BatchNormalization's updated running stats) stay
    outputs."""
    import onnxruntime as ort
    from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

    ort.set_default_logger_severity(3)    # errors only: the builder's warnings are not the user's
    options = ort.SessionOptions()
    options.log_severity_level = 3
    wanted = set(params)

    def gradients(model):
        optimized = get_optimized_model(model.SerializeToString(), wanted, options)
        builder = GradientGraphBuilder(optimized, {LOSS}, wanted, LOSS, options)
        builder.build()
        return onnx.load_from_string(builder.get_model())
    try:
        try:
            grad_model = gradients(loss_model)
        except Exception as exc:  # noqa: BLE001 - an assertion: again with the outputs the builder reads
            filled = _outputs_the_builder_reads(loss_model)
            if " was false." not in str(exc) or filled is loss_model:
                raise
            loss_model = filled
            grad_model = gradients(loss_model)
    except Exception as exc:  # noqa: BLE001 - the builder raises RuntimeError/Fail with the op at fault
        raise UsageError(f"{source}: onnxruntime's gradient builder cannot differentiate this graph: "
                         f"{_builder_reason(str(exc), loss_model, wanted)}") from None

    outputs = {o.name: o for o in grad_model.graph.output}
    missing = [p for p in params if p + GRAD_SUFFIX not in outputs]
    if missing:
        raise independent(source, missing)

    nodes = list(_untransposed_weight_gradients(_scatter_tied_gradients(_gelu_gradients(grad_model))).graph.node)
    new_inputs = list(grad_model.graph.input)
    new_outputs = [outputs[LOSS]] + [outputs[k] for k in keep]
    for p in params:
        grad = outputs[p + GRAD_SUFFIX]
        buf = p + BUFFER_SUFFIX
        nodes.append(helper.make_node("InPlaceAccumulatorV2", [buf, grad.name, RESET], [p + ACC_OUT_SUFFIX],
                                      name=f"accumulate/{p}", domain="com.microsoft"))
        buf_vi = copy.deepcopy(grad)
        buf_vi.name = buf
        new_inputs.append(buf_vi)
        new_outputs.append(helper.make_tensor_value_info(p + ACC_OUT_SUFFIX, TensorProto.BOOL, [1]))
    new_inputs.append(helper.make_tensor_value_info(RESET, TensorProto.BOOL, [1]))
    # the builder's value_info kept: without it onnxruntime 1.19 crashes (SIGSEGV) creating a session over
    # MaxPoolGrad, whose forward MaxPool's added Indices output then has no type
    model = fresh(grad_model, nodes, new_inputs, new_outputs, list(grad_model.graph.initializer),
                   grad_model.graph.value_info)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _scatter_tied_gradients(model: onnx.ModelProto) -> onnx.ModelProto:
    """A parameter read by a Gather (an embedding) and by other ops (a tied LM head) gets from the
    gradient builder Sum(its other gradient, GatherGrad(shape, indices, dY)): GatherGrad writes a dense
    zero tensor of the parameter's size, scatters dY into it (a mutex per element in onnxruntime 1.19),
    and the Sum reads both: three passes over a [50257, 768] tensor at GPT-2 124M. Here that pair
    becomes ScatterElements(other gradient, indices, dY, reduction add), which adds the looked-up rows'
    gradients into the other gradient in place (on the CPU serially, so repeated indices are summed in
    the same order every run; on CUDA with atomic adds, whose order varies from run to run).
    When the other gradient is a Transpose's output (a tied LM head's, computed as [width, vocab]), the
    scatter goes into the Transpose's input, along axis 1, and the Transpose then writes the sum: with
    direct gradients (:func:`trainrun.graphs.gradients.direct_gradients`) straight into the flat buffer, where a scatter into a
    bound output first copies its input there; the same adds in the same
    order per element. Only float32 2-D parameters (graph inputs), from opset 16 (ScatterElements'
    reduction); returns ``model``, changed in place."""
    if opset(model) < 16:
        return model
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    uses: dict[str, int] = {}
    for n in nodes:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    params = {i.name for i in model.graph.input if i.type.tensor_type.elem_type == TensorProto.FLOAT
              and len(i.type.tensor_type.shape.dim) == 2}
    replace, dropped = {}, set()
    for n in nodes:
        if n.op_type != "Sum" or len(n.input) != 2:
            continue
        for k, name in enumerate(n.input):
            gg = producer.get(name)
            shape = producer.get(gg.input[0]) if gg is not None and gg.op_type == "GatherGrad" else None
            if shape is None or shape.op_type != "Shape" or shape.input[0] not in params or uses[name] != 1 \
                    or any(a.name == "axis" and a.i != 0 for a in gg.attribute):
                continue
            b, (_, indices, d_rows), other = n.name or n.output[0], gg.input, n.input[1 - k]
            rows = [const(b + "/all", [-1]), const(b + "/start", [1]), const(b + "/big", [2**62]),
                    helper.make_node("Slice", [gg.input[0], b + "/start", b + "/big"], [b + "/width"],
                                     name=b + "/width"),
                    helper.make_node("Concat", [b + "/all", b + "/width"], [b + "/rows_shape"], axis=0,
                                     name=b + "/rows_shape"),                                  # [-1, width]
                    helper.make_node("Reshape", [d_rows, b + "/rows_shape"], [b + "/rows"], name=b + "/rows")]
            tp = producer.get(other)
            # the other gradient a Transpose's output (a tied LM head's): scatter along axis 1 of its input
            transposed = tp is not None and tp.op_type == "Transpose" and uses[other] == 1 \
                and [list(a.ints) for a in tp.attribute if a.name == "perm"] in ([[1, 0]], [])
            if transposed:
                rows.append(helper.make_node("Transpose", [b + "/rows"], [b + "/rows_t"], perm=[1, 0],
                                             name=b + "/rows_t"))
                dropped.add(id(tp))
            updates, axis = (b + "/rows_t", 1) if transposed else (b + "/rows", 0)
            target, out = (tp.input[0], [b + "/sum_t"]) if transposed else (other, list(n.output))
            replace[id(n)] = rows + [
                const(b + "/ids_shape", [1, -1] if transposed else [-1, 1]),
                helper.make_node("Reshape", [indices, b + "/ids_shape"], [b + "/indices"], name=b + "/indices"),
                helper.make_node("Shape", [updates], [b + "/rows_size"], name=b + "/rows_size"),
                helper.make_node("Expand", [b + "/indices", b + "/rows_size"], [b + "/where"], name=b + "/where"),
                helper.make_node("ScatterElements", [target, b + "/where", updates], out, axis=axis,
                                 reduction="add", name=b)]
            if transposed:
                replace[id(n)].append(helper.make_node("Transpose", out, list(n.output), perm=[1, 0], name=b + "/sum"))
            dropped.add(id(gg))
            break
    if not replace:
        return model
    out = []
    for n in nodes:
        if id(n) not in dropped:
            out.extend(replace.get(id(n), [n]))
    del model.graph.node[:]
    model.graph.node.extend(out)
    return model


def _untransposed_weight_gradients(model: onnx.ModelProto) -> onnx.ModelProto:
    """The gradient builder writes a MatMul's weight gradient as Gemm(X, dY, transA=1) = X^T dY, and
    onnxruntime's GemmTransposeFusion turns the tied LM head's Gemm + Transpose into Gemm(dY, X,
    transA=1) over the [tokens, vocab] dY. MLAS runs a transposed A by transposing it again, panel
    by panel, for every block of output columns, slower than the forward's multiply of the same size
    (docs/design.md, "Levers at GPT-2 124M"). Here X is transposed once (Reshape [K, 1, M], Transpose [M, K, 1], Reshape [M, K]:
    a shape onnxruntime's MatmulTransposeFusion does not fold back into a transA) and multiplied by
    a plain MatMul; the same products in the same order. Only Gemm(X, Y) with transA=1, transB=0,
    alpha=1 and no C; returns ``model``, changed in place."""
    nodes, out, changed = list(model.graph.node), [], False
    for n in nodes:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if n.op_type != "Gemm" or n.domain not in ("", "ai.onnx") or len([i for i in n.input if i]) != 2 \
                or a.get("transA", 0) != 1 or a.get("transB", 0) != 0 or a.get("alpha", 1.0) != 1.0:
            out.append(n)
            continue
        b, (x, y) = n.name or n.output[0], n.input[:2]
        out += [const(b + "/k1m", [0, 1, -1]), const(b + "/mk", [0, -1]),
                helper.make_node("Reshape", [x, b + "/k1m"], [b + "/x3"], name=b + "/x3"),
                helper.make_node("Transpose", [b + "/x3"], [b + "/xt3"], perm=[2, 0, 1], name=b + "/xt3"),
                helper.make_node("Reshape", [b + "/xt3", b + "/mk"], [b + "/xt"], name=b + "/xt"),
                helper.make_node("MatMul", [b + "/xt", y], list(n.output), name=b)]
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(out)
    return model


def _gelu_gradients(model: onnx.ModelProto) -> onnx.ModelProto:
    """tanh-GELU written with a Sigmoid, y * sigmoid(y * (a + b y^2)) (the built-in GPT-2's MLP: onnxruntime
    has no fast fused GELU gradient on the CPU), differentiated by hand: the gradient builder chains a
    Mul's gradient per product, 8 Muls, a SigmoidGrad and a Sum of y's four contributions, 12 passes over
    the [tokens, 4 width] activation; here dy = dact s + SigmoidGrad(dact y, s) (poly + 2b y^2), 7 passes
    (poly = a + b y^2, y^2 and s are the forward's). The same value; the rounding differs from the builder's
    chain in the last bits. Only where y's gradient is the Sum of exactly the pattern's four, and y^2, the
    polynomial, z and s feed nothing else; returns ``model``, changed in place."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    backward = lambda n: "_Grad/" in n.name or n.name.startswith("AccumulateGrad_")  # noqa: E731 - the builder's names
    fwd_uses: dict[str, int] = {}
    for n in nodes:
        if not backward(n):
            for i in n.input:
                fwd_uses[i] = fwd_uses.get(i, 0) + 1
    scalars = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
               if t.data_type == TensorProto.FLOAT and int(np.prod(t.dims)) == 1}

    def made(name, op):
        n = producer.get(name)
        return n if n is not None and n.op_type == op and n.domain in ("", "ai.onnx") else None

    def split(n, pred):
        """(the input that satisfies pred, the other) of a two-input node, or None."""
        a, b = n.input
        return (a, b) if pred(a) else (b, a) if pred(b) else None

    replace = {}
    for act in nodes:
        if act.op_type != "Mul" or act.domain not in ("", "ai.onnx") or len(act.input) != 2:
            continue
        pair = split(act, lambda t: made(t, "Sigmoid") is not None)
        if pair is None:
            continue
        s, y = pair
        sig = producer[s]
        zmul = made(sig.input[0], "Mul")
        pair = zmul and split(zmul, lambda t: t != y and made(t, "Add") is not None)
        if not pair or pair[1] != y:
            continue
        poly = pair[0]
        pair = split(producer[poly], lambda t: t in scalars)
        tmul = pair and made(pair[1], "Mul")
        pair = tmul and split(tmul, lambda t: t in scalars)
        sq = pair and made(pair[1], "Mul")
        if not sq or list(sq.input) != [y, y]:
            continue
        b, y2 = float(scalars[pair[0]]), pair[1]
        gy, gact = y + "_grad", act.output[0] + "_grad"
        acc = producer.get(gy)
        # y read by the pattern's four product inputs only, the intermediates by the pattern only: the
        # Sum is of the pattern's contributions, nothing else reaches y's gradient
        if acc is None or acc.op_type != "Sum" or len(acc.input) != 4 or gact not in producer \
                or fwd_uses.get(y) != 4 or any(fwd_uses.get(t, 0) != 1 for t in (y2, tmul.output[0], poly,
                                                                                zmul.output[0], s)):
            continue
        k = act.name or act.output[0]
        replace[id(acc)] = [
            const(k + "/gelu_2b", 2 * b, np.float32),
            helper.make_node("Mul", [gact, s], [k + "/gelu_ds"], name=k + "/gelu_ds"),
            helper.make_node("Mul", [gact, y], [k + "/gelu_dy"], name=k + "/gelu_dy"),
            helper.make_node("SigmoidGrad", [k + "/gelu_dy", s], [k + "/gelu_dz"], name=k + "/gelu_dz",
                             domain="com.microsoft"),
            helper.make_node("Mul", [y2, k + "/gelu_2b"], [k + "/gelu_2by2"], name=k + "/gelu_2by2"),
            helper.make_node("Add", [poly, k + "/gelu_2by2"], [k + "/gelu_slope"], name=k + "/gelu_slope"),
            helper.make_node("Mul", [k + "/gelu_dz", k + "/gelu_slope"], [k + "/gelu_dzy"], name=k + "/gelu_dzy"),
            helper.make_node("Add", [k + "/gelu_ds", k + "/gelu_dzy"], [gy], name=k + "/gelu_grad")]
    if not replace:
        return model
    out = [x for n in nodes for x in replace.get(id(n), [n])]
    keep = {o.name for o in model.graph.output}
    while True:      # the builder's chain, now read by nothing
        used = keep | {i for n in out for i in n.input}
        gone = {id(n) for n in out if backward(n) and not used.intersection(n.output)}
        if not gone:
            break
        out = [n for n in out if id(n) not in gone]
    del model.graph.node[:]
    model.graph.node.extend(out)
    return model


# optional outputs that onnxruntime's gradient builder reads from the forward node (an assertion
# without them): how many outputs each of these ops needs. torch.onnx.export writes one output of each
# (the cross-entropy's log-probabilities, LayerNormalization's mean and inverse standard deviation left out)
_BUILDER_OUTPUTS = {"SoftmaxCrossEntropyLoss": 2, "LayerNormalization": 3}


def _outputs_the_builder_reads(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose :data:`_BUILDER_OUTPUTS` nodes write the optional outputs their gradients
    read (computed by the same kernel; the node's other outputs unchanged); ``model`` when none lacks one.
    Only for a graph the builder failed on: onnxruntime's optimizer rewrites some of these nodes itself
    (a cross-entropy over logits reshaped to [N, C], the built-in models'), and those graphs stay as they
    are."""
    short = [k for k, n in enumerate(model.graph.node) if n.domain in ("", "ai.onnx")
             and len([o for o in n.output if o]) < _BUILDER_OUTPUTS.get(n.op_type, 0)]
    if not short:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input} \
        | {t.name for t in model.graph.initializer}
    for k in short:
        n = out.graph.node[k]
        while len(n.output) < _BUILDER_OUTPUTS[n.op_type]:
            n.output.append("")
        for i, name in enumerate(n.output):
            if not name:
                name = f"{n.output[0]}/output_{i}"
                while name in taken:
                    name += "_"
                taken.add(name)
                n.output[i] = name
    return out


def _builder_reason(text: str, model: onnx.ModelProto, params: set) -> str:
    """The useful part of a gradient-builder exception: the op and node at fault and what to do; an
    internal check's failure (an assertion, which does not say on which node) names the nodes between
    the parameters and the loss that leave optional outputs out (onnx's schemas; an op onnx does not
    define counts too), the outputs the builder's gradients read."""
    m = re.search(r"has not been registered: (\S+) for node\s*(\S*)", text)
    if m:
        node = f" (node '{m.group(2)}')" if m.group(2) else ""
        return (f"operator {m.group(1)}{node} has no gradient; freeze the parameters that feed it "
                f"(model.frozen) or express it with differentiable operators")
    text = text.strip().splitlines()[-1]
    if " was false." not in text:
        return text.split("] ")[-1]
    check = text.split(" was false.")[0].split(" const ")[-1].strip()
    short = [f"{n.op_type} node '{n.name or n.output[0]}' ({why})" for n, why in _short_nodes(model, params)]
    if not short:
        return (f"its internal check '{check}' failed on an operator of this graph; freeze the parameters "
                f"that feed the operator (model.frozen) or express it with other operators")
    return (f"its internal check '{check}' failed: the gradient of a node reads an output the node does not "
            f"write; {'; '.join(short[:5])}{' ...' if len(short) > 5 else ''}. Export the model with "
            f"every output of such a node (an unused output is fine), express it with other operators, or "
            f"freeze the parameters that feed it (model.frozen)")


def _short_nodes(model: onnx.ModelProto, params: set):
    """(node, why) for each node between ``params`` and the loss that writes fewer outputs than its
    schema allows, or whose op onnx does not define."""
    nodes = list(model.graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    before, stack = set(), [LOSS]           # the loss's ancestors
    while stack:
        k = producer.get(stack.pop())
        if k is not None and k not in before:
            before.add(k)
            stack.extend(nodes[k].input)
    after, changed = set(params), True       # the tensors that depend on a parameter
    while changed:
        changed = False
        for n in nodes:
            if after.intersection(n.input) and not after.issuperset(o for o in n.output if o):
                after.update(o for o in n.output if o)
                changed = True
    version = opset(model)
    for k in sorted(before):
        n = nodes[k]
        if not after.intersection(n.input):
            continue
        try:
            schema = onnx.defs.get_schema(n.op_type, version, n.domain if n.domain != "ai.onnx" else "")
        except Exception:  # noqa: BLE001 - an op onnx does not define (onnxruntime's own)
            yield n, "an operator onnx does not define: its optional outputs unknown here"
            continue
        written = len([o for o in n.output if o])
        if written < len(schema.outputs):
            missing = [o.name for o in schema.outputs[written:]]
            yield n, f"writes {written} of its {len(schema.outputs)} outputs, not {', '.join(missing)}"
