"""The conformance suite of the ``EventPublisher`` port, run against a real broker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import attrs
import pytest
import pytest_asyncio

from timer_core._entry import TimerEntry
from timer_core._ids import EnvelopeId
from timer_core._messages import DueTimeReached, MessageEnvelope
from timer_core.errors import PublishError
from timer_core.events import build_due_event
from timer_core.ports import EventPublisher

__all__ = ["EventPublisherContract", "PublisherHarness"]

Event = MessageEnvelope[DueTimeReached]
T0 = datetime(2030, 1, 1, tzinfo=UTC)


@attrs.frozen
class PublisherHarness:
    """What the publisher suite needs: the publisher and two handles on the broker behind it."""

    publisher: EventPublisher
    """The publisher under test, not started (the suite starts and closes it)."""
    published: Callable[[], Awaitable[list[Event]]]
    """What the broker durably holds, in broker order, as decoded envelopes."""
    break_broker: Callable[[], Awaitable[None]]
    """Make the broker refuse or lose contact: every publish after it must fail."""


def event(index: int, *, tenant: str = "tenant-a", correlation: str | None = None) -> Event:
    """A distinct ``DueTimeReached`` envelope, as the timer would publish it."""
    entry = TimerEntry(
        tenant_id=tenant,
        service_call_id=f"call-{index}",
        due_at=T0 + timedelta(milliseconds=index * 7 + 1),
        registered_at=T0,
        correlation_id=correlation,
    )
    return build_due_event(entry, entry.due_at + timedelta(milliseconds=index % 5))


class EventPublisherContract:
    """Conformance tests every :class:`~timer_core.ports.EventPublisher` must pass.

    Subclass it as a ``Test...`` class and override the ``make_publisher`` fixture (sync or
    async) to return a :class:`PublisherHarness` over a fresh broker (stream)::

        class TestNatsPublisher(EventPublisherContract):
            @pytest.fixture
            def make_publisher(self, nats_server):
                stream = ...
                return PublisherHarness(
                    publisher=NatsEventPublisher(nats_server.url),
                    published=lambda: read_stream(nats_server.url),
                    break_broker=nats_server.stop,
                )

    The suite's ``harness`` fixture starts the publisher and closes it after the test, even
    after ``break_broker``.
    """

    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def make_publisher(self) -> PublisherHarness:
        """The factory hook: override it to return a harness over a fresh broker."""
        raise NotImplementedError(
            "override the make_publisher fixture to bind EventPublisherContract"
        )

    @pytest_asyncio.fixture
    async def harness(self, make_publisher: PublisherHarness) -> AsyncIterator[PublisherHarness]:
        """The harness with its publisher started."""
        await make_publisher.publisher.start()
        try:
            yield make_publisher
        finally:
            await make_publisher.publisher.aclose()

    async def test_publish_nothing(self, harness: PublisherHarness) -> None:
        """Publishing an empty batch returns no results and holds nothing."""
        assert await harness.publisher.publish_many([]) == []
        assert await harness.published() == []

    async def test_concurrent_calls_keep_their_order_when_promised(
        self, harness: PublisherHarness
    ) -> None:
        """A publisher whose ``keeps_call_order`` is true lets the broker hold all of one
        call's envelopes before any of a later concurrent call's (else nothing is promised)."""
        first = [event(i) for i in range(300)]
        second = [event(i) for i in range(300, 400)]
        calls = [
            asyncio.ensure_future(harness.publisher.publish_many(batch))
            for batch in (first, second)
        ]
        results = await asyncio.gather(*calls)
        assert results == [[None] * 300, [None] * 100]
        held = [e.id for e in await harness.published()]
        assert sorted(held) == sorted(e.id for e in first + second)
        if harness.publisher.keeps_call_order:
            assert held == [e.id for e in first + second]

    async def test_batch_is_acknowledged_and_held(self, harness: PublisherHarness) -> None:
        """A batch of 200 envelopes is acknowledged one result per envelope and all are held."""
        envelopes = [event(i, tenant=f"tenant-{i % 3}") for i in range(200)]
        results = await harness.publisher.publish_many(envelopes)
        assert results == [None] * 200
        held = await harness.published()
        assert len(held) == 200
        assert {e.id: e for e in held} == {e.id: e for e in envelopes}

    async def test_fields_round_trip_exactly(self, harness: PublisherHarness) -> None:
        """Every field survives the broker: id, aggregateId, correlationId or none, times."""
        with_correlation = event(1, correlation="corr-1")
        without = event(2, tenant="other-tenant")
        assert without.correlation_id is None
        await harness.publisher.publish(with_correlation)
        await harness.publisher.publish(without)
        held = await harness.published()
        assert held == [with_correlation, without]
        assert held[0].aggregate_id == with_correlation.payload.service_call_id
        assert held[0].correlation_id == "corr-1"
        assert held[1].correlation_id is None
        assert held[1].causation_id is None
        assert held[0].timestamp_ms == with_correlation.timestamp_ms
        assert held[0].payload.reached_at == with_correlation.payload.reached_at

    async def test_single_publishes_are_held_in_order(self, harness: PublisherHarness) -> None:
        """Envelopes published one after another are held in that order."""
        envelopes = [event(i) for i in range(5)]
        for envelope in envelopes:
            await harness.publisher.publish(envelope)
        assert [e.id for e in await harness.published()] == [e.id for e in envelopes]

    async def test_same_id_is_held_once(self, harness: PublisherHarness) -> None:
        """Publishing the same envelope id again is acknowledged and the broker keeps one."""
        envelope = event(1)
        other = event(2)
        await harness.publisher.publish(envelope)
        assert await harness.publisher.publish_many([envelope, other]) == [None, None]
        await harness.publisher.publish(envelope)
        held = await harness.published()
        assert sorted(e.id for e in held) == sorted([envelope.id, other.id])

    async def test_fresh_ids_are_distinct_messages(self, harness: PublisherHarness) -> None:
        """Two envelopes for the same timer but with different ids are both held."""
        envelope = event(1)
        again = attrs.evolve(envelope, id=EnvelopeId.generate())
        assert await harness.publisher.publish_many([envelope, again]) == [None, None]
        assert sorted(e.id for e in await harness.published()) == sorted([envelope.id, again.id])

    async def test_broken_broker_gives_one_error_per_envelope(
        self, harness: PublisherHarness
    ) -> None:
        """After the broker breaks, publish_many returns a PublishError per envelope, in order."""
        await harness.publisher.publish(event(0))
        await harness.break_broker()
        envelopes = [event(i) for i in range(1, 6)]
        results = await harness.publisher.publish_many(envelopes)
        assert len(results) == len(envelopes)
        assert all(isinstance(result, PublishError) for result in results)

    async def test_broken_broker_makes_publish_raise(self, harness: PublisherHarness) -> None:
        """After the broker breaks, publish raises PublishError."""
        await harness.break_broker()
        with pytest.raises(PublishError):
            await harness.publisher.publish(event(1))
