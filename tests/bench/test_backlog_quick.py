"""``bench/backlog.py`` (the catch-up of a big backlog) runs small in the normal suite, so it
never rots, and its order check is shown to catch what it claims to.

The figures (1,000,000 timers, peak RSS) are taken by hand; see bench/README.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _backlog() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # its own imports: harness
    spec = importlib.util.spec_from_file_location("bench_backlog", BENCH / "backlog.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


backlog = _backlog()


def run(store: str, tmp_path: Path) -> tuple[int, str, dict[str, Any]]:
    output = tmp_path / f"{store}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "backlog.py"),
            *("--store", store, "--timers", "3000", "--sample-s", "0.5"),
            *("--output", str(output)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    result = json.loads(output.read_text()) if output.exists() else {}
    return done.returncode, done.stdout + done.stderr, result


class TestSmallBacklog:
    @pytest.mark.parametrize("store", ["sqlite", "postgres"])
    def test_drains_with_every_check_passing(self, store: str, tmp_path: Path) -> None:
        """3,000 overdue timers (SQLite one service, PostgreSQL two): exit 0, every check
        passed, a peak RSS reported per service."""
        code, log, result = run(store, tmp_path)
        assert code == 0, log[-3000:]
        assert result["checks"] and all(result["checks"].values()), result["checks"]
        assert len(result["peak_rss_mib"]) == (1 if store == "sqlite" else 2)
        assert all(peak > 0 for peak in result["peak_rss_mib"])
        assert result["events"] == result["distinct_timers"] == 3000


class TestOrderCheck:
    def test_counts_early_and_out_of_order_events(self) -> None:
        """An event fired before its due time, and one earlier-due than its tenant's event
        before it, are both counted; another tenant's events do not count against it."""
        events = [
            ("a", "1", "2030-01-01T00:00:01.000Z", "2030-01-01T00:00:05.000Z"),
            ("b", "2", "2030-01-01T00:00:00.000Z", "2030-01-01T00:00:05.000Z"),
            ("a", "3", "2030-01-01T00:00:00.500Z", "2030-01-01T00:00:05.000Z"),
            ("a", "4", "2030-01-01T00:00:09.000Z", "2030-01-01T00:00:05.000Z"),
        ]
        checked = backlog.order_checks(events, None)
        assert checked["early"] == 1
        assert checked["out_of_due_order_within_tenant"] == 1
        assert checked["out_of_due_order_within_tenant_and_instance"] == 1
        assert checked["worst_inversion_ms"] == 500

    def test_two_firers_are_checked_each_on_its_own(self) -> None:
        """With the firer of each timer known, interleaved instances are not out of order,
        and one instance out of its own order is."""
        events = [
            ("a", "1", "2030-01-01T00:00:02.000Z", "2030-01-01T00:00:05.000Z"),
            ("a", "2", "2030-01-01T00:00:01.000Z", "2030-01-01T00:00:05.000Z"),
            ("a", "3", "2030-01-01T00:00:03.000Z", "2030-01-01T00:00:05.000Z"),
        ]
        interleaved = backlog.order_checks(events, {"1": "x", "2": "y", "3": "x"})
        assert interleaved["out_of_due_order_within_tenant"] == 1
        assert interleaved["out_of_due_order_within_tenant_and_instance"] == 0
        own = backlog.order_checks(events, {"1": "x", "2": "x", "3": "y"})
        assert own["out_of_due_order_within_tenant_and_instance"] == 1
