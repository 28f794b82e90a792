"""The per-tenant authorization recipe (deploy/nats/tenants.conf, shown in docs/operations.md)
on a real ``nats-server`` with the real service: each tenant schedules and reads only its own
timers, the server refuses the rest, and the service works for both."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.js.api import ConsumerConfig

from tests.secure_nats import DEPLOY_NATS, start_server_from_file
from tests.timer_service.process import ServiceProcess, free_port
from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient
from timer_core import PublishError, encode_envelope

RECIPE = DEPLOY_NATS / "tenants.conf"
PASSWORDS = {
    "timer-service": "service-pw-1",
    "tenant-a": "tenant-a-pw-2",
    "tenant-b": "tenant-b-pw-3",
}
# A refused request gets no reply: how long each of those waits.
REFUSED_WAIT_S = 1.0
VIOLATION = "permissions violation"


class Deployment:
    """The recipe's server and the service logged in as its user."""

    def __init__(self, root: Path) -> None:
        environment = {
            "TIMER_SERVICE_PASSWORD": PASSWORDS["timer-service"],
            "TENANT_A_PASSWORD": PASSWORDS["tenant-a"],
            "TENANT_B_PASSWORD": PASSWORDS["tenant-b"],
        }
        self.server = start_server_from_file(root / "nats", RECIPE, environment)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env.update(
            TIMER_DB_PATH=str(root / "timer.db"),
            TIMER_BROKER_URL=self.url("timer-service"),
            TIMER_BROKER_INBOX_PREFIX="_INBOX.timer-service",
            TIMER_HTTP_PORT=str(free_port()),
            TIMER_POLLING_INTERVAL="200",
        )
        self.service = ServiceProcess(env, root, root / "service.log")
        try:
            self.service.start()
            self.service.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def url(self, user: str) -> str:
        return f"nats://{user}:{PASSWORDS[user]}@127.0.0.1:{self.server.port}"

    def settings(self, user: str) -> NatsSettings:
        """A tenant's settings: its own inbox, no provisioning, refusals noticed quickly."""
        return NatsSettings(
            url=self.url(user),
            provision=False,
            inbox_prefix=f"_INBOX.{user}",
            ack_timeout_s=REFUSED_WAIT_S,
            client_name=user,
        )

    def stop(self) -> None:
        self.service.kill_group()
        self.server.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    started = Deployment(tmp_path_factory.mktemp("tenants"))
    try:
        yield started
    finally:
        started.stop()


@asynccontextmanager
async def tenant(deployment: Deployment, user: str) -> AsyncIterator[NatsBroker]:
    broker = NatsBroker(deployment.settings(user))
    await broker.start()
    try:
        yield broker
    finally:
        await broker.aclose()


async def next_event_ids(broker: NatsBroker, user: str, count: int) -> list[str]:
    """The service call ids of the next ``count`` events the tenant's own consumer reads."""
    seen: list[str] = []
    async with broker.due_events(user, tenant_id=user) as events:
        async for delivery in events:
            async with delivery:
                seen.append(delivery.event.service_call_id)
            if len(seen) == count:
                break
    return seen


def violations(caplog: pytest.LogCaptureFixture, subject: str) -> list[str]:
    """The client's log lines reporting the server's refusal of ``subject`` (quoted).

    nats-py lower-cases the server's whole error line, the subject included.
    """
    messages = [record.getMessage().lower() for record in caplog.records]
    return [text for text in messages if VIOLATION in text and subject.lower() in text]


class TestTenantPermissions:
    """What tenant A may and may not do on the recipe's server."""

    async def test_service_serves_both_tenants(self, deployment: Deployment) -> None:
        """Each tenant schedules its own timer and reads its own DueTimeReached."""
        due = datetime.now(UTC) + timedelta(milliseconds=300)
        for user in ("tenant-a", "tenant-b"):
            async with tenant(deployment, user) as broker:
                await TimerClient(broker).schedule(user, f"own-{user}", due)
                assert await asyncio.wait_for(next_event_ids(broker, user, 1), 30) == [
                    f"own-{user}"
                ]

    @pytest.mark.parametrize("command", ["schedule", "cancel"])
    async def test_cannot_send_commands_for_another_tenant(
        self, deployment: Deployment, caplog: pytest.LogCaptureFixture, command: str
    ) -> None:
        """Tenant A's command on tenant B's subject is refused by the server, never stored."""
        caplog.set_level(logging.WARNING)
        async with tenant(deployment, "tenant-a") as broker:
            client = TimerClient(broker)
            send = (
                client.schedule("tenant-b", "stolen", datetime.now(UTC))
                if command == "schedule"
                else client.cancel("tenant-b", "stolen")
            )
            with pytest.raises(PublishError):
                await send
        assert violations(caplog, '"timer.commands.tenant-b"'), caplog.text
        async with tenant(deployment, "timer-service") as service:
            last = await service.jetstream.get_last_msg("TIMER_COMMANDS", "timer.commands.tenant-b")
        assert b"stolen" not in (last.data or b"")

    async def test_cannot_cancel_another_tenants_timer_through_its_own_subject(
        self, deployment: Deployment
    ) -> None:
        """A CancelTimer for B sent on A's own subject is dead-lettered: B's timer still fires."""
        async with tenant(deployment, "tenant-b") as b:
            await TimerClient(b).schedule(
                "tenant-b", "kept", datetime.now(UTC) + timedelta(seconds=1)
            )
            async with tenant(deployment, "tenant-a") as a:
                forged = TimerClient(a).cancel_envelope("tenant-b", "kept")
                ack = await a.jetstream.publish("timer.commands.tenant-a", encode_envelope(forged))
                assert ack.seq > 0  # stored: A may publish on its own subject
            assert await asyncio.wait_for(next_event_ids(b, "tenant-b", 1), 30) == ["kept"]

    async def test_cannot_subscribe_to_another_tenants_events(
        self, deployment: Deployment, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A core subscription to B's event subjects is refused by the server."""
        caplog.set_level(logging.WARNING)
        async with tenant(deployment, "tenant-a") as broker:
            await broker.client.subscribe("timer.events.tenant-b.>")
            await broker.client.flush()
            for _ in range(100):
                if violations(caplog, '"timer.events.tenant-b.>"'):
                    break
                await asyncio.sleep(0.02)  # the -ERR arrives after the PONG of flush()
        assert violations(caplog, '"timer.events.tenant-b.>"'), caplog.text

    async def test_cannot_read_another_tenants_events_through_jetstream(
        self, deployment: Deployment, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Neither a consumer filtered to B's events nor fetching from B's consumer is allowed."""
        caplog.set_level(logging.WARNING)
        async with tenant(deployment, "tenant-a") as broker:
            js = broker.jetstream
            snooping = ConsumerConfig(
                name="tenant-a", durable_name="tenant-a", filter_subject="timer.events.tenant-b.>"
            )
            with pytest.raises(asyncio.TimeoutError):
                await js.add_consumer("TIMER_EVENTS", snooping, timeout=REFUSED_WAIT_S)
            with pytest.raises(asyncio.TimeoutError):
                await js.consumer_info("TIMER_EVENTS", "tenant-b", timeout=REFUSED_WAIT_S)
            with pytest.raises(asyncio.TimeoutError):
                await broker.client.request(
                    "$JS.API.CONSUMER.MSG.NEXT.TIMER_EVENTS.tenant-b", b"1", REFUSED_WAIT_S
                )
            with pytest.raises(asyncio.TimeoutError):
                await js.get_msg("TIMER_EVENTS", subject="timer.events.tenant-b.own-tenant-b")
        for subject in (
            "$JS.API.CONSUMER.CREATE.TIMER_EVENTS.tenant-a.timer.events.tenant-b.>",
            "$JS.API.CONSUMER.INFO.TIMER_EVENTS.tenant-b",
            "$JS.API.CONSUMER.MSG.NEXT.TIMER_EVENTS.tenant-b",
            "$JS.API.STREAM.MSG.GET.TIMER_EVENTS",
        ):
            assert violations(caplog, f'"{subject}"'), (subject, caplog.text)
