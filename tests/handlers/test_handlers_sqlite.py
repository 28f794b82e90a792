"""The handler path on a real SQLite file: isolation, quarantine, slow calls, and a host killed
mid-call (issue 27's "done when")."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from timer_adapters_memory import FakeClock
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import (
    DueTimeReached,
    HandlerSettings,
    MessageEnvelope,
    Timer,
    TimerEntry,
    TimerState,
)

Event = MessageEnvelope[DueTimeReached]
HOST = Path(__file__).with_name("host.py")
ROOT = Path(__file__).resolve().parents[2]


T0 = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
STEP = 0.01


def lateness(events: list[Event]) -> list[float]:
    """Seconds from each event's due time to when it was handed to the handler, by the
    Timer's own clock (``reachedAt`` is its reading when the pass found the timer due)."""
    return [(e.payload.reached_at - e.payload.due_at).total_seconds() for e in events]


async def wait_for(condition: object, budget: float, what: str) -> None:
    """Poll ``condition()`` every 10 ms until true, failing after ``budget`` seconds."""
    deadline = time.monotonic() + budget
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)


async def run_clock(timer: Timer, clock: FakeClock, until: datetime) -> None:
    """Move the Timer's clock to ``until`` in 10 ms steps, letting the worker finish what
    each step made due before the next (real time does not count: a busy machine only
    makes each step take longer)."""
    while clock.now() < until:
        clock.advance(STEP)
        await timer.wait_until_idle(timeout=60)


class TestIsolation:
    async def test_a_failing_handler_delays_no_other_timer_by_more_than_50_ms(
        self, tmp_path: Path
    ) -> None:
        """One timer failing over and over (every 10 ms of the Timer's clock) leaves the
        others handed out at their due time."""
        handled: list[Event] = []
        poison_calls: list[datetime] = []

        async def handler(event: Event) -> None:
            if event.payload.service_call_id == "poison":
                poison_calls.append(event.payload.reached_at)
                raise RuntimeError("always fails")
            handled.append(event)

        settings = HandlerSettings(retry_delay_s=0.01, max_retry_delay_s=0.01, max_attempts=1000)
        clock = FakeClock(T0)
        store = SqliteTimerStore(tmp_path / "t.db")
        async with Timer(store, handler=handler, handler_settings=settings, clock=clock) as timer:
            await timer.schedule("shop-1", "poison", T0)
            for n in range(1, 5):
                await timer.schedule("shop-1", f"order-{n}", T0 + timedelta(seconds=0.3 * n))
            await run_clock(timer, clock, T0 + timedelta(seconds=1.3))
        assert [e.payload.service_call_id for e in handled] == [f"order-{n}" for n in range(1, 5)]
        assert max(lateness(handled)) < 0.05, lateness(handled)
        # It kept failing all along, every step or two, before and after each of the others.
        assert len(poison_calls) > 60 and poison_calls[-1] > handled[-1].payload.reached_at

    async def test_an_always_failing_handler_ends_quarantined_after_the_set_attempts(
        self, tmp_path: Path
    ) -> None:
        """After max_attempts failures the timer is quarantined with the handler's error, is
        not called again, and stays Scheduled in the file."""
        calls = 0

        async def handler(event: Event) -> None:
            nonlocal calls
            calls += 1
            raise ValueError("the payment service refused")

        settings = HandlerSettings(max_attempts=4, retry_delay_s=0.01)
        clock = FakeClock(T0)
        store = SqliteTimerStore(tmp_path / "t.db")
        async with Timer(store, handler=handler, handler_settings=settings, clock=clock) as timer:
            await timer.schedule("shop-1", "order-1", T0)
            # Four attempts back off 10, 20 and 40 ms (less jitter): quarantined within 0.1 s;
            # then a whole second more of the Timer's clock brings no fifth call.
            await run_clock(timer, clock, T0 + timedelta(seconds=0.1))
            assert len(timer.quarantined) == 1
            await run_clock(timer, clock, T0 + timedelta(seconds=1.1))
            (quarantined,) = timer.quarantined
            stored = await timer.get("shop-1", "order-1")
        assert calls == 4 and quarantined.failures == 4
        assert "ValueError: the payment service refused" in quarantined.error
        assert stored is not None and stored.state is TimerState.SCHEDULED

    async def test_a_ten_second_handler_does_not_stop_others_firing_on_time(
        self, tmp_path: Path
    ) -> None:
        """While one call takes 10 s of the Timer's clock, each other timer is handed out the
        moment it is due; on close the slow one is cancelled after the grace period and
        stays Scheduled."""
        handled: list[Event] = []
        called = asyncio.Event()
        clock = FakeClock(T0)

        async def handler(event: Event) -> None:
            called.set()
            if event.payload.service_call_id == "slow":
                await clock.sleep(10)
            handled.append(event)

        settings = HandlerSettings(shutdown_grace_s=0.1)
        store = SqliteTimerStore(tmp_path / "t.db")
        async with Timer(store, handler=handler, handler_settings=settings, clock=clock) as timer:
            await timer.schedule("shop-1", "slow", T0)
            await asyncio.wait_for(called.wait(), 60)
            for n in range(1, 4):
                due = T0 + timedelta(seconds=0.3 * n)
                await timer.schedule("shop-1", f"order-{n}", due)
                called.clear()
                clock.advance(due - clock.now())  # the clock stands still at the due time
                await asyncio.wait_for(called.wait(), 60)
            await wait_for(lambda: len(handled) == 3, 60, "the three others")
        # reachedAt is the clock's reading when a pass found each due: it never moved past
        # the due time, so each was handed out by the pass the due time woke.
        assert lateness(handled) == [0.0, 0.0, 0.0]
        assert clock.now() < T0 + timedelta(seconds=10)  # the slow call was still running
        async with SqliteTimerStore(tmp_path / "t.db") as reopened:
            slow = await reopened.get("shop-1", "slow")
        assert slow is not None and slow.state is TimerState.SCHEDULED


class TestCrash:
    async def test_a_host_killed_mid_handler_redelivers_after_restart(self, tmp_path: Path) -> None:
        """SIGKILL while a call runs: after the restart that timer is handled again, and every
        timer ends Reached (nothing lost)."""
        db, log = tmp_path / "t.db", tmp_path / "calls.log"
        now = datetime.now(UTC)
        calls = [f"order-{n}" for n in range(20)]
        async with SqliteTimerStore(db) as store:
            await store.apply([TimerEntry("shop-1", call, now, now) for call in calls])

        def lines() -> list[str]:
            return log.read_text().splitlines() if log.exists() else []

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        first = await asyncio.create_subprocess_exec(
            sys.executable, str(HOST), str(db), str(log), "order-7", env=env
        )
        try:
            await wait_for(
                lambda: (
                    "started order-7" in lines()
                    and sum(line.startswith("done") for line in lines()) == 19
                ),
                60,
                "the first host to handle all but order-7",
            )
        finally:
            first.send_signal(signal.SIGKILL)
            await first.wait()
        assert "done order-7" not in lines()
        second = await asyncio.create_subprocess_exec(
            sys.executable, str(HOST), str(db), str(log), "none", env=env
        )
        try:
            await wait_for(lambda: "done order-7" in lines(), 60, "order-7 after the restart")
            async with SqliteTimerStore(db) as store:

                async def all_reached() -> bool:
                    entries = [await store.get("shop-1", call) for call in calls]
                    return all(e is not None and e.state is TimerState.REACHED for e in entries)

                deadline = time.monotonic() + 20
                while not await all_reached():
                    assert time.monotonic() < deadline, "not every timer was marked Reached"
                    await asyncio.sleep(0.05)
        finally:
            second.send_signal(signal.SIGKILL)
            await second.wait()
        started = [line.split()[1] for line in lines() if line.startswith("started")]
        assert set(started) == set(calls)
        assert started.count("order-7") == 2
