"""Renders runs/bench/results.json (written by run.py) as BENCHMARKS.md: targets, the trainrun /
trainrun-off / PyTorch / ceiling tables, findings (prose with this run's numbers; "n/a" where a figure
was not measured), levers and components."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LAYOUTS = ("2x1", "1x2")
TORCH = {"2x1": "PyTorch DDP 2x1", "1x2": "PyTorch 1x2"}


def f0(x):
    return "–" if x is None else f"{x:,.0f}"


def f2(x):
    return "–" if x is None else f"{x:.2f}"


def pct(x, digits=0):
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def tps(runs):
    return [r.get("tokens_per_sec") for r in runs if r.get("tokens_per_sec")]


def paired(a_runs, b_runs, key="tokens_per_sec"):
    """Per-round ratios a/b (runs of the same round ran next to each other)."""
    b = {r["round"]: r.get(key) for r in b_runs if r.get(key)}
    return [r[key] / b[r["round"]] for r in a_runs if r.get(key) and b.get(r["round"])]


def ratio_cell(vals):
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.2f}"
    return f"{statistics.median(vals):.2f} [{min(vals):.2f}–{max(vals):.2f}]"


def peak_gflops(R):
    vals = [p.get("peak_gflops") for p in (R.get("peak"), R.get("peak_end")) if p]
    return max(vals) if vals else None


def max_rss(runs):
    vals = [max(r["peak_rss_mb"]) for r in runs if r.get("peak_rss_mb")]
    return max(vals) if vals else None


def rss_cell(runs):
    per_rank = [r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb")]
    if not per_rank:
        return "–"
    ranks = len(per_rank[0])
    return " / ".join(f"{max(p[i] for p in per_rank if len(p) > i):.0f}" for i in range(ranks))


STEP_PHASES = ("data", "forward_backward", "allreduce", "norm", "optimizer", "forward", "backward", "clip")


def shares(runs):
    """Median share per phase over runs, renormalised over the step's own phases."""
    acc: dict[str, list] = {}
    for r in runs:
        ph = {k: v for k, v in (r.get("phase_shares") or {}).items() if k in STEP_PHASES}
        total = sum(ph.values()) or 1.0
        for k, v in ph.items():
            acc.setdefault(k, []).append(v / total)
    return {k: statistics.median(v) for k, v in acc.items()}


def shares_cell(runs):
    s = shares(runs)
    if not s:
        return "–"
    names = {"forward_backward": "fwd+bwd", "allreduce": "allreduce", "optimizer": "optim", "data": "data",
             "norm": "norm", "forward": "fwd", "backward": "bwd(+allreduce)", "clip": "clip"}
    return ", ".join(f"{names.get(k, k)} {pct(v, 1)}" for k, v in s.items())


def foreign(runs):
    v = [r.get("foreign_cpu_cores") for r in runs if r.get("foreign_cpu_cores") is not None]
    return f"{statistics.median(v):.2f}" if v else "–"


def na(x, fmt="{:.2f}", suffix=""):
    """A number for the findings' prose; 'n/a' where it was not measured."""
    return "n/a" if x is None else fmt.format(x) + suffix


def ceiling_of(setup):
    """The ceiling setup that bounds a trainrun setup: the same train graph, the same layout."""
    who, layout = setup.rsplit(" ", 1)
    return ("ceiling-off " if who == "trainrun-off" else "ceiling ") + layout


def graph_label(r):
    s = r.get("static_shape")
    return "dynamic" if s is None and "static_shape" in r else (f"static {s[0]}x{s[1]}" if s else "?")


def model_section(R, name, out):
    M = R["models"][name]
    md = R["models_def"][name]
    runs = M.get("runs", {})
    if not runs:
        return
    peak = peak_gflops(R)
    fpt = md["flops_per_token"]
    out.append(f"### {name}: GPT-2 {md['n_layer']} layers, d {md['n_embd']}, {md['n_head']} heads, seq {md['seq_len']}, "
               f"vocab {md['vocab_size']} ({md['params'] / 1e6:.2f}M parameters), global batch {md['global_batch']} "
               f"x {md['seq_len']} = {md['tokens_per_step']:,} tokens/step\n")
    first = (runs.get("trainrun 2x1") or [{}])[0].get("cmd", "")
    total = first.split("train.max_steps=")[-1].split()[0] if "train.max_steps=" in first else "?"
    out.append(f"{md['warmup']} untimed warm-up steps, then {total} steps in all per run; {fpt / 1e6:.2f} MFLOP per "
               f"token (6N + 12 L S d); MFU against {f0(peak)} GFLOP/s measured.\n")
    out.append("| setup | tokens/s median [min–max] (runs) | best window | vs PyTorch, same layout (paired) | "
               "of ceiling, same graph (paired) | MFU | peak RSS MB per rank | step time shares | foreign load (cores) | final loss |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for setup, rs in runs.items():
        v = tps(rs)
        s = common.summarize(v)
        layout = setup.split()[-1]
        vs_torch = "–"
        if not setup.startswith("PyTorch") and TORCH.get(layout) in runs:
            vs_torch = ratio_cell(paired(rs, runs[TORCH[layout]]))
        of_ceiling = "–"
        if setup.startswith("trainrun") and ceiling_of(setup) in runs:
            of_ceiling = ratio_cell(paired(rs, runs[ceiling_of(setup)]))
        mfu = pct(s["median"] * fpt / (peak * 1e9), 1) if s["median"] and peak else "–"
        losses = [r.get("final_loss") for r in rs if r.get("final_loss") is not None]
        rng = f" [{f0(s['min'])}–{f0(s['max'])}]" if s["n"] > 1 else ""
        out.append(f"| {setup} | **{f0(s['median'])}**{rng} ({s['n']}) | {f0(med([r.get('best_window_tokens_per_sec') for r in rs]))} | "
                   f"{vs_torch} | {of_ceiling} | {mfu} | {rss_cell(rs)} | {shares_cell(rs)} | {foreign(rs)} | "
                   f"{f'{statistics.median(losses):.4f}' if losses else '–'} |")
    out.append("")
    errors = [(k, r.get("error"), r.get("log")) for k, rs in runs.items() for r in rs if r.get("error")]
    for k, e, log in errors:
        out.append(f"* {k}: run failed ({e}; log {log})")
    if errors:
        out.append("")
    decomposition(R, name, runs, out)
    used = []
    for k, rs in runs.items():
        if rs and not k.startswith("PyTorch"):
            r = rs[0]
            bits = [graph_label(r)]
            if k.startswith("trainrun"):
                kern = r.get("optimizer_kernel", "?")
                bits.append("optimizer " + ("host (auto)" if kern == "auto" else kern))
                bits.append("GELU " + (", ".join(r.get("gelu_ops") or []) or "?"))
            used.append(f"{k}: {'; '.join(bits)}")
    if used:
        out.append("Train graph (from its graphs folder's manifest: static = built for micro-batch x seq), optimizer "
                   "kernel and GELU op of each setup: " + " · ".join(used) + ".\n")
    again = sorted({k for k, rs in runs.items() for r in rs if r.get("reprepared")})
    if again:
        out.append(f"**Re-prepared inside the run** (its graphs folder did not fit; before step 1, outside the timed "
                   f"steps): {', '.join(again)}.\n")


def decomposition(R, name, runs, out):
    """Where a trainrun step's time goes, against the ceiling's step."""
    md = R["models_def"][name]
    tok = md["tokens_per_step"]
    rows = (R.get("comm") or {}).get("rows") or []
    raw = min(rows, key=lambda r: abs(r["floats"] - md["params"]))["blocking_ms"] if rows else None
    lines = []
    for setup in ("trainrun 2x1", "trainrun-off 2x1", "trainrun 1x2", "trainrun-off 1x2"):
        rs = runs.get(setup)
        ceil = runs.get(ceiling_of(setup))
        t, c = med(tps(rs or [])), med(tps(ceil or []))
        if not t or not c:
            continue
        step, cstep = tok / t * 1e3, tok / c * 1e3
        ms = {k: v * step for k, v in shares(rs).items()}
        ar = ms.get("allreduce", 0.0)
        ar_cell = f"{ar:.1f}" + (f" (raw MPI {raw:.1f})" if raw is not None and setup.endswith("2x1") else "")
        lines.append(f"| {setup} | {step:.1f} | {ceiling_of(setup)}: {cstep:.1f} | {step - cstep:+.1f} ({(step - cstep) / step:+.1%}) | "
                     f"{ms.get('forward_backward', 0):.1f} ({ms.get('forward_backward', 0) - cstep:+.1f}) | "
                     f"{ms.get('data', 0):.1f} | {ar_cell} | {ms.get('norm', 0):.1f} | {ms.get('optimizer', 0):.1f} |")
    if lines:
        out.append(f"Where the step time goes ({name}; medians; phase ms = trainrun's phase share x its step time; "
                   f"the allreduce phase includes waiting for the slower rank):\n")
        out.append("| setup | step ms | ceiling step ms | overhead ms | fwd+bwd ms (vs ceiling) | data ms | "
                   "allreduce ms | norm ms | optimizer ms |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        out.extend(lines)
        out.append("")


def targets(R, out):
    out.append("Targets count for **trainrun** (its defaults); the *trainrun-off* rows (its two levers off) are "
               "there for comparison.\n")
    out.append("| target | " + " | ".join(R["models"]) + " |")
    out.append("|---|" + "---|" * len(R["models"]))

    def row(label, fn):
        cells = []
        for name in R["models"]:
            try:
                cells.append(fn(R["models"][name].get("runs", {})))
            except (KeyError, TypeError, ValueError, ZeroDivisionError, statistics.StatisticsError):
                cells.append("–")
        out.append(f"| {label} | " + " | ".join(cells) + " |")

    def verdict(ok, counts):
        return ("met" if ok else "**not met**") if counts else "(comparison)"

    def vs(a, b, goal, counts=True):
        def fn(runs):
            v = paired(runs[a], runs[b])
            return f"{statistics.median(v):.2f}x {verdict(statistics.median(v) >= goal, counts)}" if v else "–"
        return fn

    def overhead(a, b, counts=True):
        def fn(runs):
            v = paired(runs[a], runs[b])
            o = 1 - statistics.median(v)
            return f"{100 * o:.1f}% {verdict(o <= 0.03, counts)}" if v else "–"
        return fn

    def rss(a, b, counts=True):
        def fn(runs):
            x, y = max_rss(runs[a]), max_rss(runs[b])
            return f"{x:.0f} vs {y:.0f} MB {verdict(x <= y, counts)}"
        return fn

    for who, counts in (("trainrun", True), ("trainrun-off", False)):
        note = "" if counts else " (levers off)"
        # issue 32's bar (issue 17's was 1.2x)
        row(f"{who} 2x1 >= 1.3x PyTorch DDP 2x1{note}", vs(f"{who} 2x1", "PyTorch DDP 2x1", 1.3, counts))
        row(f"{who} 1x2 >= 1.0x PyTorch 1x2{note}", vs(f"{who} 1x2", "PyTorch 1x2", 1.0, counts))
        for lay in LAYOUTS:
            row(f"{who} {lay} overhead vs {ceiling_of(f'{who} {lay}')} <= 3%{note}",
                overhead(f"{who} {lay}", ceiling_of(f"{who} {lay}"), counts))
        row(f"{who} 2x1 peak RSS per rank <= DDP's{note}", rss(f"{who} 2x1", "PyTorch DDP 2x1", counts))
    rows = (R.get("comm") or {}).get("rows") or []
    if rows:
        cells = []
        for name in R["models"]:
            r = min(rows, key=lambda r: abs(r["floats"] - R["models_def"][name]["params"]))
            share = r["polled_share_of_raw_bw"]
            cells.append(f"{100 * share:.0f}% ({r['floats'] / 1e6:.2f}M floats) {'met' if share >= 0.8 else '**not met**'}")
        out.append("| trainrun allreduce >= 80% of raw MPI bandwidth, same buffer | " + " | ".join(cells) + " |")
    mc = R.get("memcap") or {}
    if mc:
        cells = []
        for name in R["models"]:
            fit = memfit(mc.get(name), MEMORY_CAPS_MB.get(name))
            if not fit:
                cells.append("–")
                continue
            cap, a, b, c = fit["cap_mb"], fit.get("trainrun"), fit.get("ddp"), fit.get("off")
            ok = a is not None and b is not None and a >= b
            cells.append(f"{na(a, '{}')} vs {na(b, '{}')} at {cap:.0f} MB/rank {'met' if ok else '**not met**'} "
                         f"(levers off: {na(c, '{}')})")
        out.append("| largest micro-batch under a per-rank memory cap >= DDP's | " + " | ".join(cells) + " |")
    out.append("")


def linfit(points):
    """Least squares y = a + b x."""
    n = len(points)
    if n < 2:
        return None
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    d = n * sxx - sx * sx
    if not d:
        return None
    b = (n * sxy - sx * sy) / d
    return (sy - b * sx) / n, b


MEMORY_CAPS_MB = {"tiny": 1024, "mid": 2048}
MEM_WHO = {"trainrun": "trainrun", "off": "trainrun-off", "ddp": "PyTorch DDP"}


def memfit(rows, cap_mb=None):
    """Straight-line fits of peak RSS per rank against the micro-batch, and the largest micro-batch under a cap."""
    if not rows:
        return None
    fits = {}
    for who in MEM_WHO:
        pts = [(r["micro_batch"], max(x for x in r[who] if x is not None)) for r in rows if r.get(who)]
        fit = linfit(pts)
        if fit:
            fits[who] = fit
    if "trainrun" not in fits:
        return None
    cap_mb = cap_mb or 1024
    out = {"cap_mb": cap_mb, "fits": fits}
    for who, (a, b) in fits.items():
        out[who] = int((cap_mb - a) // b) if b > 0 else None
    return out


def variant_table(t, out):
    variants = t["variants"]
    first_name = next(iter(variants))
    first = variants[first_name]
    out.append(f"| variant | ms/step median [min–max] | speed vs {first_name} (median) | vs (min) |")
    out.append("|---|---|---|---|")
    for k, v in variants.items():
        out.append(f"| {k} | {v['median']:.1f} [{v['min']:.1f}–{v['max']:.1f}] | "
                   f"{first['median'] / v['median']:.3f}x | {first['min'] / v['min']:.3f}x |")
    out.append("")


def ranked_ops_table(columns: dict, headers: dict, rows: int, cell, out) -> None:
    """A table of each column's top ``rows`` ops (``columns[c]["ops"]``, ranked), one cell per op."""
    out.append("| rank | " + " | ".join(headers[c] for c in columns) + " |")
    out.append("|---|" + "---|" * len(columns))
    for i in range(rows):
        cells = [cell(c, columns[c]["ops"][i]) if i < len(columns[c]["ops"]) else "" for c in columns]
        out.append(f"| {i + 1} | " + " | ".join(cells) + " |")


def levers_section(R, out):
    out.append("The train graph alone (scripts/bench/levers.py: one Engine per variant in one process, steps "
               "interleaved, order reversed every round). `static` = trainrun's train graph, built for the "
               "micro-batch; `dynamic` = `--set engine.static_shapes=false` (symbolic batch/seq dims); "
               "`static@X` = the static graph with an onnxruntime session option changed: `nospin` no intra-op "
               "spinning, `basic`/`extended`/`disabled` graph optimization level (trainrun: all), `nomempattern`, "
               "`noarena`, `daz` denormals as zero.\n")
    for name, M in R["models"].items():
        lev = M.get("levers") or {}
        for key in ("t1", "t2"):
            t = lev.get(key)
            if not t:
                continue
            out.append(f"### {name}: train graph alone, {t['threads']} thread(s), micro-batch {t['micro_batch']}, "
                       f"{t['rounds']} interleaved rounds (load avg {t['loadavg'][0]:.1f})\n")
            variant_table(t, out)
        prof = lev.get("profile")
        if prof:
            out.append(f"### {name}: onnxruntime profile of the train graph, 1 thread (share of kernel time, "
                       f"kernel ms per step)\n")
            def cell(c, o):
                ms = o.get("ms_per_step", o["ms"] / max(1, prof[c].get("steps", 1)))
                return f"{o['op']} {pct(o['share'], 1)} ({ms:.1f} ms)"
            ranked_ops_table(prof, {c: f"{c} ({prof[c]['step_ms']:.0f} ms/step)" for c in prof}, 8, cell, out)
            out.append("")


def scaling_section(R, out):
    sc = R.get("scaling")
    if not sc:
        return
    out.append("### mid: which ops of the train graph scale from 1 to 2 threads (onnxruntime profiles, micro-batch "
               f"{R['models_def']['mid']['global_batch']})\n")
    ranked_ops_table(sc, {c: f"{c}: {sc[c]['ms_1t']:.0f} -> {sc[c]['ms_2t']:.0f} ms, x{sc[c]['speedup']:.2f}"
                          for c in sc}, 10,
                     lambda c, o: f"{o['op']} {o['ms_2t']:.0f} ms ({pct(o['share_2t'], 1)}), x{o['speedup'] or 0:.2f}",
                     out)
    out.append("\nEach cell: kernel time per step at 2 threads (share), and its speed-up from 1 thread.\n")


def runner_levers_section(R, out):
    rl = R.get("runner_levers")
    if not rl:
        return
    for name, block in rl.items():
        runs = block["runs"]
        out.append(f"### {name}: runner levers end to end (trainrun CLI, {block['rounds']} rounds; each lever alone "
                   f"against trainrun's defaults of the same layout, paired per round; every run starts from graphs "
                   f"prepared for it)\n")
        out.append("| setup | tokens/s median [min–max] | vs trainrun, same layout (paired) | step time shares | "
                   "foreign load |")
        out.append("|---|---|---|---|---|")
        for k, rs in runs.items():
            s = common.summarize(tps(rs))
            base = next(b for b in runs if b.split(":")[0] == k.split(":")[0])
            flag = " (re-prepared!)" if any(r.get("reprepared") for r in rs) else ""
            out.append(f"| {k}{flag} | {f0(s['median'])} [{f0(s['min'])}–{f0(s['max'])}] | "
                       f"{ratio_cell(paired(rs, runs[base])) if k != base else '1.00'} | {shares_cell(rs)} | {foreign(rs)} |")
        out.append("")
        out.append("`optimizer_kernel=graph`, `static_shapes=false`, `data.prefetch=0`: `--set engine.…` / "
                   "`--set data.prefetch=0`; `collective spin 0 s`: trainrun.comm.SPIN_S = 0 (a rank waiting in a "
                   "collective sleeps at once instead of spinning 0.2 s); `all sessions no spinning`: the train "
                   "session's intra-op pool does not spin either (the eval/optimizer sessions never do). The last "
                   "two through `scripts/bench/trainrun_rank.py --patch`.\n")


def components(R, out):
    comm = R.get("comm")
    if comm and comm.get("rows"):
        out.append("### Allreduce (2 ranks, float32 SUM, in place): `" + comm["cmd"].replace(str(common.ROOT) + "/", "")
                   + "`\n")
        out.append("| floats | raw MPI Allreduce ms (GB/s) | trainrun allreduce_ ms (GB/s) | trainrun / raw bandwidth | memcpy ms (GB/s) |")
        out.append("|---|---|---|---|---|")
        for r in comm["rows"]:
            out.append(f"| {r['floats'] / 1e6:.2f}M | {r['blocking_ms']:.2f} ({r['blocking_gbps']:.2f}) | "
                       f"{r['polled_ms']:.2f} ({r['polled_gbps']:.2f}) | {pct(r['polled_share_of_raw_bw'])} | "
                       f"{r['memcpy_ms']:.2f} ({r['memcpy_gbps']:.2f}) |")
        out.append("")
    fo = R.get("fastopt")
    if fo and fo.get("rules"):
        out.append(f"### Optimizer update: the ONNX optimizer graph vs trainrun's host kernel "
                   f"({fo.get('model', '?')} model's {fo['params'] / 1e6:.2f}M parameters, 1 flat buffer, graph session "
                   f"{fo['threads']} thread; interleaved, {fo.get('repeats', '?')} updates each; "
                   f"`scripts/bench/fastopt.py`)\n")
        out.append("| rule | graph ms median [min–max] | host ms median [min–max] | ms per M params graph / host | "
                   "host speed-up | max abs diff after 1 update | extra RSS MB graph / host |")
        out.append("|---|---|---|---|---|---|---|")
        for k, r in fo["rules"].items():
            g, h = r["graph"], r["host"]
            out.append(f"| {k} | {g['median']:.1f} [{g['min']:.1f}–{g['max']:.1f}] | {h['median']:.1f} "
                       f"[{h['min']:.1f}–{h['max']:.1f}] | {r['graph_ms_per_M']:.2f} / {r['host_ms_per_M']:.2f} | "
                       f"{r['speedup']:.2f}x | {r['max_diff']:.1e} | {r['graph_extra_rss_mb']:.0f} / "
                       f"{r['host_extra_rss_mb']:.1f} |")
        out.append(f"\nExtra RSS = resident memory added by the first update (the graph: session and its arena's "
                   f"full-size intermediates; the host kernel: none, or LAMB's one chunk-sized buffer); the parameter buffer is "
                   f"{fo['params'] * 4 / 2**20:.0f} MB. The max |difference| covers params and optimizer state "
                   f"(the host kernel mirrors the graph's float32 arithmetic; past a square root an ulp may differ).\n")
    data = R.get("data")
    if data and data.get("rows"):
        out.append(f"### Data loader (`scripts/bench_data.py`'s loader_rate(), {data['steps']} steps)\n")
        out.append("| micro-batch x seq | prefetch | batches/s | tokens/s | max RSS growth kB |")
        out.append("|---|---|---|---|---|")
        for r in data["rows"]:
            out.append(f"| {r['micro_batch']} x {r['seq_len']} | {r['prefetch']} | {r['batches_per_s']:,.0f} | "
                       f"{r['batches_per_s'] * r['micro_batch'] * r['seq_len']:,.0f} | {r['max_rss_growth_kb']} |")
        out.append("")
    mc = R.get("memcap")
    if mc:
        out.append("### Memory: peak RSS per rank (MB, max over the 2 ranks) against the micro-batch, 2x1, 3 steps\n")
        out.append("A per-rank cap on resident memory (what a cgroup memory limit enforces) is met while the peak RSS "
                   "stays below it; the largest micro-batch under the cap comes from a straight-line fit of peak RSS "
                   "against micro-batch (activations grow linearly with it). Each trainrun run starts from graphs "
                   "prepared for its micro-batch. `ulimit -v` is not used: it caps the virtual address space, which "
                   "both frameworks reserve far beyond what they touch (VmPeak below).\n")
        for name, rows in mc.items():
            out.append(f"{name}:\n")
            out.append("| micro-batch | trainrun RSS | trainrun-off RSS | PyTorch DDP RSS | trainrun VmPeak | DDP VmPeak |")
            out.append("|---|---|---|---|---|---|")
            for r in rows:
                mx = lambda v: "–" if not v else f"{max(x for x in v if x is not None):.0f}"  # noqa: E731
                out.append(f"| {r['micro_batch']}{' (re-prepared!)' if r.get('reprepared') else ''} | "
                           f"{mx(r.get('trainrun'))} | {mx(r.get('off'))} | {mx(r.get('ddp'))} | "
                           f"{mx(r.get('trainrun_vm'))} | {mx(r.get('ddp_vm'))} |")
            fit = memfit(rows, MEMORY_CAPS_MB.get(name))
            if fit:
                out.append("")
                out.append("Fit (MB = a + b x micro-batch): " + "; ".join(
                    f"{MEM_WHO[k]} a={v[0]:.0f}, b={v[1]:.1f}" for k, v in fit["fits"].items()) +
                    f". Largest micro-batch under {fit['cap_mb']:.0f} MB per rank: " +
                    ", ".join(f"{MEM_WHO[k]} {na(fit.get(k), '{}')}" for k in MEM_WHO) + ".")
            out.append("")


def _ratio(runs, a, b):
    v = paired(runs.get(a) or [], runs.get(b) or [])
    return statistics.median(v) if v else None


def _x(v):
    return na(v, "{:.2f}x")


def _phase(R, name, setup, phase):
    """(ms per step, share) of a trainrun phase: its median share x the median step time; (None, None) if unknown."""
    rs = (R["models"][name].get("runs") or {}).get(setup) or []
    t, sh = med(tps(rs)), shares(rs).get(phase)
    if not t or sh is None:
        return None, None
    return sh * R["models_def"][name]["tokens_per_step"] / t * 1e3, sh


def _lever(R, key):
    """A runner lever's tokens/s over trainrun's defaults of the same layout (tiny, paired), or None."""
    runs = ((R.get("runner_levers") or {}).get("tiny") or {}).get("runs") or {}
    return _ratio(runs, key, key.split(":")[0] + ": trainrun")


def _op_ms(block, op):
    return block.get(op) if block else None


MATMULS = ("MatMul", "FusedMatMul", "Gemm")


def _moved_ops(a, b, where, extra=lambda o: "") -> str:
    """The non-matmul ops whose share of the kernel time differs most between profile ``a`` (dynamic) and ``b``
    (static), as prose. Shares, not ms: a shared machine's load scales every op of a profile alike; the
    matmuls do the same work in both graphs and are left out."""
    ta, tb = sum(a.values()) or 1.0, sum(b.values()) or 1.0
    ops = sorted((o for o in set(a) | set(b) if o not in MATMULS),
                 key=lambda o: -abs(a.get(o, 0.0) / ta - b.get(o, 0.0) / tb))[:3]
    return (f"The non-matmul ops whose share of the kernel time changes most ({where}), dynamic -> static: " +
            "; ".join(f"`{o}` {pct(a.get(o, 0.0) / ta, 1)} -> {pct(b.get(o, 0.0) / tb, 1)} "
                      f"({a.get(o, 0.0):.1f} -> {b.get(o, 0.0):.1f} ms per step{extra(o)})" for o in ops) + ".")


def findings(R, out):
    """The measured reasons behind the targets, with the numbers of this run ('n/a': not measured in it)."""
    models = list(R["models"])
    out.append("## Findings\n")
    # 1. GELU: measured with the earlier version of the suite (the FastGelu form is gone from trainrun)
    used = sorted({op for n in models for rs in (R["models"][n].get("runs") or {}).values() for r in rs
                   for op in (r.get("gelu_ops") or [])})
    out.append(
        "1. **GELU.** trainrun's GPT-2 (trainrun/models/gpt2.py) writes gelu_new as `y * Sigmoid(y * (2k + "
        "2k*0.044715*y^2))` (y = x + bias, k = sqrt(2/pi); exactly `0.5 y (1 + tanh(k (y + 0.044715 y^3)))`) "
        "instead of com.microsoft.FastGelu, whose gradient kernel (`BiasFastGeluGrad_dX`) is a scalar loop on one "
        "thread: it took 21% (tiny) and 15% (mid) of the train graph's kernel time at 1 thread. The sigmoid form's "
        "gradient is SigmoidGrad and Mul/Add, vectorised and multi-threaded: the train graph was 1.17x (tiny) / "
        "1.12x (mid) faster at 1 thread and 1.26x / 1.14x at 2 threads, within 2e-6 of transformers' gelu_new "
        "(logits and gradients). ONNX opset-20 `Gelu(approximate=\"tanh\")` must not be used: onnxruntime 1.19's "
        "gradient builder gives it the erf derivative (gradient error 2.5e-4). Measured 2026-11-22 with the earlier "
        "version of this suite (FastGelu vs sigmoid graphs side by side; see the git history of BENCHMARKS.md); the "
        "GELU form has no switch, so this suite no longer times it. GELU ops in this run's train graphs: "
        f"{', '.join(used) or 'n/a'}.\n")
    # 2. optimizer
    fo = R.get("fastopt") or {}
    rules = fo.get("rules") or {}
    adamw = rules.get("adamw") or {}
    upd = "; ".join(f"{k} {r['graph']['median']:.1f} -> {r['host']['median']:.1f} ms ({r['speedup']:.2f}x)"
                    for k, r in rules.items()) or "n/a"
    diff = max((r["max_diff"] for r in rules.values()), default=None)
    pbytes = fo["params"] * 4 / 2**20 if fo.get("params") else None
    extra = adamw.get("graph_extra_rss_mb")
    phases = []
    for name in models:
        for lay in LAYOUTS:
            a, sa = _phase(R, name, f"trainrun {lay}", "optimizer")
            b, sb = _phase(R, name, f"trainrun-off {lay}", "optimizer")
            if a is not None or b is not None:
                phases.append(f"{name} {lay} {na(a, '{:.1f} ms')} ({pct(sa, 1) if sa is not None else 'n/a'}) vs "
                              f"{na(b, '{:.1f} ms')} ({pct(sb, 1) if sb is not None else 'n/a'})")
    out.append(
        "2. **Optimizer: host kernel vs graph.** With `engine.optimizer_kernel: auto` (host on the CPU) the update "
        "runs as trainrun.kernels.host.HostOptimizer: the rule's elementwise ops fused into one compiled loop over the "
        "flat buffers, in place, instead of graphs/optimizer.onnx, where every op is a pass over main memory with "
        "full-size intermediates. Per update at 1 thread on the "
        f"{fo.get('model', 'mid')} model's {na(fo.get('params') and fo['params'] / 1e6, '{:.2f}', 'M')} parameters "
        f"(Components): {upd}; params and state agree within {na(diff, '{:.0e}')}. The graph's session adds "
        f"{na(extra, '{:.0f} MB')} of resident memory on its first AdamW update "
        f"({na(extra / pbytes if extra is not None and pbytes else None, '{:.1f}', 'x')} the parameter bytes), the host "
        f"kernel {na(adamw.get('host_extra_rss_mb'), '{:.1f} MB')}. Optimizer phase per step, trainrun (host) vs "
        f"trainrun-off (graph): {'; '.join(phases) or 'n/a'}. End to end, the graph kernel alone switched back "
        f"(tiny, runner levers): 2x1 {_x(_lever(R, '2x1: optimizer_kernel=graph'))}, 1x2 "
        f"{_x(_lever(R, '1x2: optimizer_kernel=graph'))} of trainrun's tokens/s.\n")
    # 3. static shapes
    lev = []
    for name in models:
        for key in ("t1", "t2"):
            t = (R["models"][name].get("levers") or {}).get(key)
            v = (t or {}).get("variants") or {}
            if "static" in v and "dynamic" in v:
                lev.append(f"{name} {t['threads']} thread(s) {v['dynamic']['median'] / v['static']['median']:.2f}x")
    ceil = []
    for name in models:
        runs = R["models"][name].get("runs") or {}
        for lay in LAYOUTS:
            r = _ratio(runs, f"ceiling {lay}", f"ceiling-off {lay}")
            if r is not None:
                ceil.append(f"{name} {lay} {r:.2f}x")
    sc = R.get("scaling") or {}
    st, dy = sc.get("static"), sc.get("dynamic")
    scal = ""
    if st and dy and st.get("all") and dy.get("all"):
        a = {o: v[1] for o, v in dy["all"].items()}
        b = {o: v[1] for o, v in st["all"].items()}
        speed = {k: {o: (v[0] / v[1] if v[1] else None) for o, v in blk["all"].items()} for k, blk in (("d", dy), ("s", st))}
        scal = (f" From 1 to 2 threads (mid, micro-batch {R['models_def']['mid']['global_batch']}, profiles in Levers) the "
                f"dynamic graph speeds up x{dy['speedup']:.2f}, the static one x{st['speedup']:.2f}. "
                + _moved_ops(a, b, "2 threads", lambda o: f", x{na(speed['d'].get(o))} -> x{na(speed['s'].get(o))} "
                                                            "from 1 to 2 threads"))
    else:
        prof = next(((n, p) for n in models for p in [(R["models"][n].get("levers") or {}).get("profile") or {}]
                     if (p.get("static") or {}).get("all_ms_per_step") and (p.get("dynamic") or {}).get("all_ms_per_step")),
                    None)
        if prof:
            name, p = prof
            scal = " " + _moved_ops(p["dynamic"]["all_ms_per_step"], p["static"]["all_ms_per_step"],
                                    f"1 thread, {name}") + " (1 -> 2 thread scaling of the mid model: n/a in this run.)"
        else:
            scal = " Per-op profiles: n/a in this run."
    out.append(
        "3. **Static shapes.** With `engine.static_shapes` (default on) `trainrun prepare` fixes the train graph's "
        "data inputs to [micro_batch, seq_len] before the gradient builder runs, so it emits reductions over known "
        "axes instead of runtime shape arithmetic, and onnxruntime plans memory statically. Speed of the static "
        f"train graph over the dynamic one, alone (levers tables, interleaved): {', '.join(lev) or 'n/a'}; as the "
        f"ceiling (2x1: the same processes; 1x2: paired rounds): {', '.join(ceil) or 'n/a'}.{scal} End to end, the "
        f"dynamic graph alone switched back (tiny, runner levers): 2x1 {_x(_lever(R, '2x1: static_shapes=false'))}, "
        f"1x2 {_x(_lever(R, '1x2: static_shapes=false'))} "
        "of trainrun's tokens/s. The price: a graphs folder fits one micro-batch and sequence length; trainrun "
        "re-prepares (before step 1) when a run's differ.\n")
    # 4. 2x1 overhead vs the ceiling
    rows = (R.get("comm") or {}).get("rows") or []
    parts = []
    for name in models:
        runs = R["models"][name].get("runs") or {}
        of = _ratio(runs, "trainrun 2x1", "ceiling 2x1")
        bits = [f"trainrun at {_x(of)} of its ceiling (paired)",
                f"ceiling / DDP {_x(_ratio(runs, 'ceiling 2x1', 'PyTorch DDP 2x1'))}",
                f"trainrun / DDP {_x(_ratio(runs, 'trainrun 2x1', 'PyTorch DDP 2x1'))}"]
        ph = {k: _phase(R, name, "trainrun 2x1", k) for k in ("allreduce", "optimizer", "norm", "data")}
        raw = min(rows, key=lambda r: abs(r["floats"] - R["models_def"][name]["params"]))["blocking_ms"] if rows else None
        bits.append("phases per step: " + ", ".join(
            f"{k} {na(v[0], '{:.1f} ms')}" + (f" (raw MPI allreduce of the buffer {na(raw, '{:.1f} ms')})"
                                                if k == "allreduce" else "")
            for k, v in ph.items()))
        parts.append(f"{name}: " + "; ".join(bits))
    out.append(
        "4. **2 ranks x 1 thread: overhead vs the ceiling.** " + (". ".join(parts) or "n/a") + ". The allreduce "
        "phase includes waiting for the slower rank; with `SPIN_S = 0` (ranks sleep at once while waiting) tiny runs "
        f"at {_x(_lever(R, '2x1: collective spin 0 s'))} of trainrun's tokens/s. What is left: none of the allreduce "
        "overlaps the backward pass (the train graph is one onnxruntime run that hands back all gradients at its "
        "end, whereas DDP allreduces gradient buckets while the backward pass still runs: splitting the train graph "
        "would let the last layers' gradients travel during the first layers' backward), and the optimizer and the "
        "gradient norm run in full on every rank: ZeRO-1 (reduce-scatter, update a shard, allgather) is not built "
        "(`distributed.zero_stage: 1` is refused by the config check). The overhead ratios swing by several percent "
        "between rounds (see the [min–max]): a rank slowed for a moment stalls both at the allreduce, which the "
        "unsynchronised ceiling never pays, so a 3% bound is at the edge of what a shared 2-core machine resolves.\n")
    # 5. memory
    mc = R.get("memcap") or {}
    bits = []
    for name, mrows in mc.items():
        fit = memfit(mrows, MEMORY_CAPS_MB.get(name))
        if not fit:
            continue
        f = fit["fits"]
        a = lambda k, i: na(f[k][i], "{:.0f}" if i == 0 else "{:.1f}") if k in f else "n/a"  # noqa: E731
        bits.append(f"{name}: fixed part trainrun {a('trainrun', 0)} MB, trainrun-off {a('off', 0)}, DDP {a('ddp', 0)}; "
                    f"per sequence of the micro-batch trainrun {a('trainrun', 1)} MB, trainrun-off {a('off', 1)}, DDP "
                    f"{a('ddp', 1)}; largest micro-batch under {fit['cap_mb']} MB per rank trainrun "
                    f"{na(fit.get('trainrun'), '{}')}, trainrun-off {na(fit.get('off'), '{}')}, DDP {na(fit.get('ddp'), '{}')}")
    rss = []
    for name in models:
        runs = R["models"][name].get("runs") or {}
        x, y, z = (max_rss(runs.get(k) or []) for k in ("trainrun 2x1", "trainrun-off 2x1", "PyTorch DDP 2x1"))
        if x or y or z:
            rss.append(f"{name} {na(x, '{:.0f}')} / {na(y, '{:.0f}')} / {na(z, '{:.0f}')} MB")
    alone = []
    for name in models:
        runs = R["models"][name].get("runs") or {}
        x, y = max_rss(runs.get("ceiling 1x2") or []), max_rss(runs.get("ceiling-off 1x2") or [])
        if x or y:
            alone.append(f"{name} {na(x, '{:.0f}')} vs {na(y, '{:.0f}')} MB")
    out.append(
        "5. **Memory (peak RSS per rank during training, 2x1).** Peak RSS trainrun / trainrun-off / DDP in the runs "
        f"above: {', '.join(rss) or 'n/a'}. Against the micro-batch (Components): {'; '.join(bits) or 'n/a'}. "
        "trainrun's fixed part is the flat buffers (parameters, gradients, 2 AdamW moments: 16 bytes per parameter), "
        "the libraries and the sessions. Two things separate it from trainrun-off's: the host kernel has no "
        f"optimizer session, whose arena holds full-size intermediates ({na(extra, '+{:.0f} MB')} on mid's first "
        "AdamW update, Components); and the train graph itself: alone in one process (ceiling 1x2, micro-batch = "
        f"global batch), peak RSS static vs dynamic graph {', '.join(alone) or 'n/a'}. The optimizer has "
        "no per-sequence part, so the per-sequence slopes of trainrun and trainrun-off compare the static and the "
        "dynamic train graph (what onnxruntime keeps alive for the backward pass). The end-of-run checkpoint "
        "snapshot and (rank 0) the export come after training and are left out (PyTorch's script saves nothing); "
        "the whole-run peaks are in results.json (run_peak_rss_mb).\n")
    # 6. 1 process x 2 threads
    p1 = []
    for name in models:
        runs = R["models"][name].get("runs") or {}
        if runs:
            p1.append(f"{name} {_x(_ratio(runs, 'trainrun 1x2', 'PyTorch 1x2'))} of PyTorch, "
                      f"{_x(_ratio(runs, 'trainrun 1x2', 'ceiling 1x2'))} of its ceiling "
                      f"(trainrun-off {_x(_ratio(runs, 'trainrun-off 1x2', 'PyTorch 1x2'))} of PyTorch)")
    out.append(
        "6. **1 process x 2 threads.** trainrun 1x2: " + ("; ".join(p1) or "n/a") + ". The eval and optimizer "
        "sessions run without spinning (their pools no longer compete with the train session's threads after each "
        "short run; with the host kernel the optimizer session does not exist). Switching spinning off for the train "
        f"session too: {_x(_lever(R, '1x2: all sessions no spinning'))}; without data prefetch (`data.prefetch=0`): "
        f"{_x(_lever(R, '1x2: data.prefetch=0'))} of trainrun's tokens/s (tiny, runner levers).\n")


def cnn_section(R, out):
    """scripts/bench/cnn.py's results: SqueezeNet 1.1 on the digits, trainrun vs PyTorch DDP 2x1 (target >= 1.0x)."""
    c = R.get("cnn")
    if not c:
        return
    ratio = c["median_ratio"]
    out.append("## A CNN (SqueezeNet 1.1 on the digits) vs PyTorch DDP\n")
    out.append(f"`scripts/bench/cnn.py`: configs/squeezenet-digits.yaml's network (scripts/squeezenet_digits.py: fire "
               f"modules, BatchNorm, 32x32 inputs, 10 classes), global batch 64 (32 a rank), 2 ranks x 1 thread: "
               f"`mpirun -np 2 trainrun` against the same network in PyTorch under DDP (gloo, torchrun, its default "
               f"BatchNorm buffer broadcast), same initial weights, same batches, AdamW + clipping at 1.0; "
               f"{c['timed_steps']} timed steps after {c['steps'] - c['timed_steps']} untimed, rounds alternating. "
               f"Run started {c.get('started', '?')}; 1-minute load average {na(c.get('loadavg'), '{:.1f}')}.\n")
    out.append("| round | trainrun samples/s | PyTorch DDP samples/s | trainrun / DDP |")
    out.append("|---|---|---|---|")
    for i, (a, d) in enumerate(zip(c["trainrun_samples_per_s"], c["ddp_samples_per_s"])):
        out.append(f"| {i + 1} | {a:,.0f} | {d:,.0f} | {a / d:.2f} |")
    out.append("")
    out.append(f"**Target trainrun 2x1 >= 1.0x PyTorch DDP 2x1: {ratio:.2f}x (median of rounds) "
               f"{'met' if ratio >= 1.0 else '**not met**'}.**\n")
    if c.get("profile"):
        out.append("trainrun's onnxruntime profile (`trainrun profile summarize`, 40-step run): the convolution "
                   "kernels lead\n")
        text = re.sub(r"(rank\(s\)): \S+", r"\1", c["profile"].strip())
        out.append("```\n" + text + "\n```\n")


def bert_section(R, out):
    """scripts/bench/bert.py's results: bert-tiny, trainrun vs PyTorch DDP 2x1 (the target >= 1.2x)."""
    b = R.get("bert")
    if not b:
        return
    s = b["shape"]
    ratio = b["median_ratio"]
    out.append("## BERT pre-training vs PyTorch DDP\n")
    out.append(f"`scripts/bench/bert.py`: configs/bert-tiny.yaml (BertForPreTraining, {s['num_hidden_layers']} layers, "
               f"hidden {s['hidden_size']}, {s['num_attention_heads']} heads, WordPiece {s['vocab_size']}, erf GELU, "
               f"no dropout), seq {b['seq_len']}, 20 predictions a sample, global batch {b['global_batch']} "
               f"({b['global_batch'] // 2} a rank), 2 ranks x 1 thread: `mpirun -np 2 trainrun` against transformers' "
               f"`BertForPreTraining` under DDP (gloo, torchrun), same initial weights, same batches (data.shuffle "
               f"off), AdamW + clipping at 1.0 on all; {b['timed_steps']} timed steps after "
               f"{b['steps'] - b['timed_steps']} untimed, rounds alternating the setups. trainrun runs the MLM head "
               f"at the masked positions only, as ORT's and NVIDIA's BERT do; PyTorch runs transformers' model as a "
               f"user gets it (the head at every position) and, like for like, the same modules with the head at "
               f"the masked positions only (\"masked head\"). Run started {b.get('started', '?')}; 1-minute load average "
               f"{na(b.get('loadavg'), '{:.1f}')} at its end.\n")
    masked = b.get("ddp_masked_head_tokens_per_s") or [None] * len(b["ddp_tokens_per_s"])
    out.append("| round | trainrun tokens/s | PyTorch DDP tokens/s | trainrun / DDP | PyTorch DDP, masked head, "
               "tokens/s | trainrun / DDP masked head |")
    out.append("|---|---|---|---|---|---|")
    for i, (a, d, m) in enumerate(zip(b["trainrun_tokens_per_s"], b["ddp_tokens_per_s"], masked)):
        out.append(f"| {i + 1} | {a:,.0f} | {d:,.0f} | {a / d:.2f} | {na(m, '{:,.0f}')} | "
                   f"{na(a / m if m else None)} |")
    out.append("")
    fl = b.get("final_loss") or {}
    like = b.get("median_masked_head_ratio")
    out.append(f"**Target trainrun 2x1 >= 1.2x PyTorch DDP 2x1: {ratio:.2f}x (median of rounds) "
               f"{'met' if ratio >= 1.2 else '**not met**'}**; like for like (masked head): {na(like, '{:.2f}x')}"
               f"{'' if like is None else (' met' if like >= 1.2 else ' **not met**')}. Final loss (last round, step "
               f"{b['steps']}): trainrun {na(fl.get('trainrun'), '{:.4f}')}, DDP {na(fl.get('ddp'), '{:.4f}')}, "
               f"DDP masked head {na(fl.get('ddp_masked_head'), '{:.4f}')} (same start and data).\n")
    co = b.get("compute_only_ms")
    if co:
        out.append(f"Forward + backward alone (1 thread, one process, the three interleaved step by step so that "
                   f"load hits them alike; median ms a step, micro-batch {b['global_batch'] // 2}): trainrun "
                   f"{co['trainrun']:.1f}, transformers {co['torch']:.1f} ({co['torch'] / co['trainrun']:.2f}x "
                   f"trainrun's), masked head {co['torch_masked_head']:.1f} "
                   f"({co['torch_masked_head'] / co['trainrun']:.2f}x).\n")
    if b.get("profile"):
        out.append("trainrun's onnxruntime profile (`trainrun profile summarize`, steps 30-34):\n")
        text = re.sub(r"(rank\(s\)): \S+", r"\1", b["profile"].strip())       # (the run folder)
        out.append("```\n" + text + "\n```\n")


def render(R) -> str:
    m = R.get("machine", {})
    v = m.get("versions", {})
    out = ["# trainrun benchmarks", ""]
    out.append("Generated by `scripts/bench/run.py` (`make bench` runs it through `scripts/bench.py`); "
               "do not edit by hand, except the stand-alone measurements at the end (between the "
               "`by hand` markers), which re-rendering keeps. Regenerate:\n")
    out.append("```\nmake bench                                   # full suite (~20 min on 2 cores)\n"
               ".venv/bin/python scripts/bench/run.py --quick   # ~5 min, 1 round, fewer steps\n"
               ".venv/bin/python scripts/bench/run.py --render  # re-write this file from runs/bench/results.json\n```\n")
    out.append(f"Mode **{R.get('mode')}**, started {R.get('started')}, took {R.get('duration_s', '?')} s. "
               f"Dataset `{R.get('dataset')}` (Python stdlib sources, byte-level BPE 1024).\n")
    out.append(f"Machine: {m.get('cpu')} ({m.get('hypervisor', '?')} guest), {m.get('cores')} cores ({m.get('simd', '')}), "
               f"{m.get('memory_gb')} GB; {m.get('platform')}; Python {m.get('python')}; onnxruntime-training "
               f"{v.get('onnxruntime')}, onnx {v.get('onnx')}, numpy {v.get('numpy')}, torch {v.get('torch')}, "
               f"transformers {v.get('transformers')}, mpi4py {v.get('mpi4py')}, MPICH {v.get('mpich')}.\n")
    la = [x[1] for x in R.get("load", [])]
    if la:
        out.append(f"The machine is shared: 1-minute load average {min(la):.1f}–{max(la):.1f} during the run "
                   f"(median {statistics.median(la):.1f}; {m.get('cores')} cores). Every run records the CPU time "
                   f"used by processes outside it (\"foreign load\", in cores); rounds alternate the setups so that "
                   f"load hits them alike, and ratios are taken between runs of the same round.\n")
    pk, pk2 = R.get("peak"), R.get("peak_end")
    if pk:
        out.append("Peak float32 FLOP/s, measured in this run (2048^3 matmul, best of repeats; start / end of the run): "
                   + "; ".join(f"{k.replace('_t', ' ').replace('onnxruntime', 'onnxruntime MatMul').replace('torch', 'torch.mm')} thread(s) "
                               f"{pk[k]['best_gflops']:.0f}" + (f" / {pk2[k]['best_gflops']:.0f}" if pk2 and k in pk2 else "")
                               for k in pk if k.startswith(("onnxruntime_t", "torch_t")))
                   + f" GFLOP/s. **MFU is against {f0(peak_gflops(R))} GFLOP/s** (all cores).\n")
    off = (R.get("off") or {}).get("sets") or []
    out.append("**trainrun** = trainrun's CLI with its defaults (the train graph built for the micro-batch, the host "
               "optimizer kernel). **trainrun-off** = the same CLI with "
               f"`{' '.join('--set ' + s for s in off) or '(no --set)'}`: trainrun's speed levers that have a switch, "
               "off (the ONNX optimizer graph instead of the host kernel, the train graph with symbolic batch/seq "
               "dims). The sigmoid GELU and the eval/optimizer sessions without spinning came with them and have no "
               "switch, so trainrun-off is not trainrun's old code. **ceiling** = trainrun's train graph alone in a "
               "loop (no data, allreduce, norm or optimizer); **ceiling-off** = the same on trainrun-off's graph. "
               "Every run starts from graphs prepared for its micro-batch.\n")
    out.append("## Targets\n")
    targets(R, out)
    gpt2_124m_section(R, out)
    out.append("## trainrun vs PyTorch vs the ceiling\n")
    out.append("Layouts: **2x1** = 2 processes x 1 thread (trainrun: `mpirun -np 2`, PyTorch: DDP gloo via torchrun); "
               "**1x2** = 1 process x 2 threads. tokens/s = timed tokens / timed wall time (all ranks; warm-up excluded); "
               "'best window' = median over runs of the fastest window of warm-up-many steps (less sensitive to other "
               "jobs). Ratios are medians of per-round ratios [min–max]. 'of ceiling, same graph': trainrun against "
               "ceiling, trainrun-off against ceiling-off. Step time shares: trainrun's own phase timer "
               "(metrics.jsonl's phase_ms over the timed steps; older results: summary.json, warm-up included); PyTorch's from the benchmark script (DDP's allreduce overlaps "
               "the backward pass); medians per phase over the runs, so they need not add up to 100%.\n")
    for name in R["models"]:
        model_section(R, name, out)
    cmds = {}
    for name, M in R["models"].items():
        for k, rs in (M.get("runs") or {}).items():
            if rs and rs[0].get("cmd"):
                cmds.setdefault(k, rs[0]["cmd"])
    if cmds:
        out.append("Commands (first model, first round; the data path, output folder and shapes come from `--set`; "
                   "each trainrun run's folder starts with a copy of the graphs prepared for it by `trainrun prepare` "
                   "with the same config and `--set`s):\n")
        out.append("```")
        for k, c in cmds.items():
            out.append(f"# {k}\n{c.replace(str(common.ROOT) + '/', '')}")
        out.append("```\n")
    bert_section(R, out)
    cnn_section(R, out)
    findings(R, out)
    out.append("## Levers\n")
    levers_section(R, out)
    scaling_section(R, out)
    runner_levers_section(R, out)
    out.append("## Components\n")
    components(R, out)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- GPT-2 124M (issue 17's targets)
BEGIN_124M, END_124M = "<!-- gpt2-124m: begin -->", "<!-- gpt2-124m: end -->"
LOADED_CORES = 0.2       # median foreign load (cores) above which the section is labelled as run on a loaded machine


def _best(*vals):
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _mach_figures(G):
    """(GEMM peak GFLOP/s, memcpy GB/s, MPI allreduce GB/s): the best of the section's start and end."""
    peaks, mem, mpi = [], [], []
    for when in ("machine_start", "machine_end"):
        f = G.get(when) or {}
        p = f.get("peak")
        if p:        # 2 ranks x 1 thread run on single-thread GEMMs: cores x the 1-thread peak counts too
            peaks += [p.get("peak_gflops"), p["cores"] * p["peak_gflops_1core"] if p.get("peak_gflops_1core") else None]
        for r in (f.get("comm") or {}).get("rows") or []:
            mem.append(r.get("memcpy_gbps"))
            mpi.append(r.get("blocking_gbps"))
    return _best(*peaks), _best(*mem), _best(*mpi)


def _med_of(runs, key):
    return med([r.get(key) for r in runs])


def _rss_max(runs, key):
    vals = [max(r[key]) for r in runs if r.get(key)]
    return max(vals) if vals else None


def _reduce_ms(run):
    """The run's gradient reduction phase (``allreduce``; any phase named *reduce*), median ms a step."""
    ph = run.get("phase_ms") or {}
    vals = [v for k, v in ph.items() if "reduce" in k]
    return sum(vals) if vals else None


def gpt2_124m_section(R, out):
    """scripts/bench/gpt2_124m.py's results: the targets of issue 17 at GPT-2 124M, all setups of one run."""
    G = R.get("gpt2-124m")
    if not G:
        return
    md, mach = G["model"], G.get("machine", {})
    cpu = mach.get("cpu", "?")
    runs, setups = G["runs"], G.get("setups", {})
    peak, memcpy, mpi_bw = _mach_figures(G)
    params, tps_step = md["params"], md["tokens_per_step"]
    grad_mb = 4 * params / 1e6
    loads = [r.get("foreign_cpu_cores") for rs in runs.values() for r in rs if r.get("foreign_cpu_cores") is not None]
    load = med(loads)
    loaded = load is not None and load > LOADED_CORES
    before = next((k for k, v in setups.items() if v.get("code") == "before"), None)
    ddp = next((k for k, v in setups.items() if v.get("code") == "ddp"), None)
    current = [k for k, v in setups.items() if v.get("code") == "current"]
    ex = next((rs[0]["cmd"] for k, rs in runs.items() if k in current and rs), "")
    out.append(BEGIN_124M)
    out.append(f"## GPT-2 {md['n_layer']} x {md['n_embd']} ({params / 1e6:.1f}M parameters): issue 17's targets\n")
    if loaded:
        out.append(f"**Run on a loaded machine** (processes outside the runs used a median {load:.2f} cores of "
                   f"{mach.get('cores')} during them): the figures are not representative; re-run "
                   f"`make bench-124m` on a quiet machine.\n")
    again = sorted({k for k, rs in runs.items() for r in rs if r.get("reprepared")})
    if again:
        out.append(f"**Re-prepared inside the run** (its graphs folder did not fit: the whole-run memory and "
                   f"wall time include a prepare): {', '.join(again)}.\n")
    out.append(f"`make bench-124m` (= `.venv/bin/python scripts/bench/run.py --only {'gpt2-124m'}`, "
               f"scripts/bench/gpt2_124m.py), started {G.get('started')}, took {G.get('duration_s', '?')} s. "
               f"GPT-2 {md['n_layer']} layers x {md['n_embd']}, {md['n_head']} heads, vocab {md['vocab_size']}, "
               f"seq {md['seq_len']}, micro-batch {md['global_batch'] // G['ranks']} per rank, AdamW, "
               f"{G['ranks']} ranks x {G['threads_per_rank']} thread; {md['warmup']} warm-up steps then "
               f"{md['steps']} measured steps per run, {G['rounds']} round(s), setups in a rotated order per round. "
               f"Data: {G.get('dataset')}. Machine: **{cpu}** ({mach.get('cores')} cores, {mach.get('simd', '')}, "
               f"{mach.get('memory_gb')} GB; median foreign load during the runs {na(load)} cores).\n")
    out.append(f"Setups: trainrun of this checkout ({', '.join(current)}; `distributed.intra_node` "
               f"{'exists and is' if G.get('intra_node_key') else 'does not exist in this checkout, so it is not'} "
               f"varied); **main before issue 17** = commit `{G['before']}`'s trainrun package and "
               f"configs/gpt2-tiny.yaml (`git archive`), run with the same venv, graphs prepared by its own "
               f"`trainrun prepare`; **PyTorch DDP** = scripts/bench/torch_train.py (transformers GPT-2, gloo, "
               f"same data and initial weights). Every trainrun run: `{ex}` (the `--set`s of the setup added; "
               f"WORK = runs/bench/gpt2-124m; the end-of-run checkpoint and export included).\n")
    out.append(f"Measured in this run: GEMM peak **{na(peak, '{:.0f}')} GFLOP/s** (scripts/bench/peak.py: 2048^3 "
               f"matmul, onnxruntime and torch, the best of all cores at once and {mach.get('cores')} x one core, "
               f"best of repeats at the start and the end); memcpy of a "
               f"{grad_mb:.0f} MB buffer on both ranks at once **{na(memcpy)} GB/s**, MPI allreduce of it "
               f"{na(mpi_bw)} GB/s (scripts/bench_comm.py, best of start and end).\n")

    def tgt(label, rows):
        for setup, measured, ok in rows:
            out.append(f"| {label} | {setup} | {measured} | "
                       f"{'–' if ok is None else ('yes' if ok else '**no**')} |")

    out.append("### Targets (steady state: the steps after the warm-up)\n")
    out.append("| target | setup | measured | met |")
    out.append("|---|---|---|---|")
    tgt("time outside forward/backward <= 5% of the steady step", [
        (k, pct(_med_of(runs[k], "outside_share"), 1), None if _med_of(runs[k], "outside_share") is None
         else _med_of(runs[k], "outside_share") <= 0.05) for k in current])
    rows, shares = [], []
    for k in current:
        t = _med_of(runs[k], "tokens_per_sec")
        fl = None if t is None else t * md["flops_per_token"] / 1e9
        share = None if fl is None or not peak else fl / peak
        shares.append(share)
        rows.append((k, f"{na(fl, '{:.0f}')} GFLOP/s = {pct(share)} of {na(peak, '{:.0f}')}",
                     None if share is None else share >= 0.8))
    tgt("model FLOP/s >= 80% of the GEMM peak of the same run", rows)
    if any(sh is not None and sh > 1 for sh in shares):
        out.append("| (above 100%: the GEMM peak was measured low, under load) | | | |")
    for other, goal, label in ((before, 1.15, f"tokens/s >= 1.15x main before issue 17 ({G['before']})"),
                               (ddp, 1.25, "tokens/s >= 1.25x PyTorch DDP")):
        rows = []
        for k in current:
            v = paired(runs[k], runs.get(other, []))
            r = statistics.median(v) if v else None
            rows.append((k, f"{na(r, '{:.2f}x')} ({na(_med_of(runs[k], 'tokens_per_sec'), '{:.0f}')} vs "
                            f"{na(_med_of(runs.get(other, []), 'tokens_per_sec'), '{:.0f}')} tokens/s; {cpu})",
                         None if r is None else r >= goal))
        tgt(label, rows)
    rows = []
    for k in current:
        ms = med([_reduce_ms(r) for r in runs[k]])
        bw = None if not ms else grad_mb / ms
        share = None if bw is None or not memcpy else bw / memcpy
        rows.append((k, f"{na(bw)} GB/s ({grad_mb:.0f} MB in {na(ms, '{:.0f}')} ms) = {pct(share)} of memcpy "
                        f"{na(memcpy)} GB/s", None if share is None else share >= 0.6))
    tgt("gradient reduction >= 60% of the memcpy bandwidth of the same run", rows)
    tgt("parameters + AdamW moments about 12 bytes per parameter per node", [
        (k, f"{setups[k]['bytes_per_param_per_node']['total']} B (computed)",
         setups[k]["bytes_per_param_per_node"]["total"] <= 12) for k in current])
    d_tr, d_run = _rss_max(runs.get(ddp, []), "train_rss_mb"), _rss_max(runs.get(ddp, []), "run_rss_mb")
    rows = []
    for k in current:
        a, b = _rss_max(runs[k], "train_rss_mb"), _rss_max(runs[k], "run_rss_mb")
        ok = None if None in (a, b, d_run) else (b <= d_run)
        rows.append((k, f"training {na(a, '{:.0f}')}, whole run {na(b, '{:.0f}')} vs DDP {na(d_run, '{:.0f}')} MB "
                        f"(max over ranks)", ok))
    tgt("peak RSS per rank <= DDP's (whole run: checkpoint and export included)", rows)
    out.append("")
    out.append("Bytes per parameter per node are computed from the setup's config, not measured: float32 "
               "parameters on every rank (4 x ranks), once per node on the shared intra-node path (4); AdamW's "
               "float32 m and v on every rank (8 x ranks) or one part per rank with ZeRO-1 or the shared path "
               "at any stage (8); the sizes the ranks hold are checked by tests/test_shared.py and test_zero.py; "
               f"{G['ranks']} ranks on the node. Gradients (4 B per parameter per rank) are not counted. "
               "Ratios are medians of per-round ratios (the runs of one round ran next to each other).\n")

    out.append("### Every setup (steady state; whole run apart)\n")
    out.append("| setup | tokens/s (steady, median of steps) | step ms | outside fwd/bwd | phases ms (median) | "
               "model GFLOP/s (of peak) | grad reduction GB/s (of memcpy) | peak RSS MB per rank: training / whole run "
               "| params+moments B/param/node | whole run: wall s, tokens/s (summary.json) | final loss | "
               "foreign load (cores) |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k, rs in runs.items():
        if not rs:
            continue
        t = _med_of(rs, "tokens_per_sec")
        fl = None if t is None else t * md["flops_per_token"] / 1e9
        ms = med([_reduce_ms(r) for r in rs])
        bw = None if not ms else grad_mb / ms
        phase = {}
        for r in rs:
            for p, v in (r.get("phase_ms") or {}).items():
                phase.setdefault(p, []).append(v)
        if not phase and rs[0].get("phase_shares"):        # DDP: shares of its timed steps
            ph = ", ".join(f"{p} {pct(med([r['phase_shares'].get(p) for r in rs]))}"
                           for p in rs[0]["phase_shares"])
        else:
            ph = ", ".join(f"{p} {statistics.median(v):.0f}" for p, v in
                           sorted(phase.items(), key=lambda kv: -statistics.median(kv[1])))
        tr = "; ".join("/".join(f"{x:.0f}" for x in r["train_rss_mb"]) for r in rs if r.get("train_rss_mb"))
        wr = "; ".join("/".join(f"{x:.0f}" for x in r["run_rss_mb"]) for r in rs if r.get("run_rss_mb"))
        bpp = (setups.get(k) or {}).get("bytes_per_param_per_node") or {}
        whole = "; ".join(f"{r.get('wall_s', 0):.0f} s, {na(r.get('whole_run_tokens_per_sec'), '{:.0f}')}"
                          for r in rs)
        per_round = ", ".join(f"{r['tokens_per_sec']:.0f}" for r in rs if r.get("tokens_per_sec"))
        err = "; ".join(r["error"] for r in rs if r.get("error"))
        out.append(f"| {k} | {na(t, '{:.0f}')}" + (f" ({per_round})" if len(rs) > 1 else "") +
                   (f" failed: {err}" if err else "") + " | " +
                   f"{na(_med_of(rs, 'step_ms'), '{:.0f}')} | {pct(_med_of(rs, 'outside_share'), 1)} | {ph or '–'} | "
                   f"{na(fl, '{:.0f}')} ({pct(None if fl is None or not peak else fl / peak)}) | "
                   f"{na(bw)} ({pct(None if bw is None or not memcpy else bw / memcpy)}) | "
                   f"{tr or '–'} / {wr or '–'} | {bpp.get('total', '–')} | "
                   f"{'(DDP: no checkpoint, no export) ' if k == ddp else ''}{whole} | "
                   f"{na(_med_of(rs, 'final_loss'), '{:.4f}')} | {na(med([r.get('foreign_cpu_cores') for r in rs]))} |")
    out.append("")
    out.append("Steady tokens/s: trainrun = median of metrics.jsonl's per-step tokens/s after the warm-up (log_every 1); "
               "DDP = tokens a step / median step time of its timed steps. Phases: trainrun's `phase_ms` (rank 0; for "
               "the commit before issue 17, which does not log it, the same per-step phase times taken by "
               "scripts/bench/trainrun_rank.py `--phases`); DDP's forward/backward/clip/optimizer shares (its "
               "allreduce overlaps the backward pass). Model FLOP/s = nanoGPT's count "
               f"({md['flops_per_token'] / 1e6:.0f} MFLOP per token: 6 x matmul parameters + 12 x layers x seq x d) x "
               "steady tokens/s. Gradient reduction = 4 bytes x parameters / the `allreduce` phase (a reduce-scatter "
               "with ZeRO-1; the phases named *reduce*, added up). Whole run: the command's wall time (start-up, graph loading, checkpoint and export "
               "included) and summary.json's tokens/s.\n")
    cmds = {k: rs[0]["cmd"] for k, rs in runs.items() if rs and rs[0].get("cmd")}
    if cmds:
        out.append("Commands (first round):\n")
        out.append("```")
        for k, c in cmds.items():
            out.append(f"# {k}\n{c}")
        out.append("```\n")
    out.append(END_124M)
    out.append("")


BEGIN_HAND, END_HAND = "<!-- by hand: begin -->", "<!-- by hand: end -->"


def keep_by_hand(old: str, new: str) -> str:
    """``new`` (a rendered BENCHMARKS.md) with ``old``'s hand-kept part (the stand-alone scripts'
    figures, between the ``by hand`` markers) appended."""
    if BEGIN_HAND not in old or END_HAND not in old:
        return new
    part = old.split(BEGIN_HAND, 1)[1].split(END_HAND, 1)[0]
    return new.rstrip("\n") + "\n\n" + BEGIN_HAND + part + END_HAND + "\n"


def splice_124m(text: str, R) -> str:
    """``text`` (a BENCHMARKS.md) with its GPT-2 124M section replaced by (or, if it has none, given) this one."""
    part: list = []
    gpt2_124m_section(R, part)
    new = "\n".join(part)
    if BEGIN_124M in text and END_124M in text:
        head, rest = text.split(BEGIN_124M, 1)
        return head + new.rstrip("\n") + rest.split(END_124M, 1)[1]
    anchor = "## trainrun vs PyTorch vs the ceiling"
    if anchor in text:
        head, rest = text.split(anchor, 1)
        return head + new + "\n" + anchor + rest
    return text.rstrip("\n") + "\n\n" + new + "\n"


if __name__ == "__main__":
    print(render(common.read_json(sys.argv[1] if len(sys.argv) > 1 else common.ROOT / "runs" / "bench" / "results.json")))
