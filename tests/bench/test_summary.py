"""The headline figures of the docs come from one results file and cannot disagree.

docs/benchmarks.md and the Sizing section of docs/operations.md include files that
bench/summary.py renders from bench/results/latest.json; these tests fail when those files
are stale or when a page grows hand-written figures of its own.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _summary_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_summary", ROOT / "bench" / "summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = _summary_module()


def _sizing_section() -> str:
    text = (DOCS / "operations.md").read_text()
    return text.split("## Sizing\n", 1)[1].split("\n## ", 1)[0]


class TestHeadlineFigures:
    def test_rendered_files_match_the_latest_results(self) -> None:
        """summary.md and sizing.md are exactly what bench/summary.py makes of latest.json."""
        document = json.loads(summary.LATEST.read_text())
        assert document["mode"] == "full"
        assert summary.SUMMARY.read_text() == summary.summary_markdown(document)
        assert summary.SIZING.read_text() == summary.sizing_markdown(document)

    def test_both_pages_include_the_rendered_figures(self) -> None:
        """The Benchmarks page opens with the summary; Sizing includes the sizing figures."""
        benchmarks = (DOCS / "benchmarks.md").read_text()
        first_block = benchmarks.split("\n\n")[1]
        assert first_block.strip() == '--8<-- "bench/results/summary.md"'
        assert '--8<-- "bench/results/sizing.md"' in _sizing_section()

    def test_sizing_states_no_rate_of_its_own(self) -> None:
        """Outside the included file, the Sizing section writes down no throughput figure."""
        rates = re.findall(r"\d[\d,.]*\s*(?:/s|per second|timers/s|commands/s)", _sizing_section())
        assert rates == []

    def test_both_renderings_carry_the_same_figures(self) -> None:
        """The firing, scheduling and storm figures appear alike in the summary and sizing."""
        document = json.loads(summary.LATEST.read_text())
        figures = summary.figures(document)
        for text in (summary.summary_markdown(document), summary.sizing_markdown(document)):
            for key in ("schedule_per_s", "fire_default_per_s", "fire_big_per_s", "storm_s"):
                assert figures[key] in text, key

    def test_a_quick_run_is_refused(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """bench/summary.py will not publish the figures of a --quick run."""

        latest = tmp_path / "latest.json"
        latest.write_text(json.dumps({"mode": "quick"}))

        monkeypatch.setattr(summary, "LATEST", latest)
        assert summary.main() == 2
