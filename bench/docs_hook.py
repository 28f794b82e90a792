"""mkdocs hook: the Benchmarks page's detailed log, each section of bench/README.md as a
collapsible note (``??? note``), so the page opens with its summary, not with the log.

docs/benchmarks.md holds the marker below where the sections go; bench/README.md stays the
one file the benchmark scripts write (each rewrites its own ``## `` section).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).with_name("README.md")
MARKER = "<!-- bench:log -->"


def collapsible_sections(text: str) -> str:
    """Every ``## `` section of ``text`` as a collapsed admonition titled by its heading."""
    notes = []
    for section in re.split(r"(?m)^## ", text)[1:]:
        title, _, body = section.partition("\n")
        lines = body.strip("\n").splitlines()
        indented = "\n".join(f"    {line}" if line.strip() else "" for line in lines)
        notes.append(f'??? note "{title.strip()}"\n\n{indented}\n')
    return "\n".join(notes)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, collapsible_sections(README.read_text()))
