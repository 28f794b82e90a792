"""mkdocs hook: a page whose figures are not bench/results' (a ``{{ e2e.fire }}`` not yet
rendered, a figure stale or edited between its markers) fails the build, naming the
command that fixes it (:mod:`timer_bench.pages` writes the figures into the pages)."""

from __future__ import annotations

from typing import Any

from mkdocs.exceptions import PluginError

from timer_bench import pages
from timer_bench.figures import Figures, figures

_figures: Figures | None = None


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    global _figures
    if "{{" not in markdown and "<!-- fig:" not in markdown:
        return markdown
    if _figures is None:
        _figures = figures()
    try:
        fresh = pages.fill(markdown, _figures, page.file.src_path)
    except pages.UnknownFigure as exc:
        raise PluginError(str(exc)) from None
    if fresh != markdown:
        raise PluginError(
            f"{page.file.src_path}: figures stale or unrendered; "
            "run `uv run python -m timer_bench render`"
        )
    return markdown
