"""`trainrun generate` and the attention-cache graph (`export --kv-cache`): cache vs full passes,
greedy tokens vs transformers' generate, the command on a real run from each kind of source."""

import os

import numpy as np
import onnxruntime as ort
import pytest

from conftest import TRAINRUN, hf_gpt2, run, write_config
from trainrun.config import GPT2Config
from trainrun.commands.generate import Decoder, generate
from trainrun.models.gpt2 import build_gpt2, init_weights

SHAPE = {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 48, "vocab_size": 300}


def _weights(seed=0):
    """GPT-2 initialisation with the token embedding and the blocks' matrices scaled up: logits of a few
    units (the greedy choice decided by clear margins, not by float rounding), and blocks that outweigh
    the residual stream (at the plain initialisation the model repeats its last token)."""
    w = init_weights(GPT2Config(**SHAPE), seed)
    for name in w:
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            w[name] *= 30
    w["transformer.wte.weight"] *= 10
    return w


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_cache_passes_equal_one_full_pass():
    cfg, w = GPT2Config(**SHAPE), _weights()
    full = _session(build_gpt2(cfg, w))
    cached = Decoder(_session(build_gpt2(cfg, w, kv_cache=True)), cfg.n_positions)
    assert cached.kv and len(cached.past) == 2 * cfg.n_layer
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 30).tolist()
    ref = full.run(["logits"], {"input_ids": np.array([ids], np.int64)})[0][0]
    steps = [cached.start(ids[:7])] + [cached.next(t) for t in ids[7:]]     # one pass of 7, then 23 of 1
    assert np.abs(np.stack(steps) - ref[6:]).max() <= 1e-4
    assert cached.cache[0].shape == (1, cfg.n_head, 30, cfg.n_embd // cfg.n_head)
    # a batch of 3 rows through the cache: the same as each row alone
    batch = np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 12))
    past = {i.name: np.zeros((3, cfg.n_head, 0, cfg.n_embd // cfg.n_head), np.float32)
            for i in cached.session.get_inputs() if i.name.startswith("past.")}
    out = cached.session.run(None, {"input_ids": batch, **past})
    for r in range(3):
        alone = full.run(["logits"], {"input_ids": batch[r:r + 1]})[0][0]
        assert np.abs(out[0][r] - alone).max() <= 1e-4


@pytest.mark.torch
def test_greedy_tokens_equal_transformers_generate():
    import torch
    w = _weights(0)
    hf = hf_gpt2(SHAPE, w).eval()
    prompt = [5, 17, 250, 3]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    theirs = out.sequences[0, len(prompt):].tolist()
    margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
    decoder = Decoder(_session(build_gpt2(GPT2Config(**SHAPE), w, kv_cache=True)), SHAPE["n_positions"])
    ours = generate(decoder, prompt, 40, np.random.default_rng(0), temperature=0)
    # equal up to the first step whose best two logits are closer than float32 noise could move them
    close = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))
    assert close >= 10, margins
    assert ours[:close + 1] == theirs[:close + 1]
    assert len(ours) == 40
    # the window is the limit: 48 positions - 4 prompt tokens
    assert len(generate(decoder, prompt, 100, np.random.default_rng(0), temperature=0)) == 44
    # stops right after the end-of-document token
    j = next(j for j in range(2, 40) if ours[j] not in ours[:j])
    assert generate(decoder, prompt, 40, np.random.default_rng(0), temperature=0, eos_id=ours[j]) == ours[:j + 1]


def test_sampling_follows_the_seed_and_top_k():
    decoder = Decoder(_session(build_gpt2(GPT2Config(**SHAPE), _weights(4), kv_cache=True)), SHAPE["n_positions"])
    a = generate(decoder, [1, 2], 30, np.random.default_rng(7), temperature=1.0, top_k=5)
    b = generate(decoder, [1, 2], 30, np.random.default_rng(7), temperature=1.0, top_k=5)
    assert a == b
    # top-k 1 and top-p near 0 are greedy whatever the seed
    greedy = generate(decoder, [1, 2], 30, np.random.default_rng(0), temperature=0)
    assert generate(decoder, [1, 2], 30, np.random.default_rng(9), temperature=2.0, top_k=1) == greedy
    assert generate(decoder, [1, 2], 30, np.random.default_rng(9), temperature=2.0, top_p=1e-6) == greedy


@pytest.fixture(scope="module")
def trained(tmp_path_factory, byte_dataset):
    root = tmp_path_factory.mktemp("gen")
    cfg = write_config(root / "c.yaml", byte_dataset, **{"train.max_steps": 6, "checkpoint": {"every": 6},
                                                         "model.gpt2.vocab_size": 257})
    run([TRAINRUN, "--config", cfg], check=0)
    return str(root / "run")


def test_generate_command_from_a_run_a_checkpoint_and_both_exports(trained, tmp_path):
    kv, plain = os.path.join(trained, "kv.onnx"), os.path.join(trained, "plain.onnx")   # beside the run's tokenizer
    p = run([TRAINRUN, "export", trained, "--kv-cache", "--output", kv], check=0)
    assert "attention cache" in p.stdout
    run([TRAINRUN, "export", trained, "--output", plain], check=0)
    greedy = ["--prompt", "def f(", "--max-new-tokens", "12", "--temperature", "0"]
    outs = [run([TRAINRUN, "generate", src, *greedy], check=0).stdout
            for src in [trained, os.path.join(trained, "checkpoints", "6"), kv, plain]]
    assert outs[0].startswith("def f(") and len(set(outs)) == 1, outs
    sampled = ["--prompt", "class ", "--max-new-tokens", "20", "--seed", "4", "--top-k", "20", "--top-p", "0.9",
               "--temperature", "0.8", "--num-samples", "2"]
    a = run([TRAINRUN, "generate", trained, *sampled], check=0).stdout
    assert a == run([TRAINRUN, "generate", trained, *sampled], check=0).stdout
    assert a.count("---- sample") == 2


def test_generate_refuses_what_it_cannot_do(trained, tmp_path):
    (tmp_path / "bad.json").write_text("{")
    p = run([TRAINRUN, "generate", trained, "--prompt", "x", "--tokenizer", str(tmp_path / "bad.json")], check=2)
    assert "not a readable tokenizer.json" in p.stderr
    run([TRAINRUN, "export", trained, "--output", str(tmp_path / "m.onnx")], check=0)
    p = run([TRAINRUN, "generate", str(tmp_path / "m.onnx"), "--prompt", "x"], check=2)    # no run beside it
    assert "--tokenizer" in p.stderr
    p = run([TRAINRUN, "export", trained, "--kv-cache", "--with-loss", "--output", str(tmp_path / "x.onnx")], check=2)
    assert "exclude" in p.stderr


def test_generate_refuses_a_file_that_is_not_an_onnx_model(trained, tmp_path):
    cfg = os.path.join(os.path.dirname(trained), "c.yaml")          # the run's config, not a model
    p = run([TRAINRUN, "generate", cfg, "--prompt", "x"], check=2)
    assert f"{cfg}: not an ONNX model" in p.stderr and "SOURCE is an exported model.onnx" in p.stderr
    assert "Traceback" not in p.stderr


def test_empty_prompt_samples_from_the_end_of_document_token(trained):
    """No prompt (or an empty one): unconditional samples, the text after the end-of-document token."""
    from trainrun.hf import tokenizer as T
    from trainrun.commands.generate import load_source
    greedy = ["--max-new-tokens", "12", "--temperature", "0"]
    out = run([TRAINRUN, "generate", trained, "--prompt", "", *greedy], check=0).stdout
    assert out == run([TRAINRUN, "generate", trained, *greedy], check=0).stdout
    decoder, run_dir = load_source(trained)
    text = T.for_run(run_dir)
    assert text.eos_id is not None
    new = generate(decoder, [text.eos_id], 12, np.random.default_rng(0), temperature=0, eos_id=text.eos_id)
    assert out == text.decode(new) + "\n" and len(new) > 1


def test_generate_help_describes_every_option():
    import click
    from trainrun.cli import generate as command
    text = run([TRAINRUN, "generate", "--help"], check=0).stdout
    assert "SOURCE is a model.onnx" in text
    options = [p for p in command.params if isinstance(p, click.Option)]
    assert len(options) == 8
    for option in options:
        assert option.help, option.name
        assert option.opts[0] in text and option.help.split()[0] in text


def test_samples_during_training_leave_the_training_numbers_unchanged(tmp_path, byte_dataset):
    import struct
    from tensorboardX.proto import event_pb2
    from conftest import mpirun, read_metrics
    # a frozen weight too: the samples read it as training does, from the engine's frozen buffer
    common = {"train.max_steps": 6, "train.eval_every": 3, "model.gpt2.vocab_size": 257,
              "model.frozen": ["transformer.wpe.weight"], "tensorboard": {"enabled": True}}
    runs = {}
    for name, extra in (("plain", {}), ("sampled", {"train.sample_every": 3, "train.sample_prompt": "def f"})):
        os.makedirs(tmp_path / name)
        cfg = write_config(tmp_path / name / "c.yaml", byte_dataset, **common, **extra)
        runs[name] = mpirun(2, "--config", cfg).stdout
    assert "sample at step" not in runs["plain"]
    assert runs["sampled"].count("sample at step") == 2 and "\ndef f" in runs["sampled"]
    a_train, a_eval = read_metrics(str(tmp_path / "plain" / "run"))
    b_train, b_eval = read_metrics(str(tmp_path / "sampled" / "run"))
    keys = ("loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in a_train.values()] == [[r[k] for k in keys] for r in b_train.values()]
    assert [r["eval_loss"] for r in a_eval.values()] == [r["eval_loss"] for r in b_eval.values()]
    texts = {}
    for f in os.listdir(tmp_path / "sampled" / "run" / "tensorboard"):
        data = open(tmp_path / "sampled" / "run" / "tensorboard" / f, "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            for v in event.summary.value:
                if v.tag.startswith("samples"):
                    texts[event.step] = v.tensor.string_val[0].decode()
            i += 12 + n + 4
    assert sorted(texts) == [3, 6] and all("def f" in t for t in texts.values())
    # the frozen weight left as it started (the graphs' frozen.safetensors), bit for bit, in the export
    from safetensors.numpy import load_file
    import onnx
    from onnx import numpy_helper
    start = load_file(str(tmp_path / "sampled" / "run" / "graphs" / "frozen.safetensors"))
    assert list(start) == ["transformer.wpe.weight"]
    exported = {t.name: numpy_helper.to_array(t) for t in
                onnx.load(str(tmp_path / "sampled" / "run" / "model.onnx")).graph.initializer}
    np.testing.assert_array_equal(exported["transformer.wpe.weight"], start["transformer.wpe.weight"])
    # a model without a GPT-2 tokenizer cannot be sampled: refused before training
    os.makedirs(tmp_path / "bad")
    cfg = write_config(tmp_path / "bad" / "c.yaml", byte_dataset, **common, **{
        "train.sample_every": 3, "model": {"builtin": "bert"}})
    p = mpirun(2, "--config", cfg, check=2)
    assert "train.sample_every" in p.stderr and "samples need model.builtin gpt2" in p.stderr
