"""The project's Markdown for the docs tests: the files, their code blocks, their tables."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sybil import Document, Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser

from timer_core.codec import decode_envelope

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: Every Markdown file whose Python code blocks must run: the docs and the README.
DOCUMENTS = [*sorted(DOCS.glob("**/*.md")), ROOT / "README.md"]

_FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")


def check_json(example: Example) -> str | None:
    """A ``json`` block must parse; one that looks like an envelope must decode as one."""
    try:
        value: Any = json.loads(example.parsed)
    except ValueError as exc:
        return f"not valid JSON: {exc}"
    if isinstance(value, dict) and "payload" in value and "type" in value:
        decode_envelope(json.dumps(value))
    return None


SYBIL = Sybil(parsers=[PythonCodeBlockParser(), CodeBlockParser("json", check_json)])


def parse(path: Path) -> Document:
    """The document with its Python and JSON blocks as examples."""
    return SYBIL.parse(path)


def fences_without_language(path: Path) -> list[int]:
    """Line numbers of fenced blocks opened without a language (they would be ambiguous)."""
    missing: list[int] = []
    open_fence: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _FENCE.match(line)
        if match is None:
            continue
        fence, info = match.group(2), match.group(3).strip()
        if open_fence is None:
            open_fence = fence
            if not info:
                missing.append(number)
        elif fence.startswith(open_fence) and not info:
            open_fence = None
    return missing


def table_rows(path: Path) -> list[list[str]]:
    """The cells of every Markdown table row (header and separator rows included)."""
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|"):
            rows.append([cell.strip() for cell in line[1:-1].split("|")])
    return rows
