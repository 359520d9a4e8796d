"""DiLoCo's quality at equal tokens: mid GPT-2 trained by every-step data parallelism and by
``distributed.sync: diloco`` at several inner-step counts H, on the same data, batches, schedule and
initial weights; the eval loss of each (on the global weights for DiLoCo) along the run.

    .venv/bin/python scripts/bench/diloco_quality.py [--steps 1000] [--micro-batch 1] [--h 10,50,100,500]
        [--warm-start 200] [--seed N] [--extra NAME=SETS] [--step-time every-step=S --step-time NAME=S]
        [--work runs/bench/diloco-quality] [--output BENCHMARKS.md]

Every run: ``mpirun -np 2`` on this machine, each rank a replica of one rank (``distributed.diloco.group
1``; the link does not change a loss, so no pretend cluster is needed), micro-batch ``--micro-batch`` x seq
256 a rank, AdamW with a cosine schedule, eval every ``--eval-every`` steps on the same ``--eval-steps``
batches. Outer optimizer: ``--outer-lr``, ``--outer-momentum`` (Nesterov where > 0; default the paper's lr 0.7,
momentum 0.9) for every H; ``--extra`` variants name their own.
A run whose metrics.jsonl already ends at the last step is not run again (``--fresh`` to rerun all).

Steps to target: the first eval step at which a run's eval loss is at most every-step training's final
eval loss (linear between two evals). A variant may run longer than ``--steps`` (``train.max_steps=N`` in its
``--extra`` sets; its loss at ``--steps`` is the equal-tokens figure) to reach it; ``--step-time`` gives the
seconds a step takes at one link rate (``make bench-cluster``) and so the wall time to that loss, a warm
start's steps counted at every-step training's time. The block in BENCHMARKS.md is one per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

H_LIST = "10,50,100,500"
HEADING = "### DiLoCo's eval loss at equal tokens, and the wall time to a loss (`scripts/bench/diloco_quality.py`)"


def markers(micro_batch: int) -> tuple[str, str]:
    """The lines around this script's block in BENCHMARKS.md: a block per micro-batch."""
    tag = "diloco-quality" + (f" micro-batch {micro_batch}" if micro_batch != 1 else "")
    return f"<!-- {tag}: begin -->", f"<!-- {tag}: end -->"


def base_sets(args, out: Path) -> list[str]:
    m = common.MODELS["mid"]
    sets = common.run_sets(m, out, args.data + "/train", args.micro_batch, steps=args.steps - 1)
    sets = [s for s in sets if not s.startswith(("data.eval=", "train.eval_every=", "train.log_every=",
                                                 "lr_schedule.warmup_steps="))]
    return sets + [f"data.eval={args.data}/eval", f"train.eval_every={args.eval_every}",
                   f"train.eval_steps={args.eval_steps}", f"train.log_every={args.eval_every}",
                   f"optimizer.lr={args.lr}", f"lr_schedule.warmup_steps={args.warmup}",
                   f"lr_schedule.min_lr={args.lr / 10}"] + ([f"run.seed={args.seed}"] if args.seed is not None else [])


def outer_sets(args) -> list[str]:
    return [f"distributed.diloco.outer.lr={args.outer_lr}", f"distributed.diloco.outer.momentum={args.outer_momentum}",
            f"distributed.diloco.outer.nesterov={str(args.outer_momentum > 0).lower()}"]


def variants(args) -> dict[str, list[str]]:
    v = {"every-step": ["distributed.sync=every_step"]}
    for h in args.h.split(","):
        v[f"diloco-h{h}"] = ["distributed.sync=diloco", "distributed.diloco.group=1",
                             f"distributed.diloco.inner_steps={h}"] + outer_sets(args)
    for spec in args.extra or []:
        name, sets = spec.split("=", 1)
        v[name] = ["distributed.sync=diloco", "distributed.diloco.group=1"] + sets.split(",")
    return v


def run_steps(args, sets: list[str]) -> int:
    """The last step of a variant: ``--steps`` unless its sets give ``train.max_steps`` (a longer run, to see
    the step at which it reaches every-step training's final loss)."""
    given = [s.split("=", 1)[1] for s in sets if s.startswith("train.max_steps=")]
    return int(given[-1]) if given else args.steps


def wall_time(args, results: dict) -> list[str]:
    """Wall time to every-step training's final loss at a link rate, from the seconds a step takes there
    (``--step-time NAME=S``, measured by ``make bench-cluster``); a warm start's steps at every-step's time."""
    times = {k: float(v) for k, v in (x.split("=", 1) for x in args.step_time or [])}
    if "every-step" not in times:
        return []
    base = args.steps * times["every-step"]
    out = [f"Wall time to every-step training's final loss at the link of `--step-time`: every-step {args.steps} "
           f"steps x {times['every-step']:g} s = {base:,.0f} s."]
    for name, t in times.items():
        if name == "every-step":
            continue
        if name not in results:
            raise SystemExit(f"--step-time {name}: no variant of that name in this run")
        to = results[name]["steps_to_target"]
        if to is None:
            out.append(f"{name}: does not reach it in its {results[name]['end'][0]} steps.")
            continue
        wall = args.warm_start * times["every-step"] + (to - args.warm_start) * t
        out.append(f"{name}: reaches it at step {to:.0f} (of {results[name]['end'][0]}): {args.warm_start} steps x "
                   f"{times['every-step']:g} s + {to - args.warm_start:.0f} x {t:g} s = **{wall:,.0f} s, "
                   f"{wall / base:.2f}x** every-step's (target: at most 0.6x).")
    return out


def launch(work: Path, name: str, head: list[str], sets: list[str], check: bool = True) -> None:
    argv = [str(common.BIN / "mpirun"), "-np", "2", str(common.BIN / "trainrun"), *head,
            *[x for s in sets for x in ("--set", s)]]
    t0 = time.time()
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=common.ROOT).returncode
    if rc and (check or rc != 75):      # 75: stopped at train.stop_at, resumable
        raise SystemExit(f"{name} failed (exit {rc}): see {work / f'{name}.log'}")
    print(f"{name}: {time.time() - t0:.0f} s", flush=True)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def evals(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["eval_loss"]) for r in records(run) if "eval_loss" in r]


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which ``curve`` reaches ``target`` (linear between evals), None if it never does."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            return prev[0] + (prev[1] - target) / (prev[1] - loss) * (step - prev[0])
        prev = (step, loss)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--h", default=H_LIST)
    ap.add_argument("--extra", action="append", help="NAME=set,set (diloco sets of another variant)")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov where > 0")
    ap.add_argument("--warm-start", type=int, default=0, help="DiLoCo runs continue every-step training's "
                    "checkpoint of this step (resume --force --set distributed.sync=diloco), as the paper starts "
                    "from a pre-trained model; 0: from the initial weights")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seed", type=int, help="run.seed of every run: the initial weights and the data order "
                    "(default: the bench config's)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-steps", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--data", help="a trainrun-data folder with train/ and eval/ (default: the stdlib .py "
                    "files, BPE 1024, 2%% held out, made in WORK/data)")
    ap.add_argument("--work", default=str(common.ROOT / "runs" / "bench" / "diloco-quality"))
    ap.add_argument("--output", default=str(common.ROOT / "BENCHMARKS.md"))
    ap.add_argument("--step-time", action="append", help="NAME=SECONDS a step at one link rate (from make "
                    "bench-cluster), every-step's and a variant's: the wall time to every-step's final loss")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.data is None:
        args.data = str(work / "data")
        if not (work / "data" / "eval" / "manifest.json").exists():
            import sysconfig
            subprocess.run([str(common.BIN / "trainrun-data"), "tokens", "--input", sysconfig.get_paths()["stdlib"],
                            "--output", args.data, "--train-bpe", "1024", "--include", "*.py", "--eval-fraction",
                            "0.02", "--no-progress", "--overwrite"], check=True)
    results = {}
    warm = None
    if args.warm_start:
        warm = work / f"every-step-to-{args.warm_start}"
        if args.fresh or not (warm / "checkpoints" / str(args.warm_start) / "state.json").exists():
            shutil.rmtree(warm, ignore_errors=True)
            launch(work, warm.name, ["--config", str(common.CONFIG)], base_sets(args, warm) + [
                "distributed.sync=every_step", f"train.stop_at={args.warm_start}",
                f"checkpoint.every={args.warm_start}"], check=False)
    for name, sets in variants(args).items():
        run = work / name
        last = run_steps(args, sets)
        done = [r for r in records(run) if r.get("step") == last and "eval_loss" in r]
        if args.fresh or not done:
            shutil.rmtree(run, ignore_errors=True)
            if warm is not None and name != "every-step":
                shutil.copytree(warm, run, ignore=shutil.ignore_patterns("checkpoints"))
                shutil.copytree(warm / "checkpoints" / str(args.warm_start),
                                run / "checkpoints" / str(args.warm_start))
                launch(work, name, ["resume", str(run), "--force"], sets)
            else:
                launch(work, name, ["--config", str(common.CONFIG)], base_sets(args, run) + sets)
        recs = records(run)
        outer = [r for r in recs if "outer_bytes" in r]
        results[name] = {"sets": sets, "evals": evals(run), "outer_steps": len(outer),
                         "outer_bytes": sum(r["outer_bytes"] for r in outer)}
    base = results["every-step"]["evals"][-1][1]
    for name, r in results.items():
        if args.steps not in dict(r["evals"]):
            raise SystemExit(f"{name}: no eval at step {args.steps} (--eval-every must divide --steps)")
        r["final"] = dict(r["evals"])[args.steps]         # at equal tokens, also for a longer run
        r["end"] = r["evals"][-1]
        r["vs_every_step"] = r["final"] / base - 1
        r["steps_to_target"] = steps_to(r["evals"], base)
    common.write_json(work / "quality.json", {"args": vars(args), "machine": common.machine(), "results": results})
    text = render(args, results)
    print(text)
    if not args.no_write:
        common.write_section(args.output, text, *markers(args.micro_batch), HEADING)
    return 0


def render(args, results: dict) -> str:
    m = common.MODELS["mid"]
    tokens = 2 * args.micro_batch * m.seq_len
    diloco = {k: v for k, v in results.items() if k != "every-step"}
    best = min(diloco, key=lambda k: diloco[k]["final"]) if diloco else None
    begin, end = markers(args.micro_batch)
    out = [begin,
           f"mid GPT-2 ({m.n_layer} x {m.n_embd}, seq {m.seq_len}, vocabulary {m.vocab_size}), 2 replicas of one rank "
           f"(`mpirun -np 2`, `distributed.diloco.group: 1`) against every-step data parallelism on the same 2 ranks: "
           f"{args.steps} steps of {tokens:,} tokens ({args.steps * tokens:,} tokens), AdamW lr {args.lr:g} "
           f"(cosine, warm-up {args.warmup}, to {args.lr / 10:g}), outer SGD lr {args.outer_lr:g}"
           f"{f' with Nesterov momentum {args.outer_momentum:g}' if args.outer_momentum else ', no momentum'} "
           f"unless named; eval loss on {args.eval_steps} batches a rank every {args.eval_every} steps (DiLoCo: on "
           f"the global weights). "
           + (f"The DiLoCo runs continue every-step training's checkpoint of step {args.warm_start} "
              f"(`trainrun resume --force --set distributed.sync=diloco`; the paper starts from a pre-trained "
              f"model): steps 1-{args.warm_start} are every-step's. " if args.warm_start else "")
           + f"Data: the standard library's .py files, BPE 1024, 2% held out. The losses do "
           f"not depend on the machine's load. Command: `.venv/bin/python scripts/bench/diloco_quality.py "
           f"--steps {args.steps} --micro-batch {args.micro_batch}{f' --h {args.h}' if args.h != H_LIST else ''}"
           f"{f' --seed {args.seed}' if args.seed is not None else ''}"
           f"{f' --warm-start {args.warm_start}' if args.warm_start else ''} "
           f"--outer-lr {args.outer_lr:g} --outer-momentum {args.outer_momentum:g}"
           f"{''.join(f' --step-time {t}' for t in args.step_time or [])}` (variants past the H list: "
           f"`--extra NAME=SETS` with their sets, named by them). Outer steps and bytes: the whole run.", "",
           f"| variant | outer steps | eval loss at step {args.steps} | vs every-step | steps to every-step's final loss | "
           "bytes across replicas (per rank) |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        to = f"{r['steps_to_target']:.0f}" if r["steps_to_target"] is not None else "not reached"
        out.append(f"| {name} | {r['outer_steps']} | {r['final']:.4f} | {r['vs_every_step'] * 100:+.2f}% | {to} | "
                   f"{r['outer_bytes']:,} |")
    out.append("")
    if best:
        r = diloco[best]
        out.append(f"Best H here: **{best}**, {r['vs_every_step'] * 100:+.2f}% against every-step's "
                   f"{results['every-step']['final']:.4f} (target: within 2%: "
                   f"{'met' if abs(r['vs_every_step']) <= 0.02 or r['vs_every_step'] < 0 else '**not met**'}).")
    out[-1] += "".join(" " + x for x in wall_time(args, results))
    return "\n".join(out + [end])


if __name__ == "__main__":
    sys.exit(main())
