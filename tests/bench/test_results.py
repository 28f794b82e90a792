"""bench/README.md's tables and the docs' figures come from bench/results, and the kit reads
every results file there; these tests fail when the two part ways."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from mkdocs.exceptions import PluginError

from timer_bench import compare, docs_hook, figures, kit, pages, render
from timer_bench.__main__ import SCENARIOS


class TestReadme:
    def test_tables_are_rendered_from_the_results(self) -> None:
        """The README is what `python -m timer_bench render` makes of bench/results."""
        text = render.README.read_text()
        assert render.readme(text) == text, "run `uv run python -m timer_bench render`"

    def test_every_scenario_has_its_table(self) -> None:
        """Each scenario's results have a block in the README, and each block a scenario."""
        blocks = set(render.MARKERS.findall(render.README.read_text()))
        assert {name for _, name, _, _ in blocks} == set(SCENARIOS) == set(render.BLOCKS)

    def test_every_results_file_is_read_by_the_kit(self) -> None:
        """No results file lies in bench/results that no scenario writes (``--quick`` runs'
        files are not kept)."""
        files = {p.stem for p in kit.RESULTS.glob("*.json") if not p.stem.startswith("quick-")}
        assert files <= set(SCENARIOS)

    def test_a_stale_table_is_rewritten(self, tmp_path: Path) -> None:
        """A block whose text is not its file's rendering gets the rendering."""
        stale = "<!-- results:fairness -->\nhand-typed 1,234/s\n<!-- /results:fairness -->"
        fresh = render.readme(stale)
        assert "1,234/s" not in fresh and "python -m timer_bench fairness" in fresh


class TestDocsFigures:
    def test_every_docs_figure_is_rendered(self) -> None:
        """Each results file the docs use gives its figures and the sentence that cites them."""
        named = figures.figures()
        for name in figures.PAGES:
            prefix = name.replace("-", "_")
            assert named[f"{prefix}.source"].startswith("Measured on ")
            assert "cores" in named[f"{prefix}.label"]

    def test_the_hook_refuses_unrendered_stale_and_unknown_figures(self) -> None:
        """A rendered page builds as it is; a placeholder, a figure edited by hand and a name no
        results file gives each fail the build, naming the page."""
        page = SimpleNamespace(file=SimpleNamespace(src_path="page.md"))
        fire = figures.figures()["e2e.fire"]
        rendered = f"fires {pages.marked('e2e.fire', fire)}"
        assert docs_hook.on_page_markdown(rendered, page=page) == rendered
        for wrong in ("fires {{ e2e.fire }}", rendered.replace(fire, "1/s"), "{{ e2e.nothing }}"):
            with pytest.raises(PluginError, match=r"page\.md"):
                docs_hook.on_page_markdown(wrong, page=page)


class TestComparison:
    def test_results_are_for_the_pinned_peers(self) -> None:
        """The comparison was made with the versions the kit pins, and the peers'
        environment it recorded holds each of them at that version."""
        document = kit.read_result("compare")
        assert document["peers"] == compare.PEERS
        frozen = dict(line.lower().split("==") for line in document["peer_environment"])
        for requirement, version in compare.PEERS.items():
            assert frozen[requirement.split("[")[0]] == version, requirement

    @pytest.mark.parametrize(
        ("scenario", "systems"),
        [("compare", compare.SYSTEMS), ("compare-pending", compare.PENDING_SYSTEMS.split(","))],
    )
    def test_every_system_ran_every_round(self, scenario: str, systems: Sequence[str]) -> None:
        """Every system of the race has one result per round, each with lateness measured."""
        document = kit.read_result(scenario)
        assert set(document["systems"]) == set(systems)
        for name, results in document["rounds"].items():
            assert len(results) == document["settings"]["rounds"], name
            assert all(r["lateness"]["count"] > 0 for r in results), name
