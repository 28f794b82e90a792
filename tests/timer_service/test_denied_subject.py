"""One tenant's event subject denied by nats-server's permissions, through the real service
(the docs' own example of a quarantine cause): the other tenants' timers fire on time while
the poison timer is retried and then quarantined, with the server's words as its last
error."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.secure_nats import hostport, start_configured_server
from tests.timer_adapters_nats.jetstream import wait_until
from tests.timer_service.process import ServiceProcess, isolated_env
from timer_adapters_nats import NatsBroker, NatsServerProcess, NatsSettings, TimerClient
from timer_core.codec import decode_event

DENIED = "denied-tenant"
TENANTS = [f"tenant-{t}" for t in range(6)]
PASSWORD = "service-pw-0123"
TOKEN = "denied-subject-token-0123456789"
#: Issue 42's promise: other tenants' timers at most this late while one is retried.
LATE_S = 0.25
BUDGET_S = 60.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServerProcess]:
    """A nats-server whose service user may publish anywhere but the denied tenant's events,
    and a host user who may do anything."""
    config = (
        "jetstream {}\n"
        "authorization { users: [\n"
        f'  {{user: timer-service, password: "{PASSWORD}", permissions: '
        f'{{publish: {{deny: ["timer.events.{DENIED}.>"]}}}}}}\n'
        f'  {{user: host, password: "{PASSWORD}"}}\n'
        "] }\n"
    )
    started = start_configured_server(tmp_path / "nats", config)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def service(server: NatsServerProcess, tmp_path: Path) -> Iterator[ServiceProcess]:
    """The service logged in as the service user, its quarantine behind ``TOKEN``."""
    env = isolated_env(
        TIMER_DB_PATH=tmp_path / "timer.db",
        TIMER_BROKER_URL=f"nats://timer-service:{PASSWORD}@{hostport(server)}",
        TIMER_HTTP_TOKEN=TOKEN,
        # A failing timer's backoff doubles up to the polling interval: ten failures (the
        # quarantine) within a few seconds.
        TIMER_POLLING_INTERVAL=500,
    )
    started = ServiceProcess(env, tmp_path, tmp_path / "service.log")
    try:
        started.start()
        started.wait_healthy()
        yield started
    finally:
        started.kill_group()


def quarantined(service: ServiceProcess) -> list[dict[str, Any]]:
    """``GET /quarantine``: the service's quarantined timers."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{service.http_port}/quarantine",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        rows: list[dict[str, Any]] = json.loads(response.read())
    return rows


async def lateness(broker: NatsBroker) -> dict[str, float]:
    """Each event TIMER_EVENTS holds: when the stream stored it minus its timer's due time,
    in seconds, by tenant/call."""
    js = broker.jetstream
    stream = broker.settings.events_stream
    state = (await js.stream_info(stream)).state
    late = {}
    for seq in range(state.first_seq, state.last_seq + 1):
        raw = await js.get_msg(stream, seq)
        assert raw.data is not None and raw.time is not None
        event = decode_event(raw.data).payload
        late[f"{event.tenant_id}/{event.service_call_id}"] = (
            raw.time - event.due_at
        ).total_seconds()
    return late


class TestDeniedEventSubject:
    async def test_others_on_time_while_the_poison_is_retried_and_quarantined(
        self, server: NatsServerProcess, service: ServiceProcess
    ) -> None:
        """The denied tenant's timer and 96 of six other tenants are due over six seconds:
        every other one is stored in TIMER_EVENTS at most 250 ms after its due time while
        the denied one fails again and again, then is quarantined with the server's own
        words as its last error: 'Permissions Violation for Publish to "<its subject>"'."""
        settings = NatsSettings(url=f"nats://host:{PASSWORD}@{hostport(server)}", provision=False)
        async with NatsBroker(settings) as broker:
            client = TimerClient(broker)
            start = datetime.now(UTC) + timedelta(seconds=1)
            others = {
                f"{TENANTS[n % 6]}/call-{n}": start + timedelta(milliseconds=62 * n)
                for n in range(96)
            }
            await client.schedule(DENIED, "poison", start)
            for key, due in others.items():
                tenant, call = key.split("/")
                await client.schedule(tenant, call, due)

            rows: list[dict[str, Any]] = []

            async def quarantine_shows_it() -> bool:
                rows[:] = await asyncio.to_thread(quarantined, service)
                return bool(rows)

            async def all_stored() -> bool:
                info = await broker.jetstream.stream_info(settings.events_stream)
                return int(info.state.messages) >= len(others)

            await wait_until(quarantine_shows_it, within=BUDGET_S, what="the quarantine")
            await wait_until(all_stored, within=BUDGET_S, what="the other tenants' events")
            late = await lateness(broker)
        (row,) = rows
        assert (row["tenantId"], row["serviceCallId"]) == (DENIED, "poison")
        assert row["failures"] >= 10
        subject = f"timer.events.{DENIED}.poison"
        assert f'Permissions Violation for Publish to "{subject}"' in row["error"], row["error"]
        assert set(late) == set(others)
        too_late = {key: round(s, 3) for key, s in late.items() if s > LATE_S}
        assert not too_late, f"later than {LATE_S}s: {too_late}"
        assert min(late.values()) >= 0
