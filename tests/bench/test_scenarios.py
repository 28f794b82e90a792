"""The kit's scenarios run small in the normal suite (``--quick``), so they never rot: they
check what they measure (nothing lost, nothing early, drained in due order), never the
figures, which mean something only at full size on a quiet machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from timer_bench import kit, otel
from timer_bench.backlog import order_checks

ROOT = Path(__file__).resolve().parents[2]


def run(scenario: str, output: Path, *options: str) -> tuple[int, str, dict[str, Any]]:
    """``python -m timer_bench <scenario> --quick`` from the repository's root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
    command = [sys.executable, "-m", "timer_bench", scenario, "--quick", "--output", str(output)]
    done = subprocess.run(
        [*command, *options],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
        check=False,
    )
    result = json.loads(output.read_text()) if output.exists() else {}
    return done.returncode, done.stdout + done.stderr, result


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    return run("e2e", tmp_path_factory.mktemp("bench") / "e2e.json")


class TestEndToEnd:
    def test_exits_zero_with_every_check_passing(
        self, e2e: tuple[int, str, dict[str, Any]]
    ) -> None:
        """The run exits 0 and no check failed (lost, early or out-of-order timers)."""
        code, log, result = e2e
        assert code == 0, log[-3000:]
        assert [c for c in result["checks"] if not c["ok"]] == []

    def test_every_scenario_ran_and_was_checked(self, e2e: tuple[int, str, dict[str, Any]]) -> None:
        """Each scenario left its results, and the loss, earliness and order checks passed."""
        _, log, result = e2e
        assert set(result["results"]) == {
            "yardsticks",
            "schedule",
            "fire",
            "storm",
            "steady",
            "catchup",
            "scale",
        }
        passed = {c["check"] for c in result["checks"] if c["ok"]}
        assert {"storm: nothing lost, nothing early", "catch-up: drained in due order"} <= passed
        assert "steady: every timer fired, none early" in passed
        assert "| measure | value |" in log

    def test_result_names_the_machine_and_the_settings(
        self, e2e: tuple[int, str, dict[str, Any]]
    ) -> None:
        """The results file says where it ran and how the service was configured."""
        _, _, result = e2e
        assert result["mode"] == "quick"
        assert result["machine"]["nproc"] >= 1 and result["machine"]["load_average_end"]
        assert result["service"]["batch_size"] == result["service"]["default_batch_size"] == 100


class TestBacklog:
    @pytest.mark.parametrize("store", ["sqlite", "postgres"])
    def test_drains_with_every_check_passing(self, store: str, tmp_path: Path) -> None:
        """3,000 overdue timers (SQLite one service, PostgreSQL two): exit 0, every check
        passed, a peak RSS reported per service."""
        code, log, result = run(f"backlog-{store}", tmp_path / "backlog.json")
        assert code == 0, log[-3000:]
        assert result["checks"] and all(result["checks"].values()), result["checks"]
        assert len(result["peak_rss_mib"]) == (1 if store == "sqlite" else 2)
        assert result["events"] == result["distinct_timers"] == 3000

    def test_counts_early_and_out_of_order_events(self) -> None:
        """An event fired before its due time, and one earlier-due than its tenant's event
        before it, are both counted; another tenant's events do not count against it."""
        events = [
            ("a", "1", "2030-01-01T00:00:01.000Z", "2030-01-01T00:00:05.000Z"),
            ("b", "2", "2030-01-01T00:00:00.000Z", "2030-01-01T00:00:05.000Z"),
            ("a", "3", "2030-01-01T00:00:00.500Z", "2030-01-01T00:00:05.000Z"),
            ("a", "4", "2030-01-01T00:00:09.000Z", "2030-01-01T00:00:05.000Z"),
        ]
        checked = order_checks(events, None)
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
        interleaved = order_checks(events, {"1": "x", "2": "y", "3": "x"})
        assert interleaved["out_of_due_order_within_tenant"] == 1
        assert interleaved["out_of_due_order_within_tenant_and_instance"] == 0
        own = order_checks(events, {"1": "x", "2": "x", "3": "y"})
        assert own["out_of_due_order_within_tenant_and_instance"] == 1


class TestCommandOrder:
    def test_writes_both_modes(self, tmp_path: Path) -> None:
        """Plain and positioned operations are both measured, with their ratio per step."""
        code, log, result = run("command-order", tmp_path / "order.json")
        assert code == 0, log[-3000:]
        assert set(result["results"]["positioned_vs_plain"]) == {"insert", "reschedule", "cancel"}


class TestHandlers:
    def test_every_loop_handles_every_timer(self, tmp_path: Path) -> None:
        """The handler path (default and tuned), the batch handler, the hand-written loop (also
        the one handing out envelopes) and the store-API loop each ran to the end (each asserts
        it handled every timer) and were compared with the yardstick; the batch handler also
        with the loop handing out envelopes."""
        code, log, result = run("handlers", tmp_path / "handlers.json")
        assert code == 0, log[-3000:]
        sqlite = result["sqlite"]
        sides = {"timer", "timer_tuned", "timer_batch", "raw", "raw_envelopes", "store_loop"}
        assert set(sqlite) == sides
        assert all(sqlite[side]["median_per_s"] > 0 for side in sqlite)
        measured = ("timer", "timer_tuned", "timer_batch", "raw_envelopes", "store_loop")
        assert all("vs_raw" in sqlite[side] for side in measured)
        assert sqlite["timer_batch"]["vs_raw_envelopes"] > 0

    def test_runs_the_handler_path_on_an_earlier_commit_beside_the_current(
        self, tmp_path: Path
    ) -> None:
        """With ``--baseline-ref``, the per-timer handler path also runs on that commit's
        sources and on the current ones, each in a process of its own, and is compared."""
        code, log, result = run("handlers", tmp_path / "handlers.json", "--baseline-ref", "HEAD")
        assert code == 0, log[-3000:]
        assert result["settings"]["baseline_ref"] == "HEAD"
        assert set(result["baseline"]) == {"timer_child", "timer_baseline"}
        assert result["baseline"]["timer_child"]["vs_timer_baseline"] > 0


class TestIsolation:
    def test_both_cases_run_and_check_what_they_measure(self, tmp_path: Path) -> None:
        """The storm beside a quiet tenant (handler path) and the unacknowledged publish beside
        other tenants' timers (a real nats-server) each ran in a child process; every timer
        was handled or stored, the poison one held."""
        code, log, result = run("isolation", tmp_path / "isolation.json")
        assert code == 0, log[-3000:]
        assert result["checks"] and all(result["checks"].values()), result["checks"]
        (storm,) = result["results"]["storm"]["current"]
        (unacked,) = result["results"]["unacked"]["current"]
        assert storm["quiet_handled"] == 1
        assert unacked["published"] == result["settings"]["unacked"]["others"]


class TestOtel:
    def test_the_baseline_runs_off_on_the_sources_before_issue_42(self, tmp_path: Path) -> None:
        """``--baseline-ref``'s child runs ``off`` to the end on cb42c94's packages (the
        commit before issue 42, the figures' baseline), which lack API the parent's helpers
        import (``command_backlog``); a current variant runs beside it."""
        tree = kit.export_tree("cb42c94", tmp_path / "tree")
        baseline = otel.run_one("baseline", 200, tree)
        current = otel.run_one("sdk-timer-spans", 200, None)
        assert baseline["rate"] > 0 and baseline["cpu_us"] > 0
        assert current["rate"] > 0 and current["cpu_us"] > 0


class TestHandlersPythons:
    def test_every_side_runs_the_handlers_scenario_in_every_round(self, tmp_path: Path) -> None:
        """Each side (here every one on this interpreter: the other's root needs root) ran
        ``handlers`` to the end in a process of its own, the lazy one with eager starts
        off, and the ratios between the sides come from the rounds' own."""
        code, log, result = run("handlers-pythons", tmp_path / "pythons.json", "--python", "this")
        assert code == 0, log[-3000:]
        assert [set(r) for r in result["rounds"]] == [{"this", "other", "other_lazy"}]
        assert all(r[side]["timer"] > 0 for r in result["rounds"] for side in r)
        lazy = result["interpreters"]["other_lazy"]["eager_start"]
        assert lazy is False
        eager = result["interpreters"]["this"]["eager_start"]
        assert eager is (sys.version_info >= (3, 12))
        [this, other] = [result["rounds"][0][side]["timer"] for side in ("this", "other")]
        assert result["other_vs_this"] == round(other / this, 3)
        assert "python -m timer_bench handlers-pythons" in log


class TestDurability:
    def test_measures_both_defaults_on_both_stores(self, tmp_path: Path) -> None:
        """Old and new defaults are measured side by side on SQLite, PostgreSQL and the
        embedded nats-server's sync, each measure with its per-round ratios."""
        code, log, result = run("durability", tmp_path / "durability.json")
        assert code == 0, log[-3000:]
        assert set(result["results"]) == {"sqlite", "postgres", "nats"}
        for measures in result["results"].values():
            for figure in measures.values():
                assert len(figure["old"]) == len(figure["new"]) == len(figure["rounds"]) == 1


class TestResultFiles:
    """Where a run writes its figures by default."""

    @pytest.mark.parametrize(
        ("argv", "name"),
        [
            (["e2e"], "e2e"),
            (["e2e", "--quick"], "quick-e2e"),
            (["e2e", "--only", "steady,schedule"], "e2e-only-schedule-steady"),
            (["fire-tenants"], "fire-tenants"),
        ],
    )
    def test_a_probe_of_some_scenarios_leaves_the_full_figures_alone(
        self, argv: list[str], name: str
    ) -> None:
        """``e2e --only`` writes a file of its own, never the full run's ``e2e.json``."""
        from timer_bench.__main__ import parser, result_name

        assert result_name(parser().parse_args(argv)) == name


class TestLargeStoreCalls:
    async def test_measures_the_fair_share_find_the_service_uses(self, tmp_path: Path) -> None:
        """The large-table kit times find_due_by_tenant on a store that finds by tenant
        (the drain's find whenever more is due than one batch holds)."""
        from timer_bench.large import SqliteLarge, store_calls

        large = SqliteLarge(tmp_path)
        db = large.create("calls")
        measured = await store_calls(large, db, samples=1)
        assert set(measured) == {
            "count_scheduled",
            "next_due_at",
            "find_due (batch 100)",
            "find_due_by_tenant (batch 100)",
        }
