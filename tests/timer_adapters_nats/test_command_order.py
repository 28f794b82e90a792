"""Command order: commands replayed from JetStream after newer ones never re-arm a timer."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import attrs
import pytest

from tests.timer_adapters_nats.jetstream import read_stream, wait_until
from tests.timer_adapters_nats.test_source import consuming, settled
from timer_adapters_memory import FakeClock, MemoryTimerStore
from timer_adapters_nats import ERROR_HEADER, NatsBroker, NatsSettings, TimerClient
from timer_adapters_postgres import PostgresTimerStore
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import Command, CommandOutcome, MessageEnvelope, TenantId, TimerStore
from timer_core.commands import handle_commands

DUE = datetime(2032, 1, 2, 3, 4, 5, tzinfo=UTC)
A = TenantId("tenant-a")


class Applier:
    """A command handler that applies each batch to a store and counts the outcomes."""

    def __init__(self, store: TimerStore) -> None:
        self.store = store
        self.clock = FakeClock(datetime(2031, 1, 1, tzinfo=UTC))
        self.outcomes: collections.Counter[CommandOutcome] = collections.Counter()
        self.positions: list[int | None] = []

    async def __call__(self, batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
        self.positions += [envelope.position for envelope in batch]
        outcomes = await handle_commands(self.store, batch, self.clock)
        self.outcomes.update(outcomes)
        return outcomes

    @property
    def handled(self) -> int:
        return sum(self.outcomes.values())


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], TimerStore]:
    """A factory of stores over one storage: in memory, one SQLite file, or one database."""
    if request.param == "memory":
        first = MemoryTimerStore()
        return lambda: MemoryTimerStore(shared_with=first)
    if request.param == "postgres":
        url: str = request.getfixturevalue("fresh_postgres_url")
        return lambda: PostgresTimerStore(url, listen=False)
    return lambda: SqliteTimerStore(tmp_path / "timer.db")


class TestReplayedCommands:
    async def test_replaying_the_whole_stream_rearms_nothing(
        self, settings: NatsSettings, make_store: Callable[[], TimerStore]
    ) -> None:
        """A second consumer replays every command after the first applied them: 0 re-arms."""
        store = make_store()
        async with NatsBroker(attrs.evolve(settings, fetch_batch=5)) as broker, store:
            client = TimerClient(broker)
            sent = 0
            for i in range(20):
                call = f"call-{i}"
                await client.schedule(A, call, DUE)
                sent += 1
                if i % 2:
                    await client.cancel(A, call)  # the old schedule must stay cancelled
                    sent += 1
                if i % 3 == 0:
                    await client.schedule(A, call, DUE.replace(year=2033))  # a reschedule
                    sent += 1
            first = Applier(store)
            async with consuming(broker.command_source(), first):
                await wait_until(lambda: first.handled == sent, what="every command applied")
                await wait_until(lambda: settled(broker), what="every command acked")
            before = await store.list_for_tenant(A)
            assert first.positions == list(range(1, sent + 1))
            assert first.outcomes[CommandOutcome.STALE] == 0

        # The same stream read again from its start by a new consumer: every command is now
        # older than (or the same as) the last one applied to its timer, as after a broker
        # that lost its acks.
        replay_settings = attrs.evolve(settings, fetch_batch=5, consumer_name="replay")
        async with NatsBroker(replay_settings) as broker, make_store() as replay_store:
            again = Applier(replay_store)
            async with consuming(broker.command_source(), again):
                await wait_until(lambda: again.handled == sent, what="every command replayed")
                await wait_until(lambda: settled(broker), what="every replay acked")
            after = await replay_store.list_for_tenant(A)
        assert after == before
        assert [e.key.service_call_id for e in after if e.is_scheduled] == sorted(
            f"call-{i}" for i in range(20) if i % 2 == 0 or i % 3 == 0
        )
        assert again.positions == first.positions
        # Cancelled keys' schedules, and schedules replaced by a reschedule, are stale.
        assert again.outcomes[CommandOutcome.STALE] > 0
        assert again.outcomes[CommandOutcome.CANCELLED] == 0


class TestQuota:
    async def test_schedules_over_the_cap_are_dead_lettered_naming_it(
        self, broker: NatsBroker, make_store: Callable[[], TimerStore]
    ) -> None:
        """With a cap of 3 pending timers, a tenant's 4th and 5th new timers go to its dead
        letter subject with a Timer-Error naming the cap; the rest are stored and acked."""
        client = TimerClient(broker)
        for i in range(5):
            await client.schedule(A, f"call-{i}", DUE)
        await client.schedule("tenant-b", "call-0", DUE)
        async with make_store() as store:
            clock = FakeClock(datetime(2031, 1, 1, tzinfo=UTC))

            async def handler(batch: Sequence[MessageEnvelope[Command]]) -> list[CommandOutcome]:
                return await handle_commands(store, batch, clock, max_pending_per_tenant=3)

            async with consuming(broker.command_source(), handler):  # type: ignore[arg-type]
                await wait_until(
                    lambda: _dead_lettered(broker, 2), what="two commands dead-lettered"
                )
                await wait_until(lambda: settled(broker), what="every command settled")
            assert await store.count_scheduled_for_tenant(A) == 3
            assert await store.count_scheduled_for_tenant(TenantId("tenant-b")) == 1
        letters = await read_stream(broker.jetstream, broker.settings.dlq_stream)
        assert [m.subject for m in letters] == ["timer.dlq.tenant-a"] * 2
        for letter in letters:
            assert "max_pending_per_tenant" in letter.headers[ERROR_HEADER]
        assert {m.json()["payload"]["serviceCallId"] for m in letters} == {"call-3", "call-4"}


async def _dead_lettered(broker: NatsBroker, count: int) -> bool:
    return len(await read_stream(broker.jetstream, broker.settings.dlq_stream)) >= count
