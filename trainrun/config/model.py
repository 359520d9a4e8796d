"""The schema's ``model`` section: the built-in families' sections (GPT-2, BERT, Llama), the loss keys, the
families ``model.builtin`` names and the sections of families added from outside (``add_family_section``).

What a family is beyond its section lives in trainrun/models/; this is the one other place that names the
built-in ones (the schema is where every user-facing key is written and documented)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Union

from .fields import opt


@dataclass
class GPT2Config:
    n_layer: int = opt(2, min=1)
    """Number of transformer blocks."""
    n_head: int = opt(4, min=1)
    """Attention heads per block (must divide n_embd)."""
    n_embd: int = opt(128, min=1)
    """Width of the residual stream."""
    n_positions: int = opt(256, min=1)
    """Longest sequence the position embedding covers."""
    vocab_size: int = opt(1024, min=2)
    """Vocabulary size (tokens must be below it)."""
    dropout: float = opt(0.0, min=0.0, max=0.999)
    """Dropout while training, placed as transformers' GPT-2: embeddings, attention probabilities,
    after each c_proj (attention and MLP); masks from run.seed and the sample position."""
    layer_norm_epsilon: float = opt(1e-5, gt=0.0)
    """Epsilon of every LayerNorm."""
    initializer_range: float = opt(0.02, gt=0.0)
    """Std of the normal initialisation (residual projections scaled by 1/sqrt(2 n_layer))."""

    # the fields of a transformers config.json that fix the shape (model.init_from)
    CONFIG_JSON_SHAPE: ClassVar[tuple] = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size",
                                          "layer_norm_epsilon")
    POSITIONS: ClassVar[str] = "n_positions"      # the field that is the longest sequence

    def problems(self) -> list[tuple[str, str]]:
        if self.n_head and self.n_embd % self.n_head:
            return [("n_head", f"must divide n_embd ({self.n_embd}), got {self.n_head}")]
        return []


@dataclass
class BertConfig:
    vocab_size: int = opt(1024, min=2)
    """Vocabulary size (token ids must be below it; id 0 is [PAD])."""
    hidden_size: int = opt(128, min=1)
    """Width of the encoder."""
    num_hidden_layers: int = opt(2, min=1)
    """Number of encoder layers."""
    num_attention_heads: int = opt(4, min=1)
    """Attention heads per layer (must divide hidden_size)."""
    intermediate_size: int = opt(512, min=1)
    """Width of each layer's feed-forward block."""
    max_position_embeddings: int = opt(512, min=1)
    """Longest sequence the position embedding covers."""
    type_vocab_size: int = opt(2, min=1)
    """Token types (segment ids) the token-type embedding covers."""
    hidden_act: str = opt("gelu", choices=["gelu", "gelu_new"])
    """Activation of the feed-forward block and the MLM head: gelu (erf form) or gelu_new (tanh form)."""
    layer_norm_eps: float = opt(1e-12, gt=0.0)
    """Epsilon of every LayerNorm."""
    hidden_dropout_prob: float = opt(0.1, min=0.0, max=0.999)
    """Dropout on the embeddings and after each attention-output and output dense layer."""
    attention_probs_dropout_prob: float = opt(0.1, min=0.0, max=0.999)
    """Dropout on the attention probabilities."""
    initializer_range: float = opt(0.02, gt=0.0)
    """Std of the normal initialisation of weights and embeddings."""

    # the fields of a transformers config.json that fix the shape (model.init_from)
    CONFIG_JSON_SHAPE: ClassVar[tuple] = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "intermediate_size", "max_position_embeddings", "type_vocab_size",
                                          "hidden_act", "layer_norm_eps")
    POSITIONS: ClassVar[str] = "max_position_embeddings"      # the field that is the longest sequence

    def problems(self) -> list[tuple[str, str]]:
        if self.num_attention_heads and self.hidden_size % self.num_attention_heads:
            return [("num_attention_heads",
                     f"must divide hidden_size ({self.hidden_size}), got {self.num_attention_heads}")]
        return []


LLAMA_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass
class LlamaConfig:
    model_type: str = opt("llama", choices=list(LLAMA_ARCHITECTURES))
    """The transformers class (config.json's model_type): llama (LlamaForCausalLM: Llama 2/3, SmolLM2,
    TinyLlama), qwen2 (Qwen2ForCausalLM: q/k/v biases, attention_bias true) or mistral (MistralForCausalLM)."""
    vocab_size: int = opt(1024, min=2)
    """Vocabulary size (tokens must be below it)."""
    hidden_size: int = opt(128, min=1)
    """Width of the residual stream."""
    intermediate_size: int = opt(256, min=1)
    """Width of each layer's SwiGLU MLP (gate_proj, up_proj)."""
    num_hidden_layers: int = opt(2, min=1)
    """Number of decoder layers."""
    num_attention_heads: int = opt(4, min=1)
    """Query heads per layer."""
    num_key_value_heads: Optional[int] = opt(None, min=1)
    """Key/value heads per layer (grouped-query attention; 1: multi-query); must divide
    num_attention_heads. null: num_attention_heads."""
    head_dim: Optional[int] = opt(None, min=2)
    """Width of each head (even). null: hidden_size / num_attention_heads."""
    rms_norm_eps: float = opt(1e-6, gt=0.0)
    """Epsilon of every RMSNorm."""
    rope_theta: float = opt(10000.0, gt=0.0)
    """Base of the rotary embeddings' frequencies."""
    rope_scaling: dict[str, Union[str, float]] = opt(factory=dict)
    """Rotary scaling as transformers' rope_scaling: {} (none), {rope_type: linear, factor} or
    {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}."""
    max_position_embeddings: int = opt(256, min=1)
    """Longest sequence (the rotary tables' length)."""
    sliding_window: Optional[int] = opt(None, min=1)
    """mistral: its attention window; data.seq_len (and generate's window) must not exceed it. null: none."""
    tie_word_embeddings: bool = False
    """The LM head is the token embedding (SmolLM2, Llama 3.2 1B/3B); false: its own lm_head.weight."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (qwen2: always) and, for llama, on o_proj."""
    mlp_bias: bool = False
    """Biases on gate_proj, up_proj and down_proj."""
    bos_token_id: Optional[int] = opt(None, min=0)
    """Beginning-of-sequence id written to config.json (null: the end-of-sequence id, as GPT-2's)."""
    eos_token_id: Optional[int] = opt(None, min=0)
    """End-of-sequence id written to config.json (null: the run's tokenizer's end-of-document id)."""
    pad_token_id: Optional[int] = opt(None, min=0)
    """Padding id written to config.json (null: none)."""
    initializer_range: float = opt(0.02, gt=0.0)
    """Std of the normal initialisation of the embeddings and projections."""

    # the fields of a transformers config.json that fix the shape (model.init_from; from_config_json reads
    # them and the token ids and initializer_range, which fill the section but need not agree with it)
    CONFIG_JSON_SHAPE: ClassVar[tuple] = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                          "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                                          "max_position_embeddings", "sliding_window", "tie_word_embeddings",
                                          "attention_bias", "mlp_bias")

    def __post_init__(self):        # the derived defaults written out are the defaults (null)
        if self.num_key_value_heads == self.num_attention_heads:
            self.num_key_value_heads = None
        if self.head_dim and self.num_attention_heads and self.head_dim * self.num_attention_heads == self.hidden_size:
            self.head_dim = None

    @property
    def POSITIONS(self) -> str:     # noqa: N802 - the field that is the longest sequence
        small = self.sliding_window is not None and self.sliding_window < self.max_position_embeddings
        return "sliding_window" if small else "max_position_embeddings"

    @property
    def heads_dim(self) -> int:
        return self.head_dim or (self.hidden_size // self.num_attention_heads)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            out.append(("num_attention_heads", f"must divide hidden_size ({self.hidden_size}), got "
                        f"{self.num_attention_heads} (or give head_dim)"))
        if self.heads_dim % 2:
            out.append(("head_dim", f"must be even (the rotary embedding rotates halves), got {self.heads_dim}"))
        if self.num_attention_heads % self.kv_heads:
            out.append(("num_key_value_heads", f"must divide num_attention_heads ({self.num_attention_heads}), "
                        f"got {self.kv_heads}"))
        if self.model_type not in LLAMA_ARCHITECTURES:
            out.append(("model_type", f"{self.model_type!r} is not one of: {', '.join(LLAMA_ARCHITECTURES)}"))
        if self.model_type == "qwen2" and not self.attention_bias:
            out.append(("attention_bias", "qwen2 has q/k/v biases: set it true"))
        if self.sliding_window is not None and self.model_type != "mistral":
            out.append(("sliding_window", f"a window is built for mistral only, not {self.model_type}"))
        kind = self.rope_scaling.get("rope_type", "default") if self.rope_scaling else "default"
        if kind not in ROPE_TYPES:
            out.append(("rope_scaling", f"rope_type {kind!r} is not one of: {', '.join(ROPE_TYPES)}"))
        else:
            missing = [k for k in ROPE_TYPES[kind] if not isinstance(self.rope_scaling.get(k), (int, float))]
            if missing:
                out.append(("rope_scaling", f"rope_type {kind} needs {', '.join(missing)} (numbers)"))
        return out

    @staticmethod
    def from_config_json(source: dict) -> dict:
        """The section's values from a transformers config.json of LlamaForCausalLM, Qwen2ForCausalLM or
        MistralForCausalLM: rope as transformers 4's rope_theta + rope_scaling or 5's rope_parameters."""
        kind = source.get("model_type", "llama")
        out = {k: source[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "max_position_embeddings") if k in source}
        out["model_type"] = kind
        heads = source.get("num_attention_heads", 0)
        out["num_key_value_heads"] = None if source.get("num_key_value_heads") == heads else \
            source.get("num_key_value_heads")
        head_dim = source.get("head_dim")      # the default written out by some versions: none of ours
        out["head_dim"] = None if head_dim and heads and head_dim * heads == source.get("hidden_size") else head_dim
        out["rms_norm_eps"] = float(source.get("rms_norm_eps", 1e-6))
        rope = dict(source.get("rope_parameters") or source.get("rope_scaling") or {})
        if "type" in rope:      # transformers 4's older name of rope_type
            rope.setdefault("rope_type", rope.pop("type"))
        out["rope_theta"] = float(rope.pop("rope_theta", source.get("rope_theta", 10000.0)))
        out["rope_scaling"] = {} if rope.get("rope_type", "default") == "default" else \
            {k: float(v) if isinstance(v, (int, float)) else v for k, v in rope.items() if v is not None}
        out["tie_word_embeddings"] = bool(source.get("tie_word_embeddings", False))
        out["attention_bias"] = True if kind == "qwen2" else bool(source.get("attention_bias", False))
        out["mlp_bias"] = bool(source.get("mlp_bias", False))
        window = source.get("sliding_window")
        out["sliding_window"] = window if kind == "mistral" or (kind == "qwen2" and source.get("use_sliding_window")) \
            else None
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = source.get(key)
            out[key] = ids[0] if isinstance(ids, list) and ids else ids if isinstance(ids, int) else None
        if "initializer_range" in source:
            out["initializer_range"] = float(source["initializer_range"])
        return out

    @staticmethod
    def config_json_problems(source: dict) -> list[tuple[str, str]]:
        """(field, why) of each config.json field whose value asks for math the family does not build
        (rope_scaling's types are model.llama.rope_scaling's own check)."""
        out = []
        for key, default, built in (("hidden_act", "silu", "the MLP is SwiGLU: silu only"),
                                    ("attention_dropout", 0.0, "no dropout: 0 only"), ("pretraining_tp", 1, "1 only")):
            value = source.get(key, default)
            if value is not None and value != default:
                out.append((key, f"{value!r} is not built ({built})"))
        return out


@dataclass
class LossConfig:
    type: str = opt("cross_entropy", choices=["cross_entropy", "mse", "l1"])
    """cross_entropy (integer labels; eval accuracy, and top-5 accuracy when there are >= 5 classes),
    mse or l1 (float targets of the output's shape; eval mse and mae); each the mean over the micro-batch."""
    output: Optional[str] = None
    """An output of the forward graph that already is the scalar loss (type, logits and labels unused:
    the graph's own inputs carry the labels)."""
    logits: str = "logits"
    """Name of the forward graph output holding the logits (cross_entropy) or predictions (mse, l1)."""
    labels: str = "labels"
    """Name of the labels input (created as a graph input of the loss)."""
    ignore_index: int = -100
    """cross_entropy: label value that does not count towards the loss nor the accuracy."""
    class_axis: int = opt(-1, choices=[-1, 1])
    """cross_entropy: the logits' class axis. -1: classes last, [N, C] or [N, S, V] (language models;
    labels [N] or [N, S]); 1: ONNX's SoftmaxCrossEntropyLoss layout [N, C, d1, ...] (labels [N, d1, ...])."""
    weights: list[float] = opt(factory=list)
    """cross_entropy: one weight per class (empty: all 1); the mean is weighted as PyTorch's."""
    label_smoothing: float = opt(0.0, min=0.0)
    """cross_entropy, in [0, 1): the target is (1 - s) on the label plus s / C spread over the C classes,
    as torch.nn.functional.cross_entropy(label_smoothing=s) (with class weights and ignore_index too). The
    train loss and the eval `loss` are the smoothed loss (as HF Trainer reports); eval `perplexity`
    (model.builtin gpt2) comes from the plain cross-entropy, `eval_ce`. train.precision fp32 only."""


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT's LoRA, its names and meanings) on a built-in model's linear layers: each
    targeted layer y = x W (+ b) gains (dropout(x) A^T B^T) alpha / r, A [r, in] initialised as PEFT does
    (kaiming-uniform), B [out, r] zeros. The base weights are frozen; the adapters (and modules_to_save) alone train."""
    r: int = opt(8, min=1)
    """The adapters' rank."""
    alpha: float = opt(8.0, gt=0.0)
    """PEFT's lora_alpha: the adapters' output is scaled by alpha / r."""
    dropout: float = opt(0.0, min=0.0, max=0.99)
    """PEFT's lora_dropout: dropout on each adapter's input (trainrun's dropout masks)."""
    target_modules: list[str] = opt(factory=list)
    """Linear layers to adapt, matched as PEFT matches them against the transformers module names (a name
    equal to an entry or ending in `.<entry>`); empty: PEFT's default for the family (gpt2 `c_attn`, llama
    `q_proj`, `v_proj`, bert `query`, `value`). An entry that matches no linear layer is an error."""
    modules_to_save: list[str] = opt(factory=list)
    """Modules trained in full beside the adapters (e.g. `score`, a classification head), matched as
    target_modules."""


# model.builtin's values: a family's name is that of its section below (the built-in families' sections
# are part of the schema here; trainrun.models.registry adds a family defined elsewhere with
# add_family_section). What a family is beyond its section lives in trainrun/models/.
FAMILIES: dict[str, type] = {"gpt2": GPT2Config, "bert": BertConfig, "llama": LlamaConfig}
_BUILTIN_CHOICES = [*FAMILIES, None]
_ADDED: dict[str, type] = {}        # sections of families added with add_family_section


def positions(section) -> int:
    """The longest sequence a family's section covers."""
    return getattr(section, section.POSITIONS)


def config_json_values(section, source: dict) -> dict:
    """The values of ``section``'s fields (an instance) that a transformers config.json (``source``) fixes:
    its ``from_config_json`` where it has one, else each of CONFIG_JSON_SHAPE that ``source`` holds."""
    own = getattr(section, "from_config_json", None)
    if own is not None:
        return own(source)
    return {k: type(getattr(section, k))(source[k]) for k in section.CONFIG_JSON_SHAPE if k in source}


def add_family_section(name: str, section: type) -> None:
    """Make ``model.builtin: <name>`` valid, with ``section`` (a dataclass: ``vocab_size``,
    ``POSITIONS``, ``problems()``, ``CONFIG_JSON_SHAPE``) as ``model.<name>``."""
    if FAMILIES.get(name, section) is not section:
        raise ValueError(f"model.{name}: a section of another class exists already")
    if name not in FAMILIES:
        FAMILIES[name] = _ADDED[name] = section
        _BUILTIN_CHOICES.insert(len(_BUILTIN_CHOICES) - 1, name)


@dataclass
class ModelConfig:
    builtin: Optional[str] = opt("gpt2", choices=_BUILTIN_CHOICES)
    """Built-in model to build (null when `onnx` names a forward graph)."""
    gpt2: GPT2Config = opt(factory=GPT2Config)
    """Shape of the built-in GPT-2."""
    bert: BertConfig = opt(factory=BertConfig)
    """Shape of the built-in BERT (BertForPreTraining: MLM + NSP loss in the graph)."""
    llama: LlamaConfig = opt(factory=LlamaConfig)
    """Shape of the built-in Llama-family decoder (transformers' LlamaConfig names; Qwen2 and Mistral too)."""
    onnx: Optional[str] = opt(None, path="file")
    """A user's forward ONNX model (inputs -> logits); its initializers are the parameters."""
    inputs: list[str] = opt(factory=list)
    """Data inputs of the forward graph (empty: every graph input that is not an initializer); each is fed
    by the dataset feature of its name, or the one data.inputs maps it to."""
    loss: LossConfig = opt(factory=LossConfig)
    """How the loss is computed from the forward graph's outputs."""
    frozen: list[str] = opt(factory=list)
    """Parameter name patterns (fnmatch) that are not trained; each must match a parameter (or a tensor that
    is frozen anyway: a buffer, LoRA's base)."""
    trainable: list[str] = opt(factory=list)
    """Parameter names or patterns (fnmatch) that train, all others frozen (empty: every parameter trains);
    each must match a parameter. A parameter that model.frozen also matches is frozen."""
    lora: Optional[LoraConfig] = None
    """Train low-rank adapters (PEFT's LoRA) on the built-in model's frozen weights (null: train the
    weights themselves); see docs/models.md, "LoRA"."""
    task: Optional[str] = None
    """The head on the built-in model (null: its own, pretraining for bert, causal_lm for gpt2 and llama):
    `sequence_classification` (bert) puts a classifier on the pooled [CLS] token, as transformers'
    BertForSequenceClassification, trained on the dataset feature `labels` (`trainrun-data labelled`)
    with cross-entropy, or with mean squared error when num_labels is 1 (regression);
    `token_classification` (bert) a classifier on every token (BertForTokenClassification; labels -100
    ignored); `sequence_classification` (gpt2, llama): the last token's state -> `score` (GPT2ForSequenceClassification,
    LlamaForSequenceClassification and Qwen2's and Mistral's, reading `input_ids` and `input_mask`). Eval adds `accuracy` and macro `f1` (regression: `pearson`,
    `spearman`)."""
    num_labels: int = opt(2, min=1)
    """Classes of model.task's head (1: a regression); must equal the train dataset's num_labels."""
    init_from: Optional[str] = opt(None, path="any")
    """Start the built-in model from these weights: a transformers save_pretrained directory (config.json +
    model.safetensors, or model.safetensors.index.json and its shards; its shape fields must match model.<builtin>, or fill it when the config gives no
    such section), a .safetensors file, or a trainrun run/checkpoint directory (weights only)."""

    def __post_init__(self):
        for name, section in _ADDED.items():     # an added family's section (not a dataclass field)
            if not isinstance(getattr(self, name, None), section):
                setattr(self, name, section())

    def family_section(self):
        """The section of ``builtin`` (None for a user's model.onnx)."""
        return getattr(self, self.builtin) if self.builtin else None
