"""The schema: every section of the run configuration but ``model`` (:mod:`trainrun.config.model`) as
dataclasses, each field documented by the string literal that follows it; the names of eval metrics the
keys refer to; dotted access to a key."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

from .fields import opt
from .model import ModelConfig


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
class OuterConfig:
    lr: float = opt(1.0, gt=0.0)
    """The outer optimizer's learning rate: the step taken along the replicas' mean outer gradient (the
    round's start weights minus each replica's weights). 1 without momentum (the replicas' mean) measured
    best for runs of a few hundred outer steps, from an every-step checkpoint and from the initial weights
    alike; the paper's is lr 0.7, momentum 0.9, nesterov true (docs/distributed.md, "When to choose DiLoCo")."""
    momentum: float = opt(0.0, min=0.0, max=0.999)
    """The outer SGD's momentum (torch.optim.SGD's, dampening 0), kept in fp32."""
    nesterov: bool = False
    """Nesterov momentum, as torch.optim.SGD defines it (needs momentum > 0)."""


@dataclass
class DiLoCoConfig:
    inner_steps: int = opt(100, min=1)
    """Optimizer steps each replica takes on its own between two outer steps (the paper's H). The run's
    last step is always an outer step."""
    outer: OuterConfig = opt(factory=OuterConfig)
    """The outer optimizer: SGD with (Nesterov) momentum over the replicas' mean outer gradient."""
    group: int = opt(0, min=0)
    """Ranks per replica: consecutive world ranks that reduce their gradients every step among
    themselves as distributed.sync every_step does (shared memory, ZeRO-1 within the replica); 0: the
    ranks of one node."""
    fragments: int = opt(1, min=1)
    """Parts of the model (contiguous runs of whole tensors of about equal size) synchronised in turn
    (streaming DiLoCo): fragment f's outer step comes (f + 1) x inner_steps / fragments steps into each
    round, so the link carries 1 / fragments of the model at a time; 1: all of it at each outer step."""
    overlap_steps: int = opt(0, min=0)
    """With fragments > 1: a fragment's exchange runs in the background over this many inner steps, then is
    applied (the fragment's new global weights plus what the replica learned meanwhile); less than
    inner_steps / fragments. 0: each exchange is waited for at its outer step."""
    outer_dtype: str = opt("fp32", choices=["fp32", "bf16"])
    """The outer gradients' type on the wire between replicas: fp32, or bf16 summed in fp32 (as
    distributed.reduce_dtype's); the global weights and the outer momentum stay fp32."""


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
    sync: str = opt("every_step", choices=["every_step", "diloco"])
    """every_step: every rank's gradients are reduced at every step (data parallel). diloco: the ranks form
    replicas (distributed.diloco.group) that train on their own and exchange only at outer steps, every
    distributed.diloco.inner_steps steps (DiLoCo: for links too slow for a reduction per step)."""
    diloco: DiLoCoConfig = opt(factory=DiLoCoConfig)
    """Local steps with outer synchronisation (distributed.sync: diloco); see docs/distributed.md."""
    elastic: bool = False
    """Keep training when a rank dies: the survivors drop it and redo that step's reduction among themselves
    (the global batch shrinks with them, the learning rate stays). Needs Open MPI with its ULFM fault
    tolerance, launched with `mpirun --with-ft ulfm` (the elastic extra, `make setup-elastic`), zero_stage 0
    and no overlap_grad_reduce (DiLoCo: one rank per replica, no overlap_steps; its outer step averages over
    the replicas alive); every rank keeps its own parameters (no intra-node sharing). At rank 0's death the
    lowest survivor takes over its writing. See docs/distributed.md, "Elastic runs"."""
    min_replicas: int = opt(1, min=1)
    """distributed.elastic: fewer ranks alive than this stops the run with a checkpoint (exit 75, resumable)."""


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
    train.micro_batch_size (and, for the built-in GPT-2, Llama and BERT, the sequence dim to data.seq_len), so
    the gradient builder emits reductions over fixed axes and onnxruntime plans memory statically.
    Changing either size later re-prepares the graphs. Eval and exported graphs keep symbolic dims."""
    pad_products: str = opt("auto", choices=["auto", "always", "never"])
    """On the CPU, pad a matrix product of the train graph whose contraction is a multiple of 1024 float32
    (rows 4 KiB apart: every weight gradient of a 1024-token micro-batch, GPT-2's MLP projection) by 16
    zeros, when its result is large enough to repay the copies (needs static_shapes; the same values):
    auto = on AMD processors with AVX-512 (Zen 4 and later), where such products are slower, and not
    elsewhere (Intel, AMD Zen 3); always = on any
    processor; never. Baked into the train graph."""


@dataclass
class GraphsConfig:
    builder: str = opt("auto", choices=["auto", "onnxruntime", "trainrun"])
    """Who writes the train graph's gradients: trainrun = trainrun's own (standard ONNX ops: runs on stock
    onnxruntime, the default install); onnxruntime = onnxruntime-training's gradient builder (needs the
    training extra, onnxruntime-training 1.19.2 in place of stock onnxruntime; its graphs hold training ops
    only that build runs); auto = onnxruntime-training's where it is installed, else trainrun's. Recorded in graphs/manifest.json; a change prepares the graphs again,
    and a run resumes across builders (the weights have the same names)."""
    fuse: bool = True
    """Rewrite the train graph of trainrun's own builder into fewer, larger nodes with the same numbers
    (float32 reordering at most): shapes known under engine.static_shapes folded into constants, no-op
    Casts, Reshapes and Identities removed, a transpose or a scale a matrix product can apply itself
    written into it (com.microsoft FusedMatMul, which stock onnxruntime runs on the CPU and CUDA).
    false: the builder's graph as it writes it. No effect on onnxruntime-training's builder."""


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
    """The model: a built-in GPT-2, BERT or Llama-family decoder, or a user's forward ONNX."""
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
    graphs: GraphsConfig = opt(factory=GraphsConfig)
    """How prepare builds the graphs."""
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


# --------------------------------------------------------------------------- dotted keys

def get(obj, dotted: str):
    for p in dotted.split("."):
        obj = obj[p] if isinstance(obj, dict) else getattr(obj, p)
    return obj


def _set(obj, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        obj = obj[p] if isinstance(obj, dict) else getattr(obj, p)
    if isinstance(obj, dict):
        obj[last] = value
    else:
        setattr(obj, last, value)
