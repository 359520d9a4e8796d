"""The built-in BERT (BertForPreTraining as ONNX) against transformers' BertForPreTraining."""

import numpy as np
import onnxruntime as ort
import pytest

from trainrun import config as C
from trainrun.graphs.manifest import prepare
from trainrun.step.engine import Engine, EngineOptions
from trainrun.models.bert import INPUTS, TIED, build_bert, init_weights, param_count, sample_inputs

pytestmark = pytest.mark.graphs      # the graphs a builder writes and their numbers: make test-training and test-py313 run it too

torch = pytest.importorskip("torch", reason="needs torch (the test extra), not installed here")

SHAPES = [
    dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
         max_position_embeddings=24),
    dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
         max_position_embeddings=64, type_vocab_size=3, layer_norm_eps=1e-5),
    dict(vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
         max_position_embeddings=16, hidden_act="gelu_new"),
]
TINY = SHAPES[1]


def hf_bert(shape: dict, weights: dict):
    """transformers' BertForPreTraining (erf GELU unless ``shape`` says, no dropout) holding ``weights``
    (numpy, our names)."""
    from transformers import BertConfig, BertForPreTraining
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    model = BertForPreTraining(BertConfig(**{"hidden_act": "gelu", **shape}, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    result = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
    assert set(result.missing_keys) <= set(TIED) and not result.unexpected_keys, result
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    return model


def hf_forward(model, batch):
    """transformers' outputs for an ORT-layout batch (labels -100 except at the used prediction slots)."""
    ids = batch["input_ids"]
    labels = np.full(ids.shape, -100, np.int64)
    for b in range(len(ids)):
        for pos, tok in zip(batch["masked_lm_positions"][b], batch["masked_lm_ids"][b]):
            if tok != 0:
                labels[b, pos] = tok
    return model(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(batch["segment_ids"]),
                 attention_mask=torch.from_numpy(batch["input_mask"]), labels=torch.from_numpy(labels),
                 next_sentence_label=torch.from_numpy(batch["next_sentence_labels"]))


def bert_cfg(shape, dropout=0.0):
    return C.BertConfig(**shape, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)


@pytest.mark.parametrize("shape", SHAPES)
def test_both_heads_match_transformers(shape):
    cfg = bert_cfg(shape)
    weights = init_weights(cfg, seed=7)
    for w in weights.values():      # non-trivial LayerNorm and bias values, not only the init's 1/0
        w += np.random.default_rng(w.size).normal(0, 0.02, w.shape).astype(np.float32)
    assert param_count(cfg) == sum(w.size for w in weights.values())
    sess = ort.InferenceSession(build_bert(cfg, weights).SerializeToString(), providers=["CPUExecutionProvider"])
    hf = hf_bert(shape, weights).eval()
    rng = np.random.default_rng(0)
    for batch_size, seq, preds in [(1, 4, 2), (3, shape["max_position_embeddings"] // 2, 5),
                                   (2, shape["max_position_embeddings"], 8)]:
        batch = sample_inputs(cfg, batch_size, seq, preds, rng)
        mlm, nsp, loss, hits, used = sess.run(["prediction_logits", "seq_relationship_logits", "bert_loss",
                                               "metric/mlm_accuracy/sum", "metric/mlm_accuracy/count"], batch)
        with torch.no_grad():
            ref = hf_forward(hf, batch)
        at = ref.prediction_logits.numpy()[np.arange(batch_size)[:, None], batch["masked_lm_positions"]]
        assert mlm.shape == at.shape and nsp.shape == (batch_size, 2)
        assert np.abs(mlm - at).max() < 1e-4, (shape, batch_size, seq)
        assert np.abs(nsp - ref.seq_relationship_logits.numpy()).max() < 1e-4
        assert loss == pytest.approx(ref.loss.item(), rel=1e-5)
        valid = batch["masked_lm_ids"] != 0
        assert used == valid.sum()
        assert hits == (valid & (at.argmax(-1) == batch["masked_lm_ids"])).sum()
    # an id past its table fails as transformers' nn.Embedding does (not a silent zero embedding)
    for name, bad in (("input_ids", cfg.vocab_size), ("segment_ids", cfg.type_vocab_size)):
        with pytest.raises(Exception, match="(?i)indice|index"):
            sess.run(["bert_loss"], {**batch, name: np.full_like(batch[name], bad)})


def test_initialisation_is_seeded_and_bert_like():
    cfg = C.BertConfig(vocab_size=2000, hidden_size=128, initializer_range=0.05)
    a, b, c = init_weights(cfg, 1), init_weights(cfg, 1), init_weights(cfg, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    words = "bert.embeddings.word_embeddings.weight"
    assert not np.array_equal(a[words], c[words])
    assert (a[words][0] == 0).all() and a[words][1:].std() == pytest.approx(0.05, rel=0.02)   # [PAD] row 0
    assert a["bert.encoder.layer.1.intermediate.dense.weight"].std() == pytest.approx(0.05, rel=0.02)
    assert (a["bert.encoder.layer.0.output.LayerNorm.weight"] == 1).all() and (a["cls.predictions.bias"] == 0).all()


def test_dropout_masks_in_the_train_graph_only(tmp_path):
    """hidden_dropout_prob / attention_probs_dropout_prob become mask inputs of the train graph where
    transformers places its Dropouts; eval is dropout-free (= transformers' eval mode)."""
    cfg, eng = make_engine(tmp_path, TINY, 4, 16, 3, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2)
    masks = [(m["shape"], m["ratio"]) for m in eng.manifest["dropout"]["masks"]]
    hidden, attention = (["batch", "seq", 64], 0.1), (["batch", 4, "seq", "seq"], 0.2)
    assert masks == [hidden] + [attention, hidden, hidden] * 2     # embeddings, then per layer
    batch = sample_inputs(cfg.model.bert, 4, 16, 3, np.random.default_rng(5))
    hf = hf_bert(TINY, eng.layout.unflatten(eng.params)).eval()
    with torch.no_grad():
        ref = hf_forward(hf, batch).loss.item()
    assert eng.evaluate(batch) == pytest.approx(ref, rel=1e-5)
    assert abs(eng.forward_backward(batch, accumulate=False, position=0) - ref) > 1e-4


def make_engine(tmp_path, shape, batch, seq, preds, **bert_over):
    cfg = C.from_dict({"model": {"builtin": "bert", "bert": {**shape, "hidden_dropout_prob": 0.0,
                                                             "attention_probs_dropout_prob": 0.0, **bert_over}},
                       "data": {"seq_len": seq}, "train": {"micro_batch_size": batch},
                       "run": {"output_dir": str(tmp_path), "seed": 3}, "optimizer": {"name": "sgd"}})
    graphs_dir = prepare(cfg)
    dims = {"input_ids": (seq,), "segment_ids": (seq,), "input_mask": (seq,), "masked_lm_positions": (preds,),
            "masked_lm_ids": (preds,), "next_sentence_labels": ()}
    shapes = {k: ((batch, *dims[k]), np.int64) for k in INPUTS}
    eng = Engine(graphs_dir, EngineOptions(threads=2), shapes, shapes)
    eng.load_weights()
    return cfg, eng


def test_gradients_match_transformers(tmp_path):
    cfg, eng = make_engine(tmp_path, TINY, batch=4, seq=32, preds=6)
    weights = {k: v.copy() for k, v in eng.layout.unflatten(eng.params).items()}
    hf = hf_bert(TINY, weights)
    batch = sample_inputs(cfg.model.bert, 4, 32, 6, np.random.default_rng(1))
    eng.grads[:] = 123.0            # stale content: lazy reset must overwrite it
    loss = eng.forward_backward(batch, accumulate=False)
    ref = hf_forward(hf, batch)
    ref.loss.backward()
    assert loss == pytest.approx(ref.loss.item(), rel=1e-5)
    named = dict(hf.named_parameters())
    grads = eng.layout.unflatten(eng.grads)
    assert set(grads) == set(named) - set(TIED)
    largest = max(float(np.abs(g).max()) for g in grads.values())
    for name, grad in grads.items():
        want = named[name].grad.numpy()
        if name.endswith("attention.self.key.bias"):
            # exactly 0 in exact arithmetic (softmax ignores the q.b_k added to a whole row): rounding noise
            assert np.abs(grad).max() <= 1e-6 * largest and np.abs(want).max() <= 1e-6 * largest, name
            continue
        assert np.abs(grad - want).max() <= 1e-4 * np.abs(want).max(), name
    # the eval graph: the same loss, and the metrics
    assert eng.evaluate(batch) == pytest.approx(loss, rel=1e-6)


def test_two_ranks_match_transformers_and_adamw(tmp_path):
    """2 MPI ranks of trainrun against transformers + torch.optim.AdamW over 20 steps, fed the global
    batches of the documented sample order (scripts/reference.py reads the .pb files itself); bounds
    as in test_parity.py (restart from trainrun's state every 5 steps: float32 drift, not the rule)."""
    import os
    import sys

    from conftest import ROOT, TRAINRUN, TRAINRUN_DATA, adamw_windows, mpirun, read_metrics, run, write_config
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import reference as R

    steps, window, seq, preds, seed = 20, 5, 32, 5, 9
    cfg = bert_cfg(TINY)
    rng = np.random.default_rng(4)
    for split, n in (("train", 96), ("eval", 16)):
        np.savez(tmp_path / f"{split}.npz", **sample_inputs(cfg, n, seq, preds, rng))
        run([TRAINRUN_DATA, "tensors", "--input", str(tmp_path / f"{split}.npz"), "--output",
             str(tmp_path / "data" / split), "--samples-per-file", "40"], check=0)
    cfg_path = write_config(tmp_path / "c.yaml", str(tmp_path / "data"), **{
        "model": {"builtin": "bert", "bert": {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}},
        "data.seq_len": seq, "train.max_steps": steps, "train.micro_batch_size": 4, "run.seed": seed,
        "checkpoint": {"every": window, "keep_last": steps}, "train.eval_steps": 2,
        "optimizer": {"name": "adamw", "lr": 2e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01,
                      "max_grad_norm": 1.0},
        "lr_schedule": {"name": "linear", "warmup_steps": 5}})
    mpirun(2, "--config", cfg_path)
    train, evals = read_metrics(str(tmp_path / "run"))
    assert sorted(train) == list(range(1, steps + 1))
    final = evals[steps]      # eval_loss: mean over batches; the others: over predictions / samples
    assert 0 <= final["eval_mlm_accuracy"] <= 1 and 0 <= final["eval_nsp_accuracy"] <= 1
    assert final["eval_mlm_loss"] > 0 and final["eval_nsp_loss"] > 0
    batches = R.tensor_batches(str(tmp_path / "data" / "train"), 8, seed)

    def loss_of(model):
        """As DDP: the mean of each rank's loss (rank r takes samples 4r..4r+3 of the global batch); the
        MLM loss is a mean over each micro-batch's own predictions, so this is not the global batch's."""
        batch = next(batches)
        return sum(hf_forward(model, {k: v[r * 4:r * 4 + 4] for k, v in batch.items()}).loss for r in (0, 1)) / 2

    worst = adamw_windows(tmp_path / "run", C.load_config(cfg_path), train, window,
                          lambda params: hf_bert(TINY, params), loss_of,
                          lambda t: R.learning_rate(t, 2e-3, steps, "linear", 5))
    assert worst["first_loss"] <= 1e-5 and worst["loss"] <= 1e-4, worst
    assert worst["first_grad_norm"] <= 1e-3 and worst["grad_norm"] <= 1e-3, worst
    assert worst["update"] <= 1e-3, worst
    # the export (forward graph, dropout off) agrees with the eval graph on a valid BERT batch
    out = run([TRAINRUN, "export", str(tmp_path / "run"), "--output", str(tmp_path / "m.onnx")], check=0)
    assert "max |logits - eval graph|" in out.stdout
