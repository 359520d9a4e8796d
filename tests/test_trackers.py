"""Experiment trackers for real: a 2-rank run logs to an MLflow file store and a W&B offline run, stops,
resumes into the same tracker runs; what they hold is read back with the libraries' own readers and
compared with metrics.jsonl, TensorBoard and config.yaml."""

import glob
import json
import os

import pytest
import yaml

from conftest import BIN, TRAINRUN, mpirun, run, write_config
from test_runner import _tensorboard_scalars

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
