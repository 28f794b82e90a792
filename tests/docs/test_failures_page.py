"""What "Operating through failures" says that the suite can show on a real nats-server: the
bytes a timer's command and event take in the streams, and what a consumer away for longer
than `TIMER_EVENTS` keeps events gets when it is back."""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime, timedelta

import nats

from tests.docs.markdown import DOCS
from timer_adapters_memory import MemoryTimerStore
from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient
from timer_core import Timer

TIMERS = 300


def page_figures() -> tuple[int, int]:
    """The page's bytes per ``ScheduleTimer`` and per ``DueTimeReached``."""
    text = (DOCS / "failures.md").read_text()
    match = re.search(
        r"a `ScheduleTimer` takes about (\d+)\s+bytes of `TIMER_COMMANDS` and its "
        r"`DueTimeReached` about (\d+) bytes of `TIMER_EVENTS`",
        text,
    )
    assert match is not None, "the page no longer states the bytes per command and event"
    return int(match.group(1)), int(match.group(2))


async def test_stream_bytes_per_timer_are_what_the_page_says(nats_url: str) -> None:
    """Timers with UUID identifiers and a correlation id, scheduled through TimerClient and
    fired by a Timer, take within 10% of the page's bytes per message in each stream."""
    per_command, per_event = page_figures()
    async with NatsBroker(NatsSettings(url=nats_url)) as broker:
        async with TimerClient.connect(nats_url) as client:
            due = datetime.now(UTC) + timedelta(milliseconds=200)
            envelopes = [
                client.schedule_envelope(
                    str(uuid.uuid4()), str(uuid.uuid4()), due, correlation_id=str(uuid.uuid4())
                )
                for _ in range(TIMERS)
            ]
            assert await client.send_many(envelopes) == [None] * TIMERS
        async with Timer(MemoryTimerStore(), broker.publisher, commands=broker.command_source()):
            nc = await nats.connect(nats_url)
            try:
                js = nc.jetstream()
                for _ in range(600):  # the firings: 200 ms ahead, then a few batches
                    if (await js.stream_info("TIMER_EVENTS")).state.messages >= TIMERS:
                        break
                    await asyncio.sleep(0.05)
                commands = (await js.stream_info("TIMER_COMMANDS")).state
                events = (await js.stream_info("TIMER_EVENTS")).state
            finally:
                await nc.close()
    assert (commands.messages, events.messages) == (TIMERS, TIMERS)
    assert abs(commands.bytes / TIMERS - per_command) <= per_command * 0.1
    assert abs(events.bytes / TIMERS - per_event) <= per_event * 0.1


async def test_a_consumer_away_longer_than_the_stream_keeps_events_gets_what_is_left(
    nats_url: str,
) -> None:
    """A durable consumer of events whose reader is away while an event outlives the stream's
    maximum age gets, once back, the events still stored, with no error: the expired one is
    gone for it."""
    settings = NatsSettings(url=nats_url, stream_max_age_s=1.0, duplicate_window_s=0.5)
    async with NatsBroker(settings) as broker:
        async with broker.due_events("away", tenant_id="tenant-a"):
            pass  # the consumer exists on the server; its reader goes away
        async with Timer(MemoryTimerStore(), broker.publisher) as timer:
            nc = await nats.connect(nats_url)
            try:
                js = nc.jetstream()
                await timer.schedule("tenant-a", "while-away", datetime.now(UTC))
                for _ in range(600):  # published, then deleted by the stream's age (30 s budget)
                    state = (await js.stream_info("TIMER_EVENTS")).state
                    if state.last_seq == 1 and state.messages == 0:
                        break
                    await asyncio.sleep(0.05)
                assert (state.last_seq, state.messages) == (1, 0)
                await timer.schedule("tenant-a", "after-return", datetime.now(UTC))
            finally:
                await nc.close()
            async with broker.due_events("away", tenant_id="tenant-a") as events:
                async for delivery in events:
                    async with delivery:
                        received = delivery.envelope.payload.service_call_id
                    break
    assert received == "after-return"
