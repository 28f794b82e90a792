"""The JetStream event publisher: the shipped conformance suite plus what is NATS-specific."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attrs
import pytest
import pytest_asyncio
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from tests.secure_nats import hostport, start_configured_server
from tests.timer_adapters_nats.jetstream import RECOVERY_S, jetstream_back, read_stream, wait_until
from timer_adapters_nats import (
    AckedPublisher,
    NatsBroker,
    NatsServerProcess,
    NatsSettings,
    Outgoing,
)
from timer_core import DueTimeReached, MessageEnvelope, PublishError, TimerEntry
from timer_core.codec import decode_event, encode_envelope
from timer_core.events import build_due_event
from timer_core.testing import EventPublisherContract, PublisherHarness

T0 = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)


def firing(
    index: int, *, tenant: str = "tenant-a", due: datetime = T0, late_ms: int = 0
) -> MessageEnvelope[DueTimeReached]:
    """The ``DueTimeReached`` of timer ``call-<index>`` fired ``late_ms`` after ``due``."""
    entry = TimerEntry(
        tenant_id=tenant,
        service_call_id=f"call-{index}",
        due_at=due,
        registered_at=due - timedelta(minutes=1),
        correlation_id=f"corr-{index}",
    )
    return build_due_event(entry, due + timedelta(milliseconds=late_ms))


class TestNatsEventPublisherContract(EventPublisherContract):
    """The shipped ``EventPublisher`` suite, against TIMER_EVENTS on a real nats-server."""

    @pytest_asyncio.fixture
    async def make_publisher(
        self, broker: NatsBroker, nats_server: NatsServerProcess
    ) -> PublisherHarness:
        async def published() -> list[MessageEnvelope[DueTimeReached]]:
            held = await read_stream(broker.jetstream, broker.settings.events_stream)
            return [decode_event(message.data) for message in held]

        async def break_broker() -> None:
            nats_server.stop()
            await wait_until(lambda: not broker.is_connected, what="the client to notice")

        return PublisherHarness(
            publisher=broker.publisher, published=published, break_broker=break_broker
        )


class TestWireFormat:
    """What an event looks like in the stream."""

    async def test_subject_header_and_body(self, broker: NatsBroker) -> None:
        """An event goes to <prefix>.events.<tenant>.<call>, Nats-Msg-Id = id, the codec's body."""
        envelope = firing(1, tenant="tenant-x")
        await broker.publisher.publish(envelope)
        (held,) = await read_stream(broker.jetstream, "TIMER_EVENTS")
        assert held.subject == "timer.events.tenant-x.call-1"
        assert held.headers["Nats-Msg-Id"] == envelope.id
        assert held.data == encode_envelope(envelope)

    async def test_custom_prefix(self, nats_url: str) -> None:
        """With another subject prefix, events go to <prefix>.events.<tenant>.<call>."""
        settings = NatsSettings(url=nats_url, subject_prefix="acme.timer")
        async with NatsBroker(settings) as broker:
            await broker.publisher.publish(firing(2))
            (held,) = await read_stream(broker.jetstream, "TIMER_EVENTS")
        assert held.subject == "acme.timer.events.tenant-a.call-2"


class TestDuplicates:
    """Semantics 6: every publish of one firing carries the same id and is stored once."""

    async def test_republished_firing_is_stored_once(self, broker: NatsBroker) -> None:
        """The same firing re-published (other reachedAt, same id) is dropped by JetStream."""
        first = firing(3, late_ms=5)
        again = firing(3, late_ms=900)
        assert first.id == again.id
        assert await broker.publisher.publish_many([first]) == [None]
        assert await broker.publisher.publish_many([again, again]) == [None, None]
        held = await read_stream(broker.jetstream, "TIMER_EVENTS")
        assert [decode_event(m.data) for m in held] == [first]

    async def test_rescheduled_firing_is_a_new_event(self, broker: NatsBroker) -> None:
        """A firing of the same timer at another due time has another id and is stored too."""
        first = firing(4)
        later = firing(4, due=T0 + timedelta(seconds=1))
        await broker.publisher.publish_many([first, later])
        held = await read_stream(broker.jetstream, "TIMER_EVENTS")
        assert [m.headers["Nats-Msg-Id"] for m in held] == [first.id, later.id]


class TestBatches:
    """Batches are published concurrently, and each envelope gets its own result."""

    @pytest.mark.parametrize("size", [0, 1])
    async def test_small_batches(self, broker: NatsBroker, size: int) -> None:
        """Empty and single-envelope batches return one result per envelope."""
        envelopes = [firing(i) for i in range(size)]
        assert await broker.publisher.publish_many(envelopes) == [None] * size

    async def test_batch_larger_than_the_window(self, nats_url: str) -> None:
        """A batch of 500 with a window of 16 is acked in full and held in batch order."""
        settings = NatsSettings(url=nats_url, publish_window=16)
        envelopes = [firing(i, tenant=f"tenant-{i % 4}") for i in range(500)]
        async with NatsBroker(settings) as broker:
            assert await broker.publisher.publish_many(envelopes) == [None] * 500
            held = await read_stream(broker.jetstream, "TIMER_EVENTS")
        assert [m.headers["Nats-Msg-Id"] for m in held] == [e.id for e in envelopes]

    async def test_refused_envelope_fails_alone(self, settings: NatsSettings) -> None:
        """When the stream refuses one envelope, only that one gets a PublishError."""
        settings = attrs.evolve(settings, provision=False)
        async with NatsBroker(settings) as broker:
            # One message per subject, new ones refused: a second firing of a timer fails.
            await broker.jetstream.add_stream(
                StreamConfig(
                    name="TIMER_EVENTS",
                    subjects=["timer.events.>"],
                    storage=StorageType.FILE,
                    max_msgs_per_subject=1,
                    discard=DiscardPolicy.NEW,
                    discard_new_per_subject=True,
                    duplicate_window=120,
                )
            )
            batch = [firing(1), firing(2), firing(1, due=T0 + timedelta(seconds=1)), firing(3)]
            results = await broker.publisher.publish_many(batch)
        assert results[0] is None and results[1] is None and results[3] is None
        assert isinstance(results[2], PublishError)
        assert batch[2].id in str(results[2]), str(results[2])

    async def test_no_stream_is_a_publish_error(self, settings: NatsSettings) -> None:
        """Without a stream for the events subject, each envelope gets a PublishError."""
        settings = attrs.evolve(settings, provision=False)
        async with NatsBroker(settings) as broker:
            results = await broker.publisher.publish_many([firing(1), firing(2)])
        assert all(isinstance(r, PublishError) for r in results)
        assert "no stream" in str(results[0])

    async def test_disconnected_fails_fast(
        self, settings: NatsSettings, nats_server: NatsServerProcess
    ) -> None:
        """While reconnecting, a batch fails at once instead of waiting for ack timeouts
        (30 s here, so "at once" has room on a machine whose cores other work shares)."""
        async with NatsBroker(attrs.evolve(settings, ack_timeout_s=30.0)) as broker:
            nats_server.stop()
            await wait_until(lambda: not broker.is_connected, what="the client to notice")
            started = time.monotonic()
            results = await broker.publisher.publish_many([firing(i) for i in range(50)])
            assert time.monotonic() - started < broker.settings.ack_timeout_s / 6
            assert all(isinstance(r, PublishError) for r in results)

    async def test_publishes_again_after_reconnect(
        self, broker: NatsBroker, nats_server: NatsServerProcess
    ) -> None:
        """After the server comes back, the same publisher publishes again."""
        nats_server.stop()
        await wait_until(lambda: not broker.is_connected, what="the client to notice")
        nats_server.start()
        await wait_until(lambda: broker.is_connected, what="the client to reconnect")
        # JetStream recovers its streams a moment after the server accepts clients again.
        await wait_until(
            lambda: jetstream_back(broker.jetstream, broker.settings.events_stream),
            within=RECOVERY_S,
            what="JetStream back",
        )
        assert await broker.publisher.publish_many([firing(7)]) == [None]

    async def test_same_publisher_after_broker_restart(self, settings: NatsSettings) -> None:
        """The broker's publisher keeps working after the broker is closed and started again."""
        broker = NatsBroker(settings)
        await broker.start()
        publisher = broker.publisher
        await publisher.publish(firing(1))
        await broker.aclose()
        assert isinstance((await publisher.publish_many([firing(2)]))[0], PublishError)
        await broker.start()
        try:
            assert broker.publisher is publisher
            assert await publisher.publish_many([firing(3)]) == [None]
        finally:
            await broker.aclose()

    async def test_unbuildable_message_fails_alone(self, broker: NatsBroker) -> None:
        """publish_each turns a message that cannot be built into that message's error only."""
        publisher = AckedPublisher(broker.client, window=4, ack_timeout_s=2.0)

        def build(index: int) -> Outgoing:
            if index == 2:
                raise ValueError("cannot encode this one")
            return Outgoing(f"timer.events.t.c{index}", b"{}", msg_id=f"id-{index}")

        results = await publisher.publish_each(range(6), build)
        assert [r is None for r in results] == [True, True, False, True, True, True]
        assert "cannot encode this one" in str(results[2])


#: Acks awaited far longer than any test waits: only a result told before its ack timeout
#: can pass.
NEVER_S = 120.0
#: How long a test waits for results that need no timeout (a busy 2-core machine included).
BUDGET_S = 30.0
STALL = "stall.here"


class _Told:
    """The results a ``publish_frames_each`` call told so far, by index."""

    def __init__(self) -> None:
        self.results: dict[int, PublishError | None] = {}

    def __call__(self, index: int, error: PublishError | None) -> None:
        assert index not in self.results, f"message {index} told twice"
        self.results[index] = error


def _frames(subjects: list[str]) -> list[tuple[str, bytes, str, dict[str, str]]]:
    return [
        (subject, b"{}", f"each-{time.monotonic_ns()}-{i}", {"Nats-Msg-Id": f"id-{i}-{subject}"})
        for i, subject in enumerate(subjects)
    ]


class _Publishing:
    """A ``publish_frames_each`` call under way, each message to one of ``subjects``, with a
    subject (:data:`STALL`) outside every stream that a plain subscriber takes and never
    answers: its publishes are never acknowledged (no stream, no "no responders" either)."""

    def __init__(self, subjects: list[str]) -> None:
        self.told = _Told()
        self.frames = _frames(subjects)

    async def start(
        self, broker: NatsBroker, *, window: int, ack_timeout_s: float
    ) -> asyncio.Future[None]:
        await broker.client.subscribe(STALL)
        await broker.client.flush()
        publisher = AckedPublisher(broker.client, window=window, ack_timeout_s=ack_timeout_s)
        return asyncio.ensure_future(
            publisher.publish_frames_each(self.frames, lambda frame: frame, self.told)
        )

    async def until_told(self, count: int) -> dict[int, PublishError | None]:
        await wait_until(
            lambda: len(self.told.results) == count, within=BUDGET_S, what=f"{count} results"
        )
        return self.told.results


class TestEachResultAsItComes:
    """``publish_frames_each`` (and so the fire path's ``publish_each``) tells each message's
    result as its own ack comes back: one never acknowledged holds back no other."""

    async def test_an_unacknowledged_message_holds_back_no_other(self, broker: NatsBroker) -> None:
        """The first of eleven messages is never acknowledged: the other ten are told
        acknowledged while it still waits for its ack, and cutting the call off tells no
        more."""
        publishing = _Publishing([STALL] + [f"timer.events.t.c{i}" for i in range(10)])
        call = await publishing.start(broker, window=64, ack_timeout_s=NEVER_S)
        assert await publishing.until_told(10) == dict.fromkeys(range(1, 11))
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert 0 not in publishing.told.results

    async def test_a_full_window_waits_for_any_ack_not_the_oldest(self, broker: NatsBroker) -> None:
        """With a window of 4 and its oldest message never acknowledged, the 20 after it
        still go out and are acknowledged, 3 places at a time."""
        publishing = _Publishing([STALL] + [f"timer.events.t.c{i}" for i in range(20)])
        call = await publishing.start(broker, window=4, ack_timeout_s=NEVER_S)
        try:
            assert await publishing.until_told(20) == dict.fromkeys(range(1, 21))
        finally:
            call.cancel()

    async def test_the_unacknowledged_one_fails_at_its_own_timeout(
        self, broker: NatsBroker
    ) -> None:
        """The message never acknowledged fails "no ack from JetStream in time" once its ack
        timeout passes; the call returns once every message is told."""
        publishing = _Publishing(["timer.events.t.c0", STALL, "timer.events.t.c1"])
        await asyncio.wait_for(
            await publishing.start(broker, window=64, ack_timeout_s=0.5), BUDGET_S
        )
        results = publishing.told.results
        assert results[0] is None and results[2] is None
        assert "no ack from JetStream in time" in str(results[1])
        assert publishing.frames[1][2] in str(results[1])


class _ToldTogether(_Told):
    """A ``done`` that also takes acknowledgements several at a time (``delivered``), as
    the firing pipeline's does; it notes how many tellings there were."""

    def __init__(self) -> None:
        super().__init__()
        self.tellings = 0

    def __call__(self, index: int, error: PublishError | None) -> None:
        self.tellings += 1
        super().__call__(index, error)

    def delivered(self, indices: Sequence[int]) -> None:
        self.tellings += 1
        for index in indices:
            super().__call__(index, None)


class TestAcksToldTogether:
    async def test_acks_that_come_in_together_are_told_in_one_step(
        self, broker: NatsBroker
    ) -> None:
        """200 messages: every one told acknowledged exactly once, in far fewer tellings than
        messages (the acks read in one go are told together, through ``delivered``); a
        message never acknowledged among them is told on its own, at its timeout."""
        frames = _frames([f"timer.events.t.c{i}" for i in range(199)] + [STALL])
        await broker.client.subscribe(STALL)
        await broker.client.flush()
        publisher = AckedPublisher(broker.client, window=1000, ack_timeout_s=0.5)
        told = _ToldTogether()
        await asyncio.wait_for(
            publisher.publish_frames_each(frames, lambda frame: frame, told), BUDGET_S
        )
        assert {i: told.results[i] for i in range(199)} == dict.fromkeys(range(199))
        assert "no ack from JetStream in time" in str(told.results[199])
        assert told.tellings < 100

    async def test_a_plain_callable_is_told_one_by_one(self, broker: NatsBroker) -> None:
        """A ``done`` without ``delivered`` is called once per message, as before."""
        publishing = _Publishing([f"timer.events.t.c{i}" for i in range(30)])
        await asyncio.wait_for(
            await publishing.start(broker, window=64, ack_timeout_s=NEVER_S), BUDGET_S
        )
        assert publishing.told.results == dict.fromkeys(range(30))


class TestRefusedByTheServer:
    """A publish the server's permissions refuse fails with the server's own words as soon as
    the server says so (nats-py reports it to the connection, not to the publish)."""

    async def test_the_permissions_violation_is_the_reason(self, tmp_path: Path) -> None:
        """The service's user may not publish to one tenant's events: that tenant's envelope
        fails at once with 'Permissions Violation for Publish to "<subject>"' (its subject as
        published, capitals included, though nats-py lower-cases the server's line), not
        after its ack timeout; the envelopes around it are acknowledged."""
        config = (
            "jetstream {}\n"
            "authorization { users: [ {user: svc, password: svc-pw, permissions: "
            '{publish: {deny: ["timer.events.Denied-Tenant.>"]}}} ] }\n'
        )
        server = start_configured_server(tmp_path / "nats", config)
        try:
            settings = NatsSettings(
                url=f"nats://svc:svc-pw@{hostport(server)}", ack_timeout_s=NEVER_S
            )
            async with NatsBroker(settings) as broker:
                batch = [firing(0), firing(1, tenant="Denied-Tenant"), firing(2), firing(3)]
                told = _Told()
                await asyncio.wait_for(broker.publisher.publish_each(batch, told), BUDGET_S)
                again = await asyncio.wait_for(
                    broker.publisher.publish_many([firing(4, tenant="Denied-Tenant")]), BUDGET_S
                )
        finally:
            server.stop()
        assert {i: told.results[i] for i in (0, 2, 3)} == {0: None, 2: None, 3: None}
        subject = "timer.events.Denied-Tenant.call-1"
        assert str(told.results[1]) == (
            f'{batch[1].id} to {subject}: Permissions Violation for Publish to "{subject}" '
            "(the NATS server)"
        )
        assert 'Permissions Violation for Publish to "timer.events.Denied-Tenant.call-4"' in str(
            again[0]
        )
