"""The Llama-family decoder (input_ids -> logits), built directly as ONNX: transformers' LlamaForCausalLM,
and Qwen2ForCausalLM / MistralForCausalLM, which differ from it in biases and the attention window only.

Token embedding, pre-norm decoder layers (RMSNorm; grouped-query causal self-attention with rotary
embeddings applied as transformers applies them, ``x cos + rotate_half(x) sin`` with rotate_half(x) =
[-x2, x1] over each head's halves; SwiGLU MLP ``down(silu(gate(x)) * up(x))``), a final RMSNorm and the LM
head (its own ``lm_head.weight``, or the token embedding when ``tie_word_embeddings``). Parameter names and
layouts are those of transformers' state dict (Linear weights [out, in]), so weights move between the two
unchanged. Standard ONNX ops only (Gemm, MatMul, Mul, Add, Div, Sqrt, ReduceMean, Sigmoid, Softmax,
Reshape/Transpose/Split/Concat/Neg, Gather, Range/Less/Where for the causal mask, Cast/Cos/Sin for the
rotary angles of the graph's positions). No torch needed.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..config import LlamaConfig
from ..config.model import LLAMA_ARCHITECTURES
from .onnx_builder import CLS_INPUTS, MASK_VALUE, Graph, decoder_io, last_token_head, right_padded_sample
from .registry import Family, Transformers, classifier_config, register

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def _biases(cfg: LlamaConfig) -> tuple[bool, bool]:
    """(q/k/v projections biased, o_proj biased): Qwen2's q/k/v biases only, Llama's attention_bias all four."""
    return cfg.attention_bias, cfg.attention_bias and cfg.model_type != "qwen2"


def param_specs(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every parameter's shape and initialisation (``normal``, ``ones``, ``zeros``), in the graph's order."""
    E, H, KV, D, I = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.heads_dim, cfg.intermediate_size
    qkv_bias, o_bias = _biases(cfg)
    s = {EMBED: ((cfg.vocab_size, E), "normal")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = ((E,), "ones")
        for name, out in (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D)):
            s[p + f"self_attn.{name}.weight"] = ((out, E), "normal")
            if qkv_bias:
                s[p + f"self_attn.{name}.bias"] = ((out,), "zeros")
        s[p + "self_attn.o_proj.weight"] = ((E, H * D), "normal")
        if o_bias:
            s[p + "self_attn.o_proj.bias"] = ((E,), "zeros")
        s[p + "post_attention_layernorm.weight"] = ((E,), "ones")
        for name, shape in (("gate_proj", (I, E)), ("up_proj", (I, E)), ("down_proj", (E, I))):
            s[p + f"mlp.{name}.weight"] = (shape, "normal")
            if cfg.mlp_bias:
                s[p + f"mlp.{name}.bias"] = ((shape[0],), "zeros")
    s["model.norm.weight"] = ((E,), "ones")
    if not cfg.tie_word_embeddings:
        s[HEAD] = ((cfg.vocab_size, E), "normal")
    return s


def init_weights(cfg: LlamaConfig, seed: int, specs: dict | None = None) -> dict[str, np.ndarray]:
    """transformers' initialisation: N(0, initializer_range) weights and embeddings, biases 0, RMSNorm 1.
    Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)

    def make(shape, init):
        if init == "normal":
            return (rng.standard_normal(shape, dtype=np.float32) * np.float32(cfg.initializer_range)).astype(np.float32)
        return (np.ones if init == "ones" else np.zeros)(shape, np.float32)
    return {name: make(shape, init) for name, (shape, init) in (specs or param_specs(cfg)).items()}


def layers_above(cfg: LlamaConfig, name: str) -> int:
    """``optimizer.layer_decay``'s exponent: the token embedding num_hidden_layers + 1, layer i (0-based)
    num_hidden_layers - i, the final norm and the head 0."""
    if name == EMBED:
        return cfg.num_hidden_layers + 1
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return cfg.num_hidden_layers - int(m.group(1)) if m else 0


def inverse_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] as transformers computes them (float32; the
    ``linear`` and ``llama3`` scalings)."""
    D = cfg.heads_dim
    exponent = (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)).astype(np.float32)
    inv = (1.0 / np.power(np.float32(cfg.rope_theta), exponent, dtype=np.float32)).astype(np.float32)
    rope = cfg.rope_scaling or {}
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        inv = (inv / np.float32(rope["factor"])).astype(np.float32)
    elif kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv.astype(np.float64)
        scaled = np.where(wavelen > old / low, inv / np.float32(factor), inv).astype(np.float32)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def build_llama(cfg: LlamaConfig, weights: dict[str, np.ndarray], kv_cache: bool = False,
                num_labels: int | None = None) -> onnx.ModelProto:
    """The forward graph with ``weights`` as initializers; input ``input_ids`` int64 [batch, seq], output
    ``logits`` float32 [batch, seq, vocab].

    ``kv_cache``: the inference graph for generation. Per layer ``i`` it also takes ``past.{i}.key`` /
    ``past.{i}.value`` [batch, num_key_value_heads, past, head_dim] (keys after the rotary embedding,
    transformers' cache layout; ``past`` may be 0) and returns ``present.{i}.key`` / ``present.{i}.value``
    [batch, num_key_value_heads, past + seq, head_dim]; positions start at ``past``.

    ``num_labels``: <Model>ForSequenceClassification's head in place of the LM head (inputs ``input_ids``
    and ``input_mask``, output ``logits`` [batch, num_labels]: :func:`~.onnx_builder.last_token_head`).
    """
    E, H, KV, D = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.heads_dim
    G = H // KV
    qkv_bias, o_bias = _biases(cfg)
    g = Graph()
    for name, value in weights.items():
        g.const(name, value)
    g.const("rope_inv_freq", inverse_frequencies(cfg))
    g.const("c_zero1", np.array([0], np.int64))
    g.const("c_zero", np.array(0, np.int64))
    g.const("c_one", np.array(1, np.int64))
    g.const("c_rows", np.array([-1], np.int64))
    g.const("c_flat_shape", np.array([-1, E], np.int64))
    g.const("c_width", np.array([E], np.int64))
    g.const("c_q_shape", np.array([KV, G, D], np.int64))
    g.const("c_kv_shape", np.array([KV, D], np.int64))
    g.const("c_heads_flat", np.array([-1, H * D], np.int64))
    g.const("c_axis_rows", np.array([1], np.int64))
    g.const("c_kv_axis", np.array([2], np.int64))
    g.const("c_scale", np.array(1.0 / math.sqrt(D), np.float32))
    g.const("c_eps", np.array(cfg.rms_norm_eps, np.float32))
    g.const("c_mask", np.array(MASK_VALUE, np.float32))
    g.const("c_unmasked", np.array(0.0, np.float32))

    def rms_norm(x, weight):
        var = g.op("ReduceMean", [g.op("Mul", [x, x])], axes=[-1], keepdims=1)
        return g.op("Mul", [g.op("Div", [x, g.op("Sqrt", [g.op("Add", [var, "c_eps"])])]), weight])

    def linear(x, prefix, bias):
        return g.op("Gemm", [x, prefix + ".weight", *([prefix + ".bias"] if bias else [])], transB=1)

    def rotate(x, cos, sin):
        """x cos + rotate_half(x) sin over the last axis (x [..., S, D], cos/sin [S, D])."""
        x1, x2 = g.op("Split", [x], n_out=2, axis=-1)
        half = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [half, sin])])

    seq = g.op("Shape", ["input_ids"], start=1, end=2)                        # [1]
    past = g.op("Shape", ["past.0.key"], start=2, end=3) if kv_cache else "c_zero1"
    total = g.op("Add", [past, seq])
    # the causal mask [S, T]: query row r (position past + r) sees keys 0..past + r
    rows = g.op("Range", [g.op("Squeeze", [past, "c_zero1"]), g.op("Squeeze", [total, "c_zero1"]), "c_one"])
    # cos and sin [S, D] of positions past..total, as transformers computes them: the angles position x
    # inverse frequency in float32, each half of the head the same, cos and sin in float32
    angles = g.op("Mul", [g.op("Unsqueeze", [g.op("Cast", [rows], to=TensorProto.FLOAT), "c_axis_rows"]),
                          "rope_inv_freq"])
    angles = g.op("Concat", [angles, angles], axis=-1)
    cos, sin = g.op("Cos", [angles]), g.op("Sin", [angles])
    keys = g.op("Range", ["c_zero", g.op("Squeeze", [total, "c_zero1"]), "c_one"])
    future = g.op("Less", [g.op("Unsqueeze", [rows, "c_axis_rows"]), keys])
    mask = g.op("Where", [future, "c_mask", "c_unmasked"])

    h = g.op("Reshape", [g.op("Gather", [EMBED, "input_ids"], axis=0), "c_flat_shape"])   # [B*S, E]
    q_shape = g.op("Concat", ["c_rows", seq, "c_q_shape"], axis=0)            # [B, S, KV, G, D]
    kv_shape = g.op("Concat", ["c_rows", seq, "c_kv_shape"], axis=0)          # [B, S, KV, D]
    seq_shape = g.op("Concat", ["c_rows", seq, "c_width"], axis=0)            # [B, S, E]

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        a = rms_norm(h, p + ".input_layernorm.weight")
        # query head h reads key/value head h // G (transformers' repeat_kv): queries [B, KV, G, S, D]
        # against keys [B, KV, 1, T, D], the group axis broadcast
        q = g.op("Transpose", [g.op("Reshape", [linear(a, p + ".self_attn.q_proj", qkv_bias), q_shape])],
                 perm=[0, 2, 3, 1, 4])
        k = g.op("Transpose", [g.op("Reshape", [linear(a, p + ".self_attn.k_proj", qkv_bias), kv_shape])],
                 perm=[0, 2, 1, 3])                                                       # [B, KV, S, D]
        v = g.op("Transpose", [g.op("Reshape", [linear(a, p + ".self_attn.v_proj", qkv_bias), kv_shape])],
                 perm=[0, 2, 1, 3])
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if kv_cache:
            for name, new in (("key", k), ("value", v)):
                g.nodes.append(helper.make_node("Concat", [f"past.{i}.{name}", new], [f"present.{i}.{name}"],
                                                name=f"present.{i}.{name}", axis=2))
            k, v = f"present.{i}.key", f"present.{i}.value"
        kt = g.op("Unsqueeze", [g.op("Transpose", [k], perm=[0, 1, 3, 2]), "c_kv_axis"])      # [B, KV, 1, D, T]
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, kt]), "c_scale"]), mask])       # [B, KV, G, S, T]
        probs = g.op("Softmax", [scores], axis=-1)
        y = g.op("MatMul", [probs, g.op("Unsqueeze", [v, "c_kv_axis"])])                     # [B, KV, G, S, D]
        y = g.op("Reshape", [g.op("Transpose", [y], perm=[0, 3, 1, 2, 4]), "c_heads_flat"])   # [B*S, H*D]
        h = g.op("Add", [h, linear(y, p + ".self_attn.o_proj", o_bias)])

        m = rms_norm(h, p + ".post_attention_layernorm.weight")
        gate = linear(m, p + ".mlp.gate_proj", cfg.mlp_bias)
        act = p + ".mlp.act"      # a stable name for debug.tensors: silu(gate) * up
        g.nodes.append(helper.make_node("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]),
                                                linear(m, p + ".mlp.up_proj", cfg.mlp_bias)], [act], name=act))
        h = g.op("Add", [h, linear(act, p + ".mlp.down_proj", cfg.mlp_bias)])

    normed = rms_norm(h, "model.norm.weight")                                  # [B*S, E]
    if num_labels is not None:
        return last_token_head(g, g.op("Reshape", [normed, seq_shape]), E, num_labels, "llama")
    if cfg.tie_word_embeddings:     # the token embedding read as [E, vocab] (ort_gradients scatters its gradient)
        g.nodes.append(helper.make_node("MatMul", [g.op("Reshape", [normed, seq_shape]),
                                                   g.op("Transpose", [EMBED], perm=[1, 0])], ["logits"], name="lm_head"))
    else:                           # a linear layer on rows like the others (model.lora may adapt it)
        g.const("c_vocab", np.array([cfg.vocab_size], np.int64))
        g.nodes.append(helper.make_node("Reshape", [linear(normed, "lm_head", False),
                                                    g.op("Concat", ["c_rows", seq, "c_vocab"], axis=0)],
                                        ["logits"], name="lm_head"))

    return g.model("llama", *decoder_io(cfg.vocab_size, cfg.num_hidden_layers, KV, D, kv_cache))


def param_count(cfg: LlamaConfig) -> int:
    return sum(int(np.prod(shape)) for shape, _ in param_specs(cfg).values())


def _transformers_config(cfg: LlamaConfig, eos_id: int | None) -> tuple[dict, dict]:
    """(config.json's values, the token ids config.json and generation_config.json both hold)."""
    config = {"architectures": [LLAMA_ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.kv_heads,
              "head_dim": cfg.heads_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
              "max_position_embeddings": cfg.max_position_embeddings, "initializer_range": cfg.initializer_range,
              "tie_word_embeddings": cfg.tie_word_embeddings, "rope_theta": cfg.rope_theta,
              "rope_scaling": _rope_json(cfg.rope_scaling) or None, "attention_dropout": 0.0}
    if cfg.model_type == "llama":
        config.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    if cfg.model_type == "mistral" or cfg.model_type == "qwen2":
        config.update(sliding_window=cfg.sliding_window, use_sliding_window=cfg.sliding_window is not None)
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else eos_id
    ids = {k: v for k, v in (("bos_token_id", cfg.bos_token_id if cfg.bos_token_id is not None else eos),
                             ("eos_token_id", eos), ("pad_token_id", cfg.pad_token_id)) if v is not None}
    return config, ids


def _rope_json(rope: dict) -> dict:
    """rope_scaling as config.json holds it (original_max_position_embeddings an integer)."""
    out = dict(rope)
    if "original_max_position_embeddings" in out:
        out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return out


def _transformers_tokenizer(eos: str | None) -> tuple[dict, dict]:
    return ({"bos_token": eos, "eos_token": eos} if eos else {}), {}


def classifier_specs(cfg: LlamaConfig, num_labels: int) -> dict:
    """<Model>ForSequenceClassification's parameters: the decoder's (no LM head) and ``score.weight``
    [num_labels, hidden_size]."""
    specs = {n: spec for n, spec in param_specs(cfg).items() if n != HEAD}
    return {**specs, "score.weight": ((num_labels, cfg.hidden_size), "normal")}


def _sequence_classification(config):
    """``config`` of the causal LM's class as that of its <Model>ForSequenceClassification."""
    def classifier(cfg: LlamaConfig, eos_id: int | None) -> tuple[dict, dict]:
        values, ids = config(cfg, eos_id)
        name = LLAMA_ARCHITECTURES[cfg.model_type].replace("ForCausalLM", "ForSequenceClassification")
        return {**values, "architectures": [name]}, ids
    return classifier


def with_task(task: str, num_labels: int) -> Family:
    """The family with ``model.task``'s head: sequence_classification (LlamaForSequenceClassification's
    last-token pooling, and Qwen2's and Mistral's)."""
    return dataclasses.replace(
        FAMILY, build=lambda cfg, w: build_llama(cfg, w, num_labels=num_labels),
        init_weights=lambda cfg, seed: init_weights(cfg, seed, classifier_specs(cfg, num_labels)),
        param_specs=lambda cfg: classifier_specs(cfg, num_labels), inputs=tuple(CLS_INPUTS), kv_cache=None,
        sample_batch=lambda cfg, rng: right_padded_sample(cfg.vocab_size, num_labels, rng),
        transformers=dataclasses.replace(FAMILY.transformers, architecture="LlamaForSequenceClassification", tied={},
                                         optional=("score.",),
                                         config=_sequence_classification(classifier_config(_transformers_config,
                                                                                           num_labels))),
        tasks=(), task=None)


FAMILY = register(Family(
    name="llama", section=LlamaConfig, build=build_llama, init_weights=init_weights, param_specs=param_specs,
    inputs=("input_ids",), logits="logits", sequence_inputs=True,
    kv_cache=lambda cfg, weights: build_llama(cfg, weights, kv_cache=True),
    layers_above=layers_above,
    transformers=Transformers(architecture="LlamaForCausalLM", model_type="llama", prefix="model.",
                              tied={HEAD: EMBED}, config=_transformers_config, tokenizer=_transformers_tokenizer),
    tasks=("causal_lm", "sequence_classification"), task=lambda task, n: with_task(task, n),
    lora_targets=("q_proj", "v_proj"), embeddings=(EMBED,)))
