"""Fine-tuning the built-in BERT (model.task sequence_classification) on `trainrun-data labelled` data:
its logits against transformers' BertForSequenceClassification, real runs from a transformers folder,
eval metrics, export to transformers' Auto classes, and bad values refused by name."""

import json
import os
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, TRAINRUN, TRAINRUN_DATA, loss_graph_outputs, mpirun, optional, read_metrics, run, write_config
from trainrun import checkpoint as K
from trainrun import config as C
from trainrun.models import registry

torch = optional("torch")

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reference as R  # noqa: E402  (reads the .pb files without trainrun)

SEQ = 16
WORDS = {"sport": "ball goal team match score play win coach".split(),
         "food": "bread cheese soup apple cook taste salt meal".split(),
         "music": "song guitar drum sing note band tune piano".split()}
BERT = dict(vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=SEQ, type_vocab_size=2)


def _rows(n, seed):
    rng, tag_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    topics = sorted(WORDS)
    rows = []
    for i in range(n):
        t = topics[i % 3]
        mixed = [(str(tag_rng.choice(WORDS[u])), u) for u in tag_rng.choice(topics, int(tag_rng.integers(2, 7)))]
        rows.append({"text": " ".join(rng.choice(WORDS[t], int(rng.integers(3, 9)))), "topic": t,
                     "score": float(i % 3) + round(float(rng.random()), 2),
                     "words": " ".join(w for w, _ in mixed), "tags": " ".join(u for _, u in mixed)})
    return rows


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """{'cls': DIR of a 3-topic classification, 'reg': DIR of a regression, 'tok': DIR of a per-word
    topic tagging}, from one tokenizer."""
    from trainrun.data_tools.bert import train_wordpiece
    d = tmp_path_factory.mktemp("ft")
    tok = d / "tokenizer.json"
    train_wordpiece(lambda: [" ".join(w) for w in WORDS.values()] * 3, 100, False).save(str(tok))
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(96, 0)))
    out = {}
    for kind, more in (("cls", ["--text-field", "text", "--label-field", "topic"]),
                       ("reg", ["--text-field", "text", "--label-field", "score", "--regression"]),
                       ("tok", ["--text-field", "words", "--label-field", "tags", "--task", "token_classification"])):
        run([TRAINRUN_DATA, "labelled", "--input", str(d / "rows.jsonl"), *more,
             "--tokenizer", str(tok), "--seq-len", str(SEQ), "--eval-fraction", "0.25", "--output", str(d / kind)],
            check=0)
        out[kind] = str(d / kind)
    return out


def _hf(task, num_labels, weights):
    import transformers
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    cls = getattr(transformers, {"sequence_classification": "BertForSequenceClassification",
                                 "token_classification": "BertForTokenClassification"}[task])
    model = cls(transformers.BertConfig(**BERT, num_labels=num_labels, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)).eval()
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=True)
    return model


@pytest.mark.parametrize("task, num_labels", [("sequence_classification", 3), ("sequence_classification", 1),
                                              ("token_classification", 4)])
@pytest.mark.torch
def test_logits_match_transformers(task, num_labels):
    """The prepared graph's logits (a regression's predictions too) and loss equal transformers' Bert
    For{Sequence,Token}Classification's (tokens labelled -100 ignored)."""
    cfg = C.from_dict({"model": {"builtin": "bert", "task": task, "num_labels": num_labels,
                                 "bert": {**BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}},
                       "data": {"seq_len": SEQ}})
    family = registry.of(cfg.model)
    weights = family.init_weights(cfg.model.bert, 3)
    assert "classifier.weight" in weights and not any(k.startswith("cls.") for k in weights)
    assert ("bert.pooler.dense.weight" in weights) == (task == "sequence_classification")
    for w in weights.values():
        w += np.random.default_rng(w.size).normal(0, 0.02, w.shape).astype(np.float32)
    batch = family.sample_batch(cfg.model.bert, np.random.default_rng(0))
    out = loss_graph_outputs(cfg, weights, batch)
    with torch.no_grad():
        ref = _hf(task, num_labels, weights)(input_ids=torch.from_numpy(batch["input_ids"]),
                                             token_type_ids=torch.from_numpy(batch["segment_ids"]),
                                             attention_mask=torch.from_numpy(batch["input_mask"]),
                                             labels=torch.from_numpy(batch["labels"]))
    logits = ref.logits.numpy()
    np.testing.assert_allclose(out[family.logits], logits[:, 0] if num_labels == 1 else logits, atol=1e-4)
    assert float(out["loss"]) == pytest.approx(ref.loss.item(), rel=1e-4)


def _config(tmp_path, data, **over):
    return write_config(tmp_path / "c.yaml", data, **{
        "model": {"builtin": "bert", "bert": BERT, "task": "sequence_classification", "num_labels": 3},
        "data.seq_len": SEQ, "train.max_steps": 12, "train.eval_every": 6, "lr_schedule.warmup_steps": 2, **over})


def _auto_logits(hf_dir, samples):
    """The exported folder's logits on ``samples`` through AutoModelForSequenceClassification (and the model)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    batch = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in ("input_ids", "segment_ids", "input_mask")}
    with torch.no_grad():
        return model, model(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                            attention_mask=batch["input_mask"]).logits.numpy()


@pytest.mark.torch
def test_fine_tune_from_a_transformers_folder(tmp_path, labelled):
    """From a BertForPreTraining folder: the encoder and pooler are its weights, the classifier fresh
    (normal(0, 0.02), bias 0); the run's loss falls; eval_accuracy and eval_f1 equal scikit-learn's on
    the exported model's predictions over the whole eval set; the export loads with the Auto class (the
    dataset's label names in id2label), its logits those of the ONNX export, which takes the model's
    inputs only."""
    import onnxruntime as ort
    from sklearn.metrics import accuracy_score, f1_score
    from transformers import BertConfig, BertForPreTraining
    torch.manual_seed(0)
    pre = BertForPreTraining(BertConfig(**BERT))
    pre.save_pretrained(tmp_path / "pre")
    cfg = _config(tmp_path, labelled["cls"], **{"model.init_from": str(tmp_path / "pre"), "train.max_steps": 48,
                                                "model.bert": {**BERT, "hidden_dropout_prob": 0.0},
                                                "train.eval_every": 24, "train.eval_steps": 6})
    run([TRAINRUN, "train", "--config", cfg], check=0)
    run_dir = str(tmp_path / "run")
    start = load_file(os.path.join(run_dir, "graphs", "weights.safetensors"))
    state = pre.state_dict()
    for name, value in start.items():
        if not name.startswith("classifier."):
            assert np.array_equal(value, state[name].numpy()), name
    assert abs(start["classifier.weight"].std() - 0.02) < 0.01 and not start["classifier.bias"].any()
    train, evals = read_metrics(run_dir)
    assert np.mean([train[s]["loss"] for s in (46, 47, 48)]) < np.mean([train[s]["loss"] for s in (1, 2, 3)]) - 0.05

    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", str(tmp_path / "hf")], check=0)
    run([TRAINRUN, "export", run_dir, "--output", str(tmp_path / "m.onnx")], check=0)
    samples = R.tensor_samples(os.path.join(labelled["cls"], "eval"))
    assert len(samples) == 24
    model, logits = _auto_logits(str(tmp_path / "hf"), samples)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.id2label == {0: "food", 1: "music", 2: "sport"} and model.config.label2id["sport"] == 2
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in sess.get_inputs()) == ["input_ids", "input_mask", "segment_ids"]
    (onnx_logits,) = sess.run(["logits"], {k: np.stack([s[k] for s in samples])
                                           for k in ("input_ids", "segment_ids", "input_mask")})
    np.testing.assert_allclose(onnx_logits, logits, atol=1e-4)
    labels, pred = np.array([int(s["labels"]) for s in samples]), logits.argmax(-1)
    assert evals[48]["eval_accuracy"] == pytest.approx(accuracy_score(labels, pred), abs=1e-6)
    assert evals[48]["eval_f1"] == pytest.approx(f1_score(labels, pred, average="macro"), abs=1e-6)

    # the exported BertForSequenceClassification folder as model.init_from: every tensor, classifier too
    from trainrun.graphs.manifest import prepare
    again = C.from_dict({"model": {"builtin": "bert", "task": "sequence_classification", "num_labels": 3,
                                   "init_from": str(tmp_path / "hf")},
                         "data": {"seq_len": SEQ}, "run": {"output_dir": str(tmp_path / "again"), "seed": 9}})
    prepare(again)
    held = load_file(str(tmp_path / "again" / "graphs" / "weights.safetensors"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(held) == set(exported) and all(np.array_equal(held[k], exported[k]) for k in held)


@pytest.mark.torch
def test_fine_tune_from_a_trainrun_pre_training_run(tmp_path, labelled):
    """The recipe's path (scripts/recipe_topics.py) in small: a BERT pre-trained by trainrun (masked LM and next
    sentence, `trainrun-data bert` with the labelled set's tokenizer) and exported with --format transformers is
    the fine-tune's model.init_from: the fine-tune starts at its encoder and pooler (classifier fresh); the
    fine-tuned run's transformers export loads with AutoModelForSequenceClassification and gives the ONNX
    export's logits."""
    import onnxruntime as ort
    text = tmp_path / "text"
    text.mkdir()
    rng = np.random.default_rng(3)
    for topic, words in WORDS.items():
        docs = ["\n".join(" ".join(rng.choice(words, 6)) for _ in range(4)) for _ in range(12)]
        (text / f"{topic}.txt").write_text("\n\n".join(docs) + "\n")
    tokenizer = os.path.join(os.path.dirname(labelled["cls"]), "tokenizer.json")
    run([TRAINRUN_DATA, "bert", "--input", str(text), "--output", str(tmp_path / "pre-data"), "--tokenizer",
         tokenizer, "--seq-len", str(SEQ), "--max-predictions", "3", "--eval-fraction", "0", "--no-progress"],
        check=0)
    pre_cfg = write_config(tmp_path / "pre.yaml", str(tmp_path / "pre-data"), **{
        "model": {"builtin": "bert", "bert": BERT}, "data.eval": None, "data.seq_len": SEQ,
        "run.output_dir": str(tmp_path / "pre"), "train.max_steps": 8, "lr_schedule.warmup_steps": 2})
    run([TRAINRUN, "train", "--config", pre_cfg], check=0)
    run([TRAINRUN, "export", str(tmp_path / "pre"), "--format", "transformers", "--output", str(tmp_path / "pre-hf")],
        check=0)
    pre = load_file(str(tmp_path / "pre-hf" / "model.safetensors"))
    initial = load_file(str(tmp_path / "pre" / "graphs" / "weights.safetensors"))
    assert any(not np.array_equal(pre[k], initial[k]) for k in initial)      # it did train

    cfg = _config(tmp_path, labelled["cls"], **{"model.init_from": str(tmp_path / "pre-hf")})
    mpirun(2, "train", "--config", cfg)
    start = load_file(str(tmp_path / "run" / "graphs" / "weights.safetensors"))
    shared = [k for k in start if not k.startswith("classifier.")]
    assert shared and all(np.array_equal(start[k], pre[k]) for k in shared)
    run([TRAINRUN, "export", str(tmp_path / "run"), "--format", "transformers", "--output", str(tmp_path / "hf")],
        check=0)
    run([TRAINRUN, "export", str(tmp_path / "run"), "--output", str(tmp_path / "m.onnx")], check=0)
    samples = R.tensor_samples(os.path.join(labelled["cls"], "eval"))
    model, logits = _auto_logits(str(tmp_path / "hf"), samples)
    assert type(model).__name__ == "BertForSequenceClassification"
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (onnx_logits,) = sess.run(["logits"], {k: np.stack([s[k] for s in samples])
                                           for k in ("input_ids", "segment_ids", "input_mask")})
    np.testing.assert_allclose(onnx_logits, logits, atol=1e-4)


@pytest.mark.graphs
@pytest.mark.torch
def test_regression_on_two_ranks_matches_scipy(tmp_path, labelled):
    """num_labels 1: mse; on 2 ranks eval_pearson / eval_spearman over both ranks' samples equal scipy's
    on the exported model's predictions (problem_type regression); keep_best ranks by eval_spearman and
    early stopping watches eval_pearson."""
    from scipy.stats import pearsonr, spearmanr
    cfg = _config(tmp_path, labelled["reg"], **{
        "model.num_labels": 1, "train.eval_steps": 3, "checkpoint.keep_best": 1,
        "checkpoint.best_metric": "eval_spearman", "train.early_stopping": {"patience": 5, "metric": "eval_pearson"}})
    mpirun(2, "train", "--config", cfg)
    run_dir = str(tmp_path / "run")
    train, evals = read_metrics(run_dir)
    assert "eval_mse" in evals[12] and np.isfinite(train[12]["loss"])
    state = K.read_state(os.path.join(run_dir, "checkpoints", "12"))
    assert state["best_metric"] == {"name": "eval_spearman", "greater_is_better": True,
                                    "value": pytest.approx(evals[12]["eval_spearman"], rel=1e-12)}
    assert state["early_stopping"]["metric"] == "eval_pearson"
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", str(tmp_path / "hf")], check=0)
    samples = R.tensor_samples(os.path.join(labelled["reg"], "eval"))
    model, logits = _auto_logits(str(tmp_path / "hf"), samples)
    assert model.config.problem_type == "regression" and logits.shape == (24, 1)
    y = np.array([float(s["labels"]) for s in samples])
    assert evals[12]["eval_pearson"] == pytest.approx(pearsonr(logits[:, 0], y)[0], abs=1e-4)
    assert evals[12]["eval_spearman"] == pytest.approx(spearmanr(logits[:, 0], y)[0], abs=1e-4)
    # `trainrun evaluate` on 2 ranks reports the same
    mpirun(2, "evaluate", run_dir, "--data", os.path.join(labelled["reg"], "eval"), "--output",
           str(tmp_path / "e.json"))
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["samples"] == 24 and "perplexity" not in result
    assert result["pearson"] == pytest.approx(evals[12]["eval_pearson"], abs=1e-6)
    assert result["spearman"] == pytest.approx(evals[12]["eval_spearman"], abs=1e-6)


@pytest.mark.graphs
@pytest.mark.torch
def test_token_classification_run_and_export(tmp_path, labelled):
    """token_classification: a run's eval_accuracy / eval_f1 over the labelled tokens (the -100 ones left
    out) equal scikit-learn's on the predictions of the export, which AutoModelForTokenClassification loads."""
    from sklearn.metrics import accuracy_score, f1_score
    from transformers import AutoModelForTokenClassification
    cfg = _config(tmp_path, labelled["tok"], **{"model.task": "token_classification", "train.eval_steps": 6,
                                                  "checkpoint.keep_best": 1, "checkpoint.best_metric": "eval_f1"})
    run([TRAINRUN, "train", "--config", cfg], check=0)
    run_dir = str(tmp_path / "run")
    train, evals = read_metrics(run_dir)
    assert K.read_state(os.path.join(run_dir, "checkpoints", "12"))["best_metric"] == {
        "name": "eval_f1", "greater_is_better": True, "value": pytest.approx(evals[12]["eval_f1"], rel=1e-12)}
    assert np.mean([train[s]["loss"] for s in (10, 11, 12)]) < np.mean([train[s]["loss"] for s in (1, 2, 3)])
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", str(tmp_path / "hf")], check=0)
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(model).__name__ == "BertForTokenClassification"
    assert model.config.id2label == {0: "food", 1: "music", 2: "sport"}
    samples = R.tensor_samples(os.path.join(labelled["tok"], "eval"))
    assert len(samples) == 24
    b = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in ("input_ids", "segment_ids", "input_mask")}
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], token_type_ids=b["segment_ids"],
                       attention_mask=b["input_mask"]).logits.numpy()
    labels = np.stack([s["labels"] for s in samples])
    keep = labels != -100
    assert keep.any() and (~keep).any()
    pred = logits.argmax(-1)[keep]
    assert evals[12]["eval_accuracy"] == pytest.approx(accuracy_score(labels[keep], pred), abs=1e-6)
    assert evals[12]["eval_f1"] == pytest.approx(f1_score(labels[keep], pred, average="macro"), abs=1e-6)
    p = run([TRAINRUN, "evaluate", run_dir, "--data", os.path.join(labelled["tok"], "eval"), "--output",
             str(tmp_path / "e.json")], check=0)
    result = json.loads((tmp_path / "e.json").read_text())
    assert "perplexity" not in result and "perplexity" not in p.stdout and "eval_perplexity" not in evals[12]
    assert result["f1"] == pytest.approx(evals[12]["eval_f1"], abs=1e-6)
    assert result["accuracy"] == pytest.approx(evals[12]["eval_accuracy"], abs=1e-6)


GPT2 = dict(n_layer=2, n_head=2, n_embd=32, n_positions=SEQ, vocab_size=160, dropout=0.0)


@pytest.mark.graphs
@pytest.mark.torch
def test_gpt2_sequence_classification_matches_transformers_and_trains(tmp_path, labelled):
    """gpt2 sequence_classification: the last token's state -> score (no bias); logits and loss equal
    GPT2ForSequenceClassification's (padding found by pad_token_id 0 there, by input_mask here); a run on
    labelled data; its export loads with AutoModelForSequenceClassification, logits as the ONNX export's."""
    import onnxruntime as ort
    from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2ForSequenceClassification
    cfg = C.from_dict({"model": {"builtin": "gpt2", "task": "sequence_classification", "num_labels": 3,
                                 "gpt2": GPT2}, "data": {"seq_len": SEQ}})
    family = registry.of(cfg.model)
    weights = family.init_weights(cfg.model.gpt2, 3)
    assert weights["score.weight"].shape == (3, 32)
    for w in weights.values():
        w += np.random.default_rng(w.size).normal(0, 0.02, w.shape).astype(np.float32)
    batch = family.sample_batch(cfg.model.gpt2, np.random.default_rng(0))
    out = loss_graph_outputs(cfg, weights, batch)
    hf = GPT2ForSequenceClassification(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=SEQ, vocab_size=160,
                                                  num_labels=3, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                  attn_pdrop=0.0)).eval()
    loaded = hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
    assert not loaded.unexpected_keys and set(dict(hf.named_parameters())) <= set(weights)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(batch["input_ids"]), attention_mask=torch.from_numpy(batch["input_mask"]),
                 labels=torch.from_numpy(batch["labels"]))
    np.testing.assert_allclose(out["logits"], ref.logits.numpy(), atol=1e-4)
    assert float(out["loss"]) == pytest.approx(ref.loss.item(), rel=1e-4)

    cfg_path = write_config(tmp_path / "c.yaml", labelled["cls"], **{
        "model": {"builtin": "gpt2", "gpt2": GPT2, "task": "sequence_classification", "num_labels": 3},
        "data.seq_len": SEQ, "train.max_steps": 32, "train.eval_every": 32, "train.eval_steps": 6})
    run([TRAINRUN, "train", "--config", cfg_path], check=0)
    run_dir = str(tmp_path / "run")
    _, evals = read_metrics(run_dir)
    # it learns the topics (their words are disjoint): a fresh head starts at chance, loss ln 3 and macro F1
    # about 1/3 (1/6 predicting one class); 32 steps end at F1 1.0 (seeds 1, 2, 3 and 5 alike; >= 0.95 at 16)
    assert evals[32]["eval_samples"] == 24
    assert evals[32]["eval_f1"] >= 0.8 and evals[32]["eval_loss"] < np.log(3) - 0.3, evals[32]
    run([TRAINRUN, "export", run_dir, "--format", "transformers", "--output", str(tmp_path / "hf")], check=0)
    run([TRAINRUN, "export", run_dir, "--output", str(tmp_path / "m.onnx")], check=0)
    samples = R.tensor_samples(os.path.join(labelled["cls"], "eval"))
    auto = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(auto).__name__ == "GPT2ForSequenceClassification" and auto.config.id2label[2] == "sport"
    b = {k: np.stack([s[k] for s in samples]) for k in ("input_ids", "input_mask")}
    with torch.no_grad():
        logits = auto(input_ids=torch.from_numpy(b["input_ids"]),
                      attention_mask=torch.from_numpy(b["input_mask"])).logits.numpy()
    exported = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in exported.get_inputs()) == ["input_ids", "input_mask"]
    np.testing.assert_allclose(exported.run(["logits"], b)[0], logits, atol=1e-4)


@pytest.mark.parametrize("over, says", [
    ({"model.builtin": "gpt2", "model.task": "token_classification"}, "model.task: 'token_classification'"),
    ({"model.task": "summarise"}, "model.task: 'summarise'"),
    ({"model.num_labels": 0}, "model.num_labels"),
    ({"model.builtin": "gpt2", "model.task": "sequence_classification", "model.num_labels": 1},
     "model.num_labels: 1"),
    ({"model.task": "token_classification", "model.num_labels": 1}, "model.num_labels: 1"),
    ({"model.task": "token_classification"}, "model.task: token_classification, but data.train"),
    ({"model.num_labels": 4}, "model.num_labels: 4, but data.train"),
])
def test_bad_task_values_exit_2_naming_the_key(tmp_path, labelled, over, says):
    cfg = _config(tmp_path, labelled["cls"], **over)
    p = run([TRAINRUN, "train", "--config", cfg], check=2)
    assert says in p.stderr + p.stdout


def _head_reference(samples, logits, regression, micro, ranks):
    """The eval results of a task head over every sample in numpy, from the exported model's ``logits``:
    loss as the mean of the micro-batch losses weighed by their samples, the micro-batches split as
    data.eval_batches documents (step s: samples s*G .. s*G+G-1, rank r the r-th ``micro`` of them; the
    rest one last step split over the ranks in order); accuracy and macro F1 / mse, Pearson, Spearman
    over all samples."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score
    labels = np.stack([s["labels"] for s in samples])
    n, group = len(samples), micro * ranks
    whole = n // group * group
    parts = [range(first, first + micro) for first in range(0, whole, micro)]
    parts += [range(whole + r * (n - whole) // ranks, whole + (r + 1) * (n - whole) // ranks) for r in range(ranks)]
    parts = [p for p in parts if len(p)]
    assert len(parts[-1]) < micro         # the case under test: a partial last batch

    def loss(idx):
        x, y = logits[idx].astype(np.float64), labels[idx]
        if regression:
            return np.mean((x.reshape(-1) - y) ** 2)
        keep = y != -100
        x, y = x[keep], y[keep]
        top = x.max(-1, keepdims=True)
        return np.mean(np.log(np.exp(x - top).sum(-1)) + top[:, 0] - x[np.arange(len(y)), y])
    ref = {"loss": sum(loss(np.array(p)) * len(p) for p in parts) / n}
    if regression:
        x, y = logits.reshape(-1).astype(np.float64), labels.astype(np.float64)
        ref.update(mse=np.mean((x - y) ** 2), pearson=pearsonr(x, y)[0], spearman=spearmanr(x, y)[0])
    else:
        keep = labels != -100
        y, p = labels[keep], logits.argmax(-1)[keep]
        ref.update(accuracy=accuracy_score(y, p), f1=f1_score(y, p, average="macro"))
    return ref


@pytest.mark.parametrize("kind, task, num_labels", [("cls", "sequence_classification", 3),
                                                    ("reg", "sequence_classification", 1),
                                                    ("tok", "token_classification", 3)])
def test_task_head_evaluates_a_partial_last_batch_on_two_ranks(tmp_path, labelled, kind, task, num_labels):
    """Every task head on 2 ranks, micro-batch 5: the 24 eval samples are 2 whole steps of 10 and a last
    step of 2 per rank. The in-training evaluation (eval_steps past the set's end) and `trainrun evaluate`
    on 2 ranks cover all 24, their loss and metrics those of numpy over the exported model's logits."""
    import onnxruntime as ort
    micro, ranks = 5, 2
    cfg = _config(tmp_path, labelled[kind], **{
        "model.task": task, "model.num_labels": num_labels, "train.micro_batch_size": micro,
        "train.max_steps": 8, "train.eval_every": 4, "train.eval_steps": 10, "lr_schedule.warmup_steps": 1,
        "optimizer.lr": 1e-2})
    mpirun(ranks, "train", "--config", cfg)
    run_dir = str(tmp_path / "run")
    _, evals = read_metrics(run_dir)
    run([TRAINRUN, "export", run_dir, "--output", str(tmp_path / "m.onnx")], check=0)
    samples = R.tensor_samples(os.path.join(labelled[kind], "eval"))
    assert len(samples) == 24
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(["logits"], {i.name: np.stack([s[i.name] for s in samples]) for i in sess.get_inputs()})
    ref = _head_reference(samples, logits, num_labels == 1, micro, ranks)
    mpirun(ranks, "evaluate", run_dir, "--data", os.path.join(labelled[kind], "eval"), "--output",
           str(tmp_path / "e.json"))
    result = json.loads((tmp_path / "e.json").read_text())
    assert evals[4]["eval_samples"] == evals[8]["eval_samples"] == result["samples"] == 24
    assert result["batch"] == micro * ranks
    for name, value in ref.items():
        # float32 logits of batches of other sizes: the loss to rounding; metrics of the argmax / ranks alike
        assert evals[8][f"eval_{name}"] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        assert result[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
