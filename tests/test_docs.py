"""The user docs: the configuration reference matches the schema, every relative link resolves,
the README stays a short entry point that reaches every page, and the user docs tell no history
and keep measured figures in BENCHMARKS.md."""

import argparse
import re
import sys
from pathlib import Path

import pytest

from trainrun import config as C

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
USER_DOCS = [ROOT / "README.md"] + sorted(p for p in DOCS.glob("*.md") if p.name != "architecture.md")
LINKED = USER_DOCS + [DOCS / "architecture.md", ROOT / "BENCHMARKS.md", ROOT / "tests" / "README.md"]

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def prose(text: str) -> str:
    """The text without its fenced code blocks (examples and command output)."""
    return FENCE.sub("", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_configuration_reference_is_up_to_date():
    text = (DOCS / "configuration.md").read_text()
    assert text == C.markdown_reference(), \
        "docs/configuration.md is out of date with trainrun/config/: run `make docs`"
    for section in ("run", "model", "model.gpt2", "optimizer", "distributed"):
        assert f"## `{section}`" in text
    assert "| `optimizer.name` | `adamw` | `adam`, `adamw`, `lamb`, `sgd` |" in text


def test_ops_with_gradient_rules_table_is_up_to_date():
    """docs/models.md's table of ops with gradient rules is the one scripts/gen_config_docs.py writes from the
    builder's registry."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_docs
    finally:
        sys.path.pop(0)
    from trainrun.graphs.autodiff import covered_ops
    text = (DOCS / "models.md").read_text()
    assert text == gen_config_docs.with_ops_table(text), \
        "docs/models.md's table of ops with gradient rules is out of date: run `make docs`"
    table = text.partition(gen_config_docs.BEGIN)[2].partition(gen_config_docs.END)[0]
    for module, ops in covered_ops().items():
        assert f"| `{module}` | {', '.join(ops)} |" in table
    assert "Einsum" in covered_ops()["einsum"] and "Resize" in covered_ops()["resize"]


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    bad = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue                                           # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


def test_readme_is_short_and_reaches_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md: keep it within 300 lines; move detail to docs/"
    linked = {t.partition("#")[0] for t in LINK.findall(readme)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md links no docs/ page named {missing}"
    for must in ("## The two commands", "## Exit codes", "## The run directory", "BENCHMARKS.md"):
        assert must in readme


@pytest.mark.parametrize("doc", USER_DOCS[1:], ids=lambda p: p.name)
def test_each_page_has_a_contents_list(doc):
    text = prose(doc.read_text())
    sections = [re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^## (.*)$", text, re.M)]
    listed = {t.partition("#")[2] for t in LINK.findall(text.split("\n## ", 1)[0])}
    assert [s for s in sections if s not in listed] == [], f"{doc.name}: its contents list misses sections"


HISTORY = re.compile(r"\bissue \d+|\bmain before\b|\bearlier belief\b|\bsince the last\b|\bno longer\b"
                     r"|\bbefore this work\b|\bwas wrong\b", re.I)
FIGURE = re.compile(r"\b\d[\d,.]*\s?(ms|GFLOP/s|GB/s|tokens/s|samples/s|images/s)\b|\b\d+(\.\d+)?x (DDP|PyTorch|"
                    r"transformers|faster|main)\b")


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_tell_no_history_and_keep_figures_in_benchmarks(doc):
    text = prose(doc.read_text())
    history = [m.group(0) for m in HISTORY.finditer(text)]
    assert not history, f"{doc.name}: history belongs in git log, not the docs: {history}"
    if doc.name == "design.md":
        text = text.split("\n## Measured experiments\n", 1)[0]     # the one-off experiments keep their figures
    figures = [m.group(0) for m in FIGURE.finditer(text)]
    assert not figures, f"{doc.name}: measured figures belong in BENCHMARKS.md (link it): {figures}"


def _report():
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import common
        import report
    finally:
        sys.path.pop(0)
    return common, report


def _bench_results(common) -> dict:
    """A small results.json of the shape run.py writes: two rounds of every setup of one model, the GPT-2 124M
    section, BERT, the CNN and the components."""
    runs = {}
    for k, t in {"trainrun 2x1": 300, "PyTorch DDP 2x1": 200, "trainrun-off 2x1": 250, "ceiling 2x1": 310,
                 "ceiling-off 2x1": 260, "trainrun 1x2": 180, "PyTorch 1x2": 200, "trainrun-off 1x2": 170,
                 "ceiling 1x2": 200, "ceiling-off 1x2": 190}.items():
        runs[k] = [{"round": r, "tokens_per_sec": t + 10 * r, "peak_rss_mb": [t, t - 1],
                    "phase_shares": {"forward_backward": 0.9, "allreduce": 0.1}} for r in range(2)]
    g = {k: [{"round": 0, "tokens_per_sec": t, "outside_share": o, "phase_ms": {"forward_backward": 1000, "allreduce": a},
              "train_rss_mb": [rss, rss], "run_rss_mb": [rss + 100, rss]}]
         for k, t, o, a, rss in (("trainrun stage 0", 240, 0.02, 50, 2800), ("trainrun at 315f1e2", 190, 0.09, 230, 3500),
                                 ("PyTorch DDP", 160, 0.09, 0, 4300))}
    codes = {"trainrun stage 0": "current", "trainrun at 315f1e2": "before", "PyTorch DDP": "ddp"}
    return {
        "mode": "full", "started": "2026-01-01 00:00:00 UTC", "duration_s": 60, "load": [[0, 1.0], [1, 1.5]],
        "machine": {"cpu": "a CPU", "cores": 2}, "off": {"sets": ["engine.static_shapes=false"]},
        "peak": {"peak_gflops": 100.0}, "models": {"tiny": {"runs": runs}},
        "models_def": {"tiny": common.asdict_model(common.MODELS["tiny"])},
        "comm": {"rows": [{"floats": 544300, "blocking_ms": 0.3, "blocking_gbps": 8.0, "polled_ms": 0.3,
                           "polled_gbps": 7.5, "polled_share_of_raw_bw": 0.94, "memcpy_ms": 0.1, "memcpy_gbps": 20.0}]},
        "memcap": {"tiny": [{"micro_batch": 8, "trainrun": [300, 290], "off": [200, 190], "ddp": [500, 490]},
                            {"micro_batch": 64, "trainrun": [650, 640], "off": [500, 490], "ddp": [980, 970]}]},
        "data": {"steps": 100, "rows": [{"micro_batch": 8, "seq_len": 128, "prefetch": 2, "batches_per_s": 20000.0,
                                         "max_rss_growth_kb": 0}]},
        "gpt2-124m": {"model": common.asdict_model(common.MODELS["gpt2-124m"]), "ranks": 2, "threads_per_rank": 1,
                      "rounds": 1, "before": "315f1e2", "started": "2026-01-01", "runs": g,
                      "setups": {k: {"code": c, "bytes_per_param_per_node": {"total": 12 if c == "current" else 24}}
                                 for k, c in codes.items()},
                      "machine_start": {"peak": {"peak_gflops": 190.0}, "comm": {"rows": [{"memcpy_gbps": 11.0}]}}},
        "bert": {"shape": {"num_hidden_layers": 2, "hidden_size": 128, "vocab_size": 2048}, "seq_len": 128,
                 "global_batch": 32, "timed_steps": 50, "median_ratio": 1.6, "median_masked_head_ratio": 1.05,
                 "trainrun_tokens_per_s": [37000.0], "ddp_tokens_per_s": [23000.0],
                 "ddp_masked_head_tokens_per_s": [35000.0], "final_loss": {"trainrun": 6.7, "ddp": 6.7}},
        "cnn": {"median_ratio": 1.75, "timed_steps": 180, "trainrun_samples_per_s": [2700.0],
                "ddp_samples_per_s": [1550.0]},
    }


def _headline_rows(text: str) -> list[str]:
    head = text.split("## Headline\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in head.splitlines() if line.startswith("| ") and not line.startswith("| claim")]


def test_benchmarks_render_a_headline_then_a_section_per_claim():
    common, report = _report()
    text = report.render(_bench_results(common))
    sections = re.findall(r"^## (.*)$", text, re.M)
    assert sections[0] == "Headline", "BENCHMARKS.md opens with the headline table"
    assert len(set(sections)) == len(sections)
    rows = _headline_rows(text)
    assert len(rows) == 17, rows          # 5 of tiny's, 7 of 124M's, BERT, the CNN, allreduce, memory cap, loader
    linked = {re.search(r"\]\(#([^)]+)\)", row).group(1) for row in rows}
    assert linked == anchors_of("\n".join(f"## {s}" for s in sections[1:])), "a claim per section, each linked"
    assert "| trainrun 2x1 >= 1.3x PyTorch DDP 2x1 (tiny) | 1.49x | yes |" in text
    assert "| GPT-2 124M: tokens/s >= 1.15x trainrun at 315f1e2 | 1.26x (trainrun stage 0) | yes; 1 of 1 setups |" in text
    assert "| largest micro-batch under a per-rank cap >= DDP's (tiny) | 123 vs 69 | yes |" in text
    assert "issue" not in text.lower()
    assert len(text.splitlines()) < 120


def test_benchmarks_rendering_keeps_the_sections_it_did_not_render():
    common, report = _report()
    old = (ROOT / "BENCHMARKS.md").read_text()
    assert len(old.splitlines()) < 300 and old.split("\n## ", 1)[1].startswith("Headline\n")
    R = _bench_results(common)
    del R["cnn"], R["gpt2-124m"]
    merged = report.merge(old, report.render(R))
    for kept in ("## A CNN against PyTorch DDP", "## GPT-2 124M", "## Across 2 nodes over a slow link"):
        assert merged.count(kept) == 1 and old.split(kept, 1)[1].split("\n## ", 1)[0] in merged
    rows = _headline_rows(merged)
    assert [r for r in rows if "SqueezeNet" in r] == [r for r in _headline_rows(old) if "SqueezeNet" in r] != []
    assert sum("GPT-2 124M:" in r for r in rows) == 7
    assert "| trainrun 2x1 >= 1.3x PyTorch DDP 2x1 (tiny) | 1.49x | yes |" in merged     # this run's, not the old
    assert merged.count("## tiny and mid against PyTorch and the ceiling") == 1
    assert report.merge("", "# t\n\n## Headline\n\n| claim |\n") == "# t\n\n## Headline\n\n| claim |\n"


def test_benchmarks_a_section_measured_alone_replaces_only_its_own():
    """scripts/bench/builders.py renders its section alone (report.render_only): the last file's preamble,
    sections and headline rows stay; its own rows and section are added once, however often it runs."""
    common, report = _report()
    old = (ROOT / "BENCHMARKS.md").read_text()
    rnd = lambda g, r=None: {"graphs": g, "loadavg": [1.0, 1.0, 1.0], "started": "2026-01-01", "cpu": "a CPU",  # noqa: E731
                             **({"ratio": r} if r else {})}
    mid = {"nodes": {"onnxruntime": 700, "trainrun": 900},
           "time_1.19.2-training": [rnd({"onnxruntime": {"tokens_per_s": 100.0}, "trainrun": {"tokens_per_s": 98.0}},
                                        0.98)],
           "time_1.32.0": [rnd({"trainrun": {"tokens_per_s": 90.0}})],
           "peak_1.19.2-training": [{"graphs": {"onnxruntime": {"peak_rss_mb": 500.0},
                                                "trainrun": {"peak_rss_mb": 520.0}}}]}
    R = {"builders": {"models": {"mid": mid}}}
    once = report.merge(old, report.render_only(old, R))
    assert report.merge(once, report.render_only(once, R)) == once
    assert once.split("\n## ", 1)[0] == old.split("\n## ", 1)[0]
    for h in re.findall(r"^## .*$", old, re.M):
        assert once.count(h + "\n") == 1
    others = {r for r in _headline_rows(old) if f"]({report.anchor(report.BUILDERS)})" not in r}
    assert others < set(_headline_rows(once))
    assert "same run (mid) | 0.98x | yes |" in once
    assert "on stock onnxruntime 1.32.0 >= 0.95x the training build's (mid) | 0.90x | **no** |" in once
    assert "peak RSS <= 1.05x onnxruntime-training's (mid) | 1.04x | yes |" in once
    assert "| mid | 4 x 256 | 700 / 900 | 100 | 98 | 0.98 | 90 (1.32.0) | 0.90 | 500 / 520 | 1, 1.0–1.0 |" in once


def _smollm2_results(load0: float) -> dict:
    def side(tps, rss, opt, grad, **kw):
        return {"tokens_per_sec": tps, "train_rss_mb": rss, "optimizer_state_bytes": opt, "grad_bytes_per_step": grad,
                "wall_s": 60.0, **kw}
    ddp = dict(attn="sdpa", trainable_params=921600)
    return {"started": "2026-01-01 00:00 UTC", "machine": {"cpu": "a CPU", "cores": 2},
            "load": [load0, 2.0, 2.0, 2.0, 2.0],
            "full": {"trainrun": side(199.0, [3000.0, 2900.0], 1_076_000_000, 538_000_000),
                     "ddp": side(140.0, [4400.0, 4300.0], 1_076_000_000, 538_000_000, **ddp)},
            "lora": {"trainrun": side(320.0, [2000.0, 1900.0], 7_372_800, 3_686_400),
                     "ddp": side(200.0, [3000.0, 3000.0], 7_372_800, 3_686_400, **ddp)}}


def test_benchmarks_smollm2_section_states_the_load_and_the_full_and_lora_claims():
    """scripts/bench/smollm2.py's section: the measured load averages, "SHARED" and rough only where the load
    before any run was above LOAD_SHARED; a headline row for full fine-tuning and one for LoRA (tokens/s against
    DDP + peft, optimizer state and allreduced bytes against full fine-tuning's), replacing its old rows."""
    common, report = _report()
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import smollm2
    finally:
        sys.path.pop(0)
    old = (ROOT / "BENCHMARKS.md").read_text()
    args = argparse.Namespace(warmup=2, steps=3)
    link = f"]({report.anchor(smollm2.SECTION)})"
    idle = smollm2.render(_smollm2_results(0.4), args, old)
    assert smollm2.render(_smollm2_results(0.4), args, idle) == idle
    section = idle.split(smollm2.SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    assert "SHARED" not in section and "rough" not in section
    assert "idle before the runs (1-minute load average 0.40" in section and "0.40, 2.00, 2.00, 2.00, 2.00" in section
    rows = [r for r in _headline_rows(idle) if link in r]
    assert len(rows) == 2
    assert "| 1.42x, 3000 vs 4300 MB | yes (one run) |" in rows[0]
    assert "LoRA r 16" in rows[1] and "| 1.60x; 0.69% and 0.69% (peak RSS 2000 vs 3000 MB) | yes (one run) |" in rows[1]
    assert "| LoRA r 16 | trainrun | 320.0 | 2000 / 1900 | 7.4 | 3.7 |" in section
    shared = smollm2.render(_smollm2_results(3.96), args, old)
    section = shared.split(smollm2.SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    assert "SHARED with other jobs (1-minute load average 3.96 before any run" in section
    assert all("(one run on a shared box)" in r for r in _headline_rows(shared) if link in r)


def anchors_of(text: str) -> set[str]:
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^## (.*)$", text, re.M)}
