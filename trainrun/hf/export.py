"""``trainrun export --format transformers|peft``: a run's checkpoint as the folders Hugging Face's libraries load:
a transformers ``save_pretrained`` folder (:func:`export_transformers`: config.json, model.safetensors under
transformers' names, generation_config.json, the run's tokenizer) and a LoRA run's PEFT adapters
(:func:`export_peft`). The weights are read as ``trainrun export``'s ONNX model reads them
(:mod:`trainrun.commands.export`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from safetensors.numpy import save_file

from .. import checkpoint as K
from .. import config as C
from ..commands.export import checkpoint_weights, full_weights, parameters_of
from ..errors import UsageError
from ..graphs.manifest import load_manifest
from ..models import registry
from ..run import rundir
from . import tokenizer as T


def _hf_files(family, section, text, eos_id: int | None) -> dict[str, dict]:
    """config.json and generation_config.json with the run's values; with a tokenizer (``text``),
    tokenizer_config.json and special_tokens_map.json for the run's tokenizer.json."""
    hf = family.transformers
    config, ids = hf.config(section, eos_id)
    files = {"config.json": {"architectures": [hf.architecture], "model_type": hf.model_type, **config, **ids,
                             "torch_dtype": "float32"},
             "generation_config.json": {**ids, "_from_model_config": True}}
    if text is not None and text.tokenizer is not None:
        eos = text.tokenizer.id_to_token(text.eos_id) if text.eos_id is not None else None
        special, more = hf.tokenizer(eos)
        files["tokenizer_config.json"] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                          "model_max_length": C.positions(section),
                                          "clean_up_tokenization_spaces": False, **special, **more}
        files["special_tokens_map.json"] = special
    return files


def _label_map(ckpt: K.Pinned, num_labels: int, echo) -> dict:
    """config.json's id2label / label2id of a task model: those of its data.train's manifest.json
    (``trainrun-data labelled``); {} (transformers' LABEL_<i>) when the dataset is gone or has none."""
    train = K.read_config(ckpt).data.train
    path = os.path.join(train or "", "manifest.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        id2label = {str(k): str(v) for k, v in data["id2label"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        echo(f"note: config.json's id2label is LABEL_<i>: no label map in {path}")
        return {}
    if len(id2label) != num_labels:
        echo(f"note: config.json's id2label is LABEL_<i>: {path} names {len(id2label)} labels, the model has "
             f"{num_labels}")
        return {}
    return {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}


def export_transformers(checkpoint: str, output: str, *, tokenizer: str | None = None, echo=print,
                        retry=None) -> str:
    """Write a transformers ``save_pretrained`` directory (see docs/operations.md): config.json, model.safetensors
    (transformers' names; the tied heads are the tensors they are tied to), generation_config.json and
    the run's tokenizer. Staged beside ``output`` and moved into place at the end."""
    with K.pin(checkpoint) as held:       # its files stay readable if the run training on prunes it
        return _export_transformers(held, output, tokenizer, echo, retry)


def _export_transformers(held: K.Pinned, output: str, tokenizer: str | None, echo, retry) -> str:
    ckpt = held.dir
    run_dir = rundir.run_dir_of(ckpt)
    manifest = load_manifest(os.path.join(run_dir, "graphs"))
    family = registry.of_manifest(manifest)
    if family is None or family.transformers is None:
        raise UsageError(f"--format transformers: {ckpt} is "
                         + (f"a {family.name} model, a family with no transformers class" if family else
                            "a user graph, which has no transformers class") + "; export it as onnx")
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise UsageError(f"--output {output} already exists and is not an empty directory")
    if manifest.get("task_labels"):     # the label map is read from the data its config.yaml names
        K.verify(held, ["config.yaml"], retry=retry)
    weights = full_weights(os.path.join(run_dir, "graphs"), manifest, checkpoint_weights(held, manifest, retry))
    for tied, source in family.transformers.tied.items():       # as the transformers class holds them
        weights.setdefault(tied, weights[source])               # (a head that is a parameter: untied)
    try:
        text = T.for_run(run_dir, tokenizer)
    except UsageError as exc:
        text = None
        echo(f"note: no tokenizer files written: {exc.message}")
    if text is not None and text.tokenizer is None:
        echo("note: no tokenizer files written: the run's data are raw bytes (no tokenizer.json)")
    files = _hf_files(family, family.shape_of(manifest), text, text.eos_id if text is not None else None)
    if manifest.get("task_labels"):
        files["config.json"].update(_label_map(held, manifest["task_labels"], echo))
    _write_folder(output, "model.safetensors", weights, files,
                  text.path if text is not None and text.tokenizer is not None else None)
    what = parameters_of(held)[2]
    echo(f"exported {output} ({family.transformers.architecture}, {', '.join(sorted(os.listdir(output)))}) from {ckpt}"
         + (f": {what}" if what else ""))
    return output


# model.task -> PEFT's task_type (a family's own task: causal_lm for the decoders, none for BERT's pretraining)
_PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS"}


def export_peft(checkpoint: str, output: str, *, echo=print, retry=None) -> str:
    """Write a LoRA run's adapters as PEFT saves them: adapter_config.json and adapter_model.safetensors
    (``base_model.model.<module>.lora_A.weight`` ..., and the parameters of modules_to_save), which
    ``PeftModel.from_pretrained`` loads onto the base model. Staged beside ``output`` and moved into place."""
    with K.pin(checkpoint) as held:
        ckpt = held.dir
        manifest = load_manifest(os.path.join(rundir.run_dir_of(ckpt), "graphs"))
        lora = manifest["model"].get("lora")
        if not manifest.get("lora") or not lora:
            raise UsageError(f"--format peft: {ckpt} is not a LoRA run (no model.lora): it has no adapters; "
                             f"export it as onnx or transformers")
        if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
            raise UsageError(f"--output {output} already exists and is not an empty directory")
        weights = checkpoint_weights(held, manifest, retry)
    family = registry.of_manifest(manifest)
    task = manifest["model"].get("task") or (family.tasks[0] if family.tasks else None)
    targets = sorted({n.rsplit(".lora_A.", 1)[0].rsplit(".", 1)[-1] for n in weights if ".lora_A." in n})
    config = {"peft_type": "LORA", "task_type": _PEFT_TASKS.get(task), "r": lora["r"], "lora_alpha": lora["alpha"],
              "lora_dropout": lora["dropout"], "target_modules": list(lora["target_modules"]) or targets,
              "modules_to_save": list(lora["modules_to_save"]) or None,
              "fan_in_fan_out": bool(manifest["lora"]["in_out"]), "bias": "none", "inference_mode": True,
              "init_lora_weights": True, "base_model_name_or_path": manifest["model"].get("init_from")}
    _write_folder(output, "adapter_model.safetensors", {f"base_model.model.{n}": v for n, v in weights.items()},
                  {"adapter_config.json": config})
    echo(f"exported {output} (PEFT LoRA adapters, r {lora['r']}, {len(weights)} tensors) from {ckpt}")
    return output


def _write_folder(output: str, tensors_file: str, weights: dict, files: dict, tokenizer: str | None = None) -> None:
    """A folder as transformers and PEFT save them: ``weights`` in safetensors (``tensors_file``), each of
    ``files`` as JSON, the tokenizer.json ``tokenizer`` copied; staged beside ``output`` and moved into place
    (``output`` absent or an empty folder), so a stop leaves either nothing or the whole folder."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.path.join(stage, tensors_file),
                  metadata={"format": "pt"})
        rundir.as_created(os.path.join(stage, tensors_file))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, os.path.join(stage, "tokenizer.json"))
        for name, obj in files.items():
            with open(os.path.join(stage, name), "w") as fh:
                json.dump(obj, fh, indent=2)
                fh.write("\n")
        if os.path.isdir(output):
            os.rmdir(output)
        os.replace(rundir.as_created(stage), output)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
