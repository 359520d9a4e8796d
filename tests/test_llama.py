"""The Llama family (model.builtin llama) against transformers: logits of small random configs of each
variant (Llama 3 with grouped-query attention and llama3 rope scaling, a tied SmolLM2-shaped one with
multi-query-like grouping, Qwen2 with q/k/v biases and linear rope scaling, Mistral inside its window),
the train graph's gradients against torch autograd, greedy generation through the attention cache
against transformers' generate."""

import os

import numpy as np
import onnxruntime as ort
import pytest

from trainrun import config as C
from trainrun.step.engine import Engine, EngineOptions
from trainrun.commands.generate import Decoder, generate
from trainrun.graphs.manifest import prepare
from trainrun.models.llama import build_llama, init_weights, param_count

from conftest import (MPIRUN, TRAINRUN, assert_matches_torch, loss_graph_outputs, mpirun, optional, read_metrics, run,
                      write_config)
from test_finetune import labelled  # noqa: F401 - the fixture: `trainrun-data labelled` topics

torch = optional("torch")

VARIANTS = {
    "llama3_gqa": dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                       max_position_embeddings=64, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5),
    "smollm2_tied": dict(model_type="llama", vocab_size=120, hidden_size=72, intermediate_size=80,
                         num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         max_position_embeddings=48, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "qwen2_bias": dict(model_type="qwen2", vocab_size=90, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, rope_theta=1000000.0, attention_bias=True,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=40),
    "mistral_window": dict(model_type="mistral", vocab_size=80, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, sliding_window=32,
                           max_position_embeddings=64),
}


def section(shape: dict) -> C.LlamaConfig:
    return C.LlamaConfig(**shape)


def hf_model(shape: dict, weights: dict):
    """transformers' class of the variant holding ``weights`` (numpy, our names), float32, eval mode."""
    import transformers
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    kind = shape["model_type"]
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    keys = {k: v for k, v in shape.items() if k not in ("model_type", "attention_bias", "mlp_bias")}
    if kind == "llama":
        keys.update(attention_bias=shape.get("attention_bias", False), mlp_bias=shape.get("mlp_bias", False))
    if "rope_scaling" in keys:
        keys["rope_scaling"] = dict(keys["rope_scaling"], type=keys["rope_scaling"]["rope_type"])
    cfg = cls[0](**keys, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "eager"
    model = cls[1](cfg).float()
    result = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
    tied = shape.get("tie_word_embeddings", False)
    assert set(result.missing_keys) <= ({"lm_head.weight"} if tied else set()) and not result.unexpected_keys, result
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def random_weights(shape: dict, seed: int, scale: float = 0.1) -> dict:
    """Every parameter random (biases and norms too, so that each of them counts)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in init_weights(section(shape), seed).items():
        noise = rng.standard_normal(w.shape).astype(np.float32) * np.float32(scale)
        out[name] = (1 + noise if name.endswith("layernorm.weight") or name == "model.norm.weight" else noise
                     ).astype(np.float32)
    return out


def relative(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.torch
def test_logits_match_transformers(variant):
    shape = VARIANTS[variant]
    cfg = section(shape)
    weights = random_weights(shape, seed=5)
    assert param_count(cfg) == sum(w.size for w in weights.values())
    hf = hf_model(shape, weights)
    assert param_count(cfg) == sum(p.numel() for p in hf.parameters())
    sess = ort.InferenceSession(build_llama(cfg, weights).SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, seq in [(1, 1), (2, 13), (2, shape["max_position_embeddings"] if variant != "mistral_window" else 32)]:
        ids = rng.integers(0, shape["vocab_size"], (batch, seq))
        ours = sess.run(["logits"], {"input_ids": ids})[0]
        with torch.no_grad():
            ref = hf(torch.from_numpy(ids)).logits.numpy()
        assert ours.shape == ref.shape
        assert relative(ours, ref) < 1e-5, (variant, batch, seq, relative(ours, ref))


def test_initialisation_is_seeded_and_llama_like():
    cfg = C.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=2048,
                        attention_bias=True, initializer_range=0.05)
    a, b, c = init_weights(cfg, 1), init_weights(cfg, 1), init_weights(cfg, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.embed_tokens.weight"].std() == pytest.approx(0.05, rel=0.02)
    assert a["model.layers.1.mlp.down_proj.weight"].std() == pytest.approx(0.05, rel=0.02)
    assert (a["model.layers.0.input_layernorm.weight"] == 1).all() and (a["model.norm.weight"] == 1).all()
    assert (a["model.layers.0.self_attn.q_proj.bias"] == 0).all()


@pytest.mark.torch
def test_the_smollm2_recipe_is_smollm2_135m():
    """configs/smollm2-135m.yaml: transformers' LlamaForCausalLM of the config.json export writes has
    our parameters, name for name and shape for shape (134,515,008 of them)."""
    import transformers
    from trainrun.models.llama import _transformers_config, param_specs
    from conftest import ROOT
    cfg = C.load_config(os.path.join(ROOT, "configs", "smollm2-135m.yaml")).model.llama
    values, ids = _transformers_config(cfg, None)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**values, **ids))
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert theirs == {n: shape for n, (shape, _) in param_specs(cfg).items()}
    assert param_count(cfg) == 134_515_008


def make_engine(tmp_path, shape, batch, seq, builder="auto"):
    cfg = C.from_dict({"model": {"builtin": "llama", "llama": shape}, "data": {"seq_len": seq},
                       "graphs": {"builder": builder},
                       "train": {"micro_batch_size": batch}, "optimizer": {"name": "sgd"},
                       "run": {"output_dir": str(tmp_path), "seed": 3}})
    graphs_dir = prepare(cfg)
    shapes = {"input_ids": ((batch, seq), np.int64), "labels": ((batch, seq), np.int64)}
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    eng.load_weights()
    return eng


@pytest.mark.graphs
@pytest.mark.parametrize("builder", [pytest.param("onnxruntime", marks=pytest.mark.ort_training), "trainrun"])
@pytest.mark.parametrize("variant", ["llama3_gqa", "smollm2_tied", "qwen2_bias"])
@pytest.mark.torch
def test_train_graph_gradients_match_torch(tmp_path, variant, builder):
    """The train graph of either gradient builder (onnxruntime-training's, trainrun's own)."""
    shape = VARIANTS[variant]
    eng = make_engine(tmp_path, shape, batch=2, seq=24, builder=builder)
    weights = random_weights(shape, seed=9)
    eng.params[:] = np.concatenate([weights[n].ravel() for n in eng.layout.names])
    hf = hf_model(shape, weights).train()
    rng = np.random.default_rng(1)
    V = shape["vocab_size"]
    batch = {"input_ids": rng.integers(0, V, (2, 24)), "labels": rng.integers(0, V, (2, 24))}
    batch["labels"][0, :5] = -100
    loss = eng.forward_backward(batch, accumulate=False)
    assert_matches_torch(eng, loss, hf, batch, V, rel=1e-5)
    assert set(eng.layout.unflatten(eng.grads)) == set(dict(hf.named_parameters()))


@pytest.mark.parametrize("variant", ["llama3_gqa", "smollm2_tied", "qwen2_bias"])
@pytest.mark.torch
def test_greedy_generation_through_the_cache_matches_transformers(variant):
    shape = VARIANTS[variant]
    cfg = section(shape)
    weights = random_weights(shape, seed=11, scale=0.5)
    hf = hf_model(shape, weights)
    sess = ort.InferenceSession(build_llama(cfg, weights, kv_cache=True).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    decoder = Decoder(sess, C.positions(cfg))
    prompt = list(np.random.default_rng(3).integers(0, shape["vocab_size"], 7))
    ours = generate(decoder, prompt, 20, np.random.default_rng(0), temperature=0.0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                          eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(prompt):].tolist()
    # equal up to the first step whose best two logits are closer than float32 noise could move them
    margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
    close = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))
    assert close >= 10, margins
    assert ours[:close + 1] == ref[:close + 1]
    assert len(set(ours)) > 3          # not one token repeated: the cache's positions matter


def test_a_sequence_longer_than_mistrals_window_is_refused(tmp_path, byte_dataset):
    shape = dict(VARIANTS["mistral_window"], vocab_size=300)
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, model={"builtin": "llama", "llama": shape},
                       **{"data.seq_len": 48})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert "data.seq_len: 48 is longer than the model's positions (model.llama.sliding_window = 32)" in p.stderr


def pretrained_folder(path, shape: dict, seed: int, tokenizer: str, max_shard_size=None, transformers4=False):
    """A transformers save_pretrained folder of the variant with every weight random (none zero) and the
    data's tokenizer.json; ``transformers4``: its config.json rewritten with rope_theta + rope_scaling
    ("type") in place of transformers 5's rope_parameters."""
    import json
    import shutil
    hf = hf_model(shape, random_weights(shape, seed))
    hf.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    shutil.copyfile(tokenizer, os.path.join(path, "tokenizer.json"))
    if transformers4:
        file = os.path.join(path, "config.json")
        config = json.load(open(file))
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else dict(rope, type=rope.pop("rope_type"))
        json.dump(config, open(file, "w"))
    return hf


@pytest.mark.parametrize("variant,sharded,transformers4", [("llama3_gqa", True, False), ("qwen2_bias", False, True),
                                                           ("smollm2_tied", False, False), ("mistral_window", True, True)])
@pytest.mark.torch
def test_init_from_a_transformers_folder_and_export_back_bit_for_bit(tmp_path, bpe_dataset, variant, sharded,
                                                                      transformers4):
    """model.init_from a LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM folder (sharded with an
    index or one file; transformers 4's or 5's rope keys) fills model.llama from config.json and starts
    from its weights bit for bit; a step at lr 1e-30 (no weight moves: every one is far from 0) then
    export --format transformers gives back the very tensors, loaded by AutoModelForCausalLM (the same
    class, the same logits) with the run's tokenizer loaded by AutoTokenizer."""
    import transformers
    from safetensors.numpy import load_file
    shape = dict(VARIANTS[variant], vocab_size=384, max_position_embeddings=64)
    src = tmp_path / "pre"
    hf = pretrained_folder(str(src), shape, 21, os.path.join(bpe_dataset, "tokenizer.json"),
                           max_shard_size="40KB" if sharded else None, transformers4=transformers4)
    assert os.path.exists(src / "model.safetensors.index.json") == sharded
    cfg_path = write_config(tmp_path / "c.yaml", bpe_dataset, **{
        "model": {"builtin": "llama", "init_from": str(src)}, "train.max_steps": 1,
        "optimizer": {"name": "sgd", "lr": 1e-30}, "lr_schedule": {"name": "constant"}, "checkpoint": {"every": 1}})
    filled = C.load_config(cfg_path).model.llama
    want = section(shape)
    assert {f: getattr(filled, f) for f in ("model_type", "num_key_value_heads", "rope_theta", "rope_scaling",
                                           "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
                                           "hidden_size", "intermediate_size", "heads_dim")} == \
        {f: getattr(want, f) for f in ("model_type", "num_key_value_heads", "rope_theta", "rope_scaling",
                                       "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
                                       "hidden_size", "intermediate_size", "heads_dim")}
    run([TRAINRUN, "--config", cfg_path], check=0)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    if shape.get("tie_word_embeddings"):
        del state["lm_head.weight"]
    prepared = load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))
    assert set(prepared) == set(state) and all(np.array_equal(prepared[k], state[k]) for k in state)

    out = tmp_path / "hf"
    run([TRAINRUN, "export", str(tmp_path / "run" / "checkpoints" / "1"), "--format", "transformers",
         "--output", str(out)], check=0)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(back) is type(hf)
    for name, value in back.state_dict().items():
        assert np.array_equal(value.numpy(), hf.state_dict()[name].numpy()), name
    exported = load_file(str(out / "model.safetensors"))
    assert all(np.array_equal(exported[k], state[k]) for k in state)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 384, (2, 20)))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf.eval()(ids).logits)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(os.path.join(bpe_dataset, "tokenizer.json"))
    text = "def f(x):\n    return x + 1\n"
    assert tok.get_vocab() == ref.get_vocab()
    if variant != "qwen2_bias":     # transformers loads a qwen2 folder's tokenizer with Qwen's own pre-tokenizer
        assert tok(text, add_special_tokens=False)["input_ids"] == ref.encode(text, add_special_tokens=False).ids
    assert tok.eos_token == "<|endoftext|>" and back.config.eos_token_id == ref.token_to_id("<|endoftext|>")


TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rope_theta=500000.0,
            rms_norm_eps=1e-5, initializer_range=0.05, bos_token_id=1, eos_token_id=256, pad_token_id=0,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32})


@pytest.mark.torch
def test_two_ranks_train_resume_export_evaluate_and_generate(tmp_path, byte_dataset):
    """A tiny llama on 2 ranks: stopped at step 3 and resumed to 6 = 6 steps straight, bit for bit; the
    ONNX and attention-cache exports (checked against the eval graph), the transformers export
    (AutoModelForCausalLM's logits = the ONNX export's; the section's token ids in config.json), evaluate
    on 2 ranks = the run's own last evaluation, greedy generate the same from the run and the export."""
    import json
    import transformers
    from safetensors.numpy import load_file
    runs = {}
    for name, stop in (("straight", 0), ("resumed", 3)):
        os.makedirs(tmp_path / name)
        cfg = write_config(tmp_path / name / "c.yaml", byte_dataset, **{
            "model": {"builtin": "llama", "llama": TINY}, "train.max_steps": 6, "train.stop_at": stop,
            "train.eval_every": 3, "train.eval_steps": 2, "checkpoint": {"every": 3}})
        mpirun(2, "--config", cfg)
        if stop:
            mpirun(2, "resume", str(tmp_path / name / "run"), "--set", "train.stop_at=0")
        runs[name] = str(tmp_path / name / "run")
    final = [load_file(os.path.join(r, "checkpoints", "6", "model.safetensors")) for r in runs.values()]
    assert set(final[0]) == set(final[1]) and all(np.array_equal(final[0][k], final[1][k]) for k in final[0])
    train, evals = read_metrics(runs["resumed"])
    assert train[6]["loss"] < train[1]["loss"] and set(evals) >= {3, 6}
    run_dir = runs["resumed"]

    onnx_out, kv_out, hf_out = (os.path.join(run_dir, n) for n in ("m.onnx", "kv.onnx", "hf"))
    assert "max |logits - eval graph|" in run([TRAINRUN, "export", run_dir, "--output", onnx_out], check=0).stdout
    assert "attention cache" in run([TRAINRUN, "export", run_dir, "--kv-cache", "--output", kv_out], check=0).stdout
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", hf_out], check=0)
    config = json.load(open(os.path.join(hf_out, "config.json")))
    assert (config["architectures"], config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == \
        (["LlamaForCausalLM"], 1, 256, 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
    ids = np.random.default_rng(2).integers(0, 257, (2, 32))
    ours = ort.InferenceSession(onnx_out, providers=["CPUExecutionProvider"]).run(["logits"], {"input_ids": ids})[0]
    with torch.no_grad():
        assert relative(ours, hf(torch.from_numpy(ids)).logits.numpy()) < 1e-5

    out = str(tmp_path / "e.json")
    run([MPIRUN, "-np", "2", TRAINRUN, "evaluate", run_dir, "--data", os.path.join(byte_dataset, "eval"),
         "--batch", "8", "--steps", "2", "--output", out], check=0)
    assert json.load(open(out))["loss"] == pytest.approx(evals[6]["eval_loss"], rel=1e-5)

    greedy = ["--prompt", "def f(", "--max-new-tokens", "12", "--temperature", "0"]
    texts = [run([TRAINRUN, "generate", src, *greedy], check=0).stdout for src in (run_dir, kv_out, onnx_out)]
    assert texts[0].startswith("def f(") and len(set(texts)) == 1, texts


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.torch
def test_init_from_a_half_precision_folder_reads_it_as_float32(tmp_path, dtype):
    """A folder saved in bfloat16 or float16 (as released checkpoints are): the prepared weights are its
    values, exactly, in float32."""
    from safetensors.numpy import load_file
    shape = VARIANTS["smollm2_tied"]
    hf = hf_model(shape, random_weights(shape, 4)).to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path / "pre")
    cfg = C.from_dict({"model": {"builtin": "llama", "init_from": str(tmp_path / "pre")}, "data": {"seq_len": 16},
                       "run": {"output_dir": str(tmp_path / "run")}})
    prepare(cfg)
    ours = load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))
    state = {k: v.float().numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(state) and all(np.array_equal(ours[k], state[k]) for k in state)


@pytest.mark.parametrize("variant", ["llama3_gqa", "qwen2_bias"])
@pytest.mark.torch
def test_sequence_classification_matches_transformers(variant):
    """model.task sequence_classification: the last token's state (input_mask's last one) -> score (no
    bias); logits and loss = <Model>ForSequenceClassification's (which finds the last token that is not
    pad_token_id 0) on right-padded rows."""
    import transformers
    from trainrun.models import registry
    shape = VARIANTS[variant]
    cfg = C.from_dict({"model": {"builtin": "llama", "llama": shape, "task": "sequence_classification",
                                 "num_labels": 3}, "data": {"seq_len": 16}})
    family = registry.of(cfg.model)
    assert family.transformers.optional == ("score.",) and "lm_head.weight" not in family.param_specs(cfg.model.llama)
    weights = {n: w for n, w in random_weights(shape, 6).items() if n != "lm_head.weight"}
    weights["score.weight"] = np.random.default_rng(1).normal(0, 0.3, (3, shape["hidden_size"])).astype(np.float32)
    batch = family.sample_batch(cfg.model.llama, np.random.default_rng(0))
    out = loss_graph_outputs(cfg, weights, batch)
    body = {k: v for k, v in weights.items() if k != "score.weight"}
    causal = hf_model(shape, {**body, "lm_head.weight": weights["model.embed_tokens.weight"]})   # its config
    config = causal.config
    config.num_labels, config.pad_token_id = 3, 0
    cls = {"llama": transformers.LlamaForSequenceClassification,
           "qwen2": transformers.Qwen2ForSequenceClassification}[shape["model_type"]]
    hf = cls(config).eval()
    loaded = hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
    assert not loaded.unexpected_keys and not loaded.missing_keys, loaded
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(batch["input_ids"]), attention_mask=torch.from_numpy(batch["input_mask"]),
                 labels=torch.from_numpy(batch["labels"]))
    assert relative(out["logits"], ref.logits.numpy()) < 1e-5
    assert float(out["loss"]) == pytest.approx(ref.loss.item(), rel=1e-5)


@pytest.mark.torch
def test_a_classifier_fine_tuned_from_a_causal_lm_folder_trains_and_exports(tmp_path, labelled):
    """A LlamaForCausalLM folder as model.init_from of a sequence_classification run (its lm_head left
    out, score fresh) on `trainrun-data labelled` topics: it learns them; the export loads with
    AutoModelForSequenceClassification (LlamaForSequenceClassification, the data's label names), its
    logits the ONNX export's."""
    import transformers
    from safetensors.numpy import load_file
    shape = dict(VARIANTS["llama3_gqa"], vocab_size=160, max_position_embeddings=16)
    causal = hf_model(shape, random_weights(shape, 8))
    causal.save_pretrained(tmp_path / "pre")
    cfg_path = write_config(tmp_path / "c.yaml", labelled["cls"], **{
        "model": {"builtin": "llama", "init_from": str(tmp_path / "pre"), "task": "sequence_classification",
                  "num_labels": 3}, "data.seq_len": 16, "train.max_steps": 32, "train.eval_every": 32,
        "train.eval_steps": 6})
    run([TRAINRUN, "train", "--config", cfg_path], check=0)
    run_dir = str(tmp_path / "run")
    prepared = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
    state = causal.state_dict()
    assert set(prepared) == set(state) - {"lm_head.weight"} | {"score.weight"}
    assert all(np.array_equal(prepared[k], state[k].numpy()) for k in prepared if k != "score.weight")
    _, evals = read_metrics(run_dir)
    assert evals[32]["eval_loss"] < np.log(3) - 0.3 and evals[32]["eval_f1"] >= 0.8, evals[32]
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", str(tmp_path / "hf")], check=0)
    run([TRAINRUN, "export", run_dir, "--output", str(tmp_path / "m.onnx")], check=0)
    auto = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(auto).__name__ == "LlamaForSequenceClassification" and auto.config.id2label[2] == "sport"
    b = {"input_ids": np.array([[5, 9, 14, 22, 0, 0], [7, 3, 30, 11, 12, 40]], np.int64),
                        "input_mask": np.array([[1, 1, 1, 1, 0, 0], [1] * 6], np.int64)}
    with torch.no_grad():
        logits = auto(input_ids=torch.from_numpy(b["input_ids"]),
                      attention_mask=torch.from_numpy(b["input_mask"])).logits.numpy()
    exported = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert relative(exported.run(["logits"], b)[0], logits) < 1e-5


@pytest.mark.torch
def test_bad_llama_sections_exit_2_naming_each_key(tmp_path, byte_dataset):
    """model.llama's own checks, all reported at once, each with its key; and a section given beside an
    init_from folder that disagrees with its config.json."""
    bad = dict(VARIANTS["qwen2_bias"], vocab_size=300, num_key_value_heads=3, attention_bias=False,
               rope_scaling={"rope_type": "yarn", "factor": 4.0}, sliding_window=16)
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, model={"builtin": "llama", "llama": bad})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    for says in ("model.llama.num_key_value_heads: must divide num_attention_heads (4), got 3",
                 "model.llama.attention_bias: qwen2 has q/k/v biases: set it true",
                 "model.llama.rope_scaling: rope_type 'yarn' is not one of: default, linear, llama3",
                 "model.llama.sliding_window: a window is built for mistral only, not qwen2"):
        assert says in p.stderr, (says, p.stderr)
    odd = dict(VARIANTS["llama3_gqa"], vocab_size=300, head_dim=None, hidden_size=66,
               rope_scaling={"rope_type": "linear"})
    cfg = write_config(tmp_path / "d.yaml", byte_dataset, model={"builtin": "llama", "llama": odd})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert "model.llama.num_attention_heads: must divide hidden_size (66), got 4 (or give head_dim)" in p.stderr
    assert "model.llama.rope_scaling: rope_type linear needs factor (numbers)" in p.stderr

    shape = dict(VARIANTS["smollm2_tied"], vocab_size=300)
    hf_model(shape, random_weights(shape, 1)).save_pretrained(tmp_path / "pre")
    cfg = write_config(tmp_path / "e.yaml", byte_dataset, model={
        "builtin": "llama", "init_from": str(tmp_path / "pre"), "llama": dict(shape, num_key_value_heads=1)})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    assert f"model.llama.num_key_value_heads: 1, but model.init_from's {tmp_path / 'pre' / 'config.json'} says 3" \
        in p.stderr


@pytest.mark.torch
def test_config_json_fields_the_family_does_not_build_exit_2_naming_each(tmp_path, byte_dataset):
    """A folder's config.json that asks for math the family does not build (another activation, attention
    dropout, the sliced projections of pretraining_tp, a rope scaling other than linear/llama3) is refused
    with each field and its value named, instead of a silu model without them."""
    import json
    shape = dict(VARIANTS["smollm2_tied"], vocab_size=300)
    hf_model(shape, random_weights(shape, 1)).save_pretrained(tmp_path / "pre")
    file = tmp_path / "pre" / "config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps(dict(config, hidden_act="gelu", attention_dropout=0.1, pretraining_tp=2)))
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, model={"builtin": "llama", "init_from": str(tmp_path / "pre")})
    p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    for says in (f"model.init_from: {file}: hidden_act 'gelu' is not built (the MLP is SwiGLU: silu only)",
                 f"model.init_from: {file}: attention_dropout 0.1 is not built (no dropout: 0 only)",
                 f"model.init_from: {file}: pretraining_tp 2 is not built (1 only)"):
        assert says in p.stderr, (says, p.stderr)
    for rope in ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                 {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
                 {"rope_type": "dynamic", "factor": 2.0}):
        kind = rope.get("rope_type") or rope.get("type")
        rewritten = {k: v for k, v in config.items() if k != "rope_parameters"}
        file.write_text(json.dumps(dict(rewritten, rope_theta=10000.0, rope_scaling=rope)))
        p = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
        assert f"model.llama.rope_scaling: rope_type {kind!r} is not one of: default, linear, llama3" in p.stderr, \
            p.stderr
    file.write_text(json.dumps(dict(config, hidden_act="silu", attention_dropout=0.0, pretraining_tp=1)))
    run([TRAINRUN, "config", "validate", "--config", cfg], check=0)
