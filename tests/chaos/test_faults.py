"""The nine fault and pressure scenarios of the bench kit (``python -m timer_bench faults``),
shortened: ``timer-service`` processes on PostgreSQL with a real nats-server at a steady due
load, and the checks of every run (nothing acknowledged lost, nothing early, nothing stored
twice, no hang on SIGTERM, and recovery to 98% of the baseline after every chaos scenario)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import PostgresCluster, start_cluster
from timer_bench.faults import CHAOS, RECOVERED, SCENARIOS, Shape, run_scenario

pytestmark = pytest.mark.chaos


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    """A PostgreSQL server of this module's own (postgres_restart stops and starts it)."""
    # Not under pytest's base directory, which the postgres user (tests run as root) cannot
    # enter.
    root = Path(tempfile.mkdtemp(prefix="timer-faults-pg-"))
    os.chmod(root, 0o755)
    cluster = start_cluster(root)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


class TestFaults:
    @pytest.mark.parametrize("name", SCENARIOS)
    async def test_the_service_survives_and_keeps_its_promises(
        self, name: str, cluster: PostgresCluster, tmp_path: Path
    ) -> None:
        """Under the fault, then after it: every acknowledged timer fires, none early, none
        stored twice, every service stops on SIGTERM, and after a chaos fault the completion
        rate is back to at least 98% of the baseline."""
        result = await run_scenario(name, Shape.of(quick=True), cluster, tmp_path)
        assert result["rates"]["baseline"] > 0 and result["timers"] > 0, result
        assert result["fault"] and all(done > 0 for done in result["fault"].values()), result
        failed = [check for check, ok in result["checks"].items() if not ok]
        assert failed == [], result
        if name in CHAOS:
            assert result["recovery"] >= RECOVERED, result
