"""Config loading, overrides, validation and the `trainrun config` commands."""

import glob
import os

import pytest
import yaml

from trainrun import config as C
from trainrun.run import validity as V
from trainrun.step.cuda import cuda_provider_problem
from trainrun.errors import UsageError

from conftest import ROOT, TRAINRUN, run, write_config


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(p)


def test_defaults_are_valid_and_documented():
    cfg = V.load_config(None)
    assert cfg.optimizer.name == "adamw" and cfg.train.micro_batch_size == 8
    text = C.to_yaml(cfg, comments=True)
    # every field of every section carries its docstring as a comment
    for section in ("run", "model", "data", "train", "optimizer", "lr_schedule", "checkpoint"):
        docs = C.field_docs(type(getattr(cfg, section)))
        for name, doc in docs.items():
            assert f"# {doc}" in text, (section, name)
    assert yaml.safe_load(text)["optimizer"]["name"] == "adamw"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_shipped_configs_parse(path):
    data = yaml.safe_load(open(path))
    if data["model"].get("builtin", "gpt2") is None:     # a user model: its file is built by a script
        with pytest.raises(UsageError) as err:
            V.load_config(path)
        assert [p.split(":")[0] for p in err.value.problems] == ["model.onnx"], err.value.problems
        return
    if data.get("device") == "cuda" and cuda_provider_problem():    # a CPU build of onnxruntime refuses it, by name
        with pytest.raises(UsageError) as err:
            V.load_config(path)
        assert [p.split(":")[0] for p in err.value.problems] == ["device"], err.value.problems
        return
    cfg = V.load_config(path)  # data dirs are only required to train
    assert cfg.data.seq_len <= C.positions(cfg.model.family_section())


def test_loss_and_data_inputs_are_checked(tmp_path):
    """The loss keys that contradict each other or the built-in model, and data.inputs' type, are named."""
    with pytest.raises(UsageError) as err:
        V.load_config(write(tmp_path, {"model": {"loss": {"output": "l", "type": "mse", "weights": [1.0]}},
                                       "data": {"inputs": ["x"]}}))
    assert sorted(p.split(":")[0] for p in err.value.problems) == [
        "data.inputs", "model.loss.output", "model.loss.type", "model.loss.weights"], err.value.problems
    assert "data.inputs: expected a mapping of str, got ['x']" in err.value.problems
    cfg = V.load_config(write(tmp_path, {"data": {"inputs": {"labels": "target"}}}))
    assert cfg.data.inputs == {"labels": "target"}


def test_every_problem_reported_at_once(tmp_path):
    path = write(tmp_path, {
        "run": {"seedd": 3, "log_level": "loud"},
        "model": {"gpt2": {"n_layer": "two", "n_head": 5, "n_embd": 128}},
        "train": {"micro_batch_size": 0},
        "optimizer": {"betas": [0.9], "name": "adamx"},
        "data": {"seq_len": 4096, "train": str(tmp_path / "missing")},
    })
    with pytest.raises(UsageError) as err:
        V.load_config(path, need_data=True)
    problems = "\n".join(err.value.problems)
    for expected in ["run.seedd: unknown key (did you mean 'seed'?)", "run.log_level: 'loud'",
                     "model.gpt2.n_layer: expected an integer", "model.gpt2.n_head: must divide n_embd",
                     "train.micro_batch_size: must be >= 1", "optimizer.name: 'adamx'",
                     "optimizer.betas: expected two values", "data.seq_len: 4096 is longer",
                     "data.train: directory not found"]:
        assert expected in problems, (expected, problems)
    assert len(err.value.problems) == 9


def test_overrides_are_typed(tmp_path):
    path = write(tmp_path, {"optimizer": {"lr": "6e-4"}})   # YAML 1.1 reads 6e-4 as a string
    cfg = V.load_config(path, ["train.max_steps=7", "optimizer.betas=[0.8, 0.9]", "tensorboard.enabled=false",
                               "optimizer.weight_decay=1e-2", "run.name=x y"])
    assert cfg.optimizer.lr == pytest.approx(6e-4)
    assert cfg.train.max_steps == 7 and isinstance(cfg.train.max_steps, int)
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.tensorboard.enabled is False
    assert cfg.optimizer.weight_decay == pytest.approx(0.01)
    assert cfg.run.name == "x y"
    with pytest.raises(UsageError) as err:
        V.load_config(path, ["train.max_step=7", "train.max_steps=seven"])
    assert any("did you mean 'max_steps'" in p for p in err.value.problems)
    assert any("train.max_steps: expected an integer" in p for p in err.value.problems)
    with pytest.raises(UsageError):
        V.load_config(path, ["novalue"])


def test_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "d").mkdir()
    path = write(tmp_path, {"data": {"train": "d"}, "run": {"output_dir": "out"}})
    cfg = V.load_config(path, need_data=True)
    assert cfg.data.train == str(tmp_path / "d")
    assert cfg.run.output_dir == str(tmp_path / "out")


def test_model_source_is_exclusive(tmp_path):
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"x")
    with pytest.raises(UsageError, match="configuration") as err:
        V.load_config(write(tmp_path, {"model": {"onnx": str(onnx_file)}}))
    assert "exclusive" in err.value.problems[0]
    cfg = V.load_config(write(tmp_path, {"model": {"onnx": str(onnx_file), "builtin": None}}))
    assert cfg.model.onnx == str(onnx_file)
    with pytest.raises(UsageError) as err:
        V.load_config(write(tmp_path, {"model": {"onnx": "nope.onnx", "builtin": None}}))
    assert "model.onnx: file not found" in err.value.problems[0]


def test_cli_validate_and_show(tmp_path):
    bad = write(tmp_path, {"train": {"max_stepz": 3}, "optimizer": {"lr": -1}})
    proc = run([TRAINRUN, "config", "validate", "--config", bad], check=2)
    assert "train.max_stepz: unknown key (did you mean 'max_steps'?)" in proc.stderr
    assert "optimizer.lr: must be > 0.0" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run([TRAINRUN, "config", "show", "--config", os.path.join(ROOT, "configs", "gpt2-tiny.yaml"),
                "--set", "train.max_steps=11"], check=0)
    shown = yaml.safe_load(proc.stdout)
    assert shown["train"]["max_steps"] == 11
    assert "# Optimizer steps to train (the LR schedule spans them)." in proc.stdout
    plain = run([TRAINRUN, "config", "show", "--config", os.path.join(ROOT, "configs", "gpt2-tiny.yaml"),
                 "--set", "train.max_steps=11", "--no-comments"], check=0).stdout
    assert "#" not in plain and yaml.safe_load(plain) == shown
    run([TRAINRUN, "config", "show", "--config", str(tmp_path / "nope.yaml")], check=2)
    bad_yaml = write(tmp_path, "train: [unclosed", name="b.yaml")
    proc = run([TRAINRUN, "config", "show", "--config", bad_yaml], check=2)
    assert "not valid YAML" in proc.stderr


def test_a_rejected_value_is_reported_once(tmp_path):
    """A value out of range is one problem: no cross-field check compares with it (a negative max_steps
    put profile.start_step's default 'after the last step', a negative lr lr_schedule.min_lr 'above' it)."""
    with pytest.raises(UsageError) as err:
        V.load_config(write(tmp_path, {"train": {"max_steps": -5}, "optimizer": {"lr": -1.0}}))
    assert sorted(err.value.problems) == ["optimizer.lr: must be > 0.0, got -1.0",
                                          "train.max_steps: must be >= 1, got -5"], err.value.problems
    with pytest.raises(UsageError) as err:      # a check naming a key still runs when that key is fine
        V.load_config(write(tmp_path, {"train": {"max_steps": 5}, "profile": {"start_step": 6}}))
    assert err.value.problems == ["profile.start_step: 6 is after the last step (train.max_steps = 5)"]


def test_validate_reads_the_datasets_as_training_does(tmp_path, byte_dataset):
    """Token ids the model's vocabulary cannot take (bytes: up to 256) are found by `config validate`,
    in both datasets at once, and training refuses them before anything is written."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"model.gpt2.vocab_size": 200})
    proc = run([TRAINRUN, "config", "validate", "--config", cfg], check=2)
    for key in ("train", "eval"):
        assert (f"data.{key}: {os.path.join(byte_dataset, key, 'manifest.json')}: token ids go up to 256 "
                f"(tokenizer vocab_size 257), not below the model's vocab_size 200: set model.gpt2.vocab_size to 257 "
                f"or more") in proc.stderr, proc.stderr
    assert "2 problem(s)" in proc.stderr and "Traceback" not in proc.stderr
    again = run([TRAINRUN, "--config", cfg], check=2)
    assert again.stderr == proc.stderr and not os.path.exists(tmp_path / "run")
    run([TRAINRUN, "config", "validate", "--config", cfg, "--set", "model.gpt2.vocab_size=257"], check=0)


def test_a_model_too_large_for_memory_is_refused_before_allocating(tmp_path, byte_dataset):
    """The parameters, gradients and AdamW moments of a vocabulary of 10^13 x 32 (5 PB) exceed any machine's
    memory: validate, prepare and training say so, naming the keys (exit 2), instead of a MemoryError."""
    V, E, P, L = 10**13, 32, 32, 2
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"model.gpt2.vocab_size": V})
    n = V * E + P * E + L * (12 * E * E + 13 * E) + 2 * E      # GPT-2's parameters (tied head)
    for cmd in (["config", "validate"], ["prepare"], ["train"]):
        proc = run([TRAINRUN, *cmd, "--config", cfg], check=2)
        assert (f"model.gpt2: {n:,} parameters need {16 * n / 2**30:,.1f} GiB for the parameters, gradients "
                "and 2 adamw moment(s) (float32) on each rank, more than this machine's") in proc.stderr, proc.stderr
        assert "(model.gpt2.vocab_size 10,000,000,000,000) holds 100% of them" in proc.stderr
        assert "MemoryError" not in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "run")


def test_config_show_describes_what_the_code_does():
    """`config show` prints every key's documentation: the host optimizer kernel as what it is (fused loops
    compiled by Numba, not chunked NumPy), the model section naming every built-in family."""
    shown = run([TRAINRUN, "config", "show"], check=0).stdout
    assert "host = the same rule as fused in-place loops compiled by Numba" in shown
    assert "chunked" not in shown
    assert "# The model: a built-in GPT-2, BERT or Llama-family decoder, or a user's forward ONNX." in shown


def test_cli_help_lists_commands():
    """The contract's commands are registered: listed under "Commands:" and each with its own --help."""
    proc = run([TRAINRUN, "--help"], check=0)
    listed = proc.stdout.split("\nCommands:\n", 1)[1]
    names = {line.split()[0] for line in listed.splitlines() if line.startswith("  ") and line.split()}
    expected = {"train", "resume", "export", "prepare", "config"}
    assert expected <= names, names
    for cmd in sorted(expected):
        sub = run([TRAINRUN, cmd, "--help"], check=0)
        assert sub.stdout.startswith(f"Usage: trainrun {cmd} "), sub.stdout
    run([TRAINRUN, "no-such-command"], check=2)


def test_command_line_paths_are_relative_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf", {"run": {"output_dir": "from_file"}})
    monkeypatch.chdir(tmp_path)
    assert V.load_config(path).run.output_dir == str(tmp_path / "conf" / "from_file")
    assert V.load_config(path, ["run.output_dir=runs/x"]).run.output_dir == str(tmp_path / "runs" / "x")


def test_host_optimizer_kernel_needs_the_cpu(tmp_path):
    with pytest.raises(UsageError) as err:
        V.load_config(write(tmp_path, {"device": "cuda", "engine": {"optimizer_kernel": "host"}}))
    assert any(p.startswith("engine.optimizer_kernel: host runs on the CPU") for p in err.value.problems), \
        err.value.problems
    try:
        cfg = V.load_config(write(tmp_path, {"device": "cuda", "engine": {"optimizer_kernel": "auto"}}))
        assert cfg.engine.optimizer_kernel == "auto"
    except UsageError as exc:   # an onnxruntime without the CUDA provider (Python 3.12): that is the only problem
        assert [p.split(":")[0] for p in exc.problems] == ["device"] and cuda_provider_problem(), exc.problems


def test_zero_stage_1_needs_the_cpu_mpi_and_the_host_kernel(tmp_path):
    for data, key, text in [
            ({"device": "cuda"}, "distributed.zero_stage", "runs on the CPU with the mpi backend"),
            ({"engine": {"optimizer_kernel": "graph"}}, "distributed.zero_stage", "needs engine.optimizer_kernel"),
            ({"debug": {"stats_every": 1}}, "debug.stats_every", "needs distributed.zero_stage: 0")]:
        with pytest.raises(UsageError) as err:
            V.load_config(write(tmp_path, {**data, "distributed": {"zero_stage": 1}}))
        assert [p for p in err.value.problems if p.startswith(f"{key}: ") and text in p], err.value.problems
        if not (data.get("device") == "cuda" and cuda_provider_problem()):   # a CPU build refuses cuda itself
            assert V.load_config(write(tmp_path, data)).distributed.zero_stage == 0     # fine with stage 0
    assert V.load_config(write(tmp_path, {"distributed": {"zero_stage": 1}})).distributed.zero_stage == 1


def test_tracker_keys_resolve_a_plain_store_path_and_refuse_a_bad_mode(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf", {"logging": {"mlflow": {"tracking_uri": "mlruns"}}})
    monkeypatch.chdir(tmp_path)
    assert V.load_config(path).logging.mlflow.tracking_uri == str(tmp_path / "conf" / "mlruns")   # the file's folder
    assert V.load_config(path, ["logging.mlflow.tracking_uri=st"]).logging.mlflow.tracking_uri == str(tmp_path / "st")
    for uri in ("http://host:5000", "file:///abs/mlruns", "sqlite:///m.db", "databricks"):   # URIs as they are
        assert V.load_config(path, [f"logging.mlflow.tracking_uri={uri}"]).logging.mlflow.tracking_uri == uri
    assert V.load_config(None).logging.wandb.project is None and V.load_config(None).logging.mlflow.tracking_uri is None
    with pytest.raises(UsageError) as err:
        V.load_config(path, ["logging.wandb.mode=disabled", "logging.mlflow.experiment=[a]"])
    assert "logging.wandb.mode: 'disabled' is not one of: online, offline" in err.value.problems
    assert any(p.startswith("logging.mlflow.experiment: expected a string") for p in err.value.problems)


def test_parameter_groups_and_label_smoothing_are_checked(tmp_path, byte_dataset):
    """optimizer.groups, layer_decay and model.loss.label_smoothing: bad values exit 2 naming the key; a
    pattern that matches no trainable parameter is found by `config validate` and by training before
    anything is written."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "optimizer.groups": [{"params": "transformer.h.*", "lr_scale": 0.0}, {"params": "*", "weight_decay": -1}],
        "optimizer.layer_decay": 1.5, "model.loss.label_smoothing": 1.0})
    err = run([TRAINRUN, "config", "validate", "--config", cfg], check=2).stderr
    for line in ("optimizer.groups[0].lr_scale: must be > 0.0, got 0.0", "optimizer.groups[1].weight_decay: must be "
                 ">= 0.0, got -1.0", "optimizer.layer_decay: must be <= 1.0, got 1.5",
                 "model.loss.label_smoothing: must be < 1, got 1.0"):
        assert line in err, err
    assert "Traceback" not in err
    err = run([TRAINRUN, "config", "validate", "--config", cfg, "--set", "optimizer.groups=[{lr_scale: 2}]",
               "--set", "optimizer.layer_decay=0.5", "--set", "model.loss.label_smoothing=0.1"], check=2).stderr
    assert "1 problem(s)" in err and "optimizer.groups[0].params: a parameter name pattern is required" in err, err
    cfg = write_config(tmp_path / "d.yaml", byte_dataset, **{
        "optimizer.groups": [{"params": "transformer.h.*", "lr_scale": 0.5}, {"params": "h.*"}],
        "model.frozen": ["transformer.wpe.*"], "optimizer.layer_decay": 0.7})
    err = run([TRAINRUN, "config", "validate", "--config", cfg], check=2).stderr
    assert "optimizer.groups[1].params: 'h.*' matches no trainable parameter" in err and "groups[0]" not in err
    shown = yaml.safe_load(run([TRAINRUN, "config", "show", "--config", cfg], check=0).stdout)   # commented YAML
    assert shown["optimizer"]["groups"] == [{"params": "transformer.h.*", "lr_scale": 0.5, "weight_decay": None},
                                            {"params": "h.*", "lr_scale": 1.0, "weight_decay": None}]
    frozen = run([TRAINRUN, "--config", cfg, "--set", "optimizer.groups=[{params: transformer.h.*}, "
                  "{params: transformer.wpe.*}]"], check=2)
    assert "optimizer.groups[1].params: 'transformer.wpe.*' matches no trainable parameter" in frozen.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    onnx_model = write_config(tmp_path / "e.yaml", byte_dataset, **{
        "model.builtin": "bert", "optimizer.layer_decay": 0.9, "model.loss.label_smoothing": 0.1})
    err = run([TRAINRUN, "config", "validate", "--config", onnx_model], check=2).stderr
    assert "model.loss.label_smoothing: smooths the cross_entropy trainrun builds" in err
    err = run([TRAINRUN, "config", "validate", "--config", cfg, "--set", "model.builtin=null", "--set",
               f"model.onnx={cfg}"], check=2).stderr
    assert "optimizer.layer_decay: reads each parameter's layer from a built-in model's names" in err
