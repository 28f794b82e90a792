"""The isolation suite: one timer's or one tenant's trouble stays its own, on every way out.

Run against a real store (and the real clock), through the public ``Timer``: a handler that
returns a coroutine, settings of the wrong type, threaded calls that time out, a storm of
one tenant beside a quiet one, a publish that is never acknowledged, a timer held back whose
claim must go back, and a quarantine that health shows.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest

from timer_core._entry import TimerEntry, TimerState
from timer_core._ids import ServiceCallId, TenantId
from timer_core._messages import DueTimeReached, MessageEnvelope
from timer_core._runtime import Timer
from timer_core.errors import ConfigurationError, PublishError, StoreInUse
from timer_core.handlers import HandlerSettings
from timer_core.instrumentation import Instrumentation
from timer_core.ports import EventPublisher, LeasesClaims, TimerStore

__all__ = ["LeasingIsolationContract", "TimerIsolationContract"]

Event = MessageEnvelope[DueTimeReached]
MakeStore = Callable[[], TimerStore]
#: How long a test waits for the event it means before it fails (a busy 2-core machine
#: included): generous, never slept through.
BUDGET_S = 60.0
#: How long another instance may wait for a claim given back: far less than the lease the
#: binding gives (two minutes or more), so only a release passes.
RELEASE_BUDGET_S = 10.0
#: The storm: as many timers of one tenant, each call awaiting this long.
STORM = 20_000
STORM_CALL_S = 0.01


async def _until(condition: Callable[[], bool], what: str, budget: float = BUDGET_S) -> None:
    """Wait (looking every few milliseconds) until ``condition()`` holds; fail after
    ``budget`` seconds naming ``what``."""
    deadline = time.monotonic() + budget
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {budget:g}s waiting for {what}")
        await asyncio.sleep(0.005)


async def _reached(timer: Timer, tenant: str, calls: Sequence[str]) -> None:
    """Wait until every one of ``calls`` is stored ``Reached``."""
    deadline = time.monotonic() + BUDGET_S
    for call in calls:
        while True:
            entry = await timer.get(tenant, call)
            if entry is not None and entry.state is TimerState.REACHED:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{tenant}/{call} was never marked Reached")
            await asyncio.sleep(0.01)


class _Failures(Instrumentation):
    """The timers whose delivery failed, by service call id, as metrics would count them."""

    def __init__(self) -> None:
        self.failed: Counter[str] = Counter()

    def publish_failed(self, entry: TimerEntry, error: PublishError) -> None:
        self.failed[str(entry.service_call_id)] += 1


class _UnackedPublisher(EventPublisher):
    """A broker that acknowledges every event at once, except those of ``poison``: their
    publish waits until :attr:`release` is set (a lost acknowledgement), then fails."""

    def __init__(self, poison: str) -> None:
        self.poison = poison
        self.release = asyncio.Event()
        self.published: list[Event] = []
        self.stalled = asyncio.Event()

    @property
    def keeps_call_order(self) -> bool:
        return True

    async def publish_many(self, envelopes: Sequence[Event]) -> list[PublishError | None]:
        results: list[PublishError | None] = []
        stalled = False
        for envelope in envelopes:
            if envelope.payload.service_call_id == self.poison:
                stalled = True
                results.append(PublishError(f"{envelope.id}: no ack from the broker in time"))
            else:
                self.published.append(envelope)
                results.append(None)
        if stalled:
            self.stalled.set()
            await self.release.wait()
        return results


class TimerIsolationContract:
    """The isolation promises of the ``Timer`` on a store, for every way out.

    Subclass it as a ``Test...`` class and override ``make_store``: it returns a callable
    making a new, not yet started store over fresh storage (the same storage on every call
    of one test), as the store contracts do::

        class TestSqliteIsolation(TimerIsolationContract):
            @pytest.fixture
            def make_store(self, tmp_path):
                return lambda: SqliteTimerStore(tmp_path / "timers.db")

    The tests run on the real clock (or the store's shared one) and wait for the events they
    mean, with generous budgets; none asserts a timing.
    """

    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def make_store(self) -> MakeStore:
        """The factory hook: override it to return a callable making unstarted stores."""
        raise NotImplementedError("override the make_store fixture to bind TimerIsolationContract")

    @staticmethod
    def now(timer: Timer) -> datetime:
        return timer.clock.now()

    async def test_a_handler_that_returns_a_coroutine_has_it_run(
        self, make_store: MakeStore
    ) -> None:
        """``handler=lambda event: process(event)`` with ``process`` async: the coroutine
        the lambda returns is run before the timer is marked, never dropped."""
        processed: list[str] = []
        done = asyncio.Event()

        async def process(event: Event) -> None:
            await asyncio.sleep(0)
            processed.append(str(event.payload.service_call_id))
            done.set()

        async with Timer(make_store(), handler=lambda event: process(event)) as timer:
            await timer.schedule("shop-1", "order-1", self.now(timer))
            await asyncio.wait_for(done.wait(), BUDGET_S)
            await _reached(timer, "shop-1", ["order-1"])
        assert processed == ["order-1"]

    def test_handler_settings_of_the_wrong_type_are_refused_at_once(
        self, make_store: MakeStore
    ) -> None:
        """A dict where ``HandlerSettings`` belongs is refused when the Timer is made, with
        the library's error naming the fix."""

        async def handler(event: Event) -> None:
            return None

        with pytest.raises(ConfigurationError, match=r"HandlerSettings\(\*\*\{'timeout_s': 5\}\)"):
            Timer(make_store(), handler=handler, handler_settings={"timeout_s": 5})  # type: ignore[arg-type]

    async def test_a_second_timer_on_a_running_store_object_is_refused(
        self, make_store: MakeStore
    ) -> None:
        """One store object given to two Timers would have each fire every timer: the second
        is refused at start with ``StoreInUse`` naming the fix, the first handles each timer
        once, and once it is closed a new Timer runs on the object."""
        handled: Counter[str] = Counter()
        refused_handled: list[str] = []

        async def handler(event: Event) -> None:
            handled[str(event.payload.service_call_id)] += 1

        async def refused_handler(event: Event) -> None:
            refused_handled.append(str(event.payload.service_call_id))

        calls = [f"order-{n}" for n in range(40)]
        store = make_store()
        async with Timer(store, handler=handler) as timer:
            refused = Timer(store, handler=refused_handler)
            with pytest.raises(StoreInUse, match="a store object serves one Timer at a time"):
                async with refused:
                    pytest.fail("the second Timer started")
            now = self.now(timer)
            for call in calls:
                await timer.schedule("shop-1", call, now)
            await _reached(timer, "shop-1", calls)
        assert handled == Counter(calls)  # every timer, once
        assert refused_handled == []
        async with Timer(store, handler=handler) as again:
            await again.schedule("shop-1", "after", self.now(again))
            await _reached(again, "shop-1", ["after"])
        assert handled["after"] == 1

    async def test_threaded_calls_past_their_timeout_hold_back_only_their_own_timers(
        self, make_store: MakeStore
    ) -> None:
        """Two threaded calls outlive their 0.5 s timeout in both places: the ten timers
        due meanwhile wait for a place, are never counted failed nor quarantined, and no
        timer is ever called twice at once."""
        settings = HandlerSettings(max_concurrency=2, timeout_s=0.5, retry_delay_s=0.05)
        release = threading.Event()
        lock = threading.Lock()
        running: Counter[str] = Counter()
        overlapping: list[str] = []
        handled: list[str] = []
        started = threading.Semaphore(0)

        def handler(event: Event) -> None:
            call = str(event.payload.service_call_id)
            with lock:
                running[call] += 1
                if running[call] > 1:
                    overlapping.append(call)
            try:
                if call.startswith("slow"):
                    started.release()
                    release.wait(BUDGET_S)  # far past the timeout: a thread cannot be stopped
                with lock:
                    handled.append(call)
            finally:
                with lock:
                    running[call] -= 1

        failures = _Failures()
        instant = [f"order-{n}" for n in range(10)]
        async with Timer(
            make_store(), handler=handler, handler_settings=settings, instrumentation=failures
        ) as timer:
            now = self.now(timer)
            await timer.schedule("shop-1", "slow-1", now)
            await timer.schedule("shop-1", "slow-2", now)
            for _ in range(2):
                assert await asyncio.to_thread(started.acquire, True, BUDGET_S)
            for call in instant:
                await timer.schedule("shop-2", call, now + timedelta(milliseconds=50))
            # Let the slow calls outlive their timeout (what is under test is time itself).
            await asyncio.sleep(2 * settings.timeout_s)
            release.set()
            await _until(lambda: set(instant) <= set(handled), "the ten instant timers")
            await _reached(timer, "shop-2", instant)
            quarantined = timer.quarantined
        assert overlapping == []
        assert set(failures.failed) <= {"slow-1", "slow-2"}, failures.failed
        assert quarantined == []

    @pytest.mark.parametrize("way", ["handler", "batch_handler"])
    async def test_a_storm_of_one_tenant_does_not_hold_back_a_quiet_one(
        self, make_store: MakeStore, way: str
    ) -> None:
        """20,000 timers of one tenant due together, each call awaiting 10 ms, and one timer
        of another tenant due 0.2 s later: the quiet one is handled while most of the storm
        still waits (the handler path shares what it finds among tenants), per timer and in
        batches."""
        storm_handled = 0
        quiet_at: list[int] = []
        quiet_done = asyncio.Event()

        async def handler(event: Event) -> None:
            nonlocal storm_handled
            if event.payload.tenant_id == "quiet":
                quiet_at.append(storm_handled)
                quiet_done.set()
                return
            await asyncio.sleep(STORM_CALL_S)
            storm_handled += 1

        async def batch_handler(events: Sequence[Event]) -> None:
            nonlocal storm_handled
            if any(event.payload.tenant_id == "quiet" for event in events):
                quiet_at.append(storm_handled)
                quiet_done.set()
            await asyncio.sleep(STORM_CALL_S)
            storm_handled += sum(event.payload.tenant_id == "storm" for event in events)

        store = make_store()
        async with store:
            at = store_now(store)
            await store.apply(
                [
                    TimerEntry(TenantId("storm"), ServiceCallId(f"call-{n:05d}"), at, at)
                    for n in range(STORM)
                ]
            )
            await store.apply(
                [TimerEntry(TenantId("quiet"), ServiceCallId("q"), at + timedelta(seconds=0.2), at)]
            )
        settings = HandlerSettings(shutdown_grace_s=0.1)
        way_out: dict[str, Any] = (
            {"handler": handler} if way == "handler" else {"batch_handler": batch_handler}
        )
        async with Timer(make_store(), handler_settings=settings, **way_out):
            await asyncio.wait_for(quiet_done.wait(), BUDGET_S)
        assert quiet_at and quiet_at[0] < STORM // 2, quiet_at

    async def test_an_unacknowledged_publish_holds_back_no_other_timer(
        self, make_store: MakeStore
    ) -> None:
        """One timer's publish goes unacknowledged: the timers of six other tenants, due
        over the next second, are all published while it still waits."""
        publisher = _UnackedPublisher("poison")
        others = [(f"tenant-{t}", f"call-{n}") for t in range(6) for n in range(10)]
        async with Timer(make_store(), publisher) as timer:
            now = self.now(timer)
            await timer.schedule("tenant-p", "poison", now)
            await asyncio.wait_for(publisher.stalled.wait(), BUDGET_S)
            for i, (tenant, call) in enumerate(others):
                await timer.schedule(tenant, call, now + timedelta(milliseconds=20 * i))
            try:
                await _until(
                    lambda: len(publisher.published) >= len(others),
                    "the other tenants' timers to be published",
                )
                assert not publisher.release.is_set()  # all while the poison one waited
                for tenant, call in others[:3]:
                    await _reached(timer, tenant, [call])
            finally:
                publisher.release.set()
        assert sorted(
            (str(e.payload.tenant_id), str(e.payload.service_call_id)) for e in publisher.published
        ) == sorted(others)

    async def test_health_shows_the_quarantine_and_its_oldest_age(
        self, make_store: MakeStore
    ) -> None:
        """A timer quarantined by its handler shows in ``health()``: how many, and how long
        the oldest has been held."""

        async def handler(event: Event) -> None:
            raise RuntimeError("the provider refused")

        settings = HandlerSettings(max_attempts=2, retry_delay_s=0.01)
        async with Timer(make_store(), handler=handler, handler_settings=settings) as timer:
            before = timer.health()
            await timer.schedule("shop-1", "order-1", self.now(timer))
            await _until(lambda: bool(timer.quarantined), "the quarantine")
            health = timer.health()
        assert (before.quarantined, before.oldest_quarantined_age_s) == (0, None)
        assert health.quarantined == 1
        assert health.oldest_quarantined_age_s is not None
        assert health.oldest_quarantined_age_s >= 0


class LeasingIsolationContract:
    """The isolation promises of a store several instances share
    (:class:`~timer_core.ports.LeasesClaims`): a timer held back gives its claim back.

    Override ``make_store`` to return a callable making a new, unstarted store, a distinct
    lease owner over the same storage on every call, with a lease of two minutes or more
    (so only a claim given back lets another instance take the timer).
    """

    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def make_store(self) -> MakeStore:
        """The factory hook: override it to return a callable making unstarted stores."""
        raise NotImplementedError(
            "override the make_store fixture to bind LeasingIsolationContract"
        )

    async def test_a_timer_backing_off_gives_its_claim_back(self, make_store: MakeStore) -> None:
        """A handled timer whose call failed, waiting for its retry, is not held by this
        instance's claim: another instance may take it at once."""
        failed = asyncio.Event()

        async def handler(event: Event) -> None:
            failed.set()
            raise RuntimeError("not now")

        settings = HandlerSettings(retry_delay_s=300.0, jitter=0.0)
        other = make_store()
        assert isinstance(other, LeasesClaims)
        async with other, Timer(make_store(), handler=handler, handler_settings=settings) as timer:
            now = timer.clock.now()
            await timer.schedule("shop-1", "order-1", now)
            await asyncio.wait_for(failed.wait(), BUDGET_S)
            found: list[TimerEntry] = []

            async def claimed() -> bool:
                found.extend(await other.find_due(timer.clock.now(), 10))
                return bool(found)

            deadline = time.monotonic() + RELEASE_BUDGET_S
            while not await claimed():
                assert time.monotonic() < deadline, "the claim was never given back"
                await asyncio.sleep(0.02)
        assert [str(entry.service_call_id) for entry in found] == ["order-1"]


def store_now(store: TimerStore) -> datetime:
    """The instant that decides due times for ``store`` (a shared clock's, else this
    host's), to the millisecond."""
    from timer_core._runtime import _deciding_clock  # the Timer's own choice of clock

    now = _deciding_clock(store).now()
    return now.replace(microsecond=now.microsecond // 1000 * 1000)
