"""Lateness one tenant cannot skew (issue 43): a timer scheduled in the past counts from when
it was stored, and the worst tenants' lateness is reported with a bounded set of labels."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry

from tests.timer_service.process import ServiceProcess, http_get
from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient
from timer_core import ScheduleTimer, ServiceCallId, TenantId, TimerEntry
from timer_core.commands import scheduled_entry
from timer_service.metrics import PrometheusInstrumentation, WorstTenants, firing_lateness

NOW = datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)
#: How long a fired timer may take to show in /metrics on a busy machine.
FIRED_WITHIN_S = 30.0


def fired(
    tenant: str, call: str, due_at: datetime, registered_at: datetime, late_s: float
) -> TimerEntry:
    """A timer of ``tenant`` stored at ``registered_at``, fired ``late_s`` after it could."""
    command = ScheduleTimer(TenantId(tenant), ServiceCallId(call), due_at)
    entry = scheduled_entry(command, registered_at)
    return entry.reach(max(due_at, registered_at) + timedelta(seconds=late_s))


class TestLatenessFromWhenItCouldFire:
    def test_a_timer_due_in_the_past_counts_from_when_it_was_stored(self) -> None:
        """Due in year 1, stored now, fired 20 ms later: 0.02 s late, not 6.4e10 s."""
        entry = fired("a", "past", datetime(1, 1, 1, tzinfo=UTC), NOW, 0.02)
        assert firing_lateness([entry]) == [pytest.approx(0.02)]

    def test_a_timer_due_later_counts_from_its_due_time(self) -> None:
        """Stored before it is due: lateness is reachedAt - dueAt, as before."""
        entry = fired("a", "future", NOW + timedelta(hours=1), NOW, 1.5)
        assert firing_lateness([entry]) == [pytest.approx(1.5)]

    def test_the_shared_histogram_keeps_a_sum_a_tenant_cannot_inflate(self) -> None:
        """A tenant's timers due at year 1 add only their real lateness to the sum."""
        metrics = PrometheusInstrumentation(CollectorRegistry())
        entries = [fired("a", f"p{i}", datetime(1, 1, 1, tzinfo=UTC), NOW, 0.01) for i in range(5)]
        metrics.timers_fired(entries)
        total = metrics.registry.get_sample_value("timer_firing_lateness_seconds_sum")
        assert total == pytest.approx(0.05)


class TestWorstTenants:
    def test_reports_the_latest_tenants_only(self) -> None:
        """Of 50 tenants, the 10 whose timers fired latest are labelled, worst first."""
        worst = WorstTenants(top=10)
        entries = [fired(f"t{i}", "c", NOW, NOW, i / 10) for i in range(50)]
        worst.observe(entries, firing_lateness(entries))
        reported = worst.worst()
        assert [tenant for tenant, _ in reported] == [f"t{i}" for i in range(49, 39, -1)]
        assert reported[0][1] == pytest.approx(4.9)

    def test_labels_stay_bounded_however_many_tenants_fire(self) -> None:
        """A million-tenant storm costs at most ``most_tenants`` entries and ``top`` labels."""
        worst = WorstTenants(top=5, most_tenants=1000)
        for start in range(0, 20_000, 1000):
            entries = [fired(f"t{i}", "c", NOW, NOW, i / 1e3) for i in range(start, start + 1000)]
            worst.observe(entries, firing_lateness(entries))
        assert len(worst._current) <= 1000
        assert [tenant for tenant, _ in worst.worst()] == [
            f"t{i}" for i in range(19_999, 19_994, -1)
        ]

    def test_a_tenant_drops_out_two_windows_after_its_last_late_timer(self) -> None:
        """Lateness is reported for one to two windows, then forgotten."""
        now = [0.0]
        worst = WorstTenants(window_s=60, clock=lambda: now[0])
        entries = [fired("slow", "c", NOW, NOW, 3.0)]
        worst.observe(entries, firing_lateness(entries))
        now[0] = 70.0
        assert worst.worst() == [("slow", 3.0)]
        now[0] = 130.0
        assert worst.worst() == []


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[TimerClient]:
    broker = NatsBroker(NatsSettings(url=nats_url, provision=False, ack_timeout_s=5.0))
    await broker.start()
    try:
        yield TimerClient(broker)
    finally:
        await broker.aclose()


def metric(port: int, name: str) -> float | None:
    _, body = http_get(port, "/metrics")
    for line in body.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[-1])
    return None


class TestOnTheService:
    async def test_scheduling_in_the_past_does_not_move_the_shared_histogram(
        self, service: ServiceProcess, client: TimerClient
    ) -> None:
        """Timers due at 0001-01-01 fire at once and add under a second each to
        timer_firing_lateness_seconds_sum; the tenant shows among the worst by its real
        lateness, not by centuries."""
        service.start()
        service.wait_healthy()
        year_one = datetime(1, 1, 1, tzinfo=UTC)
        for i in range(3):
            await client.schedule("tenant-past", f"ancient-{i}", year_one)
        port = service.http_port
        deadline = time.monotonic() + FIRED_WITHIN_S
        while (metric(port, "timer_schedules_processed_total") or 0) < 3:
            assert time.monotonic() < deadline, "the three timers did not fire"
            await asyncio.sleep(0.1)
        total = metric(port, "timer_firing_lateness_seconds_sum")
        assert total is not None and total < 3 * FIRED_WITHIN_S
        worst = metric(port, "timer_tenant_lateness_worst_seconds")
        assert worst is not None and worst < FIRED_WITHIN_S
        _, body = http_get(port, "/metrics")
        assert 'timer_tenant_lateness_worst_seconds{tenant="tenant-past"}' in body
