"""Scenario 6: 100,000 timers came due while the service was down; it drains them in bounded
batches, each tenant's in due order, keeps taking commands meanwhile, and its memory stays
bounded."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats.js.errors
import pytest
from nats.js.client import JetStreamContext

from tests.chaos.conftest import ServiceFactory
from tests.chaos.rig import (
    at_least,
    count_messages,
    db_count,
    db_rows,
    duplicates,
    read_events,
    report,
    service_backlog,
    wait_until,
)
from timer_adapters_nats import TimerClient
from timer_adapters_nats.embedded import NatsServerProcess
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import TimerEntry
from timer_core.firing import READ_AHEAD
from timer_core.instants import floor_ms

pytestmark = pytest.mark.chaos

TIMERS = 100_000
TENANTS = 40
BATCH = 100
#: Peak resident memory allowed to the service while draining: about twice what it uses idle.
#: Holding the backlog in memory would cost far more (a TimerEntry and its event are several
#: hundred bytes each, 100,000 of them).
MAX_RSS_MB = 120


async def prefill(path: Path, now: datetime) -> list[TimerEntry]:
    """Write the backlog straight into the database, due over the past hour, in random order."""
    rng = random.Random(6)
    entries = [
        TimerEntry(
            tenant_id=f"tenant-{rng.randrange(TENANTS)}",
            service_call_id=f"call-{index}",
            # Whole seconds over an hour: many timers share a due time, so ties are ordered
            # by (tenant, serviceCallId) as well.
            due_at=now - timedelta(seconds=rng.randrange(1, 3600)),
            registered_at=now - timedelta(hours=2),
        )
        for index in range(TIMERS)
    ]
    store = SqliteTimerStore(path)
    await store.start()
    try:
        for start in range(0, TIMERS, 10_000):
            await store.apply(entries[start : start + 10_000])
    finally:
        await store.aclose()
    return entries


class TestBacklogAfterDowntime:
    async def test_drains_in_due_order_in_bounded_batches_while_taking_commands(
        self,
        tmp_path: Path,
        make_service: ServiceFactory,
        broker: NatsServerProcess,
        js: JetStreamContext,
    ) -> None:
        """A 100,000-timer backlog drains in due order with bounded memory, and a command sent
        mid-drain is stored and acked before the drain ends."""
        now = floor_ms(datetime.now(UTC))
        entries = await prefill(tmp_path / "timer.db", now)
        service = make_service(TIMER_BATCH_SIZE=BATCH, TIMER_POLLING_INTERVAL=1000)
        started = time.monotonic()
        service.start()
        await asyncio.to_thread(service.wait_healthy, 60)

        async def events_stored() -> int:
            try:
                return await count_messages(js, "TIMER_EVENTS")
            except nats.js.errors.NotFoundError:  # not provisioned yet
                return 0

        # Mid-drain: once a tenth has gone out, a host schedules a new timer.
        await wait_until(
            lambda: at_least(events_stored(), TIMERS // 10), within=120, what="drain to start"
        )
        async with TimerClient.connect(broker.url) as client:
            await client.schedule("tenant-live", "mid-drain", now + timedelta(hours=1))
        acked: list[tuple[datetime, int]] = []

        async def command_acked() -> bool:
            if (await service_backlog(js)).settled:
                # Observed after the fact: an upper bound of when the service acked it.
                acked.append((datetime.now(UTC), await events_stored()))
                return True
            return False

        await wait_until(command_acked, within=60, what="the mid-drain command to be acked")
        await wait_until(
            lambda: at_least(events_stored(), TIMERS), within=240, what="the backlog to drain"
        )
        drain_s = time.monotonic() - started
        db = tmp_path / "timer.db"

        await wait_until(
            lambda: db_count(db, "state = 'Reached'") == TIMERS, within=30, what="every mark"
        )
        live = [r for r in db_rows(db) if r["tenant_id"] == "tenant-live"]
        assert [(r["service_call_id"], r["state"]) for r in live] == [("mid-drain", "Scheduled")]

        read_started = time.monotonic()
        events = await read_events(js)
        read_s = time.monotonic() - read_started
        assert len(events) == TIMERS
        assert {e.key for e in events} == {(e.tenant_id, e.service_call_id) for e in entries}
        # Stored and acked before the last backlog event went out: the drain does not hold
        # commands back.
        ((acked_at, events_when_acked),) = acked
        assert acked_at < events[-1].stored_at

        # Bounded reads, each tenant in due order. A read finds due timers, at most a batch
        # (or, for a backlog on a store that takes no claims, a page read ahead of at most
        # READ_AHEAD, handed out a batch at a time), and gives them all the read's reachedAt.
        # So in stream order the events form runs of equal reachedAt, one per read, each
        # holding at most a page. When more is due than a batch holds, the reads are
        # shared among the tenants (fairness: no tenant waits for another's backlog), so the
        # promise is per tenant: every event of a tenant in a run is due no earlier than every
        # event of that tenant in the runs before it. Within a run the order is not promised
        # (concurrent publishes); inversions there are only counted.
        passes = [list(run) for _, run in itertools.groupby(events, key=lambda e: e.reached_at)]
        assert max(len(run) for run in passes) <= max(BATCH, READ_AHEAD)
        latest_fired: dict[str, datetime] = {}
        for run in passes:
            run_dues: dict[str, list[datetime]] = {}
            for e in run:
                run_dues.setdefault(e.tenant_id, []).append(e.due_at)
            for tenant, dues in run_dues.items():
                before = latest_fired.get(tenant)
                assert before is None or before <= min(dues), (
                    f"pass at {run[0].reached_at} fired a timer of {tenant} due before one of "
                    "its timers fired earlier"
                )
                latest_fired[tenant] = max(dues) if before is None else max(before, *dues)
        inversions = sum(
            1 for run in passes for a, b in itertools.pairwise(run) if b.due_at < a.due_at
        )
        assert all(e.reached_at >= e.due_at and e.stored_at >= e.due_at for e in events)
        dups = duplicates(events)
        assert dups == 0
        firing_s = (events[-1].stored_at - events[0].stored_at).total_seconds()

        assert service.watch.peak_rss_mb < MAX_RSS_MB
        assert service.terminate() == 0
        report(
            "backlog",
            timers=TIMERS,
            batch_size=BATCH,
            firing_passes=len(passes),
            start_to_drained_s=round(drain_s, 1),
            first_to_last_event_s=round(firing_s, 1),
            events_per_s=round(TIMERS / firing_s),
            command_acked_with_events_out=f"{events_when_acked}/{TIMERS}",
            inversions=inversions,
            duplicates=dups,
            peak_rss_mb=service.watch.peak_rss_mb,
            read_back_s=round(read_s, 1),
        )
