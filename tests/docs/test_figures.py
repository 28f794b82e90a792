"""Every figure on a user page and in the README comes from bench/results, labelled with where
it was measured (bench/README.md, "Figures in the docs", states the rule).

A figure stands in the Markdown between markers, ``<!-- fig:e2e.fire -->26,804/s<!-- /fig -->``,
written by ``python -m timer_bench render``: a page whose marked figures are not what
bench/results give (stale, or edited by hand), or that still holds a ``{{ e2e.fire }}``
placeholder, fails. The rule for "a figure typed by hand", on each page's own text (code
removed, the marked figures removed): no number in the shape a measurement takes (a rate,
a ratio like 1.03x, a percentile, a percentage, microseconds, a memory size other than the
documented limits below), and in any paragraph that speaks of a measurement (measured,
benchmark, bench/), no number with a unit of time, share or memory at all. A section using
a results file's figures also names it, by its ``source`` or ``label``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT
from tests.docs.test_failures_page import page_figures
from timer_bench import pages
from timer_bench.figures import figures

#: The site's own pages, the README and the changelog.
PAGES = list(pages.DOCUMENTS)
#: Sizes the docs state as limits or settings, not as measurements.
LIMITS = {
    "1 MiB": "message size limit",
    "32 MiB": "SQLite page cache",
    "64 MiB": "WAL limit",
    "128 MB": "PostgreSQL's default shared_buffers",
}
#: Sizes that are no measurement of Timer's speed, each with what keeps it true.
NOT_MEASURED = {
    "110 MB": "README.md: the tests' download (PyPI's wheels)",
    "360 MB": "README.md: the same, installed",
}


def checked_sizes() -> set[str]:
    """The sizes "Operating through failures" states that its own test measures against a real
    nats-server (``tests/docs/test_failures_page.py``): a command's and an event's bytes in
    the streams, and what 100,000 of each a day come to over the streams' 7 days."""
    per_command, per_event = page_figures()
    week_gb = (per_command + per_event) * 100_000 * 7 / 1e9
    return {f"{per_command} bytes", f"{per_event} bytes", f"{week_gb:.1f} GB"}


_FENCED = re.compile(r"^(\s*)(```+|~~~+).*?^\1\2[ \t]*$", re.M | re.S)
_CODE = re.compile(r"`[^`\n]+`")
_FIGURE = re.compile(r"<!-- fig:([a-z0-9_]+)\.([a-z0-9_]+) -->")
_SHAPES = {
    "a rate": re.compile(r"\d[\d,.]*\s*(?:[a-z]+/s\b|/s\b|(?:per|a) second\b)"),
    "a ratio": re.compile(r"\b\d+(?:\.\d+)?x\b"),
    "a percentile": re.compile(r"\bp(?:50|90|95|99)\b:?\s*[<~]?\s*\d"),
    "a percentage": re.compile(r"\d+(?:\.\d+)?\s?%"),
    "microseconds": re.compile(r"\d+(?:\.\d+)?\s?us\b"),
    "a memory size": re.compile(r"\d+(?:\.\d+)?\s?(?:[KMGT]i?B|kB|bytes)\b"),
}
_MEASURED = re.compile(r"(?i)\bmeasured\b|\bbenchmark|\bbench/|timer_bench")
_UNIT = re.compile(r"\d[\d,.]*\s?(?:ms|us|s|%|x|MiB|GiB|cores?)\b")


def prose(path: Path) -> str:
    """A page's own text: no code blocks, code spans, marked figures or HTML comments (each
    marked figure's opening marker is kept, to say which results file the text cites)."""
    text = _FENCED.sub("", without_figures(path.read_text()))
    return _CODE.sub("", re.sub(r"<!--(?! fig:).*?-->", "", text, flags=re.S))


def without_figures(text: str) -> str:
    """``text`` with each marked figure's text removed, its opening marker kept."""
    return pages.MARKED.sub(lambda m: f"<!-- fig:{m[1]} -->", text)


def blocks(text: str) -> Iterator[str]:
    """Paragraphs, list items and table rows."""
    for paragraph in re.split(r"\n\s*\n", text):
        yield from re.split(r"\n(?=\s*(?:[-*] |\d+\. |\|))", paragraph)


def typed_figures(text: str) -> list[str]:
    """What in ``text`` reads as a figure typed by hand (marked figures removed first)."""
    found, allowed = [], {*LIMITS, *NOT_MEASURED, *checked_sizes()}
    for block in blocks(re.sub(r"<!--.*?-->", "", without_figures(text), flags=re.S)):
        for what, shape in _SHAPES.items():
            found += [
                f"{what}: {m[0]!r} in {block.strip()[:80]!r}"
                for m in shape.finditer(block)
                if " ".join(m[0].split()) not in allowed
            ]
        if _MEASURED.search(block):
            found += [
                f"a measured number: {m[0]!r} in {block.strip()[:80]!r}"
                for m in _UNIT.finditer(block)
                if m[0] not in allowed
            ]
    return sorted(set(found))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
class TestUserPages:
    def test_figures_are_rendered_from_the_results(self, page: Path) -> None:
        """Every marked figure is what bench/results give, and no placeholder is left."""
        assert pages.stale([page]) == [], "run `uv run python -m timer_bench render`"

    def test_figures_come_from_the_results(self, page: Path) -> None:
        """No figure on the page is typed by hand: each is a marked, rendered figure."""
        assert typed_figures(prose(page)) == []

    def test_each_section_says_where_its_figures_were_measured(self, page: Path) -> None:
        """A section that shows a results file's figures shows its source or label too."""
        for section in re.split(r"(?m)^## ", prose(page)):
            used = {name for name, _ in _FIGURE.findall(section)}
            cited = {name for name, what in _FIGURE.findall(section) if what in ("source", "label")}
            assert used <= cited, f"{section.splitlines()[0]!r}: {sorted(used - cited)}"


class TestTheRule:
    @pytest.mark.parametrize(
        "typed",
        [
            "It fires 26,804 timers/s.",
            "at 1.03x the raw loop",
            "p99 7 ms under load",
            "about 5% more CPU",
            "the hooks cost 0.8 us",
            "peaked at 128 MiB",
            "Measured on the fire path: drained in 72.9 s.",
        ],
    )
    def test_a_typed_figure_is_caught(self, typed: str) -> None:
        """Each shape a hand-typed measurement takes is found."""
        assert typed_figures(typed) != []

    @pytest.mark.parametrize(
        "fine",
        [
            "It fires <!-- fig:e2e.fire -->26,804/s<!-- /fig --> "
            "(<!-- fig:e2e.label -->one service, 2 cores<!-- /fig -->).",
            "A message is at most 1 MiB; the lease lasts 30 s.",
            "Retries back off from 50 ms up to the polling interval.",
        ],
    )
    def test_rendered_figures_and_settings_pass(self, fine: str) -> None:
        """Rendered figures, documented limits and settings outside a measurement pass."""
        assert typed_figures(fine) == []

    def test_a_hand_edited_figure_is_stale(self) -> None:
        """A marked figure changed by hand is rewritten by the render, so the page is stale."""
        known = figures()
        page = f"fires {pages.marked('e2e.fire', known['e2e.fire'])} a second"
        assert pages.fill(page, known) == page
        edited = page.replace(known["e2e.fire"], "99,999/s")
        assert pages.fill(edited, known) == page

    def test_a_placeholder_is_rendered_and_code_is_left_alone(self) -> None:
        """``{{ e2e.fire }}`` becomes the marked figure; in a code span or block it stays."""
        known = figures()
        assert pages.fill("fires {{ e2e.fire }}", known) == (
            f"fires <!-- fig:e2e.fire -->{known['e2e.fire']}<!-- /fig -->"
        )
        code = "write `{{ e2e.fire }}`\n\n```\n{{ e2e.fire }}\n```\n"
        assert pages.fill(code, known) == code

    def test_an_unknown_figure_is_refused(self) -> None:
        """A name no results file gives is an error naming it."""
        with pytest.raises(pages.UnknownFigure, match=r"e2e\.nothing"):
            pages.fill("{{ e2e.nothing }}", figures())
