"""Renders runs/bench/results.json (written by run.py) as BENCHMARKS.md."""

from __future__ import annotations

import json
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
    out.append(f"{md['warmup']} untimed warm-up steps, then "
               f"{(runs.get('trainrun 2x1') or [{}])[0].get('cmd', '').split('train.max_steps=')[-1].split()[0] if runs.get('trainrun 2x1') else '?'}"
               f" steps in all per run; {fpt / 1e6:.2f} MFLOP per token (6N + 12 L S d); MFU against "
               f"{f0(peak)} GFLOP/s measured.\n")
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
        if setup.startswith("trainrun"):
            ceil = ("ceiling+proposed " if "proposed" in setup else "ceiling ") + layout
            if ceil in runs:
                of_ceiling = ratio_cell(paired(rs, runs[ceil]))
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
    decomposition(R, name, runs, out)
    gelu = {k: rs[0].get("gelu_ops") for k, rs in runs.items() if rs and rs[0].get("gelu_ops") is not None}
    if gelu:
        out.append("GELU op in the train graph each trainrun run actually used: " +
                   "; ".join(f"{k}: {', '.join(v) or 'none'}" for k, v in gelu.items()) + "\n")


def decomposition(R, name, runs, out):
    """Where a trainrun step's time goes, against the ceiling's step."""
    md = R["models_def"][name]
    tok = md["tokens_per_step"]
    rows = (R.get("comm") or {}).get("rows") or []
    raw = min(rows, key=lambda r: abs(r["floats"] - md["params"]))["blocking_ms"] if rows else None
    lines = []
    for setup in ("trainrun 2x1", "trainrun+proposed 2x1", "trainrun 1x2", "trainrun+proposed 1x2"):
        rs = runs.get(setup)
        ceil = runs.get(("ceiling+proposed " if "proposed" in setup else "ceiling ") + setup.split()[-1])
        t, c = med(tps(rs or [])), med(tps(ceil or []))
        if not t or not c:
            continue
        step, cstep = tok / t * 1e3, tok / c * 1e3
        sh = shares(rs)
        ms = {k: v * step for k, v in sh.items()}
        ar = ms.get("allreduce", 0.0)
        ar_cell = f"{ar:.1f}" + (f" (raw MPI {raw:.1f})" if raw is not None and setup.endswith("2x1") else "")
        lines.append(f"| {setup} | {step:.1f} | {cstep:.1f} | {step - cstep:+.1f} ({(step - cstep) / step:+.1%}) | "
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

    def vs(a, b, goal):
        def fn(runs):
            v = paired(runs[a], runs[b])
            return f"{statistics.median(v):.2f}x {'met' if statistics.median(v) >= goal else '**not met**'}" if v else "–"
        return fn

    def overhead(a, b):
        def fn(runs):
            v = paired(runs[a], runs[b])
            o = 1 - statistics.median(v)
            return f"{100 * o:.1f}% {'met' if o <= 0.03 else '**not met**'}" if v else "–"
        return fn

    def rss(a, b):
        def fn(runs):
            x, y = max_rss(runs[a]), max_rss(runs[b])
            return f"{x:.0f} vs {y:.0f} MB {'met' if x <= y else '**not met**'}"
        return fn

    for who in ("trainrun", "trainrun+proposed"):
        row(f"{who} 2x1 >= 1.2x PyTorch DDP 2x1", vs(f"{who} 2x1", "PyTorch DDP 2x1", 1.2))
        row(f"{who} 1x2 >= 1.0x PyTorch 1x2", vs(f"{who} 1x2", "PyTorch 1x2", 1.0))
    for who, ceil in (("trainrun", "ceiling"), ("trainrun+proposed", "ceiling+proposed")):
        for lay in LAYOUTS:
            row(f"{who} {lay} overhead vs its ceiling <= 3%", overhead(f"{who} {lay}", f"{ceil} {lay}"))
    for who in ("trainrun", "trainrun+proposed"):
        row(f"{who} 2x1 peak RSS per rank <= DDP's", rss(f"{who} 2x1", "PyTorch DDP 2x1"))
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
            cap, a, b, c = fit["cap_mb"], fit["trainrun"], fit["ddp"], fit["proposed"]
            cells.append(f"{a} (proposed {c}) vs {b} at {cap:.0f} MB/rank {'met' if a >= b else '**not met**'}")
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


def memfit(rows, cap_mb=None):
    if not rows:
        return None
    fits = {}
    for who in ("trainrun", "ddp", "proposed"):
        pts = [(r["micro_batch"], max(r[who])) for r in rows if r.get(who)]
        fits[who] = linfit(pts)
    if not all(fits.values()):
        return None
    if cap_mb is None:
        cap_mb = 1024
    out = {"cap_mb": cap_mb, "fits": fits}
    for who, (a, b) in fits.items():
        out[who] = int((cap_mb - a) // b) if b > 0 else None
    return out


def levers_section(R, out):
    num = R.get("numerics")
    if num:
        out.append("### GELU forms: numerics\n")
        out.append("Forward logits vs transformers `GPT2LMHeadModel` (`gelu_new`) on the tests' largest shape "
                   "(3 layers, d 96), at the initial weights and with weight matrices x3 (pre-activations of order 1, "
                   "where GELU forms differ); train-graph gradients vs torch autograd on the tiny model (weights x3), "
                   "max |diff| / max |ref| over every tensor.\n")
        out.append("| form | GELU ops in train graph | logits max diff (init) | logits max diff (x3) | gradient rel. error | matches gelu_new to 1e-4 |")
        out.append("|---|---|---|---|---|---|")
        for k, v in num.items():
            ops = ", ".join(f"{o} x{c}" for o, c in (v.get("train_ops") or {}).items())
            e = lambda x: "–" if x is None else f"{x:.1e}"  # noqa: E731
            out.append(f"| {k} | {ops or v.get('error', '–')} | {e(v.get('logits_maxdiff_init'))} | "
                       f"{e(v.get('logits_maxdiff_scaled_x3'))} | {e(v.get('grad_rel_err'))} | "
                       f"{'yes' if v.get('matches_gelu_new_1e-4') else '**no**'} |")
        out.append("")
    for name, M in R["models"].items():
        lev = M.get("levers") or {}
        for key in ("t1", "t2"):
            t = lev.get(key)
            if not t:
                continue
            out.append(f"### {name}: train graph alone, {t['threads']} thread(s), micro-batch {t['micro_batch']}, "
                       f"{t['rounds']} interleaved rounds (load avg {t['loadavg'][0]:.1f})\n")
            out.append("| variant | ms/step median [min–max] | speed vs trainrun today (median) | vs (min) |")
            out.append("|---|---|---|---|")
            variants = t["variants"]
            first = next(iter(variants.values()))
            for k, v in variants.items():
                out.append(f"| {k} | {v['median']:.1f} [{v['min']:.1f}–{v['max']:.1f}] | "
                           f"{first['median'] / v['median']:.3f}x | {first['min'] / v['min']:.3f}x |")
            out.append("")
        prof = lev.get("profile")
        if prof:
            out.append(f"### {name}: onnxruntime profile of the train graph, 1 thread (share of kernel time)\n")
            cols = list(prof)
            out.append("| rank | " + " | ".join(f"{c} ({prof[c]['step_ms']:.0f} ms/step)" for c in cols) + " |")
            out.append("|---|" + "---|" * len(cols))
            for i in range(8):
                cells = []
                for c in cols:
                    ops = prof[c]["ops"]
                    cells.append(f"{ops[i]['op']} {pct(ops[i]['share'], 1)} ({ops[i]['ms'] / max(1, 1):.0f} ms)"
                                 if i < len(ops) else "")
                out.append(f"| {i + 1} | " + " | ".join(cells) + " |")
            out.append("")


def scaling_section(R, out):
    sc = R.get("scaling")
    if not sc:
        return
    out.append("### mid: which ops of the train graph scale from 1 to 2 threads (onnxruntime profiles, micro-batch "
               f"{R['models_def']['mid']['global_batch']})\n")
    cols = list(sc)
    out.append("| rank | " + " | ".join(f"{c}: {sc[c]['ms_1t']:.0f} -> {sc[c]['ms_2t']:.0f} ms, x{sc[c]['speedup']:.2f}"
                                      for c in cols) + " |")
    out.append("|---|" + "---|" * len(cols))
    for i in range(10):
        cells = []
        for c in cols:
            ops = sc[c]["ops"]
            if i < len(ops):
                o = ops[i]
                cells.append(f"{o['op']} {o['ms_2t']:.0f} ms ({pct(o['share_2t'], 1)}), x{o['speedup'] or 0:.2f}")
            else:
                cells.append("")
        out.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    out.append("\nEach cell: kernel time per step at 2 threads (share), and its speed-up from 1 thread.\n")


def runner_levers_section(R, out):
    rl = R.get("runner_levers")
    if not rl:
        return
    for name, block in rl.items():
        runs = block["runs"]
        out.append(f"### {name}: runner levers end to end (trainrun CLI, {block['graph']} graph, {block['rounds']} rounds, "
                   f"each lever alone on top of the graph change)\n")
        out.append("| setup | tokens/s median [min–max] | vs first row (paired) | step time shares | foreign load |")
        out.append("|---|---|---|---|---|")
        for k, rs in runs.items():
            s = common.summarize(tps(rs))
            layout_base = next(b for b in runs if b.split(":")[0] == k.split(":")[0])
            out.append(f"| {k} | {f0(s['median'])} [{f0(s['min'])}–{f0(s['max'])}] | "
                       f"{ratio_cell(paired(rs, runs[layout_base]))} | {shares_cell(rs)} | {foreign(rs)} |")
        out.append("")


def components(R, out):
    comm = R.get("comm")
    if comm and comm.get("rows"):
        out.append("### Allreduce (2 ranks, float32 SUM, in place): `" + comm["cmd"] + "`\n")
        out.append("| floats | raw MPI Allreduce ms (GB/s) | trainrun allreduce_ ms (GB/s) | trainrun / raw bandwidth | memcpy ms (GB/s) |")
        out.append("|---|---|---|---|---|")
        for r in comm["rows"]:
            out.append(f"| {r['floats'] / 1e6:.2f}M | {r['blocking_ms']:.2f} ({r['blocking_gbps']:.2f}) | "
                       f"{r['polled_ms']:.2f} ({r['polled_gbps']:.2f}) | {pct(r['polled_share_of_raw_bw'])} | "
                       f"{r['memcpy_ms']:.2f} ({r['memcpy_gbps']:.2f}) |")
        out.append("")
    opt = R.get("optim")
    if opt and opt.get("rows"):
        out.append(f"### Optimizer update (AdamW, {opt['params'] / 1e6:.1f}M GPT-2-like parameters; "
                   f"`scripts/bench_optim.py`'s bench())\n")
        out.append("| threads | ONNX graph ms [min–max] | ms per M params | NumPy ms [min–max] | ms per M params | ONNX / NumPy |")
        out.append("|---|---|---|---|---|---|")
        for r in opt["rows"]:
            o, n = r["onnx_ms"], r["numpy_ms"]
            out.append(f"| {r['threads']} | {o['median']:.1f} [{o['min']:.1f}–{o['max']:.1f}] | {r['onnx_ms_per_M']:.2f} | "
                       f"{n['median']:.1f} [{n['min']:.1f}–{n['max']:.1f}] | {r['numpy_ms_per_M']:.2f} | {r['onnx_over_numpy']:.2f} |")
        out.append("")
    fo = R.get("fastopt")
    if fo and fo.get("rows"):
        out.append(f"### Lever: AdamW as cache-sized NumPy chunks vs trainrun's optimizer graph "
                   f"({fo['params'] / 1e6:.1f}M parameters, {fo['threads']} thread; `scripts/bench/fastopt.py`)\n")
        out.append("| implementation | ms per update median [min–max] | ms per M params | speed vs the graph |")
        out.append("|---|---|---|---|")
        for k, r in fo["rows"].items():
            out.append(f"| {k} | {r['median']:.1f} [{r['min']:.1f}–{r['max']:.1f}] | {r['ms_per_M']:.2f} | {r['speedup']:.2f}x |")
        diffs = fo.get("max_diff_vs_onnx") or {}
        out.append("")
        out.append(f"Max |difference| of the parameters after one update vs the graph: "
                   f"{max(diffs.values()) if diffs else float('nan'):.1e}. The optimizer session's first run adds "
                   f"**{fo.get('onnx_extra_rss_mb', 0):.0f} MB** of resident memory (its arena holds full-size "
                   f"intermediates; the parameter buffer is {fo['params'] * 4 / 2**20:.0f} MB); the chunked "
                   f"version needs two chunk-sized temporaries.\n")
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
                   "against micro-batch (activations grow linearly with it). `ulimit -v` is not used: it caps the "
                   "virtual address space, which both frameworks reserve far beyond what they touch (VmPeak below).\n")
        for name, rows in mc.items():
            out.append(f"{name}:\n")
            out.append("| micro-batch | trainrun RSS | trainrun+proposed RSS | PyTorch DDP RSS | trainrun VmPeak | DDP VmPeak |")
            out.append("|---|---|---|---|---|---|")
            for r in rows:
                mx = lambda v: "–" if not v else f"{max(x for x in v if x is not None):.0f}"  # noqa: E731
                out.append(f"| {r['micro_batch']} | {mx(r.get('trainrun'))} | {mx(r.get('proposed'))} | {mx(r.get('ddp'))} | "
                           f"{mx(r.get('trainrun_vm'))} | {mx(r.get('ddp_vm'))} |")
            fit = memfit(rows, MEMORY_CAPS_MB.get(name))
            if fit:
                out.append("")
                out.append("Fit (MB = a + b x micro-batch): " + "; ".join(
                    f"{k} a={v[0]:.0f}, b={v[1]:.1f}" for k, v in fit["fits"].items()) +
                    f". Largest micro-batch under {fit['cap_mb']:.0f} MB per rank: trainrun {fit['trainrun']}, "
                    f"trainrun+proposed {fit['proposed']}, PyTorch DDP {fit['ddp']}.")
            out.append("")


def _op_share(prof, variant, op):
    for o in (prof or {}).get(variant, {}).get("ops", []):
        if o["op"] == op:
            return o["share"]
    return None


def _overhead_sentence(R, name) -> str:
    """The proposed 2x1 step's fixed costs as shares of its step (from the phase timer)."""
    runs = R["models"][name].get("runs") or {}
    rs = runs.get("trainrun+proposed 2x1") or []
    sh = shares(rs)
    if not sh:
        return ""
    return (f"{name}, trainrun+proposed 2x1: allreduce phase {pct(sh.get('allreduce'), 1)}, optimizer "
            f"{pct(sh.get('optimizer'), 1)}, norm {pct(sh.get('norm'), 1)}, data {pct(sh.get('data'), 1)} of the step.")


def findings(R, out):
    """The measured reasons behind the targets, with the numbers of this run."""
    models = list(R["models"])
    out.append("## Findings: why each target is met or not\n")
    # 1. GELU
    parts = []
    for name in models:
        prof = (R["models"][name].get("levers") or {}).get("profile")
        share = _op_share(prof, "fastgelu", "BiasFastGeluGrad_dX")
        if share is not None:
            parts.append(f"{name} {pct(share)}")
    speed = []
    for name in models:
        for key in ("t1", "t2"):
            t = (R["models"][name].get("levers") or {}).get(key)
            prop = R.get("proposed", {}).get("graph")
            if t and prop in t["variants"]:
                v = t["variants"]
                speed.append(f"{name} {t['threads']} thread(s) {v['fastgelu']['median'] / v[prop]['median']:.2f}x")
    num = (R.get("numerics") or {}).get(R.get("proposed", {}).get("graph"), {})
    out.append(
        "1. **GELU gradient.** In the onnxruntime profile of trainrun's train graph (1 thread) "
        f"`BiasFastGeluGrad_dX` takes {', '.join(parts) or '?'} of kernel time: its CPU kernel "
        "(orttraining/training_ops/cpu/activation/activations_grad.cc) is a scalar `std::tanh` loop on one thread. "
        "Writing gelu_new as `y * Sigmoid(y * (2k + 2k*0.044715*y^2))` (y = x + bias, k = sqrt(2/pi); exactly "
        "`0.5 y (1 + tanh(k (y + 0.044715 y^3)))`) makes the gradient builder emit SigmoidGrad and Mul/Add, which "
        f"are vectorised and multi-threaded: train graph {', '.join(speed) or '?'} faster; logits within "
        f"{num.get('logits_maxdiff_scaled_x3', float('nan')):.0e} of transformers, gradients within "
        f"{num.get('grad_rel_err', float('nan')):.0e} (relative). com.microsoft.Gelu/BiasGelu are erf GELU, not "
        "gelu_new (logits off by ~7e-4 at order-1 activations). ONNX opset-20 `Gelu(approximate=\"tanh\")` "
        "computes the right forward but onnxruntime 1.19's gradient builder gives it the erf derivative (GeluGrad): "
        "gradients off by ~2.5e-4 relative, so it must not be used.\n")
    # 2. optimizer
    fo = R.get("fastopt") or {}
    rows = fo.get("rows") or {}
    if rows:
        graph = rows.get("onnx graph (trainrun today)", {})
        best = max((r for k, r in rows.items() if k.startswith("numpy chunked")), key=lambda r: r["speedup"], default=None)
        if graph and best:
            out.append(
                f"2. **Optimizer.** trainrun's AdamW graph runs each elementwise op over the whole flat buffer: "
                f"{graph['median']:.0f} ms for {fo['params'] / 1e6:.1f}M parameters at 1 thread ({graph['ms_per_M']:.1f} ms/M), "
                f"and its session keeps full-size intermediates: +{fo.get('onnx_extra_rss_mb', 0):.0f} MB resident "
                f"({fo.get('onnx_extra_rss_mb', 0) / (fo['params'] * 4 / 2**20):.1f}x the parameter bytes). The same "
                f"math on cache-sized chunks in NumPy takes {best['median']:.0f} ms ({best['speedup']:.1f}x faster, "
                f"about one pass over memory) and no extra memory. With 2 ranks the two updates share the memory "
                f"bandwidth, which is why the optimizer phase costs more in the 2x1 runs than alone.\n")
    # 3. threads
    rl = (R.get("runner_levers") or {}).get("tiny")
    if rl:
        runs = rl["runs"]
        def r_(k):
            v = paired(runs.get(k, []), runs.get("1x2: proposed graph", []))
            return f"{statistics.median(v):.2f}x" if v else "?"
        out.append(
            "3. **1 process x 2 threads.** Every onnxruntime session (train, eval, optimizer) has its own intra-op "
            "pool, and a pool's threads spin after each run. After the optimizer session's run its spinning worker "
            "competes with the train session's threads on the 2 cores, and the train graph itself slows down "
            "(fwd+bwd above the ceiling in the table of where the step time goes). Measured end to end on tiny: "
            f"optimizer/eval sessions without spinning {r_('1x2: + optimizer/eval sessions no spinning')}, all sessions "
            f"without spinning {r_('1x2: + all sessions no spinning')}, chunked NumPy AdamW (the optimizer session "
            f"never runs) {r_('1x2: + chunked AdamW')}.")
        sc = R.get("scaling") or {}
        if sc:
            def op(variant, name):
                return next((o for o in sc.get(variant, {}).get("ops", []) if o["op"] == name), None)
            prop = R.get("proposed", {}).get("graph")
            rs = op(prop, "ReduceSum")
            st = sc.get(f"{prop}+static")
            if rs and st:
                out[-1] += (
                    f" The train graph itself scales worse than PyTorch from 1 to 2 threads (mid, profiles in Levers: "
                    f"x{sc[prop]['speedup']:.2f} for the {prop} graph): the matmuls scale ~2x, but the bias-gradient "
                    f"`ReduceSum` ({pct(rs['share_2t'])} of the step at 2 threads) gets x{rs['speedup']:.2f}, and "
                    f"LayerNormalizationGrad, Sum, GatherGrad, SoftmaxCrossEntropyLoss(Grad) and InPlaceAccumulatorV2 "
                    f"do not parallelise either. With static shapes (the graph built for the micro-batch) the "
                    f"gradient builder's reductions lose their runtime axes and that ReduceSum all but disappears: "
                    f"x{st['speedup']:.2f} from 1 to 2 threads.")
        out[-1] += "\n"
    # 4. 2x1 overhead and the 1.2x target
    lines = []
    for name in models:
        runs = R["models"][name].get("runs") or {}
        c = paired(runs.get("ceiling+proposed 2x1", []), runs.get("PyTorch DDP 2x1", []))
        c0 = paired(runs.get("ceiling 2x1", []), runs.get("PyTorch DDP 2x1", []))
        if c:
            lines.append(f"{name}: ceiling / DDP = {statistics.median(c0):.2f}x with trainrun's graph, "
                         f"{statistics.median(c):.2f}x with the proposed graph")
    rows = (R.get("comm") or {}).get("rows") or []
    big = max(rows, key=lambda r: r["floats"]) if rows else None
    out.append(
        "4. **2 ranks x 1 thread: overhead and the 1.2x target.** The ceiling bounds what any runner can reach: "
        + ("; ".join(lines) or "?") + ". trainrun's step adds, in order of size (table above): the allreduce "
        + (f"(MPI itself moves {big['floats'] / 1e6:.1f}M floats in {big['blocking_ms']:.0f} ms, "
           f"{big['blocking_gbps']:.1f} GB/s against {big['memcpy_gbps']:.1f} GB/s for a memcpy; trainrun's polled "
           f"allreduce gets {pct(big['polled_share_of_raw_bw'])} of it) " if big else "")
        + "plus the wait for the slower rank, the optimizer and the gradient norm. None of it overlaps the "
        "backward pass: the train graph is one onnxruntime run that hands back all gradients at its end, whereas "
        "DDP allreduces gradient buckets while the backward pass still runs. "
        + " ".join(_overhead_sentence(R, name) for name in models)
        + " The 2x1 overhead ratios of a run swing by several percent between rounds (see the [min–max]): a "
        "rank that is slowed for a moment stalls both at the allreduce, which the unsynchronised ceiling never pays, "
        "so a 3% bound is at the edge of what this shared 2-core machine resolves. What would take the fixed costs "
        "out: sharding the optimizer over the ranks (ZeRO-1: reduce-scatter, update half, allgather; the config's "
        "zero_stage 1 is refused today) and splitting the train graph so the allreduce of the last layers' "
        "gradients overlaps the backward pass of the first ones.\n")
    # 5. memory
    mc = R.get("memcap") or {}
    if mc:
        bits = []
        for name, rows in mc.items():
            fit = memfit(rows, MEMORY_CAPS_MB.get(name))
            if fit:
                f = fit["fits"]
                bits.append(f"{name}: fixed part trainrun {f['trainrun'][0]:.0f} MB (proposed {f['proposed'][0]:.0f}) vs "
                            f"DDP {f['ddp'][0]:.0f} MB; per sequence of the micro-batch trainrun {f['trainrun'][1]:.1f} MB "
                            f"(proposed {f['proposed'][1]:.1f}) vs DDP {f['ddp'][1]:.1f} MB")
        out.append(
            "5. **Memory (peak RSS per rank during training).** " + "; ".join(bits) + ". trainrun's fixed part is "
            "the flat buffers (parameters, gradients, 2 moments: 16 bytes per parameter), the libraries, and the "
            "optimizer session's full-size intermediates, which the chunked optimizer removes; its per-sequence "
            "part is what onnxruntime's memory planner keeps alive for the backward pass. The primitive-op GELU "
            "keeps more of them alive than FastGelu (y, y^2, the polynomial and the sigmoid instead of one "
            "input per layer), hence the proposed graph's larger per-sequence slope; it stays below PyTorch's. The end-of-run checkpoint "
            "snapshot and (rank 0) the export come after training and are left out of this comparison "
            "(PyTorch's script saves nothing); the whole-run peaks are in results.json (run_peak_rss_mb).\n")


def render(R) -> str:
    m = R.get("machine", {})
    v = m.get("versions", {})
    out = ["# trainrun benchmarks", ""]
    out.append("Generated by `scripts/bench/run.py` (`make bench` runs it through `scripts/bench.py`); "
               "do not edit by hand. Regenerate:\n")
    out.append("```\nmake bench                                   # full suite (~20 min on 2 cores)\n"
               ".venv/bin/python scripts/bench/run.py --quick   # ~4 min, 1 round, fewer steps\n"
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
                   + f" GFLOP/s. **MFU is against {peak_gflops(R):.0f} GFLOP/s** (all cores).\n")
    prop = R.get("proposed", {})
    out.append(f"**trainrun+proposed** = trainrun's CLI with the proposed core changes prototyped outside trainrun's "
               f"code: graph variant `{prop.get('graph')}` (the MLP GELU of trainrun/models/gpt2.py; see levers), "
               f"extra `--set {' '.join(prop.get('sets') or []) or '(none)'}`, runner patch {prop.get('patch') or '(none)'}.\n")
    out.append("## Targets\n")
    targets(R, out)
    out.append("## trainrun vs PyTorch vs the ceiling\n")
    out.append("Layouts: **2x1** = 2 processes x 1 thread (trainrun: `mpirun -np 2`, PyTorch: DDP gloo via torchrun); "
               "**1x2** = 1 process x 2 threads. tokens/s = timed tokens / timed wall time (all ranks; warm-up excluded); "
               "'best window' = median over runs of the fastest window of warm-up-many steps (less sensitive to other "
               "jobs). Ratios are medians of per-round ratios [min–max]. Step time shares: trainrun's own phase timer "
               "(summary.json, warm-up steps included); PyTorch's from the benchmark script (DDP's allreduce overlaps "
               "the backward pass); medians per phase over the runs, so they need not add up to 100%.\n")
    for name in R["models"]:
        model_section(R, name, out)
    cmds = {}
    for name, M in R["models"].items():
        for k, rs in (M.get("runs") or {}).items():
            if rs and rs[0].get("cmd"):
                cmds.setdefault(k, rs[0]["cmd"])
    if cmds:
        out.append("Commands (first model, first round; the data path, output folder and shapes come from `--set`):\n")
        out.append("```")
        prop = R.get("proposed", {})
        for k, c in cmds.items():
            c = c.replace(str(common.ROOT) + "/", "")
            if k.startswith("trainrun+proposed"):
                c = c.replace("trainrun --config", "python scripts/bench/trainrun_rank.py --patch "
                              f"'{json.dumps(prop.get('patch') or {})}' -- --config", 1)
                k += f" (graphs folder: the `{prop.get('graph')}` variant from scripts/bench/variants.py)"
            out.append(f"# {k}\n{c}")
        out.append("```\n")
    findings(R, out)
    out.append("## Levers\n")
    levers_section(R, out)
    scaling_section(R, out)
    runner_levers_section(R, out)
    out.append("## Components\n")
    components(R, out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(common.read_json(sys.argv[1] if len(sys.argv) > 1 else common.ROOT / "runs" / "bench" / "results.json")))
