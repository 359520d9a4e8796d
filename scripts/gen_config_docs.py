"""Writes the generated docs (``make docs``): docs/configuration.md from the config schema, and the table of
ops with gradient rules in docs/models.md from trainrun's gradient builder.

tests/test_docs.py fails when either differs from what this writes.
"""

from pathlib import Path

from trainrun.config import markdown_reference
from trainrun.graphs.autodiff import ops_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"
BEGIN = "<!-- generated from trainrun/graphs/autodiff (covered_ops): make docs -->\n"
END = "<!-- end of generated table -->\n"


def with_ops_table(text: str) -> str:
    """``text`` (docs/models.md) with the table between BEGIN and END written anew."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"docs/models.md: the markers {BEGIN.strip()} ... {END.strip()} are missing")
    return head + BEGIN + ops_markdown() + END + tail


if __name__ == "__main__":
    out = DOCS / "configuration.md"
    out.write_text(markdown_reference())
    print(f"wrote {out}")
    models = DOCS / "models.md"
    models.write_text(with_ops_table(models.read_text()))
    print(f"wrote the ops table in {models}")
