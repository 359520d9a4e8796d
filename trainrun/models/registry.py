"""Model families: everything trainrun knows of a built-in model, one :class:`Family` per family, so that
no other module names one. A family's module (``models/<family>.py``) builds its :class:`Family` and
calls :func:`register`; the rest of trainrun asks the registry: ``prepare`` for the forward graph and
the initial weights (:func:`of`), ``validity`` / ``evaluate`` for the shapes the data must fit
(:func:`vocab_and_positions`), ``model.init_from`` and ``export --format transformers`` for the
transformers names (:class:`Transformers`), ``export`` and ``generate`` for the graphs they build
from a run's manifest (:func:`of_manifest`), the optimizer each parameter's layer (:func:`layer_depths`).

The family's YAML section (``model.<name>``) is a dataclass: the built-in ones are part of the
schema in :mod:`trainrun.config` (which imports nothing of trainrun, so that the schema, ``config
show`` and the generated reference load no ONNX); a family defined elsewhere (a test's, a plug-in's)
passes its own dataclass to :func:`register`, which adds it to the schema
(:func:`trainrun.config.add_family_section`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .. import config as C
from ..errors import UsageError


@dataclass(frozen=True)
class Transformers:
    """A family's transformers counterpart: what ``model.init_from`` reads and ``export --format
    transformers`` writes."""
    architecture: str
    """config.json's ``architectures[0]``: the class ``from_pretrained`` builds."""
    model_type: str
    """config.json's ``model_type``."""
    prefix: str
    """The base model's prefix of the tensor names (a file of the base model holds them without it)."""
    tied: dict[str, str]
    """{head tensor: the parameter it is tied to}: written as a copy, read as the parameter."""
    optional: tuple[str, ...] = ()
    """Name prefixes of heads a base model's file may lack (they keep their fresh initialisation)."""
    config: Callable[[Any, Optional[int]], tuple[dict, dict]] = None
    """(section, the tokenizer's end-of-document id or None) -> (config.json, generation_config.json)."""
    tokenizer: Callable[[Optional[str]], tuple[dict, dict]] = None
    """(the end-of-document token or None) -> (special_tokens_map.json, more tokenizer_config.json keys)."""


@dataclass(frozen=True)
class Family:
    """One model family (``model.builtin: <name>``)."""
    name: str
    section: type
    """The dataclass of its config section ``model.<name>``: its shape and defaults. It has a
    ``vocab_size``, ``POSITIONS`` (the name of its field that is the longest sequence), its own checks in
    ``problems()`` and ``CONFIG_JSON_SHAPE`` (the fields of a transformers config.json that fix it)."""
    build: Callable[[Any, dict], Any]
    """(section, weights) -> the training forward graph, the weights as initializers."""
    init_weights: Callable[[Any, int], dict]
    """(section, run.seed) -> {parameter: float32 array}, in the graph's order."""
    param_specs: Callable[[Any], dict]
    """(section) -> {parameter: (shape, initialisation)}: the model's size without allocating it."""
    inputs: tuple[str, ...]
    """The forward graph's data inputs."""
    logits: str
    """Its logits output."""
    loss: Optional[str] = None
    """An output that already is the scalar loss; None: cross-entropy of the logits (classes last)
    against ``model.loss.labels``."""
    sequence_inputs: bool | tuple = True
    """Dim 1 of every data input is the sequence (True), or of the inputs named (BERT's input_ids,
    segment_ids and input_mask, not its masked_lm_positions): ``engine.static_shapes`` fixes it to data.seq_len."""
    sample_batch: Optional[Callable[[Any, Any], dict]] = None
    """(section, numpy Generator) -> a valid batch of the eval graph's inputs (export's check); None:
    each integer input drawn below the vocabulary."""
    inference: Optional[Callable[[Any], Any]] = None
    """(section) -> the inference graph export writes (dropout off, no weights: they follow), when
    it is not the prepared forward graph."""
    kv_cache: Optional[Callable[[Any, dict], Any]] = None
    """(section, weights) -> the attention-cache graph of ``generate`` and ``train.sample_every``;
    None: the family does not generate text."""
    positions_tensor: Optional[str] = None
    """The parameter whose first dim is the positions (generate's window in an exported model)."""
    transformers: Optional[Transformers] = None
    """Its transformers class; None: ``export --format transformers`` and ``model.init_from`` of a
    transformers folder are refused for it."""
    dropout_fields: tuple[str, ...] = ()
    """The section's dropout probabilities (set to 0 for the inference and attention-cache graphs)."""
    layers_above: Optional[Callable[[Any, str], int]] = None
    """(section, parameter name) -> how many layers lie above it (``optimizer.layer_decay``'s exponent);
    None: the family does not say (``optimizer.layer_decay`` is refused for it)."""
    loss_type: str = "cross_entropy"
    """The loss trainrun builds from ``logits`` when ``loss`` is None: cross_entropy or mse."""
    tasks: tuple[str, ...] = ()
    """``model.task``'s values: the first is this family's own (what ``model.task`` null means)."""
    task: Optional[Callable[[str, int], "Family"]] = None
    """(model.task other than the first of ``tasks``, model.num_labels) -> the family with that task head."""
    regression: tuple[str, ...] = ()
    """The tasks whose head may be a regression (``model.num_labels`` 1: one output, mse)."""
    metrics: tuple[str, ...] = ()
    """The eval metrics ``loss``'s own graph outputs (``metric/<name>/sum`` and ``/count``)."""
    lora_targets: tuple[str, ...] = ()
    """``model.lora.target_modules``' default: PEFT's for the family's transformers model type."""
    embeddings: tuple[str, ...] = ()
    """Its two-dim parameters read as lookup tables (Gather), not by a linear layer: ``model.lora`` cannot
    target them."""

    def shape(self, model: C.ModelConfig):
        """This family's section of ``model`` (a ModelConfig)."""
        return getattr(model, self.name)

    def shape_of(self, manifest: dict):
        """The section a run's graphs were prepared with, from its manifest."""
        return self.section(**manifest["model"].get(self.name, {}))

    def without_dropout(self, section):
        return dataclasses.replace(section, **{f: 0.0 for f in self.dropout_fields})


def classifier_config(config: Callable[[Any, Optional[int]], tuple[dict, dict]], num_labels: int):
    """A family's :attr:`Transformers.config` for its sequence classification head: ``config``'s values with
    num_labels, LABEL_<i> names and pad_token_id 0 (the padding of ``trainrun-data labelled`` samples,
    where transformers finds the last token)."""
    def classifier(section, eos_id: Optional[int]) -> tuple[dict, dict]:
        values, ids = config(section, eos_id)
        names = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        return {**values, "num_labels": num_labels, "id2label": names, "pad_token_id": 0,
                "label2id": {v: int(k) for k, v in names.items()},
                "problem_type": "single_label_classification"}, {**ids, "pad_token_id": 0}
    return classifier


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (``model.builtin: <family.name>``, its section ``model.<family.name>``)."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is registered already")
    C.add_family_section(family.name, family.section)
    _FAMILIES[family.name] = family
    return family


def names() -> list[str]:
    return list(_FAMILIES)


def get(name: str) -> Family:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise UsageError(f"model.builtin: {name!r} is not a model family (families: "
                         f"{', '.join(_FAMILIES)})") from None


def with_task(family: Family, task: Optional[str], num_labels: int) -> Family:
    """``family`` with the head of ``model.task`` (null or the family's own: ``family`` itself); the task
    and num_labels checked by :func:`trainrun.run.validity.config_problems`."""
    if not task or (family.tasks and task == family.tasks[0]):
        return family
    if task not in family.tasks or family.task is None:     # a config that did not pass validity
        raise ValueError(f"model.task {task!r} is not a task of {family.name}")
    return family.task(task, num_labels)


def task_labels(model: C.ModelConfig) -> int | None:
    """model.num_labels when model.task puts a task head on the built-in model (its eval then reports
    accuracy and F1, or Pearson and Spearman); None otherwise."""
    if not model.builtin or not model.task:
        return None
    family = get(model.builtin)
    return model.num_labels if family.tasks and model.task != family.tasks[0] else None


def of(model: C.ModelConfig) -> Family | None:
    """The family of ``model.builtin`` with the head of ``model.task``; None for a user's ``model.onnx``."""
    return with_task(get(model.builtin), model.task, model.num_labels) if model.builtin else None


def of_manifest(manifest: dict) -> Family | None:
    """The family (with its task head) a run's graphs were prepared from; None for a user's graph."""
    m = manifest["model"]
    name = m.get("builtin")
    return with_task(get(name), m.get("task"), m.get("num_labels", 2)) if name else None


def vocab_and_positions(model: C.ModelConfig) -> tuple[int | None, int | None]:
    """(vocabulary size, longest sequence) the data must fit; (None, None) for a user's graph."""
    family = of(model)
    if family is None:
        return None, None
    section = family.shape(model)
    return section.vocab_size, C.positions(section)


def layer_depths(model: C.ModelConfig, names: list[str]) -> dict[str, int] | None:
    """``optimizer.layer_decay``'s exponent of each parameter of a built-in model (the layers above it,
    from its family's ``layers_above``); None for a user's graph or a family that does not say (both
    refuse layer_decay: :mod:`trainrun.run.validity`)."""
    family = of(model)
    if family is None or family.layers_above is None:
        return None
    section = family.shape(model)
    return {n: family.layers_above(section, n) for n in names}


def positions_tensors() -> set[str]:
    """The parameters whose first dim is a family's positions (an exported model's window)."""
    return {f.positions_tensor for f in _FAMILIES.values() if f.positions_tensor}


def generating() -> list[str]:
    """The families that generate text (they have an attention-cache graph)."""
    return [n for n, f in _FAMILIES.items() if f.kv_cache is not None]
