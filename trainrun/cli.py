"""The ``trainrun`` command line (click).

``trainrun --config FILE`` is ``trainrun train --config FILE``.
Exit codes: 0 success, 2 usage/config error, 1 any other failure.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import traceback

from .run import stopping

if os.path.basename(sys.argv[0]) == "trainrun":    # the command starting (not a test importing this module):
    stopping.start_up()                            # a stop signal from here on says what it stopped

import click  # noqa: E402

from . import config as C  # noqa: E402
from . import errors  # noqa: E402
from .errors import TrainrunError, UsageError  # noqa: E402

LOG_LEVELS = ["warning", "info", "devinfo", "verbose"]

config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False),
                             help="YAML config file.")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="Override a config value (repeatable), e.g. --set train.max_steps=50.")
log_option = click.option("--log-level", type=click.Choice(LOG_LEVELS), default=None,
                          help="Log level of this command only (run.log_level stays as the config has it).")


def _with_log_level(overrides, log_level):
    overrides = list(overrides)
    if log_level:
        overrides.append(f"run.log_level={log_level}")
    return overrides


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@config_option
@set_option
@log_option
@click.pass_context
def cli(ctx, config_path, overrides, log_level):
    """trainrun: data-parallel training of ONNX graphs.

    \b
    mpirun -np N trainrun --config FILE [--set key.path=value ...]   train
    mpirun -np N trainrun resume RUN_DIR                             continue a run
    trainrun export CHECKPOINT --output model.onnx                   inference model
    trainrun generate RUN_DIR --prompt TEXT                          sample text
    mpirun -np N trainrun evaluate RUN_DIR --data DIR                loss, perplexity, metrics
    """
    ctx.ensure_object(dict)
    ctx.obj["log_level"] = log_level
    if ctx.invoked_subcommand not in (None, "train", "resume"):    # a run takes the stop signals over itself
        stopping.started()
    if ctx.invoked_subcommand is None:
        if not config_path:
            click.echo(ctx.get_help())
            ctx.exit(2)
        ctx.invoke(train, config_path=config_path, overrides=overrides, log_level=log_level)


@cli.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="YAML config file.")
@set_option
@log_option
def train(config_path, overrides, log_level):
    """Train from a config (under mpirun for several ranks)."""
    from .run.runner import train as run_train
    from .run.validity import load_config
    cfg = load_config(config_path, overrides, need_data=True)
    run_train(cfg, log_level=log_level)


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True))
@set_option
@log_option
@click.option("--force", is_flag=True, help="Allow --set of keys that change the model or optimizer.")
def resume(run_dir, overrides, log_level, force):
    """Continue a run from its latest complete checkpoint (or the named one)."""
    from .run.resume import resume_config
    from .run.runner import train as run_train
    cfg, ckpt = resume_config(run_dir, list(overrides), force=force)

    def retry(other: str) -> str:       # this command from another checkpoint (named where ckpt is corrupt)
        return shlex.join(["trainrun", "resume", other, *[a for o in overrides for a in ("--set", o)],
                           *(["--log-level", log_level] if log_level else []), *(["--force"] if force else [])])
    run_train(cfg, resume_from=ckpt, force=force, log_level=log_level, retry=retry)


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default=None,
              help="Start it on this host of the job (default: the survivors' host with the fewest ranks).")
def rejoin(run_dir, host):
    """Ask the elastic job training in RUN_DIR (distributed.elastic) for a lost rank back: its survivors start one
    after their next step, heal it from their rank 0 over MPI and train on with it (docs/distributed.md)."""
    from .run.heal import request
    click.echo(request(run_dir, host))


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--output", "-o", required=True, type=click.Path(),
              help="Output ONNX file (--format onnx) or directory (--format transformers or peft).")
@click.option("--format", "fmt", type=click.Choice(["onnx", "transformers", "peft"]), default="onnx",
              show_default=True,
              help="onnx: an inference model; transformers: a save_pretrained directory (a built-in model "
                   "family with a transformers class); both the full model, a LoRA run's adapters merged; "
                   "peft: a LoRA run's adapters (adapter_config.json, adapter_model.safetensors) for "
                   "PeftModel.from_pretrained.")
@click.option("--kv-cache", is_flag=True,
              help="A language model (a family that generates text): an inference graph with past/present "
                   "keys and values (for trainrun generate).")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False),
              help="--format transformers: this tokenizer.json instead of the run's.")
@click.option("--opset", type=int, default=None, help="Target opset (default: the graph's).")
@click.option("--with-loss", is_flag=True, help="Keep the loss output (takes labels).")
@click.option("--best", is_flag=True, help="From a run directory: its best checkpoint, ranked by the run's "
                                           "checkpoint.best_metric (null: the eval loss).")
def export(checkpoint, output, fmt, kv_cache, tokenizer, opset, with_loss, best):
    """Write an inference model from a checkpoint (offline, no MPI): an ONNX file, or a
    transformers directory (config.json, model.safetensors, tokenizer)."""
    from .commands.export import export_checkpoint
    from .hf.export import export_peft, export_transformers
    if fmt != "onnx" and (kv_cache or with_loss or opset is not None):
        raise UsageError(f"--format {fmt} takes none of --kv-cache, --with-loss, --opset")
    if tokenizer and fmt != "transformers":
        raise UsageError("--tokenizer goes with --format transformers")
    if kv_cache and with_loss:
        raise UsageError("--kv-cache and --with-loss exclude each other")
    if best:
        from .checkpoint import best_of_run
        checkpoint = best_of_run(checkpoint)

    def retry(other: str) -> str:       # this command from another checkpoint (named where one is corrupt)
        return shlex.join(["trainrun", "export", other, "--output", output,
                           *(["--format", fmt] if fmt != "onnx" else []),
                           *(["--kv-cache"] if kv_cache else []), *(["--tokenizer", tokenizer] if tokenizer else []),
                           *(["--opset", str(opset)] if opset is not None else []),
                           *(["--with-loss"] if with_loss else [])])
    if fmt == "transformers":
        export_transformers(checkpoint, output, tokenizer=tokenizer, echo=click.echo, retry=retry)
    elif fmt == "peft":
        export_peft(checkpoint, output, echo=click.echo, retry=retry)
    else:
        export_checkpoint(checkpoint, output, opset=opset, with_loss=with_loss, kv_cache=kv_cache, echo=click.echo,
                          retry=retry)


@cli.command()
@click.argument("source", type=click.Path())
@click.option("--prompt", default="", show_default="empty: unconditional, from the end-of-document token",
              help="Text the sample starts from (printed before it).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=100, show_default=True,
              help="Most tokens generated per sample (fewer at the end-of-document token or a full window).")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="Softmax temperature; 0: greedy (always the most likely token).")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="Sample among the k most likely tokens only (0: all).")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True,
              help="Sample among the most likely tokens holding this much probability (nucleus).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the sampling's random numbers (NumPy PCG64): same seed, same text.")
@click.option("--num-samples", type=click.IntRange(min=1), default=1, show_default=True,
              help="Samples drawn one after another from the same prompt, each under a '---- sample N ----' line.")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False),
              help="A tokenizer.json (default: the one the run recorded from its data).")
def generate(source, prompt, max_new_tokens, temperature, top_k, top_p, seed, num_samples, tokenizer):
    """Sample text from a GPT-2 or Llama-family model: SOURCE is a model.onnx (an export; the run's tokenizer is looked
    for beside it), a checkpoint or a run directory (its latest checkpoint). Tokens are printed as
    they come."""
    from .commands.generate import run_generate
    run_generate(source, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 top_p=top_p, seed=seed, num_samples=num_samples, tokenizer=tokenizer)


@cli.command()
@click.argument("source", type=click.Path())
@click.option("--data", required=True, type=click.Path(exists=True, file_okay=False),
              help="Dataset directory (token shards or tensor samples with the model's features).")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Steps (default: the whole dataset).")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Samples per step over all ranks (default: the run's micro_batch_size x ranks).")
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="Also write the result as JSON.")
@click.option("--force", is_flag=True, help="Evaluate data tokenized otherwise than the run's (refused without).")
def evaluate(source, data, steps, batch, output, force):
    """Loss, perplexity and the model's metrics of a checkpoint (SOURCE: a checkpoint or a run
    directory, its latest) on a dataset; under mpirun the batches are split over the ranks."""
    from .commands.evaluate import run_evaluate
    run_evaluate(source, data, steps=steps, batch=batch, output=output, force=force, echo=click.echo)


@cli.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="YAML config file.")
@set_option
@log_option
@click.option("--force", is_flag=True, help="Replace the graphs of a run directory that holds checkpoints "
                                            "(they then no longer fit them).")
def prepare(config_path, overrides, log_level, force):
    """Build the train, eval and optimizer graphs and initial weights into <output_dir>/graphs."""
    from .run.rundir import complete_checkpoints
    from .graphs.gradients import BUILDER_NAMES
    from .graphs.manifest import load_manifest, prepare as run_prepare
    from .run.lock import RunLock
    from .run.validity import check, load_config
    cfg = load_config(config_path, _with_log_level(overrides, log_level))
    check(cfg, datasets=False)
    out = cfg.run.output_dir
    lock = RunLock(out)
    lock.acquire()        # not while a job trains there
    try:
        done = complete_checkpoints(os.path.join(out, "checkpoints"))
        if done and not force:
            raise UsageError(f"{out} holds checkpoints ({done[-1]} the latest), trained with its graphs: new graphs "
                             f"would no longer fit them; `trainrun resume {out}` prepares what it needs, or "
                             f"choose another run.output_dir (--force replaces the graphs anyway)")
        graphs = run_prepare(cfg)
    finally:
        lock.release()
    if cfg.run.log_level != "warning":
        made_by = load_manifest(graphs)["builder"]
        click.echo(f"graphs written to {graphs} (gradients by {BUILDER_NAMES[made_by]} builder, graphs.builder: "
                   f"{cfg.graphs.builder})")


@cli.group("config")
def config_group():
    """Show or validate a config."""


@config_group.command("show")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="YAML config file (default: built-in defaults).")
@set_option
@click.option("--no-comments", is_flag=True, help="Plain YAML without field documentation.")
def config_show(config_path, overrides, no_comments):
    """Print the fully resolved config, every field documented."""
    from .run.validity import load_config
    cfg = load_config(config_path, overrides)
    click.echo(C.to_yaml(cfg, comments=not no_comments), nl=False)


@config_group.command("validate")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="YAML config file.")
@set_option
def config_validate(config_path, overrides):
    """Check a config and the files it names (datasets, model.init_from, the memory the model needs, as
    training's start-up does on one rank); list every problem (exit 2) or say it is valid."""
    from .run.validity import check, load_config
    check(load_config(config_path, overrides, need_data=True))
    click.echo(f"{config_path}: valid")


@cli.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="Also check the data and graph files this config names.")
@set_option
@click.option("--size-mb", type=click.FloatRange(min=0.001), default=64.0, show_default=True,
              help="Buffer size of the allreduce bandwidth measurement.")
@click.option("--iters", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed allreduce rounds (after two warm-up rounds).")
def doctor(config_path, overrides, size_mb, iters):
    """Check the distributed set-up (run under mpirun): ranks, hosts, devices, versions,
    an allreduce of known values, allreduce bandwidth, same config/data/graphs everywhere."""
    from .commands.doctor import run_doctor
    cfg, raw = None, b""
    if config_path:
        from .run.validity import load_config
        cfg = load_config(config_path, overrides)
        with open(config_path, "rb") as fh:
            raw = fh.read()
    code = run_doctor(cfg, raw, list(overrides), size_mb=size_mb, iters=iters, echo=click.echo)
    if code:
        sys.exit(code)


@cli.command()
@click.argument("run_a", type=click.Path(exists=True, file_okay=False))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False))
@click.option("--rtol", type=click.FloatRange(min=0.0), default=1e-4, show_default=True,
              help="Relative tolerance (0: bitwise equal statistics).")
@click.option("--atol", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Absolute tolerance.")
@click.option("--rank", "ranks", type=int, multiple=True, help="Compare only these ranks (repeatable).")
@click.option("--tensors", "patterns", multiple=True, metavar="PATTERN",
              help="Compare only names matching (fnmatch, repeatable), e.g. 'param/*' or 'scalar/loss'.")
@click.option("--max-rows", type=click.IntRange(min=5), default=40, show_default=True,
              help="Most rows in the per-step summary.")
def compare(run_a, run_b, rtol, atol, ranks, patterns, max_rows):
    """Compare two runs' statistics (debug.stats_every): the first step and tensor where
    they diverge beyond tolerance, then a per-step summary. Exit 0 same, 1 diverged."""
    from .commands.compare import compare as run_compare
    text, diverged = run_compare(run_a, run_b, rtol=rtol, atol=atol, ranks=list(ranks) or None,
                                 patterns=list(patterns) or None, max_rows=max_rows)
    click.echo(text)
    if diverged:
        sys.exit(1)


@cli.group("profile")
def profile_group():
    """Read the traces of profile.start_step/steps."""


@profile_group.command("summarize")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="Rows shown: operators (or nodes) by time, nodes by overhead.")
@click.option("--by", type=click.Choice(["op", "node"]), default="op", show_default=True,
              help="Group kernel time by operator type or by node.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the whole report as JSON (every operator and every node of the train graph).")
def profile_summarize(directory, top, by, as_json):
    """Top operators by total time, the phase breakdown per rank and the train graph's nodes by
    overhead: time beyond their FLOPs at the run's measured peak (DIRECTORY: the profile directory
    or the run directory)."""
    if as_json:
        from .observe.profile import report
        click.echo(json.dumps(report(directory, by=by), indent=1))
    else:
        from .observe.profile import summarize
        click.echo(summarize(directory, top=top, by=by))


def _wants_traceback() -> bool:
    argv = sys.argv
    for i, a in enumerate(argv):
        if a == "--log-level" and i + 1 < len(argv) and argv[i + 1] == "verbose":
            return True
        if a in ("--log-level=verbose", "run.log_level=verbose"):
            return True
    return os.environ.get("TRAINRUN_TRACEBACK") == "1"


def _launcher_rank() -> int:
    try:
        from .comm import detect_world
        return detect_world()[0]
    except TrainrunError:
        return 0


def main(argv=None):
    """The console script: :func:`_main`, its end without MPI_Finalize where an elastic job lost a rank
    (:func:`trainrun.comm.base.end_process`)."""
    from .comm.base import end_process
    try:
        _main(argv)
    except SystemExit as exc:
        end_process(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
        raise
    end_process(0)


def _main(argv=None):
    stopping.start_up()         # (again, where main is called without the console script)
    from .step.sessions import import_onnxruntime
    import_onnxruntime()        # before any command's imports: without torch (1.5 s of every start)
    try:
        rc = cli.main(args=argv, standalone_mode=False, prog_name="trainrun")
        if isinstance(rc, int) and rc:     # ctx.exit(code) returns the code in this mode
            sys.exit(rc)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort as exc:    # click turns Ctrl-C (KeyboardInterrupt) into Abort
        if isinstance(exc.__context__, KeyboardInterrupt):
            click.echo("trainrun: interrupted", err=True)
            sys.exit(130)
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except TrainrunError as exc:
        if _wants_traceback():
            traceback.print_exc()
        # a config/usage error, or one all ranks agreed on, is the same everywhere: rank 0 reports it
        same_everywhere = isinstance(exc, UsageError) or getattr(exc, "collective", False)
        # (distributed.elastic after rank 0 died: the survivor that took over its writing, errors.reporter)
        reports = errors.reporter if errors.reporter is not None else _launcher_rank() == 0
        if not same_everywhere or reports:
            click.echo(exc.render(), err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("trainrun: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the one-line cause the contract asks for
        if _wants_traceback():
            traceback.print_exc()
        click.echo(f"trainrun: error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
