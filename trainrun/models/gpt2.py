"""The GPT-2 forward graph (input_ids -> logits), built directly as ONNX.

Token + position embeddings, pre-LN blocks (causal self-attention, tanh-GELU
(gelu_new, written with Sigmoid) MLP), final LayerNorm and an LM head tied to the token embedding. Parameter
names and layouts are those of transformers' ``GPT2LMHeadModel`` state dict
(Conv1D weights are [in, out]), so weights move between the two unchanged.
No torch needed.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import onnx
from onnx import helper

from ..config import GPT2Config
from .onnx_builder import CLS_INPUTS, MASK_VALUE, Graph, decoder_io, last_token_head, right_padded_sample
from .registry import Family, Transformers, classifier_config, register

def param_specs(cfg: GPT2Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every parameter's shape and initialisation (``normal``, ``proj``: the residual projections'
    smaller normal, ``ones``, ``zeros``), in the graph's order: the model's size without allocating it."""
    E = cfg.n_embd
    s = {"transformer.wte.weight": ((cfg.vocab_size, E), "normal"),
         "transformer.wpe.weight": ((cfg.n_positions, E), "normal")}
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        s[p + "ln_1.weight"], s[p + "ln_1.bias"] = ((E,), "ones"), ((E,), "zeros")
        s[p + "attn.c_attn.weight"], s[p + "attn.c_attn.bias"] = ((E, 3 * E), "normal"), ((3 * E,), "zeros")
        s[p + "attn.c_proj.weight"], s[p + "attn.c_proj.bias"] = ((E, E), "proj"), ((E,), "zeros")
        s[p + "ln_2.weight"], s[p + "ln_2.bias"] = ((E,), "ones"), ((E,), "zeros")
        s[p + "mlp.c_fc.weight"], s[p + "mlp.c_fc.bias"] = ((E, 4 * E), "normal"), ((4 * E,), "zeros")
        s[p + "mlp.c_proj.weight"], s[p + "mlp.c_proj.bias"] = ((4 * E, E), "proj"), ((E,), "zeros")
    s["transformer.ln_f.weight"], s["transformer.ln_f.bias"] = ((E,), "ones"), ((E,), "zeros")
    return s


def layers_above(cfg: GPT2Config, name: str) -> int:
    """How many layers lie above parameter ``name`` (``optimizer.layer_decay``'s exponent): the
    embeddings (wte, tied to the head, and wpe) n_layer + 1, block i (0-based) n_layer - i, the final
    LayerNorm and any head 0."""
    if name.startswith("transformer.wte.") or name.startswith("transformer.wpe."):
        return cfg.n_layer + 1
    m = re.match(r"transformer\.h\.(\d+)\.", name)
    return cfg.n_layer - int(m.group(1)) if m else 0


def init_weights(cfg: GPT2Config, seed: int, specs: dict | None = None) -> dict[str, np.ndarray]:
    """GPT-2 initialisation: N(0, initializer_range), residual projections scaled by
    1/sqrt(2 n_layer), biases 0, LayerNorm 1/0. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    std = {"normal": cfg.initializer_range, "proj": cfg.initializer_range / math.sqrt(2 * cfg.n_layer)}

    def make(shape, init):
        if init in std:
            return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std[init])).astype(np.float32)
        return (np.ones if init == "ones" else np.zeros)(shape, np.float32)
    return {name: make(shape, init) for name, (shape, init) in (specs or param_specs(cfg)).items()}


def build_gpt2(cfg: GPT2Config, weights: dict[str, np.ndarray], kv_cache: bool = False,
               num_labels: int | None = None) -> onnx.ModelProto:
    """The forward graph with ``weights`` as initializers; input ``input_ids``
    int64 [batch, seq], output ``logits`` float32 [batch, seq, vocab].

    ``kv_cache``: the inference graph for generation (build it with dropout 0). Per layer ``i`` it also
    takes ``past.{i}.key`` / ``past.{i}.value`` [batch, n_head, past, head_dim] (the keys and values of
    the ``past`` tokens before ``input_ids``, transformers' layout; ``past`` may be 0) and returns
    ``present.{i}.key`` / ``present.{i}.value`` [batch, n_head, past + seq, head_dim]; positions start at
    ``past``. A prompt is one pass with past 0, each new token a pass of seq 1.

    Dropout nodes (when cfg.dropout > 0; transformers' placement: embeddings,
    attention probabilities, after each c_proj) carry ``training_mode`` as their
    third input, the constant ``dropout_training`` (true); the train graph turns
    them into products with mask inputs (graphs.dropout_nodes.dropout_masks), the eval and
    inference graphs into Identity.
    """
    E, H = cfg.n_embd, cfg.n_head
    D = E // H
    g = Graph()
    for name, value in weights.items():
        g.const(name, value)

    g.const("causal_mask", np.triu(np.full((cfg.n_positions, cfg.n_positions), MASK_VALUE, np.float32), 1))
    g.const("c_zero1", np.array([0], np.int64))
    g.const("c_axes01", np.array([0, 1], np.int64))
    if not kv_cache:
        g.const("c_zero2", np.array([0, 0], np.int64))
    g.const("c_flat_shape", np.array([-1, E], np.int64))
    g.const("c_rows", np.array([-1], np.int64))
    g.const("c_3hd", np.array([3, H, D], np.int64))
    g.const("c_width", np.array([E], np.int64))
    g.const("c_scale", np.array(1.0 / math.sqrt(D), np.float32))
    # gelu_new(y) = 0.5 y (1 + tanh(k (y + 0.044715 y^3))) = y * sigmoid(y * (2k + 2k 0.044715 y^2)), k = sqrt(2/pi)
    g.const("c_gelu_a", np.array(2 * math.sqrt(2 / math.pi), np.float32))
    g.const("c_gelu_b", np.array(2 * math.sqrt(2 / math.pi) * 0.044715, np.float32))
    if cfg.dropout > 0:
        g.const("dropout_ratio", np.array(cfg.dropout, np.float32))
        g.const("dropout_training", np.array(True))

    def dropout(x, rows=False):
        """``rows``: x is [B*S, width], dropped as [B, S, width] (trainrun's masks are drawn per sample)."""
        if cfg.dropout <= 0:
            return x
        if rows:
            y = g.op("Dropout", [g.op("Reshape", [x, seq_shape]), "dropout_ratio", "dropout_training"])
            return g.op("Reshape", [y, "c_flat_shape"])
        return g.op("Dropout", [x, "dropout_ratio", "dropout_training"])

    def layer_norm(x, prefix):
        # Mean and InvStdDev outputs are requested: the gradient builder needs them.
        y, _, _ = g.op("LayerNormalization", [x, prefix + ".weight", prefix + ".bias"], n_out=3,
                       axis=-1, epsilon=cfg.layer_norm_epsilon)
        return y

    def linear(x, prefix):
        return g.op("Add", [g.op("MatMul", [x, prefix + ".weight"]), prefix + ".bias"])

    seq = g.op("Shape", ["input_ids"], start=1, end=2)                       # [1]
    seq2 = None if kv_cache else g.op("Concat", [seq, seq], axis=0)          # [2]
    tok = g.op("Gather", ["transformer.wte.weight", "input_ids"], axis=0)    # [B,S,E]
    if kv_cache:        # rows past..past+S of the causal mask, keys 0..past+S; positions from past
        past = g.op("Shape", ["past.0.key"], start=2, end=3)
        total = g.op("Add", [past, seq])
        pos = g.op("Slice", ["transformer.wpe.weight", past, total, "c_zero1"])
        mask = g.op("Slice", ["causal_mask", g.op("Concat", [past, "c_zero1"], axis=0),
                              g.op("Concat", [total, total], axis=0), "c_axes01"])
    else:
        pos = g.op("Slice", ["transformer.wpe.weight", "c_zero1", seq, "c_zero1"])  # [S,E]
        mask = g.op("Slice", ["causal_mask", "c_zero2", seq2, "c_axes01"])   # [S,S]
    # the residual stream as [B*S, E] rows: each linear layer's MatMul + bias is one Gemm
    h = g.op("Reshape", [dropout(g.op("Add", [tok, pos])), "c_flat_shape"])
    qkv_shape = g.op("Concat", ["c_rows", seq, "c_3hd"], axis=0)                # [B, S, 3, H, D]
    seq_shape = g.op("Concat", ["c_rows", seq, "c_width"], axis=0)              # [B, S, E]

    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}"
        a = layer_norm(h, p + ".ln_1")
        qkv = linear(a, p + ".attn.c_attn")
        # [B*S,3E] -> [B,S,3,H,D] -> one transpose to [3,B,H,S,D] -> q, k, v [B,H,S,D] split off the
        # outer axis (contiguous copies); k's transpose folds into the scores' MatMul (transB)
        qkv = g.op("Transpose", [g.op("Reshape", [qkv, qkv_shape])], perm=[2, 0, 3, 1, 4])
        q, k, v = (g.op("Squeeze", [t, "c_zero1"]) for t in g.op("Split", [qkv], n_out=3, axis=0))
        if kv_cache:
            for name, new in (("key", k), ("value", v)):
                g.nodes.append(helper.make_node("Concat", [f"past.{i}.{name}", new], [f"present.{i}.{name}"],
                                                name=f"present.{i}.{name}", axis=2))
            k, v = f"present.{i}.key", f"present.{i}.value"
        kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])                                    # [B,H,D,S]
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, kt]), "c_scale"]), mask])
        probs = dropout(g.op("Softmax", [scores], axis=-1))
        y = g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])   # [B,S,H,D]
        y = g.op("Reshape", [y, "c_flat_shape"])
        h = g.op("Add", [h, dropout(linear(y, p + ".attn.c_proj"), rows=True)])

        m = layer_norm(h, p + ".ln_2")
        m = g.op("MatMul", [m, p + ".mlp.c_fc.weight"])
        # gelu_new from Add/Mul/Sigmoid: vectorised kernels (FastGelu's gradient is a scalar one-thread tanh
        # loop, 21% of a gpt2-tiny step); the train graph differentiates it by hand (graphs.ort_gradients)
        y = g.op("Add", [m, p + ".mlp.c_fc.bias"])
        poly = g.op("Add", [g.op("Mul", [g.op("Mul", [y, y]), "c_gelu_b"]), "c_gelu_a"])
        act = p + ".mlp.act"      # a stable name for debug.tensors
        g.nodes.append(helper.make_node("Mul", [y, g.op("Sigmoid", [g.op("Mul", [y, poly])])], [act], name=act))
        m = act
        h = g.op("Add", [h, dropout(linear(m, p + ".mlp.c_proj"), rows=True)])

    hf = g.op("Reshape", [layer_norm(h, "transformer.ln_f"), seq_shape])
    if num_labels is not None:
        return last_token_head(g, hf, E, num_labels, "gpt2")
    g.nodes.append(helper.make_node("MatMul", [hf, g.op("Transpose", ["transformer.wte.weight"], perm=[1, 0])],
                                    ["logits"], name="lm_head"))

    return g.model("gpt2", *decoder_io(cfg.vocab_size, cfg.n_layer, H, D, kv_cache))


def classifier_specs(cfg: GPT2Config, num_labels: int) -> dict:
    """GPT2ForSequenceClassification's parameters: the transformer's and ``score.weight`` [num_labels, n_embd]."""
    return {**param_specs(cfg), "score.weight": ((num_labels, cfg.n_embd), "normal")}


def with_task(task: str, num_labels: int) -> Family:
    """The family with ``model.task``'s head: sequence_classification (GPT2ForSequenceClassification)."""
    return dataclasses.replace(
        FAMILY, build=lambda cfg, w: build_gpt2(cfg, w, num_labels=num_labels),
        init_weights=lambda cfg, seed: init_weights(cfg, seed, classifier_specs(cfg, num_labels)),
        param_specs=lambda cfg: classifier_specs(cfg, num_labels), inputs=tuple(CLS_INPUTS),
        logits="logits", sequence_inputs=True, kv_cache=None,
        sample_batch=lambda cfg, rng: right_padded_sample(cfg.vocab_size, num_labels, rng),
        transformers=dataclasses.replace(FAMILY.transformers, architecture="GPT2ForSequenceClassification", tied={},
                                         optional=("score.",), config=classifier_config(_transformers_config, num_labels)),
        tasks=(), task=None)


def param_count(cfg: GPT2Config) -> int:
    """Trainable parameters (the LM head is tied to the token embedding)."""
    E, L = cfg.n_embd, cfg.n_layer
    per_layer = 12 * E * E + 13 * E
    return (cfg.vocab_size + cfg.n_positions) * E + L * per_layer + 2 * E


def _transformers_config(cfg: GPT2Config, eos_id: int | None) -> tuple[dict, dict]:
    """(config.json's values, the token ids config.json and generation_config.json both hold)."""
    config = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "n_positions": cfg.n_positions,
              "vocab_size": cfg.vocab_size, "n_inner": None, "activation_function": "gelu_new",
              "layer_norm_epsilon": cfg.layer_norm_epsilon, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
              "attn_pdrop": cfg.dropout, "initializer_range": cfg.initializer_range, "tie_word_embeddings": True}
    return config, ({"bos_token_id": eos_id, "eos_token_id": eos_id} if eos_id is not None else {})


def _transformers_tokenizer(eos: str | None) -> tuple[dict, dict]:
    """(special tokens: the end-of-document token for all three, more tokenizer_config.json keys)."""
    return ({"bos_token": eos, "eos_token": eos, "unk_token": eos} if eos else {}), {}


FAMILY = register(Family(
    name="gpt2", section=GPT2Config, build=build_gpt2, init_weights=init_weights, param_specs=param_specs,
    inputs=("input_ids",), logits="logits", sequence_inputs=True,
    kv_cache=lambda cfg, weights: build_gpt2(cfg, weights, kv_cache=True),
    positions_tensor="transformer.wpe.weight", dropout_fields=("dropout",),
    layers_above=layers_above,
    transformers=Transformers(architecture="GPT2LMHeadModel", model_type="gpt2", prefix="transformer.",
                              tied={"lm_head.weight": "transformer.wte.weight"},
                              config=_transformers_config, tokenizer=_transformers_tokenizer),
    tasks=("causal_lm", "sequence_classification"), task=lambda task, n: with_task(task, n),
    lora_targets=("c_attn",), embeddings=("transformer.wte.weight", "transformer.wpe.weight")))
