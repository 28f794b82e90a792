"""PullBatches: batches from the durable pull consumer on a real nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats.errors
import pytest
from nats.aio.msg import Msg

from tests.timer_adapters_nats.jetstream import LONG_POLL_S, PROMPT_STOP_S, polling, wait_until
from timer_adapters_nats import NatsBroker
from timer_adapters_nats._pull import PullBatches, PullError, stream_sequence


async def publish(broker: NatsBroker, count: int, *, start: int = 0) -> None:
    """``count`` numbered command messages, acked by JetStream (bodies are not decoded here)."""
    js = broker.jetstream
    for i in range(start, start + count):
        await js.publish("timer.commands.tenant-a", f"{i}".encode())


def bodies(messages: list[Msg]) -> list[int]:
    return [int(message.data) for message in messages]


@pytest.fixture
async def puller(broker: NatsBroker) -> AsyncIterator[PullBatches]:
    """A started puller on the broker's commands consumer, closed after the test."""
    settings = broker.settings
    pull = PullBatches(
        broker.client, stream=settings.commands_stream, consumer=settings.consumer_name
    )
    await pull.start()
    try:
        yield pull
    finally:
        await pull.aclose()


class TestFetch:
    """A fetch returns what is there at once, or the first delivery of a long poll."""

    async def test_returns_at_most_a_batch_in_stream_order(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """25 waiting messages come back as batches of 10, 10 and 5, in stream order."""
        await publish(broker, 25)
        got = [bodies(await puller.fetch(10, 1.0)) for _ in range(3)]
        assert got == [list(range(10)), list(range(10, 20)), list(range(20, 25))]

    async def test_an_empty_consumer_returns_nothing_after_the_wait(
        self, puller: PullBatches
    ) -> None:
        """With nothing to deliver, a fetch returns an empty batch once its wait is over."""
        started = time.monotonic()
        assert await puller.fetch(10, 0.3) == []
        assert 0.2 <= time.monotonic() - started < PROMPT_STOP_S  # its wait, not a hang

    async def test_a_message_published_during_the_wait_returns_at_once(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """A long poll returns with the first message published while it waits."""
        fetching = asyncio.ensure_future(puller.fetch(10, LONG_POLL_S))
        await wait_until(lambda: polling(broker), what="the long poll at the server")
        started = time.monotonic()
        await publish(broker, 1)
        assert bodies(await fetching) == [0]
        assert time.monotonic() - started < PROMPT_STOP_S  # not the poll's expiry

    async def test_later_deliveries_of_an_open_poll_are_kept_for_the_next_fetch(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """Messages delivered to a poll after its fetch returned come with the next fetch."""
        fetching = asyncio.ensure_future(puller.fetch(10, 2.0))
        await wait_until(lambda: polling(broker), what="the long poll at the server")
        await publish(broker, 1)
        first = bodies(await fetching)
        await publish(broker, 3, start=1)
        rest: list[int] = []
        async with asyncio.timeout(5):
            while len(first) + len(rest) < 4:
                rest += bodies(await puller.fetch(10, 0.5))
        assert first + rest == [0, 1, 2, 3]

    async def test_nacked_messages_are_fetched_again(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """A message handed back with a nak is delivered again."""
        await publish(broker, 2)
        first = await puller.fetch(10, 1.0)
        await first[0].ack()
        await first[1].nak()
        again = await puller.fetch(10, 2.0)
        assert bodies(again) == [1]
        assert again[0].metadata.num_delivered == 2

    async def test_leftovers_are_the_deliveries_not_fetched(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """Deliveries that arrive after the last fetch are handed out by leftovers()."""
        fetching = asyncio.ensure_future(puller.fetch(10, 2.0))
        await wait_until(lambda: polling(broker), what="the long poll at the server")
        await publish(broker, 1)
        await fetching
        await publish(broker, 2, start=1)
        async with asyncio.timeout(5):
            while puller.held < 2:
                await asyncio.sleep(0.01)
        assert bodies(puller.leftovers()) == [1, 2]
        assert puller.leftovers() == []

    async def test_finish_withdraws_an_open_poll_at_once(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """finish() does not wait out a long poll; a new message then goes to the next
        puller at once, first delivery (the server does not deliver to the withdrawn inbox)."""
        fetching = asyncio.ensure_future(puller.fetch(10, LONG_POLL_S))
        await wait_until(lambda: polling(broker), what="the long poll at the server")
        await publish(broker, 1)
        assert bodies(await fetching) == [0]  # its long poll stays open for 9 more
        async with asyncio.timeout(PROMPT_STOP_S):
            assert await puller.finish() == []
        await publish(broker, 1, start=1)
        settings = broker.settings
        successor = PullBatches(
            broker.client, stream=settings.commands_stream, consumer=settings.consumer_name
        )
        await successor.start()
        try:
            (message,) = await successor.fetch(10, 1.0)
        finally:
            await successor.aclose()
        assert bodies([message]) == [1]
        assert message.metadata.num_delivered == 1

    async def test_interrupt_ends_a_waiting_fetch_and_every_later_one(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """interrupt() returns a fetch waiting in a long poll at once, empty, and later
        fetches return at once without asking the server."""
        fetching = asyncio.ensure_future(puller.fetch(10, LONG_POLL_S))
        await wait_until(lambda: polling(broker), what="the long poll at the server")
        puller.interrupt()
        async with asyncio.timeout(PROMPT_STOP_S):
            assert await fetching == []
            assert await puller.fetch(10, LONG_POLL_S) == []
            assert await puller.fetch_now(10, LONG_POLL_S) == []


class TestErrors:
    """Refused requests raise; a fetch before start is an error."""

    async def test_a_consumer_that_does_not_exist_is_an_error(self, broker: NatsBroker) -> None:
        """Pulling from a missing consumer raises PullError instead of waiting in silence."""
        pull = PullBatches(broker.client, stream="TIMER_COMMANDS", consumer="no-such-consumer")
        await pull.start()
        try:
            with pytest.raises(PullError):
                await pull.fetch(10, 1.0)
        finally:
            await pull.aclose()

    async def test_fetch_before_start_is_an_error(self, broker: NatsBroker) -> None:
        """A puller that was never started refuses to fetch."""
        pull = PullBatches(broker.client, stream="TIMER_COMMANDS", consumer="timer")
        with pytest.raises(PullError):
            await pull.fetch(10, 0.1)


class TestStreamSequence:
    """A delivery's stream sequence, read from its reply subject without nats-py's parse."""

    async def test_agrees_with_the_metadata_of_real_deliveries(
        self, broker: NatsBroker, puller: PullBatches
    ) -> None:
        """For deliveries of a real nats-server, the sequence is the one nats-py parses."""
        await publish(broker, 5)
        messages = await puller.fetch(10, 1.0)
        assert [stream_sequence(m) for m in messages] == [
            m.metadata.sequence.stream for m in messages
        ]
        assert [stream_sequence(m) for m in messages] == [1, 2, 3, 4, 5]

    def test_reads_the_stream_sequence_not_the_consumer_sequence(self) -> None:
        """Of the two sequences in the subject, the stream's (the fifth token) is read."""
        reply = "$JS.ACK.TIMER_COMMANDS.timer-service.2.123456.123450.1764230000000000000.42"
        message = Msg(_client=None, subject="timer.commands.t", reply=reply)  # type: ignore[arg-type]
        assert stream_sequence(message) == 123456 == message.metadata.sequence.stream

    def test_a_reply_with_a_domain_goes_to_nats_py(self) -> None:
        """The form with a domain and an account is read by nats-py's parse, the same way."""
        reply = (
            "$JS.ACK.hub.ACCOUNTHASH.TIMER_COMMANDS.timer-service.1.77.70.1764230000000000000.3.x"
        )
        message = Msg(_client=None, subject="timer.commands.t", reply=reply)  # type: ignore[arg-type]
        assert stream_sequence(message) == 77

    def test_a_message_that_is_not_a_delivery_is_refused(self) -> None:
        """A reply that is no JetStream ack subject raises nats-py's error, not a number."""
        message = Msg(_client=None, subject="timer.commands.t", reply="_INBOX.abc.1")  # type: ignore[arg-type]
        with pytest.raises(nats.errors.NotJSMessageError):
            stream_sequence(message)
