"""BERT pre-training (masked LM + next sentence), built directly as ONNX.

The layout and parameter names are those of transformers' ``BertForPreTraining``
state dict (Linear weights [out, in]; the MLM decoder tied to
``bert.embeddings.word_embeddings.weight``, its bias ``cls.predictions.bias``),
so weights move between the two unchanged. Post-LN encoder layers, erf GELU
(``hidden_act: gelu``), dropout placed as transformers places it (embeddings,
attention probabilities, after the attention-output and output dense layers).
No torch needed.

Inputs (ONNX Runtime's BERT pre-training data; per sample, batch dim added):

* ``input_ids``, ``segment_ids`` (token types), ``input_mask`` (1 = token,
  0 = padding): int64 [batch, seq];
* ``masked_lm_positions``, ``masked_lm_ids``: int64 [batch, predictions], the
  positions of the masked tokens and their original ids. An unused prediction
  slot holds position 0 and id 0 (as Google's create_pretraining_data.py pads
  them; its masked_lm_weights is 0 exactly there): id 0 is [PAD], never a
  prediction target, so the MLM loss ignores label 0 (``ignore_index`` 0).
  The MLM head runs only at these positions (as NVIDIA's and ORT's BERT do);
* ``next_sentence_labels``: int64 [batch]; 0 = B follows A, 1 = B is random
  (transformers' convention).

Outputs: ``bert_loss`` = mean MLM cross-entropy over the used prediction slots
of the batch + mean NSP cross-entropy (transformers' ``loss``), the eval
metrics ``metric/{mlm_accuracy,nsp_accuracy,mlm_loss,nsp_loss}/{sum,count}``,
``prediction_logits`` [batch, predictions, vocab] (the MLM logits at the
masked positions) and ``seq_relationship_logits`` [batch, 2].

The inference graph (``build_bert(..., inference=True)``, what ``trainrun export`` writes) takes the
model's inputs only: ``input_ids``, ``segment_ids``, ``input_mask`` and, optionally,
``masked_lm_positions`` (an initializer that is also a graph input: its default, no positions, gives
the MLM logits at every position [batch, seq, vocab], as transformers' ``BertForPreTraining``
returns them); outputs ``prediction_logits`` and ``seq_relationship_logits`` only.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ..config import BertConfig
from .onnx_builder import MASK_VALUE, Graph
from .registry import Family, Transformers, register

INPUTS = ["input_ids", "segment_ids", "input_mask", "masked_lm_positions", "masked_lm_ids",
          "next_sentence_labels"]
LOSS = "bert_loss"
LOGITS = "prediction_logits"
NSP_LOGITS = "seq_relationship_logits"
CLS_INPUTS = ["input_ids", "segment_ids", "input_mask"]
CLS_LOGITS = "logits"
PREDICTIONS = "predictions"      # a regression's logits [batch, 1] as [batch], the labels' shape
IGNORE_ID = 0            # masked_lm_ids value of an unused prediction slot
METRICS = ("mlm_accuracy", "nsp_accuracy", "mlm_loss", "nsp_loss")     # the pre-training graph's own


def param_specs(cfg: BertConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every parameter's shape and initialisation (``normal``, ``normal_pad0``: normal with row 0 zero,
    ``ones``, ``zeros``), in the graph's order: the model's size without allocating it."""
    E, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    s = {"bert.embeddings.word_embeddings.weight": ((V, E), "normal_pad0"),
         "bert.embeddings.position_embeddings.weight": ((cfg.max_position_embeddings, E), "normal"),
         "bert.embeddings.token_type_embeddings.weight": ((cfg.type_vocab_size, E), "normal"),
         "bert.embeddings.LayerNorm.weight": ((E,), "ones"), "bert.embeddings.LayerNorm.bias": ((E,), "zeros")}
    for i in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            s[p + name + ".weight"], s[p + name + ".bias"] = ((E, E), "normal"), ((E,), "zeros")
        s[p + "attention.output.LayerNorm.weight"] = ((E,), "ones")
        s[p + "attention.output.LayerNorm.bias"] = ((E,), "zeros")
        s[p + "intermediate.dense.weight"], s[p + "intermediate.dense.bias"] = ((I, E), "normal"), ((I,), "zeros")
        s[p + "output.dense.weight"], s[p + "output.dense.bias"] = ((E, I), "normal"), ((E,), "zeros")
        s[p + "output.LayerNorm.weight"], s[p + "output.LayerNorm.bias"] = ((E,), "ones"), ((E,), "zeros")
    s["bert.pooler.dense.weight"], s["bert.pooler.dense.bias"] = ((E, E), "normal"), ((E,), "zeros")
    s["cls.predictions.transform.dense.weight"] = ((E, E), "normal")
    s["cls.predictions.transform.dense.bias"] = ((E,), "zeros")
    s["cls.predictions.transform.LayerNorm.weight"] = ((E,), "ones")
    s["cls.predictions.transform.LayerNorm.bias"] = ((E,), "zeros")
    s["cls.predictions.bias"] = ((V,), "zeros")
    s["cls.seq_relationship.weight"], s["cls.seq_relationship.bias"] = ((2, E), "normal"), ((2,), "zeros")
    return s


def layers_above(cfg: BertConfig, name: str) -> int:
    """How many layers lie above parameter ``name`` (``optimizer.layer_decay``'s exponent): the
    embeddings (and their LayerNorm) num_hidden_layers + 1, encoder layer i (0-based) num_hidden_layers - i,
    the pooler and the heads 0."""
    if name.startswith("bert.embeddings."):
        return cfg.num_hidden_layers + 1
    m = re.match(r"bert\.encoder\.layer\.(\d+)\.", name)
    return cfg.num_hidden_layers - int(m.group(1)) if m else 0


def classifier_specs(cfg: BertConfig, num_labels: int, pooler: bool = True) -> dict[str, tuple[tuple[int, ...], str]]:
    """BertForSequenceClassification's parameters: the encoder and pooler, ``classifier.weight/bias``;
    without the ``pooler``: BertForTokenClassification's."""
    s = {n: v for n, v in param_specs(cfg).items()
         if not n.startswith("cls.") and (pooler or not n.startswith("bert.pooler."))}
    s["classifier.weight"], s["classifier.bias"] = ((num_labels, cfg.hidden_size), "normal"), ((num_labels,), "zeros")
    return s


def init_weights(cfg: BertConfig, seed: int, specs: dict | None = None) -> dict[str, np.ndarray]:
    """transformers' BERT initialisation: weights and embeddings N(0, initializer_range), the
    [PAD] (id 0) embedding row 0, biases 0, LayerNorm 1/0. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)

    def make(shape, init):
        if init == "ones" or init == "zeros":
            return (np.ones if init == "ones" else np.zeros)(shape, np.float32)
        w = (rng.standard_normal(shape, dtype=np.float32) * np.float32(cfg.initializer_range)).astype(np.float32)
        if init == "normal_pad0":
            w[0] = 0
        return w
    return {name: make(shape, init) for name, (shape, init) in (specs or param_specs(cfg)).items()}


# transformers' state-dict names of the tied MLM decoder -> the parameter that holds them here
TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias"}


def build_bert(cfg: BertConfig, weights: dict[str, np.ndarray], inference: bool = False,
               task: str = "pretraining", num_labels: int = 2):
    """The forward graph (see the module doc) with ``weights`` as initializers; ``inference``: the
    inference graph (the model's inputs, the logits only; masked positions optional).

    Dense layers run as Gemm on [batch*seq, width] (transB: the [out, in] weights as stored);
    the residual stream is [batch, seq, hidden] so that Dropout's input has the batch first.
    Dropout nodes carry ``training_mode`` (true) as their third input; the train graph turns them
    into products with mask inputs (graphs.dropout_nodes.dropout_masks), the eval and inference graphs into Identity.
    """
    E, H = cfg.hidden_size, cfg.num_attention_heads
    D = E // H
    g = Graph()
    for name, value in weights.items():
        g.const(name, value)
    g.const("c_zero1", np.array([0], np.int64))
    g.const("c_axes12", np.array([1, 2], np.int64))
    g.const("c_last", np.array([-1], np.int64))
    g.const("c_2d", np.array([-1, E], np.int64))
    g.const("c_heads_shape", np.array([0, 0, H, D], np.int64))
    if task != "token_classification":
        g.const("c_first", np.array(0, np.int64))
    g.const("c_scale", np.array(1.0 / math.sqrt(D), np.float32))
    g.const("c_mask_value", np.array(MASK_VALUE, np.float32))
    g.const("c_1f", np.array(1.0, np.float32))
    g.const("c_half", np.array(0.5, np.float32))
    g.const("c_rsqrt2", np.array(1 / math.sqrt(2), np.float32))
    if cfg.hidden_act == "gelu_new":
        g.const("c_gelu_a", np.array(2 * math.sqrt(2 / math.pi), np.float32))
        g.const("c_gelu_b", np.array(2 * math.sqrt(2 / math.pi) * 0.044715, np.float32))
    if task == "pretraining":
        g.const("c_ignore", np.array(IGNORE_ID, np.int64))
    ratios = {}
    for key, p in (("hidden", cfg.hidden_dropout_prob), ("attention", cfg.attention_probs_dropout_prob)):
        if p > 0:
            ratios[key] = g.const(f"dropout_ratio_{key}", np.array(p, np.float32))
    if ratios:
        g.const("dropout_training", np.array(True))

    def dropout(x, key):
        return g.op("Dropout", [x, ratios[key], "dropout_training"]) if key in ratios else x

    def layer_norm(x, prefix):
        y, _, _ = g.op("LayerNormalization", [x, prefix + ".weight", prefix + ".bias"], n_out=3,
                       axis=-1, epsilon=cfg.layer_norm_eps)
        return y

    def dense(x2d, prefix):           # torch Linear on [N, in]: x W^T + b
        return g.op("Gemm", [x2d, prefix + ".weight", prefix + ".bias"], transB=1)

    def gelu(y, name):
        if cfg.hidden_act == "gelu":  # 0.5 y (1 + erf(y / sqrt 2))
            half = g.op("Mul", [g.op("Add", [g.op("Erf", [g.op("Mul", [y, "c_rsqrt2"])]), "c_1f"]), "c_half"])
            g.nodes.append(helper.make_node("Mul", [y, half], [name], name=name))
        else:                         # gelu_new as in gpt2.py: y * sigmoid(y (2k + 2k 0.044715 y^2))
            poly = g.op("Add", [g.op("Mul", [g.op("Mul", [y, y]), "c_gelu_b"]), "c_gelu_a"])
            g.nodes.append(helper.make_node("Mul", [y, g.op("Sigmoid", [g.op("Mul", [y, poly])])], [name], name=name))
        return name

    # embeddings
    seq = g.op("Shape", ["input_ids"], start=1, end=2)
    # onnxruntime's CPU GatherGrad (Gather's gradient) takes a mutex per element, slow whatever the table's
    # size (docs/design.md, "Small costs per step"). GatherND's gradient is a plain serial loop; the token types, a table of a few rows, are a one-hot [B, S, T] (a Gather from a constant
    # identity, so an out-of-range id still fails) times the table, whose gradient is one small Gemm.
    words = g.op("GatherND", ["bert.embeddings.word_embeddings.weight", g.op("Unsqueeze", ["input_ids", "c_last"])])
    pos = g.op("Slice", ["bert.embeddings.position_embeddings.weight", "c_zero1", seq, "c_zero1"])
    g.const("c_type_onehot", np.eye(cfg.type_vocab_size, dtype=np.float32))
    types = g.op("MatMul", [g.op("Gather", ["c_type_onehot", "segment_ids"], axis=0),
                            "bert.embeddings.token_type_embeddings.weight"])
    h = dropout(layer_norm(g.op("Add", [g.op("Add", [words, pos]), types]), "bert.embeddings.LayerNorm"), "hidden")
    shape3 = g.op("Shape", [h])                                                       # [B, S, E]
    # additive attention mask [B, 1, 1, S]: 0 for tokens, MASK_VALUE for padding
    keep = g.op("Cast", ["input_mask"], to=TensorProto.FLOAT)
    mask = g.op("Unsqueeze", [g.op("Mul", [g.op("Sub", ["c_1f", keep]), "c_mask_value"]), "c_axes12"])

    def heads(x2d, perm):
        return g.op("Transpose", [g.op("Reshape", [g.op("Reshape", [x2d, shape3]), "c_heads_shape"])], perm=perm)

    for i in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{i}"
        x = g.op("Reshape", [h, "c_2d"])
        q = heads(dense(x, p + ".attention.self.query"), [0, 2, 1, 3])      # [B,H,S,D]
        kt = heads(dense(x, p + ".attention.self.key"), [0, 2, 3, 1])       # [B,H,D,S]
        v = heads(dense(x, p + ".attention.self.value"), [0, 2, 1, 3])
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, kt]), "c_scale"]), mask])
        probs = dropout(g.op("Softmax", [scores], axis=-1), "attention")
        ctx = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3]), "c_2d"])
        a = g.op("Reshape", [dense(ctx, p + ".attention.output.dense"), shape3])
        h = layer_norm(g.op("Add", [dropout(a, "hidden"), h]), p + ".attention.output.LayerNorm")
        m = gelu(dense(g.op("Reshape", [h, "c_2d"]), p + ".intermediate.dense"), p + ".intermediate.act")
        o = g.op("Reshape", [dense(m, p + ".output.dense"), shape3])
        h = layer_norm(g.op("Add", [dropout(o, "hidden"), h]), p + ".output.LayerNorm")

    def ids(name, dims):
        return helper.make_tensor_value_info(name, TensorProto.INT64, dims)
    if task == "sequence_classification":
        return _classify(g, h, [ids(n, ["batch", "seq"]) for n in CLS_INPUTS], num_labels, inference, dropout, dense)
    if task == "token_classification":     # BertForTokenClassification: every token's state -> classifier
        g.const("c_num_labels", np.array([num_labels], np.int64))
        flat = dense(g.op("Reshape", [dropout(h, "hidden"), "c_2d"]), "classifier")
        shape = g.op("Concat", [g.op("Shape", [h], end=2), "c_num_labels"], axis=0)     # [B, S, num_labels]
        g.nodes.append(helper.make_node("Reshape", [flat, shape], [CLS_LOGITS], name="classifier_3d"))
        return g.model("bert", [ids(n, ["batch", "seq"]) for n in CLS_INPUTS],
                       [helper.make_tensor_value_info(CLS_LOGITS, TensorProto.FLOAT, ["batch", "seq", num_labels])])

    # MLM head at the masked positions only: [B, P, E] -> [B*P, E] -> [B*P, V]
    if inference:     # every position [B, S, E] unless masked_lm_positions are given
        at = g.op("If", [g.op("Greater", [g.op("Size", ["masked_lm_positions"]), "c_first"])],
                  then_branch=_branch("masked", [
                      helper.make_node("Unsqueeze", ["masked_lm_positions", "c_last"], ["mlm_positions"]),
                      helper.make_node("GatherND", [h, "mlm_positions"], ["mlm_at_masked"], batch_dims=1)]),
                  else_branch=_branch("every", [helper.make_node("Identity", [h], ["mlm_at_every"])]))
    else:
        at = g.op("GatherND", [h, g.op("Unsqueeze", ["masked_lm_positions", "c_last"])], batch_dims=1)
    t = layer_norm(gelu(dense(g.op("Reshape", [at, "c_2d"]), "cls.predictions.transform.dense"), "cls.predictions.act"),
                   "cls.predictions.transform.LayerNorm")
    logits2d = g.op("Gemm", [t, "bert.embeddings.word_embeddings.weight", "cls.predictions.bias"], transB=1)
    labels = None if inference else g.op("Reshape", ["masked_lm_ids", "c_last"])
    at_shape = g.op("Shape", [at], end=2) if inference else g.op("Shape", ["masked_lm_ids"])
    plogits_shape = g.op("Concat", [at_shape, g.op("Shape", [logits2d], start=1)], axis=0)
    g.nodes.append(helper.make_node("Reshape", [logits2d, plogits_shape], [LOGITS], name="mlm_logits"))

    def nsp_head():   # on the first ([CLS]) token
        pooled = g.op("Tanh", [dense(g.op("Gather", [h, "c_first"], axis=1), "bert.pooler.dense")])
        g.nodes.append(helper.make_node("Gemm", [pooled, "cls.seq_relationship.weight", "cls.seq_relationship.bias"],
                                        [NSP_LOGITS], name="nsp_logits", transB=1))

    graph_inputs = [ids("input_ids", ["batch", "seq"]), ids("segment_ids", ["batch", "seq"]),
                    ids("input_mask", ["batch", "seq"]), ids("masked_lm_positions", ["batch", "predictions"])]
    logits_outputs = [
        helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT,
                                      ["batch", "positions" if inference else "predictions", cfg.vocab_size]),
        helper.make_tensor_value_info(NSP_LOGITS, TensorProto.FLOAT, ["batch", 2])]
    if inference:
        nsp_head()
        g.inits.append(numpy_helper.from_array(np.zeros((1, 0), np.int64), "masked_lm_positions"))   # none
        return g.model("bert", graph_inputs, logits_outputs)

    mlm_loss = g.op("SoftmaxCrossEntropyLoss", [logits2d, labels], reduction="mean", ignore_index=IGNORE_ID)
    nsp_head()
    nsp_loss = g.op("SoftmaxCrossEntropyLoss", [NSP_LOGITS, "next_sentence_labels"], reduction="mean")
    g.nodes.append(helper.make_node("Add", [mlm_loss, nsp_loss], [LOSS], name=LOSS))

    # eval metrics: correct predictions / used slots, correct NSP / samples, and the two losses
    def metric(name, total, count):
        g.nodes.append(helper.make_node("Identity", [total], [f"metric/{name}/sum"], name=f"metric_{name}_sum"))
        g.nodes.append(helper.make_node("Identity", [count], [f"metric/{name}/count"], name=f"metric_{name}_count"))

    def fsum(x):
        return g.op("ReduceSum", [g.op("Cast", [x], to=TensorProto.FLOAT)], keepdims=0)

    used = g.op("Not", [g.op("Equal", [labels, "c_ignore"])])
    hits = g.op("And", [used, g.op("Equal", [g.op("ArgMax", [logits2d], axis=1, keepdims=0), labels])])
    n_used, n_samples = fsum(used), fsum(g.op("Shape", ["next_sentence_labels"]))
    nsp_hits = g.op("Equal", [g.op("ArgMax", [NSP_LOGITS], axis=1, keepdims=0), "next_sentence_labels"])
    metric("mlm_accuracy", fsum(hits), n_used)
    metric("nsp_accuracy", fsum(nsp_hits), n_samples)
    metric("mlm_loss", g.op("Mul", [mlm_loss, n_used]), n_used)
    metric("nsp_loss", g.op("Mul", [nsp_loss, n_samples]), n_samples)

    graph_inputs += [ids("masked_lm_ids", ["batch", "predictions"]), ids("next_sentence_labels", ["batch"])]
    scalar = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in
              [LOSS] + [f"metric/{m}/{k}" for m in METRICS
                        for k in ("sum", "count")]]
    return g.model("bert", graph_inputs, scalar + logits_outputs)


def _classify(g, h, graph_inputs, num_labels, inference, dropout, dense):
    """BertForSequenceClassification's head: the pooler on the first ([CLS]) token, dropout, the classifier
    -> ``logits`` [batch, num_labels]; a regression (num_labels 1) also ``predictions`` [batch] (what the
    loss compares with the float labels [batch])."""
    pooled = g.op("Tanh", [dense(g.op("Gather", [h, "c_first"], axis=1), "bert.pooler.dense")])
    g.nodes.append(helper.make_node("Gemm", [dropout(pooled, "hidden"), "classifier.weight", "classifier.bias"],
                                    [CLS_LOGITS], name="classifier", transB=1))
    outputs = [helper.make_tensor_value_info(CLS_LOGITS, TensorProto.FLOAT, ["batch", num_labels])]
    if num_labels == 1 and not inference:
        g.nodes.append(helper.make_node("Squeeze", [CLS_LOGITS, "c_last"], [PREDICTIONS], name="predictions"))
        outputs.append(helper.make_tensor_value_info(PREDICTIONS, TensorProto.FLOAT, ["batch"]))
    return g.model("bert", graph_inputs, outputs)


def _branch(name: str, nodes: list):
    """A branch of the MLM head's If: its last node's output, [batch, positions, hidden]."""
    out = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, ["batch", name, None])
    return helper.make_graph(nodes, name, [], [out])


def param_count(cfg: BertConfig) -> int:
    """Trainable parameters (the MLM decoder is tied to the word embeddings)."""
    E, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    per_layer = 4 * (E * E + E) + 2 * E + (E * I + I) + (I * E + E) + 2 * E
    embeddings = (V + cfg.max_position_embeddings + cfg.type_vocab_size) * E + 2 * E
    heads = (E * E + E) + (E * E + E) + 2 * E + V + (2 * E + 2)
    return embeddings + L * per_layer + heads


def sample_inputs(cfg: BertConfig, batch: int, seq: int, predictions: int, rng) -> dict[str, np.ndarray]:
    """A random but valid batch: distinct masked positions in 1..seq-1, ids in 1..vocab-1, padding in
    the last quarter of some rows, a few unused prediction slots."""
    out = {"input_ids": rng.integers(1, cfg.vocab_size, (batch, seq)),
           "segment_ids": rng.integers(0, cfg.type_vocab_size, (batch, seq)),
           "input_mask": np.ones((batch, seq), np.int64),
           "masked_lm_positions": np.stack([rng.permutation(np.arange(1, seq))[:predictions] for _ in range(batch)]),
           "masked_lm_ids": rng.integers(1, cfg.vocab_size, (batch, predictions)),
           "next_sentence_labels": rng.integers(0, 2, batch)}
    for b in range(0, batch, 2):
        out["input_mask"][b, seq - seq // 4:] = 0
        out["input_ids"][b, seq - seq // 4:] = 0
        keep = out["masked_lm_positions"][b] < seq - seq // 4
        out["masked_lm_positions"][b][~keep] = 0
        out["masked_lm_ids"][b][~keep] = IGNORE_ID
    return {k: v.astype(np.int64) for k, v in out.items()}


BERT_SPECIAL = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                "mask_token": "[MASK]"}


def _transformers_config(cfg: BertConfig, eos_id: int | None) -> tuple[dict, dict]:
    """(config.json's values: the section's, which are transformers' names, the token ids config.json and
    generation_config.json both hold)."""
    return {**dataclasses.asdict(cfg), "pad_token_id": 0, "tie_word_embeddings": True}, {"pad_token_id": 0}


def _transformers_tokenizer(eos: str | None) -> tuple[dict, dict]:
    """(WordPiece's special tokens; the segment ids of a pair, as BertForPreTraining was trained on them)."""
    return dict(BERT_SPECIAL), {"model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}


def _classifier_config(task: str, num_labels: int):
    def config(cfg: BertConfig, eos_id: int | None) -> tuple[dict, dict]:
        values, ids = _transformers_config(cfg, eos_id)
        names = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        values = {**values, "num_labels": num_labels, "id2label": names,
                  "label2id": {v: int(k) for k, v in names.items()}}
        if task == "sequence_classification":
            values["problem_type"] = "regression" if num_labels == 1 else "single_label_classification"
        return values, ids
    return config


def _sample_classified(cfg: BertConfig, task: str, num_labels: int, rng) -> dict[str, np.ndarray]:
    batch = {k: v for k, v in sample_inputs(cfg, 4, 16, 3, rng).items() if k in CLS_INPUTS}
    if task == "token_classification":     # padding and some other tokens ignored (-100)
        labels = rng.integers(0, num_labels, (4, 16))
        labels[(batch["input_mask"] == 0) | (rng.random((4, 16)) < 0.3)] = -100
        batch["labels"] = labels.astype(np.int64)
    else:
        batch["labels"] = rng.standard_normal(4).astype(np.float32) if num_labels == 1 else \
            rng.integers(0, num_labels, 4).astype(np.int64)
    return batch


ARCHITECTURES = {"sequence_classification": "BertForSequenceClassification",
                 "token_classification": "BertForTokenClassification"}


def with_task(task: str, num_labels: int) -> Family:
    """The family with ``model.task``'s head: sequence_classification (BertForSequenceClassification) or
    token_classification (BertForTokenClassification: no pooler; no regression: ``FAMILY.regression``)."""
    pooler = task == "sequence_classification"
    regression = num_labels == 1
    return dataclasses.replace(
        FAMILY, build=lambda cfg, w: build_bert(cfg, w, task=task, num_labels=num_labels),
        init_weights=lambda cfg, seed: init_weights(cfg, seed, classifier_specs(cfg, num_labels, pooler)),
        param_specs=lambda cfg: classifier_specs(cfg, num_labels, pooler), inputs=tuple(CLS_INPUTS),
        logits=PREDICTIONS if regression else CLS_LOGITS, loss=None,
        loss_type="mse" if regression else "cross_entropy",
        sample_batch=lambda cfg, rng: _sample_classified(cfg, task, num_labels, rng),
        inference=lambda cfg: build_bert(cfg, {}, inference=True, task=task, num_labels=num_labels),
        transformers=dataclasses.replace(FAMILY.transformers, architecture=ARCHITECTURES[task], tied={},
                                         optional=("classifier.",), config=_classifier_config(task, num_labels)),
        tasks=(), task=None)


FAMILY = register(Family(
    name="bert", section=BertConfig, build=build_bert, init_weights=init_weights, param_specs=param_specs,
    inputs=tuple(INPUTS), logits=LOGITS, loss=LOSS, sequence_inputs=tuple(CLS_INPUTS),
    layers_above=layers_above,
    sample_batch=lambda cfg, rng: sample_inputs(cfg, 4, 16, 3, rng),
    inference=lambda cfg: build_bert(cfg, {}, inference=True),
    dropout_fields=("hidden_dropout_prob", "attention_probs_dropout_prob"),
    transformers=Transformers(architecture="BertForPreTraining", model_type="bert", prefix="bert.", tied=TIED,
                              optional=("cls.",), config=_transformers_config, tokenizer=_transformers_tokenizer),
    tasks=("pretraining", "sequence_classification", "token_classification"), task=lambda task, n: with_task(task, n),
    regression=("sequence_classification",), metrics=METRICS, lora_targets=("query", "value"),
    embeddings=tuple(f"bert.embeddings.{e}_embeddings.weight" for e in ("word", "position", "token_type"))))
