"""Wake-ups across instances: a schedule on one store reaches the others through LISTEN/NOTIFY."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from timer_adapters_memory import MemoryEventBus
from timer_adapters_postgres import PostgresTimerStore
from timer_adapters_postgres._listener import EARLIEST
from timer_core import SystemClock, TimerEntry, TimerWorker

MakeStore = Callable[..., Awaitable[PostgresTimerStore]]


def timer(call: str, due: datetime, registered: datetime | None = None) -> TimerEntry:
    return TimerEntry(
        tenant_id="tenant-a",
        service_call_id=call,
        due_at=due,
        registered_at=registered or datetime.now(UTC),
    )


class Inbox:
    """Collects what a store's on_remote_schedule callback is given, for awaiting in order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[datetime] = asyncio.Queue()

    def __call__(self, due_at: datetime) -> None:
        self.queue.put_nowait(due_at)

    async def next(self) -> datetime:
        return await asyncio.wait_for(self.queue.get(), timeout=10)


class TestNotify:
    """Each store LISTENs; schedules by other stores are handed to on_remote_schedule."""

    async def test_schedule_on_one_store_reaches_the_other(
        self, make_started_store: MakeStore
    ) -> None:
        """The other store's callback gets the due time; the scheduling store skips its own."""
        inbox_a, inbox_b = Inbox(), Inbox()
        a = await make_started_store(on_remote_schedule=inbox_a)
        b = await make_started_store()
        b.on_remote_schedule = inbox_b  # may also be set after start
        due_a = datetime(2031, 1, 1, 0, 0, 1, tzinfo=UTC)
        due_b = datetime(2031, 1, 1, 0, 0, 2, tzinfo=UTC)
        await a.schedule(timer("from-a", due_a))
        assert await inbox_b.next() == due_a
        await b.schedule(timer("from-b", due_b))
        # Notifications arrive in commit order, so A's own would have come first.
        assert await inbox_a.next() == due_b

    async def test_one_notification_per_batch_with_its_earliest_due_time(
        self, make_started_store: MakeStore
    ) -> None:
        """A batch announces its earliest scheduled due time; cancels announce nothing."""
        inbox = Inbox()
        a = await make_started_store()
        await make_started_store(on_remote_schedule=inbox)
        first = datetime(2031, 1, 1, tzinfo=UTC)
        await a.apply([timer("x", first + timedelta(seconds=5)), timer("y", first)])
        assert await inbox.next() == first
        await a.cancel(timer("x", first).tenant_id, timer("x", first).service_call_id)
        await a.schedule(timer("z", first + timedelta(seconds=9)))
        assert await inbox.next() == first + timedelta(seconds=9)

    async def test_horizon_leaves_far_timers_to_the_poll(
        self, make_started_store: MakeStore
    ) -> None:
        """With notify_horizon_s, only timers due soon after registration are announced."""
        inbox = Inbox()
        a = await make_started_store(notify_horizon_s=60)
        await make_started_store(on_remote_schedule=inbox)
        registered = datetime(2031, 1, 1, tzinfo=UTC)
        await a.schedule(timer("far", registered + timedelta(days=1), registered))
        await a.schedule(timer("near", registered + timedelta(seconds=30), registered))
        assert await inbox.next() == registered + timedelta(seconds=30)

    async def test_listener_reconnects_and_asks_for_a_look(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """After its connection is killed, the listener reconnects and wakes the host once."""
        inbox = Inbox()
        a = await make_started_store()
        b = await make_started_store(on_remote_schedule=inbox)
        assert b.listener is not None
        killed = postgres_sql.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE query LIKE 'LISTEN%%' AND datname = current_database()"
        ).fetchall()
        assert len(killed) == 2
        assert await inbox.next() == EARLIEST
        due = datetime(2031, 1, 1, tzinfo=UTC)
        await a.schedule(timer("after-reconnect", due))
        assert await inbox.next() == due

    async def test_listen_false_holds_no_listening_connection(
        self, make_started_store: MakeStore, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        """A store started with listen=False (a CLI, say) opens no LISTEN connection."""
        store = await make_started_store(listen=False)
        assert store.listener is None
        listening = postgres_sql.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%'"
        ).fetchone()
        assert listening == (0,)


class TestWorkerWakeUp:
    """A worker sleeping on a long poll is woken by a schedule on another instance."""

    async def test_remote_schedule_wakes_an_idle_worker(
        self, make_started_store: MakeStore
    ) -> None:
        """A timer scheduled through another store fires long before the 60 s poll."""
        scheduler = await make_started_store(owner_id="scheduler")
        firing = await make_started_store(owner_id="firing")
        bus = MemoryEventBus()
        worker = TimerWorker(firing, bus, SystemClock(), polling_interval=60.0)
        firing.on_remote_schedule = worker.notify_scheduled
        run = asyncio.create_task(worker.run())
        try:
            while worker.passes == 0:  # the worker is asleep on its 60 s poll after one pass
                await asyncio.sleep(0.01)
            await scheduler.schedule(timer("wake", datetime.now(UTC)))
            published = await asyncio.wait_for(bus.wait_for_published(1), timeout=10)
        finally:
            worker.stop()
            await run
        assert [e.payload.service_call_id for e in published] == ["wake"]
