"""The figures of the docs pages and the README, written into the Markdown files themselves.

A page holds a figure as ``<!-- fig:e2e.fire -->26,804/s<!-- /fig -->``: a code host shows
the figure and hides the markers, and ``python -m timer_bench render`` rewrites what is
between them from bench/results (:mod:`timer_bench.figures` names them). A writer types
``{{ e2e.fire }}`` where a figure goes; ``render`` turns it into the marked figure. A
figure between markers that is not its results file's (stale, or edited by hand) and a
``{{ ... }}`` left unrendered fail ``render --check``, the docs build and the suite.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from timer_bench import kit
from timer_bench.figures import Figures, figures

ROOT = kit.RESULTS.parents[1]
#: The Markdown files whose figures come from bench/results.
DOCUMENTS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md")

_NAME = r"[a-z0-9_]+\.[a-z0-9_]+"
#: A figure written into a page: its name, then its text.
MARKED = re.compile(rf"<!-- fig:({_NAME}) -->(.*?)<!-- /fig -->", re.S)
#: Where a writer wants a figure: ``{{ file.figure }}``.
PLACEHOLDER = re.compile(rf"\{{\{{\s*({_NAME})\s*\}}\}}")
#: What a page's text holds that matters here, each found whole: a marked figure (its text
#: may hold code spans), a code span (a placeholder in it is left alone), a placeholder.
_TOKENS = re.compile(
    rf"<!-- fig:(?P<marked>{_NAME}) -->.*?<!-- /fig -->|``.+?``|`[^`\n]+`"
    rf"|\{{\{{\s*(?P<placeholder>{_NAME})\s*\}}\}}",
    re.S,
)
#: Fenced code blocks: their text is code, not figures.
_FENCED = re.compile(r"^([ \t]*)(```+|~~~+).*?^\1\2[ \t]*$", re.M | re.S)


class UnknownFigure(ValueError):
    """A page names a figure no results file gives."""


def marked(name: str, text: str) -> str:
    """``text`` between the markers of figure ``name``; a table (several lines) stands in a
    block of its own, so that Markdown still reads it as a table."""
    if "\n" in text:
        return f"<!-- fig:{name} -->\n\n{text}\n\n<!-- /fig -->"
    return f"<!-- fig:{name} -->{text}<!-- /fig -->"


def _outside_code(text: str, change: Callable[[str], str]) -> str:
    parts, at = [], 0
    for block in _FENCED.finditer(text):
        parts += [change(text[at : block.start()]), block[0]]
        at = block.end()
    return "".join([*parts, change(text[at:])])


def fill(text: str, known: Figures, where: str = "page") -> str:
    """``text`` with every placeholder and every marked figure written from ``known`` (code
    blocks and code spans left as they are: a placeholder in code is an example of one)."""

    def figure(match: re.Match[str]) -> str:
        name = match["marked"] or match["placeholder"]
        if name is None:  # a code span
            return match[0]
        if name not in known:
            raise UnknownFigure(f"{where}: no figure {name!r} in bench/results")
        return marked(name, known[name])

    return _outside_code(text, lambda part: _TOKENS.sub(figure, part))


def stale(documents: Iterable[Path] = DOCUMENTS, known: Figures | None = None) -> list[Path]:
    """The documents whose figures are not what bench/results give."""
    known = figures() if known is None else known
    return [
        path for path in documents if (text := path.read_text()) != fill(text, known, path.name)
    ]


def write(documents: Iterable[Path] = DOCUMENTS) -> list[Path]:
    """Render every document's figures; the documents that changed."""
    known, changed = figures(), []
    for path in documents:
        text = path.read_text()
        fresh = fill(text, known, path.name)
        if fresh != text:
            path.write_text(fresh)
            changed.append(path)
    return changed


def main(*, check: bool) -> int:
    """``render``'s part for the docs: write the figures, or (``check``) exit 1 if stale."""
    if check:
        old = stale()
        for path in old:
            print(f"{path.relative_to(ROOT)}: figures stale or unrendered", file=sys.stderr)
        if old:
            print("run `uv run python -m timer_bench render`", file=sys.stderr)
        return 1 if old else 0
    for path in write():
        print(f"rendered the figures of {path.relative_to(ROOT)}")
    return 0
