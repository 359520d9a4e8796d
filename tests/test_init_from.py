"""model.init_from: transformers save_pretrained directories, .safetensors files and trainrun checkpoints."""

import json
import os
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, TRAINRUN, TRAINRUN_DATA, mpirun, read_metrics, run, synthetic_text_dir, write_config
from test_bert import hf_forward
from test_data_tools import expected_split
from trainrun.models.bert import sample_inputs
from trainrun import config as C

torch = pytest.importorskip("torch", reason="needs torch (the test extra), not installed here")

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reference as R  # noqa: E402

GPT2 = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=257)
BERT = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=40)


def pretrained_gpt2(path, seed=0, eos=0, **shape):
    """A 'pretrained' GPT-2: transformers' own random initialisation, saved as save_pretrained does."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**{**GPT2, **shape}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=eos, eos_token_id=eos)).eval()
    model.save_pretrained(path)
    return model


def gpt2_tokenizer_json(texts, path, vocab_size):
    """A byte-level BPE laid out as GPT-2's tokenizer.json: merges as "a b" strings, no subword prefix or
    suffix, <|endoftext|> the last id (GPT-2's 50256), ByteLevel pre-tokenizer, post-processor and decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())
    model = spec["model"]
    assert len(model["vocab"]) == vocab_size - 1
    model["merges"] = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    model.update(continuing_subword_prefix="", end_of_word_suffix="")
    model["vocab"]["<|endoftext|>"] = vocab_size - 1
    spec["added_tokens"] = [{"id": vocab_size - 1, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": True, "special": True}]
    path.write_text(json.dumps(spec))
    return Tokenizer.from_file(str(path))


def test_gpt2_from_save_pretrained_fills_the_shape_and_starts_at_its_loss(tmp_path):
    """docs/models.md's walk-through: a pretrained GPT-2 directory and its own tokenizer.json (GPT-2's layout)
    -> `trainrun-data tokens --tokenizer` -> `model.init_from`: the first loss is transformers'."""
    vocab = 320
    text = synthetic_text_dir(str(tmp_path / "text"), max_bytes=60_000)
    docs = [open(os.path.join(text, f), encoding="utf-8").read() for f in sorted(os.listdir(text))]
    hf = pretrained_gpt2(tmp_path / "pre", eos=vocab - 1, vocab_size=vocab)
    tok = gpt2_tokenizer_json(docs, tmp_path / "pre" / "tokenizer.json", vocab)
    data = tmp_path / "data"
    run([TRAINRUN_DATA, "tokens", "--input", text, "--output", str(data), "--tokenizer",
         str(tmp_path / "pre" / "tokenizer.json"), "--eval-fraction", "0.1", "--no-progress"], check=0)
    train_docs, _ = expected_split([(f, d.encode()) for f, d in zip(sorted(os.listdir(text)), docs)], 0.1)
    want = [i for d in train_docs for i in tok.encode(d.decode(), add_special_tokens=False).ids + [vocab - 1]]
    assert np.array_equal(R.token_stream(str(data / "train")), want)      # the library's own ids
    cfg_path = write_config(tmp_path / "c.yaml", str(data), **{
        "model": {"builtin": "gpt2", "init_from": str(tmp_path / "pre")},     # no model.gpt2: from config.json
        "train.max_steps": 2, "run.seed": 3})
    shape = {k: getattr(C.load_config(cfg_path).model.gpt2, k) for k in GPT2}
    assert shape == {**GPT2, "vocab_size": vocab}
    mpirun(2, "--config", cfg_path)
    ours = load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))
    state = hf.state_dict()
    assert set(ours) == {k for k in state if k != "lm_head.weight" and not k.endswith(".attn.bias")}
    for name, value in ours.items():
        assert np.array_equal(value, state[name].numpy()), name
    train, _ = read_metrics(str(tmp_path / "run"))
    ids, labels = next(R.global_batches(str(data / "train"), 32, 8, 3))
    with torch.no_grad():
        logits = hf(torch.from_numpy(ids)).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(labels).reshape(-1)).item()
    assert train[1]["loss"] == pytest.approx(ref, rel=1e-4)

    # a trainrun run directory as init_from: its latest checkpoint's weights, a fresh run
    os.makedirs(tmp_path / "d")
    cfg2 = write_config(tmp_path / "d" / "c.yaml", str(data), **{
        "model": {"builtin": "gpt2", "gpt2": {**GPT2, "vocab_size": vocab}, "init_from": str(tmp_path / "run")},
        "train.max_steps": 1})
    run([TRAINRUN, "prepare", "--config", cfg2], check=0)
    again = load_file(str(tmp_path / "d" / "run" / "graphs" / "weights.safetensors"))
    final = load_file(str(tmp_path / "run" / "checkpoints" / "2" / "model.safetensors"))
    assert set(again) == set(final) and all(np.array_equal(again[k], final[k]) for k in final)


def test_bert_from_a_base_model_file_and_from_pretraining_weights(tmp_path):
    from transformers import BertConfig, BertForPreTraining
    torch.manual_seed(1)
    hf = BertForPreTraining(BertConfig(**BERT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    hf.save_pretrained(tmp_path / "pre")
    hf.bert.save_pretrained(tmp_path / "base")          # BertModel: no 'bert.' prefix, no cls.* heads
    state = {k: v.numpy() for k, v in hf.state_dict().items()}

    def prepared(init_from, **bert):
        cfg = C.from_dict({"model": {"builtin": "bert", "init_from": str(init_from), **({"bert": bert} if bert else {})},
                           "data": {"seq_len": 16}, "run": {"output_dir": str(tmp_path / "run"), "seed": 4}})
        from trainrun.graphs.manifest import prepare
        prepare(cfg)
        return cfg, load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))

    cfg, ours = prepared(tmp_path / "pre")
    assert {k: getattr(cfg.model.bert, k) for k in BERT} == BERT
    for name, value in ours.items():
        assert np.array_equal(value, state[name]), name
    # first loss = transformers' on the same batch, through the prepared eval graph
    import onnxruntime as ort
    sess = ort.InferenceSession(str(tmp_path / "run" / "graphs" / "eval.onnx"), providers=["CPUExecutionProvider"])
    batch = sample_inputs(cfg.model.bert, 3, 16, 4, np.random.default_rng(0))
    (loss,) = sess.run(["loss"], {**batch, **ours})
    with torch.no_grad():
        assert float(loss) == pytest.approx(hf_forward(hf, batch).loss.item(), rel=1e-4)

    _, ours = prepared(tmp_path / "base" / "model.safetensors", **BERT)
    fresh = {k: v for k, v in ours.items() if k.startswith("cls.")}
    assert fresh and all(not np.array_equal(v, state[k]) for k, v in fresh.items() if v.std() > 0)
    for name, value in ours.items():
        if not name.startswith("cls."):
            assert np.array_equal(value, state[name]), name


def test_validate_and_training_check_init_from_before_building(tmp_path, byte_dataset):
    """`config validate` and training's start-up read model.init_from's tensors' names and shapes (the
    .safetensors header), as prepare's loading does: each mismatch named with both shapes, every problem
    at once (exit 2), no graph built."""
    from safetensors.numpy import save_file
    pretrained_gpt2(tmp_path / "pre")
    tensors = load_file(str(tmp_path / "pre" / "model.safetensors"))
    part = str(tmp_path / "part.safetensors")         # without layer 1, and position embeddings of 64
    save_file({k: v for k, v in tensors.items() if ".h.1." not in k}, part)
    cfg_path = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model": {"builtin": "gpt2", "init_from": part, "gpt2": {**GPT2, "n_positions": 32}}})
    for cmd in (["config", "validate"], ["train"]):
        p = run([TRAINRUN, *cmd, "--config", cfg_path], check=2)
        assert (f"model.init_from: 'transformer.wpe.weight' is [64, 32] in {part}, the model's "
                f"'transformer.wpe.weight' is [32, 32]") in p.stderr, p.stderr
        assert f"model.init_from: {part} holds no tensor for 12 parameter(s) of the model: transformer.h.1." in p.stderr
        assert "2 problem(s)" in p.stderr and "Traceback" not in p.stderr
    assert not os.path.exists(tmp_path / "run")
    cfg_path = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model": {"builtin": "gpt2", "init_from": str(tmp_path / "pre" / "model.safetensors"), "gpt2": GPT2}})
    run([TRAINRUN, "config", "validate", "--config", cfg_path], check=0)


def test_init_from_mismatches_are_usage_errors(tmp_path, byte_dataset):
    pretrained_gpt2(tmp_path / "pre")
    cfg_path = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model": {"builtin": "gpt2", "init_from": str(tmp_path / "pre"), "gpt2": {**GPT2, "n_embd": 64}}})
    p = run([TRAINRUN, "prepare", "--config", cfg_path], check=2)
    assert "model.gpt2.n_embd" in p.stderr and "64" in p.stderr and "32" in p.stderr
    # a bare .safetensors file has no config.json: the tensors' shapes are checked instead
    cfg_path = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model": {"builtin": "gpt2", "init_from": str(tmp_path / "pre" / "model.safetensors"),
                  "gpt2": {**GPT2, "n_positions": 32}}})
    p = run([TRAINRUN, "prepare", "--config", cfg_path], check=2)
    assert "'transformer.wpe.weight' is [64, 32]" in p.stderr and "[32, 32]" in p.stderr
    assert not os.path.exists(tmp_path / "run" / "graphs" / "manifest.json")
    cfg_path = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "model": {"builtin": "gpt2", "init_from": str(tmp_path / "nowhere")}})
    p = run([TRAINRUN, "prepare", "--config", cfg_path], check=2)
    assert "model.init_from" in p.stderr and "nowhere" in p.stderr
