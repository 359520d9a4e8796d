"""trainrun.run.validity, the one owner of "is this combination legal?": a table of configs through the real
`trainrun config validate` (each refusal exit 2 naming its key(s), each accepted one exit 0); the metrics it
predicts the evaluations log against those of the prepared graphs; the same owner at training and resume,
and what a launch turns off said once at start."""

import json
import os

import pytest

from conftest import TRAINRUN, mpirun, run, write_config
from test_finetune import _config as bert_config, labelled  # noqa: F401 - labelled: a fixture used here
from trainrun import checkpoint as K
from trainrun.run import rundir
from trainrun.run import validity as V
from trainrun.graphs.manifest import load_manifest, prepare

# (dataset, overrides, exit code, what stderr says: every text, in full)
ROWS = {
    # the metrics early stopping and keep_best watch, decided by `config validate` from the task
    "gpt2-watches-f1": ("bytes", {"checkpoint.keep_best": 1, "checkpoint.best_metric": "eval_f1"}, 2, [
        "checkpoint.best_metric: 'eval_f1': the evaluations log no 'f1' (they log eval_loss, eval_perplexity, "
        "eval_accuracy, eval_top5_accuracy)"]),
    "classifier-watches-pearson": ("cls", {"train.early_stopping": {"patience": 2, "metric": "eval_pearson"}}, 2, [
        "train.early_stopping.metric: 'eval_pearson': the evaluations log no 'pearson' (they log eval_loss, "
        "eval_accuracy, eval_f1)"]),
    "classifier-watches-f1": ("cls", {"checkpoint.keep_best": 1, "checkpoint.best_metric": "eval_f1",
                                      "train.early_stopping": {"patience": 2, "metric": "eval_accuracy"}}, 0, []),
    "regression-watches-spearman": ("reg", {"model.num_labels": 1, "checkpoint.keep_best": 1,
                                            "checkpoint.best_metric": "eval_spearman",
                                            "train.early_stopping": {"patience": 2, "metric": "eval_pearson"}}, 0, []),
    "regression-watches-f1": ("reg", {"model.num_labels": 1, "checkpoint.keep_best": 1,
                                      "checkpoint.best_metric": "eval_f1"}, 2, [
        "checkpoint.best_metric: 'eval_f1': the evaluations log no 'f1' (they log eval_loss, eval_mse, eval_mae, "
        "eval_pearson, eval_spearman)"]),
    # accepted and ignored no more
    "smoothing-a-regression": ("reg", {"model.num_labels": 1, "model.loss.label_smoothing": 0.1}, 2, [
        "model.loss.label_smoothing: smooths a cross_entropy, but model.num_labels 1 makes model.task "
        "sequence_classification a regression, trained with mse"]),
    "early-stopping-without-evaluations": ("bytes", {"train.early_stopping.patience": 2}, 2, [
        "train.early_stopping.patience: stops on evaluations during training, but train.eval_every is 0 (an "
        "evaluation at the end only); set train.eval_every"]),
    "early-stopping-on-keep-best-evaluations": ("bytes", {"train.early_stopping.patience": 2,
                                                          "checkpoint.keep_best": 1, "checkpoint.every": 5}, 2, [
        "train.early_stopping.patience: stops on evaluations during training, but train.eval_every is 0 (an "
        "evaluation at the end only); set train.eval_every"]),
    "task-on-a-user-graph": ("bytes", {"model.builtin": None, "model.onnx": "GRAPH", "model.task": "foo"}, 2, [
        "model.task: 'foo': puts a head on a built-in model (model.builtin); model.onnx trains its graph as it is"]),
    "class-weights-on-a-built-in": ("bytes", {"model.loss.weights": [1.0, 2.0]}, 2, [
        "model.loss.weights: class weights apply to a model.onnx's cross_entropy; the built-in gpt2 does not "
        "take them"]),
    "overlap-with-zero-1": ("bytes", {"distributed.overlap_grad_reduce": True, "distributed.zero_stage": 1}, 2, [
        "distributed.overlap_grad_reduce: overlaps the replicated allreduce; distributed.zero_stage 1 "
        "reduce-scatters after the backward pass (use zero_stage 0, or overlap_grad_reduce false)"]),
    "overlap-on-cuda": ("bytes", {"distributed.overlap_grad_reduce": True, "device": "cuda"}, 2, [
        "distributed.overlap_grad_reduce: runs on the CPU over MPI; not with device: cuda or "
        "distributed.backend: nccl"]),
    "elastic-with-diloco-and-zero-1": ("bytes", {"distributed.elastic": True, "distributed.sync": "diloco",
                                                "distributed.zero_stage": 1}, 2, [
        "distributed.elastic: needs distributed.diloco.group: a number of ranks with distributed.sync diloco (a "
        "replica a node, group 0, is not built yet)",
        "distributed.elastic: needs distributed.zero_stage: 0 (every survivor holds the whole optimizer state; a "
        "ZeRO-1 part would die with its rank)"]),
    "min-replicas-without-elastic": ("bytes", {"distributed.min_replicas": 2}, 2, [
        "distributed.min_replicas: is the quorum of distributed.elastic: true runs; set that too, or leave "
        "min_replicas out"]),
    # the task against its family (once the registry's)
    "gpt2-token-classification": ("bytes", {"model.task": "token_classification"}, 2, [
        "model.task: 'token_classification' is not a task of model.builtin gpt2 (its tasks: causal_lm, "
        "sequence_classification)"]),
    "gpt2-regression": ("bytes", {"model.task": "sequence_classification", "model.num_labels": 1}, 2, [
        "model.num_labels: 1 (a regression) is not built for model.builtin gpt2's sequence_classification; "
        "use 2 or more"]),
    "token-regression": ("cls", {"model.task": "token_classification", "model.num_labels": 1}, 2, [
        "model.num_labels: 1 (a regression) is not built for model.builtin bert's token_classification; only "
        "for sequence_classification; use 2 or more"]),
    # the data against the model: the key to set
    "unknown-data-input": ("bytes", {"data.inputs": {"nope": "input_ids"}}, 2, [
        "data.inputs: 'nope' not a data input of the model (its data inputs: input_ids, labels)"]),
    "vocabulary-too-small": ("bytes", {"model.gpt2.vocab_size": 200}, 2, [
        "token ids go up to 256 (tokenizer vocab_size 257), not below the model's vocab_size 200: set "
        "model.gpt2.vocab_size to 257 or more"]),
}


def _row_config(tmp_path, kind, over, byte_dataset, labelled):
    over = dict(over)
    if over.get("model.onnx") == "GRAPH":
        (tmp_path / "m.onnx").write_bytes(b"not looked at: the keys are refused first")
        over["model.onnx"] = str(tmp_path / "m.onnx")
    if kind == "bytes":
        return write_config(tmp_path / "c.yaml", byte_dataset, **over)
    return bert_config(tmp_path, labelled[kind], **over)


@pytest.mark.parametrize("name", list(ROWS))
def test_config_validate_table(tmp_path, byte_dataset, labelled, name):  # noqa: F811 - the fixture
    kind, over, code, says = ROWS[name]
    cfg = _row_config(tmp_path, kind, over, byte_dataset, labelled)
    proc = run([TRAINRUN, "config", "validate", "--config", cfg], check=code)
    for text in says:
        assert text in proc.stderr, proc.stderr
    if code:
        assert "problem(s)" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    else:
        assert proc.stdout == f"{cfg}: valid\n"


@pytest.mark.parametrize("kind, over", [
    ("bytes", {}),                                                       # gpt2 causal_lm: top-5 of 512 tokens
    ("bytes", {"model.task": "sequence_classification", "model.num_labels": 5}),    # top-5 of 5 labels
    ("reg", {"model.num_labels": 1}),
    ("tok", {"model.task": "token_classification"}),
    ("bytes", {"model.builtin": "bert", "model.bert": {"vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 1,
               "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32}}),   # pre-training
], ids=["gpt2", "gpt2-classifier", "bert-regression", "bert-tokens", "bert-pretraining"])
def test_predicted_metrics_are_the_prepared_graphs(tmp_path, byte_dataset, labelled, kind, over):  # noqa: F811
    """What `config validate` predicts the evaluations log (from the model, its task and the data) is what
    the prepared eval graph and its task head log."""
    cfg = V.load_config(_row_config(tmp_path, kind, over, byte_dataset, labelled), need_data=True)
    train = V.check(cfg).train
    predicted = V.eval_metrics(cfg, train)
    prepared = V.eval_metrics(cfg, train, manifest=load_manifest(prepare(cfg)))
    assert sorted(predicted) == sorted(prepared) and "loss" in predicted, (predicted, prepared)


def test_the_owner_acts_at_start_and_resume(tmp_path, byte_dataset):
    """2 ranks on one node (intra_node: shared by default) with overlap_grad_reduce and reduce_dtype bf16:
    rank 0 says once each that it is off and why. The run resumes with reduce_dtype fp32 without --force (the
    same model, optimizer and data); a resume that turns on early stopping without evaluations is refused by
    the same check as `config validate`, naming the key, before anything runs."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 4, "train.stop_at": 2, "checkpoint.every": 2,
        "distributed.overlap_grad_reduce": True, "distributed.reduce_dtype": "bf16"})
    proc = mpirun(2, "--config", cfg)
    for text in ("trainrun: warning: distributed.overlap_grad_reduce is off: the 2 ranks of each node sum their "
                 "gradients in shared memory (distributed.intra_node: shared) once every backward pass has ended; "
                 "set distributed.intra_node: mpi to overlap the allreduce\n",
                 "trainrun: warning: distributed.reduce_dtype: bf16 is off: every rank is on one node, whose "
                 "gradients are summed in shared memory (distributed.intra_node: shared); no gradient goes over "
                 "the wire\n"):
        assert proc.stderr.count(text) == 1, proc.stderr
    out = str(tmp_path / "run")
    refused = mpirun(2, "resume", out, "--set", "train.early_stopping.patience=2", check=2)
    assert "train.early_stopping.patience: stops on evaluations during training, but train.eval_every is 0" \
        in refused.stderr, refused.stderr
    assert K.read_state(rundir.resolve_checkpoint(out))["step"] == 2
    resumed = mpirun(2, "resume", out, "--set", "distributed.reduce_dtype=fp32")
    assert "reduce_dtype" not in resumed.stderr, resumed.stderr
    assert K.read_state(rundir.resolve_checkpoint(out))["step"] == 4
    with open(os.path.join(out, "summary.json")) as fh:
        assert json.load(fh)["final_step"] == 4


def test_diloco_replicas_of_one_rank_say_why_overlap_is_off(tmp_path, byte_dataset):
    """DiLoCo on 2 ranks, each replica one rank, with overlap_grad_reduce and reduce_dtype bf16: rank 0 says
    once each that they are off because a replica has one rank (nothing to reduce within it), not that the
    run has one rank."""
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{
        "train.max_steps": 2, "distributed.sync": "diloco", "distributed.diloco": {"inner_steps": 2, "group": 1},
        "distributed.overlap_grad_reduce": True, "distributed.reduce_dtype": "bf16"})
    proc = mpirun(2, "--config", cfg)
    why = ("one rank per replica (2 DiLoCo replicas of 1 rank: distributed.diloco.group), nothing to reduce within "
           "a replica; the replicas exchange weights at the outer step (distributed.diloco.outer_dtype)")
    for text in (f"trainrun: warning: distributed.overlap_grad_reduce is off: {why}\n",
                 f"trainrun: warning: distributed.reduce_dtype: bf16 is off: {why}; no gradient goes over the wire\n"):
        assert proc.stderr.count(text) == 1, proc.stderr
    assert "one rank," not in proc.stderr and "one rank;" not in proc.stderr, proc.stderr


def test_export_best_names_the_key_it_ranks_by():
    """`export --best`'s help names what it ranks by, checkpoint.best_metric, not "lowest eval loss"
    (test_controls.py checks the ranking by an accuracy, highest first)."""
    text = " ".join(run([TRAINRUN, "export", "--help"], check=0).stdout.split())
    assert "--best From a run directory: its best checkpoint, ranked by the run's checkpoint.best_metric " \
           "(null: the eval loss)." in text, text


@pytest.mark.parametrize("where", ["the file", "under the file"])
def test_an_output_dir_that_is_a_file_is_named_by_validate_prepare_and_training(tmp_path, byte_dataset, where):
    """run.output_dir naming a file (or a path under one): `config validate`, `prepare` and training exit 2
    naming the key and the file, no traceback nor raw FileExistsError; the file is left as it was."""
    blocker = tmp_path / "afile"
    blocker.write_text("not a run directory\n")
    out = blocker if where == "the file" else blocker / "run"
    cfg = write_config(tmp_path / "c.yaml", byte_dataset, **{"run.output_dir": str(out), "train.max_steps": 2})
    says = f"run.output_dir: {out}: {blocker} is a file, not a directory"
    for cmd in (["config", "validate", "--config", cfg], ["prepare", "--config", cfg], ["--config", cfg]):
        proc = run([TRAINRUN, *cmd], check=2)
        assert says in proc.stderr, (cmd, proc.stderr)
        assert "Traceback" not in proc.stderr and "FileExistsError" not in proc.stderr, (cmd, proc.stderr)
    assert blocker.read_text() == "not a run directory\n"
