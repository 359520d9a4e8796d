"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases (rank 0 only).

Each gets what TensorBoard gets, under the same names (``train/loss``, ``eval/loss``,
``time/<phase>_ms`` ...) at the same steps, plus the resolved config as parameters, one
per leaf key (``optimizer.lr``). Both libraries are optional (the ``trackers`` extra) and
imported only when their section is set. The tracker run ids are kept in
``<output_dir>/trackers.json``, so a resumed run continues the same tracker run.

A tracker that fails while the run trains is reported once and dropped: the training,
metrics.jsonl and TensorBoard go on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

from ..errors import UsageError
from ..stopping import STOPPED_EXIT as STOPPED

PIP = "pip install 'trainrun[trackers]'"
IDS_FILE = "trackers.json"
_MLFLOW_BATCH = 100        # MLflow's limit of parameters (and of metrics: 1000) per log_batch call
_MLFLOW_PARAM_LEN = 6000   # MLflow's longest parameter value


def check_installed(cfg) -> None:
    """UsageError naming the key and the pip command when a configured tracker's library is missing."""
    problems = [f"logging.{key}: {need} is set but the {lib} package is not installed; {PIP}"
                for key, need, lib, on in (("mlflow", "tracking_uri", "mlflow", cfg.logging.mlflow.tracking_uri),
                                           ("wandb", "project", "wandb", cfg.logging.wandb.project))
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


class Trackers:
    """The configured trackers of rank 0; ``log`` and ``close`` never raise (a failing tracker is dropped)."""

    def __init__(self, cfg, output_dir: str, *, resumed: bool, echo):
        import dataclasses
        self.echo = echo
        self.open: list = []
        m, w = cfg.logging.mlflow, cfg.logging.wandb
        if not (m.tracking_uri or w.project):
            return
        check_installed(cfg)
        path = os.path.join(output_dir, IDS_FILE)
        ids = {}
        if resumed and os.path.isfile(path):
            with open(path) as fh:
                ids = json.load(fh)
        params = flat_params(dataclasses.asdict(cfg))
        record = {}
        if m.tracking_uri:
            uri = m.tracking_uri if ":" in m.tracking_uri else "file://" + m.tracking_uri
            same = ids.get("mlflow", {})
            self._start("logging.mlflow", _Mlflow, uri, m.experiment or cfg.run.name, cfg.run.name,
                        same.get("run_id") if same.get("tracking_uri") == uri else None, params, echo)
            record["mlflow"] = {"tracking_uri": uri, "run_id": self.open[-1].run_id}
        if w.project:
            same = ids.get("wandb", {})
            self._start("logging.wandb", _Wandb, w.project, w.mode, cfg.run.name,
                        same.get("run_id") if same.get("project") == w.project else None, params, output_dir)
            record["wandb"] = {"project": w.project, "run_id": self.open[-1].run_id}
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(path + ".tmp", path)
        for t in self.open:
            echo(("continuing " if t.resumed else "logging to ") + t.where)

    def _start(self, key: str, cls, *args) -> None:
        try:
            self.open.append(cls(*args))
        except Exception as exc:     # a server not answering, a store not writable, a login missing
            self.close(exit_code=2)
            text = str(exc).strip()
            raise UsageError(f"{key}: cannot start the tracker run: {type(exc).__name__}"
                             + (f": {text.splitlines()[0]}" if text else "")) from None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for t in list(self.open):
            try:
                t.log(step, scalars)
            except Exception as exc:
                self.open.remove(t)
                self.echo(f"warning: {t.name} failed at step {step} and is off for the rest of the run: "
                          f"{type(exc).__name__}: {exc}")

    def close(self, exit_code: int = 0) -> None:
        """End the tracker runs: 0 finished, 75 stopped (resumable), else failed."""
        for t in self.open:
            try:
                t.close(exit_code)
            except Exception as exc:
                self.echo(f"warning: {t.name} could not close its run: {type(exc).__name__}: {exc}")
        self.open = []
