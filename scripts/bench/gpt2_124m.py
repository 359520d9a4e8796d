"""GPT-2 124M: its targets, side by side in one run (section ``gpt2-124m`` of run.py).

    make bench-124m                 # = .venv/bin/python scripts/bench/run.py --only gpt2-124m  (~10 min, 2 cores)
    .venv/bin/python scripts/bench/run.py --only gpt2-124m --target-model mid --work /tmp/b --output /tmp/B.md

GPT-2 12 x 768, vocab 50257, seq 256, micro-batch 2 per rank (``--target-model`` picks another shape of
common.MODELS, e.g. ``mid`` to try the harness in a minute), AdamW, 2 ranks x 1 thread. Setups, in one run,
in rounds that rotate their order so that a shared machine's load hits all alike:

* trainrun (this checkout) with ``distributed.zero_stage`` 0 and 1; where this checkout's config has
  ``distributed.intra_node``, each stage with ``intra_node=shared`` and ``=mpi``;
* trainrun at an older commit (``BEFORE``, before ZeRO-1 and ``phase_ms``): that commit's ``trainrun`` package and
  configs/gpt2-tiny.yaml (``git archive`` into the work folder), run through scripts/bench/trainrun_rank.py
  ``--code``; its graphs prepared by its own ``trainrun prepare``. That commit knew only onnxruntime-training's
  gradient builder, so where this venv has stock onnxruntime it runs from .venv-training (``make
  setup-training``: onnxruntime-training 1.19.2, the runtime it was measured on) with that venv's mpirun;
* PyTorch DDP (scripts/bench/torch_train.py: transformers GPT-2, gloo) on the same data and initial weights.

Every trainrun run is ``mpirun -np 2 trainrun --config configs/gpt2-tiny.yaml --set ...`` (common.run_sets,
log_every 1, the end-of-run checkpoint and export included) from a copy of graphs its code version prepared.
The GEMM peak (peak.py) and the memcpy bandwidth of a gradient-sized buffer on both ranks at once
(scripts/bench_comm.py through extras.py, beside MPI allreduce of that buffer) are measured in the same run,
before and after the rounds (the best of the two is used).

Per run (steady state = the steps after the warm-up): tokens/s = median of the per-step tokens/s of
metrics.jsonl; phase times = median per phase of ``phase_ms`` (rank 0; for code that does not log it, the
same per-step figures from trainrun_rank.py ``--phases``); time outside forward/backward = median over the
steps of (step's phase sum - forward_backward) / step's phase sum; model FLOP/s = nanoGPT's FLOPs per token x
tokens/s; gradient reduction bandwidth = 4 bytes x parameters / the median ``allreduce`` phase; peak RSS
per rank during the training steps (before the first checkpoint) and over the whole run (checkpoint and
export included). Whole-run figures (wall time of the command, summary.json's tokens/s) are kept apart.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SECTION = "gpt2-124m"
BEFORE = "315f1e2"       # an older commit: before ZeRO-1, phase_ms, ...
HERE = common.HERE
PY = sys.executable
TRAINING_BIN = common.ROOT / ".venv-training" / "bin"


def before_bin() -> Path:
    """The bin folder whose python and mpirun run the ``BEFORE`` commit: this venv's where its onnxruntime is the
    training build, else .venv-training's (that commit prepares its graphs with onnxruntime-training's builder)."""
    from trainrun.graphs.gradients import ort_builder_missing
    missing = ort_builder_missing()
    if missing and not (TRAINING_BIN / "python").exists():
        raise SystemExit(f"{SECTION}: trainrun at {BEFORE} needs onnxruntime-training's builder ({missing}) and "
                         f"{TRAINING_BIN} is missing: make setup-training")
    return TRAINING_BIN if missing else common.BIN
GRAD_BYTES = 4           # float32 gradients, parameters and AdamW moments


def intra_node_key() -> bool:
    """Whether this checkout's config has ``distributed.intra_node`` (the shared-memory path)."""
    from trainrun.config import DistributedConfig
    return "intra_node" in {f.name for f in dataclasses.fields(DistributedConfig)}


def bytes_per_param_per_node(stage: int | None, intra: str | None, ranks: int) -> dict:
    """Parameters + AdamW moments per parameter on one node of ``ranks`` ranks, from the config (one node:
    ``intra_node: shared`` applies): float32 parameters on every rank, or once per node on the shared path
    (every rank's sessions bound to one shared buffer); float32 m and v on every rank (stage 0 over MPI) or
    one part per rank (stage 1, or the shared path at any stage: each rank updates its slice of the node)."""
    shared = intra == "shared" and ranks > 1
    params = 1 if shared else ranks
    moments = 1 if (stage == 1 or shared) else ranks
    return {"params": GRAD_BYTES * params, "moments": 2 * GRAD_BYTES * moments,
            "total": GRAD_BYTES * params + 2 * GRAD_BYTES * moments}


def setups(intra: bool) -> dict:
    """name -> (code: "current" | "before" | "ddp", extra --sets, stage, intra_node)."""
    out = {}
    for stage in (0, 1):
        if intra:
            for mode in ("shared", "mpi"):
                out[f"trainrun stage {stage}, intra_node {mode}"] = (
                    "current", [f"distributed.zero_stage={stage}", f"distributed.intra_node={mode}"], stage, mode)
        else:
            out[f"trainrun stage {stage}"] = ("current", [f"distributed.zero_stage={stage}"], stage, "mpi")
    out[f"trainrun at {BEFORE}"] = ("before", [], 0, "mpi")
    out["PyTorch DDP"] = ("ddp", [], None, None)
    return out


class Section:
    def __init__(self, suite, model: str, rounds: int, warmup: int | None, steps: int | None):
        self.suite = suite
        base = common.MODELS[model]
        self.m = dataclasses.replace(base, warmup=base.warmup if warmup is None else warmup,
                                     steps=base.steps if steps is None else steps)
        self.rounds = rounds
        self.work = suite.work / SECTION
        self.work.mkdir(parents=True, exist_ok=True)
        self.ranks = 2

    # ------------------------------------------------------------------ inputs
    def dataset(self) -> str:
        """Raw bytes of the repo's own sources (token ids < 256 fit any vocabulary): built in seconds."""
        out = self.work / "data"
        if not (out / "train" / "manifest.json").exists():
            self.suite.sh(f"{SECTION}-data", [str(common.BIN / "trainrun-data"), "tokens", "--input",
                                              str(common.ROOT / "trainrun"), "--input", str(common.ROOT / "tests"),
                                              "--output", str(out), "--bytes", "--eval-fraction", "0",
                                              "--no-progress", "--overwrite"])
        return str(out / "train")

    def before_code(self) -> Path:
        """The commit ``BEFORE``'s trainrun package, its kernels/ and data_tools/ (installed as trainrun.kernels
        and trainrun.data_tools: trainrun_rank.py --code maps them) and configs (git archive), made once."""
        d = self.work / f"code-{BEFORE}"
        if not (d / "kernels" / "__init__.py").exists():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", str(common.ROOT), "archive", BEFORE, "trainrun", "kernels",
                                      "data_tools", "configs"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
        return d

    def trainrun_argv(self, out_dir: Path, config: Path, extra=()) -> list[str]:
        sets = [s for s in common.run_sets(self.m, out_dir, self.data, self.m.global_batch // self.ranks, 1,
                                           self.m.warmup, self.m.steps) if not s.startswith("train.log_every=")]
        sets += ["train.log_every=1"] + list(extra)
        return ["--config", str(config)] + [x for s in sets for x in ("--set", s)]

    def prepare(self, version: str, code: Path | None) -> Path:
        """``trainrun prepare`` by that code version itself; returns its graphs folder. This checkout's
        graphs are prepared afresh on every invocation (kept ones may predate a graph change, and every run
        would then prepare again inside its own timing and memory); the fixed ``before`` commit's are kept."""
        d = self.work / f"prep-{version}"
        if code is None or not (d / "graphs" / "manifest.json").exists():
            shutil.rmtree(d, ignore_errors=True)
            config = (code or common.ROOT) / "configs" / "gpt2-tiny.yaml"
            py = str(before_bin() / "python") if code else PY
            cmd = [py, str(HERE / "trainrun_rank.py")] + (["--code", str(code)] if code else []) + \
                ["--", "prepare"] + self.trainrun_argv(d, config)
            self.suite.say(f"{SECTION}: preparing the graphs with the {version} code")
            self.suite.sh(f"{SECTION}-prepare-{version}", cmd, timeout=900)
        return d / "graphs"

    # ------------------------------------------------------------------ runs
    def run_trainrun(self, tag: str, graphs: Path, code: Path | None, extra) -> dict:
        d = self.work / "runs" / tag
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copytree(graphs, d / "graphs")
        config = (code or common.ROOT) / "configs" / "gpt2-tiny.yaml"
        argv = self.trainrun_argv(d, config, extra)
        bin_ = before_bin() if code else common.BIN
        wrapper = [str(bin_ / "python") if code else PY, str(HERE / "trainrun_rank.py"), "--rss-dir", str(d),
                   "--phases"] + (["--code", str(code)] if code else [])
        info = self.suite.sh(f"{SECTION}-{tag}", [str(bin_ / "mpirun"), "-np", str(self.ranks)] + wrapper +
                             ["--"] + argv, timeout=600)
        shown = f"mpirun -np {self.ranks} trainrun " + " ".join(
            str(Path(a).relative_to(common.ROOT)) if a.startswith(str(common.ROOT) + "/") and
            not a.startswith(str(self.suite.work)) else a for a in argv)
        if code:
            shown = f"PYTHONPATH={code} " + shown
            if bin_ != common.BIN:
                shown = shown.replace("mpirun", str(bin_.relative_to(common.ROOT) / "mpirun"), 1)
        out = {"cmd": shown.replace(str(self.suite.work), "WORK"), **info}
        log = self.suite.logs / f"{SECTION}-{tag}.log"
        out["reprepared"] = "preparing graphs in" in log.read_text(errors="replace") if log.exists() else None
        try:
            recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
            steady = [r for r in recs if "tokens_per_sec" in r and r.get("step", 0) > self.m.warmup]
            out["tokens_per_sec"] = statistics.median(r["tokens_per_sec"] for r in steady)
            out["final_loss"] = steady[-1]["loss"]
            if all("phase_ms" in r for r in steady):
                rows, out["phase_source"] = [r["phase_ms"] for r in steady], "metrics.jsonl phase_ms"
            else:
                hooked = common.read_json(d / "phases-0.json")["steps"]
                rows = [s["phase_ms"] for s in hooked if s["step"] > self.m.warmup]
                out["phase_source"] = "trainrun_rank.py --phases (the code logs no phase_ms)"
            out.update(phases_of(rows))
            summary = common.read_json(d / "summary.json")
            out["whole_run_tokens_per_sec"] = summary.get("tokens_per_sec")
            out["whole_run_phase_shares"] = summary.get("phase_shares")
            rss = [common.read_json(p) for p in sorted(d.glob("rss-*.json"))]
            out["train_rss_mb"] = [r.get("train_peak_rss_mb", r["peak_rss_mb"]) for r in rss]
            out["run_rss_mb"] = [r["peak_rss_mb"] for r in rss]
        except (OSError, StopIteration, ValueError, KeyError, statistics.StatisticsError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        for junk in ("checkpoints", "model.onnx", "graphs"):
            p = d / junk
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return out

    def run_ddp(self, tag: str, weights: Path) -> dict:
        out_json = self.work / "runs" / f"{tag}.json"
        out_json.unlink(missing_ok=True)
        args = [str(HERE / "torch_train.py"), "--model", self.m.name, "--micro-batch",
                str(self.m.global_batch // self.ranks), "--threads", "1", "--warmup", str(self.m.warmup),
                "--steps", str(self.m.steps), "--data", self.data, "--weights", str(weights), "--out", str(out_json)]
        port = 29500 + zlib.crc32(str(self.work).encode() + tag.encode()) % 400
        info = self.suite.sh(f"{SECTION}-{tag}", [str(common.BIN / "torchrun"), "--nproc_per_node", str(self.ranks),
                                                  "--master_port", str(port)] + args,
                             env={"OMP_NUM_THREADS": "1"}, timeout=600)
        shown = f"OMP_NUM_THREADS=1 torchrun --nproc_per_node {self.ranks} " + " ".join(
            str(Path(a).relative_to(common.ROOT)) if a.startswith(str(common.ROOT)) else a for a in args)
        out = {"cmd": shown.replace(str(self.suite.work), "WORK"), **info}
        try:
            r = common.read_json(out_json)
            sh = r["phase_shares"]
            out.update(tokens_per_sec=self.m.tokens_per_step() / (r["step_ms_median"] / 1e3),
                       mean_tokens_per_sec=r["tokens_per_sec"], step_ms=r["step_ms_median"], phase_shares=sh,
                       outside_share=1.0 - sh.get("forward", 0.0) - sh.get("backward", 0.0),
                       train_rss_mb=r["peak_rss_mb"], run_rss_mb=r["peak_rss_mb"], final_loss=r["final_loss"])
        except (OSError, ValueError, KeyError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    # ------------------------------------------------------------------ measurements of the machine
    def machine_figures(self, when: str) -> dict:
        out = {}
        pj = self.work / f"peak-{when}.json"
        self.suite.sh(f"{SECTION}-peak-{when}", [PY, str(HERE / "peak.py"), "--repeats", "10", "--out", str(pj)])
        out["peak"] = common.read_json(pj) if pj.exists() else None
        cj = self.work / f"comm-{when}.json"
        self.suite.sh(f"{SECTION}-comm-{when}", [PY, str(HERE / "extras.py"), "comm", "--sizes",
                                                 f"{self.m.params() / 1e6:.4f}M", "--iters", "4", "--out", str(cj)])
        out["comm"] = common.read_json(cj) if cj.exists() else None
        return out

    # ------------------------------------------------------------------ all
    def run(self) -> dict:
        s, m = self.suite, self.m
        t0 = time.perf_counter()
        res = {"model": common.asdict_model(m), "ranks": self.ranks, "threads_per_rank": 1, "before": BEFORE,
               "rounds": self.rounds, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "machine": common.machine(), "intra_node_key": intra_node_key(), "runs": {}}
        s.results[SECTION] = res
        self.data = self.dataset()
        res["dataset"] = "raw bytes of trainrun/ and tests/ (trainrun-data tokens --bytes)"
        code = self.before_code()
        graphs = {"current": self.prepare("current", None), "before": self.prepare("before", code)}
        res["machine_start"] = self.machine_figures("start")
        s.save()
        plan = setups(res["intra_node_key"])
        res["setups"] = {k: {"code": v[0], "sets": v[1], "stage": v[2], "intra_node": v[3],
                             "bytes_per_param_per_node": bytes_per_param_per_node(v[2], v[3], self.ranks)}
                         for k, v in plan.items()}
        names = list(plan)
        for k in names:
            res["runs"][k] = []
        for rnd in range(self.rounds):
            k0 = (rnd * 2) % len(names)
            order = names[k0:] + names[:k0]
            order = order if rnd % 2 == 0 else order[::-1]
            s.say(f"{SECTION}: round {rnd + 1}/{self.rounds}")
            for name in order:
                kind, extra, _, _ = plan[name]
                tag = "".join(c if c.isalnum() else "_" for c in name) + f"-r{rnd}"
                if kind == "ddp":
                    r = self.run_ddp(tag, graphs["current"] / "weights.safetensors")
                else:
                    r = self.run_trainrun(tag, graphs[kind], code if kind == "before" else None, extra)
                r["round"] = rnd
                res["runs"][name].append(r)
                tps = r.get("tokens_per_sec")
                s.say(f"  {name:40s} " + (f"{tps:7.0f} tokens/s steady, outside fwd/bwd "
                                         f"{100 * r.get('outside_share', float('nan')):.1f}%" if tps else
                                         f"failed: {r.get('error')}") +
                      f" (wall {r['wall_s']:.0f} s, foreign load {r['foreign_cpu_cores']:.2f} cores)")
                s.save()
        res["machine_end"] = self.machine_figures("end")
        res["duration_s"] = round(time.perf_counter() - t0)
        s.save()
        return res


def phases_of(rows: list[dict]) -> dict:
    """Median phase ms, median step ms (phase sum) and median share outside forward_backward."""
    names = sorted({k for r in rows for k in r})
    sums = [sum(r.values()) for r in rows]
    return {"phase_ms": {k: statistics.median(r.get(k, 0.0) for r in rows) for k in names},
            "step_ms": statistics.median(sums),
            "outside_share": statistics.median((t - r.get("forward_backward", 0.0)) / t for r, t in zip(rows, sums))}
