"""``mpirun -np N trainrun doctor [--config FILE]``: test the distributed set-up before a long job.

Every rank gathers facts about itself (host, pid, local rank, device, MPI
library, onnxruntime version and providers) and rank 0 prints them as one
table. Then the checks, each PASS, FAIL or SKIP:

* ``versions``   every rank runs the same onnxruntime, trainrun and Python;
* ``allreduce``  a sum of known values (rank r contributes (r+1)*(i%7+1) at
                 index i of a float32 buffer, exact in float32) and of scalars
                 comes back exact on every rank, with the run's backend;
* ``elastic``    whether the job could survive a lost rank (``distributed.elastic``): Open MPI 5 with its
                 ULFM fault tolerance, enabled by ``mpirun --with-ft ulfm``; MPICH cannot (its fault
                 tolerance aborts in MPI_Init). FAIL only where the config sets distributed.elastic;
* ``bandwidth``  allreduce time of a ``--size-mb`` buffer (the slowest rank's
                 median of ``--iters``), as algorithm bandwidth (bytes/time)
                 and bus bandwidth (x 2(n-1)/n, as nccl-tests report it);
                 over several nodes also ``intra-node`` (each node's ranks
                 among themselves, every node at once) and ``inter-node`` (one
                 rank per node: the link between the nodes) apart. Nodes are
                 training's (MPI's shared-memory nodes, or
                 ``TRAINRUN_RANKS_PER_NODE``'s pretend ones), not hostnames;
* ``config``     every rank read the same config file bytes and ``--set``;
* ``run_dir``    with --config: a file rank 0 writes into run.output_dir is read by
                 every rank (checkpoints are committed by rank 0 from every
                 rank's files: the run directory must be one shared path);
* ``data``       with --config: every rank sees the same files in data.train
                 and data.eval (names, sizes and a digest of each file:
                 sha256 of the whole file up to 64 MiB, above that of 16
                 evenly spaced 1 MiB pieces and the size);
* ``builder``    the gradient builder prepare would use (``graphs.builder``; auto without
                 --config) and why, the same on every rank; FAIL where the config names
                 onnxruntime-training's and it is not installed;
* ``graphs``     with --config: the user's model.onnx (if any) and the
                 prepared graphs under <output_dir>/graphs are the same on
                 every rank and match the sha256 their manifest records
                 (SKIP when not prepared yet).
* ``diloco``     with a config of ``distributed.sync: diloco`` over several nodes:
                 the inner steps that keep the link under 5% of the time (one
                 outer gradient at the inter-node rate against one inner step's
                 computation, from the run directory's metrics.jsonl).

Exit 0 when nothing failed; otherwise rank 0 names the failing checks and
every rank exits 1.
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import sys
import time

import numpy as np

from ..graphs.gradients import BUILDER_NAMES, builder
from ..graphs.manifest import load_manifest
from ..comm import fault_tolerance, make_communicator
from ..errors import TrainrunError, UsageError
from ..run.rundir import sha256_file

FULL_HASH_LIMIT = 64 << 20
PIECE = 1 << 20
PIECES = 16


def file_digest(path: str) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(str(size).encode())
            for i in range(PIECES):
                fh.seek((size - PIECE) * i // (PIECES - 1))
                h.update(fh.read(PIECE))
    return h.hexdigest()[:16]


def dir_digest(path: str) -> dict:
    """{relative name: "size:digest"} of every file under ``path`` (or an error text)."""
    if not os.path.isdir(path):
        return {"error": f"not a directory: {path}"}
    out = {}
    try:
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for f in sorted(files):
                full = os.path.join(root, f)
                out[os.path.relpath(full, path)] = f"{os.path.getsize(full)}:{file_digest(full)}"
    except OSError as exc:
        return {"error": str(exc)}
    return out


def _cores() -> str:
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        spans, start = [], cores[0]
        for a, b in zip(cores, cores[1:] + [None]):
            if b != a + 1:
                spans.append(f"{start}-{a}" if a != start else str(a))
                start = b
        return f"{len(cores)} core(s) {','.join(spans)}"
    return f"{os.cpu_count()} core(s)"


def _device(device: str, local_rank: int) -> str:
    if device == "cuda":
        try:
            import cupy
            n = cupy.cuda.runtime.getDeviceCount()
            i = local_rank % max(n, 1)
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            return f"cuda:{i} {name} ({props['totalGlobalMem'] / 2**30:.0f} GiB)"
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            return f"cuda: unavailable ({type(exc).__name__}: {exc})"
    return f"cpu, {_cores()}"


def _mpi_library() -> str:
    try:
        from mpi4py import MPI
        return " ".join(MPI.Get_library_version().split("\n")[0].split())
    except Exception as exc:  # noqa: BLE001
        return f"unavailable ({exc})"


def _facts(comm, device: str) -> dict:
    import onnxruntime as ort
    from importlib.metadata import version
    return {"rank": comm.rank, "host": platform.node(), "pid": os.getpid(), "local_rank": comm.local_rank,
            "device": _device(device, comm.local_rank),
            "mpi": _mpi_library() if comm.world_size > 1 or comm.backend != "none" else "not used (1 rank)",
            "ort": ort.__version__, "providers": ort.get_available_providers(),
            "trainrun": version("trainrun"), "python": platform.python_version()}


def _xp(comm, device):
    if comm.backend == "nccl":
        import cupy
        return cupy
    return np


def check_allreduce(comm, device: str, n: int = 1 << 20) -> tuple[str, str]:
    xp = _xp(comm, device)
    w = comm.world_size
    pattern = (np.arange(n) % 7 + 1).astype(np.float32)
    buf = xp.asarray(pattern * (comm.rank + 1))
    comm.allreduce_(buf)
    got = np.asarray(buf.get() if xp is not np else buf)
    expected = pattern * np.float32(w * (w + 1) // 2)
    bad = int(np.count_nonzero(got != expected))
    scal = comm.allreduce_scalars([comm.rank + 1.0, 1.0], op="sum")
    oks = comm.allgather_object([bad, scal == [w * (w + 1) / 2, float(w)]])
    failing = [f"rank {r}: {b} of {n} wrong elements" if b else f"rank {r}: wrong scalar sum"
               for r, (b, s) in enumerate(oks) if b or not s]
    if failing:
        return "FAIL", "; ".join(failing)
    return "PASS", f"sum of known values over {w} rank(s) ({n:,} float32 and 2 float64 scalars, {comm.backend})"


def _allreduce_time(comm, xp, n: int, iters: int) -> float:
    """This rank's median time of ``iters`` allreduces of ``n`` float32 over ``comm`` (after two warm-up rounds)."""
    buf = xp.ones(n, np.float32)
    times = []
    for i in range(iters + 2):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce_(buf)
        dt = time.perf_counter() - t0
        if i >= 2:
            times.append(dt)
    return statistics.median(times)


def _bandwidth_text(n: int, t: float, w: int, iters: int) -> str:
    algbw = n * 4 / t / 1e9
    busbw = algbw * 2 * (w - 1) / w
    return (f"allreduce of {n * 4 / 2**20:.0f} MiB over {w} rank(s): {t * 1e3:.2f} ms, algbw {algbw:.2f} GB/s, "
            f"busbw {busbw:.2f} GB/s (median of {iters})")


def measure_bandwidth(comm, device: str, size_mb: float, iters: int) -> tuple[str, str]:
    if comm.world_size == 1:
        return "SKIP", "one rank: nothing to measure"
    n = max(1, int(size_mb * (1 << 20)) // 4)
    t = comm.allreduce_scalars([_allreduce_time(comm, _xp(comm, device), n, iters)], op="max")[0]
    return "PASS", _bandwidth_text(n, t, comm.world_size, iters)


def _node_group(comm):
    """This rank's node group as training makes it (``comm.split_nodes``), or None on one rank or without
    MPI."""
    from ..comm import MPICommunicator, split_nodes
    from ..sync.update import ranks_per_node
    if not isinstance(comm, MPICommunicator) or comm.world_size == 1:
        return None
    return split_nodes(comm, ranks_per_node(comm.world_size))[0]


def measure_node_bandwidth(comm, node, size_mb: float, iters: int, link: dict | None = None
                           ) -> list[tuple[str, str, str]]:
    """``intra-node`` (every node's ranks at once; the slowest node) and ``inter-node`` (node rank 0 of
    every node) bandwidth, where there are several nodes (and, for intra-node, several ranks on one);
    ``link`` gets the inter-node allreduce's float32 count ``n``, seconds ``s`` and ``nodes``."""
    leaders = comm.allgather_object(node.rank == 0).count(True)
    if leaders < 2:
        return []
    n = max(1, int(size_mb * (1 << 20)) // 4)
    checks = []
    sizes = comm.allgather_object(node.world_size)
    if max(sizes) > 1:
        t = _allreduce_time(node, np, n, iters) if node.world_size > 1 else 0.0
        t = comm.allreduce_scalars([t], op="max")[0]
        checks.append(("intra-node", "PASS", _bandwidth_text(n, t, max(sizes), iters) + " on each node"))
    cross = comm.split(node.rank, "cross-node")
    try:
        t = _allreduce_time(cross, np, n, iters) if node.rank == 0 else 0.0
        t = comm.allreduce_scalars([t], op="max")[0]
    finally:
        cross.close()
    checks.append(("inter-node", "PASS", _bandwidth_text(n, t, leaders, iters) + ", one rank per node"))
    if link is not None:
        link.update(n=n, s=t, nodes=leaders)
    return checks


LINK_SHARE = 0.05      # the share of the time diloco's estimate lets the outer steps take on the link


def estimate_inner_steps(cfg, link: dict) -> tuple[str, str]:
    """``diloco``: the inner steps (distributed.diloco.inner_steps) that keep the link between the nodes
    under :data:`LINK_SHARE` of the time: one outer gradient (the model's float32, or bf16 with
    ``outer_dtype``) over the link, at the inter-node allreduce's measured rate, against one inner step's
    computation, read from the run directory's metrics.jsonl (its last line's phases but the reduction)."""
    import json
    import math
    if not link:
        return "SKIP", "one node: no link between nodes to estimate for"
    graphs = os.path.join(cfg.run.output_dir, "graphs")
    try:
        params = load_manifest(graphs)["num_params"]
    except (UsageError, OSError, KeyError):
        return "SKIP", "the graphs are not prepared yet (trainrun prepare): the model's size is not known"
    half = cfg.distributed.diloco.outer_dtype == "bf16"
    nbytes = 4 * params // (2 if half else 1)
    link_s = link["s"] * params / link["n"] / (2 if half else 1)
    what = (f"an outer gradient of {params:,} parameters ({cfg.distributed.diloco.outer_dtype}: {nbytes:,} bytes) "
            f"takes ~{link_s * 1e3:.1f} ms on the link between the {link['nodes']} nodes")
    metrics = os.path.join(cfg.run.output_dir, "metrics.jsonl")
    phases = None
    if os.path.exists(metrics):
        with open(metrics) as fh:
            for line in fh:
                row = json.loads(line)
                phases = row.get("phase_ms", phases)
    if not phases:
        return "PASS", f"{what}; no step time yet ({metrics}: train a few steps first) to estimate inner_steps"
    step_s = sum(v for k, v in phases.items() if k in ("data", "forward_backward", "norm", "optimizer",
                                                        "allgather")) / 1e3
    need = max(1, math.ceil(link_s / (LINK_SHARE * step_s)))
    return "PASS", (f"{what}; an inner step computes ~{step_s * 1e3:.1f} ms ({metrics}): distributed.diloco."
                    f"inner_steps >= {need} keeps the link under {LINK_SHARE:.0%} of the time")


def check_fault_tolerance(comm, elastic: bool) -> tuple[str, str]:
    """Whether this job could go on after losing a rank (:func:`trainrun.comm.fault_tolerance`): FAIL only where
    the config asks for it (``elastic``: ``distributed.elastic``) and this MPI or launch cannot survive one."""
    if comm.world_size == 1 and comm.backend == "none":
        return "SKIP", "one rank, no MPI: nothing to survive"
    from mpi4py import MPI      # initialised already by the communicator
    ok, why = fault_tolerance(MPI)
    if ok:
        return "PASS", f"yes, a lost rank can be survived: {why}"
    return ("FAIL" if elastic else "SKIP"), f"no: {why}"


def check_run_dir(comm, run_dir: str) -> tuple[str, str]:
    """Rank 0 writes a file with a fresh token into ``run_dir``; every rank must read that token."""
    token = comm.allgather_object(os.urandom(8).hex())[0]
    probe = os.path.join(run_dir, f".doctor-{token}")
    if comm.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "w") as fh:
            fh.write(token)
            fh.flush()
            os.fsync(fh.fileno())
    comm.barrier()
    try:
        with open(probe) as fh:
            mine = fh.read() == token
    except OSError:
        mine = False
    seen = comm.allgather_object([mine, platform.node()])
    comm.barrier()
    if comm.rank == 0:
        os.remove(probe)
    blind = [f"{r} ({host})" for r, (ok, host) in enumerate(seen) if not ok]
    if blind:
        return "FAIL", (f"{run_dir}: rank(s) {', '.join(blind)} cannot read the file rank 0 wrote there; the run "
                        f"directory must be the same shared filesystem path on every host")
    return "PASS", f"{run_dir}: a file written by rank 0 is read by every rank"


def check_builder(comm, choice: str) -> tuple[str, str]:
    """Which gradient builder ``prepare`` would use on each rank for ``choice`` (graphs.builder, auto without a
    config)."""
    try:
        mine = dict(zip(("builder", "why"), builder(choice)))
    except UsageError as exc:
        mine = {"error": exc.message}
    everyone = comm.allgather_object(mine)
    status, text = _same("builder", everyone, lambda a, b: f"{a['builder']} vs {b['builder']} ({b['why']})")
    if status == "PASS":
        text = f"{BUILDER_NAMES[everyone[0]['builder']]} ({everyone[0]['why']}); {text}"
    return status, text


def _same(name: str, values: list, describe) -> tuple[str, str]:
    ref = values[0]
    for r, v in enumerate(values):
        if isinstance(v, dict) and "error" in v:
            return "FAIL", f"rank {r}: {v['error']}"
    for r, v in enumerate(values[1:], 1):
        if v != ref:
            return "FAIL", f"rank {r} differs from rank 0: {describe(ref, v)}"
    return "PASS", f"same on all {len(values)} rank(s)"


def _diff_files(a: dict, b: dict) -> str:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    parts = []
    if changed:
        parts.append(f"different content: {', '.join(changed[:3])}")
    if only_a:
        parts.append(f"missing: {', '.join(only_a[:3])}")
    if only_b:
        parts.append(f"extra: {', '.join(only_b[:3])}")
    return "; ".join(parts)


def _graph_files(cfg) -> dict:
    out = {}
    if cfg.model.onnx:
        try:
            out["model.onnx"] = file_digest(cfg.model.onnx)
        except OSError as exc:
            return {"error": f"model.onnx: {exc}"}
    gdir = os.path.join(cfg.run.output_dir, "graphs")
    manifest_path = os.path.join(gdir, "manifest.json")
    if not os.path.isfile(manifest_path):
        out["graphs"] = "not prepared"
        return out
    try:
        manifest = load_manifest(gdir)
        for name, sha in manifest["files"].items():
            actual = sha256_file(os.path.join(gdir, name))
            if actual != sha:
                return {"error": f"{os.path.join(gdir, name)} does not match its manifest (sha256 {actual[:12]} "
                                 f"vs {sha[:12]}); run `trainrun prepare` again"}
            out[name] = sha[:16]
    except (OSError, TrainrunError) as exc:
        return {"error": str(getattr(exc, "message", exc))}
    return out


def run_doctor(cfg=None, config_bytes: bytes = b"", overrides=(), size_mb: float = 64.0, iters: int = 5,
               echo=print) -> int:
    """Run every check on every rank; rank 0 prints the report. Returns the exit status."""
    device = cfg.device if cfg else "cpu"
    backend = cfg.distributed.backend if cfg else "auto"
    comm = make_communicator(backend, device, cfg.distributed.timeout_s if cfg else 120.0)
    node = None
    try:
        node = _node_group(comm)
        mine = _facts(comm, device)
        mine["node"] = node.allgather_object(comm.rank)[0] if node else 0     # the node's first world rank
        facts = comm.allgather_object(mine)
        checks = []
        keys = ("ort", "trainrun", "python")
        checks.append(("versions", *_same("versions", [{k: f[k] for k in keys} for f in facts],
                                          lambda a, b: ", ".join(f"{k} {a[k]} vs {b[k]}" for k in keys
                                                                 if a[k] != b[k]))))
        checks.append(("builder", *check_builder(comm, cfg.graphs.builder if cfg is not None else "auto")))
        checks.append(("allreduce", *check_allreduce(comm, device)))
        checks.append(("elastic", *check_fault_tolerance(comm, cfg is not None and cfg.distributed.elastic)))
        checks.append(("bandwidth", *measure_bandwidth(comm, device, size_mb, iters)))
        link: dict = {}
        if node is not None:
            checks += measure_node_bandwidth(comm, node, size_mb, iters, link)
        if cfg is not None:
            mine = hashlib.sha256(config_bytes + "\0".join(overrides).encode()).hexdigest()[:16]
            checks.append(("config", *_same("config", comm.allgather_object(mine),
                                             lambda a, b: f"config file or --set differ (sha256 {b} vs {a})")))
            checks.append(("run_dir", *check_run_dir(comm, cfg.run.output_dir)))
            named = cfg.data.eval if isinstance(cfg.data.eval, dict) else {}
            sets = [("train", cfg.data.train)] + ([(f"eval.{n}", p) for n, p in named.items()] if named
                                                    else [("eval", cfg.data.eval)])
            for key, path in sets:
                if not path:
                    checks.append((f"data.{key}", "SKIP", "not configured"))
                    continue
                status, text = _same(f"data.{key}", comm.allgather_object(dir_digest(path)), _diff_files)
                text = f"{path}: " + text
                checks.append((f"data.{key}", status, text))
            graphs = comm.allgather_object(_graph_files(cfg))
            status, text = _same("graphs", graphs, _diff_files)
            if status == "PASS" and graphs[0].get("graphs") == "not prepared":
                status, text = ("SKIP", "not prepared yet (trainrun prepare); "
                                + ("model.onnx same on every rank" if "model.onnx" in graphs[0] else "nothing to check"))
            checks.append(("graphs", status, text))
            if cfg.distributed.sync == "diloco":
                checks.append(("diloco", *estimate_inner_steps(cfg, link)))
        comm.barrier()
    finally:
        if node is not None:
            node.close()
        comm.close()

    failed = [name for name, status, _ in checks if status == "FAIL"]
    if comm.rank == 0:
        echo(_report(facts, checks, comm.world_size))
        if failed:
            details = [f"{name}: {text}" for name, status, text in checks if status == "FAIL"]
            raise TrainrunError(f"doctor: check(s) failed: {', '.join(failed)}", details)
    return 1 if failed else 0


def _report(facts: list[dict], checks: list[tuple], world: int) -> str:
    nodes = sorted({f["node"] for f in facts})
    f0 = facts[0]
    per_node = "; ".join(f"{facts[n]['host']}: rank(s) {', '.join(str(f['rank']) for f in facts if f['node'] == n)}"
                         for n in nodes)
    lines = [f"trainrun doctor: {world} rank(s) on {len(nodes)} node(s) ({per_node})",
             f"MPI library: {f0['mpi']}",
             f"onnxruntime {f0['ort']} (providers: {', '.join(f0['providers'])}); trainrun {f0['trainrun']}; "
             f"Python {f0['python']} ({sys.executable})", ""]
    hw = max(len("host"), *(len(f["host"]) for f in facts))
    lines.append(f"  {'rank':>4}  {'host':<{hw}}  {'pid':>7}  {'local':>5}  device")
    for f in facts:
        lines.append(f"  {f['rank']:>4}  {f['host']:<{hw}}  {f['pid']:>7}  {f['local_rank']:>5}  {f['device']}")
    lines.append("")
    lines.append("checks:")
    nw = max(len(c[0]) for c in checks)
    for name, status, text in checks:
        lines.append(f"  {status:<4}  {name:<{nw}}  {text}")
    return "\n".join(lines)
