"""``bench/run.py --quick`` runs end to end in the normal suite, so the harness never rots.

It checks what the harness checks (nothing lost, nothing early, drained in due order), never
the figures: those mean something only on a quiet machine with the full sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "bench" / "run.py"
SCENARIOS = {"yardsticks", "schedule", "fire", "storm", "steady", "catchup", "scale"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    """One ``--quick`` run of the harness: its exit code, its output, its JSON result."""
    output = tmp_path_factory.mktemp("bench") / "quick.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
    done = subprocess.run(
        [sys.executable, str(HARNESS), "--quick", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    log = done.stdout + done.stderr
    result = json.loads(output.read_text()) if output.exists() else {}
    return done.returncode, log, result


class TestQuickHarness:
    """The quick harness completes and every correctness check in it holds."""

    def test_exits_zero_with_every_check_passing(
        self, quick_run: tuple[int, str, dict[str, Any]]
    ) -> None:
        """The run exits 0 and no check failed (lost, early or out-of-order timers)."""
        code, log, result = quick_run
        failed = [c for c in result.get("checks", []) if not c["ok"]]
        assert code == 0, log[-3000:]
        assert failed == [], failed

    def test_every_scenario_ran(self, quick_run: tuple[int, str, dict[str, Any]]) -> None:
        """Each scenario left its results, and the table was printed."""
        _, log, result = quick_run
        assert set(result["results"]) == SCENARIOS
        assert "| measure | value |" in log

    def test_nothing_lost_and_drained_in_due_order(
        self, quick_run: tuple[int, str, dict[str, Any]]
    ) -> None:
        """The loss, earliness and due-order checks are among those that passed."""
        _, _, result = quick_run
        names = {c["check"] for c in result["checks"] if c["ok"]}
        assert "storm: nothing lost, nothing early" in names
        assert "steady: every timer fired, none early" in names
        assert "catch-up: drained in due order" in names
        assert any(name.startswith("schedule: every acked command stored") for name in names)

    def test_result_names_the_machine_and_the_service_settings(
        self, quick_run: tuple[int, str, dict[str, Any]]
    ) -> None:
        """The JSON says where it ran and how the service was configured."""
        _, _, result = quick_run
        assert result["mode"] == "quick"
        assert result["machine"]["nproc"] >= 1
        assert result["service"]["default_batch_size"] == 100
        assert "subprocess" in result["service"]["process"]
