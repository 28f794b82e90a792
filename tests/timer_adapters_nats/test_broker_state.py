"""NatsBroker.missing() and restore(): what of the streams and consumers is gone, recreated
where the command sources left off, and a restart keeping a recreated consumer as it is."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import attrs
from nats.js.api import DeliverPolicy

from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient
from timer_adapters_nats._pull import PullBatches
from timer_core import Command, CommandOutcome, MessageEnvelope

FAR = datetime.now(UTC) + timedelta(days=30)


class Recorder:
    """A command handler that notes each command's service call id."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, batch: list[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        self.seen += [str(envelope.payload.service_call_id) for envelope in batch]
        return [CommandOutcome.SCHEDULED] * len(batch)

    async def wait_for(self, count: int) -> None:
        for _ in range(400):
            if len(self.seen) >= count:
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"{len(self.seen)} of {count} commands handled: {self.seen}")


async def acked_through(broker: NatsBroker, seq: int) -> None:
    """Until the command consumer's ack floor reaches ``seq``."""
    for _ in range(400):
        info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer")
        if info.ack_floor is not None and info.ack_floor.stream_seq >= seq:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"commands up to {seq} never acked")


class TestMissing:
    async def test_nothing_missing_after_provisioning(self, settings: NatsSettings) -> None:
        """A provisioned broker, tenant consumers included, has nothing missing."""
        async with NatsBroker(attrs.evolve(settings, tenant_consumers=("t-1", "t-2"))) as broker:
            assert await broker.missing() == []
            info = await broker.jetstream.consumer_info("TIMER_EVENTS", "t-1")
            assert info.config.filter_subject == "timer.events.t-1.>"

    async def test_names_what_is_gone(self, settings: NatsSettings) -> None:
        """A deleted stream, command consumer and tenant consumer are each named; the
        tenant's dead-letter consumer goes with its stream and comes back with it."""
        async with NatsBroker(attrs.evolve(settings, tenant_consumers=("t-1",))) as broker:
            js = broker.jetstream
            await js.delete_consumer("TIMER_EVENTS", "t-1")
            await js.delete_consumer("TIMER_COMMANDS", "timer")
            await js.delete_stream("TIMER_DLQ")
            assert await broker.missing() == [
                "stream TIMER_DLQ",
                "consumer timer on TIMER_COMMANDS",
                "consumer t-1 on TIMER_EVENTS",
            ]
            assert sorted(await broker.restore()) == sorted(
                [
                    "stream TIMER_DLQ",
                    "consumer timer on TIMER_COMMANDS",
                    "consumer t-1 on TIMER_EVENTS",
                    "consumer t-1 on TIMER_DLQ",
                ]
            )
            assert await broker.missing() == []
            assert await broker.restore() == []


class TestRestore:
    async def test_command_consumer_resumes_after_the_last_acked(
        self, settings: NatsSettings
    ) -> None:
        """A command consumer deleted under a running source is recreated starting after
        the commands it acked: those sent meanwhile come, the acked ones do not again, and
        a restart keeps that start."""
        async with NatsBroker(settings) as broker:
            source = broker.command_source()
            handler = Recorder()
            running = asyncio.create_task(source.run(handler))
            try:
                client = TimerClient(broker)
                for i in range(3):
                    await client.schedule("t", f"before-{i}", FAR)
                await handler.wait_for(3)
                await acked_through(broker, 3)
                await broker.jetstream.delete_consumer("TIMER_COMMANDS", "timer")
                for i in range(2):
                    await client.schedule("t", f"during-{i}", FAR)
                assert await broker.restore() == ["consumer timer on TIMER_COMMANDS"]
                await handler.wait_for(5)
                info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer")
                assert info.config.deliver_policy == DeliverPolicy.BY_START_SEQUENCE
                assert info.config.opt_start_seq == 4
            finally:
                await source.stop()
                await running
        assert handler.seen == [*(f"before-{i}" for i in range(3)), "during-0", "during-1"]
        # The next start's provisioning updates it without moving its start (JetStream
        # would refuse that change, and the start would fail).
        async with NatsBroker(attrs.evolve(settings, ack_wait_s=7.0)) as again:
            info = await again.jetstream.consumer_info("TIMER_COMMANDS", "timer")
        assert info.config.opt_start_seq == 4
        assert info.config.ack_wait == 7.0

    async def test_resumes_after_the_ack_floor_last_seen(self, settings: NatsSettings) -> None:
        """Commands another instance held unacknowledged when the consumer was deleted are
        delivered again: the recreated consumer starts after the ack floor last seen."""
        async with NatsBroker(settings) as broker, NatsBroker(settings) as other:
            client = TimerClient(broker)
            for i in range(3):
                await client.schedule("t", f"call-{i}", FAR)
            puller = PullBatches(other.client, stream="TIMER_COMMANDS", consumer="timer")
            await puller.start()
            try:
                held = await puller.fetch(3, 2.0)
                assert len(held) == 3
                await held[0].ack()  # the other instance settled one, holds two
                await acked_through(broker, 1)
                assert await broker.missing() == []  # sees the ack floor: 1
                await broker.jetstream.delete_consumer("TIMER_COMMANDS", "timer")
                await broker.restore()
                info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer")
            finally:
                await puller.aclose()
        assert info.config.deliver_policy == DeliverPolicy.BY_START_SEQUENCE
        assert info.config.opt_start_seq == 2
        assert info.num_pending == 2
