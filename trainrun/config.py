"""The run configuration: dataclasses, YAML loading, ``--set`` overrides, validation.

Every field is documented once, by the string literal that follows it (the
attribute docstring); ``trainrun config show`` prints those docstrings as YAML
comments. Constraints live in the field's metadata (``min``, ``max``,
``choices``, ``path``): the checks of one key at a time. The checks across keys
and of the files keys name belong to :mod:`trainrun.validity`, which
:func:`load_config` takes as ``checks``; it reports every problem at once, each
with its key path, as one :class:`~trainrun.errors.UsageError` (exit code 2).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Union

import yaml

from .errors import UsageError


def opt(default=dataclasses.MISSING, *, factory=None, min=None, max=None, gt=None,
        choices=None, path=None):
    """A dataclass field with validation metadata.

    ``path``: ``"file"`` or ``"dir"`` when the value names something that must exist.
    """
    meta = {k: v for k, v in dict(min=min, max=max, gt=gt, choices=choices, path=path).items()
            if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- schema

@dataclass
class RunConfig:
    name: str = "run"
    """Name of the run (shown in logs)."""
    output_dir: str = "runs/run"
    """Run directory: config.yaml, graphs/, checkpoints/, tensorboard/, metrics.jsonl, model.onnx."""
    seed: int = opt(1234, min=0)
    """Seed of the weight initialisation, the data order and dropout."""
    log_level: str = opt("info", choices=["warning", "info", "devinfo", "verbose"])
    """warning: quiet; info: progress; devinfo: + ORT logs and every rank; verbose: + tracebacks."""
    deterministic: bool = False
    """Bitwise-reproducible runs: no float-reordering graph rewrites, 1 thread (dropout stays on); on
    cuda also TF32 off. CUDA cannot promise bitwise: the tied embedding's gradient (ScatterElements add)
    sums with atomic adds, whose order varies from run to run (a few float32 ulps per element)."""


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


# model.builtin's values: a family's name is that of its section below (the built-in families' sections
# are part of the schema here; trainrun.models.registry adds a family defined elsewhere with
# add_family_section). What a family is beyond its section lives in trainrun/models/.
FAMILIES: dict[str, type] = {"gpt2": GPT2Config, "bert": BertConfig}
_BUILTIN_CHOICES = [*FAMILIES, None]
_ADDED: dict[str, type] = {}        # sections of families added with add_family_section


def positions(section) -> int:
    """The longest sequence a family's section covers."""
    return getattr(section, section.POSITIONS)


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
    onnx: Optional[str] = opt(None, path="file")
    """A user's forward ONNX model (inputs -> logits); its initializers are the parameters."""
    inputs: list[str] = opt(factory=list)
    """Data inputs of the forward graph (empty: every graph input that is not an initializer); each is fed
    by the dataset feature of its name, or the one data.inputs maps it to."""
    loss: LossConfig = opt(factory=LossConfig)
    """How the loss is computed from the forward graph's outputs."""
    frozen: list[str] = opt(factory=list)
    """Parameter name patterns (fnmatch) that are not trained."""
    task: Optional[str] = None
    """The head on the built-in model (null: its own, pretraining for bert, causal_lm for gpt2):
    `sequence_classification` (bert) puts a classifier on the pooled [CLS] token, as transformers'
    BertForSequenceClassification, trained on the dataset feature `labels` (`trainrun-data labelled`)
    with cross-entropy, or with mean squared error when num_labels is 1 (regression);
    `token_classification` (bert) a classifier on every token (BertForTokenClassification; labels -100
    ignored); `sequence_classification` (gpt2): the last token's state -> `score` (GPT2ForSequenceClassification,
    reading `input_ids` and `input_mask`). Eval adds `accuracy` and macro `f1` (regression: `pearson`,
    `spearman`)."""
    num_labels: int = opt(2, min=1)
    """Classes of model.task's head (1: a regression); must equal the train dataset's num_labels."""
    init_from: Optional[str] = opt(None, path="any")
    """Start the built-in model from these weights: a transformers save_pretrained directory (config.json +
    model.safetensors; its shape fields must match model.<builtin>, or fill it when the config gives no
    such section), a .safetensors file, or a trainrun run/checkpoint directory (weights only)."""

    def __post_init__(self):
        for name, section in _ADDED.items():     # an added family's section (not a dataclass field)
            if not isinstance(getattr(self, name, None), section):
                setattr(self, name, section())

    def family_section(self):
        """The section of ``builtin`` (None for a user's model.onnx)."""
        return getattr(self, self.builtin) if self.builtin else None


@dataclass
class DataConfig:
    train: Optional[str] = opt(None, path="dir")
    """Training dataset directory (trainrun-data output)."""
    eval: Union[str, dict[str, str], None] = opt(None, path="dir")
    """Evaluation dataset directory (optional), or several named ones `{NAME: DIR, ...}`: each evaluated at
    every evaluation, its metrics logged as `eval_<NAME>_<metric>` (TensorBoard `eval/<NAME>/<metric>`);
    a single directory logs `eval_<metric>` (`eval/<metric>`). Names: letters, digits, `_`, `-`."""
    seq_len: int = opt(128, min=1)
    """Tokens per sample (inputs; labels are the next tokens)."""
    shuffle: bool = True
    """Shuffle samples each epoch (a seeded permutation independent of the rank count)."""
    prefetch: int = opt(2, min=0)
    """Batches read ahead by a background thread (0: read synchronously)."""
    inputs: dict[str, str] = opt(factory=dict)
    """{graph input: dataset feature} for the inputs not fed by the feature of their own name (the loss's
    labels input defaults to the feature `labels`); checked against the graph at start-up."""

    def eval_sets(self) -> dict[Optional[str], str]:
        """{name: directory} of the eval sets; the name None for a single unnamed data.eval."""
        if not self.eval:
            return {}
        return dict(self.eval) if isinstance(self.eval, dict) else {None: self.eval}


def eval_key(name: Optional[str], metric: str) -> str:
    """The metrics key of an eval set's metric: `eval_<metric>`, or `eval_<name>_<metric>` for a named set."""
    return f"eval_{metric}" if name is None else f"eval_{name}_{metric}"


EVAL_NAME = re.compile(r"[A-Za-z0-9_-]+")


DEFAULT_MAX_STEPS = 100


def parse_duration(value) -> float:
    """Seconds of a number or an "HH:MM:SS" (or "MM:SS") string; ValueError unless positive."""
    if isinstance(value, str) and ":" in value:
        parts = value.split(":")
        if len(parts) > 3 or not all(re.fullmatch(r"\d+(\.\d*)?", p.strip()) for p in parts):
            raise ValueError(f"expected seconds or \"HH:MM:SS\", got {value!r}")
        seconds = 0.0
        for p in parts:
            seconds = seconds * 60 + float(p)
    else:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected seconds or \"HH:MM:SS\", got {value!r}") from None
    if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"must be a time > 0, got {value!r}")
    return seconds


@dataclass
class EarlyStoppingConfig:
    patience: int = opt(0, min=0)
    """Stop (with a checkpoint) after this many evaluations of train.eval_every in a row without improvement
    (0: never); keep_best's evaluations at other checkpoint steps do not count."""
    min_delta: float = opt(0.0, min=0.0)
    """The metric must beat the best by more than this to count as an improvement."""
    metric: Optional[str] = None
    """The eval metric watched, as metrics.jsonl names it: `eval_loss`, `eval_accuracy`, ... or with named
    eval sets `eval_<NAME>_<metric>` (null: the loss of data.eval, or of its first named set). Lower is
    better for a loss, perplexity, mse or mae; higher for the others (accuracy, f1, ...)."""


@dataclass
class TrainConfig:
    micro_batch_size: int = opt(8, min=1)
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: int = opt(1, min=1)
    """Micro-batches accumulated (in place) before each update."""
    max_steps: Optional[int] = opt(None, min=1)
    """Optimizer steps to train (the LR schedule spans them). Null: train.max_epochs's steps, or 100 when
    that is not set either; given with train.max_epochs, max_steps wins (as in HF Trainer)."""
    max_epochs: float = opt(0.0, min=0.0)
    """Passes over the train set (an epoch: data.train's samples, over all ranks; fractions allowed),
    resolved at start-up to ceil(max_epochs x train samples / global batch) steps, which the LR schedule
    spans (0: train.max_steps decides)."""
    max_time: Union[float, str, None] = None
    """Wall-clock limit of this session (seconds, or "HH:MM:SS"), counted from its start-up: once past it,
    every rank stops after the same step with a checkpoint and the job exits 75 (stopped, resumable), as
    on SIGTERM; `trainrun resume` continues, with the limit counted again (null: no limit). Leave time for
    the last step and its checkpoint under a scheduler's limit."""
    stop_at: int = opt(0, min=0)
    """Stop early at this step, with a checkpoint, without changing the schedule (0: run to max_steps);
    for time-limited jobs that `resume` later."""
    eval_every: int = opt(0, min=0)
    """Evaluate every N steps (0: only at the end, when an eval set is given)."""
    eval_steps: int = opt(8, min=1)
    """Batches per evaluation, each of global-batch size (so the same samples on any rank count); an eval
    set that ends first is evaluated whole, its last batch smaller (as `trainrun evaluate`). Each eval line
    says how many of the set's samples it covered."""
    log_every: int = opt(10, min=1)
    """Log train metrics every N steps."""
    sample_every: int = opt(0, min=0)
    """model.builtin gpt2: every N steps rank 0 writes a sample of 64 tokens after train.sample_prompt to the
    log and to TensorBoard (text, tag `samples`); top-k 40, seeded by run.seed and the step (0: never)."""
    sample_prompt: str = "\n"
    """The text train.sample_every's samples start from (encoded with the run's tokenizer)."""
    early_stopping: EarlyStoppingConfig = opt(factory=EarlyStoppingConfig)
    """Stop on eval loss (needs data.eval and evaluations: train.eval_every)."""
    precision: str = opt("fp32", choices=["fp32", "fp16", "bf16"])
    """Compute type of the train graph: fp32; fp16 or bf16 (float32 master parameters, a Cast after each
    in the graph; LayerNorm, Softmax and the loss in fp32; fp16 with dynamic loss scaling). fp16/bf16
    need device: cuda (onnxruntime's CPU provider lacks their training kernels)."""
    recompute: str = opt("none", choices=["none", "blocks"])
    """Activation recomputation: blocks = each transformer block's forward runs again in the backward pass,
    so only the blocks' inputs are kept between the passes (less memory for a larger micro-batch, about
    one more forward pass of time; the same gradients). Blocks are found from the parameter names
    PREFIX.<i>.… (the built-in models'; a user model's when its parameters are so named)."""

    def total_steps(self, train_samples: int, global_batch: int) -> int:
        """The step the run ends at: max_steps, else max_epochs's steps over ``train_samples``, else 100."""
        if self.max_steps:
            return self.max_steps
        if self.max_epochs:
            return max(1, math.ceil(self.max_epochs * train_samples / global_batch - 1e-9))
        return DEFAULT_MAX_STEPS

    def max_time_s(self) -> Optional[float]:
        """train.max_time in seconds (None: no limit); a bad value raises ValueError."""
        return None if self.max_time is None else parse_duration(self.max_time)


@dataclass
class ParamGroupConfig:
    params: str = ""
    """Parameter name pattern (fnmatch, case-sensitive) of the group."""
    lr_scale: float = opt(1.0, gt=0.0)
    """The group's learning rate is optimizer.lr (as scheduled) times this."""
    weight_decay: Optional[float] = opt(None, min=0.0)
    """The group's weight decay (null: optimizer.weight_decay, or 0 where a no_decay pattern matches)."""


@dataclass
class OptimizerConfig:
    name: str = opt("adamw", choices=["adam", "adamw", "lamb", "sgd"])
    """Update rule: adam (L2 in the gradient), adamw (decoupled decay), lamb (ORT's), sgd (momentum)."""
    lr: float = opt(1e-3, gt=0.0)
    """Peak learning rate."""
    betas: list[float] = opt(factory=lambda: [0.9, 0.999])
    """Adam/LAMB moment decay rates (beta1, beta2)."""
    eps: float = opt(1e-8, gt=0.0)
    """Adam/LAMB epsilon."""
    eps_mode: str = opt("torch", choices=["torch", "ort"])
    """AdamW/Adam epsilon placement: torch (sqrt(v_hat)+eps) or ort (sqrt(v)+eps, HF style)."""
    weight_decay: float = opt(0.0, min=0.0)
    """Weight decay (L2 for adam/sgd, decoupled for adamw, lambda for lamb)."""
    momentum: float = opt(0.0, min=0.0, max=1.0)
    """SGD momentum (0: plain SGD)."""
    nesterov: bool = False
    """SGD Nesterov momentum."""
    bias_correction: bool = True
    """Adam/AdamW/LAMB bias correction of the moments."""
    ratio_min: float = opt(0.0, min=0.0)
    """LAMB lower bound of the trust ratio."""
    ratio_max: float = opt(float("inf"), gt=0.0)
    """LAMB upper bound of the trust ratio."""
    max_grad_norm: float = opt(1.0, min=0.0)
    """Clip the global gradient L2 norm to this (0: no clipping)."""
    no_decay: list[str] = opt(factory=lambda: ["*bias", "*ln_*", "*LayerNorm*", "*layernorm*", "*norm*"])
    """Parameter name patterns (fnmatch) excluded from weight decay (groups of weight_decay 0 after
    optimizer.groups)."""
    groups: list[ParamGroupConfig] = opt(factory=list)
    """Parameter groups, each `{params: PATTERN, lr_scale: 1.0, weight_decay: null}`: for each key, the
    first group whose pattern matches a parameter's name and sets the key decides it (then no_decay,
    then optimizer.weight_decay); every pattern must match some trainable parameter. In every optimizer
    (lr scales LAMB's trust-ratio step) and with ZeRO-1; see docs/models.md."""
    layer_decay: float = opt(1.0, gt=0.0, max=1.0)
    """Layer-wise learning-rate decay (built-in models): the lr of a parameter is also scaled by
    layer_decay ** (L - i) in block i of L, layer_decay ** (L + 1) in the embeddings, 1 in the head and
    final norm (1.0: off)."""


@dataclass
class LRScheduleConfig:
    name: str = opt("cosine", choices=["constant", "linear", "poly", "cosine"])
    """Decay after warmup, as a pure function of the step."""
    warmup_steps: int = opt(0, min=0)
    """Steps of linear warmup from 0 to optimizer.lr."""
    min_lr: float = opt(0.0, min=0.0)
    """Floor the decay ends at (at max_steps)."""
    power: float = opt(0.5, gt=0.0)
    """Exponent of the poly schedule (0.5 as in ORT's runner; 1.0 is linear)."""


@dataclass
class CheckpointConfig:
    every: int = opt(0, min=0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = opt(3, min=1)
    """Complete checkpoints kept (older ones deleted after a newer one is committed)."""
    keep_best: int = opt(0, min=0)
    """Also keep the K best checkpoints by checkpoint.best_metric (never pruned by keep_last); checkpoint
    steps then evaluate too. `trainrun export RUN --best` exports the best."""
    best_metric: Optional[str] = None
    """The eval metric keep_best ranks by, named as train.early_stopping.metric (null: the loss of
    data.eval, or of its first named set)."""


@dataclass
class DistributedConfig:
    backend: str = opt("auto", choices=["auto", "mpi", "nccl", "none"])
    """Gradient collectives: auto (nccl on cuda, mpi on cpu, none for one rank)."""
    zero_stage: int = opt(0, choices=[0, 1])
    """0: replicated optimizer state; 1: optimizer state sharded over ranks (ZeRO-1: reduce-scatter,
    each rank updates its part with its part of the moments, allgather; CPU, mpi backend)."""
    intra_node: str = opt("shared", choices=["shared", "mpi"])
    """shared: the ranks of a node share one copy of the parameters (MPI-3 shared memory), reduce the
    gradients by reading each other's buffers and each update a slice of the parameters with its slice
    of the optimizer state; applies on the CPU with the mpi backend and the host optimizer kernel
    (elsewhere, or where shared windows are missing, with a warning: mpi). mpi: every rank its own copy,
    gradients reduced over MPI."""
    timeout_s: float = opt(300.0, gt=0.0)
    """A collective that takes longer fails the run instead of hanging."""
    reduce_dtype: str = opt("fp32", choices=["fp32", "bf16"])
    """The gradients' type on the wire between ranks: fp32, or bf16 (half the bytes; rounded to nearest even,
    summed in fp32; the sums, the optimizer and the master weights stay fp32; each reduced element within
    about 2^-7 of the sum of the ranks' magnitudes). Not the intra-node shared-memory sum (no wire: fp32):
    on one rank, or with every rank on one node sharing memory, nothing goes on the wire and rank 0 says so
    at start."""
    overlap_grad_reduce: bool = False
    """Reduce the gradients in buckets while the backward pass goes on, as PyTorch DDP does: the train graph
    is cut where each bucket's gradients are final and a background thread reduces a finished bucket while
    the next part of the backward pass computes (the last bucket, with the embeddings, after it). Applies
    to replicated updates over MPI on the CPU (zero_stage 0; one rank per node, or intra_node: mpi): refused
    with zero_stage 1, device cuda or backend nccl; off, as rank 0 says at start, where the ranks of a node
    share memory, on one rank, or when the gradients fit one bucket."""
    bucket_mb: float = opt(4.0, gt=0.0)
    """Size of a gradient bucket (MiB) for overlap_grad_reduce: smaller starts the wire sooner and leaves
    less after the backward pass, but cuts the train graph into more parts."""


@dataclass
class EngineConfig:
    threads: int = opt(0, min=0)
    """Intra-op threads per rank (0: the rank's share of the cores it may run on: cores / local ranks when
    the ranks share them, all of its own when the launcher bound each rank to cores of its own)."""
    graph_optimization: str = opt("all", choices=["disabled", "basic", "extended", "all"])
    """onnxruntime graph optimization level."""
    optimizer_kernel: str = opt("auto", choices=["auto", "graph", "host"])
    """Who runs the update: graph = graphs/optimizer.onnx in onnxruntime; host = the same rule as
    fused in-place loops compiled by Numba (no full-size temporaries; cpu only);
    auto = host on cpu, graph on cuda."""
    static_shapes: bool = True
    """Build the train graph for the exact micro-batch: the data inputs' batch dim fixed to
    train.micro_batch_size (and, for the built-in GPT-2, the sequence dim to data.seq_len), so
    the gradient builder emits reductions over fixed axes and onnxruntime plans memory statically.
    Changing either size later re-prepares the graphs. Eval and exported graphs keep symbolic dims."""
    pad_products: str = opt("auto", choices=["auto", "always", "never"])
    """On the CPU, pad a matrix product of the train graph whose contraction is a multiple of 1024 float32
    (rows 4 KiB apart: every weight gradient of a 1024-token micro-batch, GPT-2's MLP projection) by 16
    zeros, when its result is large enough to repay the copies (needs static_shapes; the same values):
    auto = on AMD processors, where such products are slower, and not elsewhere; always = on any
    processor; never. Baked into the train graph."""


@dataclass
class TensorBoardConfig:
    enabled: bool = True
    """Write tensorboardX event files under <output_dir>/tensorboard (rank 0)."""


@dataclass
class MlflowConfig:
    tracking_uri: Optional[str] = None
    """MLflow tracking URI: a server (http://host:5000), a database (sqlite:///FILE) or a local file
    store (file:///DIR, or a plain path, relative to the config file's folder); null: MLflow off. Rank 0
    logs the TensorBoard scalars (train/loss, eval/loss, time/<phase>_ms, ...) and the resolved config
    as parameters. Needs the trackers extra (pip install 'trainrun[trackers]')."""
    experiment: Optional[str] = None
    """MLflow experiment (made if missing); null: run.name."""


@dataclass
class WandbConfig:
    project: Optional[str] = None
    """Weights & Biases project; null: W&B off. Rank 0 logs the TensorBoard scalars and the resolved
    config; the run's files go to <output_dir>/wandb (or $WANDB_DIR). Needs the trackers extra."""
    mode: str = opt("online", choices=["online", "offline"])
    """online: send as it runs (needs `wandb login` or WANDB_API_KEY); offline: no network, the run
    stays in its folder for a later `wandb sync`."""


@dataclass
class LoggingConfig:
    mlflow: MlflowConfig = opt(factory=MlflowConfig)
    """MLflow tracking (off unless tracking_uri is set)."""
    wandb: WandbConfig = opt(factory=WandbConfig)
    """Weights & Biases tracking (off unless project is set)."""
    timeout_s: float = opt(30.0, gt=0.0)
    """Seconds a tracker may leave a call unanswered (its start, a logged step, its end) before it is
    dropped with a warning and the run goes on without it. Each tracker gets its calls on a thread of its
    own, so the steps never wait for a tracking server."""


@dataclass
class ProfileConfig:
    start_step: int = opt(0, min=0)
    """First step run under onnxruntime's per-operator profiler, on every rank (0: profiling off)."""
    steps: int = opt(3, min=1)
    """Consecutive steps profiled from start_step (each with its eval and checkpoint, if any)."""
    dir: Optional[str] = None
    """Where the traces go, one rank-<r>.json per rank (default <output_dir>/profile; relative: inside
    output_dir); `trainrun profile summarize DIR` reads them."""


@dataclass
class DebugConfig:
    stats_every: int = opt(0, min=0)
    """Write statistics (min/max/mean/std/norm, NaN/Inf counts) of the chosen activations, the gradients
    and the parameters every N steps to <output_dir>/stats/rank-<r>/ (0: off; nothing is added)."""
    tensors: list[str] = opt(factory=list)
    """Train-graph tensor name patterns (fnmatch), e.g. logits or LayerNormalization_*_out0: made graph
    outputs at prepare time and summarised (only when stats_every > 0)."""
    save_graphs: bool = False
    """Write the graphs as onnxruntime runs them (after its optimizations) to <output_dir>/debug/graphs."""


@dataclass
class Config:
    run: RunConfig = opt(factory=RunConfig)
    """Run identity and logging."""
    model: ModelConfig = opt(factory=ModelConfig)
    """The model: a built-in GPT-2 or BERT, or a user's forward ONNX."""
    data: DataConfig = opt(factory=DataConfig)
    """Datasets."""
    train: TrainConfig = opt(factory=TrainConfig)
    """Batch sizes and loop periods."""
    optimizer: OptimizerConfig = opt(factory=OptimizerConfig)
    """Update rule and clipping."""
    lr_schedule: LRScheduleConfig = opt(factory=LRScheduleConfig)
    """Learning-rate schedule."""
    checkpoint: CheckpointConfig = opt(factory=CheckpointConfig)
    """Checkpointing."""
    distributed: DistributedConfig = opt(factory=DistributedConfig)
    """Data-parallel communication."""
    engine: EngineConfig = opt(factory=EngineConfig)
    """onnxruntime session options."""
    device: str = opt("cpu", choices=["cpu", "cuda"])
    """Where the graphs run."""
    tensorboard: TensorBoardConfig = opt(factory=TensorBoardConfig)
    """TensorBoard logging."""
    logging: LoggingConfig = opt(factory=LoggingConfig)
    """Experiment trackers beside TensorBoard: MLflow, Weights & Biases (rank 0; a resumed run continues
    the same tracker run)."""
    profile: ProfileConfig = opt(factory=ProfileConfig)
    """Per-operator profiling of chosen steps (trainrun profile summarize)."""
    debug: DebugConfig = opt(factory=DebugConfig)
    """Convergence statistics (trainrun compare) and graph dumps."""

    def global_batch(self, world_size: int) -> int:
        return self.train.micro_batch_size * self.train.gradient_accumulation_steps * world_size


# --------------------------------------------------------------------------- docs

def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal after each field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def markdown_reference() -> str:
    """docs/configuration.md: every key of the schema with its default, allowed values and docstring
    (the texts ``trainrun config show`` prints); ``make docs`` writes it."""
    sections: list[tuple[str, Any]] = []

    def walk(obj, prefix):
        sections.append((prefix, obj))
        for f in dataclasses.fields(obj):
            if dataclasses.is_dataclass(getattr(obj, f.name)):
                walk(getattr(obj, f.name), f"{prefix}{f.name}.")

    walk(Config(), "")

    def flow(v):
        return yaml.safe_dump(v, default_flow_style=True, width=10_000).removesuffix("...\n").strip()

    def allowed(m):
        parts = [", ".join(f"`{flow(c)}`" for c in m["choices"])] if "choices" in m else []
        parts += [f"{op} {flow(m[k])}" for k, op in (("min", ">="), ("gt", ">"), ("max", "<=")) if k in m]
        if "path" in m:
            parts.append("an existing " + {"file": "file", "dir": "directory"}.get(m["path"], "path"))
        return "; ".join(parts)

    def anchor(prefix):
        return prefix.rstrip(".").replace(".", "") or "top-level-keys"

    lines = ["# Configuration reference", "",
             "Generated from the schema (the dataclasses of `trainrun/config.py`) by `make docs`; do not edit",
             "by hand. `trainrun config show --config FILE` prints the same texts as comments above the",
             "resolved values; `--set key.path=value` overrides any key. Relative dataset, model and run",
             "paths are resolved against the config file's folder.", "", "Contents:", ""]
    for prefix, _ in sections:
        name = prefix.rstrip(".") or "top-level keys"
        lines.append(f"- [`{name}`](#{anchor(prefix)})" if prefix else f"- [{name}](#{anchor(prefix)})")
    for prefix, obj in sections:
        docs = field_docs(type(obj))
        lines += ["", f"## `{prefix.rstrip('.')}`" if prefix else "## Top-level keys", "",
                  "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            doc = docs.get(f.name, "").replace("|", "\\|")
            if dataclasses.is_dataclass(v):
                lines.append(f"| `{prefix}{f.name}` | [section](#{anchor(prefix + f.name)}) | | {doc} |")
            else:
                lines.append(f"| `{prefix}{f.name}` | `{flow(v)}` | {allowed(f.metadata)} | {doc} |")
    return "\n".join(lines) + "\n"


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# --------------------------------------------------------------------------- coercion

class _Problems(list):
    def add(self, path: str, msg: str) -> None:
        self.append(f"{path}: {msg}")


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, path: str, problems: _Problems):
    """Convert a YAML value to the field type; record a problem and return None if impossible."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None:
            return None
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) > 1:     # the arm of the value's own kind: a mapping, a string, a number
            kinds = {dict: dict, str: str, int: (int, float), float: (int, float)}
            arms = [a for a in arms if isinstance(value, kinds[typing.get_origin(a) or a])
                    and not isinstance(value, bool)]
            if not arms:
                problems.add(path, f"expected a {_type_name(tp)}, got {value!r}")
                return None
        return _coerce(value, arms[0], path, problems)
    if origin is list:
        if not isinstance(value, list):
            problems.add(path, f"expected a {_type_name(tp)}, got {value!r}")
            return None
        (inner,) = typing.get_args(tp)
        out = [_coerce(v, inner, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return out
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            problems.add(path, f"expected a {_type_name(tp)}, got {value!r}")
            return None
        key_t, val_t = typing.get_args(tp)
        return {_coerce(k, key_t, path, problems): _coerce(v, val_t, f"{path}.{k}", problems)
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            problems.add(path, f"expected a mapping (section), got {value!r}")
            return tp()
        return _build(tp, value, path, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.add(path, f"expected true or false, got {value!r}")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        problems.add(path, f"expected an integer, got {value!r}")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "6e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        problems.add(path, f"expected a number, got {value!r}")
        return None
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.add(path, f"expected a string, got {value!r}")
        return None
    raise TypeError(f"unsupported config type {tp}")  # a schema bug, not user input


def _check_constraints(f: dataclasses.Field, value, path: str, problems: _Problems) -> None:
    m = f.metadata
    if value is None:
        return
    if "choices" in m and value not in m["choices"]:
        shown = ", ".join("null" if c is None else str(c) for c in m["choices"])
        problems.add(path, f"{value!r} is not one of: {shown}")
    if "min" in m and value < m["min"]:
        problems.add(path, f"must be >= {m['min']}, got {value}")
    if "max" in m and value > m["max"]:
        problems.add(path, f"must be <= {m['max']}, got {value}")
    if "gt" in m and not value > m["gt"]:
        problems.add(path, f"must be > {m['gt']}, got {value}")


def _build(cls, data: dict, prefix: str, problems: _Problems):
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    added = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if cls is ModelConfig and key in _ADDED:
            added[key] = _coerce(value, _ADDED[key], path, problems)
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            valid = ", ".join(fields)
            problems.add(path, f"unknown key{hint}; valid keys here: {valid}")
            continue
        before = len(problems)
        v = _coerce(value, hints[key], path, problems)
        if dataclasses.is_dataclass(v):   # a section: keep what parsed, its problems are recorded
            kwargs[key] = v
        elif len(problems) == before:
            _check_constraints(fields[key], v, path, problems)
            kwargs[key] = v
    out = cls(**kwargs)
    for key, section in added.items():
        setattr(out, key, section)
    return out


# --------------------------------------------------------------------------- eval metric names

def eval_set_of(d: DataConfig, metric: str):
    """(set name, metric) of a metrics key of data.eval's sets; False when it names none."""
    for name in sorted(d.eval_sets(), key=lambda n: -len(n or "")):
        prefix = eval_key(name, "")
        if metric.startswith(prefix) and len(metric) > len(prefix):
            return name, metric[len(prefix):]
    return False


def watched_metric(cfg: Config, key: str) -> str:
    """The metrics key train.early_stopping.metric or checkpoint.best_metric (``key``) names: the loss of
    data.eval's (first) set when null."""
    return get(cfg, key) or eval_key(next(iter(cfg.data.eval_sets()), None), "loss")


def greater_is_better(metric: str) -> bool:
    """Whether a higher value of an eval metric is better: not for a loss, perplexity, mse or mae."""
    return not metric.endswith(("loss", "perplexity", "mse", "mae"))


def path_fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        p = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(v):
            yield from path_fields(v, p)
        elif "path" in f.metadata and isinstance(v, dict):     # named paths (data.eval: {NAME: DIR})
            for name, one in v.items():
                yield f"{p}.{name}", one, f.metadata["path"]
        elif "path" in f.metadata:
            yield p, v, f.metadata["path"]


def resolve_path(value: str, base_dir: str) -> str:
    value = os.path.expanduser(value)
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(base_dir, value))


def init_from_config_json(m: ModelConfig, base_dir: str) -> tuple[str, dict | str] | None:
    """(model.init_from's config.json, its object or why it is none) when there is one to read."""
    if not m.init_from or m.builtin not in FAMILIES:
        return None
    file = os.path.join(resolve_path(m.init_from, base_dir), "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as fh:
            source = json.load(fh)
    except (OSError, ValueError) as exc:
        return file, str(exc)
    return file, source if isinstance(source, dict) else f"a {type(source).__name__}"


def _fill_from_init_from(cfg: Config, data: dict, base_dir: str) -> None:
    """model.<builtin> from model.init_from's config.json when the config gives no such section (that a
    given one agrees with it is :mod:`trainrun.validity`'s check)."""
    found = init_from_config_json(cfg.model, base_dir)
    m = cfg.model
    if found is None or not isinstance(found[1], dict) or \
            (isinstance(data.get("model"), dict) and data["model"].get(m.builtin) is not None):
        return
    section = m.family_section()
    for key in section.CONFIG_JSON_SHAPE:
        if key in found[1]:
            setattr(section, key, type(getattr(section, key))(found[1][key]))


# --------------------------------------------------------------------------- overrides

def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UsageError(f"--set {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UsageError(f"--set {text!r}: bad key path {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides; a relative path given on the command line is
    relative to the current directory (paths in the file are relative to the file)."""
    path_keys = {dotted for dotted, _, _ in path_fields(Config())} | {"run.output_dir"}
    for text in overrides:
        keys, value = parse_override(text)
        named = ".".join(keys[:-1]) in path_keys      # data.eval.NAME=DIR
        if (".".join(keys) in path_keys or named) and isinstance(value, str) and value:
            value = os.path.abspath(os.path.expanduser(value))
        if ".".join(keys) == "logging.mlflow.tracking_uri" and isinstance(value, str) and _is_local_path(value):
            value = os.path.abspath(os.path.expanduser(value))
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
    return data


# --------------------------------------------------------------------------- entry points

def read_yaml(path: str, text: str | None = None) -> dict:
    """The mapping of a YAML config file (``text``: its content, already read)."""
    try:
        if text is not None:
            data = yaml.safe_load(text)
        else:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise UsageError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


Checks = Callable[[Config, str, bool], list]
"""``checks(cfg, base_dir, need_data)``: the problems (``"key: message"``) across keys and of the files
keys name, on a config built from what parsed (:func:`trainrun.validity.config_problems`)."""


def from_dict(data: dict, *, base_dir: str = ".", source: str = "config", need_data: bool = False,
              checks: Optional[Checks] = None) -> Config:
    """Build a Config, each value coerced and range-checked, and run ``checks`` on it; raise UsageError
    listing every problem. Without ``checks`` only the schema's own (one key at a time) are made:
    :func:`trainrun.validity.load_config` passes the checks across keys."""
    problems = _Problems()
    cfg = _build(Config, data, "", problems)
    _fill_from_init_from(cfg, data, base_dir)
    if checks is not None:
        # Checks across keys run too (on the values that parsed), skipping those of a key already reported
        # and those that name one: a comparison with a rejected value only repeats its problem.
        bad = {p.split(":", 1)[0] for p in problems}
        named = re.compile("|".join(rf"(?<![\w.]){re.escape(k)}(?!\w)" for k in bad if "." in k) or "(?!)")
        problems += [p for p in checks(cfg, base_dir, need_data)
                     if p.split(":", 1)[0] not in bad and not named.search(p)]
    if problems:
        raise UsageError(f"{source}: {len(problems)} problem(s) in the configuration", problems)
    return cfg


def load_config(path: Optional[str], overrides: list[str] = (), *, need_data: bool = False,
                checks: Optional[Checks] = None, text: Optional[str] = None) -> Config:
    """Load a YAML config (or only defaults when path is None), apply ``--set`` overrides, validate
    (the schema, and ``checks``: see :func:`from_dict`). ``text``: the file's content, already read
    (``path`` then names it).

    Relative paths in the config are resolved against the config file's directory
    and stored absolute, so the resolved config works from any directory.
    """
    data = read_yaml(path, text) if path else {}
    data = apply_overrides(data, list(overrides))
    base_dir = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    cfg = from_dict(data, base_dir=base_dir, source=path or "config", need_data=need_data, checks=checks)
    absolutize(cfg, base_dir)
    return cfg


def absolutize(cfg: Config, base_dir: str) -> None:
    """Make every path of the config absolute (relative to base_dir)."""
    for dotted, value, _kind in list(path_fields(cfg)):
        if value is not None:
            _set(cfg, dotted, resolve_path(value, base_dir))
    cfg.run.output_dir = resolve_path(cfg.run.output_dir, base_dir)
    if cfg.logging.mlflow.tracking_uri and _is_local_path(cfg.logging.mlflow.tracking_uri):
        cfg.logging.mlflow.tracking_uri = resolve_path(cfg.logging.mlflow.tracking_uri, base_dir)


def _is_local_path(uri: str) -> bool:
    """A tracking URI that names a folder by a plain path (no scheme such as file:, http:, sqlite:)."""
    return ":" not in uri and uri != "databricks"


def _set(obj, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        obj = obj[p] if isinstance(obj, dict) else getattr(obj, p)
    if isinstance(obj, dict):
        obj[last] = value
    else:
        setattr(obj, last, value)


def get(obj, dotted: str):
    for p in dotted.split("."):
        obj = obj[p] if isinstance(obj, dict) else getattr(obj, p)
    return obj


def to_dict(cfg) -> dict:
    out = dataclasses.asdict(cfg)
    model, d = (cfg.model, out["model"]) if isinstance(cfg, Config) else (cfg, out)
    if isinstance(model, ModelConfig):     # the sections of added families
        d.update({name: dataclasses.asdict(getattr(model, name)) for name in _ADDED})
    return out


def to_yaml(cfg, *, comments: bool = False) -> str:
    """The resolved config as YAML; with comments, every field's docstring above it."""
    if not comments:
        return yaml.safe_dump(to_dict(cfg), sort_keys=False)
    lines: list[str] = []
    _yaml_commented(cfg, 0, lines)
    return "\n".join(lines) + "\n"


def changed_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted names of the leaves whose values differ between two :func:`to_dict` results."""
    out = []
    for k in a:
        path = f"{prefix}{k}"
        if isinstance(a[k], dict) and isinstance(b[k], dict) and a[k].keys() == b[k].keys():
            out += changed_keys(a[k], b[k], path + ".")
        elif a[k] != b[k]:
            out.append(path)
    return out


def to_text_changed(cfg) -> str:
    """What differs from the defaults, one line per section, each value as JSON (one line even for a
    string holding a newline), e.g. ``  train: max_steps=50, sample_prompt="def f\\n"``."""
    sections: dict[str, list[str]] = {}
    mine = to_dict(cfg)
    for key in changed_keys(to_dict(Config()), mine):
        section, _, rest = key.partition(".")
        value = mine
        for part in key.split("."):
            value = value[part]
        value = json.dumps(value)
        sections.setdefault(section, []).append(f"{rest}={value}" if rest else value)
    return "".join(f"  {k}: {', '.join(v)}\n" for k, v in sections.items())


def _yaml_commented(obj, indent: int, lines: list[str]) -> None:
    docs = field_docs(type(obj))
    pad = "  " * indent
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        doc = docs.get(f.name)
        if doc:
            lines.append(f"{pad}# {doc}")
        if dataclasses.is_dataclass(v):
            lines.append(f"{pad}{f.name}:")
            _yaml_commented(v, indent + 1, lines)
        else:
            if isinstance(v, list):     # a list of sections (optimizer.groups): plain mappings
                v = [dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x for x in v]
            dumped = yaml.safe_dump({f.name: v}, default_flow_style=True, sort_keys=False, width=10_000).strip()
            if dumped.startswith("{") and dumped.endswith("}"):
                dumped = dumped[1:-1]
            lines.append(f"{pad}{dumped}")
