"""Every figure on a user page comes from bench/results, labelled with where it was measured.

The rule for "a figure typed by hand", on each page's own text (code removed, the rendered
``{{ file.figure }}`` places removed): no number in the shape a measurement takes (a rate,
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

from tests.docs.markdown import DOCS

#: The site's own pages (the changelog's figures are history, not claims).
PAGES = sorted(DOCS.glob("*.md"))
#: Sizes the docs state as limits or settings, not as measurements.
LIMITS = {"1 MiB": "message size limit", "32 MiB": "SQLite page cache", "64 MiB": "WAL limit"}

_FENCED = re.compile(r"^(\s*)(```+|~~~+).*?^\1\2[ \t]*$", re.M | re.S)
_CODE = re.compile(r"`[^`\n]+`")
_FIGURE = re.compile(r"\{\{\s*([a-z0-9_]+)\.([a-z0-9_]+)\s*\}\}")
_SHAPES = {
    "a rate": re.compile(r"\d[\d,.]*\s*(?:[a-z]+/s\b|/s\b|(?:per|a) second\b)"),
    "a ratio": re.compile(r"\b\d+(?:\.\d+)?x\b"),
    "a percentile": re.compile(r"\bp(?:50|90|95|99)\b:?\s*[<~]?\s*\d"),
    "a percentage": re.compile(r"\d+(?:\.\d+)?\s?%"),
    "microseconds": re.compile(r"\d+(?:\.\d+)?\s?us\b"),
    "a memory size": re.compile(r"\d+(?:\.\d+)?\s?(?:MiB|GiB)\b"),
}
_MEASURED = re.compile(r"(?i)\bmeasured\b|\bbenchmark|\bbench/|timer_bench")
_UNIT = re.compile(r"\d[\d,.]*\s?(?:ms|us|s|%|x|MiB|GiB|cores?)\b")


def prose(path: Path) -> str:
    """A page's own text: no code blocks, code spans or HTML comments."""
    text = _FENCED.sub("", path.read_text())
    return _CODE.sub("", re.sub(r"<!--.*?-->", "", text, flags=re.S))


def blocks(text: str) -> Iterator[str]:
    """Paragraphs, list items and table rows."""
    for paragraph in re.split(r"\n\s*\n", text):
        yield from re.split(r"\n(?=\s*(?:[-*] |\d+\. |\|))", paragraph)


def typed_figures(text: str) -> list[str]:
    """What in ``text`` reads as a figure typed by hand (rendered figures removed first)."""
    found = []
    for block in blocks(_FIGURE.sub("", text)):
        for what, shape in _SHAPES.items():
            found += [
                f"{what}: {m[0]!r} in {block.strip()[:80]!r}"
                for m in shape.finditer(block)
                if m[0] not in LIMITS
            ]
        if _MEASURED.search(block):
            found += [
                f"a measured number: {m[0]!r} in {block.strip()[:80]!r}"
                for m in _UNIT.finditer(block)
                if m[0] not in LIMITS
            ]
    return sorted(set(found))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
class TestUserPages:
    def test_figures_come_from_the_results(self, page: Path) -> None:
        """No figure on the page is typed by hand: each is a ``{{ file.figure }}``."""
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
            "It fires {{ e2e.fire }} ({{ e2e.label }}).",
            "A message is at most 1 MiB; the lease lasts 30 s.",
            "Retries back off from 50 ms up to the polling interval.",
        ],
    )
    def test_rendered_figures_and_settings_pass(self, fine: str) -> None:
        """Rendered figures, documented limits and settings outside a measurement pass."""
        assert typed_figures(fine) == []
