"""trainrun's benchmark suite: trainrun vs PyTorch (DDP and single process) vs the
train-graph ceiling, side by side in one run, with trainrun's speed levers
switched off for comparison, plus BERT, a CNN, GPT-2 124M and component
measurements; regenerates BENCHMARKS.md.

    .venv/bin/python scripts/bench/run.py            # full (~20 min on 2 cores), = make bench
    .venv/bin/python scripts/bench/run.py --quick    # ~5 min: fewer steps and repeats
    .venv/bin/python scripts/bench/run.py --render   # re-write BENCHMARKS.md from the last results.json
    .venv/bin/python scripts/bench/run.py --only bert,memcap   # re-run sections into results.json
    .venv/bin/python scripts/bench/run.py --only gpt2-124m   # = make bench-124m: GPT-2 124M alone (~10 min)

Everything runs with the same thread budget (all cores, 2 on the reference
machine): "2x1" = 2 ranks x 1 thread, "1x2" = 1 process x 2 threads, the same
global batch, the same data (trainrun's loader and order), the same initial
weights. The setups of one model run in rounds; each round runs every setup
once, in a rotated order, so that a shared machine's load changes hit all
setups alike. For every run the CPU time that processes outside the run used
meanwhile is recorded ("foreign load", in cores).

Setups per model:
  trainrun        mpirun -np 2 trainrun --config ... (2x1) / trainrun --config ... (1x2), defaults
  trainrun-off    the same CLI with --set engine.optimizer_kernel=graph --set engine.static_shapes=false
                  (--off-set replaces them): trainrun's two speed levers off (the ONNX optimizer
                  graph instead of the host kernel, the dynamic-shape train graph); the other
                  changes made with them (the sigmoid GELU, no spinning in the eval/optimizer
                  sessions) have no switch and stay on
  PyTorch         torchrun --nproc_per_node 2 (DDP, gloo) / one process, 2 threads
  ceiling         trainrun's train graph alone in a loop on trainrun's flat buffers
                  (scripts/bench/ceiling.py); ceiling-off: the same on the dynamic-shape
                  graph (2x1: both graphs in the same processes, alternating blocks; 1x2:
                  one process each)

With engine.static_shapes on, a train graph fits one micro-batch: the graphs
are prepared (``trainrun prepare``, scripts/bench/variants.py) once per model,
micro-batch (2x1: global batch / 2, 1x2: the global batch, memcap: its own)
and graph-shaping --sets, and every run starts from the folder of its own
micro-batch, so no run re-prepares (a run that did is flagged in the report).

Section gpt2-124m (scripts/bench/gpt2_124m.py; not in --quick unless named in --only): GPT-2 124M
with trainrun's ZeRO stages (and intra-node paths), an older commit of trainrun and PyTorch DDP, side by
side. BENCHMARKS.md keeps every section of the last file that this run did not render (``--only``, the
hand-kept sections), with its headline rows.

Raw results: runs/bench/results.json (+ logs/ and per-run folders).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import BIN, MODELS, ROOT  # noqa: E402

import gpt2_124m  # noqa: E402
import variants  # noqa: E402

PY = sys.executable
HERE = Path(__file__).resolve().parent
CONFIG = common.CONFIG
# trainrun's speed levers that have a switch, off: the ONNX optimizer graph, the dynamic-shape train graph
DEFAULT_OFF_SETS = ["engine.optimizer_kernel=graph", variants.STATIC_OFF]


def rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


class CpuMeter:
    """Machine CPU time vs this process's children's CPU time over an interval."""

    def __init__(self):
        self.t = time.perf_counter()
        self.busy = self._machine_busy()
        self.ours = self._children()

    @staticmethod
    def _machine_busy() -> float:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        v = [int(x) for x in fields]
        user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _children() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t
        busy = self._machine_busy() - self.busy
        ours = self._children() - self.ours
        return {"wall_s": round(wall, 2), "our_cpu_cores": round(ours / wall, 2),
                "foreign_cpu_cores": round(max(0.0, busy - ours) / wall, 2)}


class Suite:
    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.work = Path(args.work).resolve()
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.results: dict = {"mode": "quick" if self.quick else "full", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "argv": sys.argv[1:], "models": {}, "load": []}
        self.off_sets = list(DEFAULT_OFF_SETS if args.off_set is None else args.off_set)

    # ------------------------------------------------------------------ helpers
    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.0f}s] {text}", flush=True)

    def sh(self, name: str, cmd: list[str], env: dict | None = None, timeout: int = 420) -> dict:
        # no PYTHONPATH: the venvs hold this checkout's trainrun (editable), and the root before site-packages
        # would shadow the `kernels` transformers imports with the checkout's kernels/ (tests/conftest.py)
        full_env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {}))
        log = self.logs / f"{name}.log"
        meter = CpuMeter()
        load = os.getloadavg()[0]
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:     # the whole launched tree (mpirun/torchrun and ranks)
                import signal
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
        info = {"rc": rc, "log": rel(log), "loadavg_1m": load, **meter.stop()}
        self.results["load"].append([round(time.perf_counter() - self.t0), load])
        if rc != 0:
            self.say(f"  {name}: exit {rc} (see {rel(log)})")
        return info

    def save(self) -> None:
        common.write_json(self.work / "results.json", self.results)

    # ------------------------------------------------------------------ data and graphs
    def dataset(self) -> str:
        if self.args.data:
            return str(Path(self.args.data).resolve())
        shared = ROOT / "data" / "stdlib" / "train"
        if (shared / "manifest.json").exists() and json.loads((shared / "manifest.json").read_text()).get("vocab_size") == 1024:
            return str(shared)
        out = self.work / "data"
        if not (out / "train" / "manifest.json").exists():
            import sysconfig
            self.say(f"building the dataset in {rel(out)}")
            self.sh("dataset", [str(BIN / "trainrun-data"), "tokens", "--input", sysconfig.get_paths()["stdlib"],
                                "--output", str(out), "--train-bpe", "1024", "--include", "*.py", "--no-progress",
                                "--overwrite"])
        return str(out / "train")

    def sets(self, m: common.BenchModel, out_dir: Path, ranks: int, threads: int, warmup: int, steps: int,
             micro_batch: int | None = None) -> list[str]:
        return common.run_sets(m, out_dir, self.data, micro_batch or m.global_batch // ranks, threads, warmup, steps)

    def graphs(self, m: common.BenchModel, micro_batch: int, sets=()) -> Path:
        """The graphs folder for ``m`` at ``micro_batch`` and the graph-shaping ones of ``sets``
        (none: trainrun's static train graph; engine.static_shapes=false: the dynamic one),
        made once by ``trainrun prepare`` (scripts/bench/variants.py)."""
        return variants.prepare(self.work, m, micro_batch, self.data, sets,
                                run=lambda name, cmd: self.sh(name, cmd)["rc"])

    # ------------------------------------------------------------------ one run of each kind
    def run_trainrun(self, m, tag, ranks, threads, graphs: Path, warmup, steps, extra_sets=(), micro_batch=None) -> dict:
        d = self.work / "runs" / m.name / tag
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copytree(graphs, d / "graphs")
        sets = self.sets(m, d, ranks, threads, warmup, steps, micro_batch) + list(extra_sets)
        argv = ["--config", str(CONFIG)] + [x for s in sets for x in ("--set", s)]
        wrapper = [PY, str(HERE / "trainrun_rank.py"), "--rss-dir", str(d)]
        cmd = ([str(BIN / "mpirun"), "-np", str(ranks)] if ranks > 1 else []) + wrapper + ["--"] + argv
        info = self.sh(f"{m.name}-{tag}", cmd)
        # trainrun re-prepares (before step 1, outside the timed steps) when the graphs do not fit the run
        log = self.logs / f"{m.name}-{tag}.log"
        info["reprepared"] = "preparing graphs in" in log.read_text(errors="replace") if log.exists() else None
        if info["reprepared"]:
            self.say(f"  {m.name}-{tag}: trainrun re-prepared its graphs (graphs folder {rel(graphs)} does not fit)")
        shown = (f"mpirun -np {ranks} " if ranks > 1 else "") + "trainrun " + " ".join(
            a if not a.startswith(("/", str(ROOT))) else rel(a) for a in argv)
        out = {"cmd": shown, **info}
        try:
            records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
            records = [r for r in records if "elapsed_s" in r and "step" in r]
            first = next(r for r in records if r["step"] == max(1, warmup))
            last = records[-1]
            tps = (last["step"] - first["step"]) * m.tokens_per_step() / (last["elapsed_s"] - first["elapsed_s"])
            windows = [(b["step"] - a["step"]) * m.tokens_per_step() / (b["elapsed_s"] - a["elapsed_s"])
                       for a, b in zip(records, records[1:]) if a["step"] >= first["step"]]
            summary = json.loads((d / "summary.json").read_text())
            rss = [common.read_json(p) for p in sorted(d.glob("rss-*.json"))]
            # phase shares of the timed steps (metrics.jsonl's phase_ms: the mean per step since the previous
            # log), not summary.json's, which count the warm-up: the first step loads the optimizer's compiled
            # loops (0.3 s), a tenth of a short run
            steady: dict[str, float] = {}
            for a, b in zip(records, records[1:]):
                if a["step"] >= first["step"]:
                    for k, v in (b.get("phase_ms") or {}).items():
                        steady[k] = steady.get(k, 0.0) + v * (b["step"] - a["step"])
            total = sum(steady.values())
            out.update(tokens_per_sec=tps, best_window_tokens_per_sec=max(windows) if windows else tps,
                       phase_shares={k: v / total for k, v in steady.items()} if total else
                       summary.get("phase_shares", {}), whole_run_phase_shares=summary.get("phase_shares", {}),
                       startup_s=summary.get("startup_s"), end_s=summary.get("end_s"),
                       final_loss=summary.get("final_loss"),
                       peak_rss_mb=[r.get("train_peak_rss_mb", r["peak_rss_mb"]) for r in rss],
                       run_peak_rss_mb=[r["peak_rss_mb"] for r in rss], vm_peak_mb=[r.get("vm_peak_mb") for r in rss])
            ops = variants.op_counts(d / "graphs" / "train.onnx")
            out["gelu_ops"] = sorted(k for k in ops if k in ("FastGelu", "Sigmoid", "Tanh", "BiasGelu", "Gelu"))
            out["static_shape"] = variants.build_of(d / "graphs").get("static_shape")
            out["optimizer_kernel"] = next((s.split("=", 1)[1] for s in reversed(sets)
                                            if s.startswith("engine.optimizer_kernel=")), "auto")
        except (OSError, StopIteration, ValueError, KeyError, ZeroDivisionError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        for junk in ("checkpoints", "model.onnx", "graphs"):
            p = d / junk
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return out

    def run_torch(self, m, tag, ranks, threads, weights: Path, warmup, steps, micro_batch=None) -> dict:
        out_json = self.work / "runs" / m.name / f"{tag}.json"
        out_json.unlink(missing_ok=True)
        mb = micro_batch or m.global_batch // ranks
        args = [str(HERE / "torch_train.py"), "--model", m.name, "--micro-batch", str(mb), "--threads", str(threads),
                "--warmup", str(warmup), "--steps", str(steps), "--data", self.data, "--weights", str(weights),
                "--out", str(out_json)]
        if ranks > 1:
            cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(29500 + os.getpid() % 500)] + args
            shown = f"OMP_NUM_THREADS=1 torchrun --nproc_per_node {ranks} " + " ".join(rel(a) for a in args)
        else:
            cmd = [PY] + args
            shown = "python " + " ".join(rel(a) for a in args)
        info = self.sh(f"{m.name}-{tag}", cmd, env={"OMP_NUM_THREADS": str(threads)})
        out = {"cmd": shown, **info}
        try:
            r = common.read_json(out_json)
            out.update(tokens_per_sec=r["tokens_per_sec"], phase_shares=r["phase_shares"],
                       peak_rss_mb=r["peak_rss_mb"], vm_peak_mb=r.get("vm_peak_mb"), final_loss=r["final_loss"],
                       best_window_tokens_per_sec=r.get("best_window_tokens_per_sec", r["tokens_per_sec"]),
                       attn_implementation=r.get("attn_implementation"))
        except (OSError, ValueError, KeyError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    def run_ceiling(self, m, tag, ranks, threads, graphs: list[Path], warmup, steps) -> list[dict]:
        """One process (per rank) times every graph folder of ``graphs`` in alternating blocks."""
        out_json = self.work / "runs" / m.name / f"{tag}.json"
        out_json.unlink(missing_ok=True)
        mb = m.global_batch // ranks
        args = [str(HERE / "ceiling.py"), "--graphs", ",".join(str(g) for g in graphs), "--data", self.data,
                "--micro-batch", str(mb), "--seq-len", str(m.seq_len), "--threads", str(threads), "--warmup",
                str(warmup), "--steps", str(steps), "--window", str(max(1, m.warmup)), "--out", str(out_json)]
        cmd = ([str(BIN / "mpirun"), "-np", str(ranks)] if ranks > 1 else []) + [PY] + args
        shown = (f"mpirun -np {ranks} " if ranks > 1 else "") + "python " + " ".join(rel(a) for a in args)
        info = self.sh(f"{m.name}-{tag}", cmd)
        outs = []
        try:
            r = common.read_json(out_json)
            for row in r["rows"]:
                outs.append({"cmd": shown, **info, "tokens_per_sec": row["tokens_per_sec"],
                             "best_window_tokens_per_sec": row["best_window_tokens_per_sec"],
                             "peak_rss_mb": r["peak_rss_mb"], "static_shape": row.get("static_shape")})
        except (OSError, ValueError, KeyError) as exc:
            outs = [{"cmd": shown, **info, "error": f"{type(exc).__name__}: {exc}"} for _ in graphs]
        return outs

    # ------------------------------------------------------------------ sections
    def peak(self) -> None:
        self.say("peak FLOP/s (large matmul)")
        out = self.work / "peak.json"
        self.sh("peak", [PY, str(HERE / "peak.py"), "--repeats", "4" if self.quick else "8", "--out", str(out)])
        self.results["peak"] = common.read_json(out) if out.exists() else None

    def matrix(self, name: str) -> None:
        m = MODELS[name]
        steps = m.quick_steps if self.quick else m.steps
        warmup = m.warmup
        repeats = self.args.repeats or (1 if self.quick else 3)
        mb2, mb1 = m.global_batch // 2, m.global_batch          # per process: 2x1, 1x2
        base = {mb: self.graphs(m, mb) for mb in (mb2, mb1)}
        off = {mb: self.graphs(m, mb, self.off_sets) for mb in (mb2, mb1)}
        weights = base[mb2] / "weights.safetensors"
        OFF = dict(extra_sets=self.off_sets)
        setups = {
            "trainrun 2x1": lambda tag: self.run_trainrun(m, tag, 2, 1, base[mb2], warmup, steps),
            "PyTorch DDP 2x1": lambda tag: self.run_torch(m, tag, 2, 1, weights, warmup, steps),
            "trainrun-off 2x1": lambda tag: self.run_trainrun(m, tag, 2, 1, off[mb2], warmup, steps, **OFF),
            "ceiling 2x1": lambda tag: self.run_ceiling(m, tag, 2, 1, [base[mb2], off[mb2]], warmup, steps),
            "trainrun 1x2": lambda tag: self.run_trainrun(m, tag, 1, 2, base[mb1], warmup, steps),
            "PyTorch 1x2": lambda tag: self.run_torch(m, tag, 1, 2, weights, warmup, steps),
            "trainrun-off 1x2": lambda tag: self.run_trainrun(m, tag, 1, 2, off[mb1], warmup, steps, **OFF),
            # 1x2: one graph per process: two 2-thread sessions in one process would disturb each other
            # (a session's pool spins after its run)
            "ceiling 1x2": lambda tag: self.run_ceiling(m, tag, 1, 2, [base[mb1]], warmup, steps)[0],
            "ceiling-off 1x2": lambda tag: self.run_ceiling(m, tag, 1, 2, [off[mb1]], warmup, steps)[0],
        }
        res = self.results["models"][name]
        names = list(setups)
        res["runs"] = {}
        for k in names:
            res["runs"][k] = []
            if k == "ceiling 2x1":       # times both graphs in the same processes
                res["runs"]["ceiling-off 2x1"] = []
        for rep in range(repeats):
            k = (rep * 3) % len(names)
            order = names[k:] + names[:k]
            if rep % 2:
                order = order[::-1]
            self.say(f"{name}: round {rep + 1}/{repeats}")
            for setup in order:
                tag = setup.replace(" ", "_") + f"-r{rep}"
                got = setups[setup](tag)
                pairs = [(setup, got)] if isinstance(got, dict) else \
                    [(setup, got[0]), (setup.replace("ceiling", "ceiling-off"), got[1])]
                for key, r in pairs:
                    r["round"] = rep
                    res["runs"][key].append(r)
                    tps = r.get("tokens_per_sec")
                    self.say(f"  {key:24s} " + (f"{tps:9.0f} tokens/s" if tps else f"failed: {r.get('error')}") +
                             f"  (foreign load {r['foreign_cpu_cores']:.2f} cores)")
                self.save()

    def memcap(self) -> None:
        """Peak RSS per rank against the micro-batch, trainrun vs trainrun-off vs DDP (2x1), a few steps each."""
        res = self.results.setdefault("memcap", {})
        plan = {"tiny": [8, 64]} if self.quick else {"tiny": [8, 64], "mid": [2, 8]}
        for name, mbs in plan.items():
            m = MODELS[name]
            rows = []
            for mb in mbs:
                base, off = self.graphs(m, mb), self.graphs(m, mb, self.off_sets)
                self.say(f"memcap {name}: micro-batch {mb}")
                a = self.run_trainrun(m, f"mem-trainrun-mb{mb}", 2, 1, base, 1, 2, micro_batch=mb)
                b = self.run_torch(m, f"mem-ddp-mb{mb}", 2, 1, base / "weights.safetensors", 1, 2, micro_batch=mb)
                c = self.run_trainrun(m, f"mem-off-mb{mb}", 2, 1, off, 1, 2, micro_batch=mb,
                                      extra_sets=self.off_sets)
                rows.append({"micro_batch": mb, "trainrun": a.get("peak_rss_mb"), "ddp": b.get("peak_rss_mb"),
                             "off": c.get("peak_rss_mb"), "trainrun_vm": a.get("vm_peak_mb"),
                             "ddp_vm": b.get("vm_peak_mb"), "reprepared": bool(a.get("reprepared") or c.get("reprepared"))})
                self.save()
            res[name] = rows

    def extras(self) -> None:
        q = self.quick
        tiny, mid = MODELS["tiny"].params(), MODELS["mid"].params()
        self.say("allreduce vs raw MPI vs memcpy (scripts/bench_comm.py)")
        out = self.work / "comm.json"
        self.sh("comm", [PY, str(HERE / "extras.py"), "comm", "--sizes", f"{tiny / 1e6:.4f}M,{mid / 1e6:.4f}M",
                         "--iters", "6" if q else "12", "--out", str(out)])
        self.results["comm"] = common.read_json(out) if out.exists() else None
        self.say("data loader batches/s (scripts/bench_data.py)")
        out = self.work / "data.json"
        self.sh("data", [PY, str(HERE / "extras.py"), "data", "--data", self.data, "--steps", "1000" if q else "4000",
                         "--out", str(out)])
        self.results["data"] = common.read_json(out) if out.exists() else None

    def bert(self) -> None:
        q = self.quick
        self.say("BERT pre-training (bert-tiny) vs PyTorch DDP (scripts/bench/bert.py)")
        out = self.work / "bert"
        self.sh("bert", [PY, str(HERE / "bert.py"), "--steps", "30" if q else "60", "--rounds", "1" if q else "3",
                         "--profile", "--out", str(out)], timeout=1200)
        self.results["bert"] = common.read_json(out / "results.json") if (out / "results.json").exists() else None

    def cnn(self) -> None:
        q = self.quick
        self.say("SqueezeNet 1.1 on the digits vs PyTorch DDP (scripts/bench/cnn.py)")
        out = self.work / "cnn"
        self.sh("cnn", [PY, str(HERE / "cnn.py"), "--steps", "80" if q else "200", "--rounds", "1" if q else "3",
                        "--out", str(out)], timeout=1200)
        self.results["cnn"] = common.read_json(out / "results.json") if (out / "results.json").exists() else None

    # ------------------------------------------------------------------ all
    def run(self) -> None:
        only = set(self.args.only.split(",")) if self.args.only else None
        if only:       # update some sections of the last results
            prev = self.work / "results.json"
            if prev.exists():
                keep = self.results
                self.results = common.read_json(prev)
                self.results["argv_last"] = keep["argv"]
                for stale in ("proposed", "numerics", "optim", "fastopt", "scaling", "runner_levers"):
                    self.results.pop(stale, None)      # sections the suite no longer measures
        want = lambda section: only is None or section in only  # noqa: E731
        self.results["machine"] = common.machine()
        self.results["loadavg_start"] = os.getloadavg()
        if only is None or only - {gpt2_124m.SECTION}:      # (the 124M section builds its own)
            self.data = self.dataset()
            self.results["dataset"] = rel(self.data)
        self.results["off"] = {"sets": self.off_sets}
        self.results["models_def"] = {k: common.asdict_model(v) for k, v in MODELS.items()}
        models = self.args.models.split(",")
        for name in models:
            self.results["models"].setdefault(name, {})
        if want("peak"):
            self.peak()
        self.save()
        if want("matrix"):
            for name in models:
                self.matrix(name)
        if want("extras") and not self.args.skip_extras:
            self.extras()
            self.save()
        if want("memcap") and not self.args.skip_extras and (not self.quick or only):
            self.memcap()
        if want("bert") and not self.args.skip_extras:
            self.bert()
        if want("cnn") and not self.args.skip_extras:
            self.cnn()
            self.save()
        if want(gpt2_124m.SECTION) and (not self.quick or only):
            gpt2_124m.Section(self, self.args.target_model, self.args.target_rounds, self.args.target_warmup,
                              self.args.target_steps).run()
            self.save()
        if want("peak"):
            self.peak_again()
        self.results["loadavg_end"] = os.getloadavg()
        if only is None:
            self.results["duration_s"] = round(time.perf_counter() - self.t0)
        self.save()

    def peak_again(self) -> None:
        """The peak is measured at the start and at the end; the best of both is used."""
        out = self.work / "peak2.json"
        self.sh("peak2", [PY, str(HERE / "peak.py"), "--repeats", "4" if self.quick else "8", "--out", str(out)])
        if out.exists():
            self.results["peak_end"] = common.read_json(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer steps/rounds (~5 min; no memcap or gpt2-124m "
                                                          "unless named in --only)")
    ap.add_argument("--models", default="tiny,mid")
    ap.add_argument("--repeats", type=int, help="rounds of the main matrix (default 3, quick 1)")
    ap.add_argument("--data", help="token dataset folder (default: data/stdlib/train, else built in the work folder)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench"))
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--off-set", action="append", metavar="KEY=VALUE",
                    help=f"a --set of the trainrun-off runs (repeatable; replaces the default {' '.join(DEFAULT_OFF_SETS)})")
    ap.add_argument("--skip-extras", action="store_true")
    ap.add_argument("--only", help="comma-separated sections to (re-)run into the existing results.json: "
                                   "peak,matrix,extras,memcap,bert,cnn,gpt2-124m")
    ap.add_argument("--target-model", default="gpt2-124m", choices=list(MODELS),
                    help="model of the gpt2-124m section (e.g. mid to try it quickly)")
    ap.add_argument("--target-rounds", type=int, default=1, help="rounds of the gpt2-124m section")
    ap.add_argument("--target-warmup", type=int, help="untimed steps per run of the gpt2-124m section (default 3)")
    ap.add_argument("--target-steps", type=int, help="timed steps per run of the gpt2-124m section (default 5)")
    ap.add_argument("--render", action="store_true", help="only re-write the report from results.json")
    args = ap.parse_args()
    import report
    work = Path(args.work).resolve()
    if not args.render:
        suite = Suite(args)
        try:
            suite.run()
        finally:
            suite.save()
    results = common.read_json(work / "results.json")
    output = Path(args.output)
    old = output.read_text() if output.exists() else ""
    output.write_text(report.merge(old, report.render(results)))     # sections not rendered now kept
    print(f"wrote {rel(args.output)} (raw results: {rel(work / 'results.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
