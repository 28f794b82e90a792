"""Commands commit synchronously whatever the server's default: the test cluster runs with
``synchronous_commit=off``, yet the commit of every acknowledged command is in the flushed
write-ahead log by the time ``apply`` returns (read back with ``pg_walinspect``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg

from timer_adapters_postgres import PostgresTimerStore
from timer_core import TimerEntry, TimerKey

T0 = datetime(2030, 1, 1, tzinfo=UTC)
_RELATION = re.compile(r"rel \d+/\d+/(\d+)")


# The log from ``since`` to what is flushed now (an end past the flushed log is an error
# before PostgreSQL 16, which dropped the "till end of WAL" functions).
_RECORDS = (
    "SELECT xid::text, resource_manager, record_type, end_lsn::text, block_ref "
    "FROM pg_get_wal_records_info(%s::pg_lsn, pg_current_wal_flush_lsn())"
)


def _commit_end(sql: psycopg.Connection[Any], since: str, xid: int) -> str:
    """Where the commit record of transaction ``xid`` ends in the flushed log after ``since``."""
    for written, manager, kind, end, _ in sql.execute(_RECORDS, (since,)):
        if written == str(xid) and manager == "Transaction" and kind.startswith("COMMIT"):
            return str(end)
    raise AssertionError(f"no commit record of {xid} flushed after {since}")


def _flushed_past(sql: psycopg.Connection[Any], flushed: str, lsn: str) -> bool:
    row = sql.execute("SELECT %s::pg_lsn >= %s::pg_lsn", (flushed, lsn)).fetchone()
    assert row is not None
    return bool(row[0])


class TestSynchronousCommit:
    async def test_acknowledged_commands_are_flushed_before_apply_returns(
        self,
        make_started_store: Callable[..., Any],
        postgres_sql: psycopg.Connection[Any],
    ) -> None:
        """On a server whose default is synchronous_commit=off, the store's connections run
        with it on, and the commit record of each apply() (new timers, a reschedule, a
        cancel) is at or below the WAL flush position read the moment apply() returned."""
        sql = postgres_sql
        sql.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        assert sql.execute("SHOW synchronous_commit").fetchone() == ("off",)
        store: PostgresTimerStore = await make_started_store()
        engine = store._engine
        assert engine is not None
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
        batches: list[list[Any]] = [
            [TimerEntry("tenant-a", f"call-{i}", T0, T0) for i in range(10)],
            [TimerEntry("tenant-a", "call-0", T0.replace(hour=1), T0)],
            [TimerKey("tenant-a", "call-1")],
        ]
        tables = {
            int(row[0])
            for row in sql.execute(
                "SELECT pg_relation_filenode(c) FROM unnest(ARRAY["
                "'timer_schedules'::regclass, 'timer_tombstones'::regclass]) AS c"
            )
        }
        for batch in batches:
            (since,) = sql.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone() or ("",)
            await store.apply(batch)
            (flushed,) = sql.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone() or ("",)
            xids = {
                int(xid)
                for xid, _, _, _, block_ref in sql.execute(_RECORDS, (since,))
                if xid != "0"
                and tables & {int(node) for node in _RELATION.findall(block_ref or "")}
            }
            assert xids, "the apply wrote nothing to the timer tables"
            for written in xids:
                assert _flushed_past(sql, flushed, _commit_end(sql, since, written)), (
                    f"the commit of {batch[0]} was not flushed when apply() returned"
                )
