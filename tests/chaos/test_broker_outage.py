"""Scenario 2: nats-server dies for several polling intervals while timers come due; when it is
back every timer fires, once, and none was marked Reached without its event in the stream."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from tests.chaos.conftest import ServiceFactory
from tests.chaos.rig import (
    at_least,
    count_messages,
    db_rows,
    duplicates,
    read_events,
    report,
    service_backlog,
    wait_until,
)
from tests.timer_service.process import http_get
from timer_adapters_nats import TimerClient
from timer_adapters_nats.embedded import NatsServerProcess
from timer_core.instants import ceil_ms, parse_timestamp

pytestmark = pytest.mark.chaos

TIMERS = 600
TENANTS = 8
POLLING_MS = 500
OUTAGE_S = 3.0


class TestBrokerOutage:
    async def test_timers_due_during_an_outage_fire_after_it_and_only_then_are_marked(
        self,
        tmp_path: Path,
        make_service: ServiceFactory,
        broker: NatsServerProcess,
        js: JetStreamContext,
    ) -> None:
        """Timers due while nats-server is down fire once it is back; every Reached row in the
        database has its event in the stream, and no event is stored twice."""
        service = make_service(TIMER_POLLING_INTERVAL=POLLING_MS)
        service.start()
        await asyncio.to_thread(service.wait_healthy, 60)

        # A few due before the outage, most during it (it starts five seconds from now, time
        # enough to store them all even on a busy machine).
        now = datetime.now(UTC)
        outage_at = now + timedelta(seconds=5)
        due: dict[tuple[str, str], datetime] = {}
        for index in range(TIMERS):
            offset = 0.3 + 1.2 * index / TIMERS if index < TIMERS // 6 else None
            at = (
                now + timedelta(seconds=offset)
                if offset is not None
                else outage_at + timedelta(seconds=0.2 + (OUTAGE_S - 0.4) * index / TIMERS)
            )
            due[(f"tenant-{index % TENANTS}", f"call-{index}")] = ceil_ms(at)
        async with TimerClient.connect(broker.url) as client:
            envelopes = [client.schedule_envelope(t, c, at) for (t, c), at in due.items()]
            assert await client.send_many(envelopes) == [None] * TIMERS

        async def all_acked() -> bool:
            return (await service_backlog(js)).settled

        await wait_until(all_acked, within=30, what="every command to be stored and acked")
        # The outage is set for a moment relative to the due times, not to an event.
        await asyncio.sleep(max(0.0, (outage_at - datetime.now(UTC)).total_seconds()))

        # The outage: nats-server is killed, and kept down for several polling intervals.
        db = tmp_path / "timer.db"
        broker.kill()
        killed_at = datetime.now(UTC)
        down_at = time.monotonic()
        health_during: set[int] = set()
        while time.monotonic() - down_at < OUTAGE_S:
            assert service.running, service.log()
            health_during.add(http_get(service.http_port, "/healthz")[0])
            await asyncio.sleep(0.1)
        rows_during = db_rows(db)
        came_due_by_then = datetime.now(UTC)
        publish_failures = service.metric("timer_publish_failures_total")
        worker_errors = service.metric("timer_worker_errors_total")
        await asyncio.to_thread(broker.start)
        back_at = time.monotonic()
        outage_s = back_at - down_at

        await wait_until(
            lambda: at_least(count_messages(js, "TIMER_EVENTS"), TIMERS),
            within=60,
            what="every timer to fire after the outage",
        )
        drain_s = time.monotonic() - back_at
        await wait_until(
            lambda: all(r["state"] == "Reached" for r in db_rows(db)),
            within=30,
            what="every timer marked Reached",
        )
        events = await read_events(js)
        assert {e.key for e in events} == set(due)
        assert all(e.due_at == due[e.key] for e in events)
        assert all(e.reached_at >= e.due_at and e.stored_at >= e.due_at for e in events)
        dups = duplicates(events)
        assert dups == 0

        # Nothing was marked without its event: each Reached row's firing is in the stream,
        # and its reachedAt is the one the event carries.
        fired = {e.key: e for e in events}
        for row in db_rows(db):
            event = fired[(row["tenant_id"], row["service_call_id"])]
            assert parse_timestamp(row["due_at"]) == event.due_at
            assert parse_timestamp(row["reached_at"]) == event.reached_at
        # While the broker was down no timer that came due after it died was marked.
        marked_blind = [
            r
            for r in rows_during
            if r["state"] == "Reached" and parse_timestamp(r["due_at"]) > killed_at
        ]
        assert not marked_blind
        came_due_while_down = sum(killed_at < at <= came_due_by_then for at in due.values())
        assert came_due_while_down >= TIMERS // 2
        assert health_during == {503}
        assert service.running
        assert service.terminate() == 0
        report(
            "broker-outage",
            timers=TIMERS,
            outage_s=round(outage_s, 1),
            polling_interval_ms=POLLING_MS,
            came_due_while_down=came_due_while_down,
            reached_before_outage_end=sum(r["state"] == "Reached" for r in rows_during),
            marked_without_publish=len(marked_blind),
            publish_failures=int(publish_failures),
            worker_errors=int(worker_errors),
            time_to_drain_s=round(drain_s, 1),
            duplicates=dups,
            peak_rss_mb=service.watch.peak_rss_mb,
        )
