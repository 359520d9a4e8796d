"""`trainrun export --format transformers`: a real run's checkpoint loaded by transformers (offline, in a
fresh process), its logits against the ONNX export, its tokenizer against the dataset's, and read back by
model.init_from."""

import json
import os
import sys

import numpy as np
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file

from conftest import TRAINRUN, TRAINRUN_DATA, run, synthetic_text_dir, write_config

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/nonexistent-hf-home"}
TEXT = "def load(path):\n    return open(path).read()  # caf\u00e9"

LOAD_GPT2 = """
import sys, json, numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, text, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d).eval()
ids = tok(text)["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits.numpy()
np.save(out, logits)
print(json.dumps({"class": type(model).__name__, "ids": ids, "eos": tok.eos_token, "eos_id": tok.eos_token_id,
                  "gen_eos": model.generation_config.eos_token_id, "decoded": tok.decode(ids)}))
"""

LOAD_BERT = """
import sys, json, numpy as np, torch
from transformers import AutoTokenizer, BertForPreTraining
d, text, batch, out = sys.argv[1:5]
tok = AutoTokenizer.from_pretrained(d)
model = BertForPreTraining.from_pretrained(d).eval()
b = dict(np.load(batch))
labels = np.full(b["input_ids"].shape, -100, np.int64)     # the used prediction slots' ids at their positions
for row, (pos, ids) in enumerate(zip(b["masked_lm_positions"], b["masked_lm_ids"])):
    labels[row, pos[ids != 0]] = ids[ids != 0]
with torch.no_grad():
    o = model(input_ids=torch.from_numpy(b["input_ids"]), token_type_ids=torch.from_numpy(b["segment_ids"]),
              attention_mask=torch.from_numpy(b["input_mask"]), labels=torch.from_numpy(labels),
              next_sentence_label=torch.from_numpy(b["next_sentence_labels"]))
pos = torch.from_numpy(b["masked_lm_positions"])
mlm = torch.gather(o.prediction_logits, 1, pos[:, :, None].expand(-1, -1, o.prediction_logits.shape[-1]))
np.savez(out, mlm=mlm.numpy(), every=o.prediction_logits.numpy(), nsp=o.seq_relationship_logits.numpy(),
         loss=o.loss.numpy())
print(json.dumps({"class": type(model).__name__, "ids": tok(text)["input_ids"], "cls": tok.cls_token,
                  "pair_types": tok(text, text)["token_type_ids"],
                  "mask_id": tok.mask_token_id, "pad_id": tok.pad_token_id}))
"""


def _train(tmp_path, data_dir, **over):
    cfg = write_config(tmp_path / "c.yaml", data_dir, **{"train.max_steps": 4, "checkpoint": {"every": 4},
                                                         **over})
    run([TRAINRUN, "--config", cfg], check=0)
    return str(tmp_path / "run")


def _init_from_matches(tmp_path, data_dir, hf_dir, ckpt, **over):
    """model.init_from: DIR starts a fresh run at exactly the checkpoint's weights."""
    os.makedirs(tmp_path / "again")
    cfg = write_config(tmp_path / "again" / "c.yaml", data_dir, **{**over, "model.init_from": hf_dir})
    run([TRAINRUN, "prepare", "--config", cfg], check=0)
    again = load_file(str(tmp_path / "again" / "run" / "graphs" / "weights.safetensors"))
    final = load_file(os.path.join(ckpt, "model.safetensors"))
    assert set(again) == set(final)
    for name in final:
        assert np.array_equal(again[name], final[name]), name


@pytest.mark.torch
def test_gpt2_loads_in_transformers_offline_and_matches_the_onnx_export(tmp_path, bpe_dataset):
    from tokenizers import Tokenizer
    model = {"builtin": "gpt2", "gpt2": {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32,
                                         "vocab_size": 384}}
    run_dir = _train(tmp_path, bpe_dataset, model=model)
    # the run recorded its dataset's tokenizer
    with open(os.path.join(bpe_dataset, "tokenizer.json"), "rb") as a, open(os.path.join(run_dir, "tokenizer.json"),
                                                                              "rb") as b:
        assert a.read() == b.read()
    run([TRAINRUN, "export", run_dir, "--output", str(tmp_path / "m.onnx")], check=0)
    hf_dir = str(tmp_path / "hf")
    p = run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", hf_dir], check=0)
    assert "GPT2LMHeadModel" in p.stdout
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= set(os.listdir(hf_dir))
    # refused: the same directory again, nothing changed
    before = sorted(os.listdir(hf_dir))
    p = run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", hf_dir], check=2)
    assert "already exists" in p.stderr and sorted(os.listdir(hf_dir)) == before

    # from tmp_path: `python -c` puts its working directory first on sys.path, and the checkout's kernels/ would
    # shadow the `kernels` distribution transformers imports (tests/conftest.py)
    p = run([sys.executable, "-c", LOAD_GPT2, hf_dir, TEXT, str(tmp_path / "logits.npy")], check=0, env=OFFLINE,
            cwd=tmp_path)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["class"] == "GPT2LMHeadModel"
    tok = Tokenizer.from_file(os.path.join(bpe_dataset, "tokenizer.json"))
    assert got["ids"] == tok.encode(TEXT).ids and got["decoded"] == TEXT
    eos = tok.token_to_id("<|endoftext|>")
    assert got["eos"] == "<|endoftext|>" and got["eos_id"] == eos and got["gen_eos"] == eos
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    ref = sess.run(["logits"], {"input_ids": np.array([got["ids"]], np.int64)})[0]
    hf = np.load(tmp_path / "logits.npy")
    assert hf.shape == ref.shape and np.abs(hf - ref).max() <= 1e-4
    _init_from_matches(tmp_path, bpe_dataset, hf_dir, os.path.join(run_dir, "checkpoints", "4"), model=model)
    # another tokenizer.json named by hand goes with the model instead of the run's
    other = tmp_path / "other.json"
    tok.add_special_tokens(["<|pad|>"])
    tok.save(str(other))
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--tokenizer", str(other),
         "--output", str(tmp_path / "hf2")], check=0)
    assert (tmp_path / "hf2" / "tokenizer.json").read_bytes() == other.read_bytes()


@pytest.mark.torch
def test_bert_loads_as_bert_for_pretraining_and_matches_the_onnx_export(tmp_path):
    from tokenizers import Tokenizer
    from trainrun.config import BertConfig
    from trainrun.models.bert import sample_inputs
    synthetic_text_dir(str(tmp_path / "text"), max_bytes=60_000, seed=2)
    data = str(tmp_path / "data")
    run([TRAINRUN_DATA, "bert", "--input", str(tmp_path / "text"), "--output", data, "--train-wordpiece", "300",
         "--seq-len", "32", "--max-predictions", "5", "--eval-fraction", "0.1", "--no-progress"], check=0)
    shape = {"vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, "max_position_embeddings": 32}
    model = {"builtin": "bert", "bert": shape}
    run_dir = _train(tmp_path, data, model=model, **{"data.seq_len": 32})
    run([TRAINRUN, "export", run_dir, "--output", str(tmp_path / "m.onnx")], check=0)
    hf_dir = str(tmp_path / "hf")
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", hf_dir], check=0)

    batch = sample_inputs(BertConfig(**shape), 4, 32, 5, np.random.default_rng(0))
    np.savez(tmp_path / "batch.npz", **batch)
    p = run([sys.executable, "-c", LOAD_BERT, hf_dir, "x = [y]", str(tmp_path / "batch.npz"),
             str(tmp_path / "hf.npz")], check=0, env=OFFLINE, cwd=tmp_path)     # from tmp_path: as above
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["class"] == "BertForPreTraining"
    tok = Tokenizer.from_file(os.path.join(data, "tokenizer.json"))
    ids = tok.encode("x = [y]", add_special_tokens=False).ids        # as a sample holds it: [CLS] A [SEP] B [SEP]
    assert got["ids"] == [tok.token_to_id("[CLS]"), *ids, tok.token_to_id("[SEP]")]
    assert got["pair_types"] == [0] * (len(ids) + 2) + [1] * (len(ids) + 1)
    assert got["cls"] == "[CLS]" and got["mask_id"] == tok.token_to_id("[MASK]") and got["pad_id"] == 0
    # an inference model: the model's inputs (masked positions optional), its logits only
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "segment_ids", "input_mask"]
    assert [i.name for i in sess.get_overridable_initializers()] == ["masked_lm_positions"]
    assert [o.name for o in sess.get_outputs()] == ["prediction_logits", "seq_relationship_logits"]
    inputs = {n: batch[n] for n in ("input_ids", "segment_ids", "input_mask")}
    mlm, nsp = sess.run(None, {**inputs, "masked_lm_positions": batch["masked_lm_positions"]})
    every, nsp_every = sess.run(None, inputs)
    hf = np.load(tmp_path / "hf.npz")
    used = batch["masked_lm_ids"] != 0        # unused prediction slots point at position 0: compared too
    assert used.any() and mlm.shape == hf["mlm"].shape and np.abs(hf["mlm"] - mlm).max() <= 1e-4
    assert every.shape == hf["every"].shape == (4, 32, 300) and np.abs(hf["every"] - every).max() <= 1e-4
    assert np.abs(hf["nsp"] - nsp).max() <= 1e-4 and np.abs(hf["nsp"] - nsp_every).max() <= 1e-4
    # --with-loss keeps the loss (and takes the labels): transformers' loss of the same batch
    run([TRAINRUN, "export", run_dir, "--with-loss", "--output", str(tmp_path / "loss.onnx")], check=0)
    sess = ort.InferenceSession(str(tmp_path / "loss.onnx"), providers=["CPUExecutionProvider"])
    assert {"masked_lm_ids", "next_sentence_labels"} <= {i.name for i in sess.get_inputs()}
    loss, = sess.run(["loss"], batch)
    assert float(loss) == pytest.approx(float(hf["loss"]), rel=1e-5)
    _init_from_matches(tmp_path, data, hf_dir, os.path.join(run_dir, "checkpoints", "4"), model=model,
                       **{"data.seq_len": 32})
