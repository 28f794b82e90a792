"""docs/design.md's map of bench/ names the modules that are there, every one of them."""

from __future__ import annotations

import re
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_BENCH = _ROOT / "bench" / "src" / "timer_bench"


def _bench_row() -> str:
    rows = [
        line
        for line in (_ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `bench/` |")
    ]
    assert len(rows) == 1, rows
    return rows[0]


class TestDesignMapOfBench:
    def test_every_module_named_exists(self) -> None:
        """Each ``.py`` file the map names is a module of bench/src/timer_bench."""
        named = set(re.findall(r"`([\w]+\.py)`", _bench_row()))
        assert named, "the map names no module"
        assert {name for name in named if not (_BENCH / name).is_file()} == set()

    def test_every_module_is_named(self) -> None:
        """Every module of bench/src/timer_bench (but the package's ``__init__``) is on the
        map, so a new scenario or a renamed one shows here."""
        named = set(re.findall(r"`([\w]+\.py)`", _bench_row()))
        present = {path.name for path in _BENCH.glob("*.py")} - {"__init__.py"}
        assert present - named == set()
