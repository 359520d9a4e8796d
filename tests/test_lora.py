"""model.lora: PEFT's LoRA on every built-in family, against peft itself (the same base weights and
adapters in a transformers model wrapped by peft.get_peft_model)."""

import json
import os
import sys

import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file

from trainrun import config as C
from trainrun.step.engine import Engine, EngineOptions
from trainrun.graphs.manifest import prepare

from conftest import ROOT, TRAINRUN, mpirun, read_metrics, run, write_config
torch = pytest.importorskip("torch", reason="needs torch (the test extra), not installed here")
from test_llama import VARIANTS, hf_model, random_weights, relative  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reference as R  # noqa: E402

GPT2 = {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 32, "vocab_size": 512}
LLAMA = dict(VARIANTS["llama3_gqa"], vocab_size=512, max_position_embeddings=32)


def gpt2_folder(path, seed: int):
    """A GPT2LMHeadModel save_pretrained folder, every weight random (no dropout)."""
    import transformers
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(**GPT2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return str(path)


def llama_folder(path, seed: int):
    model = hf_model(LLAMA, random_weights(LLAMA, seed, scale=0.1))
    model.save_pretrained(path)
    return str(path)


FAMILIES = {
    # family: (folder maker, lora section, peft's extra LoraConfig keys)
    "gpt2": (gpt2_folder, {"r": 4, "alpha": 8.0, "target_modules": ["c_attn", "c_proj"], "modules_to_save": ["ln_f"]},
             {"fan_in_fan_out": True}),
    # lm_head: LLAMA's own (untied), a linear layer PEFT adapts like the others
    "llama": (llama_folder, {"r": 2, "alpha": 5.0, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}, {}),
}


def peft_model(folder: str, lora: dict, extra: dict, adapters: dict):
    """transformers' model of ``folder`` wrapped by peft with trainrun's adapters (and saved modules) loaded."""
    import peft
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float()
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora.get("dropout", 0.0),
        target_modules=lora["target_modules"], modules_to_save=lora.get("modules_to_save"), **extra))
    named = dict(model.named_parameters())
    for ours, value in adapters.items():
        theirs = peft_name(ours, lora)
        assert named[theirs].shape == value.shape, (theirs, named[theirs].shape, value.shape)
        with torch.no_grad():
            named[theirs].copy_(torch.from_numpy(value))
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable == {peft_name(n, lora) for n in adapters}, trainable ^ {peft_name(n, lora) for n in adapters}
    return model


def peft_name(ours: str, lora: dict) -> str:
    """Our parameter name in a peft model (adapter "default")."""
    for kind in ("lora_A", "lora_B"):
        if f".{kind}." in ours:
            return "base_model.model." + ours.replace(f".{kind}.", f".{kind}.default.")
    module, leaf = ours.rsplit(".", 1)
    return f"base_model.model.{module}.modules_to_save.default.{leaf}"


@pytest.mark.parametrize("family,builder", [pytest.param("gpt2", "onnxruntime", marks=pytest.mark.ort_training),
                                            pytest.param("llama", "onnxruntime", marks=pytest.mark.ort_training),
                                            ("gpt2", "trainrun"), ("llama", "trainrun")])
@pytest.mark.graphs
def test_lora_gradients_match_peft(tmp_path, family, builder):
    """The train graph's loss and the adapters' gradients (random B, so that A's count) = peft's, with
    either gradient builder; only the adapters (and modules_to_save) are parameters."""
    make, lora, extra = FAMILIES[family]
    folder = make(tmp_path / "base", seed=4)
    batch_size, seq = 2, 16
    cfg = C.from_dict({"model": {"builtin": family, "init_from": folder, "lora": lora}, "data": {"seq_len": seq},
                       "graphs": {"builder": builder}, "train": {"micro_batch_size": batch_size},
                       "optimizer": {"name": "sgd"}, "run": {"output_dir": str(tmp_path / "run"), "seed": 3}})
    graphs_dir = prepare(cfg)
    manifest = json.load(open(os.path.join(graphs_dir, "manifest.json")))
    names = [p["name"] for p in manifest["params"]]
    assert all(".lora_A." in n or ".lora_B." in n or n.startswith("transformer.ln_f.") for n in names), names
    # the frozen base: inputs of every graph (no constants of theirs), its values once in frozen.safetensors,
    # no gradient of it in the train graph
    frozen = [f["name"] for f in manifest["frozen"]]
    assert sorted(frozen) == sorted(manifest["lora"]["base"]) and not set(frozen) & set(names)
    assert sorted(load_file(os.path.join(graphs_dir, "frozen.safetensors"))) == sorted(frozen)
    for graph in ("train", "eval", "forward"):
        g = onnx.load(os.path.join(graphs_dir, f"{graph}.onnx")).graph
        assert not {t.name for t in g.initializer} & set(frozen), graph
        assert set(frozen) <= {i.name for i in g.input}, graph
    train_graph = onnx.load(os.path.join(graphs_dir, "train.onnx")).graph
    ends = {o.name for o in train_graph.output} | {i.name for i in train_graph.input}
    assert not [f for f in frozen if f + "_grad" in ends or f + "_grad.accumulation.buffer" in ends]
    shapes = {"input_ids": ((batch_size, seq), np.int64), "labels": ((batch_size, seq), np.int64)}
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    eng.load_weights()
    initial = eng.layout.unflatten(eng.params.copy())
    for n, v in initial.items():      # PEFT's initialisation: A kaiming-uniform (bound 1/sqrt(in)), B zeros
        if ".lora_A." in n:
            assert v.shape[0] == lora["r"] and 0 < np.abs(v).max() <= 1 / np.sqrt(v.shape[1])
        if ".lora_B." in n:
            assert v.shape[1] == lora["r"] and not v.any()
    rng = np.random.default_rng(7)
    adapters = {n: (rng.standard_normal(v.shape).astype(np.float32) * np.float32(0.1) if ".lora_" in n else v)
                for n, v in initial.items()}
    eng.params[:] = np.concatenate([adapters[n].ravel() for n in eng.layout.names])
    V = (GPT2 if family == "gpt2" else LLAMA)["vocab_size"]
    batch = {"input_ids": rng.integers(0, V, (batch_size, seq)), "labels": rng.integers(0, V, (batch_size, seq))}
    loss = eng.forward_backward(batch, accumulate=False)
    model = peft_model(folder, lora, extra, adapters).train()
    logits = model(input_ids=torch.from_numpy(batch["input_ids"])).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.from_numpy(batch["labels"]).reshape(-1))
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    named = dict(model.named_parameters())
    grads = eng.layout.unflatten(eng.grads)
    worst = max((relative(grads[n], named[peft_name(n, lora)].grad.numpy()), n) for n in grads)
    assert worst[0] < 1e-5, worst


def test_bad_lora_sections_exit_2_naming_the_key(tmp_path, byte_dataset):
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"model.lora": {"r": 0}})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert "model.lora.r" in p.stderr
    # an entry that matches nothing: validate (from the parameter names, no graph built) and training say the
    # same, naming the key, the entry and what the model has
    for name, key, entries, good, message in [
            ("d", "target_modules", ["c_attn", "q_proj"], "c_attn", "target_modules: 'q_proj' matches no linear layer of the "
             "gpt2 model (its linear layers end in: c_attn, c_fc, c_proj)"),
            ("e", "modules_to_save", ["score", "ln_f"], "ln_f", "modules_to_save: 'score' matches no module of the gpt2 "
             "model (its modules end in: c_attn, c_fc, c_proj, ln_1, ln_2, ln_f, wpe, wte)")]:
        cfg = write_config(tmp_path / f"{name}.yaml", byte_dataset, **{"model.lora": {key: entries}})
        for cmd in (["config", "validate"], ["train"]):
            p = run([TRAINRUN, *cmd, "--config", cfg], check=2)
            assert "model.lora." + message in p.stderr, (cmd, p.stderr)
            assert f"'{good}'" not in p.stderr     # the entry that matches is not named
        assert not (tmp_path / "run" / "graphs").exists()      # the refused model wrote nothing
    cfg = write_config(tmp_path / "w.yaml", byte_dataset, **{"model.lora": {"target_modules": ["wte"]}})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)     # an embedding is no linear layer
    assert "model.lora.target_modules: 'wte' matches no linear layer" in p.stderr, p.stderr
    # nor is a head tied to it (GPT-2's, a tied Llama's): refused by validate with that reason, and the linear
    # layers offered do not name it
    cfg = write_config(tmp_path / "h.yaml", byte_dataset, **{"model.lora": {"target_modules": ["lm_head"]}})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert ("model.lora.target_modules: 'lm_head' is the gpt2 model's head tied to its token embedding "
            "transformer.wte.weight, a lookup table: LoRA adapts an untied head only (its linear layers end in: "
            "c_attn, c_fc, c_proj)") in p.stderr, p.stderr
    cfg = write_config(tmp_path / "g.yaml", byte_dataset, **{"model.lora": {}, "train.sample_every": 5})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert "train.sample_every: samples the full model's weights; with model.lora" in p.stderr, p.stderr
    cfg = write_config(tmp_path / "f.yaml", byte_dataset, **{"train.max_steps": 1})
    run([TRAINRUN, "train", "--config", cfg], check=0)
    p = run([TRAINRUN, "export", str(tmp_path / "run"), "--format", "peft", "--output", str(tmp_path / "a")], check=2)
    assert "--format peft" in p.stderr and "not a LoRA run (no model.lora)" in p.stderr
    assert not os.path.exists(tmp_path / "a")


@pytest.mark.graphs
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_twenty_steps_equal_a_peft_loop_and_export_merged_and_as_peft(tmp_path, byte_dataset, family):
    """20 SGD steps of trainrun (1 rank) from a transformers folder = a PyTorch loop over peft's model on
    the same batches (reference.py's order): each loss and the final adapters to 1e-5. Then export:
    ``--format peft`` loaded by PeftModel.from_pretrained onto the base gives the logits of trainrun's
    (merged) ONNX export to 1e-5; ``--format transformers`` holds the weights of peft's merge_and_unload."""
    import onnxruntime as ort
    import peft
    import transformers
    make, lora, extra = FAMILIES[family]
    folder = make(tmp_path / "base", seed=4)
    seq, batch, lr, seed, steps = 32, 4, 0.05, 5, 20
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model": {"builtin": family, "init_from": folder, "lora": lora}, "data.seq_len": seq,
        "train.micro_batch_size": batch, "train.max_steps": steps, "run.seed": seed,
        "optimizer": {"name": "sgd", "lr": lr, "max_grad_norm": 0.0}, "lr_schedule": {"name": "constant"},
        "checkpoint": {"every": 0, "keep_last": 1}})
    run([TRAINRUN, "train", "--config", cfg], check=0)
    run_dir = str(tmp_path / "run")
    train, _ = read_metrics(run_dir)
    initial = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
    model = peft_model(folder, lora, extra, initial).train()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(list(named.values()), lr=lr)
    batches = R.global_batches(os.path.join(byte_dataset, "train"), seq, batch, seed)
    for t in range(1, steps + 1):
        ids, labels = next(batches)
        logits = model(input_ids=torch.from_numpy(ids)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(labels).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert train[t]["loss"] == pytest.approx(loss.item(), rel=1e-5), t
    assert train[steps]["loss"] < train[1]["loss"]
    final = load_file(os.path.join(run_dir, "checkpoints", str(steps), "model.safetensors"))
    assert set(final) == set(initial)
    worst = max((relative(final[n], named[peft_name(n, lora)].detach().numpy()), n) for n in final)
    assert worst[0] < 1e-5, worst

    # the three exports
    run([TRAINRUN, "export", run_dir, "--format", "peft", "--output", str(tmp_path / "adapter")], check=0)
    run([TRAINRUN, "export", run_dir, "--output", os.path.join(run_dir, "m.onnx")], check=0)
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", str(tmp_path / "hf")], check=0)
    # the attention-cache graph holds the merged weights too (export checks it against the eval graph)
    assert "attention cache" in run([TRAINRUN, "export", run_dir, "--kv-cache", "--output",
                                     os.path.join(run_dir, "kv.onnx")], check=0).stdout
    _, evals = read_metrics(run_dir)
    out = str(tmp_path / "eval.json")
    run([TRAINRUN, "evaluate", run_dir, "--data", os.path.join(byte_dataset, "eval"), "--batch", "4", "--steps", "2",
         "--output", out], check=0)
    assert json.load(open(out))["loss"] == pytest.approx(evals[steps]["eval_loss"], rel=1e-5)
    greedy = ["--prompt", "def f(", "--max-new-tokens", "8", "--temperature", "0"]
    texts = [run([TRAINRUN, "generate", src, *greedy], check=0).stdout
             for src in (run_dir, os.path.join(run_dir, "kv.onnx"), os.path.join(run_dir, "m.onnx"))]
    assert texts[0].startswith("def f(") and len(set(texts)) == 1, texts
    adapter_config = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == lora["r"]
    assert adapter_config["lora_alpha"] == lora["alpha"] and adapter_config["task_type"] == "CAUSAL_LM"
    assert adapter_config["base_model_name_or_path"] == folder
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float()
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = np.random.default_rng(2).integers(0, 256, (2, seq))
    with torch.no_grad():
        theirs = loaded(input_ids=torch.from_numpy(ids)).logits.numpy()
    exported = ort.InferenceSession(os.path.join(run_dir, "m.onnx"), providers=["CPUExecutionProvider"])
    assert not any(".lora_" in i.name for i in exported.get_inputs())
    ours = exported.run(["logits"], {"input_ids": ids})[0]
    assert relative(ours, theirs) < 1e-5
    merged = {k: v.numpy() for k, v in loaded.merge_and_unload().state_dict().items()}
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(written) <= set(merged) and not any(".lora_" in k for k in written)
    worst = max((relative(written[k], merged[k]), k) for k in written)
    assert worst[0] < 1e-5, worst
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    with torch.no_grad():
        assert relative(hf(input_ids=torch.from_numpy(ids)).logits.numpy(), theirs) < 1e-5


@pytest.mark.graphs
def test_resume_is_exact_with_zero1_and_adapter_dropout_and_checks_the_base(tmp_path, byte_dataset):
    """2 ranks, ZeRO-1, AdamW, adapter dropout: stopped at step 4 and resumed = straight (bitwise: losses and
    the final adapters); the optimizer state is the adapters' (exp_avg/exp_avg_sq of each adapter, nothing
    of the base). Resumed onto other base weights (model.init_from): exit 2 naming the mismatch."""
    folder = gpt2_folder(tmp_path / "base", seed=4)
    lora = {"r": 2, "alpha": 4.0, "dropout": 0.2, "target_modules": ["c_attn", "c_fc"]}

    def start(name, **extra):
        cfg = write_config(tmp_path / f"{name}.yaml", byte_dataset, **{
            "run.output_dir": str(tmp_path / name), "model": {"builtin": "gpt2", "init_from": folder, "lora": lora},
            "train.max_steps": 8, "train.micro_batch_size": 2, "distributed.zero_stage": 1, "data.eval": None,
            "checkpoint": {"every": 4, "keep_last": 3}, **extra})
        out = mpirun(2, "--config", cfg)
        return str(tmp_path / name), out.stdout + out.stderr

    straight, out = start("straight", **{"run.log_level": "devinfo", "debug.save_graphs": True})
    # both ranks bind the one frozen base of their node (shared memory, beside the parameters); no eval data:
    # the eval graph is never opened (debug.save_graphs writes each graph a session opens)
    manifest = json.load(open(os.path.join(straight, "graphs", "manifest.json")))
    frozen = sum(int(np.prod(f["shape"])) for f in manifest["frozen"])
    line = f"one {4 * manifest['num_params']:,}-byte parameter buffer and one {4 * frozen:,}-byte frozen buffer per node"
    assert out.count(line) == 2, out
    saved = os.listdir(os.path.join(straight, "debug", "graphs"))
    assert "train.onnx" in saved and "eval.onnx" not in saved, saved
    split, _ = start("split", **{"train.stop_at": 4})
    mpirun(2, "resume", os.path.join(split, "checkpoints", "4"), "--set", "train.stop_at=0")
    a, b = read_metrics(straight)[0], read_metrics(split)[0]
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    wa = load_file(os.path.join(straight, "checkpoints", "8", "model.safetensors"))
    wb = load_file(os.path.join(split, "checkpoints", "8", "model.safetensors"))
    assert set(wa) == set(wb) and all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert all(".lora_A." in k or ".lora_B." in k for k in wa) and len(wa) == 2 * 2 * 2
    moments = load_file(os.path.join(straight, "checkpoints", "8", "optimizer.safetensors"))
    assert {k: v.shape for k, v in moments.items()} == {f"{s}/{k}": v.shape for k, v in wa.items()
                                                         for s in ("exp_avg", "exp_avg_sq")}
    assert manifest["num_params"] == sum(v.size for v in wa.values())

    other = gpt2_folder(tmp_path / "other", seed=5)
    p = run([TRAINRUN, "resume", os.path.join(straight, "checkpoints", "8"), "--set", f"model.init_from={other}",
             "--set", "train.max_steps=9", "--force"], check=2)
    assert "LoRA adapters were trained on other base weights" in p.stderr, p.stderr


@pytest.mark.graphs
def test_bert_lora_gradients_match_peft(tmp_path):
    """BERT (BertForPreTraining: MLM + NSP loss in the graph) from a transformers folder with adapters on every
    query, value and dense layer (attention output, intermediate, output, pooler, the MLM transform): the loss
    and the adapters' gradients = peft's on BertForPreTraining."""
    import peft
    import transformers
    from test_bert import TINY, hf_bert, hf_forward
    from trainrun.models.bert import INPUTS, init_weights, sample_inputs
    rng = np.random.default_rng(3)
    base = {n: v + rng.standard_normal(v.shape).astype(np.float32) * np.float32(0.02)
            for n, v in init_weights(C.BertConfig(**TINY), 1).items()}
    hf_bert(TINY, base).save_pretrained(tmp_path / "base")
    lora = {"r": 3, "alpha": 6.0, "target_modules": ["query", "value", "dense"]}
    batch_size, seq, preds = 4, 32, 6
    cfg = C.from_dict({"model": {"builtin": "bert", "init_from": str(tmp_path / "base"), "lora": lora,
                                 "bert": {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}},
                       "data": {"seq_len": seq}, "train": {"micro_batch_size": batch_size},
                       "optimizer": {"name": "sgd"}, "run": {"output_dir": str(tmp_path / "run"), "seed": 3}})
    graphs_dir = prepare(cfg)
    dims = {"input_ids": (seq,), "segment_ids": (seq,), "input_mask": (seq,), "masked_lm_positions": (preds,),
            "masked_lm_ids": (preds,), "next_sentence_labels": ()}
    shapes = {k: ((batch_size, *dims[k]), np.int64) for k in INPUTS}
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    eng.load_weights()
    initial = eng.layout.unflatten(eng.params.copy())
    assert len(initial) == 2 * TINY["num_hidden_layers"] * 5 + 2 * 2     # + the pooler's and the transform's
    adapters = {n: rng.standard_normal(v.shape).astype(np.float32) * np.float32(0.1) for n, v in initial.items()}
    eng.params[:] = np.concatenate([adapters[n].ravel() for n in eng.layout.names])
    batch = sample_inputs(cfg.model.bert, batch_size, seq, preds, np.random.default_rng(1))
    loss = eng.forward_backward(batch, accumulate=False)
    model = peft.get_peft_model(transformers.BertForPreTraining.from_pretrained(str(tmp_path / "base")),
                                peft.LoraConfig(r=3, lora_alpha=6.0, target_modules=lora["target_modules"]))
    named = dict(model.named_parameters())
    with torch.no_grad():
        for n, v in adapters.items():
            named[peft_name(n, lora)].copy_(torch.from_numpy(v))
    assert {n for n, p in named.items() if p.requires_grad} == {peft_name(n, lora) for n in adapters}
    ref = hf_forward(model.train(), batch).loss
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    grads = eng.layout.unflatten(eng.grads)
    worst = max((relative(grads[n], named[peft_name(n, lora)].grad.numpy()), n) for n in grads)
    assert worst[0] < 1e-5, worst


def test_the_smollm2_recipe_pretrains_then_fine_tunes_a_lora_classifier_and_exports_it(tmp_path):
    """The recipe as docs/models.md and configs/smollm2-135m.yaml give it, its commands in order on the
    config file shrunk by --set: `trainrun-data tokens` on a text folder, pre-training, `export --format
    transformers`, `trainrun-data labelled` with the pre-training's byte-level BPE (no [CLS], as SmolLM2's), then
    model.task sequence_classification from that folder with adapters (dropout) on q_proj and v_proj and `score`
    in modules_to_save. It learns the topics; its --format peft export (task_type
    SEQ_CLS, score saved) loaded by PeftModel.from_pretrained onto LlamaForSequenceClassification of the
    pre-trained folder gives the merged ONNX export's logits, and the merged transformers export loaded by
    AutoModelForSequenceClassification the same."""
    import onnxruntime as ort
    import peft
    import transformers
    from conftest import TRAINRUN_DATA
    from test_finetune import WORDS, _rows
    recipe = os.path.join(ROOT, "configs", "smollm2-135m.yaml")
    texts = tmp_path / "corpus"
    texts.mkdir()
    rng = np.random.default_rng(0)
    words = sorted(w for ws in WORDS.values() for w in ws)
    for i in range(24):
        (texts / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 80)) + "\n")
    run([TRAINRUN_DATA, "tokens", "--input", str(texts), "--output", str(tmp_path / "data"), "--train-bpe", "300",
         "--eval-fraction", "0.25", "--no-progress"], check=0)
    (tmp_path / "topics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(96, 0)))
    topics = str(tmp_path / "data" / "topics")
    run([TRAINRUN_DATA, "labelled", "--input", str(tmp_path / "topics.jsonl"), "--text-field", "text", "--label-field",
         "topic", "--tokenizer", str(tmp_path / "data" / "tokenizer.json"), "--seq-len", "16", "--eval-fraction",
         "0.25", "--output", topics], check=0)
    tiny = ["model.llama.hidden_size=64", "model.llama.intermediate_size=96", "model.llama.num_hidden_layers=2",
            "model.llama.num_attention_heads=4", "model.llama.num_key_value_heads=2", "model.llama.vocab_size=300",
            "model.llama.max_position_embeddings=32", "train.micro_batch_size=4", "train.gradient_accumulation_steps=1",
            "train.eval_steps=2", "train.log_every=1", "lr_schedule.warmup_steps=1", "checkpoint.every=0"]

    def sets(*values):
        return [a for v in (*tiny, *values) for a in ("--set", v)]
    pre_run = str(tmp_path / "runs" / "smollm2-135m")
    run([TRAINRUN, "--config", recipe, *sets(f"run.output_dir={pre_run}", f"data.train={tmp_path / 'data' / 'train'}",
                                           f"data.eval={tmp_path / 'data' / 'eval'}", "data.seq_len=32",
                                           "train.max_steps=6", "train.eval_every=6")], check=0)
    pre = str(tmp_path / "smollm2-out")
    run([TRAINRUN, "export", pre_run, "--format", "transformers", "--output", pre], check=0)
    run_dir = str(tmp_path / "runs" / "smollm2-topics")
    run([TRAINRUN, "--config", recipe, *sets(
        f"model.init_from={pre}", "model.task=sequence_classification", "model.num_labels=3",
        "model.lora={r: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj], modules_to_save: [score]}",
        f"run.output_dir={run_dir}", f"data.train={topics}/train", f"data.eval={topics}/eval",
        "data.seq_len=16", "train.max_steps=32", "train.eval_every=32", "train.eval_steps=6", "optimizer.lr=1e-2",
        "lr_schedule.warmup_steps=0")], check=0)
    _, evals = read_metrics(run_dir)
    assert evals[32]["eval_loss"] < np.log(3), evals[32]
    for fmt, out in (("peft", "adapter"), ("transformers", "hf"), ("onnx", "m.onnx")):
        run([TRAINRUN, "export", run_dir, "--format", fmt, "--output", str(tmp_path / out)], check=0)
    adapter = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert adapter["task_type"] == "SEQ_CLS" and adapter["base_model_name_or_path"] == pre, adapter
    b = {"input_ids": np.array([[5, 9, 14, 22, 0, 0], [7, 3, 30, 11, 12, 40]], np.int64),
         "input_mask": np.array([[1, 1, 1, 1, 0, 0], [1] * 6], np.int64)}
    ours = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(["logits"], b)[0]
    base = transformers.LlamaForSequenceClassification.from_pretrained(pre, num_labels=3, pad_token_id=0)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    auto = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        for model in (loaded, auto):
            logits = model(input_ids=torch.from_numpy(b["input_ids"]),
                           attention_mask=torch.from_numpy(b["input_mask"])).logits.numpy()
            assert relative(ours, logits) < 1e-5, type(model).__name__
