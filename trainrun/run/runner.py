"""The TrainingRunner: the data-parallel training loop, in the step's order.

:meth:`TrainingRunner.fit` runs :meth:`~TrainingRunner._loop` to the last step (or a stop), then ends the run
(:meth:`~TrainingRunner._end`: the last checkpoint committed, the observers closed, model.onnx exported,
summary.json). One step (:meth:`~TrainingRunner.train_step`), in the order of ORT's C++ runner: the
micro-batches' forward and backward passes (gradients summed in the flat buffer), the reduce
(:mod:`trainrun.sync.update`), ONE small allreduce of scalars (loss, squared gradient norm, stop flag, the
background checkpoint's progress: every rank takes the same decisions), the clipping divisor, the optimizer
step at this step's learning rate (skipped on every rank where the norm is not finite), the gather of a
partitioned update. The averaging factor 1/(accum x world) and the clipping divisor are applied inside the
optimizer (its ``grad_scale``), not in extra passes over the gradients. What follows a step (a metrics
line, an evaluation, early stopping, a checkpoint, a sample) is decided by :func:`step_end`. The set-up
before the first step is :mod:`trainrun.run.startup`; the eval sets' evaluation :mod:`trainrun.commands.evaluate`; the
export and summary.json :mod:`trainrun.run.finish`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

from ..step.sessions import import_onnxruntime

# onnxruntime first imported here, on a short stack, and without torch (see import_onnxruntime): imported with
# torch inside prepare or the engine, the exception its package check keeps (ORTModule's) held every frame
# below the import, locals included, for the life of the process (the model being built: 1 GB at GPT-2 124M)
import_onnxruntime()

from .. import checkpoint as K
from .. import config as C
from .. import faults
from .startup import header, return_freed_memory, set_up, start_trackers
from ..comm import cuda_device_count, make_communicator
from ..errors import TrainrunError, UsageError, collective
from ..commands.evaluate import evaluate_sets
from ..sync.elastic import Elastic
from .heal import Heal
from .finish import export_model, model_is_current, write_summary
from .lock import RunLock
from ..observe import Observer, apply_log_level
from ..observe.flops import Utilisation
from ..observe.metrics import Metrics
from ..observe.timer import PhaseTimer, process_age
from ..step.precision import make_scaler
from ..step.schedule import every, learning_rate
from .stopping import EarlyStopping, StopSignals, Stopped
from ..hf.tokenizer import record as record_tokenizer

MAX_NONFINITE_IN_A_ROW = 8


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
    due = functools.partial(every, step)
    last = step == end
    stop = stop_requested and not last          # the last step done, the run is finished: stop or no stop
    checkpoint = due(cfg.checkpoint.every) or last or stop
    # the last step's evaluation is the final one; keep_best ranks each checkpoint by its evaluation
    evaluate = has_eval and not stop and (due(t.eval_every) or last or (checkpoint and cfg.checkpoint.keep_best > 0))
    return StepEnd(last=last, stop=stop, log=due(t.log_every) or last or stop, evaluate=evaluate,
                   patience=evaluate and due(t.eval_every),      # patience counts eval_every's evaluations
                   checkpoint=checkpoint, sample=due(t.sample_every) and not stop)


class TrainingRunner:
    def __init__(self, cfg: C.Config, comm, resume_from: str | None = None, lock: RunLock | None = None,
                 force: bool = False, config_yaml: str | None = None, retry=None):
        self.started = time.monotonic()      # train.max_time counts from here
        self.cfg = cfg
        self.config_yaml = config_yaml or C.to_yaml(cfg)     # what the run directory and its checkpoints record
        self.lock = lock
        self.resume_from = resume_from
        self.comm = comm
        self.rank = self.comm.rank
        self.is_main = self.rank == 0
        self.verbose = cfg.run.log_level in ("devinfo", "verbose")
        self.out = cfg.run.output_dir
        t = cfg.train
        self.accum = t.gradient_accumulation_steps

        # SIGTERM/SIGINT/SIGUSR1 or train.max_time: stop after the step, with a checkpoint; noted from here on,
        # so that a signal during set-up stops the run before its first step instead of killing it
        self.signals = StopSignals(t.max_time_s(), started=self.started).__enter__()
        try:
            s = set_up(cfg, comm, resume_from=resume_from, lock=lock, config_yaml=self.config_yaml,
                       stop_flag=self.signals.flag, log=self.log, retry=retry)
        except BaseException:
            self.signals.__exit__()
            raise
        self.train_ds, self.eval_sets, self.total_steps, self.loader = s.train_ds, s.eval_sets, s.total_steps, s.loader
        self.tokens, self.perplexity, self.manifest, self.threads = s.tokens, s.perplexity, s.manifest, s.threads
        self.engine, self.shard, self.grad_buckets, self.sampler = s.engine, s.shard, s.grad_buckets, s.sampler
        self.sync = s.sync         # distributed.sync: every step, or DiLoCo's replicas and outer steps
        # the model FLOPs of a step and the ranks' measured peak: the MFU of the log lines and summary.json
        self.utilisation = Utilisation(self.engine, comm, self.threads, self.accum)
        resume_from = self.resume_from = s.resume_from     # a branch's: its copy in this run directory
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
        # what a checkpoint holds besides the model's tensors, each part registered once under its state.json
        # key (None: keys of its own) and saved and restored from here on in this order (Checkpointer.register)
        for key, part in ((None, self), (None, self.shard), (None, self.sync), ("loader", self.loader),
                          ("early_stopping", self.early_stopping), ("loss_scaler", self.scaler)):
            self.checkpoints.register(key, part)
        if resume_from:
            self._restore(resume_from, force, retry)
        # distributed.elastic: the step's collectives redone over the survivors of a lost rank; a rank that
        # rejoins is healed here from the job's rank 0, rank 0's writing taken over where it is lost (Heal)
        self.elastic = Elastic(comm, self.engine.grads, self.checkpoints, self.sync, cfg.distributed.min_replicas,
                               self.log, Heal(self)) if getattr(comm, "elastic", False) \
            else None
        self.metrics = Metrics(self.out, enabled=self.is_main, tensorboard=cfg.tensorboard.enabled,
                               quiet=cfg.run.log_level == "warning", total_steps=self.total_steps,
                               start_step=self.step, eval_sets=list(self.eval_sets))
        self.timer = PhaseTimer()
        # profiling, statistics, per-rank logs: off unless configured
        self.observe = Observer(cfg, self.rank, self.world, self.engine, self.timer, self.log)

    @property
    def world(self) -> int:
        """The ranks training now (fewer after a rank was lost, distributed.elastic)."""
        return self.comm.world_size

    @property
    def global_batch(self) -> int:
        return self.cfg.global_batch(self.world)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.data.seq_len

    def log(self, text: str, all_ranks: bool = False) -> None:
        if self.verbose and (self.is_main or all_ranks):     # devinfo/verbose: every line names its rank
            print("".join(f"[rank {self.rank}] {line}\n" for line in text.splitlines()), end="", flush=True)
        elif self.is_main and self.cfg.run.log_level != "warning":
            print(text, flush=True)

    def _restore(self, ckpt: str, force: bool = False, retry=None) -> None:
        """The model's tensors and every registered part's state from ``ckpt`` (``force``: ``resume --force``,
        tensors the model or optimizer no longer takes are dropped with a warning; ``retry``: the command
        resuming from another checkpoint, named where ``ckpt`` is corrupt)."""
        eng = self.engine
        state = self.checkpoints.restore(ckpt, eng.layout, eng.params, model_state=(eng.state_layout, eng.state),
                                         state_range=(self.shard.lo, self.shard.hi), forced=force, retry=retry,
                                         lora_base=(self.manifest.get("lora") or {}).get("base_sha256"))
        self.log(f"resumed from {ckpt} at step {self.step} (saved by {state['world_size']} rank(s), "
                 f"now {self.world})")

    def state_dict(self) -> dict:
        """The run's own keys of state.json: its counters, restored on resume, and what it records of itself
        (the LR schedule's position, world size, global batch, seed, graphs, LoRA base weights)."""
        cfg = self.cfg
        return {"updates": self.updates, "skipped_steps": self.skipped,
                "lr_schedule": {"step": self.step, "total_steps": self.total_steps,
                                "lr": learning_rate(self.step, cfg.optimizer.lr, self.total_steps, cfg.lr_schedule)},
                "world_size": self.world, "global_batch": self.global_batch, "seed": cfg.run.seed,
                "graphs": self.manifest["files"], "lora_base": (self.manifest.get("lora") or {}).get("base_sha256")}

    def load_state_dict(self, state: dict, ckpt: str) -> None:
        self.step, self.updates, self.skipped = state["step"], state["updates"], state["skipped_steps"]

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict | None:
        """Train to the end (or a stop), then end the run (:meth:`_end`); the summary (None: nothing to train)."""
        t = self.cfg.train
        if self.is_main and self.cfg.data.train:     # set-up passed: generate and export find the tokenizer here
            record_tokenizer(self.cfg.data.train, self.out)
        header(self.cfg, self.comm, self.threads, self.shard, self.manifest, self.train_ds,
               self._length(), self.log)
        # before the clocks: a W&B run takes seconds to start
        self.metrics.trackers = start_trackers(self.cfg, self.comm, bool(self.resume_from), self.log)
        self.comm.barrier()          # start the clocks together: set-up time differs between ranks
        self.timer.restart()
        start, first_step, startup = time.perf_counter(), self.step, process_age()
        end = min(self.total_steps, t.stop_at) if t.stop_at else self.total_steps
        self.last, self.last_eval = {}, None     # the last step's result, the last evaluation
        self.end = end
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
            if "outer" in self.last:     # DiLoCo's outer step: bytes sent, time waiting, the replicas' drift
                self.metrics.log(self.step, self.last["outer"])
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

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict:
        timer = self.timer
        if self.elastic is not None and self.elastic.before_step(self.step):
            timer.mark("rejoin")     # distributed.elastic: a lost rank spawned, or taken back, where agreed
        faults.kill("KILL_STEP", self.rank, self.step + 1)
        faults.stall("STALL_STEP", self.rank, self.step + 1)
        faults.wait_until("WAIT_SIGNAL", self.rank, self.step + 1, self.signals.flag)
        micro = self.loader.next_step()
        timer.mark("data")
        stats = self.observe.stats_step(self.step + 1)     # None unless debug.stats_every says so
        loss_sum = self.forward_backward(micro, stats)
        if faults.hit("NAN_GRAD", self.rank, self.step + 1):
            self.engine.grads[0] = float("nan")
        timer.mark("forward_backward")
        world = self.world_step(self.step + 1)
        if self.elastic is None:
            self.shard.reduce()
            timer.mark("allreduce")
            sums = self.scalar_sums(loss_sum, world)
        else:       # a rank lost in either drops out and both are redone over the survivors
            sums = self.elastic.step(self.step + 1, lambda: (self.shard.reduce(), self.scalar_sums(loss_sum, world))[1],
                                     world)
            timer.mark("allreduce")
        loss, grad_norm, finite, stop, give_up = self.step_scalars(sums, world)
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
            self.skip_step(give_up)
        if finite and self.scaler:
            self.scaler.update(True)
        timer.mark("optimizer")
        if finite and self.shard.sharded:
            self.shard.gather()
            timer.mark("allgather")
        outer = self.sync.maybe_outer_step(self.step)
        if outer:
            result["outer"] = outer
            timer.mark("outer")
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

    def world_step(self, step: int) -> bool:
        """Whether ``step``'s scalars are summed over the world: the sync policy's call
        (:meth:`trainrun.sync.policy.Policy.world_step`), told where the world must agree whatever its schedule
        (fp16's loss scale, a checkpoint write in flight)."""
        return self.sync.world_step(step, self.end, agree=self.scaler is not None
                                    or self.checkpoints.writer.pending_step is not None)

    def scalar_sums(self, loss_sum: float, world: bool = True):
        """The sync policy's one allreduce of a few scalars (:meth:`trainrun.sync.policy.Policy.scalars`): over
        the world (``world``), carrying the background checkpoint's progress, the stop flags and the non-finite
        limit, or over this rank's replica (its loss and its norm). Collectives only, so that
        distributed.elastic can redo it over the survivors of a lost rank."""
        norm_part = self.shard.norm_sq_part()
        if not world:
            return self.sync.scalars(loss_sum, norm_part)
        ck_done, ck_failed = self.checkpoints.status()
        self.stops_carried = self.signals.noted()
        limit = float(self.nonfinite_in_a_row + 1 >= MAX_NONFINITE_IN_A_ROW)
        return self.sync.scalars(loss_sum, norm_part, [ck_done, ck_failed, float(self.stops_carried > 0), limit])

    def step_scalars(self, s, world: bool = True) -> tuple[float, float, bool, bool, bool]:
        """(mean loss, gradient norm, finite, a stop signal reached some rank or the ranks alive fell below
        distributed.min_replicas, some rank's non-finite steps in a row reach the limit with this one), from
        :meth:`scalar_sums`' ``s``."""
        stop = limit = False
        if world:
            ck_done, ck_failed, stop, limit = s.carried
            self.checkpoints.progress(ck_done, ck_failed)
            stop = stop or (self.elastic is not None and self.elastic.below is not None)
        grad_norm = math.sqrt(s.norm_sq) * self.grad_scale() if s.finite else float("inf")
        return s.loss_sum / (self.accum * s.ranks), grad_norm, s.finite, bool(stop), bool(limit)

    def grad_scale(self) -> float:
        """The gradient buffer holds a sum over ranks and micro-batches (times the fp16 loss scale):
        this makes it the mean."""
        return 1.0 / (self.accum * self.shard.comm.world_size * (self.scaler.scale if self.scaler else 1.0))

    def clip_divisor(self, grad_norm: float) -> float:
        clip = self.cfg.optimizer.max_grad_norm
        return grad_norm / clip if clip > 0 and grad_norm > clip else 1.0

    def optimizer_step(self, lr: float, grad_scale: float) -> None:
        self.nonfinite_in_a_row = 0
        self.updates += 1
        self.shard.step(lr, self.updates, grad_scale)

    def skip_step(self, give_up: bool) -> None:
        """The ranks that step together saw the same non-finite flag: skip the update; too many in a row stop
        the run (``give_up``: agreed by every rank at a world step, :meth:`step_scalars`)."""
        self.skipped += 1
        self.nonfinite_in_a_row += 1
        if give_up:
            self.checkpoints.finish()     # a write still in flight holds good weights: commit it first
            raise collective(TrainrunError(
                f"{self.nonfinite_in_a_row} steps in a row had non-finite gradients (last at step {self.step}); "
                f"stopping without a checkpoint of these weights. Lower optimizer.lr or check the data."))
        self.log(f"step {self.step}: non-finite gradients on some rank, update skipped ({self.skipped} so far)")

    # ------------------------------------------------------------------ what follows a step (step_end)
    def _log_step(self) -> None:
        """A metrics line: the step's loss, learning rate and gradient norm, the throughput and the mean time
        per phase since the previous line."""
        last, (since, step, phases) = self.last, self._window
        now, steps = time.perf_counter(), self.step - step
        sps = steps * self.global_batch / (now - since)
        phase_ms = {k: round(1e3 * (v - phases.get(k, 0.0)) / steps, 3)
                    for k, v in self.timer.total.items() if v > phases.get(k, 0.0)}
        self._window = (now, self.step, dict(self.timer.total))
        mfu = self.utilisation.of(steps, now - since)
        self.metrics.log(self.step, {"loss": last["loss"], "lr": last["lr"], "grad_norm": last["grad_norm"],
                                     "samples_per_sec": sps,
                                     **({"tokens_per_sec": sps * self.cfg.data.seq_len} if self.tokens else {}),
                                     **({"mfu": mfu} if mfu is not None else {}),
                                     "skipped_steps": self.skipped, "phase_ms": phase_ms,
                                     **({"replicas": self.elastic.replicas} if self.elastic else {}),
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

    def evaluate(self) -> dict:
        """Every eval set's metrics (:func:`trainrun.commands.evaluate.evaluate_sets`), with this step's model state."""
        self.average_model_state()
        with self.sync.global_weights():     # DiLoCo: mid-round, the global weights, not this replica's
            evaluated = evaluate_sets(self.engine, self.comm, self.cfg, self.eval_sets, step=self.step,
                                      perplexity=self.perplexity)
        self.timer.mark("eval")
        return evaluated

    def average_model_state(self) -> None:
        """Model state that is not a parameter (BatchNorm running stats) is updated by each rank from its
        own batches: replace it by the mean over ranks (before eval, checkpoints and so export), so every
        rank evaluates and every checkpoint holds the statistics of all the data."""
        state = self.engine.state
        if state.size and self.world > 1:
            self.comm.allreduce_(state)
            state *= 1.0 / self.world

    def save(self, evaluated: dict | None = None) -> None:
        """Checkpoint this step: the tensors written now, the rest in the background (every rank).
        ``evaluated``: this step's eval metrics, recorded in state.json (checkpoint.keep_best ranks by
        checkpoint.best_metric's)."""
        best = C.watched_metric(self.cfg, "checkpoint.best_metric")
        evals = {"eval_loss": self._first_eval_loss(evaluated), "eval": evaluated,
                 "best_metric": {"name": best, "value": evaluated[best], "greater_is_better": C.greater_is_better(best)}
                 if evaluated and best in evaluated else None}
        self.average_model_state()
        # rank 0 alone writes the tensors; the others hash their parameters (and take part in the gathers
        # of stage 1's optimizer state); the registered parts' state with them
        eng = self.engine
        self.checkpoints.save(self.step, eng.layout, {"params": eng.params}, evals, self.config_yaml,
                              (eng.state_layout, eng.state))
        self.timer.mark("checkpoint")

    def _sample(self) -> None:
        """train.sample_every (rank 0): a sample to the log and TensorBoard (text, tag ``samples``)."""
        if self.is_main:
            t0 = time.perf_counter()
            text = self.sampler.sample(self.engine.params, self.cfg.run.seed, self.step)
            took = time.perf_counter() - t0
            self.log(f"sample at step {self.step} ({took:.2f} s):\n{text}")
            self.metrics.text(self.step, "samples", f"step {self.step} ({took:.2f} s):\n\n{text}")
        self.timer.mark("sample")

    # ------------------------------------------------------------------ the end of the run
    def _end(self, ending: str, start: float, first_step: int, startup: float | None) -> dict:
        """The end of the run, after its last step (``ending``: "end", "early" or "stop", :meth:`_loop`): the
        last checkpoint committed, the observers closed, model.onnx exported (rank 0), summary.json. A stop
        that came after the last step's allreduce lets the commit finish and skips the export; one during the
        export abandons it. Either way :class:`Stopped` (exit 75) once summary.json is written."""
        stop = self._commit_last(ending)
        loop_end = time.perf_counter()
        self._close_training()
        if stop is None and self.is_main and self.checkpoints.saved_step == self.step:
            stop = self._export(self._checkpoint())
        summary = self._summary(start, first_step, startup, loop_end, stop and stop.by)
        if stop is not None:
            raise stop
        t = self.cfg.train
        if self.step == t.stop_at < self.total_steps and self.checkpoints.saved_step == self.step:
            self.log(f"stopped at train.stop_at {t.stop_at} of {self._length()}; checkpoint "
                     f"{self._checkpoint()} committed. {self._continue_hint()}")
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
        ckpt = self._checkpoint()
        where = f"the last step, {self.step}" if self.step == self.total_steps else f"step {self.step}"
        return collective(Stopped(
            f"stopped by {mine or 'a signal to another rank'} after {where}: checkpoint {ckpt} committed (its "
            f"write finished), model.onnx not exported. {self._export_hint()}", by=mine or "a signal to another rank"))

    def _close_training(self) -> None:
        """After the last checkpoint committed: the observers closed (the profiler's window written), the
        shared memory freed by every rank (collective), before rank 0 exports."""
        self.wire_bytes = self.shard.wire.sent_bytes     # the gradients' bytes on the wire (trainrun.sync.wire)
        self.observe.close()
        self.shard.close()
        self.sync.close()

    def _export(self, ckpt: str) -> Stopped | None:
        """rank 0: model.onnx from ``ckpt`` (:func:`trainrun.run.finish.export_model`), after dropping what
        training held (the export reads the checkpoint); the :class:`Stopped` of a stop that abandons it."""
        self.engine.close()
        # the sync policy and the checkpoint's parts hold the engine and the shard too (attach, register):
        # dropped with them, so that the moments go
        self.shard = self.sync = self.sampler = self.observe = None
        self.checkpoints.parts.clear()
        return_freed_memory()
        return export_model(ckpt, self.out, self.signals, self.stops_carried, self._export_hint(), self.log)

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
            # model FLOP/s utilisation over the session's wall time (the log lines': over their window)
            **self.utilisation.summary(ran, elapsed),
            "final_loss": self.last.get("loss"), "final_eval_loss": self._first_eval_loss(self.last_eval),
            **({"final_eval": self.last_eval} if self.last_eval else {}), "world_size": self.world,
            "phase_shares": {k: round(v, 4) for k, v in self.timer.shares().items()},
            # bytes this rank sent for the gradient reduction, per step (trainrun.sync.wire: fp32 or bf16 on the wire)
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
            write_summary(self.out, summary, self.tokens, self.log)
        return summary

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

    # ------------------------------------------------------------------ stops and errors
    def _stop_if_signalled_in_setup(self) -> None:
        """A stop signal (or train.max_time) that reached a rank during set-up: :class:`Stopped` before the
        first step, nothing new to save (the last committed checkpoint, if any, is where a resume starts)."""
        if not self.comm.allreduce_scalars([self.signals.flag()])[0]:
            return
        sig = self.signals.received
        where = (f"checkpoint {self._checkpoint()} stands. "
                 f"{self._continue_hint()}" if self.resume_from else
                 "nothing was trained; run the same command again to start")
        raise collective(Stopped(f"stopped by {sig or 'a signal to another rank'} during set-up, before step "
                                 f"{self.step + 1}: {where}"))

    def _stopped(self) -> Stopped:
        """After a stop in the loop, the checkpoint of this step committed on every rank: its :class:`Stopped`."""
        if self.elastic is not None and self.elastic.below is not None:
            return collective(Stopped(f"stopped after step {self.step}: {self.elastic.below}; checkpoint "
                                      f"{self._checkpoint()} committed. {self._continue_hint()}",
                                      by=self.elastic.below))
        sig = self.signals.received
        what = "the limit" if sig and sig.startswith("train.max_time") else "the signal"
        took = f" {time.monotonic() - self.signals.at:.1f} s after {what}" if sig else ""
        return collective(Stopped(
            f"stopped by {sig or 'a signal to another rank'} after step {self.step}; checkpoint "
            f"{self._checkpoint()} committed{took}. {self._continue_hint()}",
            by=sig or "a signal to another rank"))

    def _committed_first(self, exc: TrainrunError) -> TrainrunError:
        """An error every rank raised after this step trained (an evaluation that failed): this step's
        checkpoint committed first (not while updates are skipped: keep the good ones), then ``exc``."""
        if not self.nonfinite_in_a_row:
            self.save()
        self.checkpoints.finish()
        if self.checkpoints.saved_step == self.step:
            exc.message += (f"; checkpoint {self._checkpoint()} committed "
                            f"first. {self._continue_hint()} once the cause is fixed")
        return exc

    # ------------------------------------------------------------------ small helpers
    def _length(self) -> str:
        """How long the run is, as the config says it: ``train.max_steps N`` or ``train.max_epochs E: N steps``."""
        t = self.cfg.train
        if t.max_epochs and not t.max_steps:
            return f"train.max_epochs {t.max_epochs:g}: {self.total_steps} steps"
        return f"train.max_steps {self.total_steps}"

    def _first_eval_loss(self, evaluated: dict | None) -> float | None:
        """The loss of data.eval, or of its first named set."""
        return evaluated.get(C.eval_key(next(iter(self.eval_sets), None), "loss")) if evaluated else None

    def _checkpoint(self) -> str:
        """This step's checkpoint directory."""
        return os.path.join(self.out, "checkpoints", str(self.step))

    def _continue_hint(self) -> str:
        return f"Continue with `trainrun resume {self.out}`"

    def _export_hint(self) -> str:
        """How a stop at the end of the run is finished: a resume trains on, or only exports at the last step."""
        if self.step >= self.total_steps:
            return f"`trainrun resume {self.out}` exports it"
        return self._continue_hint()


def train(cfg: C.Config, resume_from: str | None = None, force: bool = False,
          log_level: str | None = None, retry=None) -> dict:
    """Train (or continue) on every rank. A failure on one rank ends the whole job
    at once (MPI abort) after printing its cause, so no peer waits in a collective.
    ``log_level`` (``--log-level``): this invocation's only; the run records its config's. ``retry``: the
    command that resumes from another checkpoint than ``resume_from``, given its path (named where
    ``resume_from`` is corrupt)."""
    recorded = C.to_yaml(cfg)
    if log_level:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, log_level=log_level))
    if cfg.device == "cuda":
        if cuda_device_count() == 0:
            raise UsageError("device: cuda, but no CUDA GPU is visible (checked with cupy; install the "
                             "`gpu` extra on a machine with a GPU, or set device: cpu)")
    apply_log_level(cfg.run.log_level)
    comm = make_communicator(cfg.distributed.backend, cfg.device, cfg.distributed.timeout_s,
                             elastic=cfg.distributed.elastic)
    lock = RunLock(cfg.run.output_dir)
    runner = None
    try:
        runner = TrainingRunner(cfg, comm, resume_from=resume_from, lock=lock, force=force, config_yaml=recorded,
                                retry=retry)
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
