"""A run's start-up, before its first step, the same on every rank: the datasets checked
(:func:`trainrun.run.validity.check`), the run directory written and its graphs prepared (rank 0), every rank
agreeing on the config and the graph files, then the engine, the update and the sampler built. Each
problem becomes one error agreed by every rank, so none waits in a collective the others left."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import platform
import sys

from .. import checkpoint as K
from .. import config as C
from ..sync import diloco
from .. import faults
from ..step import feeding
from . import rundir
from ..sync import reducer
from . import resume
from ..sync import update
from . import validity
from ..comm import affinity, cpu_share, local_device, machine_id
from ..data import TrainLoader
from ..step.engine import Engine, EngineOptions
from ..errors import TrainrunError, UsageError, collective
from ..commands.generate import TrainingSampler
from ..graphs.gradients import BUILDER_NAMES, builder
from ..graphs.manifest import load_manifest, prepare, up_to_date
from ..observe import engine_options
from ..observe.trackers import Trackers, check_installed

_ORT_SEVERITY = {"warning": 3, "info": 3, "devinfo": 1, "verbose": 0}


@dataclasses.dataclass
class Setup:
    """What a run trains with, built by :func:`set_up`."""
    train_ds: object            # data.train
    eval_sets: dict             # data.eval's sets by name (None: a single data.eval)
    total_steps: int            # the step the run ends at: train.max_steps, or train.max_epochs over the data
    tokens: bool                # token sequences: tokens/s besides samples/s
    perplexity: bool            # next-token cross-entropy: perplexity besides the loss
    loader: TrainLoader
    manifest: dict              # graphs/manifest.json
    threads: int                # this rank's onnxruntime threads
    engine: Engine
    shard: object               # the update (trainrun.sync.update.build)
    grad_buckets: int           # distributed.overlap_grad_reduce's buckets; 0 without overlap
    resume_from: str | None     # the checkpoint the run restores from (a branch's: its copy in the run directory)
    sync: object                # distributed.sync (trainrun.sync.diloco.build): every step, or DiLoCo's replicas
    sampler: TrainingSampler | None    # train.sample_every (rank 0)


def set_up(cfg: C.Config, comm, *, resume_from: str | None, lock, config_yaml: str, stop_flag, log,
           retry=None) -> Setup:
    """Every rank: the datasets, the run directory and graphs, the agreement on both, then the engine. A
    resume (``resume_from``) may write into a run directory that holds checkpoints; one from a checkpoint of
    another run directory branches into this one (:func:`trainrun.run.resume.branch`; ``retry``: the command
    resuming from another checkpoint, named where the one copied is corrupt); ``lock`` (rank 0) is taken
    before anything is written there; ``config_yaml`` is what config.yaml records; ``stop_flag``: the stop
    signals' flag (for the tests' faults)."""
    train_ds, eval_sets, total_steps, loader, fwd = _open_data(cfg, comm)
    out = cfg.run.output_dir
    graphs_dir = os.path.join(out, "graphs")
    branched = resume.branch_of(resume_from, out) if resume_from else None
    prepared = _prepare_run_dir(cfg, comm, resume_from, branched, lock, config_yaml, log, retry, fwd)
    del fwd     # the user's forward graph, built once (by the check) for prepare: not kept for the run
    if prepared:
        return_freed_memory()     # the model built in memory: not kept for the whole run
    manifest = _check_same_everywhere(cfg, comm, graphs_dir)
    faults.wait_until("WAIT_SIGNAL", comm.rank, 0, stop_flag)
    sync = diloco.build(cfg, comm)      # the ranks the step reduces over: all, or this rank's replica
    threads, engine, shard, grad_buckets, sampler = _build_engine(cfg, comm, graphs_dir, manifest, train_ds,
                                                                  sync.comm)
    sync.attach(engine, shard, total_steps)
    if sync.describe():
        log(sync.describe())
    if advice := sync.advice(cold_start=resume_from is None and not cfg.model.init_from):
        log(advice)
    return Setup(train_ds=train_ds, eval_sets=eval_sets, total_steps=total_steps, tokens="input_ids" in train_ds.specs,
                 perplexity=validity.logs_perplexity(cfg.model.loss, train_ds),
                 loader=loader, manifest=manifest, threads=threads, engine=engine, shard=shard,
                 grad_buckets=grad_buckets, sync=sync, sampler=sampler, resume_from=branched or resume_from)


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Building
    the graphs leaves GBs free but mapped in the heap, counted in the process's RSS until then."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):       # not glibc
        pass


def _open_data(cfg: C.Config, comm):
    """The datasets of :func:`trainrun.run.validity.check`, which finds every problem of the files the config
    names (data, model.init_from, the memory the model needs) before the graphs are built; the step the run
    ends at; this rank's loader; the user's forward graph the check built (rank 0, which prepares the
    graphs; else None)."""
    error = checked = None
    try:
        checked = validity.check(cfg, comm.world_size)
    except UsageError as exc:
        error = exc
    comm.agree(error)
    train_ds, eval_sets = checked.train, checked.evals
    total_steps = cfg.train.total_steps(train_ds.num_samples, cfg.global_batch(comm.world_size))
    loader = TrainLoader(train_ds, micro_batch=cfg.train.micro_batch_size,
                         accum=cfg.train.gradient_accumulation_steps, rank=comm.rank, world_size=comm.world_size,
                         seed=cfg.run.seed, shuffle=cfg.data.shuffle, prefetch=cfg.data.prefetch)
    return train_ds, eval_sets, total_steps, loader, checked.forward if comm.rank == 0 else None


def _prepare_run_dir(cfg: C.Config, comm, resume_from, branched, lock, config_yaml: str, log, retry,
                     fwd) -> bool:
    """Rank 0: the run directory made (locked, config.yaml, a branch's copy) and its graphs prepared where
    they are not those ``cfg`` needs (``fwd``: the user's forward graph, already built; None: prepare builds
    it). Returns whether graphs were prepared."""
    out = cfg.run.output_dir
    graphs_dir = os.path.join(out, "graphs")
    error, prepared = None, False
    if comm.rank == 0:
        try:
            check_installed(cfg.logging)      # logging.mlflow / logging.wandb set: their library is there
            if lock:
                lock.acquire()          # before anything is written: one job per run directory
            ckpt_dir = os.path.join(out, "checkpoints")
            if branched:
                resume.check_branch(rundir.run_dir_of(resume_from), out)
            elif not resume_from and rundir.complete_checkpoints(ckpt_dir):
                raise UsageError(f"{out} already holds checkpoints; continue it with "
                                 f"`trainrun resume {out}` or choose another run.output_dir")
            K.cleanup(ckpt_dir, log=log)
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "config.yaml"), "w") as fh:
                fh.write(config_yaml)
            if branched:
                resume.branch(resume_from, out, cfg, log, retry)
            if not up_to_date(graphs_dir, cfg):
                made_by, why = builder(cfg.graphs.builder)
                log(f"preparing graphs in {graphs_dir} (gradients by {BUILDER_NAMES[made_by]} builder: {why})")
                prepare(cfg, graphs_dir, fwd)
                prepared = True
        except TrainrunError as exc:
            error = exc
    comm.agree(error)
    return prepared


def _check_same_everywhere(cfg: C.Config, comm, graphs_dir: str) -> dict:
    """Every rank runs the same config and sees the same graph files (rank 0's): the manifest."""
    config_hash = hashlib.sha256(C.to_yaml(cfg).encode()).hexdigest()[:16]
    manifest = None
    try:
        manifest = load_manifest(graphs_dir)
        mine = {"config": config_hash, "graphs": manifest["files"], "host": platform.node()}
    except UsageError as exc:
        mine = {"config": config_hash, "graphs": None, "error": exc.message, "host": platform.node()}
    everyone = comm.allgather_object(mine)
    ref = everyone[0]
    blind = [r for r, other in enumerate(everyone) if other.get("graphs") is None]
    if blind and ref.get("graphs") is not None:     # rank 0 prepared them: the others see another directory
        hosts = sorted({everyone[r]["host"] for r in blind})
        raise collective(UsageError(
            f"run.output_dir {cfg.run.output_dir} is not shared: host(s) {', '.join(hosts)} (rank(s) "
            f"{', '.join(map(str, blind))}) cannot see the graphs rank 0 prepared there; the run directory "
            f"must be the same shared filesystem path on every host (`trainrun doctor` checks it)"))
    for r, other in enumerate(everyone):   # every rank sees the same list: the error is collective
        if other.get("graphs") is None:
            raise collective(UsageError(f"rank {r} cannot read the prepared graphs: {other.get('error')}"))
        if other["config"] != ref["config"]:
            raise collective(UsageError(
                f"rank {r} has a different config than rank 0 (hash {other['config']} vs {ref['config']}); "
                f"launch every rank with the same --config and --set"))
        if other["graphs"] != ref["graphs"]:
            raise collective(UsageError(f"rank {r} ({other['host']}) sees different graph files than "
                                         f"rank 0 in {graphs_dir}"))
    return manifest


def _build_engine(cfg: C.Config, comm, graphs_dir: str, manifest: dict, train_ds, step_comm):
    """(threads, engine, update, gradient buckets, sampler): the sessions bound to the flat buffers, the
    optimizer over them (or this rank's part), what this launch turns off said (rank 0). ``step_comm``: the
    ranks whose gradients the step reduces (the world, or this rank's DiLoCo replica)."""
    rank = comm.rank
    threads = cfg.engine.threads
    if cfg.run.deterministic:
        threads = 1
    elif not threads:   # this rank's share of its CPUs among the ranks of its machine (every rank asks)
        here, mask = machine_id(), affinity()
        peers = [m for key, m in comm.allgather_object([here, mask]) if key == here]
        threads = cpu_share(mask, peers)
    device_id = local_device(comm.local_rank) if cfg.device == "cuda" else 0
    node = None
    error = None
    try:     # intra_node: shared: parameters and gradients in the node's shared memory (None: the mpi path)
        frozen = sum(math.prod(f["shape"]) for f in manifest.get("frozen", []))
        node = update.node_buffers(cfg, step_comm, manifest["num_params"], frozen)
    except UsageError as exc:
        error = exc
    comm.agree(error)
    # buckets of gradients reduced during the backward pass: the train graph cut at them
    overlaps = reducer.applies(cfg.distributed, cfg.device, step_comm, node)
    buckets = int(cfg.distributed.bucket_mb * 2**20) if overlaps else 0
    opts = EngineOptions(device=cfg.device, device_id=device_id, threads=threads,
                         graph_optimization=cfg.engine.graph_optimization,
                         log_severity=_ORT_SEVERITY[cfg.run.log_level], deterministic=cfg.run.deterministic,
                         seed=cfg.run.seed, direct_gradients=cfg.train.gradient_accumulation_steps == 1,
                         bucket_bytes=buckets, **engine_options(cfg, rank))
    mb = cfg.train.micro_batch_size
    shapes = {name: ((mb, *shape), dtype) for name, (shape, dtype) in train_ds.specs.items()}
    engine = shard = None
    grad_buckets = 0
    error = None
    try:     # the data checked against the graph's inputs: the same verdict on every rank
        feeds = feeding.feeds(manifest, cfg.data.inputs, shapes)
        # the metrics early stopping and keep_best watch: among those the evaluations log
        logged = validity.eval_metrics(cfg, train_ds, manifest=manifest)
        if problems := validity.eval_metric_problems(cfg, logged):
            raise UsageError(f"{len(problems)} problem(s) in the configuration", problems)
        # the frozen weights once per node too: node rank 0 fills them before any rank runs a graph (the
        # agreement below waits for every rank); no eval data: the eval graph opened only if something evaluates
        engine = Engine(graphs_dir, opts, shapes, shapes, feeds=feeds, buffers=node.buffers if node else None,
                        frozen=node.frozen if node else None, fill_frozen=node is None or node.mem.node.rank == 0,
                        lazy_eval=not cfg.data.eval_sets())
        engine.load_weights()
        # the optimizer over the whole buffers, or (partitioned) over this rank's part only
        shard = update.build(cfg, step_comm, engine, node)
        grad_buckets = len(shard.reducer.buckets) if shard.reducer else 0
    except UsageError as exc:
        error = exc
    comm.agree(error)
    if rank == 0:    # what this launch turns off of the config, and why
        shared = (node.mem.node.world_size, node.mem.cross.world_size) if node else None
        for note in validity.inactive(cfg.distributed, step_comm.world_size, shared, overlaps, grad_buckets,
                                      comm.world_size // step_comm.world_size):
            print(f"trainrun: warning: {note}", file=sys.stderr, flush=True)
    error, sampler = None, None
    if cfg.train.sample_every and rank == 0:
        try:
            sampler = TrainingSampler(manifest, cfg.data.train, cfg.train.sample_prompt, threads,
                                      (engine.frozen_layout, engine.frozen))
        except UsageError as exc:
            error = exc
    if cfg.train.sample_every:
        comm.agree(error)
    return threads, engine, shard, grad_buckets, sampler


def header(cfg: C.Config, comm, threads: int, shard, manifest: dict, train_ds, length: str, log) -> None:
    """The run's start lines: what differs from the default config (devinfo: all of it, and each rank's
    place: host, threads, its part of the parameters, the node's shared memory), then one line of the
    run's shape and one of what trains; ``length``: how long the run is, as the config says it."""
    num_params = manifest["num_params"]
    world, accum, mb = comm.world_size, cfg.train.gradient_accumulation_steps, cfg.train.micro_batch_size
    global_batch = cfg.global_batch(world)
    if cfg.run.log_level in ("devinfo", "verbose"):
        log("resolved config:\n" + C.to_yaml(cfg))
        log(f"host {platform.node()} pid {os.getpid()} | local rank {comm.local_rank} of "
            f"{comm.local_size} | device {cfg.device} | {threads} thread(s) | "
            f"backend {comm.backend} | {mb} samples x {accum} micro-batches per step", all_ranks=True)
        log(f"zero stage {cfg.distributed.zero_stage}: this rank updates parameters {shard.lo}:{shard.hi} of "
            f"{num_params} and holds {sum(b.nbytes for b in shard.state.values()):,} bytes of optimizer state",
            all_ranks=True)
        node = getattr(shard, "node", None)
        log("intra-node: " + (f"shared (node rank {node.mem.node.rank} of {node.mem.node.world_size}, "
                               f"node {node.mem.cross.rank} of {node.mem.cross.world_size}; one "
                               f"{node.params.nbytes:,}-byte parameter buffer "
                               + (f"and one {node.frozen.nbytes:,}-byte frozen buffer " if node.frozen is not None
                                  else "") + "per node)" if node else "mpi"),
            all_ranks=True)
    else:   # what differs from the defaults; the whole file is <output_dir>/config.yaml (devinfo prints it)
        log(f"config (what differs from the defaults; all of it in "
            f"{os.path.join(cfg.run.output_dir, 'config.yaml')}):\n{C.to_text_changed(cfg).rstrip()}")
    tokens = "input_ids" in train_ds.specs
    log(f"trainrun: {cfg.run.name} | {world} rank(s) x {threads} thread(s) | "
        f"{num_params:,} parameters | global batch {global_batch} ({mb} x {accum} accum x {world} ranks) | "
        + (f"{global_batch * cfg.data.seq_len:,} tokens/step | " if tokens else "")
        + f"optimizer {cfg.optimizer.name} | {train_ds.num_samples:,} train samples | {length}")
    log(trained_line(manifest))


def trained_line(manifest: dict, shown: int = 4) -> str:
    """What trains and what is frozen, and why (model.frozen, a buffer of torch's exporter, LoRA's base),
    the names of each reason's first ``shown`` tensors."""
    frozen = manifest.get("frozen") or []
    line = (f"trained: {len(manifest['params'])} tensors, {manifest['num_params']:,} elements; "
            f"frozen: {len(frozen)} tensors")
    if not frozen:
        return line
    by_why: dict[str, list[str]] = {}
    for f in frozen:
        by_why.setdefault(f.get("why", "model.frozen"), []).append(f["name"])
    elements = sum(math.prod(f["shape"]) for f in frozen)
    parts = [f"{why}: " + ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")
             for why, names in by_why.items()]
    return line + f", {elements:,} elements ({'; '.join(parts)})"


def start_trackers(cfg: C.Config, comm, resumed: bool, log) -> Trackers | None:
    """MLflow / W&B runs (rank 0, else None; a resumed run continues its own): one that cannot start stops
    every rank before the first step."""
    error = trackers = None
    if comm.rank == 0:
        try:
            trackers = Trackers(cfg, cfg.run.output_dir, resumed=resumed, echo=log)
        except UsageError as exc:
            error = exc
    comm.agree(error)
    return trackers
