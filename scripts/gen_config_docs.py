"""Writes docs/configuration.md from the config schema (``make docs``).

tests/test_docs.py fails when the file differs from what this writes.
"""

from pathlib import Path

from trainrun.config import markdown_reference

out = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
out.write_text(markdown_reference())
print(f"wrote {out}")
