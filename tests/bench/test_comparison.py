"""The comparison page's figures come from bench/compare/run.py's results file, with the
peers' versions the script pins; these tests fail when the page and the file part ways."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
COMPARE = ROOT / "bench" / "compare"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"compare_{name}", COMPARE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _module("render")
run = _module("run")


class TestComparisonPage:
    def test_rendered_table_matches_the_results(self) -> None:
        """bench/results/comparison.md is exactly what render.py makes of compare.json."""
        document = json.loads(render.COMPARE.read_text())
        assert render.TABLE.read_text() == render.render(document)

    def test_page_includes_the_rendered_table(self) -> None:
        """docs/comparison.md shows the rendered file, not figures typed by hand."""
        page = (ROOT / "docs" / "comparison.md").read_text()
        assert '--8<-- "bench/results/comparison.md"' in page
        assert re.findall(r"\d[\d,]*/s", page) == []

    def test_results_are_for_the_pinned_peers(self) -> None:
        """The results file was made with the versions run.py pins, and the peers'
        environment it recorded holds each of them at that version."""
        document = json.loads(render.COMPARE.read_text())
        assert document["peers"] == run.PEERS
        frozen = {
            line.split("==")[0].lower(): line.split("==")[1]
            for line in document["peer_environment"]
        }
        for requirement, version in run.PEERS.items():
            assert frozen[requirement.split("[")[0]] == version, requirement

    def test_every_system_ran_every_round(self) -> None:
        """Timer, pgqueuer and APScheduler each have one result per round, medians taken."""
        document = json.loads(render.COMPARE.read_text())
        rounds = document["settings"]["rounds"]
        assert set(document["systems"]) == {"timer", "pgqueuer", "apscheduler"}
        for name, results in document["rounds"].items():
            assert len(results) == rounds, name
            assert all(r["lateness"]["count"] > 0 for r in results), name
