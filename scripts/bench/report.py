"""Renders runs/bench/results.json (written by run.py) as BENCHMARKS.md: a headline table of the claims, then
one short section per claim ("–" where a figure was not measured). ``merge`` keeps the sections of the last
file that this run did not render (``--only``, the sections kept by hand, bench-cluster's) and their
headline rows."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LAYOUTS = ("2x1", "1x2")
TORCH = {"2x1": "PyTorch DDP 2x1", "1x2": "PyTorch 1x2"}
MEMORY_CAPS_MB = {"tiny": 1024, "mid": 2048}
MEM_WHO = {"trainrun": "trainrun", "off": "trainrun-off", "ddp": "PyTorch DDP"}
STEP_PHASES = {"data": "data", "forward_backward": "fwd+bwd", "allreduce": "allreduce", "norm": "norm",
               "optimizer": "optim", "forward": "fwd", "backward": "bwd(+allreduce)", "clip": "clip"}
HEADLINE = "## Headline"
MATRIX = "## tiny and mid against PyTorch and the ceiling"
G124M = "## GPT-2 124M"
BERT = "## BERT pre-training against PyTorch DDP"
CNN = "## A CNN against PyTorch DDP"
COMM = "## Allreduce against raw MPI"
MEMCAP = "## Memory under a per-rank cap"
DATA = "## Data loader"
BUILDERS = "## trainrun's gradient builder against onnxruntime-training's"
BUILDER_MODELS = {"mid": "mid", "gpt2-124m": "GPT-2 124M", "bert": "BERT"}


def anchor(heading: str) -> str:
    """The GitHub anchor of a markdown heading."""
    text = heading.lstrip("#").strip().lower()
    return "#" + re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def na(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def pct(x, digits=0) -> str:
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


def ratio_cell(vals) -> str:
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.2f}"
    return f"{statistics.median(vals):.2f} [{min(vals):.2f}–{max(vals):.2f}]"


def max_rss(runs, key="peak_rss_mb"):
    vals = [max(r[key]) for r in runs if r.get(key)]
    return max(vals) if vals else None


def met(ok) -> str:
    return "–" if ok is None else ("yes" if ok else "**no**")


def peak_gflops(R):
    vals = [p.get("peak_gflops") for p in (R.get("peak"), R.get("peak_end")) if p]
    return max(vals) if vals else None


def ceiling_of(setup: str) -> str:
    who, layout = setup.rsplit(" ", 1)
    return ("ceiling-off " if who == "trainrun-off" else "ceiling ") + layout


def shares_cell(runs) -> str:
    """Median share per phase over runs, renormalised over the step's own phases."""
    acc: dict = {}
    for r in runs:
        ph = {k: v for k, v in (r.get("phase_shares") or {}).items() if k in STEP_PHASES}
        total = sum(ph.values()) or 1.0
        for k, v in ph.items():
            acc.setdefault(k, []).append(v / total)
    return ", ".join(f"{STEP_PHASES[k]} {pct(statistics.median(v), 1)}" for k, v in acc.items()) or "–"


def nearest_comm_row(R, params):
    rows = (R.get("comm") or {}).get("rows") or []
    return min(rows, key=lambda r: abs(r["floats"] - params)) if rows else None


def linfit(points):
    """Least squares y = a + b x."""
    n = len(points)
    sx, sy = sum(x for x, _ in points), sum(y for _, y in points)
    sxx, sxy = sum(x * x for x, _ in points), sum(x * y for x, y in points)
    d = n * sxx - sx * sx
    if n < 2 or not d:
        return None
    b = (n * sxy - sx * sy) / d
    return (sy - b * sx) / n, b


def memfit(rows, cap_mb):
    """Straight-line fits of peak RSS per rank against the micro-batch, and the largest micro-batch under a cap."""
    fits = {}
    for who in MEM_WHO:
        fit = linfit([(r["micro_batch"], max(x for x in r[who] if x is not None)) for r in rows or [] if r.get(who)])
        if fit:
            fits[who] = fit
    if "trainrun" not in fits:
        return None
    out = {"cap_mb": cap_mb, "fits": fits}
    for who, (a, b) in fits.items():
        out[who] = int((cap_mb - a) // b) if b > 0 else None
    return out


# ---------------------------------------------------------------------- claims: (claim, measured, met, section)
def matrix_claims(R):
    models = [n for n in R.get("models", {}) if R["models"][n].get("runs")]
    if not models:
        return []
    claims = []

    def row(label, fn):
        cells = []
        for n in models:
            try:
                cells.append(fn(R["models"][n]["runs"]))
            except (KeyError, TypeError, ValueError, ZeroDivisionError, statistics.StatisticsError):
                cells.append(("–", None))
        claims.append((f"{label} ({' / '.join(models)})", " / ".join(c[0] for c in cells),
                       " / ".join(met(c[1]) for c in cells), MATRIX))

    def vs(a, b, goal):
        def fn(runs):
            v = statistics.median(paired(runs[a], runs[b]))
            return f"{v:.2f}x", v >= goal
        return fn

    def overhead(a):
        def fn(runs):
            o = 1 - statistics.median(paired(runs[a], runs[ceiling_of(a)]))
            return f"{100 * o:.1f}%", o <= 0.03
        return fn

    def rss(runs):
        x, y = max_rss(runs["trainrun 2x1"]), max_rss(runs["PyTorch DDP 2x1"])
        return f"{x:.0f} vs {y:.0f} MB", x <= y

    row("trainrun 2x1 >= 1.3x PyTorch DDP 2x1", vs("trainrun 2x1", "PyTorch DDP 2x1", 1.3))
    row("trainrun 1x2 >= 1.0x PyTorch 1x2", vs("trainrun 1x2", "PyTorch 1x2", 1.0))
    for lay in LAYOUTS:
        row(f"trainrun {lay} within 3% of its train graph alone", overhead(f"trainrun {lay}"))
    row("trainrun 2x1 peak RSS per rank <= DDP's", rss)
    return claims


def component_claims(R):
    claims = []
    models = [n for n in R.get("models_def", {}) if n in ("tiny", "mid")]
    if (R.get("comm") or {}).get("rows"):
        cells = [nearest_comm_row(R, R["models_def"][n]["params"])["polled_share_of_raw_bw"] for n in models]
        claims.append((f"trainrun's allreduce >= 80% of raw MPI bandwidth ({' / '.join(models)} gradients)",
                       " / ".join(pct(c) for c in cells), " / ".join(met(c >= 0.8) for c in cells), COMM))
    fits = {n: memfit((R.get("memcap") or {}).get(n), MEMORY_CAPS_MB.get(n, 1024)) for n in models}
    fits = {n: f for n, f in fits.items() if f}
    if fits:
        claims.append((f"largest micro-batch under a per-rank cap >= DDP's ({' / '.join(fits)})",
                       " / ".join(f"{na(f.get('trainrun'), '{}')} vs {na(f.get('ddp'), '{}')}" for f in fits.values()),
                       " / ".join(met(None if None in (f.get("trainrun"), f.get("ddp")) else f["trainrun"] >= f["ddp"])
                                  for f in fits.values()), MEMCAP))
    rows = (R.get("data") or {}).get("rows") or []
    small = [r["batches_per_s"] for r in rows if (r["micro_batch"], r["seq_len"]) == (8, 128)]
    if small:
        claims.append(("data loader >= 1,500 batches/s of 8 x 128 tokens", f"{min(small):,.0f}",
                       met(min(small) >= 1500), DATA))
    return claims


def claims_of(R):
    return (matrix_claims(R) + g124m_claims(R) + bert_claims(R) + cnn_claims(R) + builders_claims(R)
            + component_claims(R))


def headline(R, out):
    out.append(HEADLINE + "\n")
    out.append("| claim | measured | met | section |")
    out.append("|---|---|---|---|")
    for claim, measured, ok, section in claims_of(R):
        out.append(f"| {claim} | {measured} | {ok} | [{section[3:]}]({anchor(section)}) |")
    out.append("")


# ---------------------------------------------------------------------- tiny and mid
def matrix_section(R, out):
    if not any(M.get("runs") for M in R.get("models", {}).values()):
        return
    off = (R.get("off") or {}).get("sets") or []
    out.append(MATRIX + "\n")
    out.append("**2x1** = 2 processes x 1 thread (trainrun `mpirun -np 2`, PyTorch DDP gloo), **1x2** = 1 process x 2 "
               "threads; the same global batch, data and initial weights. **trainrun** = its CLI with its defaults; "
               f"**trainrun-off** = with `{' '.join('--set ' + s for s in off)}` (its two levers that have a switch, "
               "off); **ceiling** = trainrun's train graph alone in a loop (ceiling-off: trainrun-off's graph). "
               "tokens/s: median [min–max] over rounds; ratios: medians of per-round ratios; MFU against "
               f"{na(peak_gflops(R), '{:.0f}')} GFLOP/s measured in the run.\n")
    peak = peak_gflops(R)
    for name, M in R["models"].items():
        runs, md = M.get("runs") or {}, R["models_def"][name]
        if not runs:
            continue
        out.append(f"### {name}: GPT-2 {md['n_layer']} x {md['n_embd']}, seq {md['seq_len']}, vocab {md['vocab_size']} "
                   f"({md['params'] / 1e6:.2f}M parameters), {md['tokens_per_step']:,} tokens a step\n")
        out.append("| setup | tokens/s | vs PyTorch, same layout | of ceiling, same graph | MFU | peak RSS MB per rank "
                   "| step time shares |")
        out.append("|---|---|---|---|---|---|---|")
        for setup, rs in runs.items():
            s = common.summarize(tps(rs))
            layout = setup.split()[-1]
            vs_torch = ratio_cell(paired(rs, runs[TORCH[layout]])) \
                if not setup.startswith("PyTorch") and TORCH.get(layout) in runs else "–"
            of_ceil = ratio_cell(paired(rs, runs[ceiling_of(setup)])) \
                if setup.startswith("trainrun") and ceiling_of(setup) in runs else "–"
            mfu = pct(s["median"] * md["flops_per_token"] / (peak * 1e9), 1) if s["median"] and peak else "–"
            rng = f" [{s['min']:,.0f}–{s['max']:,.0f}]" if s["n"] > 1 else ""
            err = "; ".join(f"failed: {r['error']}" for r in rs if r.get("error"))
            flag = " (re-prepared)" if any(r.get("reprepared") for r in rs) else ""
            out.append(f"| {setup}{flag} | **{na(s['median'], '{:,.0f}')}**{rng}{' ' + err if err else ''} | "
                       f"{vs_torch} | {of_ceil} | {mfu} | {na(max_rss(rs), '{:.0f}')} | "
                       f"{shares_cell(rs) if not setup.startswith('ceiling') else '–'} |")
        out.append("")


# ---------------------------------------------------------------------- GPT-2 124M
def _g124m(R):
    G = R.get("gpt2-124m")
    if not G:
        return None
    peaks, mem = [], []
    for when in ("machine_start", "machine_end"):
        f = G.get(when) or {}
        p = f.get("peak")
        if p:        # 2 ranks x 1 thread run on single-thread GEMMs: cores x the 1-thread peak counts too
            peaks += [p.get("peak_gflops"), p["cores"] * p["peak_gflops_1core"] if p.get("peak_gflops_1core") else None]
        mem += [r.get("memcpy_gbps") for r in (f.get("comm") or {}).get("rows") or []]
    setups = G.get("setups", {})
    code = lambda c: [k for k, v in setups.items() if v.get("code") == c]  # noqa: E731
    return {"G": G, "peak": max([p for p in peaks if p] or [0]) or None, "memcpy": max([m for m in mem if m] or [0])
            or None, "current": code("current"), "before": (code("before") or [None])[0],
            "ddp": (code("ddp") or [None])[0], "grad_mb": 4 * G["model"]["params"] / 1e6}


def _g124m_row(X, k):
    """The figures of one setup: outside share, GFLOP/s, share of peak, ratios, reduction GB/s, RSS."""
    G, runs = X["G"], X["G"]["runs"]
    rs = runs.get(k) or []
    t = med([r.get("tokens_per_sec") for r in rs])
    fl = None if t is None else t * G["model"]["flops_per_token"] / 1e9
    red = med([sum(v for p, v in (r.get("phase_ms") or {}).items() if "reduce" in p) or None for r in rs])
    bw = X["grad_mb"] / red if red else None
    ratio = lambda other: med(paired(rs, runs.get(other) or [])) if other else None  # noqa: E731
    return {"tps": t, "outside": med([r.get("outside_share") for r in rs]), "gflops": fl,
            "of_peak": fl / X["peak"] if fl and X["peak"] else None, "vs_before": ratio(X["before"]),
            "vs_ddp": ratio(X["ddp"]), "bw": bw, "of_memcpy": bw / X["memcpy"] if bw and X["memcpy"] else None,
            "bpp": ((G.get("setups", {}).get(k) or {}).get("bytes_per_param_per_node") or {}).get("total"),
            "train_rss": max_rss(rs, "train_rss_mb"), "run_rss": max_rss(rs, "run_rss_mb")}


def g124m_claims(R):
    X = _g124m(R)
    if not X or not X["current"]:
        return []
    rows = [_g124m_row(X, k) for k in X["current"]]
    ddp_rss = max_rss(X["G"]["runs"].get(X["ddp"]) or [], "run_rss_mb")
    first = X["current"][0]

    def claim(label, key, fmt, goal):
        v = rows[0][key]
        oks = [None if r[key] is None else goal(r[key]) for r in rows]
        return (f"GPT-2 124M: {label}", f"{na(v, fmt)} ({first})",
                f"{met(oks[0])}; {sum(1 for o in oks if o)} of {len(oks)} setups", G124M)

    before = X["G"].get("before", "older commit")
    return [claim("time outside forward/backward <= 5% of the step", "outside", "{:.1%}", lambda v: v <= 0.05),
            claim("model FLOP/s >= 80% of the GEMM peak", "of_peak", "{:.0%}", lambda v: v >= 0.8),
            claim(f"tokens/s >= 1.15x trainrun at {before}", "vs_before", "{:.2f}x", lambda v: v >= 1.15),
            claim("tokens/s >= 1.25x PyTorch DDP", "vs_ddp", "{:.2f}x", lambda v: v >= 1.25),
            claim("gradient reduction >= 60% of memcpy bandwidth", "of_memcpy", "{:.0%}", lambda v: v >= 0.6),
            claim("parameters + AdamW moments <= 12 bytes per parameter per node", "bpp", "{} B", lambda v: v <= 12),
            claim(f"whole-run peak RSS per rank <= DDP's ({na(ddp_rss, '{:.0f}')} MB)", "run_rss", "{:.0f} MB",
                  lambda v: ddp_rss is not None and v <= ddp_rss)]


def g124m_section(R, out):
    X = _g124m(R)
    if not X:
        return
    G, md = X["G"], X["G"]["model"]
    mach = G.get("machine", {})
    load = med([r.get("foreign_cpu_cores") for rs in G["runs"].values() for r in rs])
    out.append(G124M + "\n")
    out.append(f"`make bench-124m` (scripts/bench/gpt2_124m.py), started {G.get('started')}: GPT-2 {md['n_layer']} x "
               f"{md['n_embd']} ({md['params'] / 1e6:.1f}M parameters), seq {md['seq_len']}, micro-batch "
               f"{md['global_batch'] // G['ranks']} a rank, AdamW, {G['ranks']} ranks x {G['threads_per_rank']} "
               f"thread, {md['warmup']} warm-up then {md['steps']} measured steps, {G['rounds']} round(s); "
               f"{mach.get('cpu')}, median foreign load {na(load)} cores. Against trainrun at commit "
               f"`{G.get('before')}` (its own package and `prepare`) and PyTorch DDP (transformers' GPT-2, the same "
               f"data and initial weights). GEMM peak {na(X['peak'], '{:.0f}')} GFLOP/s and memcpy "
               f"{na(X['memcpy'])} GB/s measured in the run; bytes per parameter computed from the config.\n")
    if load is not None and load > 0.2:
        out.append("**Run on a loaded machine**: re-run `make bench-124m` on a quiet one.\n")
    out.append("| setup | tokens/s | outside fwd/bwd | model GFLOP/s (of peak) | gradient reduction GB/s (of memcpy) "
               "| B/param/node | peak RSS MB a rank: training / whole run |")
    out.append("|---|---|---|---|---|---|---|")
    for k in G["runs"]:
        r = _g124m_row(X, k)
        out.append(f"| {k} | {na(r['tps'], '{:.0f}')} | {pct(r['outside'], 1)} | {na(r['gflops'], '{:.0f}')} "
                   f"({pct(r['of_peak'])}) | {na(r['bw'])} ({pct(r['of_memcpy'])}) | {na(r['bpp'], '{}')} | "
                   f"{na(r['train_rss'], '{:.0f}')} / {na(r['run_rss'], '{:.0f}')} |")
    out.append("")


# ---------------------------------------------------------------------- BERT, CNN
def bert_claims(R):
    b = R.get("bert")
    if not b:
        return []
    like = b.get("median_masked_head_ratio")
    return [("BERT pre-training >= 1.2x PyTorch DDP (transformers' model / the same with the masked head)",
             f"{b['median_ratio']:.2f}x / {na(like, '{:.2f}x')}",
             f"{met(b['median_ratio'] >= 1.2)} / {met(None if like is None else like >= 1.2)}", BERT)]


def bert_section(R, out):
    b = R.get("bert")
    if not b:
        return
    s = b["shape"]
    out.append(BERT + "\n")
    out.append(f"`scripts/bench/bert.py`, started {b.get('started')}: configs/bert-tiny.yaml ({s['num_hidden_layers']} "
               f"layers, hidden {s['hidden_size']}, vocab {s['vocab_size']}), seq {b['seq_len']}, global batch "
               f"{b['global_batch']}, 2 ranks x 1 thread, {b['timed_steps']} timed steps; against transformers' "
               "`BertForPreTraining` under DDP as a user gets it (the MLM head at every position) and with the head "
               "at the masked positions only, as trainrun runs it (\"masked head\"). Same weights, batches, AdamW.\n")
    masked = b.get("ddp_masked_head_tokens_per_s") or [None] * len(b["ddp_tokens_per_s"])
    out.append("| round | trainrun tokens/s | DDP | trainrun / DDP | DDP, masked head | trainrun / masked head |")
    out.append("|---|---|---|---|---|---|")
    for i, (a, d, m) in enumerate(zip(b["trainrun_tokens_per_s"], b["ddp_tokens_per_s"], masked)):
        out.append(f"| {i + 1} | {a:,.0f} | {d:,.0f} | {a / d:.2f} | {na(m, '{:,.0f}')} | {na(a / m if m else None)} |")
    fl = b.get("final_loss") or {}
    out.append(f"\nFinal loss trainrun {na(fl.get('trainrun'), '{:.4f}')}, DDP {na(fl.get('ddp'), '{:.4f}')} "
               "(same start and data).\n")


def cnn_claims(R):
    c = R.get("cnn")
    return [("SqueezeNet 1.1 on the digits >= 1.0x PyTorch DDP", f"{c['median_ratio']:.2f}x",
             met(c["median_ratio"] >= 1.0), CNN)] if c else []


def cnn_section(R, out):
    c = R.get("cnn")
    if not c:
        return
    out.append(CNN + "\n")
    out.append(f"`scripts/bench/cnn.py`, started {c.get('started')}: configs/squeezenet-digits.yaml's network "
               "(BatchNorm, 32x32, 10 classes), global batch 64, 2 ranks x 1 thread, against the same network under "
               f"PyTorch DDP; same weights and batches, AdamW; {c['timed_steps']} timed steps.\n")
    out.append("| round | trainrun samples/s | DDP samples/s | trainrun / DDP |")
    out.append("|---|---|---|---|")
    for i, (a, d) in enumerate(zip(c["trainrun_samples_per_s"], c["ddp_samples_per_s"])):
        out.append(f"| {i + 1} | {a:,.0f} | {d:,.0f} | {a / d:.2f} |")
    out.append("")


# ---------------------------------------------------------------------- components
def components(R, out):
    comm = R.get("comm") or {}
    if comm.get("rows"):
        out.append(COMM + "\n")
        out.append("`scripts/bench_comm.py`, 2 ranks, float32 SUM in place: raw blocking MPI Allreduce against "
                   "trainrun's polled `Communicator.allreduce_` and a memcpy of the same buffer.\n")
        out.append("| floats | raw MPI ms (GB/s) | trainrun ms (GB/s) | trainrun / raw | memcpy ms (GB/s) |")
        out.append("|---|---|---|---|---|")
        for r in comm["rows"]:
            out.append(f"| {r['floats'] / 1e6:.2f}M | {r['blocking_ms']:.2f} ({r['blocking_gbps']:.2f}) | "
                       f"{r['polled_ms']:.2f} ({r['polled_gbps']:.2f}) | {pct(r['polled_share_of_raw_bw'])} | "
                       f"{r['memcpy_ms']:.2f} ({r['memcpy_gbps']:.2f}) |")
        out.append("")
    mc = R.get("memcap") or {}
    if mc:
        out.append(MEMCAP + "\n")
        out.append("Peak RSS per rank (MB, 2x1, 3 steps) at two micro-batches, a straight line through them, and the "
                   "largest micro-batch whose peak stays under the cap (what a cgroup memory limit enforces).\n")
        out.append("| model | micro-batch: trainrun / trainrun-off / DDP MB | fit a + b x mb | largest under the cap |")
        out.append("|---|---|---|---|")
        for name, rows in mc.items():
            cap = MEMORY_CAPS_MB.get(name, 1024)
            fit = memfit(rows, cap)
            mx = lambda v: "–" if not v else f"{max(x for x in v if x is not None):.0f}"  # noqa: E731
            pts = "; ".join(f"{r['micro_batch']}: {mx(r.get('trainrun'))} / {mx(r.get('off'))} / {mx(r.get('ddp'))}"
                            for r in rows)
            fits = ", ".join(f"{MEM_WHO[k]} {a:.0f} + {b:.1f}" for k, (a, b) in fit["fits"].items()) if fit else "–"
            largest = (f"{cap} MB: " + ", ".join(f"{MEM_WHO[k]} {na(fit.get(k), '{}')}" for k in MEM_WHO)) if fit else "–"
            out.append(f"| {name} | {pts} | {fits} | {largest} |")
        out.append("")
    data = R.get("data") or {}
    if data.get("rows"):
        out.append(DATA + "\n")
        out.append(f"`scripts/bench_data.py`'s loader_rate(), {data['steps']} steps.\n")
        out.append("| micro-batch x seq | prefetch | batches/s | max RSS growth kB |")
        out.append("|---|---|---|---|")
        for r in data["rows"]:
            out.append(f"| {r['micro_batch']} x {r['seq_len']} | {r['prefetch']} | {r['batches_per_s']:,.0f} | "
                       f"{r['max_rss_growth_kb']} |")
        out.append("")


def render(R) -> str:
    m, v = R.get("machine", {}), R.get("machine", {}).get("versions", {})
    out = ["# trainrun benchmarks", ""]
    out.append("`make bench` (scripts/bench/run.py: `--quick` ~5 min, `--render` from runs/bench/results.json, `--only "
               "SECTIONS`) measures the claims below and rewrites this file; `make bench-124m` and `make bench-cluster` "
               "their sections alone. Sections a run does not measure are kept from the last file, with their "
               "headline rows (the recipes' section is kept by hand). What the one-off experiments behind trainrun's "
               "choices measured is in [docs/design.md](docs/design.md#measured-experiments).\n")
    la = [x[1] for x in R.get("load", [])]
    out.append(f"Last `make bench`: mode {R.get('mode')}, started {R.get('started')}, took {R.get('duration_s', '?')} s; "
               f"{m.get('cpu')} ({m.get('hypervisor', '?')} guest), {m.get('cores')} cores, {m.get('memory_gb')} GB; "
               f"{v.get('onnxruntime_build') or 'onnxruntime'} {v.get('onnxruntime')}, torch {v.get('torch')}, transformers "
               f"{v.get('transformers')}, MPICH {v.get('mpich')}"
               + (f"; 1-minute load average {min(la):.1f}–{max(la):.1f}. Rounds alternate the setups so that a shared "
                  "machine's load hits them alike." if la else ".") + "\n")
    return _body(R, out)


def _body(R, out: list) -> str:
    """``out`` (the preamble) with the headline rows and every section ``R`` holds, as one text."""
    headline(R, out)
    matrix_section(R, out)
    g124m_section(R, out)
    bert_section(R, out)
    cnn_section(R, out)
    builders_section(R, out)
    components(R, out)
    return "\n".join(out).rstrip("\n") + "\n"


def render_only(old: str, R) -> str:
    """The sections ``R`` holds (a script that measures its own, as scripts/bench/builders.py) under
    ``old``'s preamble, with their headline rows: for :func:`merge` with ``old``, which keeps the rest."""
    out = [_sections(old)[0].rstrip("\n") + "\n"] if old else ["# trainrun benchmarks\n"]
    return _body(R, out)


# ---------------------------------------------------------------------- the two gradient builders
def _builder_figures(res: dict) -> dict:
    """Medians over the rounds of one model's scripts/bench/builders.py results: tokens/s per (runtime,
    graph), the same-run ratio on the training build, stock onnxruntime's (its version), peak RSS."""
    f = {"nodes": res.get("nodes", {}), "stock": None}
    for key, rounds in res.items():
        if key.startswith("time_"):
            tps = {g: med([r["graphs"][g]["tokens_per_s"] for r in rounds if g in r["graphs"]])
                   for g in ("onnxruntime", "trainrun")}
            if key.endswith("-training"):
                f["training"] = key[5:-len("-training")]
                f["ort"], f["ours"] = tps["onnxruntime"], tps["trainrun"]
                f["ratio"] = med([r["ratio"] for r in rounds if "ratio" in r])
                f["rounds"] = len(rounds)
                f["load"] = [r["loadavg"][0] for r in rounds]
                f["started"], f["cpu"] = rounds[0].get("started"), rounds[0].get("cpu")
            else:
                f["stock"], f["stock_tps"] = key[5:], tps["trainrun"]
        if key.startswith("peak_") and key.endswith("-training"):
            last = rounds[-1]["graphs"]
            f["rss"] = (last["onnxruntime"]["peak_rss_mb"], last["trainrun"]["peak_rss_mb"])
    if f["stock"] and f.get("ort"):
        f["stock_ratio"] = f["stock_tps"] / f["ort"]
    return f


def builders_claims(R):
    models = (R.get("builders") or {}).get("models") or {}
    if not models:
        return []
    F = {m: _builder_figures(r) for m, r in models.items()}
    names = " / ".join(BUILDER_MODELS[m] for m in F)

    def row(label, key, goal, fmt="{:.2f}x"):
        vals = [F[m].get(key) for m in F]
        return (f"{label} ({names})", " / ".join(na(v, fmt) for v in vals),
                " / ".join(met(None if v is None else v >= goal if goal > 0 else v <= -goal) for v in vals), BUILDERS)
    stock = next((f["stock"] for f in F.values() if f["stock"]), "(not run)")
    for f in F.values():
        f["rss_ratio"] = f["rss"][1] / f["rss"][0] if f.get("rss") else None
    return [row("trainrun's gradient builder >= 0.95x onnxruntime-training's tokens/s, same run", "ratio", 0.95),
            row(f"trainrun's builder on stock onnxruntime {stock} >= 0.95x the training build's", "stock_ratio", 0.95),
            row("trainrun's builder's peak RSS <= 1.05x onnxruntime-training's", "rss_ratio", -1.05)]


def builders_section(R, out):
    models = (R.get("builders") or {}).get("models") or {}
    if not models:
        return
    F = {m: _builder_figures(r) for m, r in models.items()}
    some = next(iter(F.values()))
    out.append(BUILDERS + "\n")
    out.append("`scripts/bench/builders.py` (`build`, then `time` in rounds under onnxruntime-training "
               f"{some.get('training')} and under stock onnxruntime in its own venv, `peak`, `report`), started "
               f"{some.get('started')} on {some.get('cpu')}: each model's loss graph as `prepare` makes it, differentiated by "
               "onnxruntime-training's builder (with trainrun's rewrites, `graphs/ort_gradients.py`, direct "
               "gradients) and by trainrun's own (`graphs/autodiff/`), both then with the cross-entropy split and "
               "padded products; forward + backward of one rank's micro-batch in a session as the engine makes it, "
               "1 thread, the two graphs alternating in one process; tokens/s: median step, medians over the rounds. "
               "The stock column is another process, timed after each training-build round: on a loaded machine its "
               "rounds vary far more than the same-run ratio, the claim of record. Peak RSS: each graph run in a "
               "process of its own (onnxruntime and numpy imported: about 330 MB before the session).\n")
    out.append("| model | tokens a step | nodes (onnxruntime / trainrun) | onnxruntime builder tokens/s | "
               "trainrun builder | ratio | trainrun builder on stock | / training build's | peak RSS MB "
               "(onnxruntime / trainrun) | rounds, load |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for m, f in F.items():
        rss = f.get("rss") or (None, None)
        tokens = {"bert": "16 x 128", "mid": "4 x 256", "gpt2-124m": "2 x 256"}.get(m, "?")
        load = f"{f.get('rounds')}, {min(f['load']):.1f}–{max(f['load']):.1f}" if f.get("load") else "?"
        out.append(f"| {BUILDER_MODELS[m]} | {tokens} | {f['nodes'].get('onnxruntime')} / {f['nodes'].get('trainrun')} "
                   f"| {na(f.get('ort'), '{:,.0f}')} | {na(f.get('ours'), '{:,.0f}')} | {na(f.get('ratio'))} | "
                   f"{na(f.get('stock_tps'), '{:,.0f}')} ({f['stock'] or '-'}) | {na(f.get('stock_ratio'))} | "
                   f"{na(rss[0], '{:.0f}')} / {na(rss[1], '{:.0f}')} | {load} |")
    out.append("")


# ---------------------------------------------------------------------- keeping what this run did not render
def _sections(text: str):
    """(preamble, [(heading, body)]) of a markdown text split at its ``## `` headings."""
    parts = re.split(r"(?m)^(?=## )", text)
    return parts[0], [(p.split("\n", 1)[0], p) for p in parts[1:]]


def merge(old: str, new: str) -> str:
    """``new`` (a rendered BENCHMARKS.md) with every section of ``old`` that ``new`` lacks appended, and the
    headline rows of ``old`` that point at those sections added to ``new``'s headline table."""
    pre, sections = _sections(new)
    have = {h for h, _ in sections}
    kept = [(h, body) for h, body in _sections(old)[1] if h not in have and h != HEADLINE]
    links = {anchor(h) for h, _ in kept}
    old_head = dict(_sections(old)[1]).get(HEADLINE, "")
    rows = [line for line in old_head.splitlines() if line.startswith("| ") and
            any(f"]({a})" in line for a in links)]
    out = pre
    for h, body in sections:
        if h == HEADLINE and rows:
            lines = body.rstrip("\n").split("\n")
            body = "\n".join(lines + rows) + "\n\n"
        out += body
    for _, body in kept:
        out = out.rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n"
    return out


if __name__ == "__main__":
    print(render(common.read_json(sys.argv[1] if len(sys.argv) > 1 else common.ROOT / "runs" / "bench" / "results.json")))
