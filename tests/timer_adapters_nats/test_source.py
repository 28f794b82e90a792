"""The JetStream command source: batches, acks, redelivery, dead letters and tenant isolation."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from tests.timer_adapters_nats.jetstream import (
    RECOVERY_S,
    StoredMessage,
    jetstream_back,
    read_stream,
    wait_until,
)
from timer_adapters_nats import (
    ERROR_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    NatsBroker,
    NatsCommandSource,
    NatsServerProcess,
    NatsSettings,
    TimerClient,
)
from timer_core import Command, CommandOutcome, Instrumentation, MessageEnvelope, StoreUnavailable
from timer_core.codec import encode_envelope

DUE = datetime(2032, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)


class Recorder:
    """A command handler that records each batch it is handed; it can fail or hold on request."""

    def __init__(self, *, failures: int = 0, hold: asyncio.Event | None = None) -> None:
        self.batches: list[list[MessageEnvelope[Command]]] = []
        self.calls = 0
        self.failures = failures
        self.hold = hold
        self.entered = asyncio.Event()

    async def __call__(self, batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        self.calls += 1
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("database is down (test)")
        self.batches.append(list(batch))
        return [CommandOutcome.SCHEDULED] * len(batch)

    @property
    def ids(self) -> list[str]:
        """Ids of every envelope handled, in order."""
        return [envelope.id for batch in self.batches for envelope in batch]


class Rejections(Instrumentation):
    """Records ``command_rejected`` reports."""

    def __init__(self) -> None:
        self.rejected: list[tuple[str, str]] = []

    def command_rejected(self, subject: str, reason: str) -> None:
        self.rejected.append((subject, reason))


@contextlib.asynccontextmanager
async def consuming(
    source: NatsCommandSource, handler: Recorder
) -> AsyncIterator[asyncio.Task[None]]:
    """Run the source in a task; stop it and wait for it at the end."""
    task = asyncio.create_task(source.run(handler))
    try:
        yield task
    finally:
        await asyncio.wait_for(source.stop(), 10)
        await task


async def settled(broker: NatsBroker) -> bool:
    """Whether the consumer has nothing pending and nothing waiting for an ack."""
    info = await broker.jetstream.consumer_info(
        broker.settings.commands_stream, broker.settings.consumer_name
    )
    return info.num_pending == 0 and info.num_ack_pending == 0


async def dead_lettered(broker: NatsBroker, count: int = 1) -> bool:
    """Whether ``count`` dead letters are stored and the consumer settled.

    Settled alone is not enough: a dead-letter publish that timed out under load naks the
    command, which then counts as neither pending nor unacked a moment.
    """
    return len(await dead_letters(broker)) >= count and await settled(broker)


async def dead_letters(broker: NatsBroker) -> list[StoredMessage]:
    """What TIMER_DLQ holds."""
    return await read_stream(broker.jetstream, broker.settings.dlq_stream)


async def fetch_and_vanish(broker: NatsBroker, count: int) -> None:
    """A dead instance: another connection fetches ``count`` commands on the service's
    consumer and closes without settling them (they come back after the ack wait)."""
    dead = await nats.connect(broker.settings.url)
    try:
        pull = await dead.jetstream().pull_subscribe_bind(
            broker.settings.consumer_name, stream=broker.settings.commands_stream
        )
        assert len(await pull.fetch(count, timeout=5)) == count
    finally:
        await dead.close()


def schedule_json(tenant: str = "tenant-a", call: str = "call-1") -> dict[str, Any]:
    """A valid ScheduleTimer envelope as JSON, to be broken by a test."""
    client_envelope = {
        "id": "01a20084-e7d2-77a8-9ad1-5e984387e2f2",
        "type": "ScheduleTimer",
        "tenantId": tenant,
        "aggregateId": call,
        "timestampMs": 1_700_000_000_000,
        "payload": {
            "_tag": "ScheduleTimer",
            "tenantId": tenant,
            "serviceCallId": call,
            "dueAt": "2032-01-02T03:04:05.678Z",
        },
    }
    return copy.deepcopy(client_envelope)


def broken(change: str) -> bytes:
    """A ScheduleTimer for tenant-a broken in one way the contract forbids."""
    body = schedule_json()
    match change:
        case "missing field":
            del body["payload"]["dueAt"]
        case "mistyped field":
            body["timestampMs"] = "1700000000000"
        case "type is not the tag":
            body["type"] = "CancelTimer"
        case "envelope and payload tenants differ":
            body["payload"]["tenantId"] = "tenant-b"
        case "bad id":
            body["id"] = "not-a-uuid"
        case "timestamp without zone":
            body["payload"]["dueAt"] = "2032-01-02T03:04:05"
        case "null optional key":
            body["correlationId"] = None
        case "subject and envelope tenants differ":
            body = schedule_json(tenant="tenant-b")
        case "an event, not a command":
            body["type"] = body["payload"]["_tag"] = "DueTimeReached"
            body["payload"]["reachedAt"] = body["payload"]["dueAt"]
        case _:
            raise AssertionError(change)
    return json.dumps(body).encode()


#: Every kind of bad command, the body sent to timer.commands.tenant-a, and how the
#: Timer-Error header must start.
BAD_COMMANDS: list[tuple[str, bytes, str]] = [
    ("not JSON", b"{this is not json", "$: not valid JSON"),
    ("missing field", broken("missing field"), "payload.dueAt: is required"),
    ("mistyped field", broken("mistyped field"), "timestampMs: expected an integer"),
    ("type is not the tag", broken("type is not the tag"), "type: 'CancelTimer' does not match"),
    (
        "envelope and payload tenants differ",
        broken("envelope and payload tenants differ"),
        "tenantId: envelope tenant 'tenant-a' does not match payload tenant 'tenant-b'",
    ),
    (
        "subject and envelope tenants differ",
        broken("subject and envelope tenants differ"),
        "tenantId: envelope tenant 'tenant-b' does not match the subject's tenant 'tenant-a'",
    ),
    ("bad id", broken("bad id"), "id: id must be a lowercase UUID v7"),
    ("timestamp without zone", broken("timestamp without zone"), "payload.dueAt: timestamp"),
    ("null optional key", broken("null optional key"), "correlationId: must be omitted"),
    ("an event, not a command", broken("an event, not a command"), "type: DueTimeReached is"),
]


class TestValidCommands:
    """Valid commands reach the handler in order and are acked after it returns."""

    async def test_handed_over_in_stream_order_and_acked(self, settings: NatsSettings) -> None:
        """Schedules and cancels arrive in the order sent, in batches of fetch_batch, all acked."""
        async with NatsBroker(attrs.evolve(settings, fetch_batch=7)) as broker:
            client = TimerClient(broker)
            sent = []
            for i in range(30):
                call = f"call-{i % 4}"
                if i % 3 == 2:
                    sent.append(await client.cancel("tenant-a", call))
                else:
                    sent.append(await client.schedule("tenant-a", call, DUE))
            recorder = Recorder()
            async with consuming(broker.command_source(), recorder):
                await wait_until(lambda: len(recorder.ids) == 30, what="30 commands")
                await wait_until(lambda: settled(broker), what="all acked")
        assert recorder.ids == sent
        assert all(len(batch) <= 7 for batch in recorder.batches)
        # Each carries its stream sequence, the position that orders a timer's commands.
        positions = [envelope.position for batch in recorder.batches for envelope in batch]
        assert positions == list(range(1, 31))

    async def test_commands_published_while_running(self, broker: NatsBroker) -> None:
        """Commands sent while the source waits are picked up by its long poll."""
        recorder = Recorder()
        client = TimerClient(broker)
        async with consuming(broker.command_source(), recorder):
            await asyncio.sleep(0)
            first = await client.schedule("tenant-a", "late-1", DUE)
            await wait_until(lambda: recorder.ids == [first], what="the first command")
            second = await client.schedule("tenant-b", "late-2", DUE)
            await wait_until(lambda: recorder.ids == [first, second], what="the second command")


class TestDeadLetters:
    """Semantics 4: bad commands are terminated and republished unchanged with the reason."""

    async def test_every_bad_kind_between_good_commands(self, settings: NatsSettings) -> None:
        """Each kind of bad command is dead-lettered with its reason; good ones around it pass."""
        rejections = Rejections()
        async with NatsBroker(settings, instrumentation=rejections) as broker:
            client = TimerClient(broker)
            good = [await client.schedule("tenant-a", "good-0", DUE)]
            for index, (_, body, _) in enumerate(BAD_COMMANDS, start=1):
                await broker.jetstream.publish("timer.commands.tenant-a", body)
                good.append(await client.schedule("tenant-a", f"good-{index}", DUE))
            recorder = Recorder()
            async with consuming(broker.command_source(), recorder):
                await wait_until(lambda: len(recorder.ids) == len(good), what="good commands")
                await wait_until(
                    lambda: dead_lettered(broker, len(BAD_COMMANDS)), what="all dead-lettered"
                )
            held = await dead_letters(broker)
        assert recorder.ids == good
        assert len(held) == len(BAD_COMMANDS)
        for message, (kind, body, reason) in zip(held, BAD_COMMANDS, strict=True):
            assert message.data == body, kind
            assert message.subject == "timer.dlq.tenant-a", kind
            assert message.headers[ERROR_HEADER].startswith(reason), (kind, message.headers)
            assert "\n" not in message.headers[ERROR_HEADER]
            assert message.headers[ORIGINAL_SUBJECT_HEADER] == "timer.commands.tenant-a"
        assert [subject for subject, _ in rejections.rejected] == ["timer.commands.tenant-a"] * len(
            BAD_COMMANDS
        )
        assert [reason for _, reason in rejections.rejected] == [
            m.headers[ERROR_HEADER] for m in held
        ]

    async def test_unreadable_subject_tenant_goes_to_underscore(self, broker: NatsBroker) -> None:
        """A command on a subject whose tenant token is not one valid id goes to <prefix>.dlq._."""
        body = encode_envelope(TimerClient(broker).schedule_envelope("tenant-a", "c", DUE))
        await broker.jetstream.publish("timer.commands.tenant-a.extra", body)
        async with consuming(broker.command_source(), Recorder()):
            await wait_until(lambda: dead_lettered(broker), what="the command dead-lettered")
        (held,) = await dead_letters(broker)
        assert held.subject == "timer.dlq._"
        assert held.data == body
        assert held.headers[ERROR_HEADER].startswith("subject: 'timer.commands.tenant-a.extra'")

    async def test_producer_cannot_touch_another_tenant(self, broker: NatsBroker) -> None:
        """A cancel for tenant-b sent on tenant-a's subject never reaches the handler."""
        envelope = TimerClient(broker).cancel_envelope("tenant-b", "call-1")
        await broker.jetstream.publish("timer.commands.tenant-a", encode_envelope(envelope))
        recorder = Recorder()
        async with consuming(broker.command_source(), recorder):
            await wait_until(lambda: dead_lettered(broker), what="the command dead-lettered")
        assert recorder.calls == 0
        (held,) = await dead_letters(broker)
        assert held.subject == "timer.dlq.tenant-a"

    async def test_failed_dead_letter_is_not_lost(self, settings: NatsSettings) -> None:
        """When the DLQ publish fails the command is nak'd, and dead-lettered once it can be."""
        broker = NatsBroker(attrs.evolve(settings, provision=False))
        async with broker:
            provisioner = NatsBroker(settings)  # for its stream and consumer configs
            commands = provisioner.stream_config("TIMER_COMMANDS", "timer.commands.>")
            await broker.jetstream.add_stream(commands)
            await broker.jetstream.add_consumer("TIMER_COMMANDS", provisioner.consumer_config())
            await broker.jetstream.publish("timer.commands.tenant-a", b"garbage")
            recorder = Recorder()
            async with consuming(broker.command_source(), recorder):

                async def delivered_twice() -> bool:
                    info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer")
                    return info.num_redelivered >= 1

                await wait_until(delivered_twice, what="a redelivery after the failed DLQ publish")
                await broker.jetstream.add_stream(
                    StreamConfig(
                        name="TIMER_DLQ", subjects=["timer.dlq.>"], storage=StorageType.FILE
                    )
                )
                await wait_until(lambda: dead_lettered(broker), what="the command dead-lettered")
            (held,) = await dead_letters(broker)
        assert held.data == b"garbage"
        assert recorder.calls == 0


class TestHandlerFailures:
    """Semantics 3: a command whose handler failed is not acked and comes back, in order."""

    async def test_failed_batch_is_redelivered_in_order(self, broker: NatsBroker) -> None:
        """After two failed attempts the same commands are handled, once, in the order sent."""
        client = TimerClient(broker)
        sent = [await client.schedule("tenant-a", f"call-{i}", DUE) for i in range(5)]
        recorder = Recorder(failures=2)
        async with consuming(broker.command_source(), recorder):
            await wait_until(lambda: len(recorder.ids) == 5, what="the commands to be handled")
            await wait_until(lambda: settled(broker), what="all acked")
        assert recorder.ids == sent
        assert recorder.calls >= 3
        # A redelivery keeps the position of the command in the stream.
        assert [e.position for batch in recorder.batches for e in batch] == [1, 2, 3, 4, 5]

    async def test_last_delivery_is_dead_lettered(self, settings: NatsSettings) -> None:
        """A command still failing on its max_deliver-th delivery is dead-lettered, not dropped."""
        async with NatsBroker(attrs.evolve(settings, max_deliver=3)) as broker:
            envelope_id = await TimerClient(broker).schedule("tenant-a", "doomed", DUE)
            recorder = Recorder(failures=1000)
            async with consuming(broker.command_source(), recorder):
                await wait_until(lambda: dead_lettered(broker), what="the command dead-lettered")
            (held,) = await dead_letters(broker)
        assert recorder.calls == 3
        assert json.loads(held.data)["id"] == envelope_id
        assert held.headers[ERROR_HEADER] == (
            "not stored after 3 deliveries: StoreUnavailable: database is down (test)"
        )

    async def test_slow_handler_is_not_redelivered(self, settings: NatsSettings) -> None:
        """A handler slower than the ack wait keeps its batch (in-progress acks): one delivery."""
        async with NatsBroker(attrs.evolve(settings, ack_wait_s=0.6)) as broker:
            await TimerClient(broker).schedule("tenant-a", "slow", DUE)
            hold = asyncio.Event()
            recorder = Recorder(hold=hold)
            async with consuming(broker.command_source(), recorder):
                await recorder.entered.wait()
                await asyncio.sleep(1.5)  # the slow work itself, over twice the ack wait
                hold.set()
                await wait_until(lambda: settled(broker), what="the command acked")
            info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer")
        assert recorder.calls == 1
        assert info.num_redelivered == 0


class TestKeepAlive:
    """In-progress acks go to the commands held long enough to need them, not to every one."""

    async def test_commands_settled_within_a_sixth_of_the_ack_wait_get_none(
        self, settings: NatsSettings
    ) -> None:
        """Commands each held a fraction of a check interval are acked without any in-progress
        ack, though together they span several of the checks."""
        # Checks every 0.5 s; one command a batch, each held 0.1 s (and read ahead while the
        # one before is held): 15 batches span three checks, no command two.
        quick = attrs.evolve(settings, ack_wait_s=3.0, fetch_batch=1)
        async with NatsBroker(quick) as broker:
            watcher = await nats.connect(quick.url)
            acks: list[bytes] = []

            async def on_ack(message: nats.aio.msg.Msg) -> None:
                acks.append(message.data)

            try:
                await watcher.subscribe(f"$JS.ACK.{quick.commands_stream}.>", cb=on_ack)
                await watcher.flush()
                client = TimerClient(broker)
                for n in range(15):
                    await client.schedule("tenant-a", f"call-{n}", DUE)
                recorder = SlowRecorder(0.1)
                async with consuming(broker.command_source(), recorder):
                    await wait_until(lambda: settled(broker), what="every command acked")
                await watcher.flush()
            finally:
                await watcher.close()
        assert recorder.calls == 15
        assert acks == [b""] * 15  # an ack each (nats-py's is empty), no b"+WPI"


class SlowRecorder(Recorder):
    """A :class:`Recorder` that takes ``seconds`` over every batch."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def __call__(self, batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        await asyncio.sleep(self.seconds)
        return await super().__call__(batch)


class TestLifecycle:
    """stop() finishes the batch in hand; the source outlives disconnects."""

    async def test_stop_lets_the_batch_finish_and_acks_it(self, broker: NatsBroker) -> None:
        """stop() waits for the handler's batch, which is then acked before run returns."""
        client = TimerClient(broker)
        sent = [await client.schedule("tenant-a", f"call-{i}", DUE) for i in range(3)]
        hold = asyncio.Event()
        recorder = Recorder(hold=hold)
        source = broker.command_source()
        task = asyncio.create_task(source.run(recorder))
        await recorder.entered.wait()
        stopping = asyncio.create_task(source.stop())
        await asyncio.sleep(0.05)
        assert not stopping.done() and not task.done()
        hold.set()
        await asyncio.wait_for(stopping, 5)
        assert task.done()
        await task
        assert recorder.ids == sent
        await wait_until(lambda: settled(broker), what="the batch acked")

    async def test_stop_before_run(self, broker: NatsBroker) -> None:
        """A source stopped before it ran returns from run at once."""
        source = broker.command_source()
        await source.stop()
        await asyncio.wait_for(source.run(Recorder()), 2)

    async def test_keeps_consuming_across_a_server_restart(
        self, broker: NatsBroker, nats_server: NatsServerProcess
    ) -> None:
        """The source outlives the server going away and consumes again once it is back."""
        client = TimerClient(broker)
        recorder = Recorder()
        async with consuming(broker.command_source(), recorder) as task:
            before = await client.schedule("tenant-a", "before", DUE)
            await wait_until(lambda: recorder.ids == [before], what="the first command")
            # Acks are fire-and-forget: one the server has not read when it stops is lost,
            # and the command comes back after the ack wait. Restart once it is applied.
            await wait_until(lambda: settled(broker), what="the first command acked")
            nats_server.stop()
            await wait_until(lambda: not broker.is_connected, what="the disconnect")
            nats_server.start()
            await wait_until(lambda: broker.is_connected, what="the reconnect")
            await wait_until(
                lambda: jetstream_back(broker.jetstream, "TIMER_COMMANDS", "timer"),
                within=RECOVERY_S,
                what="JetStream back",
            )
            after = await client.schedule("tenant-a", "after", DUE + timedelta(seconds=1))
            await wait_until(lambda: recorder.ids == [before, after], what="the second command")
            assert not task.done()

    async def test_second_run_is_refused(self, broker: NatsBroker) -> None:
        """One source runs once at a time."""
        source = broker.command_source()
        async with consuming(source, Recorder()):
            await asyncio.sleep(0)
            with pytest.raises(RuntimeError):
                await source.run(Recorder())

    async def test_unstarted_broker_is_refused(self, settings: NatsSettings) -> None:
        """run() on a broker that was never started raises instead of retrying forever."""
        with pytest.raises(RuntimeError, match="not started"):
            await NatsBroker(settings).command_source().run(Recorder())


class TestPredecessorCrash:
    """Commands a dead instance held come back after the ack wait, before later ones."""

    async def test_later_commands_wait_in_hand_for_the_dead_instances_ones(
        self, settings: NatsSettings
    ) -> None:
        """The commands a dead consumer fetched are applied first, once redelivered; the later
        ones are held back in hand meanwhile, not handed back: each is delivered only once."""
        async with NatsBroker(attrs.evolve(settings, ack_wait_s=1.0)) as broker:
            client = TimerClient(broker)
            held = [await client.schedule("tenant-a", f"call-{i}", DUE) for i in range(3)]
            # The dead instance: it fetches the first three and vanishes without settling.
            await fetch_and_vanish(broker, 3)
            # A cancel of the first one, and more, sent before the successor starts.
            later = [await client.cancel("tenant-a", "call-0")]
            later += [await client.schedule("tenant-b", f"call-{i}", DUE) for i in range(3)]
            recorder = Recorder()
            async with consuming(broker.command_source(), recorder):
                await wait_until(lambda: len(recorder.ids) == 7, what="every command")
                await wait_until(lambda: settled(broker), what="every command acked")
                info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer")
        assert recorder.ids == held + later
        # Deliveries: the dead instance's three, their redelivery, and one of each later one.
        assert info.delivered.consumer_seq == 3 + 3 + 4

    async def test_holding_back_up_to_max_ack_pending_does_not_stall(
        self, settings: NatsSettings
    ) -> None:
        """Later commands held back fill the consumer's max_ack_pending (1000): the server
        still redelivers the dead instance's commands, and everything is applied in order."""
        async with NatsBroker(attrs.evolve(settings, ack_wait_s=1.0, fetch_batch=10)) as broker:
            info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer")
            assert info.config.max_ack_pending == 1000
            client = TimerClient(broker)
            held = [await client.schedule("tenant-a", f"held-{i}", DUE) for i in range(10)]
            await fetch_and_vanish(broker, 10)
            later = [client.schedule_envelope("tenant-a", f"later-{i}", DUE) for i in range(1100)]
            assert await client.send_many(later) == [None] * len(later)
            recorder = Recorder()
            async with consuming(broker.command_source(), recorder):
                await wait_until(
                    lambda: len(recorder.ids) == 1110, within=RECOVERY_S, what="every command"
                )
        assert recorder.ids == held + [envelope.id for envelope in later]
