"""onnxruntime session options: the one place they are built, for every session trainrun opens (the
engine's train, eval and optimizer sessions, ``evaluate``, ``generate`` and the sampler, ``export``'s
check of the model it wrote).

onnxruntime is imported when options are built, not at import (see trainrun/run/runner.py: its first import
belongs on a short stack).
"""

from __future__ import annotations

import importlib
import os
import sys

_LEVELS = {"disabled": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
           "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def session_options(threads: int = 0, name: str = "", *, graph_optimization: str = "all", log_severity: int = 3,
                    deterministic: bool = False, spinning: bool = True, prepacking: bool = True,
                    profile_prefix: str | None = None, optimized_dir: str | None = None,
                    log_id: str | None = None, recompute: bool = False, chained: bool = False):
    """Options of one session. ``threads``: intra-op threads (0: onnxruntime's choice, one per core);
    operators run one after the other (``inter_op`` 1). ``name`` names the graph in the profile's and the
    optimized graph's file names and in onnxruntime's log lines. ``spinning`` False: the thread pool does
    not keep spinning after a run (for short runs between train steps, whose spinning pools would compete
    with the train session's threads); ``prepacking``
    False: no packed second copy of the weights (a check that runs once). ``deterministic`` caps the graph
    optimizations at basic (the fusions above it change the arithmetic) and asks for deterministic kernels.
    ``recompute``: a train graph with recomputed blocks (trainrun/graphs/recompute.py): its nodes run in the
    order of the graph's node list (priority-based order; equal priorities go by node index), so each
    block is recomputed when the backward pass reaches it; open it with
    ``disabled_optimizers=disabled_optimizers(True)``. ``chained``: the session is one of several
    that run one after the other (the train graph's segments): it allocates host memory from the process's
    one CPU arena (:func:`shared_cpu_arena`) instead of an arena of its own, which would keep its peak for
    the session's life, so the sessions reuse each other's memory and a tensor one makes and another frees
    goes back to it; and its thread pool stops spinning when its run ends (``session.force_spinning_stop``)
    rather than take the cores the next session computes on."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if chained:
        shared_cpu_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    # no memory pattern: stock onnxruntime 1.32's pre-planned block held mid's micro-batch 8 at 1.66 GB peak RSS
    # against 1.05 GB without it (onnxruntime-training 1.19.2: 1.03 GB), the same speed and losses
    # (docs/design.md, "Static shapes and session options"); the arena serves the allocations instead
    so.enable_mem_pattern = False
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    level = "basic" if deterministic and graph_optimization in ("extended", "all") else graph_optimization
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
    so.log_severity_level = log_severity
    if deterministic:
        so.use_deterministic_compute = True
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix + (f"_{name}" if name else "")
    if optimized_dir and name:
        so.optimized_model_filepath = os.path.join(optimized_dir, f"{name}.onnx")
    if recompute:
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if log_id:
        so.logid = f"{log_id} {name}".strip()
    return so


_ARENA: list = []


def shared_cpu_arena() -> None:
    """Register one CPU arena allocator with onnxruntime's environment (once a process), for the sessions
    opened with ``session.use_env_allocators``. It grows by what is asked (``kSameAsRequested``), not to
    the next power of two, whose slack a chain of sessions would keep (BENCHMARKS.md, the overlap path)."""
    if not _ARENA:
        import onnxruntime as ort
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))    # no limit, same as asked
        _ARENA.append(info)


def disabled_optimizers(recompute: bool = False) -> list[str] | None:
    """The onnxruntime graph transformers a session must not run (InferenceSession's
    ``disabled_optimizers``). A train graph with recomputed blocks: common-subexpression elimination
    would merge each recomputed node back into its original, and SkipLayerNormFusion turns a recomputed
    Add + LayerNormalization (the Add's only reader) into a SkipLayerNormalization whose CPU kernel does
    not write the Mean/InvStdDev outputs the LayerNormalization gradient reads (1.19.2: "Missing Input").
    (The session config key ``optimization.disable_specified_optimizers`` is not read by 1.19.2.)"""
    return ["CommonSubexpressionElimination", "SkipLayerNormFusion"] if recompute else None


def import_onnxruntime():
    """onnxruntime, imported without importing torch. onnxruntime-training's package check (its
    capi/onnxruntime_validation.py) imports ORTModule, and with it torch wherever torch is installed: 1.5 s
    of every trainrun process that never uses either. Every entry point calls this before anything imports
    onnxruntime."""
    return import_without_torch("onnxruntime")


def import_without_torch(name: str):
    """Module ``name``, imported with ``torch`` unimportable for the duration: packages that import torch
    when it is installed only to accept its tensors (onnxruntime-training's package check, which then
    finds no ORTModule and moves on; tensorboardX's writer, 1.8 s) skip it. Afterwards torch imports as
    usual; a process that already imported torch is left as it is."""
    if name in sys.modules:
        return sys.modules[name]
    block = "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None      # `import torch` raises ImportError, which they expect
    try:
        return importlib.import_module(name)
    finally:
        if block and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
