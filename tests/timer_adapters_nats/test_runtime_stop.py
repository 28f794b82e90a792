"""Stopping a Timer embedded with a real nats-server: prompt while the command source waits in
a long poll, and never at the cost of the command batch being stored."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

import attrs
import pytest
import pytest_asyncio

from tests.timer_adapters_nats.jetstream import LONG_POLL_S, PROMPT_STOP_S, polling, wait_until
from timer_adapters_memory import MemoryTimerStore
from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient
from timer_core import CommandOutcome, ServiceCallId, TenantId, Timer, TimerOperation

DUE = datetime(2032, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)


class HeldStore(MemoryTimerStore):
    """A memory store whose writes of commands wait for ``release`` once it is armed."""

    def __init__(self) -> None:
        super().__init__()
        self.hold: asyncio.Event | None = None
        self.writing = asyncio.Event()

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        self.writing.set()
        if self.hold is not None:
            await self.hold.wait()
        return await super().apply(operations)


@pytest_asyncio.fixture
async def broker(settings: NatsSettings) -> AsyncIterator[NatsBroker]:
    """A started broker whose command source long-polls for LONG_POLL_S (30 s)."""
    broker = NatsBroker(attrs.evolve(settings, fetch_timeout_s=LONG_POLL_S))
    await broker.start()
    try:
        yield broker
    finally:
        await broker.aclose()


async def settled(broker: NatsBroker) -> bool:
    """Whether the commands consumer has nothing pending and nothing awaiting an ack."""
    await broker.client.flush()
    settings = broker.settings
    info = await broker.jetstream.consumer_info(settings.commands_stream, settings.consumer_name)
    return info.num_pending == 0 and info.num_ack_pending == 0


class TestPromptStop:
    """Leaving the block, or cancelling the host's task, does not wait out the long poll."""

    async def test_leaving_the_block_while_idle(self, broker: NatsBroker) -> None:
        """Leaving ``async with Timer(...)`` while its command source waits in a 30 s long
        poll takes under PROMPT_STOP_S, and the poll is withdrawn at the server."""
        async with Timer(MemoryTimerStore(), broker.publisher, commands=broker.command_source()):
            await wait_until(lambda: polling(broker), what="the command source's long poll")
            leaving = time.monotonic()
        took = time.monotonic() - leaving
        assert took < PROMPT_STOP_S, f"stopping took {took:.2f}s"
        assert not await polling(broker)

    async def test_cancelling_the_host_task(self, broker: NatsBroker) -> None:
        """Cancelling a task that runs a Timer while its command source long-polls ends it
        (every component stopped) in under PROMPT_STOP_S."""
        timer = Timer(MemoryTimerStore(), broker.publisher, commands=broker.command_source())

        async def host() -> None:
            async with timer:
                await asyncio.Event().wait()  # the host's own work, until cancelled

        task = asyncio.create_task(host())
        await wait_until(lambda: polling(broker), what="the command source's long poll")
        cancelled = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        took = time.monotonic() - cancelled
        assert took < PROMPT_STOP_S, f"stopping took {took:.2f}s"
        assert timer.health().components == {"worker": False, "command loop": False}

    async def test_the_batch_in_flight_is_still_stored_and_acked(self, broker: NatsBroker) -> None:
        """Stopping while a command batch is being written waits for that write, then acks
        the batch; once the write is done the stop takes under PROMPT_STOP_S."""
        client = TimerClient(broker)
        calls = [f"call-{i}" for i in range(3)]
        for call in calls:  # sent before the start: the first fetch takes all three
            await client.schedule("tenant-a", call, DUE)
        store = HeldStore()
        store.hold = asyncio.Event()
        timer = Timer(store, broker.publisher, commands=broker.command_source())
        await timer.start()
        try:
            async with asyncio.timeout(10):
                await store.writing.wait()
            closing = asyncio.create_task(timer.aclose())
            await asyncio.sleep(0.05)
            assert not closing.done(), "the stop did not wait for the write in flight"
        finally:
            released = time.monotonic()
            store.hold.set()
        await closing
        took = time.monotonic() - released
        assert took < PROMPT_STOP_S, f"stopping after the write took {took:.2f}s"
        async with MemoryTimerStore(shared_with=store) as reopened:
            for call in calls:
                assert await reopened.get(TenantId("tenant-a"), ServiceCallId(call)) is not None
        await wait_until(lambda: settled(broker), what="the batch acked")
