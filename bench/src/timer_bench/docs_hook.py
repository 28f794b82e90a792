"""mkdocs hook: ``{{ e2e.fire }}`` in a page becomes that figure, formatted from
bench/results (:mod:`timer_bench.figures`); a name no results file gives fails the build."""

from __future__ import annotations

import re
from typing import Any

from mkdocs.exceptions import PluginError

from timer_bench.figures import figures

#: A figure's place in a page: ``{{ file.figure }}``.
FIGURE = re.compile(r"\{\{\s*([a-z0-9_]+\.[a-z0-9_]+)\s*\}\}")

_figures: dict[str, str] | None = None


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    global _figures
    if "{{" not in markdown:
        return markdown
    if _figures is None:
        _figures = figures()
    known = _figures

    def figure(match: re.Match[str]) -> str:
        name = match[1]
        if name not in known:
            raise PluginError(f"{page.file.src_path}: no figure {name!r} in bench/results")
        return known[name]

    return FIGURE.sub(figure, markdown)
