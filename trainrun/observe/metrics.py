"""Where numbers go: the console (with a progress bar), metrics.jsonl, TensorBoard and the experiment
trackers (:mod:`.trackers`: MLflow, W&B; the TensorBoard scalars under the same names).

Only rank 0 writes. Every ``log`` call appends one JSON object to
``metrics.jsonl`` and the matching scalars (``train/loss`` ...) to TensorBoard
as ONE event, written in the calling thread. tensorboardX's ``SummaryWriter``
sends every scalar through a multiprocessing queue to a logger thread (about
40 us per scalar here, plus the GIL that thread takes back from the step);
writing the event file directly with tensorboardX's ``EventsWriter`` costs
about 50 us per logged step for all scalars, and needs no thread. The event
file is flushed when it is closed (and by its 8 KiB buffer before that), like
SummaryWriter's ``flush_secs``; metrics.jsonl is flushed at every line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from ..step.sessions import import_without_torch

_TB_NAMES = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "tokens_per_sec": "train/tokens_per_sec", "samples_per_sec": "train/samples_per_sec", "mfu": "train/mfu",
             "eval_loss": "eval/loss",
             "eval_perplexity": "eval/perplexity", "skipped_steps": "train/skipped_steps",
             "loss_scale": "train/loss_scale", "outer_bytes": "outer/bytes", "outer_wait_s": "outer/wait_s",
             "outer_drift": "outer/drift", "outer_s": "outer/seconds"}


# what an evaluation covered, not a metric: ``eval_samples`` of ``eval_dataset_samples`` (metrics.jsonl only)
EVAL_COUNTS = ("samples", "dataset_samples")


def _tb_name(key: str, eval_sets=(None,)) -> str | None:
    """TensorBoard tag of a metrics key: the fixed names above; ``eval_<metric>`` -> ``eval/<metric>``;
    with named eval sets ``eval_<NAME>_<metric>`` -> ``eval/<NAME>/<metric>``."""
    if key in _TB_NAMES and None in eval_sets:
        return _TB_NAMES[key]
    if key in _TB_NAMES and not key.startswith("eval_"):
        return _TB_NAMES[key]
    found = _eval_split(key, eval_sets)
    if found is None or found[1] in EVAL_COUNTS:
        return None
    name, metric = found
    return f"eval/{metric}" if name is None else f"eval/{name}/{metric}"


def _eval_split(key: str, eval_sets) -> tuple | None:
    """(set name, metric) of an eval metrics key (the longest set name that fits), or None."""
    for name in sorted(eval_sets, key=lambda n: -len(n or "")):
        prefix = "eval_" if name is None else f"eval_{name}_"
        if key.startswith(prefix) and len(key) > len(prefix):
            return name, key[len(prefix):]
    return None


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a line cut short (a crash while it was written)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Metrics:
    def __init__(self, output_dir: str, *, enabled: bool, tensorboard: bool, quiet: bool,
                 total_steps: int, start_step: int = 0, eval_sets=(None,), trackers=None):
        self.enabled = enabled
        self.eval_sets = list(eval_sets) or [None]     # data.eval's set names (None: a single unnamed set)
        self.quiet_asked = quiet
        self.quiet = quiet or not enabled
        self.total = total_steps
        self.t0 = time.perf_counter()
        self.start_step = start_step
        self._jsonl = None
        self._tb = None
        self._bar = None
        self.trackers = trackers      # a .trackers.Trackers (rank 0) or None
        if enabled:
            self._open(output_dir, tensorboard)

    def _open(self, output_dir: str, tensorboard: bool, suffix: str = "") -> None:
        self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            import_without_torch("tensorboardX")       # its writer imports torch where installed
            from tensorboardX.event_file_writer import EventsWriter
            tb_dir = os.path.join(output_dir, "tensorboard")
            os.makedirs(tb_dir, exist_ok=True)
            self._tb = EventsWriter(os.path.join(tb_dir, "events"), filename_suffix=suffix)
        if not self.quiet and sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=self.total, initial=self.start_step, unit="step", dynamic_ncols=True,
                             file=sys.stderr)

    def take_over(self, output_dir: str, step: int, tensorboard: bool) -> None:
        """``distributed.elastic``: rank 0, which wrote, was lost after step ``step``'s line at most; this rank
        (the lowest survivor) writes from now on. A line the lost writer left cut short is removed (the lines
        before it stand); TensorBoard gets an event file of its own beside the lost writer's (TensorBoard reads
        every file of the folder); the experiment trackers' runs were the lost rank's and end with it."""
        path = os.path.join(output_dir, "metrics.jsonl")
        try:
            with open(path, "rb+") as fh:
                data = fh.read()
                if data and not data.endswith(b"\n"):
                    fh.truncate(data.rfind(b"\n") + 1)
        except FileNotFoundError:
            pass
        self.enabled, self.quiet, self.start_step, self.t0 = True, self.quiet_asked, step, time.perf_counter()
        self._open(output_dir, tensorboard, suffix=f".{os.getpid()}")    # not the lost writer's file name

    def echo(self, text: str) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def progress(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)     # redraws at most every 0.1 s (tqdm's mininterval)

    def eta(self, step: int) -> float:
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return (time.perf_counter() - self.t0) / done * (self.total - step)

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values, "elapsed_s": round(time.perf_counter() - self.t0, 3)}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None or self.trackers is not None:
            scalars = self.scalars(values)
            if self._tb is not None and scalars:
                self._tensorboard(step, scalars)
            if self.trackers is not None and scalars:
                self.trackers.log(step, scalars)
        if "loss" in values:
            eta = self.eta(step)
            rate = (f"{values['tokens_per_sec']:,.0f} tok/s" if "tokens_per_sec" in values
                    else f"{values['samples_per_sec']:,.1f} samples/s")
            self.echo(f"step {step:>6}/{self.total} | loss {values['loss']:.4f} | lr {values['lr']:.2e} | "
                      f"grad_norm {values['grad_norm']:.3f} | {rate} | "
                      + (f"mfu {100 * values['mfu']:.1f}% | " if "mfu" in values else "") +
                      f"eta {fmt_duration(eta) if math.isfinite(eta) else '?'}")
        evals: dict = {}      # per eval set: its metrics (perplexity where the runner gives it)
        for k, v in values.items():
            if (found := _eval_split(k, self.eval_sets)) is not None:
                evals.setdefault(found[0], {})[found[1]] = v
        for name, got in evals.items():
            more = "".join(f" | {m} {v:.{2 if m == 'perplexity' else 4}f}" for m, v in got.items()
                           if m != "loss" and m not in EVAL_COUNTS)
            counted = f" ({got['samples']} of {got['dataset_samples']} samples)" if "samples" in got else ""
            self.echo(f"eval{' ' + name if name else ''} {step:>6} | loss {got.get('loss', float('nan')):.4f}{more}"
                      f"{counted}")

    def scalars(self, values: dict) -> dict[str, float]:
        """The logged values by TensorBoard tag (train/loss, eval/loss, eval/<set>/loss, time/<phase>_ms ...),
        a NaN or infinite one too (a diverging loss is what a dashboard is watched for)."""
        tags = {k: _tb_name(k, self.eval_sets) for k in values}
        out = {tags[k]: float(v) for k, v in values.items()
               if tags[k] and isinstance(v, (int, float)) and not isinstance(v, bool)}
        out.update({f"time/{k}_ms": v for k, v in values.get("phase_ms", {}).items()})
        return out

    def _tensorboard(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        self._tb.write_event(Event(wall_time=time.time(), step=step, summary=Summary(
            value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()])))

    def resume_at(self, step: int) -> int:
        """A resumed run that trains again after ``step``: the lines of later steps (logged by a session
        that ended before its next checkpoint, so those steps are trained again) leave metrics.jsonl, and
        TensorBoard drops its events from step + 1 on (a SessionLog START there: its purge step), so every
        step appears once. Returns the number of lines removed."""
        if not self.enabled:
            return 0
        path = self._jsonl.name
        self._jsonl.close()
        with open(path) as fh:
            lines = fh.readlines()
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        if len(kept) < len(lines):
            with open(path + ".tmp", "w") as fh:
                fh.writelines(kept)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(path + ".tmp", path)     # whole or not at all
        self._jsonl = open(path, "a", buffering=1)
        if self._tb is not None:
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            self._tb.write_event(Event(wall_time=time.time(), step=step + 1,
                                       session_log=SessionLog(status=SessionLog.START)))
        return len(lines) - len(kept)

    def text(self, step: int, tag: str, text: str) -> None:
        """A text summary in TensorBoard (its Text tab) under ``tag``."""
        if self._tb is not None:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import text as text_summary
            self._tb.write_event(Event(wall_time=time.time(), step=step, summary=text_summary(tag, text)))
            self._tb.flush()

    def close(self, exit_code: int = 0) -> None:
        """Flush and close the files, end the tracker runs with the run's exit code (0: finished; 75:
        stopped by a signal, resumable; else failed). Idempotent."""
        if self.trackers is not None:
            self.trackers.close(exit_code)
            self.trackers = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
