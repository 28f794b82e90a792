"""The claim query's plan under a storm of 100,000 due timers: an ordered index walk, no sort.

db-scheduler #441 is how this goes wrong: with ``LIMIT`` outside the locking subquery, or
no index matching the order, PostgreSQL sorts every due row on every poll. Here the plan
must stop after ``limit`` rows of ``ix_timer_schedules_due``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tests.timer_adapters_postgres.conftest import PostgresCluster
from timer_adapters_postgres import PostgresTimerStore, migrate
from timer_adapters_postgres._store import _CLAIM_FIRST, _NEXT_DUE

log = logging.getLogger(__name__)

STORM = 100_000
LIMIT = 100
NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan tree, depth first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def explain(
    conn: sa.Connection, statement: sa.TextClause, params: dict[str, Any]
) -> dict[str, Any]:
    """EXPLAIN ANALYZE ``statement`` on ``conn`` (run it in a transaction rolled back later)."""
    (document,) = conn.execute(
        sa.text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement.text), params
    ).scalar_one()
    log.info("plan:\n%s", json.dumps(document["Plan"], indent=1))
    return dict(document)


def explain_and_undo(
    engine: sa.Engine, statement: sa.TextClause, params: dict[str, Any]
) -> dict[str, Any]:
    """EXPLAIN ANALYZE ``statement`` in a transaction that is rolled back (it is an UPDATE)."""
    with engine.connect() as conn, conn.begin() as transaction:
        document = explain(conn, statement, params)
        transaction.rollback()
    return document


@pytest.fixture(scope="module")
def storm(postgres_cluster: PostgresCluster) -> Iterator[sa.Engine]:
    """100,000 Scheduled timers over 50 tenants, all due, plus 20,000 Reached ones; analysed.

    Built once for the module in a database of its own; tests change it only in
    transactions they roll back (or release what they claim).
    """
    name = f"timer_storm_{os.getpid()}"
    engine = sa.create_engine(postgres_cluster.create_database(name))
    try:
        with engine.begin() as conn:
            migrate(conn)
            conn.execute(
                sa.text(
                    """
                    INSERT INTO timer_schedules
                        (tenant_id, service_call_id, due_at, registered_at, state, reached_at)
                    SELECT 'tenant-' || (i % 50), 'call-' || i,
                           :now - make_interval(secs => (i % 3600)),
                           :now - interval '2 hours',
                           CASE WHEN i > :storm THEN 'Reached' ELSE 'Scheduled' END,
                           CASE WHEN i > :storm THEN :now END
                    FROM generate_series(1, :storm + 20000) AS i
                    """
                ),
                {"now": NOW, "storm": STORM},
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE timer_schedules"))
        yield engine
    finally:
        engine.dispose()
        postgres_cluster.drop_database(name)


class TestClaimPlan:
    """Claiming stays an index walk bounded by the batch size, however large the backlog."""

    async def test_claim_walks_the_due_index_and_stops_at_the_limit(self, storm: sa.Engine) -> None:
        """The claim locks LIMIT rows read in order from ix_timer_schedules_due; nothing sorts."""
        params = {"owner": "explain", "lease": timedelta(seconds=30), "now": NOW, "limit": LIMIT}
        document = explain_and_undo(storm, _CLAIM_FIRST, params)
        plan = list(nodes(document["Plan"]))
        kinds = [node["Node Type"] for node in plan]
        assert "Sort" not in kinds and "Incremental Sort" not in kinds
        assert not [n for n in plan if n["Node Type"] == "Seq Scan"]
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Node Type"] in ("Index Scan", "Index Only Scan")
        assert walk["Actual Rows"] <= LIMIT + 1
        (limit,) = [n for n in plan if n["Node Type"] == "Limit"]
        assert limit["Actual Rows"] == LIMIT
        assert any(n["Node Type"] == "LockRows" for n in plan)
        assert document["Execution Time"] < 1000  # ms; typically a few

    async def test_claims_past_leased_rows_still_walk_the_index(self, storm: sa.Engine) -> None:
        """With the head of the backlog leased by another instance, the walk skips it in order."""
        params = {"owner": "other", "lease": timedelta(seconds=30), "now": NOW, "limit": 1000}
        with storm.connect() as conn, conn.begin() as transaction:
            assert len(conn.execute(_CLAIM_FIRST, params).all()) == 1000
            document = explain(conn, _CLAIM_FIRST, {**params, "owner": "explain", "limit": LIMIT})
            transaction.rollback()
        plan = list(nodes(document["Plan"]))
        assert not [n for n in plan if n["Node Type"] in ("Seq Scan", "Sort")]
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Rows Removed by Filter"] == 1000
        (limit,) = [n for n in plan if n["Node Type"] == "Limit"]
        assert limit["Actual Rows"] == LIMIT

    async def test_next_due_time_reads_the_first_index_entry(self, storm: sa.Engine) -> None:
        """next_due_at is a min() over the partial due index, not a scan of the backlog."""
        document = explain_and_undo(storm, _NEXT_DUE, {"owner": "explain"})
        plan = list(nodes(document["Plan"]))
        assert not [n for n in plan if n["Node Type"] in ("Seq Scan", "Sort")]
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Actual Rows"] == 1

    async def test_store_claims_a_batch_from_the_storm(self, storm: sa.Engine) -> None:
        """find_due through the store claims the 100 earliest of 100,000 due timers."""
        url = storm.url.render_as_string(hide_password=False)
        async with PostgresTimerStore(url, listen=False) as store:
            claimed = await store.find_due(NOW, LIMIT)
            assert len(claimed) == LIMIT
            assert claimed == sorted(
                claimed, key=lambda e: (e.due_at, e.tenant_id, e.service_call_id)
            )
            assert claimed[0].due_at == NOW - timedelta(seconds=3599)
            await store.release_claims(claimed)
