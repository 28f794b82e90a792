"""Per-tenant limits on the streams, on a real nats-server (issue 43): a tenant cannot queue
more commands than its limit (the publish is refused, the producer told), commands stored
leave the stream so the limit counts what waits, and dead letters are kept per tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

import pytest_asyncio

from tests.timer_adapters_nats.jetstream import wait_until
from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient
from timer_core import Command, CommandOutcome, MessageEnvelope, PublishError

DUE = datetime(2032, 1, 2, 3, 4, 5, tzinfo=UTC)
LIMIT = 50
WITHIN_S = 60.0


class Store:
    """A command handler that takes every command."""

    def __init__(self) -> None:
        self.handled = 0

    async def __call__(self, batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        self.handled += len(batch)
        return [CommandOutcome.SCHEDULED] * len(batch)


@pytest_asyncio.fixture
async def broker(nats_url: str) -> AsyncIterator[NatsBroker]:
    settings = NatsSettings(
        url=nats_url, ack_timeout_s=5.0, max_queued_per_tenant=LIMIT, max_dead_letters_per_tenant=5
    )
    async with NatsBroker(settings) as broker:
        yield broker


async def subject_count(broker: NatsBroker, subject: str, stream: str = "TIMER_COMMANDS") -> int:
    info = await broker.jetstream.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


class TestQueueLimit:
    async def test_a_tenant_cannot_queue_more_than_its_limit(self, broker: NatsBroker) -> None:
        """With nothing read, A's 51st command is refused with the server's reason, and only
        A's: B still queues its own."""
        client = TimerClient(broker)
        envelopes = [client.schedule_envelope("tenant-a", f"a-{i}", DUE) for i in range(LIMIT + 5)]
        results = await client.send_many(envelopes)
        assert results[:LIMIT] == [None] * LIMIT
        refused = results[LIMIT:]
        assert all(isinstance(error, PublishError) for error in refused)
        assert "maximum messages per subject exceeded" in str(refused[0])
        assert await subject_count(broker, "timer.commands.tenant-a") == LIMIT
        await client.schedule("tenant-b", "b-1", DUE)
        assert await subject_count(broker, "timer.commands.tenant-b") == 1

    async def test_stored_commands_leave_the_stream_so_the_tenant_can_send_again(
        self, broker: NatsBroker
    ) -> None:
        """Once its lane stored and acked them, A's commands are removed from the stream and
        A can queue up to its limit again."""
        client = TimerClient(broker)
        first = [client.schedule_envelope("tenant-a", f"a-{i}", DUE) for i in range(LIMIT)]
        assert await client.send_many(first) == [None] * LIMIT
        store = Store()
        source = broker.command_source()
        task = asyncio.create_task(source.run(store))
        try:
            await wait_until(lambda: store.handled >= LIMIT, within=WITHIN_S, what="stored")

            async def emptied() -> bool:
                return await subject_count(broker, "timer.commands.tenant-a") == 0

            await wait_until(emptied, within=WITHIN_S, what="A's stored commands removed")
            again = [client.schedule_envelope("tenant-a", f"b-{i}", DUE) for i in range(LIMIT)]
            assert await client.send_many(again) == [None] * LIMIT
        finally:
            await asyncio.wait_for(source.stop(), 30)
            await task


class TestDeadLetterLimit:
    async def test_dead_letters_are_kept_per_tenant_up_to_the_limit(
        self, broker: NatsBroker
    ) -> None:
        """Eight bad commands of A leave A's five latest dead letters; B's one is kept."""
        for i in range(8):
            await broker.jetstream.publish("timer.commands.tenant-a", f"bad {i}".encode())
        await broker.jetstream.publish("timer.commands.tenant-b", b"bad b")
        source = broker.command_source()
        task = asyncio.create_task(source.run(Store()))
        try:

            async def dead_lettered() -> bool:
                info = await broker.jetstream.stream_info("TIMER_DLQ")
                return int(info.state.last_seq) >= 9

            await wait_until(dead_lettered, within=WITHIN_S, what="nine dead letters")
        finally:
            await asyncio.wait_for(source.stop(), 30)
            await task
        assert await subject_count(broker, "timer.dlq.tenant-a", "TIMER_DLQ") == 5
        assert await subject_count(broker, "timer.dlq.tenant-b", "TIMER_DLQ") == 1
