"""The forward graph, before any training surgery: a built-in model's or a user's ONNX (loaded with its
external data, checked against ``model.inputs`` / ``model.loss``, read as torch's exporter left it:
:mod:`.exporters`), its trainable parameters (``model.trainable``, ``model.frozen``) and BatchNormalization
running statistics."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import os
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from ..config import Config
from ..data import outside
from ..errors import UsageError
from ..models import registry
from ..hf.pretrained import load_into
from .exporters import from_torch
from .lora import add_adapters
from .onnx_edit import value_dims

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
    lora: dict | None = None        # model.lora: {"base": the frozen weights, "in_out": modules with W [in, out]}
    # the frozen weights (model.frozen's, model.trainable's others, model.lora's base): graph inputs bound to the
    # frozen flat buffer
    frozen: list[str] = dataclasses.field(default_factory=list)
    why: dict = dataclasses.field(default_factory=dict)    # {frozen weight: why it is frozen}


def forward_from_config(cfg: Config) -> Forward:
    m = cfg.model
    family = registry.of(m)
    if family is None:
        return _check_forward(_load_user_onnx(m.onnx), list(m.inputs), m.loss, m, source=m.onnx)
    section = family.shape(m)
    weights = _pretrained(family.init_weights(section, cfg.run.seed), m)
    model = family.build(section, weights)
    if m.lora is None:
        params, why = _trainable(list(weights), m, family.name)
    else:
        model, in_out, adapters = add_adapters(model, weights, m.lora, family, cfg.run.seed)
        params, why = _trainable(adapters, m, family.name, {n: "lora base" for n in weights if n not in adapters})
        lora = {"base": [n for n in weights if n not in params], "in_out": in_out}
    frozen = [n for n in weights if n not in params]
    return Forward(model=model, params=params, lora=lora if m.lora else None, frozen=frozen,
                   why={n: why.get(n, "lora base") for n in frozen},
                   inputs=list(family.inputs), logits=family.logits,
                   labels=None if family.loss else m.loss.labels, loss=family.loss,
                   loss_type=family.loss_type if family.loss is None else "cross_entropy")


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
    return load_into(weights, m.init_from, registry.of(m))


def _check_forward(model, inputs, loss, m, source) -> Forward:
    """The user's forward graph checked against ``model.inputs`` and ``model.loss`` (a LossConfig), what
    trains by ``m``'s (the ModelConfig's) trainable and frozen; ``inputs`` empty: every graph input that is not
    an initializer."""
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
            dims = value_dims(model, loss.output)
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
    model, not_params = from_torch(model, source)
    model, states = _batchnorm_states(model)
    floats = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) > 0
              and t.name not in states]
    params, why = _trainable([n for n in floats if n not in not_params], m, source,
                             {n: not_params[n] for n in floats if n in not_params})
    why = {n: why.get(n) or not_params[n] for n in floats if n not in params}
    fwd = Forward(model=model, params=params, frozen=list(why), why=why, inputs=list(inputs),
                  logits=logits,
                  labels=labels, loss=loss.output, loss_type=loss.type, class_axis=loss.class_axis,
                  class_weights=list(loss.weights) or None, states=states or None)
    if fwd.loss is None and fwd.loss_type == "cross_entropy":
        classes = num_classes(fwd)
        if loss.weights and classes is not None and len(loss.weights) != classes:
            raise UsageError(f"model.loss.weights: {len(loss.weights)} weights, but '{logits}' of {source} "
                             f"has {classes} classes (axis {loss.class_axis})")
    return fwd


def num_classes(fwd: Forward) -> int | None:
    """C of cross_entropy: the logits' dim at the class axis, when static."""
    dims = value_dims(fwd.model, fwd.logits)
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


def drop_outputs(model: onnx.ModelProto, names: set) -> None:
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


FROZEN_WHY, UNLISTED_WHY = "model.frozen", "not in model.trainable"


def _trainable(names: list[str], m, source: str, others: dict = ()) -> tuple[list[str], dict[str, str]]:
    """(the ``names`` that train, {each other one: why it is frozen}): those that a ``model.trainable`` pattern
    of ``m`` matches (every one where it lists none) and no ``model.frozen`` pattern does: frozen wins. A
    UsageError for a trainable pattern that matches none of ``names`` (``others``, {tensor: why} of tensors that
    are not parameters, say why where it matches one of them), for a frozen pattern that matches none of
    ``names`` or ``others``, and where nothing would train."""
    def matching(pattern, pool):
        return [n for n in pool if fnmatch.fnmatchcase(n, pattern)]
    others = dict(others)
    unmatched = [p for p in m.trainable if not matching(p, names)]
    if unmatched:
        held = [f"{n!r} is frozen: {others[n]}" for p in unmatched for n in matching(p, others)[:1]]
        raise UsageError(f"model.trainable: {', '.join(map(repr, unmatched))} "
                         f"match{'es' if len(unmatched) == 1 else ''} no parameter of {source} "
                         f"({'; '.join(held)}{'; ' if held else ''}its parameters: {', '.join(names[:12])}"
                         f"{' ...' if len(names) > 12 else ''})")
    stray = [p for p in m.frozen if not matching(p, names) and not matching(p, others)]
    if stray:      # a typo would otherwise train what the user meant to freeze, silently
        raise UsageError(f"model.frozen: {', '.join(map(repr, stray))} match{'es' if len(stray) == 1 else ''} "
                         f"no parameter of {source} (its parameters: {', '.join(names[:12])}"
                         f"{' ...' if len(names) > 12 else ''})")
    listed = [n for n in names if not m.trainable or any(fnmatch.fnmatchcase(n, p) for p in m.trainable)]
    params = [n for n in listed if not any(fnmatch.fnmatchcase(n, p) for p in m.frozen)]
    if not params:
        raise UsageError(f"model.frozen: {list(m.frozen)} freezes every parameter of {source}"
                         + (" that model.trainable lists" if m.trainable else "") + "; nothing would train")
    return params, {n: FROZEN_WHY if n in listed else UNLISTED_WHY for n in names if n not in params}
