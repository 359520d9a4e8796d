"""The TrainingRunner: the data-parallel training loop.

One step (:meth:`TrainingRunner.train_step`), in the order of ORT's C++ runner:

1. ``forward_backward``: ``gradient_accumulation_steps`` micro-batches, gradients
   accumulated in place in the flat gradient buffer;
2. ``reduce``: ONE allreduce (sum) over the flat gradient buffer (with
   ``distributed.zero_stage: 1`` a reduce-scatter; with ``distributed.intra_node: shared`` each rank
   first sums its slice of the node's gradients from shared memory: :mod:`trainrun.update`);
3. ``step_scalars``: ONE small allreduce of scalars that carries the loss, the squared
   gradient norm (rank 0's, or each rank's part of it), and the background
   checkpoint's progress, so every rank takes the same decision (a non-finite
   norm: the step is skipped everywhere);
4. ``clip``: the divisor that brings the norm down to ``max_grad_norm``;
5. ``optimizer step``: in place, at the learning rate of this step (a pure
   function of the step, :mod:`trainrun.schedule`); a non-finite step is skipped
   on every rank (stage 1: each rank's part, then an allgather of the parameters).

Around it, :meth:`fit` logs every ``log_every`` steps, evaluates every
``eval_every`` and checkpoints every ``checkpoint.every`` steps: what follows each
step is decided by :func:`step_end`, then done in its order. After the last step
(the end of the run): its checkpoint committed, then ``model.onnx`` exported
(:meth:`TrainingRunner._end`). The averaging
factor 1/(accum x world) and the clipping divisor are applied inside the
optimizer (its ``grad_scale``) instead of in extra passes over the gradients;
in float32 that is the same arithmetic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time

import numpy as np

from .sessions import import_onnxruntime

# onnxruntime first imported here, on a short stack, and without torch (see import_onnxruntime): imported with
# torch inside prepare or the engine, the exception its package check keeps (ORTModule's) held every frame
# below the import, locals included, for the life of the process (the model being built: 1 GB at GPT-2 124M)
import_onnxruntime()

from . import checkpoint as K
from . import faults
from . import reducer
from . import update
from . import validity
from . import config as C
from . import feeding
from .graphs.manifest import load_manifest, prepare, up_to_date
from . import rundir
from .rundir import COMMITTED
from .comm import affinity, cpu_share, cuda_device_count, local_device, machine_id, make_communicator
from .data import TrainLoader, eval_batches
from .engine import Engine, EngineOptions
from .errors import TrainrunError, UsageError, collective
from .export import export_checkpoint
from .generate import TrainingSampler
from .lock import RunLock
from .observe import Observer, apply_log_level, engine_options
from .observe.metrics import Metrics, fmt_duration
from .observe.timer import PhaseTimer, process_age
from .observe.task_metrics import TaskMetrics
from .observe.trackers import Trackers, check_installed
from .precision import make_scaler
from .stopping import Abandon, EarlyStopping, StopSignals, Stopped
from .tokenizer import record as record_tokenizer
from .schedule import learning_rate

MAX_NONFINITE_IN_A_ROW = 8
_ORT_SEVERITY = {"warning": 3, "info": 3, "devinfo": 1, "verbose": 0}


def _config_hash(cfg: C.Config) -> str:
    return hashlib.sha256(C.to_yaml(cfg).encode()).hexdigest()[:16]


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Building
    the graphs leaves GBs free but mapped in the heap, counted in the process's RSS until then."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):       # not glibc
        pass


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What follows a step, in the order the runner does it (:func:`step_end`)."""
    last: bool          # the last step of the run (train.max_steps / max_epochs) or of the session (stop_at)
    stop: bool          # stop after this step: a signal or train.max_time came (never on the last step)
    log: bool           # a metrics line
    evaluate: bool      # an evaluation
    patience: bool      # ... that counts toward train.early_stopping.patience
    checkpoint: bool    # a checkpoint (early stopping, known after the evaluation, adds one)
    sample: bool        # a sample (train.sample_every)


def step_end(cfg: C.Config, step: int, end: int, stop_requested: bool, has_eval: bool) -> StepEnd:
    """The decisions after ``step`` of a run that ends at ``end``; ``stop_requested``: the step's allreduce
    carried a stop (signal or limit) from some rank; ``has_eval``: data.eval is set."""
    t = cfg.train

    def every(n: int) -> bool:
        return bool(n) and step % n == 0

    last = step == end
    stop = stop_requested and not last          # the last step done, the run is finished: stop or no stop
    checkpoint = every(cfg.checkpoint.every) or last or stop
    # the last step's evaluation is the final one; keep_best ranks each checkpoint by its evaluation
    evaluate = has_eval and not stop and (every(t.eval_every) or last or (checkpoint and cfg.checkpoint.keep_best > 0))
    return StepEnd(last=last, stop=stop, log=every(t.log_every) or last or stop, evaluate=evaluate,
                   patience=evaluate and every(t.eval_every),      # patience counts eval_every's evaluations
                   checkpoint=checkpoint, sample=every(t.sample_every) and not stop)


def model_is_current(model: str, ckpt: str) -> bool:
    """``model`` (model.onnx) exists and was written after ``ckpt`` was committed."""
    try:
        return os.stat(model).st_mtime_ns >= os.stat(os.path.join(ckpt, COMMITTED)).st_mtime_ns
    except FileNotFoundError:
        return False


class TrainingRunner:
    def __init__(self, cfg: C.Config, comm, resume_from: str | None = None, lock: RunLock | None = None,
                 force: bool = False, config_yaml: str | None = None):
        self.started = time.monotonic()      # train.max_time counts from here
        self.cfg = cfg
        self.config_yaml = config_yaml or C.to_yaml(cfg)     # what the run directory and its checkpoints record
        self.lock = lock
        self.resume_from = resume_from
        self.comm = comm
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.is_main = self.rank == 0
        self.verbose = cfg.run.log_level in ("devinfo", "verbose")
        self.out = cfg.run.output_dir
        self.graphs_dir = os.path.join(self.out, "graphs")
        t = cfg.train
        self.accum = t.gradient_accumulation_steps
        self.global_batch = cfg.global_batch(self.world)
        self.tokens_per_step = self.global_batch * cfg.data.seq_len

        # SIGTERM/SIGINT/SIGUSR1 or train.max_time: stop after the step, with a checkpoint; noted from here on,
        # so that a signal during set-up stops the run before its first step instead of killing it
        self.signals = StopSignals(t.max_time_s(), started=self.started).__enter__()
        try:
            self._open_data()          # the start-up check, before anything is written or built
            self._prepare_run_dir()
            self._check_same_everywhere()
            faults.wait_until("WAIT_SIGNAL", self.rank, 0, self.signals.flag)
            self._build_engine()
        except BaseException:
            self.signals.__exit__()
            raise
        self.step = 0              # optimizer steps taken (including skipped non-finite ones)
        self.updates = 0           # successful updates: the optimizer's own step count
        self.skipped = 0
        self.nonfinite_in_a_row = 0
        self.stops_carried = 0     # the stops this rank had noted when the last allreduce carried its flag
        self.early_stopping = EarlyStopping(t.early_stopping.patience, t.early_stopping.min_delta,
                                            C.watched_metric(cfg, "train.early_stopping.metric"))
        self.scaler = make_scaler(self.engine)     # fp16: dynamic loss scaling; else None
        self.checkpoints = K.Checkpointer(self.out, comm, cfg.checkpoint.keep_last, log=self.log,
                                          keep_best=cfg.checkpoint.keep_best,
                                          best_metric=C.watched_metric(cfg, "checkpoint.best_metric"))
        if resume_from:
            self._restore(resume_from, force)
        self.metrics = Metrics(self.out, enabled=self.is_main, tensorboard=cfg.tensorboard.enabled,
                               quiet=cfg.run.log_level == "warning", total_steps=self.total_steps,
                               start_step=self.step, eval_sets=list(self.eval_sets))
        self.timer = PhaseTimer()
        # profiling, statistics, per-rank logs: off unless configured
        self.observe = Observer(cfg, self.rank, self.world, self.engine, self.timer, self.log)

    # ------------------------------------------------------------------ set-up
    def log(self, text: str, all_ranks: bool = False) -> None:
        if self.verbose and (self.is_main or all_ranks):     # devinfo/verbose: every line names its rank
            print("".join(f"[rank {self.rank}] {line}\n" for line in text.splitlines()), end="", flush=True)
        elif self.is_main and self.cfg.run.log_level != "warning":
            print(text, flush=True)

    def _prepare_run_dir(self) -> None:
        cfg = self.cfg
        error = None
        if self.is_main:
            try:
                check_installed(cfg)        # logging.mlflow / logging.wandb set: their library is there
                if self.lock:
                    self.lock.acquire()     # before anything is written: one job per run directory
                ckpt_dir = os.path.join(self.out, "checkpoints")
                if not self.resume_from and rundir.complete_checkpoints(ckpt_dir):
                    raise UsageError(f"{self.out} already holds checkpoints; continue it with "
                                     f"`trainrun resume {self.out}` or choose another run.output_dir")
                K.cleanup(ckpt_dir, log=self.log)
                os.makedirs(self.out, exist_ok=True)
                with open(os.path.join(self.out, "config.yaml"), "w") as fh:
                    fh.write(self.config_yaml)
                if not up_to_date(self.graphs_dir, cfg):
                    self.log(f"preparing graphs in {self.graphs_dir}")
                    prepare(cfg, self.graphs_dir)
                    return_freed_memory()     # the model built in memory: not kept for the whole run
            except TrainrunError as exc:
                error = exc
        self.comm.agree(error)

    def _check_same_everywhere(self) -> None:
        try:
            manifest = load_manifest(self.graphs_dir)
            mine = {"config": _config_hash(self.cfg), "graphs": manifest["files"], "host": platform.node()}
        except UsageError as exc:
            mine = {"config": _config_hash(self.cfg), "graphs": None, "error": exc.message, "host": platform.node()}
        everyone = self.comm.allgather_object(mine)
        ref = everyone[0]
        blind = [r for r, other in enumerate(everyone) if other.get("graphs") is None]
        if blind and ref.get("graphs") is not None:     # rank 0 prepared them: the others see another directory
            hosts = sorted({everyone[r]["host"] for r in blind})
            raise collective(UsageError(
                f"run.output_dir {self.out} is not shared: host(s) {', '.join(hosts)} (rank(s) "
                f"{', '.join(map(str, blind))}) cannot see the graphs rank 0 prepared there; the run directory "
                f"must be the same shared filesystem path on every host (`trainrun doctor` checks it)"))
        for r, other in enumerate(everyone):   # every rank sees the same list: the error is collective
            if other.get("graphs") is None:
                raise collective(UsageError(f"rank {r} cannot read the prepared graphs: {other.get('error')}"))
            if other["config"] != ref["config"]:
                raise collective(UsageError(
                    f"rank {r} has a different config than rank 0 (hash {other['config']} vs {ref['config']}); "
                    f"launch every rank with the same --config and --set"))
            if other["graphs"] != ref["graphs"]:
                raise collective(UsageError(f"rank {r} ({other['host']}) sees different graph files than "
                                             f"rank 0 in {self.graphs_dir}"))
        self.manifest = manifest

    def _open_data(self) -> None:
        """The datasets of :func:`trainrun.validity.check`, which finds every problem of the files the config
        names (data, model.init_from, the memory the model needs) before the graphs are built."""
        cfg = self.cfg
        error = None
        try:
            self.train_ds, self.eval_sets = validity.check(cfg, self.world)
        except UsageError as exc:
            error = exc
        self.comm.agree(error)
        # the step the run ends at: train.max_steps, or train.max_epochs over this dataset and global batch
        self.total_steps = cfg.train.total_steps(self.train_ds.num_samples, self.global_batch)
        # token sequences: tokens/s besides samples/s; next-token cross-entropy: perplexity besides the loss
        self.tokens = "input_ids" in self.train_ds.specs
        self.perplexity = validity.logs_perplexity(cfg, self.train_ds)
        self.loader = TrainLoader(self.train_ds, micro_batch=cfg.train.micro_batch_size, accum=self.accum,
                                  rank=self.rank, world_size=self.world, seed=cfg.run.seed,
                                  shuffle=cfg.data.shuffle, prefetch=cfg.data.prefetch)

    def _build_engine(self) -> None:
        cfg = self.cfg
        threads = cfg.engine.threads
        if cfg.run.deterministic:
            threads = 1
        elif not threads:   # this rank's share of its CPUs among the ranks of its machine (every rank asks)
            here, mask = machine_id(), affinity()
            peers = [m for key, m in self.comm.allgather_object([here, mask]) if key == here]
            threads = cpu_share(mask, peers)
        self.threads = threads
        device_id = local_device(self.comm.local_rank) if cfg.device == "cuda" else 0
        node = None
        error = None
        try:     # intra_node: shared: parameters and gradients in the node's shared memory (None: the mpi path)
            node = update.node_buffers(cfg, self.comm, self.manifest["num_params"])
        except UsageError as exc:
            error = exc
        self.comm.agree(error)
        # buckets of gradients reduced during the backward pass: the train graph cut at them
        overlaps = reducer.applies(cfg, self.comm, node)
        buckets = int(cfg.distributed.bucket_mb * 2**20) if overlaps else 0
        opts = EngineOptions(device=cfg.device, device_id=device_id, threads=threads,
                             graph_optimization=cfg.engine.graph_optimization,
                             log_severity=_ORT_SEVERITY[cfg.run.log_level], deterministic=cfg.run.deterministic,
                             seed=cfg.run.seed, direct_gradients=self.accum == 1, bucket_bytes=buckets,
                             **engine_options(cfg, self.rank))
        mb = cfg.train.micro_batch_size
        shapes = {name: ((mb, *shape), dtype) for name, (shape, dtype) in self.train_ds.specs.items()}
        error = None
        try:     # the data checked against the graph's inputs: the same verdict on every rank
            feeds = feeding.feeds(self.manifest, cfg.data.inputs, shapes)
            # the metrics early stopping and keep_best watch: among those the evaluations log
            logged = validity.eval_metrics(cfg, self.train_ds, manifest=self.manifest)
            if problems := validity.eval_metric_problems(cfg, logged):
                raise UsageError(f"{len(problems)} problem(s) in the configuration", problems)
            self.engine = Engine(self.graphs_dir, opts, shapes, shapes, feeds=feeds,
                                 buffers=node.buffers if node else None)
            self.engine.load_weights()
            # the optimizer over the whole buffers, or (partitioned) over this rank's part only
            self.shard = update.build(cfg, self.comm, self.engine, node)
            self.grad_buckets = len(self.shard.reducer.buckets) if self.shard.reducer else 0
        except UsageError as exc:
            error = exc
        self.comm.agree(error)
        if self.is_main:    # what this launch turns off of the config, and why
            shared = (node.mem.node.world_size, node.mem.cross.world_size) if node else None
            for note in validity.inactive(cfg, self.world, shared, overlaps, self.grad_buckets):
                print(f"trainrun: warning: {note}", file=sys.stderr, flush=True)
        error, self.sampler = None, None
        if cfg.train.sample_every and self.is_main:
            try:
                self.sampler = TrainingSampler(self.manifest, cfg.data.train, cfg.train.sample_prompt, threads)
            except UsageError as exc:
                error = exc
        if cfg.train.sample_every:
            self.comm.agree(error)

    def average_model_state(self) -> None:
        """Model state that is not a parameter (BatchNorm running stats) is updated by each rank from its
        own batches: replace it by the mean over ranks (before eval, checkpoints and so export), so every
        rank evaluates and every checkpoint holds the statistics of all the data."""
        state = self.engine.state
        if state.size and self.world > 1:
            self.comm.allreduce_(state)
            state *= 1.0 / self.world

    def _restore(self, ckpt: str, force: bool = False) -> None:
        """Parameters, optimizer state, step counters and the data position of ``ckpt`` (``force``:
        ``resume --force``, tensors the model or optimizer no longer takes are dropped with a warning)."""
        eng = self.engine
        state = self.checkpoints.restore(ckpt, eng.layout, eng.params, self.shard.state,
                                         (eng.state_layout, eng.state), state_range=(self.shard.lo, self.shard.hi),
                                         forced=force)
        self.loader.load_state_dict(state["loader"])
        self.step, self.updates, self.skipped = state["step"], state["updates"], state["skipped_steps"]
        self.early_stopping.load_state_dict(state.get("early_stopping") or {})
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
        self.log(f"resumed from {ckpt} at step {self.step} (saved by {state['world_size']} rank(s), "
                 f"now {self.world})")

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict:
        timer = self.timer
        faults.stall("STALL_STEP", self.rank, self.step + 1)
        faults.wait_until("WAIT_SIGNAL", self.rank, self.step + 1, self.signals.flag)
        micro = self.loader.next_step()
        timer.mark("data")
        stats = self.observe.stats_step(self.step + 1)     # None unless debug.stats_every says so
        loss_sum = self.forward_backward(micro, stats)
        if faults.hit("NAN_GRAD", self.rank, self.step + 1):
            self.engine.grads[0] = float("nan")
        timer.mark("forward_backward")
        self.shard.reduce()
        timer.mark("allreduce")
        loss, grad_norm, finite, stop = self.step_scalars(loss_sum)
        timer.mark("norm")
        self.step += 1
        lr = learning_rate(self.step, self.cfg.optimizer.lr, self.total_steps, self.cfg.lr_schedule)
        scale = self.grad_scale()
        result = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "local_loss": loss_sum / self.accum,
                  "stop": stop}
        if self.scaler:
            result["loss_scale"] = self.scaler.scale        # the scale this step ran with
        if finite:
            self.optimizer_step(lr, scale / self.clip_divisor(grad_norm))
        elif self.scaler and self.scaler.update(False):
            self.skipped += 1           # an fp16 overflow: the scaler halved its scale; not a divergence
            self.log(f"step {self.step}: fp16 overflow, update skipped; loss scale now {self.scaler.scale:g}")
        else:
            self.skip_step()
        if finite and self.scaler:
            self.scaler.update(True)
        timer.mark("optimizer")
        if finite and self.shard.sharded:
            self.shard.gather()
            timer.mark("allgather")
        if stats:
            stats.finish(self.step, scale, result)
            timer.mark("stats")
        return result

    def forward_backward(self, micro: list[dict], stats=None) -> float:
        """This rank's micro-batches, gradients summed in place; the sum of their losses."""
        loss_sum = 0.0
        # the last micro-batch's buckets of gradients reduced as the backward pass finishes them, unless
        # debug statistics read this step's local gradients first
        overlap = self.shard.reducer.bucket_ready if self.shard.reducer and not stats else None
        for a, batch in enumerate(micro):
            loss_sum += self.engine.forward_backward(batch, accumulate=a > 0,
                                                     position=self.loader.sample_position(a),
                                                     between=overlap if a == len(micro) - 1 else None)
            if stats:
                stats.micro_batch()
        return loss_sum

    def grad_scale(self) -> float:
        """The gradient buffer holds a sum over ranks and micro-batches (times the fp16 loss scale):
        this makes it the mean."""
        return 1.0 / (self.accum * self.world * (self.scaler.scale if self.scaler else 1.0))

    def step_scalars(self, loss_sum: float) -> tuple[float, float, bool, bool]:
        """(mean loss, gradient norm, finite on every rank, a stop signal reached some rank), from one
        allreduce of a few scalars that also carries the background checkpoint's progress."""
        ck_done, ck_failed = self.checkpoints.status()
        self.stops_carried = self.signals.noted()
        loss_total, norm_sq, ck_done, ck_failed, stop = self.comm.allreduce_scalars(
            [loss_sum, self.shard.norm_sq_part(), ck_done, ck_failed, float(self.stops_carried > 0)], op="sum")
        self.checkpoints.progress(ck_done, ck_failed)
        finite = math.isfinite(norm_sq)     # NaN and inf propagate through the sum
        grad_norm = math.sqrt(norm_sq) * self.grad_scale() if finite else float("inf")
        return loss_total / (self.accum * self.world), grad_norm, finite, bool(stop)

    def clip_divisor(self, grad_norm: float) -> float:
        clip = self.cfg.optimizer.max_grad_norm
        return grad_norm / clip if clip > 0 and grad_norm > clip else 1.0

    def optimizer_step(self, lr: float, grad_scale: float) -> None:
        self.nonfinite_in_a_row = 0
        self.updates += 1
        self.shard.step(lr, self.updates, grad_scale)

    def skip_step(self) -> None:
        """Every rank saw the same non-finite flag: skip the update; too many in a row stop the run."""
        self.skipped += 1
        self.nonfinite_in_a_row += 1
        if self.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
            self.checkpoints.finish()     # a write still in flight holds good weights: commit it first
            raise collective(TrainrunError(
                f"{self.nonfinite_in_a_row} steps in a row had non-finite gradients (last at step {self.step}); "
                f"stopping without a checkpoint of these weights. Lower optimizer.lr or check the data."))
        self.log(f"step {self.step}: non-finite gradients on some rank, update skipped ({self.skipped} so far)")

    def evaluate(self) -> dict:
        """Every eval set's metrics (:meth:`evaluate_set`), named ``eval_<metric>`` for a single data.eval,
        ``eval_<NAME>_<metric>`` for named sets."""
        self.average_model_state()
        return {C.eval_key(name, k): v for name, ds in self.eval_sets.items()
                for k, v in self.evaluate_set(name, ds).items()}

    def evaluate_set(self, name: str | None, ds) -> dict:
        """``loss``, ``perplexity`` and each metric of the eval graph on one eval set, over ``eval_steps``
        global batches, or every sample where the set ends first (the rest as one smaller step split over
        the ranks, as ``trainrun evaluate``; not where the eval graph fixes the batch dim); ``samples`` of
        ``dataset_samples`` counted. Sums from every rank in one allreduce; the loss is the mean of the
        micro-batch losses, each weighed by its samples."""
        cfg, eng = self.cfg, self.engine
        names = list(eng.eval_metrics)
        total, count, sums = 0.0, 0.0, [0.0] * len(names)
        n_labels = eng.manifest.get("task_labels")
        task = TaskMetrics(n_labels, eng.manifest["ignore_index"]) if n_labels else None
        error = None
        try:
            for batch in eval_batches(ds, micro_batch=cfg.train.micro_batch_size, rank=self.rank,
                                      world_size=self.world, steps=cfg.train.eval_steps * self.accum,
                                      rest=eng.eval_batch_fixed is None):
                samples = len(next(iter(batch.values())))
                total += eng.evaluate(batch) * samples
                count += samples
                for i, n in enumerate(names):
                    sums[i] += float(eng.eval_metrics[n])
                if task is not None:
                    labels = eng.manifest["labels"]
                    task.add(eng.eval_logits, batch[eng.feeds.get(labels, labels)])
        except TrainrunError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - a dataset or session that breaks mid-run, on any rank
            key = "data.eval" + (f".{name}" if name is not None else "")
            error = TrainrunError(f"evaluation at step {self.step} on {key} {self.cfg.data.eval_sets()[name]}: "
                                  f"{type(exc).__name__}: {exc}")
        self.comm.agree(error)      # the same error on every rank: they commit a checkpoint together
        stats = list(task.stats()) if task is not None else []
        total, count, *sums = self.comm.allreduce_scalars([total, count, *sums, *stats], op="sum")
        sums, stats = sums[:len(names)], sums[len(names):]
        self.timer.mark("eval")
        result = feeding.eval_results(total / max(count, 1.0), dict(zip(names, sums)), self.perplexity)
        if task is not None:      # accuracy and macro F1 over every rank's samples; Pearson, Spearman
            pairs = [np.asarray(p) for p in self.comm.allgather_object(task.pairs().tolist())] \
                if task.regression else None
            result.update(task.result(np.asarray(stats), pairs))
        return {**result, "samples": int(count), "dataset_samples": ds.num_samples}

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict | None:
        """Train to the end (or a stop), then end the run (:meth:`_end`); the summary (None: nothing to train)."""
        t = self.cfg.train
        if self.is_main and self.cfg.data.train:     # set-up passed: generate and export find the tokenizer here
            record_tokenizer(self.cfg.data.train, self.out)
        self._header()
        self._start_trackers()       # before the clocks: a W&B run takes seconds to start
        self.comm.barrier()          # start the clocks together: set-up time differs between ranks
        self.timer.restart()
        start, first_step, startup = time.perf_counter(), self.step, process_age()
        end = min(self.total_steps, t.stop_at) if t.stop_at else self.total_steps
        self.last, self.last_eval = {}, None     # the last step's result, the last evaluation
        self._window = (start, self.step, dict(self.timer.total))   # since the last metrics line
        exit_code = 1
        try:
            self._stop_if_signalled_in_setup()
            if self.step >= end:
                self._close_training()
                self._nothing_to_train(end)
                exit_code = 0
                return None
            if self.resume_from:
                dropped = self.metrics.resume_at(self.step)
                if dropped:
                    self.log(f"metrics.jsonl: {dropped} line(s) after step {self.step} removed (steps after the "
                             f"checkpoint resumed from, trained again now); TensorBoard drops them too")
            try:
                ending = self._loop(end)
            except TrainrunError as exc:
                # an error every rank raised after committing this step's checkpoint: summed up too
                if getattr(exc, "collective", False) and self.checkpoints.saved_step == self.step > first_step:
                    self._close_training()
                    self._summary(start, first_step, startup, time.perf_counter(), f"error: {exc.message}")
                raise
            summary = self._end(ending, start, first_step, startup)
            exit_code = 0
            return summary
        except BaseException as exc:     # the tracker runs end as stopped (resumable) or failed
            exit_code = getattr(exc, "exit_code", 1)
            raise
        finally:
            self.loader.close()
            self.metrics.close(exit_code=exit_code)  # what was logged reaches metrics.jsonl, also on an error

    def _end(self, ending: str, start: float, first_step: int, startup: float | None) -> dict:
        """The end of the run, after its last step (``ending``: "end", "early" or "stop", :meth:`_loop`): the
        last checkpoint committed, the observers closed, model.onnx exported (rank 0), summary.json. A stop
        that came after the last step's allreduce lets the commit finish and skips the export; one during the
        export abandons it. Either way :class:`Stopped` (exit 75) once summary.json is written."""
        stop = self._commit_last(ending)
        loop_end = time.perf_counter()
        self._close_training()
        if stop is None and self.is_main and self.checkpoints.saved_step == self.step:
            stop = self._export(os.path.join(self.out, "checkpoints", str(self.step)))
        summary = self._summary(start, first_step, startup, loop_end, stop and stop.by)
        if stop is not None:
            raise stop
        t = self.cfg.train
        if self.step == t.stop_at < self.total_steps and self.checkpoints.saved_step == self.step:
            self.log(f"stopped at train.stop_at {t.stop_at} of {self._length()}; checkpoint "
                     f"{os.path.join(self.out, 'checkpoints', str(self.step))} committed. {self._continue_hint()}")
        return summary

    def _commit_last(self, ending: str) -> Stopped | None:
        """The last checkpoint's write finished and committed on every rank, whatever comes meanwhile; the
        :class:`Stopped` to raise for a stop in the loop (``ending`` "stop") or one noted on any rank after the
        last step's allreduce carried its flag, else None."""
        faults.wait_until("WAIT_SIGNAL", self.rank, "commit", lambda: self.signals.noted() > self.stops_carried)
        self.checkpoints.finish()
        noted = self.signals.noted()
        late = self.comm.allreduce_scalars([float(noted > self.stops_carried)])[0]
        mine = self.signals.latest if noted > self.stops_carried else None
        self.stops_carried = noted
        if ending == "stop":
            return self._stopped()
        if not late:
            return None
        ckpt = os.path.join(self.out, "checkpoints", str(self.step))
        where = f"the last step, {self.step}" if self.step == self.total_steps else f"step {self.step}"
        return collective(Stopped(
            f"stopped by {mine or 'a signal to another rank'} after {where}: checkpoint {ckpt} committed (its "
            f"write finished), model.onnx not exported. {self._export_hint()}", by=mine or "a signal to another rank"))

    def _export(self, ckpt: str) -> Stopped | None:
        """rank 0: model.onnx from ``ckpt``, after dropping what training held. A stop signal abandons it,
        leaving nothing half-written nor a model whose check did not finish: the :class:`Stopped` to raise
        (every other rank is done), or None."""
        model = os.path.join(self.out, "model.onnx")
        self._release()      # the export reads the checkpoint: free what training held first
        try:
            with self.signals.abandoning():
                if self.signals.noted() > self.stops_carried:      # came since the last agreement
                    raise Abandon(self.signals.latest)
                export_checkpoint(ckpt, model, echo=self.log)
        except Abandon as exc:
            if model_is_current(model, ckpt):      # written, its check against the eval graph cut short
                for path in (model, model + ".data"):
                    if os.path.exists(path):
                        os.remove(path)
            return collective(Stopped(
                f"stopped by {exc.received} during the export of {model}: export abandoned, checkpoint {ckpt} "
                f"committed. {self._export_hint()}", by=exc.received))
        return None

    def _nothing_to_train(self, end: int) -> None:
        """A resume at (or past) the step the run ends at: nothing trained, nothing logged, summary.json left as
        it is; model.onnx exported again only where it is missing or older than the checkpoint resumed from."""
        if not (self.is_main and self.resume_from):
            return
        t = self.cfg.train
        stop_at = f", train.stop_at {t.stop_at}" if t.stop_at else ""
        said = (f"nothing to train: the run is at step {self.step}, it ends at step {end} ({self._length()}"
                f"{stop_at}); ")
        model, ckpt = os.path.join(self.out, "model.onnx"), self.resume_from
        if model_is_current(model, ckpt):
            self.log(f"{said}{model} not exported again")
            return
        why = f"is older than checkpoint {ckpt}" if os.path.exists(model) else "is missing"
        self.log(f"{said}{model} {why}: exporting it")
        stop = self._export(ckpt)
        if stop is not None:
            raise stop

    def _close_training(self) -> None:
        """After the last checkpoint committed: the observers closed (the profiler's window written), the
        shared memory freed by every rank (collective), before rank 0 exports."""
        self.wire_bytes = self.shard.wire.sent_bytes     # the gradients' bytes on the wire (trainrun.wire)
        self.observe.close()
        self.shard.close()

    def _summary(self, start: float, first_step: int, startup: float | None, loop_end: float,
                 stopped: str | None) -> dict:
        """summary.json (rank 0) of this session; the closing line where it finished (``stopped`` None)."""
        elapsed = loop_end - start
        ran = self.step - first_step        # steps of this session (a resumed run started later)
        summary = {
            "steps": ran, "final_step": self.step, "skipped_steps": self.skipped, "time_s": round(elapsed, 3),
            "samples": ran * self.global_batch, "samples_per_sec": ran * self.global_batch / max(elapsed, 1e-9),
            **({"tokens": ran * self.tokens_per_step,
                "tokens_per_sec": ran * self.tokens_per_step / max(elapsed, 1e-9)} if self.tokens else {}),
            "final_loss": self.last.get("loss"), "final_eval_loss": self._first_eval_loss(self.last_eval),
            **({"final_eval": self.last_eval} if self.last_eval else {}), "world_size": self.world,
            "phase_shares": {k: round(v, 4) for k, v in self.timer.shares().items()},
            # bytes this rank sent for the gradient reduction, per step (trainrun.wire: fp32 or bf16 on the wire)
            "wire_bytes_per_step": self.wire_bytes // ran if ran else 0,
            # distributed.overlap_grad_reduce: the buckets of the gradient buffer (all but the last reduced
            # during the backward pass); 0 without overlap
            "grad_buckets": self.grad_buckets,
            # the command's start (process start) to the first step, and the last step to here (the last
            # checkpoint committed, model.onnx exported): where a short run's wall time goes besides steps
            "startup_s": None if startup is None else round(startup, 3),
            "end_s": round(time.perf_counter() - loop_end, 3),
            # what stopped this session before its end (a signal, train.max_time, an error); null: it finished
            "stopped": stopped,
        }
        if self.is_main:
            with open(os.path.join(self.out, "summary.json"), "w") as fh:
                json.dump(summary, fh, indent=1)
            if stopped is None:
                self._footer(summary)
        return summary

    def _start_trackers(self) -> None:
        """MLflow / W&B runs (rank 0; a resumed run continues its own): one that cannot start stops every
        rank before the first step."""
        error = None
        if self.is_main:
            try:
                self.metrics.trackers = Trackers(self.cfg, self.out, resumed=bool(self.resume_from), echo=self.log)
            except UsageError as exc:
                error = exc
        self.comm.agree(error)

    def _length(self) -> str:
        """How long the run is, as the config says it: ``train.max_steps N`` or ``train.max_epochs E: N steps``."""
        t = self.cfg.train
        if t.max_epochs and not t.max_steps:
            return f"train.max_epochs {t.max_epochs:g}: {self.total_steps} steps"
        return f"train.max_steps {self.total_steps}"

    def _first_eval_loss(self, evaluated: dict | None) -> float | None:
        """The loss of data.eval, or of its first named set."""
        return evaluated.get(C.eval_key(next(iter(self.eval_sets), None), "loss")) if evaluated else None

    def _loop(self, end: int) -> str:
        """Steps until ``end``, a stop or early stopping (how it ended: "end", "stop" or "early"). After each
        step, in order: a metrics line, an evaluation, early stopping, a checkpoint, a sample."""
        while self.step < end:
            self.observe.step_begin(self.step + 1)
            self.last = self.train_step()
            self.metrics.progress(self.step)
            then = step_end(self.cfg, self.step, end, self.last["stop"], bool(self.eval_sets))
            if self.last["stop"] and then.last:
                self.log(f"{self.signals.received or 'a signal to another rank'} came during the last step, "
                         f"{self.step}: finishing the run (final evaluation, checkpoint, model.onnx)")
            if then.log:
                self._log_step()
            evaluated = self._evaluate_step() if then.evaluate else None
            early = then.patience and self.early_stopping.update(self.step, evaluated)
            # not while updates are being skipped (keep_last keeps good ones), unless the run stops here
            if (then.checkpoint or early) and (then.stop or not self.nonfinite_in_a_row):
                self.save(evaluated)
            if then.sample:
                self._sample()
            self.observe.step_end(self.step, self.last)
            if then.stop:
                return "stop"
            if early:
                self.log(f"early stopping at step {self.step}: {self.early_stopping.describe()}")
                return "early"
        return "end"

    def _log_step(self) -> None:
        """A metrics line: the step's loss, learning rate and gradient norm, the throughput and the mean time
        per phase since the previous line."""
        last, (since, step, phases) = self.last, self._window
        now, steps = time.perf_counter(), self.step - step
        sps = steps * self.global_batch / (now - since)
        phase_ms = {k: round(1e3 * (v - phases.get(k, 0.0)) / steps, 3)
                    for k, v in self.timer.total.items() if v > phases.get(k, 0.0)}
        self._window = (now, self.step, dict(self.timer.total))
        self.metrics.log(self.step, {"loss": last["loss"], "lr": last["lr"], "grad_norm": last["grad_norm"],
                                     "samples_per_sec": sps,
                                     **({"tokens_per_sec": sps * self.cfg.data.seq_len} if self.tokens else {}),
                                     "skipped_steps": self.skipped, "phase_ms": phase_ms,
                                     **({"loss_scale": last["loss_scale"]} if self.scaler else {})})
        self.timer.mark("log")

    def _evaluate_step(self) -> dict:
        """This step's evaluation, logged; one that fails (on every rank, agreed) commits the step first."""
        try:
            evaluated = self.evaluate()
        except TrainrunError as exc:     # raised on every rank (agreed): lose no trained step to it
            raise self._committed_first(exc)
        self.last_eval = evaluated
        self.metrics.log(self.step, evaluated)
        self.timer.mark("log")
        return evaluated

    def _sample(self) -> None:
        """train.sample_every (rank 0): a sample to the log and TensorBoard (text, tag ``samples``)."""
        if self.is_main:
            t0 = time.perf_counter()
            text = self.sampler.sample(self.engine.params, self.cfg.run.seed, self.step)
            took = time.perf_counter() - t0
            self.log(f"sample at step {self.step} ({took:.2f} s):\n{text}")
            self.metrics.text(self.step, "samples", f"step {self.step} ({took:.2f} s):\n\n{text}")
        self.timer.mark("sample")

    def _release(self) -> None:
        """After the last checkpoint: drop the sessions, the flat buffers and the optimizer state."""
        self.engine.close()
        self.shard = self.sampler = self.observe = None
        return_freed_memory()

    def _continue_hint(self) -> str:
        return f"Continue with `trainrun resume {self.out}`"

    def _export_hint(self) -> str:
        """How a stop at the end of the run is finished: a resume trains on, or only exports at the last step."""
        if self.step >= self.total_steps:
            return f"`trainrun resume {self.out}` exports it"
        return self._continue_hint()

    def _committed_first(self, exc: TrainrunError) -> TrainrunError:
        """An error every rank raised after this step trained (an evaluation that failed): this step's
        checkpoint committed first (not while updates are skipped: keep the good ones), then ``exc``."""
        if not self.nonfinite_in_a_row:
            self.save()
        self.checkpoints.finish()
        if self.checkpoints.saved_step == self.step:
            exc.message += (f"; checkpoint {os.path.join(self.out, 'checkpoints', str(self.step))} committed "
                            f"first. {self._continue_hint()} once the cause is fixed")
        return exc

    def _stop_if_signalled_in_setup(self) -> None:
        """A stop signal (or train.max_time) that reached a rank during set-up: :class:`Stopped` before the
        first step, nothing new to save (the last committed checkpoint, if any, is where a resume starts)."""
        if not self.comm.allreduce_scalars([self.signals.flag()])[0]:
            return
        sig = self.signals.received
        where = (f"checkpoint {os.path.join(self.out, 'checkpoints', str(self.step))} stands. "
                 f"{self._continue_hint()}" if self.resume_from else
                 "nothing was trained; run the same command again to start")
        raise collective(Stopped(f"stopped by {sig or 'a signal to another rank'} during set-up, before step "
                                 f"{self.step + 1}: {where}"))

    def _stopped(self) -> Stopped:
        """After a stop in the loop, the checkpoint of this step committed on every rank: its :class:`Stopped`."""
        sig = self.signals.received
        what = "the limit" if sig and sig.startswith("train.max_time") else "the signal"
        took = f" {time.monotonic() - self.signals.at:.1f} s after {what}" if sig else ""
        return collective(Stopped(
            f"stopped by {sig or 'a signal to another rank'} after step {self.step}; checkpoint "
            f"{os.path.join(self.out, 'checkpoints', str(self.step))} committed{took}. {self._continue_hint()}",
            by=sig or "a signal to another rank"))

    def save(self, evaluated: dict | None = None) -> None:
        """Checkpoint this step: the tensors written now, the rest in the background (every rank).
        ``evaluated``: this step's eval metrics, recorded in state.json (checkpoint.keep_best ranks by
        checkpoint.best_metric's)."""
        cfg = self.cfg
        best = C.watched_metric(cfg, "checkpoint.best_metric")
        meta = {"updates": self.updates, "skipped_steps": self.skipped, "loader": self.loader.state_dict(),
                "loss_scaler": self.scaler.state_dict() if self.scaler else None,
                "lr_schedule": {"step": self.step, "total_steps": self.total_steps,
                                "lr": learning_rate(self.step, cfg.optimizer.lr, self.total_steps, cfg.lr_schedule)},
                "world_size": self.world, "global_batch": self.global_batch, "seed": cfg.run.seed,
                "graphs": self.manifest["files"], "eval_loss": self._first_eval_loss(evaluated),
                "eval": evaluated, "best_metric": {"name": best, "value": evaluated[best],
                                                   "greater_is_better": C.greater_is_better(best)}
                if evaluated and best in evaluated else None,
                "early_stopping": self.early_stopping.state_dict()}
        self.average_model_state()
        # rank 0 alone writes the tensors; the others hash their parameters (and take part in the gathers
        # of stage 1's optimizer state)
        buffers = {"params": self.engine.params, **self.shard.full_state()}
        model_state = (self.engine.state_layout, self.engine.state)
        self.checkpoints.save(self.step, self.engine.layout, buffers, meta, self.config_yaml, model_state)
        self.timer.mark("checkpoint")

    # ------------------------------------------------------------------ start and end lines
    def _header(self) -> None:
        cfg = self.cfg
        n = self.manifest["num_params"]
        if self.verbose:
            self.log("resolved config:\n" + C.to_yaml(cfg))
            self.log(f"host {platform.node()} pid {os.getpid()} | local rank {self.comm.local_rank} of "
                     f"{self.comm.local_size} | device {cfg.device} | {self.threads} thread(s) | "
                     f"backend {self.comm.backend} | {cfg.train.micro_batch_size} samples x {self.accum} "
                     f"micro-batches per step", all_ranks=True)
            sh = self.shard
            self.log(f"zero stage {cfg.distributed.zero_stage}: this rank updates parameters {sh.lo}:{sh.hi} of {n} "
                     f"and holds {sum(b.nbytes for b in sh.state.values()):,} bytes of optimizer state",
                     all_ranks=True)
            node = getattr(sh, "node", None)
            self.log(f"intra-node: " + (f"shared (node rank {node.mem.node.rank} of {node.mem.node.world_size}, "
                                        f"node {node.mem.cross.rank} of {node.mem.cross.world_size}; one "
                                        f"{node.params.nbytes:,}-byte parameter buffer per node)" if node else "mpi"),
                     all_ranks=True)
        else:   # what differs from the defaults; the whole file is <output_dir>/config.yaml (devinfo prints it)
            self.log(f"config (what differs from the defaults; all of it in {os.path.join(self.out, 'config.yaml')}):"
                     f"\n{C.to_text_changed(cfg).rstrip()}")
        self.log(f"trainrun: {cfg.run.name} | {self.world} rank(s) x {self.threads} thread(s) | "
                 f"{n:,} parameters | global batch {self.global_batch} "
                 f"({cfg.train.micro_batch_size} x {self.accum} accum x {self.world} ranks) | "
                 + (f"{self.tokens_per_step:,} tokens/step | " if self.tokens else "")
                 + f"optimizer {cfg.optimizer.name} | "
                 f"{self.train_ds.num_samples:,} train samples | {self._length()}")

    def _footer(self, s: dict) -> None:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(s["phase_shares"].items(), key=lambda kv: -kv[1]))
        final_eval = f", eval loss {s['final_eval_loss']:.4f}" if s["final_eval_loss"] is not None else ""
        final = f"; final loss {s['final_loss']:.4f}" if s["final_loss"] is not None else ""
        unit = "tokens" if self.tokens else "samples"
        self.log(f"done: {s['steps']} steps, {s[unit]:,} {unit} in {fmt_duration(s['time_s'])} "
                 f"({s[unit + '_per_sec']:,.{0 if self.tokens else 1}f} {unit}/s){final}{final_eval}; "
                 f"time: {shares}"
                 + (f"; start-up {s['startup_s']:.1f} s, after the last step {s['end_s']:.1f} s"
                    if s["startup_s"] is not None else ""))


def train(cfg: C.Config, resume_from: str | None = None, force: bool = False,
          log_level: str | None = None) -> dict:
    """Train (or continue) on every rank. A failure on one rank ends the whole job
    at once (MPI abort) after printing its cause, so no peer waits in a collective.
    ``log_level`` (``--log-level``): this invocation's only; the run records its config's."""
    recorded = C.to_yaml(cfg)
    if log_level:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, log_level=log_level))
    if cfg.device == "cuda":
        if cuda_device_count() == 0:
            raise UsageError("device: cuda, but no CUDA GPU is visible (checked with cupy; install the "
                             "`gpu` extra on a machine with a GPU, or set device: cpu)")
    apply_log_level(cfg.run.log_level)
    comm = make_communicator(cfg.distributed.backend, cfg.device, cfg.distributed.timeout_s)
    lock = RunLock(cfg.run.output_dir)
    runner = None
    try:
        runner = TrainingRunner(cfg, comm, resume_from=resume_from, lock=lock, force=force, config_yaml=recorded)
        return runner.fit()
    except BaseException as exc:
        if comm.world_size > 1 and not getattr(exc, "collective", False):
            _report_and_abort(comm, exc, verbose=cfg.run.log_level == "verbose")
        raise
    finally:
        lock.release()
        comm.close()
        if runner is not None:
            runner.signals.settle()     # a stop from here on changes nothing, nor kills the process


def _report_and_abort(comm, exc: BaseException, verbose: bool) -> None:
    import sys
    import traceback
    if verbose:
        traceback.print_exc()
    if isinstance(exc, TrainrunError):
        text, code = exc.render(), exc.exit_code
    elif isinstance(exc, KeyboardInterrupt):
        text, code = "trainrun: interrupted", 130
    else:
        text, code = f"trainrun: error: {type(exc).__name__}: {exc}", 1
    print(f"[rank {comm.rank}] {text}", file=sys.stderr, flush=True)
    time.sleep(0.5)     # let the launcher forward the message before the job is torn down
    comm.abort(code)
