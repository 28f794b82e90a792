"""The shipped store contract catches bugs a custom store can make (issue 44's four)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.timer_core.planted import PLANTED

ROOT = Path(__file__).resolve().parents[2]

#: The contract test that catches each planted bug.
CAUGHT_BY = {
    "CancelDropsTombstone": "test_plain_cancel_keeps_a_tombstone_already_there",
    "CancelOfReachedDropsPosition": "test_plain_cancel_of_a_reached_timer_keeps_its_position",
    "KeepsTheCallersEntry": "test_a_stored_timer_never_carries_the_callers_claim",
    "FindsByTenantEarly": "test_no_find_returns_a_timer_a_millisecond_early",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bool]]:
    """The contract run against the reference store and each planted one, in a pytest of its
    own: ``{class: {test: passed}}``."""
    report = tmp_path_factory.mktemp("planted") / "report.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "tests/timer_core/planted_contract.py",
        ],
        cwd=ROOT,
        capture_output=True,
        check=False,
        timeout=600,
    )
    outcomes: dict[str, dict[str, bool]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("Test")
        failed = any(child.tag in ("failure", "error") for child in case)
        outcomes.setdefault(cls, {})[case.get("name", "")] = not failed
    return outcomes


class TestPlantedBugs:
    def test_the_reference_store_passes_the_whole_contract(
        self, results: dict[str, dict[str, bool]]
    ) -> None:
        """The unplanted memory store passes every test the planted ones are run through."""
        assert len(results["Reference"]) >= 80
        assert [name for name, passed in results["Reference"].items() if not passed] == []

    @pytest.mark.parametrize("bug", sorted(PLANTED))
    def test_each_planted_bug_fails_the_contract(
        self, results: dict[str, dict[str, bool]], bug: str
    ) -> None:
        """Each planted store fails the contract at the test written for its bug, and only the
        bug's own tests fail (the rest of the store is the reference's)."""
        failed = [name for name, passed in results[bug].items() if not passed]
        assert failed == [CAUGHT_BY[bug]]
        assert len(results[bug]) == len(results["Reference"])
