"""When a run stops before its last step: on a signal or train.max_time (:class:`StopSignals`), or on an
eval metric (:class:`EarlyStopping`).

SIGTERM, SIGINT or SIGUSR1 end the run after the current step, with a checkpoint; so does
``train.max_time``: each rank compares its own clock with the limit and raises the same flag a signal
raises, so the ranks agree on the step through the same allreduce.

Clusters stop jobs by signal: SLURM sends SIGTERM to every task at the time limit or on preemption
(then SIGKILL after KillWait, 30 s by default), ``--signal=USR1@120`` warns ahead, Kubernetes sends
SIGTERM; MPICH's mpiexec forwards SIGTERM, SIGINT and SIGUSR1 to every rank. The handler only notes
the signal; :meth:`StopSignals.flag` rides in the runner's per-step scalar allreduce, so every rank
sees a signal that reached any rank after the same step, commits a checkpoint of it, and the job
exits with :data:`STOPPED_EXIT`.

A second SIGINT (Ctrl-C again) interrupts at once (exit 130); a second SIGTERM/SIGUSR1 is ignored,
the save in progress goes on. Either way nothing half-written looks committed (the commit is one
atomic rename, :mod:`trainrun.checkpoint`).

The handlers stay until the run's outcome is decided, the signals then ignored until the process exits
(:meth:`StopSignals.settle`). A stop that the last step's allreduce carries changes
nothing: that step done, the run is finished (final evaluation, checkpoint, export). One noted after
it (:meth:`StopSignals.noted` counts them) stops the end of the run: the last checkpoint's commit is
finished, the export not started, or abandoned where rank 0 is in it (:meth:`StopSignals.abandoning`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from ..errors import TrainrunError

STOPPED_EXIT = 75       # sysexits.h EX_TEMPFAIL: "temporary failure, retry later": resumable
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# the launchers' rank variables (trainrun.comm.node.WORLD_ENV_VARS; that package loads numpy)
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def _stopped_starting(signum, frame) -> None:
    """A stop signal before the command took the signals over: one line (rank 0), exit :data:`STOPPED_EXIT`.
    Nothing of the run exists yet (the run directory is first touched after :class:`StopSignals` is in)."""
    if next((os.environ[v] for v in _RANK_VARS if v in os.environ), "0") == "0":
        os.write(2, f"trainrun: stopped by {signal.Signals(signum).name} during start-up, before any step: nothing "
                    f"was written; run the same command again\n".encode())
    os._exit(STOPPED_EXIT)


def start_up() -> None:
    """The trainrun command's first lines, before its heavy imports (onnxruntime, numpy, mpi4py and MPI's
    start): SIGTERM, SIGINT and SIGUSR1 end the process with exit 75 and one line saying so, not a
    launcher's bare exit 15. A run's :class:`StopSignals` takes them over; any other command gives them
    back to Python's defaults as it starts (:func:`started`)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _stopped_starting)


def _default(s: int):
    return signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL


def started() -> None:
    """A command other than a run starts: the signals :func:`start_up` took go back to Python's defaults."""
    for s in SIGNALS:
        if signal.getsignal(s) is _stopped_starting:
            signal.signal(s, _default(s))


class Stopped(TrainrunError):
    """The run stopped on a signal after committing a checkpoint: resumable (exit 75). ``by``: what stopped it
    (a signal's name, ``train.max_time (...)``, or "a signal to another rank")."""
    exit_code = STOPPED_EXIT

    def __init__(self, message: str, by: str | None = None):
        super().__init__(message)
        self.by = by

    def render(self) -> str:
        return f"trainrun: {self.message}"


class Abandon(BaseException):
    """Raised by a stop signal inside :meth:`StopSignals.abandoning`: the work in progress is dropped."""

    def __init__(self, received: str):
        super().__init__(received)
        self.received = received


class StopSignals:
    """Notes stop signals; installed from the start of the run's set-up until the process ends (main thread
    only): a signal during set-up (reading the data, preparing graphs, opening sessions) is noted too, and the
    run stops before its first step. Entering it again while installed does nothing.
    ``max_time``: seconds from ``started`` (a ``time.monotonic()``) after which :meth:`flag` raises too."""

    def __init__(self, max_time: float | None = None, started: float | None = None):
        self.received: str | None = None    # the first signal's name, e.g. "SIGTERM", or "train.max_time ..."
        self.at: float | None = None         # time.monotonic() when it arrived
        self.latest: str | None = None       # the latest one's
        self.count = 0                       # stops noted: every signal, and the limit once
        self.deadline = None if max_time is None else (started or time.monotonic()) + max_time
        self.max_time = max_time
        self._old: dict = {}
        self._abandoning = False

    def __enter__(self) -> "StopSignals":
        if not self._old and threading.current_thread() is threading.main_thread():
            for s in SIGNALS:       # start_up's handlers are not put back: once set up, a run has written
                old = signal.signal(s, self._handle)
                self._old[s] = _default(s) if old is _stopped_starting else old
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def settle(self) -> None:
        """The run's outcome decided: the stop signals ignored until the process exits. (As the interpreter
        finalizes it puts back the default handlers, which would kill a rank still waiting in MPI_Finalize for
        rank 0's export; an ignored signal stays ignored.)"""
        if self._old:
            for s in SIGNALS:
                signal.signal(s, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        first = self.received is None
        self.count, self.latest = self.count + 1, name
        if first:
            self.received, self.at = name, time.monotonic()
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self._abandoning:
            raise Abandon(name)

    def flag(self) -> float:
        """1.0 once a signal arrived on this rank, or its clock passed train.max_time (summed over ranks by
        the runner)."""
        if self.received is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.received, self.at = f"train.max_time ({_hms(self.max_time)})", self.deadline
            self.count, self.latest = self.count + 1, self.received
        return 0.0 if self.received is None else 1.0

    def noted(self) -> int:
        """How many stops this rank noted so far (signals, and the limit once it passed)."""
        self.flag()
        return self.count

    @contextlib.contextmanager
    def abandoning(self):
        """Inside: a stop signal raises :class:`Abandon` at once (main thread), to drop work that must not
        hold the process past it (the export at the end of a run)."""
        self._abandoning = True
        try:
            yield
        finally:
            self._abandoning = False


def _hms(seconds: float) -> str:
    m, s = divmod(seconds, 60)
    return f"{int(m // 60)}:{int(m % 60):02d}:{s:05.2f}".rstrip("0").rstrip(".")


class EarlyStopping:
    """``train.early_stopping``: stop once ``patience`` evaluations in a row did not improve the best
    value of ``metric`` (a metrics key, e.g. ``eval_loss``, ``eval_val_accuracy``) by more than
    ``min_delta`` (patience 0: never); lower is better for a loss, higher for an accuracy
    (:func:`trainrun.config.greater_is_better`). Its state is saved in checkpoints."""

    def __init__(self, patience: int, min_delta: float, metric: str = "eval_loss"):
        from ..config import greater_is_better      # not at import: stopping is the command line's first import
        self.patience, self.min_delta, self.metric = patience, min_delta, metric
        self.sign = -1.0 if greater_is_better(metric) else 1.0     # compares sign * value: lower is better
        self.best: float | None = None
        self.best_step: int | None = None
        self.evals_since_best = 0

    def update(self, step: int, evaluated: dict) -> bool:
        """Note an evaluation (its metrics); True when the run should stop now."""
        value = evaluated[self.metric]
        if self.best is None or self.sign * value < self.sign * self.best - self.min_delta:
            self.best, self.best_step, self.evals_since_best = value, step, 0
        else:
            self.evals_since_best += 1
        return self.patience > 0 and self.evals_since_best >= self.patience

    def describe(self) -> str:
        return (f"{self.metric} did not improve by more than {self.min_delta:g} in {self.evals_since_best} "
                f"evaluations (best {self.best:.4f} at step {self.best_step})")

    def state_dict(self) -> dict:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step,
                "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state; one that watched another metric (changed on resume) starts afresh."""
        if state.get("metric", "eval_loss") != self.metric:
            return
        self.best = state.get("best", state.get("best_eval_loss"))
        self.best_step = state.get("best_step")
        self.evals_since_best = state.get("evals_since_best", 0)
