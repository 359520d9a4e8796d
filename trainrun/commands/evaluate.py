"""``trainrun evaluate``: loss, perplexity (a next-token cross-entropy) and the eval graph's metrics of a
checkpoint on any dataset of the run's tokenizer (:func:`trainrun.hf.tokenizer.mismatch`; ``--force``: any).

``--batch B`` counts the samples of one step over all ranks (default: the run's micro_batch_size x
the ranks); ``--steps N`` the steps (default: every sample: the whole steps, then the rest as one
smaller step split over the ranks; left out, and said so, where the graph's batch dim is fixed).
Under ``mpirun -np R`` (R dividing B) step ``s`` covers samples ``s*B .. (s+1)*B - 1`` and rank ``r``
the ``r``-th ``B/R`` of them (:func:`data.eval_batches`); each rank
runs the run's ``graphs/eval.onnx`` with the checkpoint's weights in a plain onnxruntime session and
the sums of loss, batch count and every ``metric/<name>/sum|count`` are added over ranks in one
allreduce. ``loss`` is the mean of the micro-batch losses (as ``eval_loss`` in training; a smaller last
micro-batch weighs by its samples),
``perplexity`` its exp, ``<name>`` = sum / count. With a given ``--batch``, the same samples on any
number of ranks: the metrics agree to float rounding of the sums, and so does a loss that is a mean
over every token (GPT-2; a mean over the used slots of each micro-batch, as BERT's MLM loss, depends
on the micro-batch size).

Training's evaluations (:func:`evaluate_sets`) run the same eval graph on the engine's bound session, over
``train.eval_steps`` global batches of each eval set.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .. import checkpoint as K
from .. import config as C
from ..step import feeding
from ..graphs import frozen as frozen_weights
from ..graphs.manifest import load_manifest
from ..graphs.names import LOSS, METRIC_PREFIX
from ..run import rundir
from ..hf import tokenizer
from ..run import validity
from ..comm import make_communicator
from ..data import eval_batches, open_dataset
from ..step.feeding import check_inputs
from ..errors import TrainrunError, UsageError
from .export import checkpoint_weights, frozen_tensors, mapped_weights
from ..models import registry
from ..observe.task_metrics import TaskMetrics
from ..step.sessions import session_options


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _same_checkpoint(comm, held: K.Pinned) -> K.Pinned:
    """The checkpoint every rank reads: each pinned the latest it found, and a commit in between makes
    them differ; then every rank takes the newest of them."""
    found = comm.allgather_object(held.dir)
    if len(set(found)) == 1:
        return held
    newest = max(found, key=lambda d: int(os.path.basename(d)))      # a run directory's <step> checkpoints
    if held.dir == newest:
        return held
    held.close()
    return K.pin(newest)


def run_evaluate(source: str, data: str, *, steps: int | None, batch: int | None, output: str | None,
                 force: bool = False, echo=print) -> dict | None:
    """Evaluate; rank 0 prints the result, writes ``output`` and returns it (other ranks return None).
    Data of another tokenizer than the run's is refused (UsageError) unless ``force``."""
    import onnxruntime as ort

    held = K.pin(source)        # its files stay readable if the run training on prunes it
    try:
        cfg = K.read_config(held)
        comm = make_communicator("auto", "cpu", cfg.distributed.timeout_s)
    except BaseException:
        held.close()
        raise
    error, sess, weights, feeds, batches, micro, left_out = None, None, None, None, None, 1, ""
    try:
        held = _same_checkpoint(comm, held)
        ckpt = held.dir
        run_dir = rundir.run_dir_of(ckpt)
        per_step = batch or cfg.train.micro_batch_size * comm.world_size
        if per_step % comm.world_size:
            raise UsageError(f"--batch {per_step}: samples per step over all ranks; must be a multiple of the "
                             f"{comm.world_size} ranks")
        micro = per_step // comm.world_size
        why = None if force else tokenizer.mismatch(run_dir, data)
        if why:
            raise UsageError(f"--data {data}: not tokenized as the run's data: {why}; the model would be scored "
                             f"on ids that stand for other text (--force evaluates anyway)")
        manifest = load_manifest(os.path.join(run_dir, "graphs"))
        vocab, positions = registry.vocab_and_positions(cfg.model)
        ds = open_dataset(data, cfg.data.seq_len, vocab_size=vocab, n_positions=positions)
        feeds = feeding.feeds(manifest, cfg.data.inputs, ds.specs)
        missing = [f"graph input '{i}' <- feature '{f}'" for i, f in feeds.items() if f not in ds.specs]
        if missing:
            raise UsageError(f"--data {data}: lacks the features the model reads "
                             f"(its features: {', '.join(ds.specs)})", missing)
        with frozen_weights.held(os.path.join(run_dir, "graphs"), manifest) as graphs:     # and the frozen weights
            weights = {**mapped_weights(frozen_tensors(graphs, manifest)), **checkpoint_weights(held, manifest)}
        held.close()
        so = session_options(max(1, _cores() // max(1, comm.local_size)))
        eval_path = os.path.join(run_dir, "graphs", "eval.onnx")
        sess = ort.InferenceSession(eval_path, so, providers=["CPUExecutionProvider"])
        shaped = ds.new_batch(micro)        # the batch checked as training checks it at start-up
        check_inputs(sess, eval_path, {i: shaped[f] for i, f in feeds.items()}, feeds,
                     f" (--batch {per_step}{'' if batch else ', the run micro_batch_size x ranks'} on "
                     f"{comm.world_size} rank(s): {micro} samples per rank)")
        fixed = [i.shape[0] for i in sess.get_inputs() if i.name in feeds and i.shape and isinstance(i.shape[0], int)]
        batches = eval_batches(ds, micro_batch=micro, rank=comm.rank, world_size=comm.world_size, steps=steps,
                               rest=not fixed)
        if fixed and steps is None and ds.num_samples % per_step:
            left_out = f" ({ds.num_samples % per_step} left out: the graph's batch dim is fixed to {fixed[0]})"
    except TrainrunError as exc:
        error = exc
    finally:
        held.close()
    comm.agree(error)
    metrics = [o.name for o in sess.get_outputs() if o.name.startswith(METRIC_PREFIX)]
    names = [LOSS, *metrics]
    n_labels = manifest.get("task_labels")       # a task head: accuracy and F1 / Pearson, Spearman
    task = TaskMetrics(n_labels, manifest["ignore_index"]) if n_labels else None
    total = np.zeros(len(names) + 1, np.float64)       # the sums (the loss weighed by the batch's samples), samples
    for item in batches:
        out = sess.run(names + ([manifest["logits"]] if task else []), {**weights, **{i: item[f] for i, f in feeds.items()}})
        n = len(item[next(iter(feeds.values()))])
        total[:-1] += [float(out[0]) * (n / micro)] + [float(v) for v in out[1:len(names)]]
        total[-1] += n
        if task is not None:
            task.add(out[-1], item[feeds[manifest["labels"]]])
    stats = list(task.stats()) if task is not None else []
    total = comm.allreduce_scalars(list(total) + stats, op="sum")
    total, stats = total[:len(names) + 1], total[len(names) + 1:]
    samples = int(total[-1])
    result = feeding.eval_results(total[0] / (samples / micro), dict(zip(metrics, total[1:-1])),
                                  validity.logs_perplexity(cfg.model.loss, ds))
    if task is not None:
        result.update(_task_result(comm, task, stats))
    result.update({"checkpoint": ckpt, "data": os.path.abspath(data), "samples": samples,
                   "dataset_samples": ds.num_samples, "batch": micro * comm.world_size, "world_size": comm.world_size})
    comm.close()
    if comm.rank != 0:
        return None
    echo(" | ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
         + f" | {samples} of {ds.num_samples} samples{left_out} ({result['batch']} per step on "
           f"{comm.world_size} rank(s))")
    if output:
        tmp = output + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, output)
    return result


def _task_result(comm, task: TaskMetrics, stats) -> dict:
    """A task head's accuracy and macro F1 over every rank's samples (``stats``: summed over ranks); Pearson
    and Spearman from every rank's pairs."""
    pairs = [np.asarray(p) for p in comm.allgather_object(task.pairs().tolist())] if task.regression else None
    return task.result(np.asarray(stats), pairs)


def evaluate_sets(engine, comm, cfg: C.Config, eval_sets: dict, *, step: int, perplexity: bool) -> dict:
    """Every eval set's metrics during training (:func:`evaluate_set`), named ``eval_<metric>`` for a single
    data.eval, ``eval_<NAME>_<metric>`` for named sets."""
    return {C.eval_key(name, k): v for name, ds in eval_sets.items()
            for k, v in evaluate_set(engine, comm, cfg, name, ds, step=step, perplexity=perplexity).items()}


def evaluate_set(engine, comm, cfg: C.Config, name: str | None, ds, *, step: int, perplexity: bool) -> dict:
    """``loss``, ``perplexity`` and each metric of the eval graph on one eval set, over ``eval_steps``
    global batches, or every sample where the set ends first (the rest as one smaller step split over
    the ranks, as ``trainrun evaluate``; not where the eval graph fixes the batch dim); ``samples`` of
    ``dataset_samples`` counted. Sums from every rank in one allreduce; the loss is the mean of the
    micro-batch losses, each weighed by its samples. An error on any rank is raised on every rank."""
    eng = engine
    names = list(eng.eval_metrics)
    total, count, sums = 0.0, 0.0, [0.0] * len(names)
    n_labels = eng.manifest.get("task_labels")
    task = TaskMetrics(n_labels, eng.manifest["ignore_index"]) if n_labels else None
    error = None
    try:
        for batch in eval_batches(ds, micro_batch=cfg.train.micro_batch_size, rank=comm.rank,
                                  world_size=comm.world_size,
                                  steps=cfg.train.eval_steps * cfg.train.gradient_accumulation_steps,
                                  rest=eng.eval_batch_fixed is None):
            samples = len(next(iter(batch.values())))
            total += eng.evaluate(batch) * samples
            count += samples
            for i, n in enumerate(names):
                sums[i] += float(eng.eval_metrics[n])
            if task is not None:
                labels = eng.manifest["labels"]
                task.add(eng.eval_logits, batch[eng.feeds.get(labels, labels)])
    except TrainrunError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - a dataset or session that breaks mid-run, on any rank
        key = "data.eval" + (f".{name}" if name is not None else "")
        error = TrainrunError(f"evaluation at step {step} on {key} {cfg.data.eval_sets()[name]}: "
                              f"{type(exc).__name__}: {exc}")
    comm.agree(error)      # the same error on every rank: they commit a checkpoint together
    stats = list(task.stats()) if task is not None else []
    total, count, *sums = comm.allreduce_scalars([total, count, *sums, *stats], op="sum")
    sums, stats = sums[:len(names)], sums[len(names):]
    result = feeding.eval_results(total / max(count, 1.0), dict(zip(names, sums)), perplexity)
    if task is not None:
        result.update(_task_result(comm, task, stats))
    return {**result, "samples": int(count), "dataset_samples": ds.num_samples}
