"""How the store writes a batch of commands: new timers in one statement, the rest the general
way (keys locked, then written), with the same outcomes either way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from tests.pg import wait_until_blocked
from timer_core import (
    CommandOutcome,
    PositionedOperation,
    StoreUnavailable,
    TimerEntry,
    TimerState,
)

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def entry(call: str, due_s: int = 60) -> TimerEntry:
    return TimerEntry(
        tenant_id="tenant-a",
        service_call_id=call,
        due_at=NOW + timedelta(seconds=due_s),
        registered_at=NOW,
        correlation_id=None,
        state=TimerState.SCHEDULED,
        reached_at=None,
    )


def inserting_x(postgres_url: str) -> psycopg.Connection[tuple[Any, ...]]:
    """Another writer's connection, its transaction holding an uncommitted insert of 'x'."""
    conninfo = sa.make_url(postgres_url).set(drivername="postgresql")
    other = psycopg.connect(conninfo.render_as_string(hide_password=False))
    other.execute(
        "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at) "
        "VALUES ('tenant-a', 'x', %s, %s)",
        (NOW + timedelta(seconds=5), NOW),
    )
    return other


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """The SQL every SQLAlchemy engine of this process runs while the test does."""
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(args[2])

    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)


async def test_new_timers_are_one_statement(
    make_started_store: Callable[..., Any], statements: list[str]
) -> None:
    """A batch of new timers is inserted and announced by one statement (one round trip)."""
    store = await make_started_store(listen=False)
    statements.clear()
    ops = [entry("a"), PositionedOperation(entry("b"), 7, NOW), entry("c", due_s=30)]
    assert await store.apply(ops) == [CommandOutcome.SCHEDULED] * 3
    assert len(statements) == 1
    assert "pg_notify" in statements[0]
    assert await store.get("tenant-a", "c") == entry("c", due_s=30)


async def test_a_stored_timer_sends_the_batch_the_general_way(
    make_started_store: Callable[..., Any], statements: list[str]
) -> None:
    """With one timer of the batch stored already, nothing is inserted by the one statement;
    the general way then reschedules that one and inserts the others."""
    store = await make_started_store(listen=False)
    await store.apply([entry("a")])
    statements.clear()
    assert await store.apply([entry("b"), entry("a", due_s=90)]) == [CommandOutcome.SCHEDULED] * 2
    assert len(statements) > 1
    assert await store.get("tenant-a", "a") == entry("a", due_s=90)
    assert await store.get("tenant-a", "b") == entry("b")


async def test_an_insert_racing_the_batch_makes_it_a_reschedule(
    make_started_store: Callable[..., Any],
    postgres_sql: psycopg.Connection[tuple[Any, ...]],
    postgres_url: str,
    statements: list[str],
) -> None:
    """A key inserted by another transaction while the batch waits on it: the rest of the batch
    is stored and that key rescheduled to the batch's timer, all reported SCHEDULED."""
    store = await make_started_store(listen=False)
    other = inserting_x(postgres_url)  # uncommitted: the batch's insert of 'x' waits for it
    try:
        applying = asyncio.ensure_future(store.apply([entry("w"), entry("x"), entry("y")]))
        while True:  # until the batch waits on the other transaction's lock
            (waiting,) = postgres_sql.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ).fetchone() or (0,)
            if waiting or applying.done():
                break
            await asyncio.sleep(0.01)
        statements.clear()
        other.commit()
        assert await applying == [CommandOutcome.SCHEDULED] * 3
        assert any("FOR UPDATE" in statement for statement in statements)  # the general way
    finally:
        other.close()
    for call in ("w", "x", "y"):
        assert await store.get("tenant-a", call) == entry(call)
    assert await store.count_scheduled() == 3


async def test_an_apply_that_fails_after_a_racing_insert_applied_none_of_the_batch(
    make_started_store: Callable[..., Any],
    postgres_sql: psycopg.Connection[tuple[Any, ...]],
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-statement insert of new timers inserts all or none: when another writer
    commits one of the keys while it waits, and the general way then fails, none of the
    batch is stored ("when apply raises, none of the batch is applied")."""
    store = await make_started_store(listen=False)

    def general_way_fails(*args: Any) -> Any:
        raise StoreUnavailable("the general way failed on purpose")

    monkeypatch.setattr(store, "_apply", general_way_fails)
    other = inserting_x(postgres_url)  # uncommitted: the batch's insert of 'x' waits for it
    try:
        applying = asyncio.ensure_future(store.apply([entry("w"), entry("x"), entry("y")]))
        await wait_until_blocked(postgres_sql)
        other.commit()
        with pytest.raises(StoreUnavailable):
            await applying
    finally:
        other.close()
    assert await store.get("tenant-a", "w") is None
    assert await store.get("tenant-a", "y") is None
    assert await store.count_scheduled() == 1  # the other writer's 'x' only
