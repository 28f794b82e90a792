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


def lateness(events: list[Event]) -> list[float]:
    """Seconds from each event's due time to when it was handed to the handler."""
    return [(e.payload.reached_at - e.payload.due_at).total_seconds() for e in events]


async def wait_for(condition: object, budget: float, what: str) -> None:
    """Poll ``condition()`` every 10 ms until true, failing after ``budget`` seconds."""
    deadline = time.monotonic() + budget
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)


class TestIsolation:
    async def test_a_failing_handler_delays_no_other_timer_by_more_than_50_ms(
        self, tmp_path: Path
    ) -> None:
        """One timer failing over and over (every 10 ms) leaves the others on time."""
        handled: list[Event] = []

        async def handler(event: Event) -> None:
            if event.payload.service_call_id == "poison":
                raise RuntimeError("always fails")
            handled.append(event)

        settings = HandlerSettings(retry_delay_s=0.01, max_retry_delay_s=0.01, max_attempts=1000)
        store = SqliteTimerStore(tmp_path / "t.db")
        async with Timer(store, handler=handler, handler_settings=settings) as timer:
            now = datetime.now(UTC)
            await timer.schedule("shop-1", "poison", now)
            for n in range(1, 5):
                await timer.schedule("shop-1", f"order-{n}", now + timedelta(seconds=0.3 * n))
            await wait_for(lambda: len(handled) == 4, 20, "the four healthy timers")
        assert max(lateness(handled)) < 0.05, lateness(handled)

    async def test_an_always_failing_handler_ends_quarantined_after_the_set_attempts(
        self, tmp_path: Path
    ) -> None:
        """After max_attempts failures the timer is quarantined with the handler's error and
        stays Scheduled in the file."""
        calls = 0

        async def handler(event: Event) -> None:
            nonlocal calls
            calls += 1
            raise ValueError("the payment service refused")

        settings = HandlerSettings(max_attempts=4, retry_delay_s=0.01)
        store = SqliteTimerStore(tmp_path / "t.db")
        async with Timer(store, handler=handler, handler_settings=settings) as timer:
            await timer.schedule("shop-1", "order-1", datetime.now(UTC))
            await wait_for(lambda: timer.quarantined, 20, "the quarantine")
            await asyncio.sleep(0.2)  # ten retry delays: no fifth call
            (quarantined,) = timer.quarantined
            stored = await timer.get("shop-1", "order-1")
        assert calls == 4 and quarantined.failures == 4
        assert "ValueError: the payment service refused" in quarantined.error
        assert stored is not None and stored.state is TimerState.SCHEDULED

    async def test_a_ten_second_handler_does_not_stop_others_firing_on_time(
        self, tmp_path: Path
    ) -> None:
        """While one call takes 10 s, the others are handed out on time; on close the slow one
        is cancelled after the grace period and stays Scheduled."""
        handled: list[Event] = []
        slow_started = asyncio.Event()

        async def handler(event: Event) -> None:
            if event.payload.service_call_id == "slow":
                slow_started.set()
                await asyncio.sleep(10)
            handled.append(event)

        settings = HandlerSettings(shutdown_grace_s=0.1)
        store = SqliteTimerStore(tmp_path / "t.db")
        async with Timer(store, handler=handler, handler_settings=settings) as timer:
            now = datetime.now(UTC)
            await timer.schedule("shop-1", "slow", now)
            for n in range(1, 4):
                await timer.schedule("shop-1", f"order-{n}", now + timedelta(seconds=0.3 * n))
            await asyncio.wait_for(slow_started.wait(), 10)
            await wait_for(lambda: len(handled) == 3, 20, "the three others")
        assert max(lateness(handled)) < 0.05, lateness(handled)
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
