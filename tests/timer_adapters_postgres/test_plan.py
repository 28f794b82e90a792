"""The claim query's plan under a storm of 100,000 due timers: an ordered index walk, no sort.

db-scheduler #441 is how this goes wrong: the rows are locked above a sort of every due
row, on every poll. Here the plan must stop after ``limit`` rows of
``ix_timer_schedules_due`` and find the rows to update by TID, for custom plans and for the
generic plans prepared statements end up with, for small and large batches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import psycopg.sql
import pytest
import sqlalchemy as sa

from tests.timer_adapters_postgres.conftest import PostgresCluster
from timer_adapters_postgres import PostgresTimerStore, migrate
from timer_adapters_postgres import _census as census
from timer_adapters_postgres._sql import (
    CLAIM_AFTER,
    CLAIM_BY_TENANT,
    CLAIM_FIRST,
    CLAIM_PLANNING,
    COUNT_SCHEDULED,
    COUNT_SCHEDULED_FOR_TENANT,
    DUE_TENANTS,
    DUE_TENANTS_NEAR,
    MARK,
    MOVE_NEAR_ALL,
    MOVE_NEAR_SKIPPING,
    NEXT_DUE,
    PURGE,
    RELEASE,
)
from timer_core import DueCursor

log = logging.getLogger(__name__)

STORM = 100_000
#: Timers set a day or more ahead, past the far edge (far_bucket set, as the store writes them).
FAR = 30_000
LIMIT = 100
NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan tree, depth first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def plan_as_the_claims(conn: sa.Connection) -> None:
    """This transaction planned as on the store's claiming connections: without sorts,
    bitmap scans or JIT."""
    for name, value in CLAIM_PLANNING:
        conn.execute(sa.text(f"SET LOCAL {name} = {value}"))


def prepared(
    conn: sa.Connection, statement: sa.TextClause, params: dict[str, Any]
) -> tuple[str, str]:
    """``statement`` with its ``:name`` parameters as ``$n``, and the values to EXECUTE it
    with, as SQL literals in that order."""
    text = statement.text
    for number, name in enumerate(params, start=1):
        text = re.sub(rf":{name}\b", f"${number}", text)
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    values = ", ".join(psycopg.sql.Literal(v).as_string(raw) for v in params.values())
    return text, values


def explain(
    conn: sa.Connection,
    statement: sa.TextClause,
    params: dict[str, Any],
    *,
    generic: bool = False,
) -> dict[str, Any]:
    """EXPLAIN ANALYZE ``statement`` on ``conn`` (run it in a transaction rolled back later).

    With ``generic``, as a prepared statement forced onto its generic plan: psycopg prepares
    statements it runs repeatedly, and PostgreSQL may then plan them once for any parameters.
    """
    options = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
    if not generic:
        (document,) = conn.execute(sa.text(options + statement.text), params).scalar_one()
    else:
        text, values = prepared(conn, statement, params)
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE timer_explained AS {text}")
        try:
            (document,) = conn.exec_driver_sql(
                f"{options} EXECUTE timer_explained({values})"
            ).scalar_one()
        finally:
            conn.exec_driver_sql("DEALLOCATE timer_explained")
    log.info("plan:\n%s", json.dumps(document["Plan"], indent=1))
    return dict(document)


def explain_and_undo(
    engine: sa.Engine, statement: sa.TextClause, params: dict[str, Any], *, generic: bool = False
) -> dict[str, Any]:
    """EXPLAIN ANALYZE ``statement`` in a transaction that is rolled back (it may write)."""
    with engine.connect() as conn, conn.begin() as transaction:
        document = explain(conn, statement, params, generic=generic)
        transaction.rollback()
    return document


def no_full_scan(plan: list[dict[str, Any]]) -> None:
    """Assert the plan neither reads the whole table nor sorts or hashes it."""
    kinds = {node["Node Type"] for node in plan}
    assert not kinds & {"Seq Scan", "Sort", "Incremental Sort", "Hash Join", "Hash"}, kinds


@pytest.fixture(scope="module")
def storm(postgres_cluster: PostgresCluster) -> Iterator[sa.Engine]:
    """100,000 Scheduled timers over 50 tenants, all due, plus 20,000 Reached ones, and
    30,000 far ones a day or more ahead (the far edge 20 minutes ahead); analysed.

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
            conn.execute(
                sa.text(
                    """
                    INSERT INTO timer_schedules
                        (tenant_id, service_call_id, due_at, registered_at, far_bucket)
                    SELECT 'tenant-' || (i % 50), 'far-' || i, due, :now,
                           date_bin(interval '10 minutes', due, TIMESTAMPTZ 'epoch')
                    FROM (SELECT i, :now + interval '1 day' + make_interval(secs => i) AS due
                          FROM generate_series(1, :far) AS i) AS f
                    """
                ),
                {"now": NOW, "far": FAR},
            )
            conn.execute(
                sa.text("INSERT INTO timer_horizon (id, edge) VALUES (1, :edge)"),
                {"edge": NOW + timedelta(minutes=20)},
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE timer_schedules"))
        yield engine
    finally:
        engine.dispose()
        postgres_cluster.drop_database(name)


def claim_params(owner: str = "explain", limit: int = LIMIT) -> dict[str, Any]:
    return {"owner": owner, "lease": timedelta(seconds=30), "now": NOW, "limit": limit}


class TestClaimPlan:
    """Claiming stays an index walk bounded by the batch size, however large the backlog."""

    @pytest.mark.parametrize(
        ("limit", "generic"),
        [(LIMIT, False), (LIMIT, True), (5000, False), (5000, True)],
        ids=["100-custom", "100-generic", "5000-custom", "5000-generic"],
    )
    async def test_claim_walks_the_due_index_and_stops_at_the_limit(
        self, storm: sa.Engine, limit: int, generic: bool
    ) -> None:
        """The claim locks LIMIT rows read in order from ix_timer_schedules_due; nothing sorts."""
        document = explain_and_undo(storm, CLAIM_FIRST, claim_params(limit=limit), generic=generic)
        plan = list(nodes(document["Plan"]))
        no_full_scan(plan)
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Node Type"] == "Index Scan"
        assert walk["Actual Rows"] == limit
        (lock,) = [n for n in plan if n["Node Type"] == "LockRows"]
        (top,) = [n for n in plan if n["Node Type"] == "Limit"]
        assert top["Plans"] == [lock] and lock["Plans"] == [walk]
        (update,) = [n for n in plan if n["Node Type"] == "Tid Scan"]
        assert update["Actual Rows"] == limit
        assert document["Execution Time"] < 5000  # ms; a few for 100 rows

    @pytest.mark.parametrize("plan", ["custom", "generic", "repeated"])
    async def test_a_table_never_analysed_is_walked_too(
        self, unanalysed_storm: sa.Engine, plan: str
    ) -> None:
        """A new table's first storm, no statistics: on the claiming connections' settings
        the claim is still the walk (by default, PostgreSQL read all 20,000 due timers by a
        bitmap scan and sorted them for each claim of 100)."""
        with unanalysed_storm.connect() as conn, conn.begin() as transaction:
            plan_as_the_claims(conn)
            if plan == "repeated":
                document = explain_as_repeated(conn, CLAIM_FIRST, claim_params(), undo=True)
            else:
                document = explain(conn, CLAIM_FIRST, claim_params(), generic=plan == "generic")
            transaction.rollback()
        found = list(nodes(document["Plan"]))
        no_full_scan(found)
        (walk,) = [n for n in found if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Node Type"] == "Index Scan"
        assert walk["Actual Rows"] == LIMIT

    async def test_keyset_claim_starts_inside_the_index(self, storm: sa.Engine) -> None:
        """With a cursor, the walk starts at the cursor (a row comparison in the index)."""
        params = {
            **claim_params(),
            "after_due": NOW - timedelta(seconds=1800),
            "after_tenant": "tenant-7",
            "after_call": "call-5",
        }
        for generic in (False, True):
            plan = list(
                nodes(explain_and_undo(storm, CLAIM_AFTER, params, generic=generic)["Plan"])
            )
            no_full_scan(plan)
            (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
            assert "ROW(due_at" in walk["Index Cond"]
            assert walk["Actual Rows"] == LIMIT

    async def test_claims_past_leased_rows_still_walk_the_index(self, storm: sa.Engine) -> None:
        """With the head of the backlog leased by another instance, the walk skips it in order."""
        with storm.connect() as conn, conn.begin() as transaction:
            assert len(conn.execute(CLAIM_FIRST, claim_params("other", 1000)).all()) == 1000
            document = explain(conn, CLAIM_FIRST, claim_params())
            transaction.rollback()
        plan = list(nodes(document["Plan"]))
        no_full_scan(plan)
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Rows Removed by Filter"] == 1000
        assert walk["Actual Rows"] == LIMIT

    @pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
    async def test_next_due_time_reads_the_first_index_entry(
        self, storm: sa.Engine, generic: bool
    ) -> None:
        """next_due_at is a min() over the partial due index, not a scan of the backlog."""
        document = explain_and_undo(storm, NEXT_DUE, {"owner": "explain"}, generic=generic)
        plan = list(nodes(document["Plan"]))
        no_full_scan(plan)
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Actual Rows"] == 1

    @pytest.mark.parametrize("after", [None, NOW], ids=["from-the-oldest", "after-a-batch"])
    async def test_purge_walks_the_reached_index(
        self, storm: sa.Engine, after: datetime | None
    ) -> None:
        """Retention deletes a batch of old Reached timers found through their own index,
        from the oldest or from where its last batch ended."""
        params = {"before": NOW + timedelta(seconds=1), "after": after, "limit": 500}
        for generic in (False, True):
            plan = list(nodes(explain_and_undo(storm, PURGE, params, generic=generic)["Plan"]))
            no_full_scan(plan)
            (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_reached"]
            assert walk["Actual Rows"] == 500
            assert "reached_at >=" in walk["Index Cond"]

    async def test_store_claims_a_batch_from_the_storm(self, storm: sa.Engine) -> None:
        """find_due through the store claims the 100 earliest of 100,000 due timers."""
        url = storm.url.render_as_string(hide_password=False)
        async with PostgresTimerStore(url, listen=False) as store:
            claimed = await store.find_due(NOW, LIMIT)
            assert len(claimed) == LIMIT
            assert claimed == sorted(claimed, key=DueCursor.of)
            assert claimed[0].due_at == NOW - timedelta(seconds=3599)
            await store.release_claims(claimed)


@contextlib.contextmanager
def made_due(
    postgres_cluster: PostgresCluster, name: str, *, analysed: bool, far: bool = False
) -> Iterator[sa.Engine]:
    """20,000 timers over 50 tenants scheduled far off, analysed then (or never), then all
    made due at once, in a database of their own dropped afterwards."""
    engine = sa.create_engine(postgres_cluster.create_database(name))
    try:
        with engine.begin() as conn:
            migrate(conn)
            if not analysed:  # nor by autovacuum while the tests run
                conn.execute(
                    sa.text("ALTER TABLE timer_schedules SET (autovacuum_enabled = false)")
                )
            conn.execute(
                sa.text(
                    """
                    INSERT INTO timer_schedules
                        (tenant_id, service_call_id, due_at, registered_at, far_bucket)
                    SELECT 'tenant-' || (i % 50), 'call-' || i,
                           :now + interval '70 years' + make_interval(secs => i), :now,
                           CASE WHEN :far THEN :now END
                    FROM generate_series(1, 20000) AS i
                    """
                ),
                {"now": NOW, "far": far},
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if analysed:
                conn.execute(sa.text("ANALYZE timer_schedules"))
            conn.execute(
                sa.text("UPDATE timer_schedules SET due_at = :due, far_bucket = NULL"),
                {"due": NOW - timedelta(seconds=1)},
            )
        yield engine
    finally:
        engine.dispose()
        postgres_cluster.drop_database(name)


@pytest.fixture(scope="module")
def stale_storm(postgres_cluster: PostgresCluster) -> Iterator[sa.Engine]:
    """20,000 timers over 50 tenants analysed while far off, then all made due (a storm the
    statistics have not seen, as after a bulk reschedule or a long outage)."""
    with made_due(postgres_cluster, f"timer_stale_storm_{os.getpid()}", analysed=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def moved_storm(postgres_cluster: PostgresCluster) -> Iterator[sa.Engine]:
    """20,000 timers over 50 tenants analysed while all far (as after a bulk load of timers
    weeks ahead: the due-order indexes look empty), then all made near and due (moved in
    by an advance and come due)."""
    name = f"timer_moved_storm_{os.getpid()}"
    with made_due(postgres_cluster, name, analysed=True, far=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def unanalysed_storm(postgres_cluster: PostgresCluster) -> Iterator[sa.Engine]:
    """The same storm in a table never analysed (a new deployment's first burst, before
    autovacuum came by): the partial indexes look nearly empty to the planner."""
    name = f"timer_unanalysed_storm_{os.getpid()}"
    with made_due(postgres_cluster, name, analysed=False) as engine:
        yield engine


def explain_as_repeated(
    conn: sa.Connection, statement: sa.TextClause, params: dict[str, Any], *, undo: bool = False
) -> Any:
    """EXPLAIN ANALYZE ``statement`` as a prepared statement on its tenth execution, with the
    plan PostgreSQL then settles on by itself (custom or generic: plan_cache_mode auto).

    With ``undo``, each execution runs under a savepoint rolled back after it, so a
    statement that writes finds the same rows every time."""
    text, values = prepared(conn, statement, params)
    conn.exec_driver_sql(f"PREPARE timer_repeated AS {text}")
    try:
        for _ in range(9):
            if undo:
                conn.exec_driver_sql("SAVEPOINT timer_repeated")
            conn.exec_driver_sql(f"EXECUTE timer_repeated({values})")
            if undo:
                conn.exec_driver_sql("ROLLBACK TO SAVEPOINT timer_repeated")
        (document,) = conn.exec_driver_sql(
            f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE timer_repeated({values})"
        ).scalar_one()
    finally:
        conn.exec_driver_sql("DEALLOCATE timer_repeated")
    log.info("plan:\n%s", json.dumps(document["Plan"], indent=1))
    return document


class TestTenantClaimPlan:
    """The claim shared among tenants seeks each tenant's own index range, not the storm."""

    @pytest.mark.parametrize("plan", ["custom", "generic", "repeated"])
    @pytest.mark.parametrize("statistics", ["stale", "none", "far"])
    async def test_each_tenant_is_a_seek_into_the_tenant_due_index(
        self, request: pytest.FixtureRequest, plan: str, statistics: str
    ) -> None:
        """Each tenant's share is read from ix_timer_schedules_tenant_due, unsorted, even with
        statistics that call nothing due (then ix_timer_schedules_due looked free) or none:
        planned for the values, for any values, and once prepared and run again and again
        (as psycopg does), or taken while every timer was far (then the due index, whose
        order serves one tenant's claim too, looked empty: at 10,000,000 far timers it was
        walked for every tenant, 70,000 buffers a claim of 100). The shares differ (what
        does not divide evenly goes one each to the first tenants)."""
        storm = request.getfixturevalue(
            {"stale": "stale_storm", "none": "unanalysed_storm", "far": "moved_storm"}[statistics]
        )
        tenants = [f"tenant-{n}" for n in range(50)]
        shares = [3] * 25 + [1] * 25
        params = {
            "owner": "explain",
            "lease": timedelta(seconds=30),
            "now": NOW,
            "tenants": tenants,
            "after_dues": [NOW - timedelta(days=1)] * len(tenants),
            "after_calls": [""] * len(tenants),
            "shares": shares,
        }
        with storm.connect() as conn, conn.begin() as transaction:
            plan_as_the_claims(conn)
            due = conn.execute(DUE_TENANTS, {"now": NOW, "limit": 100}).all()
            assert len(due) == len(tenants)
            if plan == "repeated":
                document = explain_as_repeated(conn, CLAIM_BY_TENANT, params)
            else:
                document = explain(conn, CLAIM_BY_TENANT, params, generic=plan == "generic")
            transaction.rollback()
        found = list(nodes(document["Plan"]))
        kinds = {node["Node Type"] for node in found}
        assert not kinds & {"Seq Scan", "Sort", "Incremental Sort", "Hash"}, kinds
        (walk,) = [n for n in found if n["Node Type"] in ("Index Scan", "Bitmap Heap Scan")]
        assert walk.get("Index Name") == "ix_timer_schedules_tenant_due", walk
        assert walk["Actual Loops"] == len(tenants)
        (update,) = [n for n in found if n["Node Type"] == "Tid Scan"]
        assert update["Actual Rows"] == sum(shares)


class TestTenantsDuePlan:
    """While the backlog is small, the tenants due are listed from the due timers alone."""

    @pytest.mark.parametrize("plan", ["custom", "generic"])
    @pytest.mark.parametrize("statistics", ["stale", "none"])
    async def test_the_walk_of_the_due_index_stops_after_its_limit(
        self, request: pytest.FixtureRequest, plan: str, statistics: str
    ) -> None:
        """The list walks ix_timer_schedules_due in its order and stops after ``walk``
        entries, unsorted, with statistics that call nothing due or none, planned for the
        values or for any values; walking the whole storm lists every tenant of it."""
        storm = request.getfixturevalue(
            "stale_storm" if statistics == "stale" else "unanalysed_storm"
        )
        with storm.connect() as conn, conn.begin() as transaction:
            plan_as_the_claims(conn)
            params = {"now": NOW, "walk": 1000}
            document = explain(conn, DUE_TENANTS_NEAR, params, generic=plan == "generic")
            walked = {row.walked for row in conn.execute(DUE_TENANTS_NEAR, params)}
            everything = {"now": NOW, "walk": 2 * STORM}
            rows = conn.execute(DUE_TENANTS_NEAR, everything).all()
            due = conn.execute(
                sa.text(
                    "SELECT count(*) FROM timer_schedules "
                    "WHERE state = 'Scheduled' AND due_at <= :now"
                ),
                {"now": NOW},
            ).scalar_one()
            transaction.rollback()
        found = list(nodes(document["Plan"]))
        kinds = {node["Node Type"] for node in found}
        assert not kinds & {"Seq Scan", "Sort", "Incremental Sort", "Bitmap Heap Scan"}, kinds
        (walk,) = [n for n in found if n["Node Type"] in ("Index Scan", "Index Only Scan")]
        assert walk.get("Index Name") == "ix_timer_schedules_due", walk
        assert walk["Actual Rows"] == 1000
        assert walked == {1000}
        assert len(rows) == 50
        assert {row.walked for row in rows} == {due}


class TestMarkPlan:
    """Marking and releasing a batch look up each of its timers by key, whatever the
    statistics say: never every Scheduled timer hashed or re-read for each batch."""

    @pytest.mark.parametrize("plan", ["custom", "generic", "repeated"])
    @pytest.mark.parametrize("statement", ["mark", "release"])
    @pytest.mark.parametrize("statistics", ["stale", "none"])
    async def test_each_timer_is_a_primary_key_lookup(
        self,
        request: pytest.FixtureRequest,
        plan: str,
        statement: str,
        statistics: str,
    ) -> None:
        """With statistics taken before the storm, or none (then the planner takes ~10
        timers for Scheduled and hashed them all, read through ix_timer_schedules_due, for
        every batch), the batch's 100 timers are 100 seeks into the primary key and an
        update by TID."""
        storm = request.getfixturevalue(
            "stale_storm" if statistics == "stale" else "unanalysed_storm"
        )
        with storm.connect() as conn, conn.begin() as transaction:
            rows = conn.execute(CLAIM_FIRST, claim_params()).all()
            assert len(rows) == LIMIT
            params: dict[str, Any] = {
                "owner": "explain",
                "tenant_ids": [row.tenant_id for row in rows],
                "service_call_ids": [row.service_call_id for row in rows],
            }
            if statement == "mark":
                params.update(reached_at=NOW, due_ats=[row.due_at for row in rows])
            params["tokens"] = [row.lease_token for row in rows]
            chosen = MARK if statement == "mark" else RELEASE
            if plan == "repeated":
                # Each run undoes the one before under a savepoint: all ten update 100 rows.
                document = explain_as_repeated(conn, chosen, params, undo=True)
            else:
                document = explain(conn, chosen, params, generic=plan == "generic")
            transaction.rollback()
        found = list(nodes(document["Plan"]))
        kinds = {node["Node Type"] for node in found}
        assert not kinds & {"Seq Scan", "Sort", "Hash", "Hash Join", "Bitmap Heap Scan"}, kinds
        (seek,) = [n for n in found if n["Node Type"] == "Index Scan"]
        assert seek["Index Name"] == "timer_schedules_pkey"
        assert seek["Actual Loops"] == LIMIT
        (update,) = [n for n in found if n["Node Type"] == "Tid Scan"]
        assert update["Actual Rows"] == LIMIT


class TestCensusPlans:
    """The census and the console's look-ups walk indexes for as long as their bounds say,
    however large the backlog (here 100,000 pending timers over 50 tenants)."""

    @pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
    async def test_capped_count_stops_after_the_cap(self, storm: sa.Engine, generic: bool) -> None:
        """A capped count of an overfull bucket reads the due index for cap entries only."""
        params = {"after": "-infinity", "until": NOW, "cap": 1000}
        document = explain_and_undo(storm, census.COUNT_DUE, params, generic=generic)
        plan = list(nodes(document["Plan"]))
        no_full_scan(plan)
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_due"]
        assert walk["Actual Rows"] == 1000

    async def test_tenant_count_walks_the_tenant_index(self, storm: sa.Engine) -> None:
        """A tenant's capped count reads that tenant's entries of its due index only."""
        params = {"after": "-infinity", "until": NOW, "cap": 100, "tenant": "tenant-7"}
        plan = list(nodes(explain_and_undo(storm, census.COUNT_TENANT_DUE, params)["Plan"]))
        no_full_scan(plan)
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_tenant_due"]
        assert walk["Actual Rows"] == 100

    async def test_pending_tenants_is_a_seek_per_tenant(self, storm: sa.Engine) -> None:
        """Listing tenants reads a few index entries per tenant listed (near and far), not
        their backlogs."""
        plan = list(
            nodes(
                explain_and_undo(storm, census.PENDING_TENANTS, {"after": "", "limit": 20})["Plan"]
            )
        )
        no_full_scan(plan)
        # A seek into each index for the next tenant, and one for the tenant's earliest.
        walks = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_tenant_due"]
        assert walks
        assert sum(n["Actual Rows"] * n["Actual Loops"] for n in walks) <= 2 * 20 + 1
        far = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_far_tenant"]
        assert far
        assert sum(n["Actual Rows"] * n["Actual Loops"] for n in far) <= 20 + 1
        assert not [n for n in plan if n.get("Index Name") == "timer_schedules_pkey"]

    @pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
    async def test_tenant_page_reads_the_tenant_index_in_order(
        self, storm: sa.Engine, generic: bool
    ) -> None:
        """A page of a tenant's pending timers is one ordered walk of its index: no sort."""
        params = {
            "tenant": "tenant-7",
            "due_from": "-infinity",
            "due_until": NOW,
            "after_due": NOW - timedelta(minutes=30),
            "after_call": "",
            "limit": 50,
        }
        document = explain_and_undo(storm, census.SCHEDULED_FOR_TENANT, params, generic=generic)
        plan = list(nodes(document["Plan"]))
        assert "Seq Scan" not in {n["Node Type"] for n in plan}
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_tenant_due"]
        assert walk["Actual Rows"] == 50
        # The page is sorted out of the near ones alone: the tenant's far timers come after
        # them and are not read.
        for node in plan:
            if node["Node Type"] == "Sort":
                assert node["Actual Rows"] <= 2 * 50
        reads = [n for n in plan if "Index Name" in n and n is not walk]
        assert sum(n["Actual Rows"] * n["Actual Loops"] for n in reads) <= 1, reads

    async def test_correlation_lookup_seeks_each_tenant(self, storm: sa.Engine) -> None:
        """A correlation id across tenants is a seek per tenant, never a scan of the table."""
        params = {"correlation": "order-1", "limit": 50}
        plan = list(nodes(explain_and_undo(storm, census.FIND_BY_CORRELATION_ID, params)["Plan"]))
        assert "Seq Scan" not in {n["Node Type"] for n in plan}
        assert any(n.get("Index Name") == "ix_timer_schedules_tenant_correlation" for n in plan)

    async def test_tenant_scan_reads_its_window_of_the_primary_key(self, storm: sa.Engine) -> None:
        """Paging through a tenant's fired timers reads at most the window's keys."""
        params = {
            "tenant": "tenant-7",
            "after": "",
            "scan": 300,
            "state": "Reached",
            "due_from": "-infinity",
            "due_until": "infinity",
            "limit": 50,
        }
        plan = list(nodes(explain_and_undo(storm, census.SCAN_TENANT, params)["Plan"]))
        assert "Seq Scan" not in {n["Node Type"] for n in plan}
        (walk,) = [n for n in plan if n.get("Index Name") == "timer_schedules_pkey"]
        assert walk["Actual Rows"] <= 300


class TestFarPlans:
    """Timers past the far edge are moved, counted and found through ix_timer_schedules_far,
    never by a scan of the table."""

    @pytest.mark.parametrize("statement", ["skipping", "all"])
    @pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
    async def test_an_advance_batch_walks_the_far_index_from_its_lowest_bucket(
        self, storm: sa.Engine, statement: str, generic: bool
    ) -> None:
        """A batch of the advance reads its rows in bucket order from the far index, stops
        after the batch, and updates them by TID: no sort, whatever the batch's target."""
        params = {"target": NOW + timedelta(days=2), "limit": 200}
        chosen = MOVE_NEAR_SKIPPING if statement == "skipping" else MOVE_NEAR_ALL
        plan = list(nodes(explain_and_undo(storm, chosen, params, generic=generic)["Plan"]))
        no_full_scan(plan)
        (walk,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_far"]
        assert walk["Node Type"] == "Index Scan"
        assert walk["Actual Rows"] == 200
        (update,) = [n for n in plan if n["Node Type"] == "Tid Scan"]
        assert update["Actual Rows"] == 200

    async def test_count_reads_the_far_index_alone_for_far_timers(self, storm: sa.Engine) -> None:
        """count_scheduled counts far timers in the far index alone (the near ones as the
        planner sees fit: here they are most of the table)."""
        with storm.connect() as conn:
            assert conn.execute(COUNT_SCHEDULED).scalar_one() == STORM + FAR
        plan = list(nodes(explain_and_undo(storm, COUNT_SCHEDULED, {})["Plan"]))
        (far,) = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_far"]
        assert far["Node Type"] == "Index Only Scan"
        assert far["Actual Rows"] == FAR

    async def test_next_due_with_only_far_timers_reads_their_lowest_bucket(
        self, storm: sa.Engine
    ) -> None:
        """With no near timer, next_due_at reads the lowest far bucket's timers only."""
        with storm.connect() as conn, conn.begin() as transaction:
            conn.execute(
                sa.text(
                    "UPDATE timer_schedules SET state = 'Reached', reached_at = :now "
                    "WHERE state = 'Scheduled' AND far_bucket IS NULL"
                ),
                {"now": NOW},
            )
            earliest = conn.execute(NEXT_DUE, {"owner": "explain"}).scalar_one()
            document = explain(conn, NEXT_DUE, {"owner": "explain"})
            transaction.rollback()
        assert earliest == NOW + timedelta(days=1, seconds=1)
        plan = list(nodes(document["Plan"]))
        assert "Seq Scan" not in {n["Node Type"] for n in plan}
        far = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_far"]
        # One seek for the lowest bucket, then that bucket's timers (10 minutes of them).
        assert far and sum(n["Actual Rows"] * n["Actual Loops"] for n in far) <= 1 + 600

    @pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
    async def test_tenant_count_reads_its_near_and_far_indexes(
        self, storm: sa.Engine, generic: bool
    ) -> None:
        """A tenant's count is its entries of the tenant due index and its far timers read
        through a far index, never its keys (and their rows) in the table."""
        params = {"tenant": "tenant-7"}
        with storm.connect() as conn:
            counted = conn.execute(COUNT_SCHEDULED_FOR_TENANT, params).scalar_one()
        assert counted == (STORM + FAR) // 50
        document = explain_and_undo(storm, COUNT_SCHEDULED_FOR_TENANT, params, generic=generic)
        plan = list(nodes(document["Plan"]))
        no_full_scan(plan)
        names = {n["Index Name"] for n in plan if "Index Name" in n}
        # The far part through either far index, as the statistics say (here, with far
        # timers 1 in 5 of the table, often the bucket one).
        assert "ix_timer_schedules_tenant_due" in names
        assert names - {"ix_timer_schedules_tenant_due"} in (
            {"ix_timer_schedules_far_tenant"},
            {"ix_timer_schedules_far"},
        )

    async def test_capped_count_of_a_far_range_reads_the_far_index(self, storm: sa.Engine) -> None:
        """A capped count of a range past the edge counts the range's whole buckets in the
        far index alone and reads rows only where the range cuts a bucket; counts across
        bucket boundaries and open ends are exact."""
        params = {
            "after": NOW + timedelta(days=1),
            "until": NOW + timedelta(days=1, hours=1),
            "cap": 1000,
        }
        with storm.connect() as conn:
            assert conn.execute(census.COUNT_DUE, params).scalar_one() == 1000
            seconds = timedelta(seconds=7)
            odd = {"after": params["after"] + seconds, "until": params["until"] + seconds}
            odd["cap"] = 10_000
            # 3,600 far timers a second apart from 1 day + 1 s on: the hour after
            # 1 day + 7 s holds those due at 1 day + 8 s ... 1 day + 3,607 s.
            assert conn.execute(census.COUNT_DUE, odd).scalar_one() == 3600
            everything = {"after": "-infinity", "until": "infinity", "cap": 10 * FAR}
            assert conn.execute(census.COUNT_DUE, everything).scalar_one() == STORM + FAR
        plan = list(nodes(explain_and_undo(storm, census.COUNT_DUE, params)["Plan"]))
        assert "Seq Scan" not in {n["Node Type"] for n in plan}
        far = [n for n in plan if n.get("Index Name") == "ix_timer_schedules_far"]
        # The whole buckets from the index alone, the one the range's start cuts read.
        (whole,) = [n for n in far if n["Node Type"] == "Index Only Scan"]
        assert whole["Actual Rows"] == 1000

    async def test_pending_tenants_with_only_far_timers_are_listed(self, storm: sa.Engine) -> None:
        """A tenant whose timers are all far is listed with its earliest far due time."""
        with storm.connect() as conn, conn.begin() as transaction:
            conn.execute(
                sa.text(
                    "DELETE FROM timer_schedules WHERE tenant_id = 'tenant-7' "
                    "AND far_bucket IS NULL"
                )
            )
            rows = conn.execute(census.PENDING_TENANTS, {"after": "tenant-69", "limit": 2}).all()
            transaction.rollback()
        assert tuple(rows[0]) == ("tenant-7", NOW + timedelta(days=1, seconds=7))
        assert rows[1].tenant_id == "tenant-8" and rows[1].due_at < NOW
