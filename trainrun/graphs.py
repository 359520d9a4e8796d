"""``trainrun prepare``: the train, eval and optimizer graphs from a forward graph.

Input: a built-in GPT-2 or BERT, or a user's forward ONNX (data inputs -> logits).
Output, in ``<output_dir>/graphs/``:

* ``train.onnx``      data + labels + parameters + gradient buffers + ``lazy_reset_grad``
                      -> ``loss``; each gradient is accumulated IN PLACE into its buffer
                      (com.microsoft InPlaceAccumulatorV2: reset when ``lazy_reset_grad``).
* ``eval.onnx``       data + labels + parameters -> ``loss`` (and ``logits`` if asked).
* ``forward.onnx``    data + parameters -> logits, dropout off (the base of ``export``).
* ``optimizer.onnx``  the update rule over flat buffers (see :mod:`trainrun.optim`).
* ``weights.safetensors``  initial parameters.
* ``manifest.json``   parameter names and shapes (in flat-buffer order), data inputs,
                      graph hashes, versions.

Parameters are graph inputs in every graph, so one set of flat buffers serves all
sessions. Gradients come from onnxruntime-training's C++ gradient builder
(needs no torch).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from safetensors.numpy import save_file

from . import cuda_kernels
from .config import Config, to_dict
from .data import outside
from .errors import TrainrunError, UsageError
from .models import bert, gpt2
from .optim import build_optimizer_graph
from .pretrained import load_into
from .recompute import recompute_blocks
from .rundir import sha256_file

IR_VERSION = 9
LOSS = "loss"
RESET = "lazy_reset_grad"
GRAD_SUFFIX = "_grad"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
# Eval metrics: a forward graph may output float32 scalars ``metric/<name>/sum`` and
# ``metric/<name>/count``; the eval graph keeps them, the runner sums each over eval batches and
# ranks and reports ``eval_<name> = sum / count`` (e.g. correct predictions / labelled positions).
METRIC_PREFIX = "metric/"
ACC_OUT_SUFFIX = "_grad.accumulation.out"
# top-5 accuracy is reported for 5..TOP5_MAX_CLASSES classes: TopK over a GPT-2 vocabulary (50257) made the
# eval step of a 2-layer d=128 model 1.9x slower (363 -> 695 ms at 8x128 tokens, 1 thread), top-1 (ArgMax) 1.1x
TOP5_MAX_CLASSES = 4096
FORMAT_VERSION = 1
# what trainrun's graph surgery produces from the same config; graphs prepared by an older version
# (a manifest with a lower or no ``graph_version``) are prepared again. 2: the cross-entropy split into
# LogSoftmax + NegativeLogLikelihoodLoss, tied embedding gradients added by ScatterElements; 3: weight
# gradients by MatMul over an explicitly transposed input (no Gemm transA); 4: the cross-entropy's gradient
# from Exp(log_prob) (_cross_entropy_grad_by_exp); 5: a tied head's gradient scattered into before its
# Transpose
GRAPH_VERSION = 5


@dataclass
class Forward:
    """A forward graph and its parameters, before any training surgery."""
    model: onnx.ModelProto          # parameters still as initializers
    params: list[str]               # trainable initializers, flat-buffer order
    inputs: list[str]               # data inputs
    logits: str | None
    labels: str | None
    loss: str | None = None         # an output of the graph that already is the scalar loss
    loss_type: str = "cross_entropy"   # or mse, l1 (logits: the predictions; labels: float targets)
    class_axis: int = -1            # cross_entropy: -1 classes last (flattened to [N, C]); 1 ONNX's [N, C, d...]
    class_weights: list | None = None
    states: dict | None = None      # BatchNormalization running stats: {initializer: output with its update}


# --------------------------------------------------------------------------- forward graphs

def forward_from_config(cfg: Config) -> Forward:
    m = cfg.model
    if m.builtin == "gpt2":
        weights = _pretrained(gpt2.init_weights(m.gpt2, cfg.run.seed), m)
        model = gpt2.build_gpt2(m.gpt2, weights)
        inputs = ["input_ids"]
        return Forward(model=model, params=_trainable(list(weights), m.frozen, "gpt2"), inputs=inputs,
                       logits="logits", labels=m.loss.labels)
    if m.builtin == "bert":
        weights = _pretrained(bert.init_weights(m.bert, cfg.run.seed), m)
        return Forward(model=bert.build_bert(m.bert, weights), params=_trainable(list(weights), m.frozen, "bert"),
                       inputs=list(bert.INPUTS), logits=bert.LOGITS, labels=None, loss=bert.LOSS)
    else:
        model = _load_user_onnx(m.onnx)
        inputs = list(m.inputs)
    return _check_forward(model, inputs, m.loss, m.frozen, source=m.onnx or "gpt2")


def _load_user_onnx(path: str) -> onnx.ModelProto:
    """model.onnx with its external data, each file of which must lie in the model's folder: onnx refuses
    a location with ``..`` but follows a link out of the folder (another file's bytes became a weight)."""
    from onnx import external_data_helper as X
    folder = os.path.dirname(os.path.abspath(path))
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad user file
        raise UsageError(f"model.onnx: cannot load {path}: {exc}") from None
    for tensor in X._get_all_tensors(model):      # initializers and attribute tensors, subgraphs too
        if not X.uses_external_data(tensor):
            continue
        location = X.ExternalDataInfo(tensor).location
        real = outside(folder, location)
        if real is not None:
            raise UsageError(f"model.onnx: {path}: tensor '{tensor.name}' has its external data in '{location}', "
                             f"which is {real}, outside the model's folder {folder}")
    try:
        X.load_external_data_for_model(model, folder)
    except Exception as exc:  # noqa: BLE001 - a missing or short data file is a bad user file
        raise UsageError(f"model.onnx: cannot load {path}: {exc}") from None
    return model


def _pretrained(weights: dict, m) -> dict:
    """``weights`` replaced by model.init_from's, when given."""
    if not m.init_from:
        return weights
    return load_into(weights, m.init_from, m.builtin)


def _check_forward(model, inputs, loss, frozen, source) -> Forward:
    """The user's forward graph checked against ``model.inputs`` and ``model.loss`` (a LossConfig);
    ``inputs`` empty: every graph input that is not an initializer."""
    inits = {t.name: t for t in model.graph.initializer}
    graph_inputs = [i.name for i in model.graph.input if i.name not in inits]
    inputs = list(inputs) or graph_inputs
    problems = []
    for name in inputs:
        if name not in graph_inputs:
            problems.append(f"model.inputs: '{name}' is not an input of {source} "
                            f"(its inputs: {', '.join(graph_inputs) or 'none'})")
    for name in graph_inputs:
        if name not in inputs:
            problems.append(f"model.inputs: {source} has input '{name}' that the config does not feed; "
                            f"add it to model.inputs")
    outputs = {o.name: o for o in model.graph.output}
    logits, labels = loss.logits, loss.labels
    if loss.output is not None:
        logits = labels = None
        if loss.output not in outputs:
            problems.append(f"model.loss.output: '{loss.output}' is not an output of {source} "
                            f"(its outputs: {', '.join(outputs)})")
        else:
            dims = _value_dims(model, loss.output)
            if dims is None or len(dims) != 0:
                problems.append(f"model.loss.output: '{loss.output}' of {source} must be a scalar (rank 0), "
                                f"its shape is {dims if dims is not None else 'unknown'}")
    else:
        if logits not in outputs:
            problems.append(f"model.loss.logits: '{logits}' is not an output of {source} "
                            f"(its outputs: {', '.join(outputs)})")
        if labels in graph_inputs or labels in inits:
            problems.append(f"model.loss.labels: '{labels}' is already a tensor of {source}; "
                            f"choose a new name for the labels input")
    if problems:
        raise UsageError(f"{source}: the forward graph does not match the config", problems)
    model, states = _batchnorm_states(model)
    floats = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) > 0
              and t.name not in states]
    fwd = Forward(model=model, params=_trainable(floats, frozen, source), inputs=list(inputs), logits=logits,
                  labels=labels, loss=loss.output, loss_type=loss.type, class_axis=loss.class_axis,
                  class_weights=list(loss.weights) or None, states=states or None)
    if fwd.loss is None and fwd.loss_type == "cross_entropy":
        classes = _num_classes(fwd)
        if loss.weights and classes is not None and len(loss.weights) != classes:
            raise UsageError(f"model.loss.weights: {len(loss.weights)} weights, but '{logits}' of {source} "
                             f"has {classes} classes (axis {loss.class_axis})")
    return fwd


def _value_dims(model, name):
    """Dims (ints, or symbols/None) of tensor ``name`` as declared or inferred by onnx; None if unknown."""
    for vi in list(model.graph.output) + list(model.graph.value_info):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in vi.type.tensor_type.shape.dim]
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - an uninferable graph: the shape stays unknown
        return None
    for vi in list(inferred.graph.output) + list(inferred.graph.value_info):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in vi.type.tensor_type.shape.dim]
    return None


def _num_classes(fwd: Forward) -> int | None:
    """C of cross_entropy: the logits' dim at the class axis, when static."""
    dims = _value_dims(fwd.model, fwd.logits)
    if not dims:
        return None
    c = dims[fwd.class_axis] if len(dims) > 1 else None
    return c if isinstance(c, int) and c > 0 else None


def _batchnorm_states(model):
    """BatchNormalization nodes in training mode (``training_mode=1``) update their running mean and
    variance: those initializers are the model's state (not parameters). Returns the model with each such
    node's running-stat outputs present and ``{state initializer: output holding its update}``."""
    inits = {t.name for t in model.graph.initializer}
    states, model = {}, copy.deepcopy(model)
    for n in model.graph.node:
        if n.op_type != "BatchNormalization":
            continue
        training = next((a.i for a in n.attribute if a.name == "training_mode"), 0)
        if not training:
            continue
        while len(n.output) < 3:
            n.output.append("")
        for k, state in ((1, n.input[3]), (2, n.input[4])):
            if state not in inits:
                raise UsageError(f"BatchNormalization node '{n.name or n.output[0]}': its running "
                                 f"{'mean' if k == 1 else 'var'} '{state}' is not an initializer")
            if not n.output[k]:
                n.output[k] = f"{state}/updated"
            states[state] = n.output[k]
    return model, states


def _drop_outputs(model: onnx.ModelProto, names: set) -> None:
    kept = [o for o in model.graph.output if o.name not in names]
    del model.graph.output[:]
    model.graph.output.extend(kept)


def batchnorm_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every BatchNormalization in inference mode (normalised by its running mean/var inputs), in place."""
    for n in model.graph.node:
        if n.op_type == "BatchNormalization":
            for a in n.attribute:
                if a.name == "training_mode":
                    a.i = 0
            del n.output[1:]
    return model


def _trainable(names: list[str], frozen: list[str], source: str) -> list[str]:
    """``names`` that no ``model.frozen`` pattern matches; a UsageError when none is left."""
    params = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in frozen)]
    if not params:
        raise UsageError(f"model.frozen: {frozen} freezes every parameter of {source}; nothing would train")
    return params


# --------------------------------------------------------------------------- surgery

def _fresh(model: onnx.ModelProto, nodes, inputs, outputs, initializers, value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, model.graph.name or "graph", inputs, outputs, initializers,
                              value_info=list(value_info))
    out = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="trainrun")
    out.ir_version = IR_VERSION
    return out


def _params_to_inputs(model: onnx.ModelProto, params: list[str]) -> onnx.ModelProto:
    """Move the parameter initializers to graph inputs (in ``params`` order)."""
    inits = {t.name: t for t in model.graph.initializer}
    keep = [t for t in model.graph.initializer if t.name not in set(params)]
    data_inputs = [i for i in model.graph.input if i.name not in inits]
    param_inputs = [helper.make_tensor_value_info(p, inits[p].data_type, list(inits[p].dims)) for p in params]
    return _fresh(model, list(model.graph.node), data_inputs + param_inputs, list(model.graph.output), keep)


def metric_outputs(model: onnx.ModelProto) -> list[str]:
    """The eval-metric outputs (``metric/<name>/sum|count``) of ``model``, in graph order."""
    return [o.name for o in model.graph.output if o.name.startswith(METRIC_PREFIX)]


def metric_names(outputs: list[str]) -> list[str]:
    """``<name>`` of every complete ``metric/<name>/sum`` + ``metric/<name>/count`` pair."""
    names = [o[len(METRIC_PREFIX):-len("/sum")] for o in outputs if o.endswith("/sum")]
    return [n for n in names if f"{METRIC_PREFIX}{n}/count" in outputs]


def eval_results(loss: float, sums: dict[str, float]) -> dict[str, float]:
    """``loss``, ``perplexity`` and ``<name>`` = sum / count of every metric, from the mean eval loss and
    the ``metric/<name>/sum|count`` outputs summed over batches and ranks (NaN for a count of 0)."""
    result = {"loss": loss, "perplexity": math.exp(min(loss, 80.0))}
    for name in metric_names(list(sums)):
        c = sums[f"{METRIC_PREFIX}{name}/count"]
        result[name] = sums[f"{METRIC_PREFIX}{name}/sum"] / c if c else float("nan")
    return result


def with_loss(fwd: Forward, ignore_index: int, keep_logits: bool, metrics: bool = False) -> onnx.ModelProto:
    """Forward graph + scalar ``loss``: the graph's own loss output (``fwd.loss``), cross-entropy
    (SoftmaxCrossEntropyLoss over the class axis), mse or l1. ``metrics``: keep the graph's eval-metric
    outputs and add the loss type's (accuracy and top-5 accuracy; mse and mae)."""
    model = copy.deepcopy(fwd.model)
    inputs = list(model.graph.input)
    outputs = [helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, [])]
    if fwd.loss:
        nodes = list(model.graph.node) + [helper.make_node("Identity", [fwd.loss], [LOSS], name="loss_output")]
    else:
        dims = _value_dims(model, fwd.logits)
        if fwd.loss_type == "cross_entropy":
            loss_nodes, metric_nodes = _cross_entropy(model, fwd, ignore_index, _num_classes(fwd))
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
    return _fresh(model, nodes, inputs, outputs, list(model.graph.initializer))


def _const(name, value, dtype=np.int64):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype)),
                            name=name + "_c")


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)


def _cross_entropy(model, fwd: Forward, ignore_index: int, classes: int | None) -> tuple[list, list]:
    """(loss nodes, metric nodes). Loss: SoftmaxCrossEntropyLoss (mean, ``ignore_index``, class weights)
    -> ``loss``; classes last: logits reshaped [N, C], labels [N] first. Metrics over the labels that are
    not ``ignore_index``: top-1 accuracy (ArgMax) and, when 5 <= C <= TOP5_MAX_CLASSES, top-5 (TopK)."""
    nodes = []
    if fwd.class_axis == -1:
        nodes += [
            _const("loss_labels_shape", [-1]),
            # Reshape [.., C] -> [N, C] needs C from the logits themselves: take the last dim.
            # Shape + Slice rather than Shape(start=-1): works from opset 12 (SoftmaxCrossEntropyLoss's own)
            helper.make_node("Shape", [fwd.logits], ["loss_logits_shape"], name="loss_shape"),
            _const("loss_minus1", [-1]),
            _const("loss_big", [2**62]),
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
        nodes.append(_const("loss_class_weights", fwd.class_weights, np.float32))
        sce_in.append("loss_class_weights")
    # over [N, C, d...] onnxruntime's gradient of SoftmaxCrossEntropyLoss needs its optional log_prob output
    sce_out = [LOSS] if fwd.class_axis == -1 else [LOSS, "loss_log_prob"]
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", sce_in, sce_out, reduction="mean",
                                  ignore_index=ignore_index, name="loss_sce"))
    # metrics: correct predictions and counted labels (float32 sums)
    m = [_const("acc_ignore", ignore_index),
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
            if _opset(model) >= 13 else \
            [helper.make_node("Unsqueeze", ["top5_labels"], ["top5_labels_k"], axes=[1], name="top5_unsq")]
        m += [_const("top5_k", [5]), _const("top5_axis", [1]), _const("top5_none", -1),
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


# prepare splits the cross-entropy of a user model from this many classes on (a vocabulary): below it the
# SCE kernel costs little, and the graph stays as it was (a BatchNorm classifier's parity run drifts with
# the last ulp of the gradient)
SPLIT_MIN_CLASSES = 1024


def split_cross_entropy(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every SoftmaxCrossEntropyLoss of ``model`` (opset >= 13) as LogSoftmax over axis 1 +
    NegativeLogLikelihoodLoss (the same attributes and inputs): ONNX's own definition of the op, the same
    outputs (its ``log_prob`` output, which the gradient's SoftmaxCrossEntropyLossGrad reads, now comes
    from LogSoftmax). onnxruntime's CPU SoftmaxCrossEntropyLoss is a scalar one-thread loop: over GPT-2
    124M's 512 x 50257 logits 228 ms a step (1 thread), LogSoftmax (MLAS, vectorised) + the NLL pick
    7 ms. Applied after the gradient builder, which differentiates SoftmaxCrossEntropyLoss in one cheap
    kernel (the gradient of LogSoftmax + NLL, LogSoftmaxGrad, is over 2x slower). Before opset 13
    LogSoftmax flattened its input from ``axis``: such graphs are left alone. In a train graph the
    gradient's SoftmaxCrossEntropyLossGrad is rewritten too (:func:`_cross_entropy_grad_by_exp`).
    Returns ``model``, changed in place."""
    if _opset(model) < 13:
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
    over the logits, where onnxruntime's CPU kernel is a scalar exp loop (58 ms over GPT-2 124M's
    512 x 50257 log-probabilities, 1 thread). Class axis 1 at any rank, as the op. Returns ``model``,
    changed in place."""
    if _opset(model) < 16:
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
            nodes += [_const(b + "/ignore", a["ignore_index"]),
                      helper.make_node("CastLike", [b + "/ignore", label], [b + "/ignore_t"], name=b + "/ignore_t"),
                      helper.make_node("Equal", [label, b + "/ignore_t"], [b + "/ignored"], name=b + "/ignored"),
                      helper.make_node("Not", [b + "/ignored"], [b + "/valid"], name=b + "/valid"),
                      _const(b + "/zero", 0),
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
        nodes += [_const(b + "/axis1", [1]),
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


def _dropouts(model: onnx.ModelProto, source: str) -> list[tuple[int, onnx.NodeProto, float, bool]]:
    """(index, node, ratio, training_mode) of every Dropout; ratio and training_mode must be constants."""
    values = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            values[n.output[0]] = n.attribute[0].t
    found = []
    for index, n in enumerate(model.graph.node):
        if n.op_type != "Dropout":
            continue
        args = []
        for i, default in ((1, 0.5), (2, False)):    # ONNX's defaults: ratio 0.5, inference mode
            name = n.input[i] if len(n.input) > i else ""
            if name and name not in values:
                raise UsageError(f"{source}: Dropout node '{n.name or n.output[0]}': its "
                                 f"{('ratio', 'training_mode')[i - 1]} '{name}' is not a constant")
            args.append(numpy_helper.to_array(values[name]).item() if name else default)
        if len(n.output) > 1 and n.output[1] and any(n.output[1] in m.input for m in model.graph.node):
            raise UsageError(f"{source}: Dropout node '{n.name or n.output[0]}': its mask output is used; "
                             f"trainrun feeds dropout masks as inputs and cannot produce it")
        found.append((index, n, float(str(np.float32(args[0]))), bool(args[1])))   # 0.1, not 0.100000001
    return found


def _replace_nodes(model: onnx.ModelProto, replace: dict) -> onnx.ModelProto:
    """A copy of ``model`` with the nodes ``replace[i]`` in place of its node i."""
    nodes = []
    for i, n in enumerate(model.graph.node):
        nodes.extend(replace.get(i, [n]))
    out = copy.deepcopy(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = {i for n in nodes for i in n.input} | {o.name for o in out.graph.output}
    kept = [t for t in out.graph.initializer if t.name in used]     # e.g. the Dropouts' ratio constants
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def dropout_off(model: onnx.ModelProto, source: str = "model") -> onnx.ModelProto:
    """Inference: every Dropout becomes an Identity (no Dropout node is left)."""
    return _replace_nodes(model, {i: [_identity(n)] for i, n, _, _ in _dropouts(model, source)})


def _identity(node: onnx.NodeProto) -> onnx.NodeProto:
    return helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)


MASK_PREFIX = "dropout_mask/"


def dropout_masks(model: onnx.ModelProto, inputs: list[str], source: str) -> tuple[onnx.ModelProto, dict | None]:
    """The train graph's dropout: every Dropout in training mode with ratio p > 0 becomes
    ``y = x * mask`` where ``mask`` is a new graph input of x's shape and type holding 0 or 1/(1-p),
    filled by trainrun's own random stream (:mod:`trainrun.dropout`); every other Dropout becomes an
    Identity. One Mul forward and one backward: measured on gpt2-tiny (1 thread, fwd+bwd 31.4 ms
    without dropout) +2.2 ms with the mask fill, against +24 ms for Where(bool mask, x, 0) * scale
    and +17 ms for x * Cast(bool mask) * scale (a float mask takes 4 bytes an element, a bool one 1).

    Returns the new model and the manifest's ``dropout`` entry (None when no mask is needed):
    ``{"dims": {symbol: [input, axis]}, "masks": [{"name", "node", "shape", "ratio", "dtype"}]}``, each shape
    x's, its dims ints or symbols of the data inputs' dims (the first is the batch)."""
    drops = _dropouts(model, source)
    active = [(i, n, p) for i, n, p, training in drops if training and p > 0]
    replace = {i: [_identity(n)] for i, n, p, training in drops if not (training and p > 0)}
    if not active:
        return _replace_nodes(model, replace), None
    dims, batch, shapes = _probe_shapes(model, inputs, [(n.name or n.output[0], n.input[0]) for _, n, _ in active],
                                        source)
    masks, new_inputs = [], []
    for i, n, p in active:
        node = n.name or n.output[0]
        shape, elem = shapes[n.input[0]]
        if not shape or shape[0] != batch:
            raise UsageError(f"{source}: Dropout node '{node}': its input's first dim ({shape[:1]}) is not the "
                             f"batch dim ('{batch}') of the data inputs; trainrun draws dropout masks per sample")
        name = MASK_PREFIX + node
        new_inputs.append(helper.make_tensor_value_info(name, elem, shape))
        replace[i] = [helper.make_node("Mul", [n.input[0], name], [n.output[0]], name=node)]
        dtype = helper.tensor_dtype_to_np_dtype(elem).name
        masks.append({"name": name, "node": node, "shape": shape, "ratio": p, "dtype": dtype})
    out = _replace_nodes(model, replace)
    out.graph.input.extend(new_inputs)
    return out, {"dims": dims, "masks": masks}


def _probe_shapes(model, inputs, tensors, source):
    """Shapes (dims as ints or data-input symbols) and element types of ``tensors`` [(node, tensor)],
    by onnx shape inference at two sets of values of the data inputs' symbolic dims: a dim that
    follows symbol k's values is that symbol, one that stays put is a constant.
    Returns ({symbol: [input, axis]}, the batch dim (symbol or int), {tensor: (dims, elem_type)})."""
    symbols: dict[str, list] = {}
    batch = None
    for vi in model.graph.input:
        if vi.name in inputs:
            for axis, d in enumerate(vi.type.tensor_type.shape.dim):
                if d.dim_param:
                    symbols.setdefault(d.dim_param, [vi.name, axis])
                if axis == 0 and batch is None:
                    batch = d.dim_param or d.dim_value
    named = list(symbols)
    probes = [{s: 2 + k for k, s in enumerate(named)}, {s: 3 + 2 * k for k, s in enumerate(named)}]
    # without the big initializers (shape inference needs their types, not their values)
    light = copy.deepcopy(helper.make_model(helper.make_graph(
        list(model.graph.node), "probe", list(model.graph.input), list(model.graph.output),
        [t for t in model.graph.initializer if np.prod(t.dims) <= 1024]), opset_imports=list(model.opset_import)))
    light.ir_version = model.ir_version
    light.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in model.graph.initializer if np.prod(t.dims) > 1024)
    seen = []
    for probe in probes:
        m = copy.deepcopy(light)
        for vi in m.graph.input:
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param in probe:
                    d.dim_value = probe[d.dim_param]
        try:
            m = shape_inference.infer_shapes(m, data_prop=True)
        except Exception as exc:  # noqa: BLE001 - onnx raises assorted errors on a malformed graph
            raise UsageError(f"{source}: shape inference failed: {exc}") from None
        info = {v.name: v.type.tensor_type for v in m.graph.value_info}
        seen.append(info)
    out = {}
    for node, t in tensors:
        a, b = (info.get(t) for info in seen)
        dims = None
        if a is not None and a.HasField("shape") and all(d.HasField("dim_value") for d in a.shape.dim) \
                and all(d.HasField("dim_value") for d in b.shape.dim) and len(a.shape.dim) == len(b.shape.dim):
            dims = []
            for x, y in zip((d.dim_value for d in a.shape.dim), (d.dim_value for d in b.shape.dim)):
                sym = [s for s in named if (probes[0][s], probes[1][s]) == (x, y)]
                dims.append(x if x == y else sym[0] if sym else None)
        if dims is None or None in dims:
            raise UsageError(f"{source}: Dropout node '{node}': the shape of its input '{t}' cannot be "
                             f"determined from the data inputs' dims (shape inference gives "
                             f"{[list(_dims(i.get(t))) for i in seen]}); trainrun needs it for the dropout mask")
        out[t] = (dims, a.elem_type)
    return symbols, batch, out


def _dims(tt):
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] \
        if tt is not None and tt.HasField("shape") else "unknown"


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
    low-precision op reads them. A Cast to float32 in the graph casts to the compute type instead.
    Float32 initializers get a Cast too (onnxruntime folds it). Graph outputs keep their types."""
    low = PRECISIONS[precision]
    if low is None:
        return model
    suffix = {TensorProto.FLOAT16: "/fp16", TensorProto.BFLOAT16: "/bf16"}[low]
    inferred = shape_inference.infer_shapes(model)
    floats = {v.name for v in list(inferred.graph.value_info) + list(inferred.graph.input)
              + list(inferred.graph.output) if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    floats |= {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}

    def keeps_fp32(n) -> bool:     # and the ops that, or whose gradient, lack a kernel in the compute type
        return n.op_type in FP32_OPS or not cuda_kernels.computes_in(n.op_type, cuda_kernels.FLOATS[low])
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
        if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT:
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
    return _fresh(model, ordered, list(model.graph.input), list(model.graph.output),
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
    return _fresh(train, nodes, list(train.graph.input), list(train.graph.output), list(train.graph.initializer),
                  train.graph.value_info)


LOSS_SCALE = "loss_scale"


def scale_loss(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """fp16: the loss output multiplied by a float32 scalar input ``loss_scale`` (dynamic loss scaling,
    :mod:`trainrun.precision`), so the gradients are scaled too; other precisions: ``model``."""
    if precision != "fp16":
        return model
    nodes = list(model.graph.node)
    for n in nodes:
        n.output[:] = [LOSS + "/unscaled" if o == LOSS else o for o in n.output]
    nodes.append(helper.make_node("Mul", [LOSS + "/unscaled", LOSS_SCALE], [LOSS], name="loss_scaled"))
    inputs = list(model.graph.input) + [helper.make_tensor_value_info(LOSS_SCALE, TensorProto.FLOAT, [])]
    return _fresh(model, nodes, inputs, list(model.graph.output), list(model.graph.initializer))


def build_options(cfg: Config) -> dict:
    """What besides the model and optimizer shapes the graphs: recorded in the manifest."""
    stats = list(cfg.debug.tensors) if cfg.debug.stats_every > 0 else []
    return {"deterministic": cfg.run.deterministic, "stats_tensors": stats, "precision": cfg.train.precision,
            "static_shape": [cfg.train.micro_batch_size, cfg.data.seq_len] if cfg.engine.static_shapes else None,
            "recompute": cfg.train.recompute}


# manifests written before a build option existed
DEFAULT_BUILD = {"deterministic": False, "stats_tensors": [], "static_shape": None, "precision": "fp32",
                 "recompute": "none"}


def fix_dims(model: onnx.ModelProto, inputs: list[str], micro_batch: int, seq_len: int | None) -> onnx.ModelProto:
    """Fix, in place, the symbolic dims of ``model``'s data ``inputs``: dim 0 (the batch) to
    ``micro_batch``, dim 1 to ``seq_len`` when given; dims of the same names elsewhere (labels,
    outputs) too. Returns ``model``."""
    sizes: dict[str, int] = {}
    for vi in model.graph.input:
        if vi.name in inputs:
            dims = vi.type.tensor_type.shape.dim
            for i, size in ((0, micro_batch), (1, seq_len)):
                if size is not None and len(dims) > i and dims[i].dim_param:
                    sizes.setdefault(dims[i].dim_param, size)
    for vi in list(model.graph.input) + list(model.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in sizes:
                d.dim_value = sizes[d.dim_param]     # (clears dim_param: a oneof)
    return model


def build_train_graph(loss_model: onnx.ModelProto, params: list[str], source: str, keep=()) -> onnx.ModelProto:
    """Gradients of ``loss`` w.r.t. ``params`` (already graph inputs), accumulated in place; the outputs
    ``keep`` (e.g. BatchNormalization's updated running stats) stay outputs."""
    import onnxruntime as ort
    from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

    ort.set_default_logger_severity(3)    # errors only: the builder's warnings are not the user's
    options = ort.SessionOptions()
    options.log_severity_level = 3
    wanted = set(params)
    try:
        optimized = get_optimized_model(loss_model.SerializeToString(), wanted, options)
        builder = GradientGraphBuilder(optimized, {LOSS}, wanted, LOSS, options)
        builder.build()
        grad_model = onnx.load_from_string(builder.get_model())
    except Exception as exc:  # noqa: BLE001 - the builder raises RuntimeError/Fail with the op at fault
        raise UsageError(f"{source}: onnxruntime's gradient builder cannot differentiate this graph: "
                         f"{_builder_reason(str(exc))}") from None

    outputs = {o.name: o for o in grad_model.graph.output}
    missing = [p for p in params if p + GRAD_SUFFIX not in outputs]
    if missing:
        raise UsageError(f"{source}: the loss does not depend on these parameters (freeze them with "
                         f"model.frozen): {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")

    nodes = list(_untransposed_weight_gradients(_scatter_tied_gradients(grad_model)).graph.node)
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
    model = _fresh(grad_model, nodes, new_inputs, new_outputs, list(grad_model.graph.initializer),
                   grad_model.graph.value_info)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def direct_gradients(train: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``train`` (a :func:`build_train_graph` graph) without its accumulators, for runs that never
    accumulate (``train.gradient_accumulation_steps`` 1): each parameter's gradient becomes a graph
    output, which the engine binds to the parameter's view of the flat gradient buffer, so the kernel
    that computes it writes it there. With InPlaceAccumulatorV2 every gradient is first written into
    onnxruntime's arena and then copied into the buffer (~2.5% of a GPT-2 124M forward/backward).
    Returns (the graph, parameter -> its gradient output). The bits are the same: a reset accumulator
    copies its value."""
    model = onnx.ModelProto()
    model.CopyFrom(train)
    g = model.graph
    acc = [n for n in g.node if n.op_type == "InPlaceAccumulatorV2" and n.input[0].endswith(BUFFER_SUFFIX)]
    if not acc:
        raise TrainrunError("the train graph has no gradient accumulators (not built by trainrun prepare?)")
    buffers = {i.name: i for i in g.input if i.name.endswith(BUFFER_SUFFIX)}
    outputs, dropped = {}, {n.output[0] for n in acc}
    for n in acc:
        g.node.remove(n)
        param = n.input[0][:-len(BUFFER_SUFFIX)]
        out = copy.deepcopy(buffers[n.input[0]])     # the buffer's type and shape = the gradient's
        out.name = outputs[param] = n.input[1]
        g.output.append(out)
    kept = [i for i in g.input if i.name not in buffers and i.name != RESET]
    del g.input[:]
    g.input.extend(kept)
    kept = [o for o in g.output if o.name not in dropped]
    del g.output[:]
    g.output.extend(kept)
    return model, outputs


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
    direct gradients (:func:`direct_gradients`) straight into the flat buffer, where a scatter into a
    bound output first copies its input there (65 ms a step at GPT-2 124M); the same adds in the same
    order per element. Only float32 2-D parameters (graph inputs), from opset 16 (ScatterElements'
    reduction); returns ``model``, changed in place."""
    if _opset(model) < 16:
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
            rows = [_const(b + "/all", [-1]), _const(b + "/start", [1]), _const(b + "/big", [2**62]),
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
                _const(b + "/ids_shape", [1, -1] if transposed else [-1, 1]),
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
    by panel, for every block of output columns: at GPT-2 124M the head's [50257, 768] gradient took
    1.45x the forward's multiply of the same size (332 vs 231 ms), the layers' weight gradients
    1.2x theirs. Here X is transposed once (Reshape [K, 1, M], Transpose [M, K, 1], Reshape [M, K]:
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
        out += [_const(b + "/k1m", [0, 1, -1]), _const(b + "/mk", [0, -1]),
                helper.make_node("Reshape", [x, b + "/k1m"], [b + "/x3"], name=b + "/x3"),
                helper.make_node("Transpose", [b + "/x3"], [b + "/xt3"], perm=[2, 0, 1], name=b + "/xt3"),
                helper.make_node("Reshape", [b + "/xt3", b + "/mk"], [b + "/xt"], name=b + "/xt"),
                helper.make_node("MatMul", [b + "/xt", y], list(n.output), name=b)]
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(out)
    return model


def _builder_reason(text: str) -> str:
    """The useful part of a gradient-builder exception (drop the C++ location and signature)."""
    m = re.search(r"has not been registered: (\S+) for node\s*(\S*)", text)
    if m:
        node = f" (node '{m.group(2)}')" if m.group(2) else ""
        return (f"operator {m.group(1)}{node} has no gradient; freeze the parameters that feed it "
                f"(model.frozen) or express it with differentiable operators")
    text = text.strip().splitlines()[-1]
    return text.split(" was false. ")[-1].split("] ")[-1]


def select_outputs(model: onnx.ModelProto, patterns: list[str], protected=()) -> list[str]:
    """Names of node outputs of ``model`` matching any fnmatch pattern, in graph order.

    Raises a UsageError naming ``debug.tensors`` for a pattern that matches nothing."""
    existing = {o.name for o in model.graph.output} | set(protected)
    candidates = [o for n in model.graph.node for o in n.output if o and o not in existing]
    chosen, unmatched = [], []
    for pat in patterns:
        hits = [c for c in candidates if fnmatch.fnmatchcase(c, pat)]
        if not hits:
            unmatched.append(pat)
        chosen += [h for h in hits if h not in chosen]
    if unmatched:
        some = ", ".join(c for c in candidates[:40] if "/" not in c)
        raise UsageError("debug.tensors: no tensor of the train graph matches "
                         + ", ".join(repr(p) for p in unmatched),
                         [f"tensor names of the train graph include: {some} ...",
                          "list them all: python -c \"import onnx,sys; print(*[o for n in onnx.load(sys.argv[1])"
                          ".graph.node for o in n.output])\" RUN/graphs/train.onnx"])
    order = {c: i for i, c in enumerate(candidates)}
    return sorted(chosen, key=order.__getitem__)


def reads(nodes) -> set[str]:
    """The tensor names ``nodes`` read, those of their subgraphs (If, Loop, Scan bodies) included."""
    names = set()
    for n in nodes:
        names.update(n.input)
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names |= reads(g.node)
    return names


def keep_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``model`` (in place) with the outputs ``names`` only, the nodes they need and the graph inputs and
    initializers those nodes read: e.g. without a loss, its metrics and the labels input only they read."""
    needed, nodes = set(names), []
    for n in reversed(model.graph.node):
        if needed.intersection(n.output):
            nodes.append(n)
            needed |= reads([n])
    graph = model.graph
    parts = {"node": nodes[::-1], "output": [o for o in graph.output if o.name in names],
             "input": [i for i in graph.input if i.name in needed],
             "initializer": [t for t in graph.initializer if t.name in needed],
             "value_info": [v for v in graph.value_info if v.name in {o for n in nodes for o in n.output}]}
    for field, kept in parts.items():
        kept = [copy.deepcopy(k) for k in kept]
        graph.ClearField(field)
        getattr(graph, field).extend(kept)
    return model


def add_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Make the intermediate tensors ``names`` graph outputs too (type left to onnxruntime)."""
    for name in names:
        model.graph.output.append(helper.make_empty_tensor_value_info(name))
    return model


# --------------------------------------------------------------------------- prepare

def _save(model: onnx.ModelProto, path: str) -> None:
    tmp = path + ".tmp"
    onnx.save(model, tmp)
    os.replace(tmp, path)


def prepare(cfg: Config, out_dir: str | None = None) -> str:
    """Write the three graphs, the forward graph, the initial weights and the manifest."""
    out_dir = out_dir or os.path.join(cfg.run.output_dir, "graphs")
    os.makedirs(out_dir, exist_ok=True)
    fwd = forward_from_config(cfg)
    source = cfg.model.onnx or cfg.model.builtin
    inits = {t.name: t for t in fwd.model.graph.initializer}
    states = dict(fwd.states or {})
    weights = {p: numpy_helper.to_array(inits[p]) for p in fwd.params + list(states)}
    shapes = [(p, tuple(int(d) for d in inits[p].dims)) for p in fwd.params]
    graph_inputs = fwd.params + list(states)       # parameters, then state: inputs of every graph

    build = build_options(cfg)
    static = build["static_shape"]

    loss_model = _params_to_inputs(with_loss(fwd, cfg.model.loss.ignore_index, keep_logits=False), graph_inputs)
    loss_model.graph.output.extend(helper.make_tensor_value_info(out, inits[st].data_type, list(inits[st].dims))
                                   for st, out in states.items())     # the state's updates
    loss_model, dropout = dropout_masks(loss_model, fwd.inputs, source)
    loss_model = scale_loss(cast_pass(loss_model, build["precision"]), build["precision"])
    if static:   # the train graph for the micro-batch's shape; eval and forward (export) stay symbolic
        fix_dims(loss_model, fwd.inputs, static[0], static[1] if cfg.model.builtin == "gpt2" else None)
    classes = _num_classes(fwd) if fwd.loss is None and fwd.loss_type == "cross_entropy" else None
    # the built-in models' losses are over vocabularies; a user model's when its classes are that many
    split = split_cross_entropy if cfg.model.builtin or (classes or 0) >= SPLIT_MIN_CLASSES else (lambda m: m)
    train = split(restore_fp32(build_train_graph(loss_model, fwd.params, source, keep=list(states.values())),
                               build["precision"]))
    if build["recompute"] == "blocks":
        train = recompute_blocks(train, fwd.params, LOSS, source, outputs_kept=list(states.values()))
    stats_outputs = []
    if build["stats_tensors"]:      # debug.stats_every > 0: chosen tensors become outputs
        stats_outputs = select_outputs(train, cfg.debug.tensors)
        add_outputs(train, stats_outputs)
    evalg = split(batchnorm_inference(dropout_off(_params_to_inputs(
        with_loss(fwd, cfg.model.loss.ignore_index, keep_logits=True, metrics=True), graph_inputs), source)))
    forward = batchnorm_inference(dropout_off(_params_to_inputs(fwd.model, graph_inputs), source))
    _drop_outputs(forward, set(states.values()))
    optimizer = build_optimizer_graph(cfg.optimizer, shapes)
    if cfg.device == "cuda":
        cuda_kernels.check({"train": train, "eval": evalg}, source)

    files = {"train": train, "eval": evalg, "forward": forward, "optimizer": optimizer}
    for name, model in files.items():
        _save(model, os.path.join(out_dir, f"{name}.onnx"))
    tmp = os.path.join(out_dir, "weights.safetensors.tmp")
    save_file(weights, tmp)
    os.replace(tmp, os.path.join(out_dir, "weights.safetensors"))

    import onnxruntime
    manifest = {
        "format_version": FORMAT_VERSION,
        "graph_version": GRAPH_VERSION,
        "params": [{"name": n, "shape": list(s)} for n, s in shapes],
        "num_params": int(sum(int(np.prod(s)) for _, s in shapes)),
        "inputs": fwd.inputs,
        "labels": fwd.labels,
        "logits": fwd.logits,
        "loss": LOSS,
        "loss_output": fwd.loss,
        # cross_entropy: labels must be below C (or ignore_index), checked per batch by the engine
        "classes": classes,
        "ignore_index": cfg.model.loss.ignore_index,
        "states": [{"name": n, "shape": [int(d) for d in inits[n].dims], "output": o} for n, o in states.items()],
        "metrics": metric_names(metric_outputs(evalg)),
        "model": to_dict(cfg.model),
        "optimizer": to_dict(cfg.optimizer),
        "build": build,
        "stats_outputs": stats_outputs,
        "dropout": dropout,
        "loss_scale": LOSS_SCALE if build["precision"] == "fp16" else None,
        "files": {f"{n}.onnx": sha256_file(os.path.join(out_dir, f"{n}.onnx")) for n in files}
                 | {"weights.safetensors": sha256_file(os.path.join(out_dir, "weights.safetensors"))},
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
    }
    tmp = os.path.join(out_dir, "manifest.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(tmp, os.path.join(out_dir, "manifest.json"))
    return out_dir


def feeds(manifest: dict, data_inputs: dict, features=None) -> dict:
    """{graph input: dataset feature}: ``data_inputs`` (the config's data.inputs) where it names the
    input, else the feature of the input's own name; the loss's labels input falls back to the feature
    ``labels`` when ``features`` (the dataset's, if known) has none of its name."""
    labels = manifest.get("labels")
    inputs = list(manifest["inputs"]) + ([labels] if labels else [])
    unknown = [k for k in data_inputs if k not in inputs]
    if unknown:
        raise UsageError(f"data.inputs: {', '.join(repr(k) for k in unknown)} not a data input of the model "
                         f"(its data inputs: {', '.join(inputs)})")
    out = {i: data_inputs.get(i, i) for i in inputs}
    if labels and labels not in data_inputs and features is not None and labels not in features:
        out[labels] = "labels"
    return out


def load_manifest(graphs_dir: str) -> dict:
    path = os.path.join(graphs_dir, "manifest.json")
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise UsageError(f"{path}: not found (run `trainrun prepare` first)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path}: format_version {manifest.get('format_version')} "
                         f"(this trainrun reads {FORMAT_VERSION})")
    return manifest


# optimizer fields that are inputs of the optimizer graph (or the runner's), not baked into it
_NOT_BAKED = ("lr", "max_grad_norm")


def up_to_date(graphs_dir: str, cfg: Config) -> bool:
    """Whether ``graphs_dir`` holds the graphs ``cfg`` would prepare (same graph version and model, baked
    optimizer fields and build options, every file present)."""
    try:
        manifest = load_manifest(graphs_dir)
    except UsageError:
        return False

    def baked(d):
        return {k: v for k, v in d.items() if k not in _NOT_BAKED}
    # "dropout" (masks as inputs) is in every manifest since dropout became trainrun's own stream; graphs
    # from before it ran Dropout in onnxruntime (ratio 0 under run.deterministic): prepare them again
    return "dropout" in manifest and manifest.get("graph_version") == GRAPH_VERSION \
        and manifest["model"] == to_dict(cfg.model) \
        and baked(manifest["optimizer"]) == baked(to_dict(cfg.optimizer)) \
        and {**DEFAULT_BUILD, **manifest.get("build", {})} == build_options(cfg) \
        and all(os.path.exists(os.path.join(graphs_dir, f)) for f in manifest["files"])
