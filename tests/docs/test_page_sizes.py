"""Pages kept short enough to be read: Operations is one page an operator reads through, and
the release notes are notes, not a log. Words are counted as a reader meets them: everything
on the page, tables and code included."""

from __future__ import annotations

import re

from tests.docs.markdown import DOCS, ROOT

#: The most words each may hold.
OPERATIONS_WORDS = 4_000
RELEASE_NOTES_WORDS = 1_500


def words(text: str) -> int:
    return len(text.split())


def release_sections() -> dict[str, str]:
    """CHANGELOG.md's sections by their heading (``[0.1.0] - ...``, ``[Unreleased]``)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    parts = re.split(r"(?m)^## ", text)[1:]
    return {part.splitlines()[0]: part for part in parts}


def test_operations_fits_its_budget() -> None:
    """docs/operations.md holds at most 4,000 words."""
    count = words((DOCS / "operations.md").read_text())
    assert count <= OPERATIONS_WORDS, f"operations.md has {count} words"


def test_each_release_fits_its_budget() -> None:
    """Each release's notes (0.1.0 and what is not released yet alike) hold at most 1,500."""
    sections = release_sections()
    assert any(heading.startswith("[0.1.0]") for heading in sections), list(sections)
    too_long = {h: words(s) for h, s in sections.items() if words(s) > RELEASE_NOTES_WORDS}
    assert too_long == {}
