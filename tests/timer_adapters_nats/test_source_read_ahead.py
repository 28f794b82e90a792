"""The command source reads the next batch while the handler stores one, and keeps order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

import attrs

from tests.timer_adapters_nats.jetstream import wait_until
from timer_adapters_nats import NatsBroker, NatsCommandSource, NatsSettings, TimerClient
from timer_core import Command, CommandOutcome, MessageEnvelope, StoreUnavailable

DUE = datetime(2033, 3, 4, 5, 6, 7, tzinfo=UTC)


class Handler:
    """Records the batches it stores; fails its first ``failures`` calls; can be held."""

    def __init__(self, *, failures: int = 0, fail_from_call: int = 1) -> None:
        self.calls: list[list[str]] = []
        self.stored: list[str] = []
        self.failures = failures
        self.fail_from_call = fail_from_call
        self.release = asyncio.Event()
        self.release.set()
        self.entered = asyncio.Event()

    async def __call__(self, batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        calls = [str(e.payload.service_call_id) for e in batch]
        self.calls.append(calls)
        self.entered.set()
        await self.release.wait()
        if self.failures and len(self.calls) >= self.fail_from_call:
            self.failures -= 1
            raise StoreUnavailable("database is down (test)")
        self.stored += calls
        return [CommandOutcome.SCHEDULED] * len(batch)


@contextlib.asynccontextmanager
async def consuming(source: NatsCommandSource, handler: Handler) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run(handler))
    try:
        yield
    finally:
        await asyncio.wait_for(source.stop(), 10)
        await task


async def consumer(broker: NatsBroker) -> object:
    return await broker.jetstream.consumer_info(
        broker.settings.commands_stream, broker.settings.consumer_name
    )


@contextlib.asynccontextmanager
async def small_batches(settings: NatsSettings, size: int) -> AsyncIterator[NatsBroker]:
    async with NatsBroker(attrs.evolve(settings, fetch_batch=size)) as broker:
        yield broker


async def send(broker: NatsBroker, count: int) -> list[str]:
    client = TimerClient(broker)
    calls = [f"call-{i}" for i in range(count)]
    for call in calls:
        await client.schedule("tenant-a", call, DUE)
    return calls


class TestReadAhead:
    """The next batch is fetched and decoded while the handler stores this one."""

    async def test_the_next_batch_is_delivered_while_this_one_is_stored(
        self, settings: NatsSettings
    ) -> None:
        """With the first batch held in the handler, the second is already delivered."""
        async with small_batches(settings, 5) as broker:
            calls = await send(broker, 10)
            handler = Handler()
            handler.release.clear()
            async with consuming(broker.command_source(), handler):
                await asyncio.wait_for(handler.entered.wait(), 10)
                await wait_until(
                    lambda: _ack_pending(broker, 10), what="the next batch to be delivered"
                )
                handler.release.set()
                await wait_until(lambda: len(handler.stored) == 10, what="all stored")
            assert handler.calls == [calls[:5], calls[5:]]

    async def test_a_failed_batch_is_not_overtaken_by_the_one_read_ahead(
        self, settings: NatsSettings
    ) -> None:
        """When a batch fails, the batch read ahead behind it waits and comes after it."""
        async with small_batches(settings, 2) as broker:
            calls = await send(broker, 6)
            handler = Handler(failures=1, fail_from_call=2)
            async with consuming(broker.command_source(), handler):
                await wait_until(lambda: len(handler.stored) == 6, what="all stored")
            assert handler.stored == calls
            assert handler.calls[1] == calls[2:4]  # the failed one
            assert handler.calls[2] == calls[2:4]  # ... came back before the one read ahead

    async def test_nothing_is_read_ahead_while_batches_fail(self, settings: NatsSettings) -> None:
        """Failing batches do not spend deliveries of the commands behind them."""
        async with small_batches(settings, 2) as broker:
            calls = await send(broker, 4)
            handler = Handler(failures=3)
            async with consuming(broker.command_source(), handler):
                await wait_until(lambda: len(handler.stored) == 4, what="all stored")
                info = await consumer(broker)
            assert handler.stored == calls
            # Four failed deliveries of the first two, one read-ahead and one real
            # delivery of the last two, then the first two stored.
            assert info.delivered.consumer_seq <= 4 * 2 + 2 + 2  # type: ignore[attr-defined]

    async def test_stop_hands_back_the_batch_read_ahead(self, settings: NatsSettings) -> None:
        """Stopping acks the batch in hand and naks the one read ahead, for the next source."""
        # An ack wait far longer than the wait below: only a nak can bring them back in time.
        async with small_batches(attrs.evolve(settings, ack_wait_s=60.0), 2) as broker:
            calls = await send(broker, 4)
            handler = Handler()
            handler.release.clear()
            source = broker.command_source()
            task = asyncio.create_task(source.run(handler))
            await asyncio.wait_for(handler.entered.wait(), 10)
            await wait_until(lambda: _ack_pending(broker, 4), what="the read-ahead")
            stopping = asyncio.create_task(source.stop())
            handler.release.set()
            await asyncio.wait_for(stopping, 10)
            await task
            assert handler.stored == calls[:2]
            successor = Handler()
            async with consuming(broker.command_source(), successor):
                # Back at once (nak'd), not after the ack wait.
                await wait_until(lambda: successor.stored == calls[2:], what="the rest")

    async def test_commands_waiting_in_the_subscription_are_kept_alive(
        self, settings: NatsSettings
    ) -> None:
        """Commands delivered to the open long poll while a slow batch is stored wait there,
        unfetched, for several ack waits without being redelivered: everything in hand gets
        in-progress acks, not only the batch in the handler."""
        slow_polls = attrs.evolve(settings, fetch_batch=5, ack_wait_s=0.6, fetch_timeout_s=3.0)
        async with NatsBroker(slow_polls) as broker:
            client = TimerClient(broker)
            handler = Handler()
            handler.release.clear()
            async with consuming(broker.command_source(), handler):
                # The first long poll is open: the first command ends its fetch, the next
                # ones are delivered to the same request while that command is being stored.
                await wait_until(lambda: _waiting(broker), what="the long poll")
                await client.schedule("tenant-a", "call-0", DUE)
                await asyncio.wait_for(handler.entered.wait(), 10)
                for n in range(1, 5):
                    await client.schedule("tenant-a", f"call-{n}", DUE)
                await wait_until(lambda: _ack_pending(broker, 5), what="all five delivered")
                await asyncio.sleep(2.0)  # the slow store itself: over three ack waits
                handler.release.set()
                await wait_until(lambda: _ack_pending(broker, 0), what="everything acked")
                info = await consumer(broker)
            assert handler.stored == [f"call-{n}" for n in range(5)]
            assert info.num_redelivered == 0  # type: ignore[attr-defined]

    async def test_a_stored_batch_is_acked_once_the_next_is_handed_over(
        self, settings: NatsSettings
    ) -> None:
        """Batch one is acked while batch two is in the handler, never before it is stored."""
        async with small_batches(settings, 3) as broker:
            await send(broker, 6)
            first, second = asyncio.Event(), asyncio.Event()
            entered: list[int] = []

            async def handler(batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
                entered.append(len(batch))
                await (first if len(entered) == 1 else second).wait()
                return [CommandOutcome.SCHEDULED] * len(batch)

            source = broker.command_source()
            task = asyncio.create_task(source.run(handler))
            try:
                await wait_until(lambda: _ack_pending(broker, 6), what="both batches delivered")
                assert entered == [3]
                first.set()
                await wait_until(lambda: _ack_pending(broker, 3), what="batch one acked")
                assert entered == [3, 3]  # ... with batch two held in the handler
                second.set()
                await wait_until(lambda: _ack_pending(broker, 0), what="batch two acked")
            finally:
                first.set()
                second.set()
                await asyncio.wait_for(source.stop(), 10)
                await task


async def _ack_pending(broker: NatsBroker, count: int) -> bool:
    info = await consumer(broker)
    return info.num_ack_pending == count  # type: ignore[attr-defined]


async def _waiting(broker: NatsBroker) -> bool:
    info = await consumer(broker)
    return bool(info.num_waiting)  # type: ignore[attr-defined]
