"""The limits of the per-tenant recipe (``timer-service nats-config --max-...``, issue 43) on a
real ``nats-server`` with the real service: a tenant cannot open more connections or hold
more subscriptions than its limit nor publish a larger message, each refused in a way it
sees; it reads its own dead letters (why a command was refused), never another's."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import nats.errors
import pytest

from tests.timer_service.tenant_rig import REFUSED_WAIT_S, TenantDeployment, connected, running
from timer_adapters_nats import BrokerUnavailable, TimerClient
from timer_service.tenancy import TenantLimits, nats_config

TENANTS = ("tenant-a", "tenant-b")
PASSWORDS = {"timer-service": "svc-pw", "tenant-a": "a-pw", "tenant-b": "b-pw"}
LIMITS = TenantLimits(
    max_connections=3, max_subscriptions=12, max_payload=2048, max_queued=30, max_dead_letters=4
)
#: Budget for the service to take and dead-letter a command on a busy machine.
WITHIN_S = 30.0
FAR = datetime.now(UTC) + timedelta(days=30)


class Deployment(TenantDeployment):
    """A server from the recipe written with LIMITS, and the service logged in to it."""

    def __init__(self, root: Path) -> None:
        recipe = root / "tenants.conf"
        recipe.write_text(nats_config(list(TENANTS), limits=LIMITS))
        limits = {
            "TIMER_MAX_PENDING_PER_TENANT": "2",
            "TIMER_MAX_QUEUED_PER_TENANT": str(LIMITS.max_queued),
            "TIMER_MAX_DEAD_LETTERS_PER_TENANT": str(LIMITS.max_dead_letters),
        }
        super().__init__(root, recipe, TENANTS, PASSWORDS, limits)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from running(Deployment(tmp_path_factory.mktemp("limits")))


async def next_dead_letter(deployment: Deployment, tenant: str) -> nats.aio.msg.Msg:
    """The next dead letter on ``tenant``'s own consumer, pulled (and acked) as the tenant
    may, with nats-py as the docs show."""
    nc = await nats.connect(deployment.url(tenant))
    try:
        pull = await nc.jetstream().pull_subscribe_bind(tenant, "TIMER_DLQ")
        (letter,) = await pull.fetch(1, timeout=WITHIN_S)
        await letter.ack()
        return letter
    finally:
        await nc.close()


async def closing_client(deployment: Deployment, user: str) -> nats.aio.client.Client:
    """A plain client as ``user`` that does not reconnect once the server closes it."""
    return await nats.connect(deployment.url(user), allow_reconnect=False)


async def wait_closed(nc: nats.aio.client.Client) -> None:
    """Wait (flushing) until the server has closed ``nc``, within WITHIN_S."""
    for _ in range(int(WITHIN_S / 0.05)):
        if nc.is_closed:
            return
        with contextlib.suppress(Exception):
            await nc.flush(timeout=0.5)
        await asyncio.sleep(0.05)
    raise AssertionError("the server did not close the connection")


class TestConnectionsAndSubscriptions:
    async def test_a_tenant_cannot_open_more_connections_than_its_limit(
        self, deployment: Deployment
    ) -> None:
        """Three connections as tenant-a are accepted, the fourth refused at connect; B still
        connects."""
        async with (
            connected(deployment, "tenant-a"),
            connected(deployment, "tenant-a"),
            connected(deployment, "tenant-a"),
        ):
            with pytest.raises(BrokerUnavailable, match=r"(?i)maximum account active connections"):
                async with connected(deployment, "tenant-a"):
                    pass
            async with connected(deployment, "tenant-b") as b:
                assert b.is_connected

    async def test_a_tenant_cannot_hold_more_subscriptions_than_its_limit(
        self, deployment: Deployment
    ) -> None:
        """Past the account's limit of subscriptions the server answers ``maximum
        subscriptions exceeded``, and the tenant's client closes the connection with it."""
        nc = await closing_client(deployment, "tenant-a")
        try:
            for i in range(LIMITS.max_subscriptions + 3):
                await nc.subscribe(f"_INBOX.mine.{i}")
            await wait_closed(nc)
        finally:
            await nc.close()
        assert "maximum subscriptions exceeded" in str(nc.last_error).lower()


class TestPayload:
    async def test_a_message_over_the_tenants_payload_limit_is_refused(
        self, deployment: Deployment
    ) -> None:
        """A 4 KiB message from tenant-a (its limit: 2 KiB) makes the server close the
        connection with a payload violation; nothing of it is stored."""
        async with connected(deployment, "timer-service") as service:
            before = (await service.jetstream.stream_info("TIMER_COMMANDS")).state.last_seq
        nc = await closing_client(deployment, "tenant-a")
        try:
            await nc.publish("timer.commands.tenant-a", b"{" + b" " * 4096 + b"}")
            await wait_closed(nc)
        finally:
            await nc.close()
        assert "payload" in str(nc.last_error).lower() or isinstance(
            nc.last_error, ConnectionResetError
        ), repr(nc.last_error)
        async with connected(deployment, "timer-service") as service:
            after = (await service.jetstream.stream_info("TIMER_COMMANDS")).state.last_seq
        assert after == before


class TestRefusalsTheTenantSees:
    async def test_a_tenant_reads_why_its_command_was_refused(self, deployment: Deployment) -> None:
        """Over TIMER_MAX_PENDING_PER_TENANT=2, A's third timer is refused; A pulls the
        dead letter from its own consumer, with the reason in Timer-Error."""
        async with connected(deployment, "tenant-a") as a:
            client = TimerClient(a)
            for i in range(3):
                await client.schedule("tenant-a", f"quota-{i}", FAR)
        letter = await next_dead_letter(deployment, "tenant-a")
        assert letter.headers is not None
        assert "cap of pending timers" in letter.headers["Timer-Error"]
        assert json.loads(letter.data)["payload"]["serviceCallId"] == "quota-2"

    async def test_a_tenant_cannot_read_another_tenants_dead_letters(
        self, deployment: Deployment
    ) -> None:
        """B's pull on A's dead-letter consumer gets no answer (not exported to B)."""
        async with connected(deployment, "tenant-b") as b:
            with pytest.raises(nats.errors.Error):
                await b.client.request(
                    "$JS.API.CONSUMER.MSG.NEXT.TIMER_DLQ.tenant-a",
                    b'{"batch":1,"no_wait":true}',
                    timeout=REFUSED_WAIT_S,
                )

    async def test_the_service_limits_each_tenants_queue_and_dead_letters(
        self, deployment: Deployment
    ) -> None:
        """The streams the service made carry the per-tenant limits it was given."""
        async with connected(deployment, "timer-service") as service:
            commands = (await service.jetstream.stream_info("TIMER_COMMANDS")).config
            dlq = (await service.jetstream.stream_info("TIMER_DLQ")).config
        assert commands.max_msgs_per_subject == LIMITS.max_queued
        assert commands.discard_new_per_subject
        assert dlq.max_msgs_per_subject == LIMITS.max_dead_letters
