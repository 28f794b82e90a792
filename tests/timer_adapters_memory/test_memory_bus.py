"""MemoryEventBus: what it keeps, how it fails on purpose, and who hears about it."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_memory import MemoryEventBus
from timer_core import DueTimeReached, MessageEnvelope, PublishError, ScheduleTimer, TimerEntry
from timer_core.events import build_due_event

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def event(index: int, tenant: str = "tenant-a") -> MessageEnvelope[DueTimeReached]:
    """A distinct DueTimeReached envelope."""
    entry = TimerEntry(
        tenant_id=tenant,
        service_call_id=f"call-{index}",
        due_at=T0 + timedelta(seconds=index),
        registered_at=T0,
    )
    return build_due_event(entry, entry.due_at)


class TestPublishing:
    """Accepting, deduplicating and recording envelopes."""

    async def test_keeps_accepted_envelopes_in_order(self) -> None:
        """published lists what was accepted, in the order it was accepted."""
        bus = MemoryEventBus()
        envelopes = [event(i) for i in range(3)]
        assert await bus.publish_many(envelopes) == [None, None, None]
        await bus.publish(event(9))
        assert bus.published == [*envelopes, event(9)]

    async def test_drops_a_repeated_id(self) -> None:
        """An id already accepted is acknowledged and dropped, like JetStream's window."""
        bus = MemoryEventBus()
        await bus.publish(event(1))
        assert await bus.publish_many([event(1), event(2)]) == [None, None]
        assert [e.payload.service_call_id for e in bus.published] == ["call-1", "call-2"]
        assert bus.duplicates == 1
        assert len(bus.publish_attempts) == 3

    async def test_keeps_repeats_without_deduplication(self) -> None:
        """With deduplicate=False every accepted envelope is kept, repeats included."""
        bus = MemoryEventBus(deduplicate=False)
        await bus.publish_many([event(1), event(1)])
        assert bus.published == [event(1), event(1)]

    async def test_refuses_non_events(self) -> None:
        """An envelope that is not a valid DueTimeReached comes back as a PublishError."""
        bus = MemoryEventBus()
        command = MessageEnvelope(
            id=event(0).id, payload=ScheduleTimer("t", "c", T0), timestamp_ms=0
        )
        (error,) = await bus.publish_many([command])  # type: ignore[list-item]
        assert isinstance(error, PublishError)
        assert bus.published == []


class TestFailureInjection:
    """Refusing envelopes on purpose, without ever raising from publish_many."""

    async def test_fail_next_refuses_that_many(self) -> None:
        """fail_next(n) refuses the next n envelopes; the others in the batch go through."""
        bus = MemoryEventBus()
        bus.fail_next(2)
        results = await bus.publish_many([event(i) for i in range(4)])
        assert [isinstance(r, PublishError) for r in results] == [True, True, False, False]
        assert [e.payload.service_call_id for e in bus.published] == ["call-2", "call-3"]
        assert len(bus.publish_attempts) == 4

    async def test_fail_when_refuses_matching_envelopes(self) -> None:
        """fail_when refuses every envelope its predicate picks, until cleared."""
        bus = MemoryEventBus()
        bus.fail_when(lambda e: e.tenant_id == "tenant-b")
        results = await bus.publish_many([event(1, "tenant-a"), event(2, "tenant-b")])
        assert results[0] is None
        assert isinstance(results[1], PublishError)
        bus.fail_when(None)
        assert await bus.publish_many([event(2, "tenant-b")]) == [None]

    async def test_unavailable_refuses_everything(self) -> None:
        """While unavailable, every publish fails; publish raises, publish_many does not."""
        bus = MemoryEventBus()
        bus.set_unavailable(True)
        results = await bus.publish_many([event(1), event(2)])
        assert all(isinstance(r, PublishError) for r in results)
        with pytest.raises(PublishError):
            await bus.publish(event(3))
        bus.set_unavailable(False)
        await bus.publish(event(3))
        assert bus.published == [event(3)]

    async def test_a_refused_envelope_can_be_accepted_later(self) -> None:
        """A refused envelope does not count as seen: its re-publish is accepted."""
        bus = MemoryEventBus()
        bus.fail_next(1)
        assert isinstance((await bus.publish_many([event(1)]))[0], PublishError)
        assert await bus.publish_many([event(1)]) == [None]
        assert bus.published == [event(1)]


class TestSubscribing:
    """Subscribers hear about envelopes accepted after they subscribed."""

    async def test_subscriber_receives_later_envelopes(self) -> None:
        """A subscription yields the envelopes accepted after subscribe, not before."""
        bus = MemoryEventBus()
        await bus.publish(event(0))
        subscription = bus.subscribe()
        await bus.publish_many([event(1), event(1), event(2)])
        assert await subscription.get() == event(1)
        assert await subscription.get() == event(2)
        subscription.close()
        assert [e async for e in subscription] == []

    async def test_iteration_ends_on_close(self) -> None:
        """async for over a subscription ends once it is closed."""
        bus = MemoryEventBus()
        subscription = bus.subscribe()

        async def read() -> list[MessageEnvelope[DueTimeReached]]:
            return [e async for e in subscription]

        reader = asyncio.ensure_future(read())
        await bus.publish(event(1))
        await bus.publish(event(2))
        subscription.close()
        assert await asyncio.wait_for(reader, 1) == [event(1), event(2)]

    async def test_wait_for_published(self) -> None:
        """wait_for_published returns once enough envelopes were accepted."""
        bus = MemoryEventBus()
        waiter = asyncio.ensure_future(bus.wait_for_published(2))
        await bus.publish(event(1))
        await asyncio.sleep(0)
        assert not waiter.done()
        await bus.publish(event(2))
        assert await asyncio.wait_for(waiter, 1) == [event(1), event(2)]

    async def test_publish_from_another_thread_reaches_the_subscriber(self) -> None:
        """Envelopes published on another thread's loop reach a subscriber on this loop."""
        bus = MemoryEventBus()
        subscription = bus.subscribe()
        thread = threading.Thread(target=asyncio.run, args=(bus.publish(event(1)),))
        thread.start()
        assert await asyncio.wait_for(subscription.get(), 1) == event(1)
        thread.join()
