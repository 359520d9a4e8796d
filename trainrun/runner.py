"""The TrainingRunner: the data-parallel training loop.

One step, in the order of ORT's C++ runner:

1. ``gradient_accumulation_steps`` micro-batches, gradients accumulated in place;
2. ONE allreduce (sum) over the flat gradient buffer;
3. global gradient norm (of the averaged gradient), finite check agreed by all
   ranks, clipping to ``max_grad_norm``;
4. the optimizer graph, in place; a non-finite step is skipped on every rank;
5. the learning rate is a pure function of the step (:mod:`trainrun.schedule`);
6. logging every ``log_every`` steps, eval every ``eval_every`` steps.

The averaging factor 1/(accum x world) and the clipping divisor are applied
inside the optimizer graph (its ``grad_scale`` input) instead of in extra passes
over the gradient buffer; in float32 that is the same arithmetic.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time

import numpy as np

from . import checkpoint as K
from . import config as C
from . import graphs as G
from .comm import make_communicator
from .data import TrainLoader, eval_batches, open_dataset
from .engine import Engine, EngineOptions, from_host
from .errors import TrainrunError, UsageError
from .metrics import Metrics, fmt_duration
from .observe import Observer, apply_log_level, engine_options
from .optim import state_names
from .schedule import learning_rate

MAX_NONFINITE_IN_A_ROW = 8
_ORT_SEVERITY = {"warning": 3, "info": 3, "devinfo": 1, "verbose": 0}
# optimizer fields that are inputs of the optimizer graph, not baked into it
_NOT_BAKED = ("lr", "max_grad_norm")


class PhaseTimer:
    """Wall time per phase of the step (data, forward_backward, allreduce, optimizer, ...)."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self._t = time.perf_counter()
        self.spans: list | None = None     # (phase, start, end) of each mark while profiling records them

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.total[phase] = self.total.get(phase, 0.0) + now - self._t
        if self.spans is not None:
            self.spans.append((phase, self._t, now))
        self._t = now

    def shares(self) -> dict[str, float]:
        s = sum(self.total.values()) or 1.0
        return {k: v / s for k, v in self.total.items()}


def _config_hash(cfg: C.Config) -> str:
    return hashlib.sha256(C.to_yaml(cfg).encode()).hexdigest()[:16]


def _graphs_match(graphs_dir: str, cfg: C.Config) -> bool:
    try:
        manifest = G.load_manifest(graphs_dir)
    except UsageError:
        return False
    def baked(d):
        return {k: v for k, v in d.items() if k not in _NOT_BAKED}
    return manifest["model"] == C.to_dict(cfg.model) \
        and baked(manifest["optimizer"]) == baked(C.to_dict(cfg.optimizer)) \
        and manifest.get("build", G.DEFAULT_BUILD) == G.build_options(cfg) \
        and all(os.path.exists(os.path.join(graphs_dir, f)) for f in manifest["files"])


class TrainingRunner:
    def __init__(self, cfg: C.Config, comm, resume_from: str | None = None):
        self.cfg = cfg
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

        self._prepare_run_dir()
        self._check_same_everywhere()
        self._open_data()
        self._build_engine()
        self.step = 0              # optimizer steps taken (including skipped non-finite ones)
        self.updates = 0           # successful updates: the optimizer's own step count
        self.skipped = 0
        self.saved_step = None     # step of the newest committed checkpoint
        self.writer = K.CheckpointWriter(self.out, self.rank, self.world, cfg.checkpoint.keep_last, log=self.log)
        if resume_from:
            self._load(resume_from)
        self.metrics = Metrics(self.out, enabled=self.is_main, tensorboard=cfg.tensorboard.enabled,
                               quiet=cfg.run.log_level == "warning", total_steps=t.max_steps,
                               start_step=self.step)
        self.timer = PhaseTimer()
        self.observe = Observer(self)   # profiling, statistics, per-rank logs: off unless configured

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
                ckpt_dir = os.path.join(self.out, "checkpoints")
                if not self.resume_from and K.complete_checkpoints(ckpt_dir):
                    raise UsageError(f"{self.out} already holds checkpoints; continue it with "
                                     f"`trainrun resume {self.out}` or choose another run.output_dir")
                K.cleanup(ckpt_dir, log=self.log)
                os.makedirs(self.out, exist_ok=True)
                with open(os.path.join(self.out, "config.yaml"), "w") as fh:
                    fh.write(C.to_yaml(cfg))
                if not _graphs_match(self.graphs_dir, cfg):
                    self.log(f"preparing graphs in {self.graphs_dir}")
                    G.prepare(cfg, self.graphs_dir)
            except TrainrunError as exc:
                error = exc
        self._agree(error)

    def _agree(self, error: TrainrunError | None) -> None:
        """Raise the same error on every rank when any rank has one (the first rank's wins).

        Such an error is *collective*: no rank is left waiting in a collective, so the
        job ends normally with the error's exit code instead of an MPI abort."""
        mine = [error.exit_code, error.message, error.problems] if error else None
        reports = self.comm.allgather_object(mine)
        for r, report in enumerate(reports):
            if report:
                code, message, problems = report
                exc = (UsageError if code == 2 else TrainrunError)(
                    message if r == 0 or self.world == 1 else f"rank {r}: {message}", problems)
                exc.collective = True
                raise exc

    def _check_same_everywhere(self) -> None:
        try:
            manifest = G.load_manifest(self.graphs_dir)
            mine = {"config": _config_hash(self.cfg), "graphs": manifest["files"], "host": platform.node()}
        except UsageError as exc:
            mine = {"config": _config_hash(self.cfg), "graphs": None, "error": exc.message}
        everyone = self.comm.allgather_object(mine)
        ref = everyone[0]
        for r, other in enumerate(everyone):   # every rank sees the same list: the error is collective
            error = None
            if other.get("graphs") is None:
                error = UsageError(f"rank {r} cannot read the prepared graphs: {other.get('error')}")
            elif other["config"] != ref["config"]:
                error = UsageError(f"rank {r} has a different config than rank 0 "
                                   f"(hash {other['config']} vs {ref['config']}); launch every rank with the "
                                   f"same --config and --set")
            elif other["graphs"] != ref["graphs"]:
                error = UsageError(f"rank {r} ({other['host']}) sees different graph files than rank 0 in "
                                   f"{self.graphs_dir}")
            if error:
                error.collective = True
                raise error
        self.manifest = manifest

    def _open_data(self) -> None:
        cfg = self.cfg
        g = cfg.model.gpt2 if cfg.model.builtin == "gpt2" else None
        vocab = g.vocab_size if g else None
        positions = g.n_positions if g else None
        self.train_ds = open_dataset(cfg.data.train, cfg.data.seq_len, vocab_size=vocab, n_positions=positions)
        if self.train_ds.num_samples < self.global_batch:
            raise UsageError(f"data.train: {cfg.data.train} has {self.train_ds.num_samples} samples of "
                             f"{cfg.data.seq_len + 1} tokens, fewer than one global batch ({self.global_batch})")
        self.eval_ds = None
        if cfg.data.eval:
            self.eval_ds = open_dataset(cfg.data.eval, cfg.data.seq_len, vocab_size=vocab, n_positions=positions)
        self.loader = TrainLoader(self.train_ds, micro_batch=cfg.train.micro_batch_size, accum=self.accum,
                                  rank=self.rank, world_size=self.world, seed=cfg.run.seed,
                                  shuffle=cfg.data.shuffle, prefetch=cfg.data.prefetch)

    def _build_engine(self) -> None:
        cfg = self.cfg
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = cfg.engine.threads or max(1, cores // max(1, self.comm.local_size))
        if cfg.run.deterministic:
            threads = 1
        self.threads = threads
        opts = EngineOptions(device=cfg.device, device_id=self.comm.local_rank, threads=threads,
                             graph_optimization=cfg.engine.graph_optimization,
                             optimizer_kernel=cfg.engine.optimizer_kernel,
                             log_severity=_ORT_SEVERITY[cfg.run.log_level], deterministic=cfg.run.deterministic,
                             **engine_options(cfg, self.rank))
        mb = cfg.train.micro_batch_size
        shapes = {name: ((mb, *shape), dtype) for name, (shape, dtype) in self.train_ds.specs.items()}
        self.engine = Engine(self.graphs_dir, opts, shapes, shapes, state_names(cfg.optimizer))
        self.engine.load_weights()

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict:
        cfg, eng, timer = self.cfg, self.engine, self.timer
        micro = self.loader.next_step()
        timer.mark("data")
        stats = self.observe.stats_step(self.step + 1)     # None unless debug.stats_every says so
        loss_sum = 0.0
        for a, batch in enumerate(micro):
            loss_sum += eng.forward_backward(batch, accumulate=a > 0, position=self.loader.sample_position(a))
            if stats:
                stats.micro_batch()
        self.local_loss = loss_sum / self.accum
        timer.mark("forward_backward")

        self.comm.allreduce_(eng.grads)
        timer.mark("allreduce")

        scale = 1.0 / (self.accum * self.world)          # sum over ranks and micro-batches -> mean
        norm_sq = eng.grad_norm_sq()
        grad_norm = math.sqrt(norm_sq) * scale if math.isfinite(norm_sq) else float("inf")
        # one tiny collective: loss, the finite check and the background checkpoint's status
        ck_done, ck_failed = self.writer.status()
        loss_total, nonfinite, ck_done, ck_failed = self.comm.allreduce_scalars(
            [loss_sum, 0.0 if math.isfinite(grad_norm) else 1.0, ck_done, ck_failed], op="sum")
        loss = loss_total / (self.accum * self.world)
        self._checkpoint_progress(ck_done, ck_failed)
        timer.mark("norm")

        self.step += 1
        lr = learning_rate(self.step, cfg.optimizer.lr, cfg.train.max_steps, cfg.lr_schedule)
        if nonfinite:
            self.skipped += 1
            self._nonfinite_in_a_row += 1
            if self._nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
                exc = TrainrunError(f"{self._nonfinite_in_a_row} steps in a row had non-finite gradients "
                                    f"(last at step {self.step}); stopping without a checkpoint of these "
                                    f"weights. Lower optimizer.lr or check the data.")
                exc.collective = True      # every rank saw the same agreed flag
                raise exc
            self.log(f"step {self.step}: non-finite gradients on some rank, update skipped "
                     f"({self.skipped} so far)")
        else:
            self._nonfinite_in_a_row = 0
            clip = cfg.optimizer.max_grad_norm
            divisor = grad_norm / clip if clip > 0 and grad_norm > clip else 1.0
            self.updates += 1
            eng.optimizer_step(lr, self.updates, scale / divisor)
        timer.mark("optimizer")
        if stats:
            stats.finish(self.step, scale, {"loss": loss, "local_loss": self.local_loss, "grad_norm": grad_norm,
                                            "lr": lr})
            timer.mark("stats")
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm}

    def evaluate(self) -> float:
        cfg = self.cfg
        total, count = 0.0, 0.0
        for batch in eval_batches(self.eval_ds, micro_batch=cfg.train.micro_batch_size, rank=self.rank,
                                  world_size=self.world, steps=cfg.train.eval_steps * self.accum):
            total += self.engine.evaluate(batch)
            count += 1
        total, count = self.comm.allreduce_scalars([total, count], op="sum")
        self.timer.mark("eval")
        return total / max(count, 1.0)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self._nonfinite_in_a_row = 0
        self._header()
        self.comm.barrier()          # start the clocks together: set-up time differs between ranks
        self.timer = PhaseTimer()
        start, first_step = time.perf_counter(), self.step
        window_t, window_steps = time.perf_counter(), 0
        last = {}
        eval_loss = None
        try:
            end = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
            while self.step < end:
                self.observe.step_begin(self.step + 1)
                last = self.train_step()
                window_steps += 1
                self.metrics.progress(self.step)
                if self.step % t.log_every == 0 or self.step == end:
                    now = time.perf_counter()
                    tps = window_steps * self.tokens_per_step / (now - window_t)
                    window_t, window_steps = now, 0
                    self.metrics.log(self.step, {**last, "tokens_per_sec": tps, "skipped_steps": self.skipped})
                    self.timer.mark("log")
                if self.eval_ds is not None and (
                        (t.eval_every and self.step % t.eval_every == 0) or self.step == end):
                    eval_loss = self.evaluate()
                    self.metrics.log(self.step, {"eval_loss": eval_loss,
                                                 "eval_perplexity": math.exp(min(eval_loss, 80.0))})
                    self.timer.mark("log")
                every = cfg.checkpoint.every
                if ((every and self.step % every == 0) or self.step == end) and not self._nonfinite_in_a_row:
                    self.save()       # never while updates are being skipped: keep_last keeps good ones
                self.observe.step_end(self.step, last)
            self.observe.close()
            self._finish_checkpoint()
        finally:
            self.loader.close()
        elapsed = time.perf_counter() - start
        if self.is_main and self.saved_step == self.step:
            from .export import export_checkpoint
            export_checkpoint(os.path.join(self.out, "checkpoints", str(self.step)),
                              os.path.join(self.out, "model.onnx"), echo=self.log)
        ran = self.step - first_step        # steps of this session (a resumed run started later)
        summary = {
            "steps": ran, "final_step": self.step, "skipped_steps": self.skipped,
            "tokens": ran * self.tokens_per_step, "time_s": round(elapsed, 3),
            "tokens_per_sec": ran * self.tokens_per_step / max(elapsed, 1e-9),
            "final_loss": last.get("loss"), "final_eval_loss": eval_loss, "world_size": self.world,
            "phase_shares": {k: round(v, 4) for k, v in self.timer.shares().items()},
        }
        self._footer(summary)
        self.metrics.close()
        return summary

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """Snapshot the state and write it in the background (every rank)."""
        if self.writer.pending_step is not None:      # the previous write is still in flight
            self.writer.wait()
            self._checkpoint_progress(*self.comm.allreduce_scalars(list(self.writer.status()), op="sum"))
        meta = {
            "format_version": K.FORMAT_VERSION, "step": self.step, "updates": self.updates,
            "skipped_steps": self.skipped, "loader": self.loader.state_dict(),
            "lr_schedule": {"step": self.step, "lr": learning_rate(self.step, self.cfg.optimizer.lr,
                                                                   self.cfg.train.max_steps, self.cfg.lr_schedule)},
            "world_size": self.world, "global_batch": self.global_batch,
            "seed": self.cfg.run.seed, "graphs": self.manifest["files"],
            "optimizer_states": list(self.engine.state),
        }
        buffers = {"params": self.engine.params, **self.engine.state}
        self.writer.start(self.step, self.engine.layout, buffers, meta, C.to_yaml(self.cfg))
        self.timer.mark("checkpoint")

    def _checkpoint_progress(self, done: float, failed: float) -> None:
        if self.writer.pending_step is None:
            return
        if failed:   # every rank learned it from the same allreduce: agree on one message
            step = self.writer.pending_step
            causes = self.comm.allgather_object(self.writer.error_text())
            self.writer.abandon()
            exc = TrainrunError(f"checkpoint at step {step} failed ("
                                + "; ".join(f"rank {r}: {c}" for r, c in enumerate(causes) if c)
                                + "); older checkpoints are intact")
            exc.collective = True
            raise exc
        if done == self.world:
            step = self.writer.pending_step
            if self.is_main:
                path = self.writer.commit()
                self.log(f"checkpoint saved: {path}")
            else:
                self.writer.pending_step = None
            self.saved_step = step

    def _finish_checkpoint(self) -> None:
        if self.writer.pending_step is not None:
            self.writer.wait()
            self._checkpoint_progress(*self.comm.allreduce_scalars(list(self.writer.status()), op="sum"))

    def _load(self, ckpt: str) -> None:
        """Restore parameters, optimizer state, step counters and the data position."""
        bad = None
        try:
            if self.is_main:
                K.verify(ckpt)       # checksums once; every rank then reads the verified files
            self._agree(None)
            state = K.read_state(ckpt)
            L = self.engine.layout
            host = np.empty(L.total, np.float32)
            K.load_tensors_into(os.path.join(ckpt, "model.safetensors"), L.names, L.shapes, host)
            from_host(self.engine.params, host)
            for s_name, buf in self.engine.state.items():
                if s_name not in state["optimizer_states"]:
                    raise UsageError(f"{ckpt}: holds no optimizer state '{s_name}' (saved: "
                                     f"{state['optimizer_states']}); the optimizer changed")
                K.load_tensors_into(os.path.join(ckpt, "optimizer.safetensors"), L.names, L.shapes, host,
                                    prefix=f"{s_name}/")
                from_host(buf, host)
            self.loader.load_state_dict(state["loader"])
        except TrainrunError as exc:
            if getattr(exc, "collective", False):
                raise
            bad = exc
        self._agree(bad)
        self.step, self.updates, self.skipped = state["step"], state["updates"], state["skipped_steps"]
        self.saved_step = self.step
        self.log(f"resumed from {ckpt} at step {self.step} (saved by {state['world_size']} rank(s), "
                 f"now {self.world})")

    def _header(self) -> None:
        cfg = self.cfg
        n = self.manifest["num_params"]
        if self.cfg.run.log_level in ("devinfo", "verbose"):
            self.log("resolved config:\n" + C.to_yaml(cfg))
        else:   # one line per section; the whole file is <output_dir>/config.yaml
            self.log("config (" + os.path.join(self.out, "config.yaml") + "):\n" + C.to_yaml_compact(cfg))
        self.log(f"trainrun: {cfg.run.name} | {self.world} rank(s) x {self.threads} thread(s) | "
                 f"{n:,} parameters | global batch {self.global_batch} "
                 f"({cfg.train.micro_batch_size} x {self.accum} accum x {self.world} ranks) | "
                 f"{self.tokens_per_step:,} tokens/step | optimizer {cfg.optimizer.name} | "
                 f"{self.train_ds.num_samples:,} train samples")

    def _footer(self, s: dict) -> None:
        if not self.is_main:
            return
        with open(os.path.join(self.out, "summary.json"), "w") as fh:
            json.dump(s, fh, indent=1)
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(s["phase_shares"].items(), key=lambda kv: -kv[1]))
        final_eval = f", eval loss {s['final_eval_loss']:.4f}" if s["final_eval_loss"] is not None else ""
        final = f"; final loss {s['final_loss']:.4f}" if s["final_loss"] is not None else ""
        self.log(f"done: {s['steps']} steps, {s['tokens']:,} tokens in {fmt_duration(s['time_s'])} "
                 f"({s['tokens_per_sec']:,.0f} tokens/s){final}{final_eval}; "
                 f"time: {shares}")

    def close(self) -> None:
        self.comm.close()


def train(cfg: C.Config, resume_from: str | None = None) -> dict:
    """Train (or continue) on every rank. A failure on one rank ends the whole job
    at once (MPI abort) after printing its cause, so no peer waits in a collective."""
    if cfg.device == "cuda":
        from .comm import cuda_device_count
        if cuda_device_count() == 0:
            raise UsageError("device: cuda, but no CUDA GPU is visible (checked with cupy; install the "
                             "`gpu` extra on a machine with a GPU, or set device: cpu)")
    apply_log_level(cfg.run.log_level)
    comm = make_communicator(cfg.distributed.backend, cfg.device, cfg.distributed.timeout_s)
    try:
        return TrainingRunner(cfg, comm, resume_from=resume_from).fit()
    except BaseException as exc:
        if comm.world_size > 1 and not getattr(exc, "collective", False):
            _report_and_abort(comm, exc, verbose=cfg.run.log_level == "verbose")
        raise
    finally:
        comm.close()


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


# keys `resume --set` may change without --force (prefix match)
SAFE_ON_RESUME = ("train.max_steps", "train.stop_at", "train.eval_every", "train.eval_steps", "train.log_every",
                  "train.micro_batch_size", "train.gradient_accumulation_steps", "checkpoint.",
                  "optimizer.lr", "optimizer.max_grad_norm", "lr_schedule.", "run.log_level", "engine.",
                  "tensorboard.", "data.prefetch", "data.eval", "distributed.timeout_s", "distributed.backend",
                  "profile.", "debug.")


def resume(path: str, overrides: list[str], force: bool = False) -> dict:
    """Continue the run holding ``path`` (a run directory or one of its checkpoints)."""
    from .comm import detect_world
    ckpt = K.resolve_checkpoint(path)
    run_dir = K.run_dir_of(ckpt)
    saved_path = os.path.join(ckpt, "config.yaml")
    saved = C.load_config(saved_path)
    cfg = C.load_config(saved_path, overrides, need_data=True)
    saved.run.output_dir = cfg.run.output_dir = run_dir   # the run may have been moved
    state = K.read_state(ckpt)
    if not any(o.split("=", 1)[0].strip() == "train.stop_at" for o in overrides) \
            and cfg.train.stop_at and cfg.train.stop_at <= state["step"]:
        saved.train.stop_at = cfg.train.stop_at = 0     # that stop was the saving session's; run on
    changed = _changed_keys(C.to_dict(saved), C.to_dict(cfg))
    unsafe = [k for k in changed if not k.startswith(SAFE_ON_RESUME)]
    if unsafe and not force:
        raise UsageError("resume: these keys change the model, optimizer or data and would not continue the "
                         "same run (add --force to do it anyway)", [f"{k}: {C.get(saved, k)!r} -> "
                                                                   f"{C.get(cfg, k)!r}" for k in unsafe])
    _, world = detect_world()
    if cfg.global_batch(world) != state["global_batch"] and not force:
        raise UsageError(
            f"resume: the global batch would change from {state['global_batch']} "
            f"(saved by {state['world_size']} rank(s)) to {cfg.global_batch(world)} "
            f"({cfg.train.micro_batch_size} x {cfg.train.gradient_accumulation_steps} accum x {world} ranks); "
            f"keep it with --set train.micro_batch_size=... / train.gradient_accumulation_steps=... "
            f"(or --force)")
    return train(cfg, resume_from=ckpt)


def _changed_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in a:
        path = f"{prefix}{k}"
        if isinstance(a[k], dict):
            out += _changed_keys(a[k], b[k], path + ".")
        elif a[k] != b[k]:
            out.append(path)
    return out

