"""Experiment trackers for real: a 2-rank run logs to an MLflow file store and a W&B offline run, stops,
resumes into the same tracker runs; what they hold is read back with the libraries' own readers and
compared with metrics.jsonl, TensorBoard and config.yaml."""

import glob
import http.server
import json
import math
import os
import threading
import time

import pytest
import yaml

from conftest import BIN, TRAINRUN, mpirun, read_metrics, run, write_config
from test_runner import _tensorboard_events, _tensorboard_scalars

mlflow = pytest.importorskip("mlflow")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")     # MLflow 3 reads its file store behind this opt-in
wandb = pytest.importorskip("wandb")

TRACKED = {"train.max_steps": 6, "train.stop_at": 3, "train.log_every": 2, "train.eval_every": 3,
           "checkpoint.every": 3, "tensorboard.enabled": True, "logging.mlflow.experiment": "exp-x",
           "logging.wandb.project": "proj-y", "logging.wandb.mode": "offline"}


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def wandb_records(run_file):
    """(history rows, config) of a W&B offline run file (run-<id>.wandb): wandb's own protobuf records
    (wandb.proto) in LevelDB's log framing, which wandb writes behind a 7-byte header (":W&B", magic
    0xBEE1, version): 32 KiB blocks of chunks, each crc32c (u32), length (u16), type (1 full, 2 first,
    3 middle, 4 last); a block's last < 7 bytes are padding."""
    import struct
    from wandb.proto import wandb_internal_pb2
    data = open(run_file, "rb").read()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    raws, pos, parts, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and n == 0):
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            raws.append(parts)
    rows, config = [], {}

    def items(update):
        return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}
    for raw in raws:
        rec = wandb_internal_pb2.Record.FromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append(items(rec.history.item))
        elif kind == "run":
            config.update(items(rec.run.config.update))
        elif kind == "config":
            config.update(items(rec.config.update))
    return rows, config


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, byte_dataset):
    """2 ranks, both trackers: stopped at step 3 (stop_at), resumed to step 6."""
    d = tmp_path_factory.mktemp("tracked")
    store = d / "mlruns"
    cfg = write_config(d / "c.yaml", byte_dataset, **TRACKED, **{"logging.mlflow.tracking_uri": "mlruns"})
    env = {"WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9"}   # offline from the config: no network used
    first = mpirun(2, "--config", cfg, env=env)
    ids = json.load(open(d / "run" / "trackers.json"))
    wandb_dirs = sorted(glob.glob(str(d / "run" / "wandb" / "offline-run-*")))
    mlflow_runs = mlflow.tracking.MlflowClient(f"file://{store}").search_runs(
        [mlflow.tracking.MlflowClient(f"file://{store}").get_experiment_by_name("exp-x").experiment_id])
    status = mlflow_runs[0].info.status
    second = run([os.path.join(BIN, "mpirun"), "-np", "2", TRAINRUN, "resume", str(d / "run"),
                  "--set", "train.stop_at=0"], check=0, env=env)
    return {"dir": d, "store": f"file://{store}", "ids": ids, "first": first, "second": second,
            "first_wandb_dirs": wandb_dirs, "first_mlflow_runs": len(mlflow_runs), "first_status": status}


def test_mlflow_holds_the_tensorboard_scalars_and_the_config(tracked_run):
    d = tracked_run["dir"]
    # rank 0 only: one MLflow run after the 2-rank session, the same one continued by the resume
    assert tracked_run["first_mlflow_runs"] == 1 and tracked_run["first_status"] == "FINISHED"   # stop_at: exit 0
    assert tracked_run["ids"] == json.load(open(d / "run" / "trackers.json"))
    assert tracked_run["ids"]["mlflow"]["tracking_uri"] == tracked_run["store"]     # the plain path, made absolute
    client = mlflow.tracking.MlflowClient(tracked_run["store"])
    exp = client.get_experiment_by_name("exp-x")
    (only,) = client.search_runs([exp.experiment_id])
    assert only.info.run_id == tracked_run["ids"]["mlflow"]["run_id"] and only.info.status == "FINISHED"
    assert only.info.run_name == "t"
    # the metrics: what TensorBoard got, at the same steps, with metrics.jsonl's values
    rows = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
    tb = _tensorboard_scalars(glob.glob(str(d / "run" / "tensorboard" / "events.*")))
    assert set(only.data.metrics) == set(tb)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "eval/loss", "eval/perplexity",
            "time/forward_backward_ms"} <= set(tb)
    for tag, steps in tb.items():
        assert [m.step for m in client.get_metric_history(only.info.run_id, tag)] == steps, tag
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("eval_loss", "eval/loss")):
        logged = {r["step"]: r[key] for r in rows if key in r}
        history = {m.step: m.value for m in client.get_metric_history(only.info.run_id, tag)}
        assert history == pytest.approx(logged, rel=1e-6) and len(history) == len(logged)
    assert sorted({r["step"] for r in rows if "loss" in r}) == [2, 3, 4, 6]       # both sessions
    # the resolved config as parameters, one per leaf
    resolved = flat(yaml.safe_load(open(d / "run" / "config.yaml")))
    params = only.data.params
    assert set(params) == set(resolved)
    assert params["train.max_steps"] == "6" and params["optimizer.lr"] == "0.003"
    assert params["logging.wandb.mode"] == "offline" and params["model.gpt2.n_embd"] == "32"
    assert params["profile.dir"] == "null" and params["tensorboard.enabled"] == "true"
    assert params["train.stop_at"] == "3"         # MLflow keeps a parameter's first value...
    assert "keeps its first value of train.stop_at" in tracked_run["second"].stdout   # ...and the resume says so


def test_wandb_offline_run_holds_the_same_scalars_and_the_config(tracked_run):
    d = tracked_run["dir"]
    assert len(tracked_run["first_wandb_dirs"]) == 1        # rank 0 only
    run_id = tracked_run["ids"]["wandb"]["run_id"]
    dirs = sorted(glob.glob(str(d / "run" / "wandb" / "offline-run-*")))
    assert len(dirs) == 2 and all(x.endswith(run_id) for x in dirs)     # the resume continues the same run id
    rows, config = [], {}
    for x in dirs:
        r, c = wandb_records(os.path.join(x, f"run-{run_id}.wandb"))
        rows += r
        config.update(c)
    metrics = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
    tb = _tensorboard_scalars(glob.glob(str(d / "run" / "tensorboard" / "events.*")))
    logged = {}
    for row in rows:
        for tag, value in row.items():
            if not tag.startswith("_") and tag != "step":
                logged.setdefault(tag, {})[row["step"]] = value
    assert set(logged) == set(tb)
    for tag, steps in tb.items():
        assert sorted(logged[tag]) == steps, tag
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("eval_loss", "eval/loss")):
        assert logged[tag] == pytest.approx({r["step"]: r[key] for r in metrics if key in r}, rel=1e-6)
    resolved = flat(yaml.safe_load(open(d / "run" / "config.yaml")))
    got = {k: v for k, v in config.items() if not k.startswith("_")}
    assert set(got) == set(resolved)
    assert got["train.max_steps"] == "6" and got["logging.mlflow.experiment"] == "exp-x"
    assert got["train.stop_at"] == "0"         # W&B takes the resumed session's value


def test_a_missing_tracker_library_or_store_is_a_usage_error(tmp_path, byte_dataset):
    """logging.mlflow set where mlflow is not importable (sys.modules entry None, as for a package not
    installed): exit 2 naming the key and the pip command, before anything is written. A store that
    cannot be written: exit 2 naming logging.mlflow, on both ranks."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"train.max_steps": 2,
                                                             "logging.mlflow.tracking_uri": "mlruns"})
    proc = mpirun(1, "--config", cfg, check=2, env={"PYTHONPATH": str(hide)})
    assert "logging.mlflow: tracking_uri is set but the mlflow package is not installed; " \
           "pip install 'trainrun[trackers]'" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "run" / "config.yaml")
    (tmp_path / "afile").write_text("not a folder")
    proc = mpirun(2, "--config", cfg, "--set", f"logging.mlflow.tracking_uri=file://{tmp_path}/afile/store",
                  check=2)
    assert proc.stderr.count("logging.mlflow: cannot start the tracker run") == 1, proc.stderr


@pytest.mark.process     # wandb starts its service process
def test_the_tracker_runs_end_as_the_run_ended(tmp_path):
    """Exit 75 (stopped by a signal, resumable): MLflow KILLED, W&B marked preempting, then a failure:
    FAILED; the same Trackers the runner uses, over real stores."""
    from trainrun import config as C
    from trainrun.observe.trackers import Trackers
    statuses = []
    for code in (75, 1):
        cfg = C.load_config(None, [f"run.output_dir={tmp_path / 'run'}", f"logging.mlflow.tracking_uri={tmp_path / 'st'}",
                                   "logging.wandb.project=p", "logging.wandb.mode=offline"])
        os.makedirs(cfg.run.output_dir, exist_ok=True)
        lines = []
        t = Trackers(cfg, cfg.run.output_dir, resumed=code == 1, echo=lines.append)
        t.log(1, {"train/loss": 2.5})
        t.close(code)
        client = mlflow.tracking.MlflowClient(f"file://{tmp_path / 'st'}")
        (only,) = client.search_runs([client.get_experiment_by_name("run").experiment_id])
        statuses.append(only.info.status)
        assert [m.value for m in client.get_metric_history(only.info.run_id, "train/loss")] == [2.5] * (len(statuses))
        assert lines[0].startswith("continuing mlflow run" if code == 1 else "logging to mlflow run"), lines
    assert statuses == ["KILLED", "FAILED"]


@pytest.mark.process     # wandb starts its service process
def test_non_finite_values_reach_tensorboard_mlflow_and_wandb(tmp_path):
    """A NaN loss and an infinite gradient norm (a diverging run) are logged as they are, by the runner's
    Metrics over a real event file, MLflow file store and W&B offline run."""
    from trainrun import config as C
    from trainrun.observe.metrics import Metrics
    from trainrun.observe.trackers import Trackers
    cfg = C.load_config(None, [f"run.output_dir={tmp_path / 'run'}", f"logging.mlflow.tracking_uri={tmp_path / 'st'}",
                               "logging.wandb.project=p", "logging.wandb.mode=offline"])
    os.makedirs(cfg.run.output_dir)
    m = Metrics(cfg.run.output_dir, enabled=True, tensorboard=True, quiet=True, total_steps=2)
    m.trackers = Trackers(cfg, cfg.run.output_dir, resumed=False, echo=print)
    m.log(1, {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "samples_per_sec": 8.0})
    m.log(2, {"loss": float("nan"), "lr": 1e-3, "grad_norm": float("inf"), "samples_per_sec": 8.0})
    m.close()
    tb = {(v.tag, e.step): v.simple_value for e in _tensorboard_events(glob.glob(str(tmp_path / "run" / "tensorboard" / "*")))
          for v in e.summary.value}
    client = mlflow.tracking.MlflowClient(f"file://{tmp_path / 'st'}")
    (only,) = client.search_runs([client.get_experiment_by_name("run").experiment_id])
    history = {tag: {h.step: h.value for h in client.get_metric_history(only.info.run_id, tag)}
               for tag in ("train/loss", "train/grad_norm")}
    (wandb_dir,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*"))
    rows, _ = wandb_records(glob.glob(os.path.join(wandb_dir, "run-*.wandb"))[0])
    logged = {(tag, row["step"]): v for row in rows for tag, v in row.items() if tag.startswith("train/")}
    for got in (tb, {(t, s): v for t, h in history.items() for s, v in h.items()}, logged):
        assert got[("train/loss", 1)] == 2.5 and math.isnan(got[("train/loss", 2)]), got
        assert got[("train/grad_norm", 2)] == float("inf"), got


class _Server(http.server.ThreadingHTTPServer):
    """An MLflow tracking server as its REST API looks to MlflowClient, on 127.0.0.1: it answers the start
    of a run (experiment, run, parameters), then never answers the metrics; for the experiment ``stuck``
    it never answers at all."""
    daemon_threads = True

    def __init__(self):
        self.release, self.metrics_calls = threading.Event(), 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200 if "error_code" not in obj else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if "experiment_name=stuck" in self.path:
                    server.release.wait()
                self._answer({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path.endswith("/runs/log-batch") and body.get("metrics"):
                    server.metrics_calls += 1
                    server.release.wait()
                self._answer({"experiment_id": "1"} if self.path.endswith("/experiments/create") else
                             {"run": {"info": {"run_id": "r1", "experiment_id": "1", "status": "RUNNING"}}}
                             if self.path.endswith("/runs/create") else {})

            def log_message(self, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        self.handle_error = lambda request, address: None     # a client gone when the held calls are let go
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.uri = f"http://127.0.0.1:{self.server_address[1]}"

    def close(self):
        self.release.set()
        self.shutdown()
        self.server_close()


def test_a_tracking_server_that_hangs_is_dropped_and_the_run_goes_on(tmp_path, byte_dataset):
    """A tracking server that stops answering mid-run: rank 0's steps never wait for it (its calls run on a
    thread of their own), so the peers, whose collectives time out after 15 s, see no stall (MLflow's client
waits 120 s for an answer); the tracker is
    dropped with a warning after logging.timeout_s and the run finishes (exit 0), metrics.jsonl whole. The
    runner's Trackers over the same server: a log call returns at once while the last one hangs, and the
    next one after the timeout drops the tracker; a server that never answers the start: the tracker is
    left out after the timeout, and the run goes on."""
    from trainrun import config as C
    from trainrun.observe.trackers import Trackers
    server = _Server()
    try:
        cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
            "train.max_steps": 30, "train.log_every": 1, "train.eval_every": 10,
            "distributed.timeout_s": 15, "logging.mlflow.tracking_uri": server.uri, "logging.timeout_s": 2})
        p = mpirun(2, "--config", cfg, timeout=240)
        assert server.metrics_calls == 1          # the first logged step's call hangs; nothing sent after it
        assert "warning: mlflow timed out: no answer in" in p.stdout and "s to its call of step 1 (logging.timeout_s 2)" \
            in p.stdout, p.stdout
        train, evals = read_metrics(str(tmp_path / "run"))
        assert sorted(train) == list(range(1, 31)) and sorted(evals) == [10, 20, 30]

        for experiment in ("live", "stuck"):
            said = []
            tracked = C.load_config(None, [f"run.output_dir={tmp_path / experiment}", "logging.timeout_s=1",
                                           f"logging.mlflow.tracking_uri={server.uri}",
                                           f"logging.mlflow.experiment={experiment}"])
            os.makedirs(tracked.run.output_dir)
            t0 = time.monotonic()
            t = Trackers(tracked, tracked.run.output_dir, resumed=False, echo=said.append)
            if experiment == "stuck":
                assert 1 <= time.monotonic() - t0 < 10 and not t.open
                assert said == ["warning: logging.mlflow: no answer in 1 s (logging.timeout_s) while starting the "
                                "tracker run; the run goes on without mlflow"], said
                continue
            t.log(1, {"train/loss": 2.5})             # sent on the tracker's thread: the server holds it
            time.sleep(1.5)
            t0 = time.monotonic()
            t.log(2, {"train/loss": 2.4})
            t.close()
            assert time.monotonic() - t0 < 0.5 and not t.open
            assert len(said) == 2 and said[1].startswith("warning: mlflow timed out: no answer in 1.") and \
                said[1].endswith(" s to its call of step 1 (logging.timeout_s 1) and is off for the rest of the run "
                                 "(training goes on)"), said
    finally:
        server.close()
