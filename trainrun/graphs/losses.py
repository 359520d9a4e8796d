"""The loss heads (cross-entropy, mse, l1, or the graph's own loss output) and the eval metrics; the
cross-entropy's rewrites into faster kernels (:func:`split_cross_entropy`)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper

from .forward import Forward, num_classes
from ..errors import UsageError
from .names import LOSS, METRIC_PREFIX
from .onnx_edit import const, fresh, opset, value_dims

# top-5 accuracy is reported for 5..TOP5_MAX_CLASSES classes: TopK over a GPT-2 vocabulary (50257) costs
# more than the eval step itself (docs/design.md, "Small costs per step")
TOP5_MAX_CLASSES = 4096


# prepare splits the cross-entropy of a user model from this many classes on (a vocabulary): below it the
# SCE kernel costs little, and the graph stays as it was (a BatchNorm classifier's parity run drifts with
# the last ulp of the gradient)
SPLIT_MIN_CLASSES = 1024


def with_loss(fwd: Forward, ignore_index: int, keep_logits: bool, metrics: bool = False,
              label_smoothing: float = 0.0) -> onnx.ModelProto:
    """Forward graph + scalar ``loss``: the graph's own loss output (``fwd.loss``), cross-entropy
    (SoftmaxCrossEntropyLoss over the class axis; smoothed with ``label_smoothing``), mse or l1.
    ``metrics``: keep the graph's eval-metric outputs and add the loss type's (accuracy and top-5
    accuracy, and the plain cross-entropy ``ce`` when smoothed; mse and mae)."""
    model = copy.deepcopy(fwd.model)
    inputs = list(model.graph.input)
    outputs = [helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, [])]
    if fwd.loss:
        # a loss output already named as trainrun's (torch.onnx.export's output_names=["loss"]) stays as it is
        nodes = list(model.graph.node) + ([] if fwd.loss == LOSS else
                                          [helper.make_node("Identity", [fwd.loss], [LOSS], name="loss_output")])
    else:
        dims = value_dims(model, fwd.logits)
        if fwd.loss_type == "cross_entropy":
            loss_nodes, metric_nodes = _cross_entropy(model, fwd, ignore_index, num_classes(fwd), label_smoothing)
            elem = TensorProto.INT64
            labels_shape = None if dims is None else [d for i, d in enumerate(dims)
                                                     if i != fwd.class_axis % len(dims)]
        else:
            loss_nodes, metric_nodes = _regression(fwd)
            elem = next(o for o in model.graph.output if o.name == fwd.logits).type.tensor_type.elem_type
            labels_shape = dims
        nodes = list(model.graph.node) + loss_nodes + (metric_nodes if metrics else [])
        inputs.append(helper.make_tensor_value_info(fwd.labels, elem, labels_shape))
        if metrics:
            outputs += [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, [])
                        for n in metric_nodes if n.output[0].startswith(METRIC_PREFIX)]
    if keep_logits and fwd.logits:
        outputs += [o for o in model.graph.output if o.name == fwd.logits]
    if metrics:
        outputs += [o for o in model.graph.output if o.name.startswith(METRIC_PREFIX)]
    return fresh(model, nodes, inputs, outputs, list(model.graph.initializer))


def _cross_entropy(model, fwd: Forward, ignore_index: int, classes: int | None,
                   smoothing: float = 0.0) -> tuple[list, list]:
    """(loss nodes, metric nodes). Loss: SoftmaxCrossEntropyLoss (mean, ``ignore_index``, class weights)
    -> ``loss``, or with label ``smoothing`` > 0 :func:`_smoothed_cross_entropy`; classes last: logits
    reshaped [N, C], labels [N] first. Metrics over the labels that are not ``ignore_index``: top-1
    accuracy (ArgMax) and, when 5 <= C <= TOP5_MAX_CLASSES, top-5 (TopK)."""
    nodes = []
    if fwd.class_axis == -1:
        nodes += [
            const("loss_labels_shape", [-1]),
            # Reshape [.., C] -> [N, C] needs C from the logits themselves: take the last dim.
            # Shape + Slice rather than Shape(start=-1): works from opset 12 (SoftmaxCrossEntropyLoss's own)
            helper.make_node("Shape", [fwd.logits], ["loss_logits_shape"], name="loss_shape"),
            const("loss_minus1", [-1]),
            const("loss_big", [2**62]),
            helper.make_node("Slice", ["loss_logits_shape", "loss_minus1", "loss_big"], ["loss_logits_dims"],
                             name="loss_last_dim"),
            helper.make_node("Concat", ["loss_minus1", "loss_logits_dims"], ["loss_2d_shape"], axis=0,
                             name="loss_cat"),
            helper.make_node("Reshape", [fwd.logits, "loss_2d_shape"], ["loss_logits_2d"], name="loss_flat_logits"),
            helper.make_node("Reshape", [fwd.labels, "loss_labels_shape"], ["loss_labels_1d"],
                             name="loss_flat_labels")]
        scores, labels = "loss_logits_2d", "loss_labels_1d"
    else:
        scores, labels = fwd.logits, fwd.labels
    sce_in = [scores, labels]
    if fwd.class_weights:
        nodes.append(const("loss_class_weights", fwd.class_weights, np.float32))
        sce_in.append("loss_class_weights")
    if smoothing:
        loss_nodes, m = _smoothed_cross_entropy(model, fwd, scores, labels, ignore_index, smoothing)
        nodes += loss_nodes
    else:
        # over [N, C, d...] onnxruntime's gradient of SoftmaxCrossEntropyLoss needs its optional log_prob output
        sce_out = [LOSS] if fwd.class_axis == -1 else [LOSS, "loss_log_prob"]
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", sce_in, sce_out, reduction="mean",
                                      ignore_index=ignore_index, name="loss_sce"))
        m = []
    # metrics: correct predictions and counted labels (float32 sums)
    m += [const("acc_ignore", ignore_index),
         helper.make_node("Equal", [labels, "acc_ignore"], ["acc_ignored"], name="acc_ignored"),
         helper.make_node("Not", ["acc_ignored"], ["acc_valid"], name="acc_valid"),
         helper.make_node("Cast", ["acc_valid"], ["acc_valid_f"], to=TensorProto.FLOAT, name="acc_valid_f"),
         helper.make_node("ReduceSum", ["acc_valid_f"], [f"{METRIC_PREFIX}accuracy/count"], keepdims=0,
                          name="acc_count"),
         helper.make_node("ArgMax", [scores], ["acc_pred"], axis=1, keepdims=0, name="acc_argmax"),
         helper.make_node("Equal", ["acc_pred", labels], ["acc_hit"], name="acc_hit"),
         helper.make_node("And", ["acc_hit", "acc_valid"], ["acc_correct"], name="acc_correct"),
         helper.make_node("Cast", ["acc_correct"], ["acc_correct_f"], to=TensorProto.FLOAT, name="acc_correct_f"),
         helper.make_node("ReduceSum", ["acc_correct_f"], [f"{METRIC_PREFIX}accuracy/sum"], keepdims=0,
                          name="acc_sum")]
    if classes is not None and 5 <= classes <= TOP5_MAX_CLASSES:
        # a label counts once when it is among the 5 best: ignored labels become -1, which no index equals
        unsq = [helper.make_node("Unsqueeze", ["top5_labels", "top5_axis"], ["top5_labels_k"], name="top5_unsq")] \
            if opset(model) >= 13 else \
            [helper.make_node("Unsqueeze", ["top5_labels"], ["top5_labels_k"], axes=[1], name="top5_unsq")]
        m += [const("top5_k", [5]), const("top5_axis", [1]), const("top5_none", -1),
              helper.make_node("Where", ["acc_valid", labels, "top5_none"], ["top5_labels"], name="top5_where"),
              helper.make_node("TopK", [scores, "top5_k"], ["top5_values", "top5_index"], axis=1, name="top5"),
              *unsq,
              helper.make_node("Equal", ["top5_index", "top5_labels_k"], ["top5_hit"], name="top5_hit"),
              helper.make_node("Cast", ["top5_hit"], ["top5_hit_f"], to=TensorProto.FLOAT, name="top5_hit_f"),
              helper.make_node("ReduceSum", ["top5_hit_f"], [f"{METRIC_PREFIX}top5_accuracy/sum"], keepdims=0,
                               name="top5_sum"),
              helper.make_node("Identity", [f"{METRIC_PREFIX}accuracy/count"],
                               [f"{METRIC_PREFIX}top5_accuracy/count"], name="top5_count")]
    return nodes, m


def _smoothed_cross_entropy(model, fwd: Forward, scores: str, labels: str, ignore_index: int,
                            s: float) -> tuple[list, list]:
    """(loss nodes, metric nodes): torch.nn.functional.cross_entropy(label_smoothing=s), reduction mean.
    With z the logits, lse_i = log sum_c exp z_ic, w the class weights, W = sum_c w_c, over the rows i whose
    label y_i is not ``ignore_index``, torch's loss is

        ((1 - s) sum_i w_yi (lse_i - z_iy) + s / C sum_i sum_c w_c (lse_i - z_ic)) / sum_i w_yi.

    Without weights that is the plain cross-entropy plus a term linear in z,
    ``CE + s * sum_i (z_iy - mean_c z_ic) / count``: the plain loss stays the SoftmaxCrossEntropyLoss
    that split_cross_entropy makes cheap (its gradient by Exp), and the smoothing costs a gather and a
    sum over the classes. With weights, lse's sum comes from a second, unweighted SoftmaxCrossEntropyLoss
    (sum of lse_i - z_iy). The metric ``ce`` (sum and count) is the plain cross-entropy: eval's perplexity."""
    if opset(model) < 13:
        raise UsageError(f"model.loss.label_smoothing: the forward graph is opset {opset(model)}; the smoothed "
                         f"loss needs opset >= 13 (re-export the model with a newer opset)")
    p = "loss_smooth/"
    weighted = bool(fwd.class_weights)

    def node(op, inputs, out, **kw):
        return helper.make_node(op, inputs, [p + out], name=p + out, **kw)

    def sce(inputs, out, reduction):     # over [N, C, d...] onnxruntime's gradient needs the log_prob output
        outs = [p + out] + ([p + out + "_log_prob"] if fwd.class_axis != -1 else [])
        return helper.make_node("SoftmaxCrossEntropyLoss", inputs, outs, reduction=reduction,
                                ignore_index=ignore_index, name=p + out)
    nodes = [const(p + "ignore", ignore_index), const(p + "zero", 0), const(p + "axis1", [1]),
             const(p + "one", [1]), const(p + "s", s, np.float32),
             node("Equal", [labels, p + "ignore"], "ignored"),
             node("Not", [p + "ignored"], "valid"),
             node("Cast", [p + "valid"], "valid_f", to=TensorProto.FLOAT),
             node("Where", [p + "valid", labels, p + "zero"], "index"),
             node("Unsqueeze", [p + "index", p + "axis1"], "index1"),
             node("GatherElements", [scores, p + "index1"], "picked1", axis=1),
             node("ReduceSum", [p + "picked1", p + "axis1"], "picked", keepdims=0),
             node("Mul", [p + "picked", p + "valid_f"], "picked_valid"),
             node("ReduceSum", [p + "picked_valid"], "picked_sum", keepdims=0),        # sum_i z_iy
             node("Shape", [scores], "shape"),
             node("Gather", [p + "shape", p + "one"], "classes_i"),
             node("Cast", [p + "classes_i"], "classes_f1", to=TensorProto.FLOAT),
             node("ReduceSum", [p + "classes_f1"], "classes_f", keepdims=0),
             node("Div", [p + "s", p + "classes_f"], "per_class")]                  # s / C
    if not weighted:
        nodes += [sce([scores, labels], "ce", "mean"),
                  node("ReduceSum", [p + "valid_f"], "count", keepdims=0),
                  node("ReduceSum", [scores, p + "axis1"], "class_sum", keepdims=0),
                  node("Mul", [p + "class_sum", p + "valid_f"], "class_sum_valid"),
                  node("ReduceSum", [p + "class_sum_valid"], "z_sum", keepdims=0),     # sum_i sum_c z_ic
                  node("Mul", [p + "z_sum", p + "per_class"], "z_part"),
                  node("Mul", [p + "picked_sum", p + "s"], "y_part"),
                  node("Sub", [p + "y_part", p + "z_part"], "linear"),
                  node("Div", [p + "linear", p + "count"], "linear_mean"),
                  helper.make_node("Add", [p + "ce", p + "linear_mean"], [LOSS], name=p + "loss")]
    else:
        dims = value_dims(model, fwd.logits)
        rank = 2 if fwd.class_axis == -1 else (len(dims) if dims is not None else None)
        if rank is None:
            raise UsageError(f"model.loss.label_smoothing with model.loss.weights over class axis 1: the rank of "
                             f"{fwd.logits!r} is not known from the graph")
        nodes += [const(p + "weights", fwd.class_weights, np.float32),      # [C], and [C, 1, ...] to broadcast
                  const(p + "weights_b", np.reshape(fwd.class_weights, [-1] + [1] * (rank - 2)), np.float32),
                  const(p + "weights_sum", float(np.sum(fwd.class_weights, dtype=np.float64)), np.float32),
                  const(p + "keep", 1.0 - s, np.float32),
                  sce([scores, labels, p + "weights"], "ce", "mean"),
                  sce([scores, labels], "nll_sum", "sum"),                          # sum_i lse_i - z_iy
                  node("Gather", [p + "weights", p + "index"], "label_w"),
                  node("Mul", [p + "label_w", p + "valid_f"], "row_w"),
                  node("ReduceSum", [p + "row_w"], "count", keepdims=0),            # sum_i w_yi
                  node("Mul", [scores, p + "weights_b"], "weighted"),
                  node("ReduceSum", [p + "weighted", p + "axis1"], "class_sum", keepdims=0),
                  node("Mul", [p + "class_sum", p + "valid_f"], "class_sum_valid"),
                  node("ReduceSum", [p + "class_sum_valid"], "z_sum", keepdims=0),  # sum_i sum_c w_c z_ic
                  node("Add", [p + "nll_sum", p + "picked_sum"], "lse_sum"),
                  node("Mul", [p + "lse_sum", p + "weights_sum"], "lse_w"),
                  node("Sub", [p + "lse_w", p + "z_sum"], "smooth"),
                  node("Mul", [p + "smooth", p + "per_class"], "smooth_part"),
                  node("Div", [p + "smooth_part", p + "count"], "smooth_mean"),
                  node("Mul", [p + "ce", p + "keep"], "ce_part"),
                  helper.make_node("Add", [p + "ce_part", p + "smooth_mean"], [LOSS], name=p + "loss")]
    nodes.append(node("Mul", [p + "ce", p + "count"], "ce_sum"))
    metrics = [helper.make_node("Identity", [p + "ce_sum"], [f"{METRIC_PREFIX}ce/sum"], name=p + "ce_sum_out"),
               helper.make_node("Identity", [p + "count"], [f"{METRIC_PREFIX}ce/count"], name=p + "ce_count")]
    return nodes, metrics


def _regression(fwd: Forward) -> tuple[list, list]:
    """(loss nodes, metric nodes): mean squared (mse) or absolute (l1) error of the predictions against
    targets of their shape -> ``loss``; metrics mse and mae over every element."""
    err = helper.make_node("Sub", [fwd.logits, fwd.labels], ["loss_err"], name="loss_err")
    sq = helper.make_node("Mul", ["loss_err", "loss_err"], ["loss_sq"], name="loss_sq")
    ab = helper.make_node("Abs", ["loss_err"], ["loss_abs"], name="loss_abs")
    per = "loss_sq" if fwd.loss_type == "mse" else "loss_abs"
    loss = [err, sq if fwd.loss_type == "mse" else ab,
            helper.make_node("ReduceMean", [per], [LOSS], keepdims=0, name="loss_mean")]
    metrics = [sq if fwd.loss_type != "mse" else ab,
               helper.make_node("Size", ["loss_err"], ["reg_size"], name="reg_size"),
               helper.make_node("Cast", ["reg_size"], ["reg_count"], to=TensorProto.FLOAT, name="reg_count"),
               helper.make_node("ReduceSum", ["loss_sq"], [f"{METRIC_PREFIX}mse/sum"], keepdims=0, name="mse_sum"),
               helper.make_node("Identity", ["reg_count"], [f"{METRIC_PREFIX}mse/count"], name="mse_count"),
               helper.make_node("ReduceSum", ["loss_abs"], [f"{METRIC_PREFIX}mae/sum"], keepdims=0, name="mae_sum"),
               helper.make_node("Identity", ["reg_count"], [f"{METRIC_PREFIX}mae/count"], name="mae_count")]
    return loss, metrics


def head_metrics(loss_type: str, classes: int | None, label_smoothing: float = 0.0) -> list[str]:
    """The eval metrics :func:`with_loss` adds to a loss it builds from the logits: cross_entropy's
    accuracy, top-5 accuracy (5 <= ``classes`` <= TOP5_MAX_CLASSES) and, smoothed, the plain ``ce``;
    mse's and l1's mse and mae."""
    if loss_type != "cross_entropy":
        return ["mse", "mae"]
    return ["accuracy", *(["top5_accuracy"] if classes is not None and 5 <= classes <= TOP5_MAX_CLASSES else []),
            *(["ce"] if label_smoothing else [])]


def metric_outputs(model: onnx.ModelProto) -> list[str]:
    """The eval-metric outputs (``metric/<name>/sum|count``) of ``model``, in graph order."""
    return [o.name for o in model.graph.output if o.name.startswith(METRIC_PREFIX)]


def split_cross_entropy(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every SoftmaxCrossEntropyLoss of ``model`` (opset >= 13) as LogSoftmax over axis 1 +
    NegativeLogLikelihoodLoss (the same attributes and inputs): ONNX's own definition of the op, the same
    outputs (its ``log_prob`` output, which the gradient's SoftmaxCrossEntropyLossGrad reads, now comes
    from LogSoftmax). onnxruntime's CPU SoftmaxCrossEntropyLoss is a scalar one-thread loop, LogSoftmax
    (MLAS) + the NLL pick vectorised (docs/design.md, "Levers at GPT-2 124M"). Applied after the gradient
    builder, which differentiates SoftmaxCrossEntropyLoss in one cheap kernel (the gradient of LogSoftmax
    + NLL, LogSoftmaxGrad, is slower). Before opset 13
    LogSoftmax flattened its input from ``axis``: such graphs are left alone. In a train graph the
    gradient's SoftmaxCrossEntropyLossGrad is rewritten too (:func:`_cross_entropy_grad_by_exp`).
    Returns ``model``, changed in place."""
    if opset(model) < 13:
        return model
    nodes = []
    for n in model.graph.node:
        if n.op_type != "SoftmaxCrossEntropyLoss" or n.domain not in ("", "ai.onnx"):
            nodes.append(n)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        log_prob = n.output[1] if len(n.output) > 1 and n.output[1] else n.output[0] + "/log_prob"
        kw = {"reduction": attrs.get("reduction", b"mean").decode()}
        if "ignore_index" in attrs:
            kw["ignore_index"] = attrs["ignore_index"]
        nodes += [helper.make_node("LogSoftmax", [n.input[0]], [log_prob], axis=1, name=f"{n.name}/log_softmax"),
                  helper.make_node("NegativeLogLikelihoodLoss", [log_prob, *n.input[1:]], [n.output[0]],
                                   name=f"{n.name}/nll", **kw)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return _cross_entropy_grad_by_exp(model)


def _cross_entropy_grad_by_exp(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every SoftmaxCrossEntropyLossGrad of a train graph (reduction mean or sum, no class weights,
    opset >= 16) as d_logits = Exp(log_prob) * r - r at each label, r = dY / (labels not ignored)
    per row (0 on an ignored row): Exp, Mul and an in-place ScatterElements(add), vectorised passes
    over the logits, where onnxruntime's CPU kernel is a scalar exp loop. Class axis 1 at any rank, as the op. Returns ``model``,
    changed in place."""
    if opset(model) < 16:
        return model
    nodes = []
    for n in model.graph.node:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        reduction = a.get("reduction", b"mean").decode()
        if n.op_type != "SoftmaxCrossEntropyLossGrad" or n.domain != "com.microsoft" or reduction not in \
                ("mean", "sum") or any(n.input[3:]):
            nodes.append(n)
            continue
        dy, log_prob, label = n.input[:3]
        b = (n.name or n.output[0]) + "/exp"
        if "ignore_index" in a:
            nodes += [const(b + "/ignore", a["ignore_index"]),
                      helper.make_node("CastLike", [b + "/ignore", label], [b + "/ignore_t"], name=b + "/ignore_t"),
                      helper.make_node("Equal", [label, b + "/ignore_t"], [b + "/ignored"], name=b + "/ignored"),
                      helper.make_node("Not", [b + "/ignored"], [b + "/valid"], name=b + "/valid"),
                      const(b + "/zero", 0),
                      helper.make_node("CastLike", [b + "/zero", label], [b + "/zero_t"], name=b + "/zero_t"),
                      helper.make_node("Where", [b + "/valid", label, b + "/zero_t"], [b + "/index"],
                                       name=b + "/index")]
            index = b + "/index"
        else:
            nodes.append(helper.make_node("Equal", [label, label], [b + "/valid"], name=b + "/valid"))
            index = label
        nodes += [helper.make_node("CastLike", [b + "/valid", dy], [b + "/w"], name=b + "/w")]
        if reduction == "mean":
            nodes += [helper.make_node("ReduceSum", [b + "/w"], [b + "/count"], keepdims=0, name=b + "/count"),
                      helper.make_node("Div", [dy, b + "/count"], [b + "/scale"], name=b + "/scale")]
        else:
            nodes.append(helper.make_node("Identity", [dy], [b + "/scale"], name=b + "/scale"))
        nodes += [const(b + "/axis1", [1]),
                  helper.make_node("Mul", [b + "/w", b + "/scale"], [b + "/r"], name=b + "/r"),
                  helper.make_node("Unsqueeze", [b + "/r", b + "/axis1"], [b + "/r1"], name=b + "/r1"),
                  helper.make_node("Neg", [b + "/r1"], [b + "/minus_r1"], name=b + "/minus_r1"),
                  helper.make_node("Unsqueeze", [index, b + "/axis1"], [b + "/index1"], name=b + "/index1"),
                  helper.make_node("Exp", [log_prob], [b + "/prob"], name=b + "/prob"),
                  helper.make_node("Mul", [b + "/prob", b + "/r1"], [b + "/scaled"], name=b + "/scaled"),
                  helper.make_node("ScatterElements", [b + "/scaled", b + "/index1", b + "/minus_r1"], [n.output[0]],
                                   axis=1, reduction="add", name=b)]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model
