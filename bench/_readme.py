"""Rewriting one benchmark's own section of bench/README.md, and nothing else."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).with_name("README.md")


def write_section(heading: str, body: str, readme: Path = README) -> None:
    """Replace the section under ``heading`` (up to the next ``## ``) by ``body``, or append it."""
    text = readme.read_text() if readme.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.rstrip()}\n"
    if heading in text:
        before, rest = text.split(heading, 1)
        after = rest[rest.find("\n## ") + 1 :] if "\n## " in rest else ""
        text = before + section + ("\n" + after if after else "")
    else:
        text = text.rstrip() + "\n\n" + section
    readme.write_text(text)
