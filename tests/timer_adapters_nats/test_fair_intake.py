"""Fair intake on a real nats-server (issue 43): one tenant's flood of commands holds back its
own commands only; another tenant's next command overtakes the whole backlog, with the
per-tenant quota refusing the flood or without it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime

import pytest_asyncio
import uuid_utils

from tests.timer_adapters_nats.jetstream import read_stream, wait_until
from timer_adapters_nats import NatsBroker, NatsSettings, TimerClient
from timer_core import (
    Command,
    CommandOutcome,
    EnvelopeId,
    MessageEnvelope,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    command_envelope,
)
from timer_core.codec import encode_envelope

DUE = datetime(2032, 1, 2, 3, 4, 5, tzinfo=UTC)
#: A's flood: what a store taking STORE_S a batch needs seconds to work through.
FLOOD = 3_000
#: What a store write of one batch takes here: A's flood needs 30 batches, about 1.5 s at
#: the least; B's one command must not wait for them.
STORE_S = 0.05
#: Generous budget for events that come within a few batches on an idle machine.
WITHIN_S = 60.0


def schedule(tenant: str, call: str) -> bytes:
    payload = ScheduleTimer(TenantId(tenant), ServiceCallId(call), DUE)
    envelope = command_envelope(payload, EnvelopeId(str(uuid_utils.uuid7())), datetime.now(UTC))
    return encode_envelope(envelope)


class SlowStore:
    """A command handler standing for a store that takes STORE_S to write each batch; it
    notes, for every command, how many of tenant A's were handed over before it. Commands of
    the tenants in ``refuse`` are refused as over their quota (the Timer's cap)."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.refuse = refuse
        self.handled: dict[str, int] = {}  # service call id -> A's handled before it
        self.a_handled = 0

    async def __call__(self, batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        refused = [str(envelope.tenant_id) in self.refuse for envelope in batch]
        for envelope in batch:
            self.handled[str(envelope.payload.service_call_id)] = self.a_handled
            if envelope.tenant_id == "tenant-a":
                self.a_handled += 1
        if not all(refused):
            await asyncio.sleep(STORE_S)  # the write (refusals write nothing)
        return [CommandOutcome.OVER_QUOTA if no else CommandOutcome.SCHEDULED for no in refused]


@pytest_asyncio.fixture
async def broker(nats_url: str) -> AsyncIterator[NatsBroker]:
    """The service's broker with its default intake."""
    async with NatsBroker(NatsSettings(url=nats_url, ack_timeout_s=5.0)) as broker:
        yield broker


async def overtakes(
    broker: NatsBroker, store: SlowStore, then: Callable[[], Awaitable[None]] | None = None
) -> int:
    """Run the broker's command source on ``store``; B's first command opens its lane, then
    A floods FLOOD commands and B sends one more; ``then`` runs before the source stops.
    Returns how many of A's were handled before B's second command."""
    source = broker.command_source()
    task = asyncio.create_task(source.run(store))
    try:
        nc = broker.client
        await nc.publish("timer.commands.tenant-b", schedule("tenant-b", "b-first"))
        await wait_until(lambda: "b-first" in store.handled, within=WITHIN_S, what="B's first")
        for i in range(FLOOD):
            await nc.publish("timer.commands.tenant-a", schedule("tenant-a", f"a-{i}"))
        await nc.flush()
        await wait_until(lambda: store.a_handled > 0, within=WITHIN_S, what="A's flood handled")
        await nc.publish("timer.commands.tenant-b", schedule("tenant-b", "b-during"))
        await wait_until(lambda: "b-during" in store.handled, within=WITHIN_S, what="B's next")
        if then is not None:
            await then()
        return store.handled["b-during"]
    finally:
        await asyncio.wait_for(source.stop(), 30)
        await task


class TestFairIntake:
    async def test_another_tenants_command_overtakes_a_flood(self, broker: NatsBroker) -> None:
        """B's command sent while A's flood waits is handled before most of the flood."""
        before = await overtakes(broker, SlowStore())
        assert before < FLOOD // 2, f"B's command waited for {before} of A's {FLOOD}"

    async def test_overtakes_while_the_flood_is_refused_over_quota(
        self, broker: NatsBroker
    ) -> None:
        """With A over its quota, every command of its flood is dead-lettered to A's own
        dead-letter subject, and B's command still overtakes the flood."""

        async def all_dead_lettered() -> bool:
            info = await broker.jetstream.stream_info("TIMER_DLQ")
            return info.state.messages >= FLOOD

        async def wait_for_dead_letters() -> None:
            await wait_until(all_dead_lettered, within=WITHIN_S, what="A's flood dead-lettered")

        store = SlowStore(refuse=frozenset({"tenant-a"}))
        before = await overtakes(broker, store, then=wait_for_dead_letters)
        assert before < FLOOD // 2, f"B's command waited for {before} of A's {FLOOD}"
        letters = await read_stream(broker.jetstream, "TIMER_DLQ")
        assert {letter.subject for letter in letters} == {"timer.dlq.tenant-a"}

    async def test_a_new_tenant_gets_a_lane_of_its_own(self, broker: NatsBroker) -> None:
        """A tenant's first command opens a consumer filtered to its subject alone."""
        store = SlowStore()
        source = broker.command_source()
        task = asyncio.create_task(source.run(store))
        try:
            await broker.client.publish("timer.commands.tenant-c", schedule("tenant-c", "c-1"))
            await wait_until(lambda: "c-1" in store.handled, within=WITHIN_S, what="C's first")
        finally:
            await asyncio.wait_for(source.stop(), 30)
            await task
        info = await broker.jetstream.consumer_info("TIMER_COMMANDS", "timer_tenant-c")
        assert info.config.filter_subject == "timer.commands.tenant-c"
        assert info.num_pending == 0 and info.num_ack_pending == 0


class TestIdsDoNotCrossTenants:
    async def test_another_tenants_message_id_never_drops_a_command(
        self, broker: NatsBroker
    ) -> None:
        """A publishes with ``Nats-Msg-Id: X``; B's command with envelope id X, sent by
        TimerClient a moment later, is stored and acked as new, and B's lane hands it over."""
        taken = EnvelopeId(str(uuid_utils.uuid7()))
        await broker.jetstream.publish(
            "timer.commands.tenant-a", schedule("tenant-a", "a-1"), headers={"Nats-Msg-Id": taken}
        )
        payload = ScheduleTimer(TenantId("tenant-b"), ServiceCallId("b-1"), DUE)
        envelope = command_envelope(payload, taken, datetime.now(UTC))
        assert await TimerClient(broker).send(envelope) == taken
        held = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert [m.subject for m in held] == ["timer.commands.tenant-a", "timer.commands.tenant-b"]

        store = SlowStore()
        source = broker.command_source()
        task = asyncio.create_task(source.run(store))
        try:
            await wait_until(lambda: "b-1" in store.handled, within=WITHIN_S, what="B's command")
        finally:
            await asyncio.wait_for(source.stop(), 30)
            await task

    async def test_the_commands_stream_keeps_the_shortest_window(self, broker: NatsBroker) -> None:
        """TIMER_COMMANDS is provisioned with JetStream's shortest duplicate window (100 ms),
        so even a host that sends Nats-Msg-Id on commands is exposed that long only."""
        info = await broker.jetstream.stream_info("TIMER_COMMANDS")
        assert info.config.duplicate_window == 0.1
