"""A stateful property test of the whole timer: commands, a real worker, failures and restarts.

Hypothesis drives a memory store, a memory bus and a FakeClock through random schedules,
reschedules, cancels, clock advances, publish and store failures and worker restarts, and
checks the timer's promises after every step against a model of the commands sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import event as count_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_core import (
    CancelTimer,
    Command,
    CommandOutcome,
    CorrelationId,
    EnvelopeId,
    MessageEnvelope,
    ScheduleTimer,
    ServiceCallId,
    StoreError,
    TenantId,
    TimerState,
    TimerWorker,
)
from timer_core.commands import handle_commands
from timer_core.instants import to_epoch_ms

T = TypeVar("T")
T0 = datetime(2030, 1, 1, tzinfo=UTC)
TENANTS = [TenantId("tenant-a"), TenantId("tenant-b"), TenantId("tenant-c")]
# Few calls, shared by every tenant: collisions across tenants are the point.
CALLS = [ServiceCallId(f"call-{i}") for i in range(3)]
CORRELATIONS = [CorrelationId("corr-1"), CorrelationId("corr-2")]
POLLING_INTERVAL = 5.0
MAX_BACKOFF = 0.4

Key = tuple[TenantId, ServiceCallId]
Firing = tuple[TenantId, ServiceCallId, datetime]


@attrs.define
class ModelTimer:
    """What the commands sent so far say a timer should be."""

    due_at: datetime
    correlation_id: CorrelationId | None
    reached: bool = False


schedule_commands = st.builds(
    lambda tenant, call, offset_ms, correlation: ("schedule", tenant, call, offset_ms, correlation),
    st.sampled_from(TENANTS),
    st.sampled_from(CALLS),
    st.integers(-3_000, 12_000),
    st.none() | st.sampled_from(CORRELATIONS),
)
cancel_commands = st.builds(
    lambda tenant, call: ("cancel", tenant, call, 0, None),
    st.sampled_from(TENANTS),
    st.sampled_from(CALLS),
)


class TimerMachine(RuleBasedStateMachine):
    """The timer under random commands, time, failures and restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock(T0)
        self.storage = MemoryTimerStore()
        self.run(self.storage.start())
        self.bus = MemoryEventBus()
        self.model: dict[Key, ModelTimer] = {}
        self.ever_scheduled: set[tuple[Key, datetime, CorrelationId | None]] = set()
        self.frozen: dict[Key, Any] = {}
        self.store_down = False
        self.restarts = 0
        self.worker, self.task = self.start_worker()
        self.settle()

    # -- plumbing ----------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the machine's loop, letting the worker task run alongside."""
        return self.loop.run_until_complete(coro)

    def start_worker(self) -> tuple[TimerWorker, asyncio.Task[None]]:
        """A new worker over a newly opened store instance on the same storage."""
        store = MemoryTimerStore(shared_with=self.storage)
        self.run(store.start())
        worker = TimerWorker(
            store,
            self.bus,
            self.clock,
            polling_interval=POLLING_INTERVAL,
            batch_size=3,
            initial_backoff=0.05,
            max_backoff=MAX_BACKOFF,
        )
        return worker, self.loop.create_task(worker.run())

    def settle(self) -> None:
        """Let the worker run until it sleeps on the fake clock again (idle or backing off)."""

        # The worker may go to sleep while a delivery or a mark is still under way (after a
        # few turns of the loop it stops waiting for them): settled means those ended too,
        # or the model would be checked against a store that changes behind its back.
        pipeline = self.worker._firing

        async def asleep() -> None:
            async with asyncio.timeout(10):
                while self.clock.sleepers != 1 or (pipeline.busy and not self.store_down):
                    assert not self.task.done(), "the worker loop died"
                    await asyncio.sleep(0)

        self.run(asleep())
        self.sync_model()

    def sync_model(self) -> None:
        """Learn which timers the worker fired, checking each against the model."""
        published = {
            (e.tenant_id, e.payload.service_call_id, e.payload.due_at): e
            for e in self.bus.published
        }
        for entry in self.storage.entries():
            model = self.model.get(entry.key)
            assert model is not None, f"the store holds {entry.key}, which was never scheduled"
            if entry.state is TimerState.REACHED and not model.reached:
                assert entry.due_at == model.due_at
                assert entry.correlation_id == model.correlation_id
                event = published.get((entry.tenant_id, entry.service_call_id, entry.due_at))
                assert event is not None, f"{entry.key} was marked Reached but never published"
                assert entry.reached_at is not None
                assert event.payload.reached_at <= entry.reached_at
                model.reached = True
                count_event("a timer fired")
            if entry.state is TimerState.REACHED:
                self.frozen.setdefault(entry.key, entry)
        if self.bus.duplicates:
            count_event("a firing was re-published and dropped as a duplicate")

    # -- rules -------------------------------------------------------------------------------

    @initialize(commands=st.lists(schedule_commands, min_size=1, max_size=8))
    def schedule_some(self, commands: list[tuple[str, TenantId, ServiceCallId, int, Any]]) -> None:
        """Start with a few timers."""
        self.send_commands(commands)

    @rule(commands=st.lists(schedule_commands | cancel_commands, min_size=1, max_size=4))
    def send_commands(
        self, commands: list[tuple[str, TenantId, ServiceCallId, int, Any]], *, racing: bool = False
    ) -> None:
        """Apply a batch of schedules (new or reschedules) and cancels, in order."""
        now = self.clock.now()
        envelopes: list[MessageEnvelope[Command]] = []
        for kind, tenant, call, offset_ms, correlation in commands:
            payload: Command
            if kind == "schedule":
                payload = ScheduleTimer(tenant, call, now + timedelta(milliseconds=offset_ms))
            else:
                payload = CancelTimer(tenant, call)
            envelopes.append(
                MessageEnvelope(
                    id=EnvelopeId.generate(),
                    payload=payload,
                    timestamp_ms=to_epoch_ms(now),
                    correlation_id=correlation,
                )
            )
        try:
            outcomes = self.run(handle_commands(self.storage, envelopes, self.clock))
        except StoreError:
            assert self.store_down
        else:
            assert not self.store_down
            for envelope, outcome in zip(envelopes, outcomes, strict=True):
                self.apply_to_model(envelope, outcome, racing=racing)
        self.settle()

    @rule(
        ms=st.integers(1, 8_000),
        commands=st.lists(schedule_commands | cancel_commands, min_size=1, max_size=3),
        yields=st.integers(0, 6),
    )
    def send_commands_during_a_pass(
        self, ms: int, commands: list[tuple[str, TenantId, ServiceCallId, int, Any]], yields: int
    ) -> None:
        """Wake the worker and send commands while its pass is in flight (between find and mark)."""
        self.clock.advance(timedelta(milliseconds=ms))

        async def part_way() -> None:
            for _ in range(yields):
                await asyncio.sleep(0)

        self.run(part_way())
        self.send_commands(commands, racing=True)

    def apply_to_model(
        self, envelope: MessageEnvelope[Command], outcome: CommandOutcome, *, racing: bool
    ) -> None:
        """Check one command's outcome against the model, then update the model.

        ``racing``: the worker's pass was in flight, so it may have marked the timer Reached
        just before this command; the invariants then check that it really was published.
        """
        command = envelope.payload
        key = (command.tenant_id, command.service_call_id)
        current = self.model.get(key)
        lost_race = outcome in (CommandOutcome.IGNORED_REACHED, CommandOutcome.CANCEL_NOOP)
        if racing and lost_race and current is not None and not current.reached:
            count_event("a command raced a firing and lost")
            current.reached = True
        if isinstance(command, ScheduleTimer):
            if current is not None and current.reached:
                assert outcome is CommandOutcome.IGNORED_REACHED
                count_event("outcome ignored_reached")
                return
            assert outcome is CommandOutcome.SCHEDULED
            self.model[key] = ModelTimer(command.due_at, envelope.correlation_id)
            self.ever_scheduled.add((key, command.due_at, envelope.correlation_id))
        elif current is not None and not current.reached:
            assert outcome is CommandOutcome.CANCELLED
            del self.model[key]
        else:
            assert outcome is CommandOutcome.CANCEL_NOOP
        count_event(f"outcome {outcome.value}")

    @rule(ms=st.integers(1, 8_000))
    def advance(self, ms: int) -> None:
        """Let time pass."""
        self.clock.advance(timedelta(milliseconds=ms))
        self.settle()

    @rule()
    def poll(self) -> None:
        """Advance exactly to the worker's next wake-up, so it makes its next pass."""
        self.settle()  # what the last rule set going (an outcome, a mark) is in first
        (wait,) = self.clock.pending_sleeps()
        self.clock.advance(wait)
        self.settle()

    @rule(
        failure=st.sampled_from(
            [
                "refuse next publishes",
                "refuse a tenant",
                "broker down",
                "lose next mark",
                "store down",
            ]
        ),
        tenant=st.sampled_from(TENANTS),
        count=st.integers(1, 5),
    )
    def inject_failure(self, failure: str, tenant: TenantId, count: int) -> None:
        """Make the broker refuse events or the store fail, as real ones do."""
        if failure == "refuse next publishes":
            self.bus.fail_next(count)
        elif failure == "refuse a tenant":
            self.bus.fail_when(lambda e: e.tenant_id == tenant)
        elif failure == "broker down":
            self.bus.set_unavailable(True)
        elif failure == "lose next mark":
            # As far as data goes, a crash between publish and mark.
            self.storage.fail_next(1, methods=["mark_reached"])
        else:
            self.storage.set_unavailable(True)
            self.store_down = True

    @rule()
    def heal(self) -> None:
        """The broker accepts everything again and the store is back."""
        self.bus.fail_next(0)
        self.bus.fail_when(None)
        self.bus.set_unavailable(False)
        self.storage.fail_next(0)
        self.storage.set_unavailable(False)
        self.store_down = False

    @rule()
    def restart(self) -> None:
        """Stop the worker (it finishes its pass) and start a new one over the same store."""
        self.worker.stop()
        self.run(asyncio.wait_for(self.task, 5))
        self.worker, self.task = self.start_worker()
        self.restarts += 1
        self.settle()

    @rule()
    def drain(self) -> None:
        """Heal everything and let time run until nothing is due: every due timer has fired."""
        self.heal()
        for _ in range(100):
            if not self.run(self.storage.find_due(self.clock.now(), 1)):
                break
            self.settle()
            (wait,) = self.clock.pending_sleeps()
            self.clock.advance(wait)
            self.settle()
        else:
            raise AssertionError("the worker did not drain the due timers")
        now = self.clock.now()
        fired = {
            (e.tenant_id, e.payload.service_call_id, e.payload.due_at) for e in self.bus.published
        }
        for key, model in self.model.items():
            if model.due_at <= now:
                assert model.reached, f"{key} was due at {model.due_at} but not fired by {now}"
                assert (*key, model.due_at) in fired

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def store_matches_the_model(self) -> None:
        """The store holds exactly the model's timers, with their due times and correlations."""
        stored = {e.key: e for e in self.storage.entries()}
        assert set(stored) == set(self.model)
        for key, model in self.model.items():
            entry = stored[key]
            assert entry.due_at == model.due_at
            assert entry.correlation_id == model.correlation_id
            assert (entry.state is TimerState.REACHED) == model.reached
        fired = {
            (e.tenant_id, e.payload.service_call_id, e.payload.due_at) for e in self.bus.published
        }
        for key, model in self.model.items():
            if model.reached:
                assert (*key, model.due_at) in fired, f"{key} is Reached but was never published"

    @invariant()
    def no_event_before_its_due_time(self) -> None:
        """Every event offered to the broker was fired at or after its due time, and by now."""
        now = self.clock.now()
        for event in self.bus.publish_attempts:
            assert event.payload.due_at <= event.payload.reached_at <= now

    @invariant()
    def events_match_what_was_scheduled(self) -> None:
        """Each event is for a due time and correlation that a ScheduleTimer asked for."""
        for event in self.bus.published:
            key = (event.tenant_id, event.payload.service_call_id)
            assert (key, event.payload.due_at, event.correlation_id) in self.ever_scheduled
            assert event.aggregate_id == event.payload.service_call_id
            assert event.causation_id is None

    @invariant()
    def reached_timers_are_never_rearmed(self) -> None:
        """A timer once Reached keeps its due time and reached_at for ever."""
        stored = {e.key: e for e in self.storage.entries()}
        for key, entry in self.frozen.items():
            assert stored[key] == entry

    @invariant()
    def each_firing_has_one_id_and_is_held_once(self) -> None:
        """Every publish of one firing carries the same id; the broker holds each firing once."""
        ids: dict[Firing, EnvelopeId] = {}
        for event in self.bus.publish_attempts:
            firing = (event.tenant_id, event.payload.service_call_id, event.payload.due_at)
            assert ids.setdefault(firing, event.id) == event.id
        assert len(set(ids.values())) == len(ids)
        held = [
            (e.tenant_id, e.payload.service_call_id, e.payload.due_at) for e in self.bus.published
        ]
        assert len(held) == len(set(held))

    @invariant()
    def tenants_never_see_each_other(self) -> None:
        """Every per-tenant query returns only that tenant's timers, exactly the model's."""
        if self.store_down:
            return
        store = self.storage
        now = self.clock.now()

        async def views(tenant: TenantId) -> tuple[list[Key], set[Key], list[set[Key]]]:
            listed = await store.list_for_tenant(tenant)
            due = await store.find_due_for_tenant(tenant, now, 100)
            by_correlation = [await store.find_by_correlation(tenant, c) for c in CORRELATIONS]
            return (
                [e.key for e in listed],
                {e.key for e in due},
                [{e.key for e in found} for found in by_correlation],
            )

        async def all_views() -> list[tuple[list[Key], set[Key], list[set[Key]]]]:
            return [await views(tenant) for tenant in TENANTS]

        for tenant, (listed, due, correlated) in zip(TENANTS, self.run(all_views()), strict=True):
            mine = {k: m for k, m in self.model.items() if k[0] == tenant}
            assert listed == sorted(mine)
            assert due == {k for k, m in mine.items() if not m.reached and m.due_at <= now}
            for correlation, found in zip(CORRELATIONS, correlated, strict=True):
                assert found == {k for k, m in mine.items() if m.correlation_id == correlation}

    def teardown(self) -> None:
        self.worker.stop()
        try:
            self.run(asyncio.wait_for(self.task, 5))
        finally:
            self.loop.close()


TimerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class TestTimerStateMachine(TimerMachine.TestCase):  # type: ignore[name-defined,misc]
    """The timer keeps its promises under any sequence of commands, time, failures, restarts."""
