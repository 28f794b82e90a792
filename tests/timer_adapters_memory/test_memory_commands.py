"""MemoryCommandSource: decode, dead-letter, hand over in order, ack after, redeliver on failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

import pytest

from timer_adapters_memory import FakeClock, MemoryCommandSource
from timer_core import (
    CancelTimer,
    Command,
    CommandOutcome,
    EnvelopeId,
    Instrumentation,
    MessageEnvelope,
    ScheduleTimer,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def schedule(call: str, tenant: str = "tenant-a") -> MessageEnvelope[Command]:
    """A ScheduleTimer envelope for one service call."""
    return MessageEnvelope(
        id=EnvelopeId.generate(), payload=ScheduleTimer(tenant, call, T0), timestamp_ms=0
    )


def cancel(call: str, tenant: str = "tenant-a") -> MessageEnvelope[Command]:
    """A CancelTimer envelope for one service call."""
    return MessageEnvelope(
        id=EnvelopeId.generate(), payload=CancelTimer(tenant, call), timestamp_ms=0
    )


class Recorder:
    """A handler that records each batch and can be told to fail."""

    def __init__(self) -> None:
        self.batches: list[list[MessageEnvelope[Command]]] = []
        self.failures_left = 0

    async def __call__(self, batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        self.batches.append(list(batch))
        if self.failures_left > 0:
            self.failures_left -= 1
            raise RuntimeError("store down")
        return [CommandOutcome.SCHEDULED] * len(batch)


@pytest.fixture
async def running() -> AsyncIterator[tuple[MemoryCommandSource, Recorder, FakeClock]]:
    """A source with a small batch size, run against a recorder, stopped afterwards."""
    clock = FakeClock(T0)
    source = MemoryCommandSource(batch_size=3, clock=clock, redelivery_delay=0.5)
    recorder = Recorder()
    task = asyncio.ensure_future(source.run(recorder))
    try:
        yield source, recorder, clock
    finally:
        await source.stop()
        await asyncio.wait_for(task, 5)


class TestDelivery:
    """Valid commands reach the handler in order and are acked after it returns."""

    async def test_hands_over_batches_in_arrival_order(
        self, running: tuple[MemoryCommandSource, Recorder, FakeClock]
    ) -> None:
        """Commands arrive at the handler in send order, at most batch_size at a time."""
        source, recorder, _ = running
        sent = [schedule(f"c{i}") for i in range(7)] + [cancel("c0")]
        for envelope in sent:
            source.send(envelope)
        await asyncio.wait_for(source.wait_until_drained(), 5)
        assert all(len(batch) <= 3 for batch in recorder.batches)
        assert [e.id for batch in recorder.batches for e in batch] == [e.id for e in sent]
        assert source.acked == sent
        assert source.pending == 0

    async def test_accepts_text_and_bytes(
        self, running: tuple[MemoryCommandSource, Recorder, FakeClock]
    ) -> None:
        """Raw JSON as str or bytes is decoded like an envelope would be."""
        source, _, _ = running
        payload = (
            '{"id":"0190a6e0-0000-7000-8000-000000000000","type":"CancelTimer",'
            '"tenantId":"t","timestampMs":1,"payload":{"_tag":"CancelTimer",'
            '"tenantId":"t","serviceCallId":"s"}}'
        )
        source.send(payload)
        source.send(payload.encode())
        await asyncio.wait_for(source.wait_until_drained(), 5)
        assert [e.payload for e in source.acked] == [CancelTimer("t", "s")] * 2

    async def test_send_before_run_is_delivered(self) -> None:
        """Messages sent before run starts are delivered once it does."""
        source = MemoryCommandSource()
        recorder = Recorder()
        source.send(schedule("early"))
        task = asyncio.ensure_future(source.run(recorder))
        await asyncio.wait_for(source.wait_until_drained(), 5)
        await source.stop()
        await asyncio.wait_for(task, 5)
        assert [e.payload.service_call_id for e in source.acked] == ["early"]


class TestDeadLetters:
    """Undecodable messages are dead-lettered with a reason and never reach the handler."""

    async def test_bad_messages_are_dead_lettered(
        self, running: tuple[MemoryCommandSource, Recorder, FakeClock]
    ) -> None:
        """Garbage, events and mismatched envelopes land in dead_letters; good ones go on."""
        source, recorder, _ = running
        good = schedule("ok")
        source.send(b"not json")
        source.send(good)
        source.send('{"id": 1}')
        await asyncio.wait_for(source.wait_until_drained(), 5)
        assert source.acked == [good]
        assert [raw for raw, _ in source.dead_letters] == [b"not json", b'{"id": 1}']
        assert source.dead_letters[1][1].startswith("id:")
        assert [e for batch in recorder.batches for e in batch] == [good]

    async def test_rejections_are_reported(self) -> None:
        """Each dead-lettered message is reported to the instrumentation with its subject."""
        rejected: list[tuple[str, str]] = []

        class Spy(Instrumentation):
            def command_rejected(self, subject: str, reason: str) -> None:
                rejected.append((subject, reason))

        source = MemoryCommandSource(instrumentation=Spy())
        task = asyncio.ensure_future(source.run(Recorder()))
        source.send(b"{}", subject="timer.commands.t1")
        await asyncio.wait_for(source.wait_until_drained(), 5)
        await source.stop()
        await asyncio.wait_for(task, 5)
        assert rejected == [("timer.commands.t1", "id: is required")]


class TestRedelivery:
    """A batch whose handler raised is not acked and comes back, before later messages."""

    async def test_failed_batch_is_redelivered_after_the_delay(
        self, running: tuple[MemoryCommandSource, Recorder, FakeClock]
    ) -> None:
        """After a handler failure the same batch is redelivered once the delay has passed."""
        source, recorder, clock = running
        recorder.failures_left = 1
        first = [schedule("a"), schedule("b")]
        for envelope in first:
            source.send(envelope)
        await clock.wait_for_sleepers(1)
        assert source.acked == []
        assert source.pending == 2
        source.send(schedule("later"))
        clock.advance(0.5)
        await asyncio.wait_for(source.wait_until_drained(), 5)
        assert recorder.batches[0] == recorder.batches[1] == first
        assert [e.payload.service_call_id for e in source.acked] == ["a", "b", "later"]
        assert source.deliveries == 3

    async def test_stop_during_handler_acks_the_batch(self) -> None:
        """stop while the handler runs lets that batch finish and be acked, then run returns."""
        source = MemoryCommandSource()
        entered = asyncio.Event()
        release = asyncio.Event()

        async def slow(batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
            entered.set()
            await release.wait()
            return [CommandOutcome.SCHEDULED] * len(batch)

        task = asyncio.ensure_future(source.run(slow))
        source.send(schedule("x"))
        await asyncio.wait_for(entered.wait(), 5)
        await source.stop()
        assert not task.done()
        release.set()
        await asyncio.wait_for(task, 5)
        assert [e.payload.service_call_id for e in source.acked] == ["x"]


class TestLifecycle:
    async def test_leaving_async_with_stops_run(self) -> None:
        """A command source is an AsyncResource: leaving ``async with`` makes run return."""
        recorder = Recorder()
        async with MemoryCommandSource(batch_size=3) as source:
            task = asyncio.ensure_future(source.run(recorder))
            source.send(schedule("one"))
            await asyncio.wait_for(source.wait_until_drained(), 5)
        await asyncio.wait_for(task, 5)
        assert [[e.payload.service_call_id for e in b] for b in recorder.batches] == [["one"]]
