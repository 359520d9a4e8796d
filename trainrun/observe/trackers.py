"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases (rank 0 only).

Each gets what TensorBoard gets, under the same names (``train/loss``, ``eval/loss``,
``time/<phase>_ms`` ...) at the same steps, plus the resolved config as parameters, one
per leaf key (``optimizer.lr``). Both libraries are optional (the ``trackers`` extra) and
imported only when their section is set. The tracker run ids are kept in
``<output_dir>/trackers.json``, so a resumed run continues the same tracker run.

Each tracker's calls (its start, every ``log``, its end) run in order on a thread of its own, behind a
bounded queue, so a step never waits for a tracking server. A tracker that fails, that leaves a call
unanswered for ``logging.timeout_s`` seconds (a server that hangs), or that falls more than
``QUEUE`` logged steps behind is reported once and dropped: the training, metrics.jsonl and
TensorBoard go on. One whose start raises stops the run before its first step (exit 2); one whose
start is not answered in time is dropped, and the run goes on without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time

from ..errors import UsageError
from ..run.stopping import STOPPED_EXIT as STOPPED

PIP = "pip install 'trainrun[trackers]'"
IDS_FILE = "trackers.json"
_MLFLOW_BATCH = 100        # MLflow's limit of parameters (and of metrics: 1000) per log_batch call
_MLFLOW_PARAM_LEN = 6000   # MLflow's longest parameter value
QUEUE = 1000               # logged steps a tracker may have waiting before it is dropped


def check_installed(logging) -> None:
    """UsageError naming the key and the pip command when a tracker ``logging`` (the config's section)
    configures has no library installed."""
    problems = [f"logging.{key}: {need} is set but the {lib} package is not installed; {PIP}"
                for key, need, lib, on in (("mlflow", "tracking_uri", "mlflow", logging.mlflow.tracking_uri),
                                           ("wandb", "project", "wandb", logging.wandb.project))
                if on and importlib.util.find_spec(lib) is None]
    if problems:
        raise UsageError("experiment tracker library missing", problems)


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """The leaves of a nested dict (the resolved config) as ``{"a.b": "value"}``, each value as YAML
    writes it in one line (null, true, 0.0006, [a, b]); strings as they are."""
    import yaml
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, str) else \
                yaml.safe_dump(v, default_flow_style=True, width=10_000).removesuffix("...\n").strip()
    return out


class _Mlflow:
    name = "mlflow"

    @staticmethod
    def load() -> None:
        import mlflow.tracking  # noqa: F401

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None, params: dict[str, str],
                 echo):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        if uri.startswith("file:"):     # asked for by name: MLflow 3 keeps its file store, in maintenance mode,
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")     # behind this opt-in
        self.client = MlflowClient(tracking_uri=uri)
        self.resumed = run_id is not None
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            have = {}
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            have = self.client.get_run(run_id).data.params
        changed = sorted(k for k, v in params.items() if k in have and have[k] != v[:_MLFLOW_PARAM_LEN])
        if changed:     # MLflow refuses to change a parameter of a run
            echo(f"mlflow: run {self.run_id} keeps its first value of {', '.join(changed)} (changed on resume)")
        todo = [Param(k, v[:_MLFLOW_PARAM_LEN]) for k, v in params.items() if k not in have]
        for i in range(0, len(todo), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=todo[i:i + _MLFLOW_BATCH])
        self.where = f"mlflow run {self.run_id} in experiment {experiment!r} at {uri}"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric
        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in scalars.items()])

    def close(self, exit_code: int) -> None:
        self.client.set_terminated(self.run_id, status={0: "FINISHED", STOPPED: "KILLED"}.get(exit_code, "FAILED"))


class _Wandb:
    name = "wandb"

    @staticmethod
    def load() -> None:
        import wandb  # noqa: F401

    def __init__(self, project: str, mode: str, run_name: str, run_id: str | None, params: dict[str, str],
                 output_dir: str):
        import wandb
        self.resumed = run_id is not None
        self.run = wandb.init(
            project=project, name=run_name, id=run_id, resume="allow" if run_id else None, mode=mode,
            dir=None if os.environ.get("WANDB_DIR") else output_dir, config=params, allow_val_change=True,
            settings=wandb.Settings(console="off", silent=True))
        # x axis: the training step, logged with each line (a resumed run logs the steps after its
        # checkpoint again, which W&B's own step counter, strictly increasing, would drop)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run_id = self.run.id
        self.where = f"wandb run {self.run_id} ({mode}) in project {project!r}: {self.run.dir}"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def close(self, exit_code: int) -> None:
        if exit_code == STOPPED:
            self.run.mark_preempting()     # W&B's state for a job stopped to be continued
        self.run.finish(exit_code=exit_code)


class _Worker:
    """One tracker's calls, in order, on a daemon thread (a call that never returns holds that thread
    alone, and does not keep the process from exiting)."""

    def __init__(self, key: str):
        self.key, self.name = key, key.split(".")[-1]
        self.tracker = None
        self.calls: queue.Queue = queue.Queue(maxsize=QUEUE)
        self.busy_since: float | None = None     # monotonic start of the call in progress
        self.busy_step: int | None = None
        self.error: tuple[int | None, BaseException] | None = None     # (step, exception) of a failed call
        threading.Thread(target=self._serve, name=f"trainrun-{self.name}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            step, call, done = self.calls.get()
            if self.error is None:      # after a failure the calls still queued are only acknowledged
                self.busy_since, self.busy_step = time.monotonic(), step
                try:
                    call()
                except Exception as exc:     # noqa: BLE001 - whatever the library raises: the caller reports it
                    self.error = (step, exc)
                self.busy_since = None
            if done is not None:
                done.set()

    def submit(self, step: int | None, call, done: threading.Event | None = None) -> bool:
        try:
            self.calls.put_nowait((step, call, done))
            return True
        except queue.Full:
            return False

    def hung(self, timeout: float) -> bool:
        """Whether the call in progress has run for more than ``timeout`` seconds."""
        since = self.busy_since
        return since is not None and time.monotonic() - since > timeout


class Trackers:
    """The configured trackers of rank 0; ``log`` and ``close`` never raise nor wait for a tracker
    (``close`` waits up to ``logging.timeout_s`` for what is queued): a failing or hanging one is dropped."""

    def __init__(self, cfg, output_dir: str, *, resumed: bool, echo):
        import dataclasses
        self.echo = echo
        self.timeout = float(cfg.logging.timeout_s)
        self.open: list[_Worker] = []
        m, w = cfg.logging.mlflow, cfg.logging.wandb
        if not (m.tracking_uri or w.project):
            return
        check_installed(cfg.logging)
        path = os.path.join(output_dir, IDS_FILE)
        ids = {}
        if resumed and os.path.isfile(path):
            with open(path) as fh:
                ids = json.load(fh)
        params = flat_params(dataclasses.asdict(cfg))
        starting = []
        if m.tracking_uri:
            uri = m.tracking_uri if ":" in m.tracking_uri else "file://" + m.tracking_uri
            same = ids.get("mlflow", {})
            starting.append((self._start("logging.mlflow", _Mlflow, uri, m.experiment or cfg.run.name, cfg.run.name,
                                         same.get("run_id") if same.get("tracking_uri") == uri else None, params,
                                         echo), {"tracking_uri": uri}))
        if w.project:
            same = ids.get("wandb", {})
            starting.append((self._start("logging.wandb", _Wandb, w.project, w.mode, cfg.run.name,
                                         same.get("run_id") if same.get("project") == w.project else None, params,
                                         output_dir), {"project": w.project}))
        deadline = time.monotonic() + self.timeout      # the trackers start together, their libraries loaded
        failed, record = [], {}
        for (worker, done), where in starting:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                echo(f"warning: {worker.key}: no answer in {self.timeout:g} s (logging.timeout_s) while starting "
                     f"the tracker run; the run goes on without {worker.name}")
            elif worker.error is not None:
                failed.append((worker, worker.error[1]))
            else:
                self.open.append(worker)
                record[worker.name] = {**where, "run_id": worker.tracker.run_id}
        if failed:
            self.close(exit_code=2)
            worker, exc = failed[0]
            text = str(exc).strip()
            raise UsageError(f"{worker.key}: cannot start the tracker run: {type(exc).__name__}"
                             + (f": {text.splitlines()[0]}" if text else ""))
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(path + ".tmp", path)
        for worker in self.open:
            echo(("continuing " if worker.tracker.resumed else "logging to ") + worker.tracker.where)

    @staticmethod
    def _start(key: str, cls, *args) -> tuple[_Worker, threading.Event]:
        """The tracker's start on its own thread (a server not answering, a store not writable, a login
        missing: the caller waits up to the timeout); its library imported first, here."""
        cls.load()
        worker, done = _Worker(key), threading.Event()

        def start():
            worker.tracker = cls(*args)
        worker.submit(None, start, done)
        return worker, done

    def _drop(self, worker: _Worker, why: str) -> None:
        self.open.remove(worker)
        self.echo(f"warning: {worker.name} {why} and is off for the rest of the run (training goes on)")

    def _check(self, worker: _Worker) -> bool:
        """False (the tracker dropped, said why) when it failed or a call of it hangs."""
        if worker.error is not None:
            step, exc = worker.error
            self._drop(worker, f"failed at step {step}: {type(exc).__name__}: {exc}")
            return False
        if worker.hung(self.timeout):
            self._drop(worker, self._hung(worker))
            return False
        return True

    def _hung(self, worker: _Worker) -> str:
        since, step = worker.busy_since, worker.busy_step
        what = "its end" if step is None else f"its call of step {step}"
        waited = f"{time.monotonic() - since:.1f}" if since is not None else f"{self.timeout:g}"
        return f"timed out: no answer in {waited} s to {what} (logging.timeout_s {self.timeout:g})"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for worker in list(self.open):
            if self._check(worker) and not worker.submit(step, lambda t=worker.tracker, s=dict(scalars): t.log(step, s)):
                self._drop(worker, f"fell {QUEUE} logged steps behind at step {step}")

    def close(self, exit_code: int = 0) -> None:
        """End the tracker runs: 0 finished, 75 stopped (resumable), else failed. Waits up to
        logging.timeout_s for the calls still queued."""
        ending = []
        for worker in list(self.open):
            done = threading.Event()
            if self._check(worker) and worker.submit(None, lambda t=worker.tracker: t.close(exit_code), done):
                ending.append((worker, done))
            elif worker in self.open:
                self.open.remove(worker)
        deadline = time.monotonic() + self.timeout
        for worker, done in ending:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                self.echo(f"warning: {worker.name} {self._hung(worker)}; its run is left as it is")
            elif worker.error is not None:
                step, exc = worker.error
                where = "could not close its run" if step is None else f"failed at step {step}"
                self.echo(f"warning: {worker.name} {where}: {type(exc).__name__}: {exc}")
        self.open = []
