"""The user docs: the configuration reference matches the schema, every relative link resolves,
the README stays a short entry point that reaches every page, and the user docs tell no history
and keep measured figures in BENCHMARKS.md."""

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
        "docs/configuration.md is out of date with trainrun/config.py: run `make docs`"
    for section in ("run", "model", "model.gpt2", "optimizer", "distributed"):
        assert f"## `{section}`" in text
    assert "| `optimizer.name` | `adamw` | `adam`, `adamw`, `lamb`, `sgd` |" in text


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
    figures = [m.group(0) for m in FIGURE.finditer(text)]
    assert not figures, f"{doc.name}: measured figures belong in BENCHMARKS.md (link it): {figures}"


def test_benchmarks_rendering_keeps_the_hand_kept_part():
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import report
    finally:
        sys.path.pop(0)
    old = (ROOT / "BENCHMARKS.md").read_text()
    kept = report.keep_by_hand(old, "# trainrun benchmarks\n\nrendered\n")
    assert kept.startswith("# trainrun benchmarks\n\nrendered\n\n" + report.BEGIN_HAND)
    assert old.split(report.BEGIN_HAND, 1)[1] in kept
    assert report.keep_by_hand("", "new\n") == "new\n"
