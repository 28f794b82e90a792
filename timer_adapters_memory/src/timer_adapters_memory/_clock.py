"""A clock the test moves by hand, so time-driven code is tested without real waiting."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

from timer_adapters_memory._waits import DEFAULT_TIMEOUT_S, within
from timer_core.instants import require_utc

__all__ = ["FakeClock"]

#: Where a :class:`FakeClock` starts unless told otherwise: a fixed instant, so tests are
#: reproducible.
DEFAULT_START = datetime(2025, 1, 1, tzinfo=UTC)


class FakeClock:
    """A :class:`~timer_core.ports.Clock` whose wall and monotonic time move only when told.

    ``sleep`` returns once :meth:`advance` has moved the monotonic time past its deadline;
    :meth:`set_wall` jumps the wall clock alone, like NTP or an operator would.
    :meth:`wait_for_sleepers` lets a test wait until the code under test is asleep, so tests
    synchronise on events instead of real sleeps. Time is kept in whole microseconds, so
    advancing by exactly the duration something sleeps always wakes it.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._lock = threading.Lock()
        self._wall = require_utc(start if start is not None else DEFAULT_START, "start")
        self._mono_us = 0
        self._order = itertools.count()
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._watchers: list[tuple[int, asyncio.Future[None]]] = []

    def now(self) -> datetime:
        """The fake wall clock (aware UTC)."""
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        """The fake monotonic clock, in seconds since the clock was made."""
        with self._lock:
            return self._mono_us / 1_000_000

    def sleep(self, seconds: float) -> Coroutine[Any, Any, None]:
        """Return once the monotonic clock has been advanced by ``seconds`` from the call.

        From the call, not from the first step of the coroutine: a sleep handed to a task
        (``asyncio.ensure_future(clock.sleep(5))``) ends five fake seconds after it was asked
        for, even when the clock is advanced before the task first runs (as it can be once a
        wait returns ahead of that task, which Python 3.12 and later do more often).
        """
        micros = _micros(seconds)
        with self._lock:
            deadline = self._mono_us + micros
        return self._sleep_until(deadline)

    async def _sleep_until(self, deadline: int) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            passed = deadline <= self._mono_us  # advanced that far since the call already
            item = (deadline, next(self._order), future)
            if not passed:
                heapq.heappush(self._sleepers, item)
                self._notify_watchers()
        if passed:
            await asyncio.sleep(0)
            return
        try:
            await future
        finally:
            with self._lock:
                if item in self._sleepers:
                    self._sleepers.remove(item)
                    heapq.heapify(self._sleepers)

    def advance(self, seconds: float | timedelta) -> None:
        """Move both clocks forward and wake every sleeper whose deadline has passed."""
        micros = _micros(seconds.total_seconds() if isinstance(seconds, timedelta) else seconds)
        if micros < 0:
            raise ValueError("a clock cannot be advanced backwards; use set_wall to jump")
        with self._lock:
            self._mono_us += micros
            self._wall += timedelta(microseconds=micros)
            woken = []
            while self._sleepers and self._sleepers[0][0] <= self._mono_us:
                woken.append(heapq.heappop(self._sleepers)[2])
            self._notify_watchers()
        for future in woken:
            _resolve(future)

    def set_wall(self, value: datetime) -> None:
        """Jump the wall clock to ``value`` (either way) without moving monotonic time."""
        value = require_utc(value, "wall clock")
        with self._lock:
            self._wall = value

    @property
    def sleepers(self) -> int:
        """How many ``sleep`` calls are waiting."""
        with self._lock:
            return len(self._sleepers)

    def pending_sleeps(self) -> list[float]:
        """The seconds each waiting ``sleep`` still has to go, shortest first."""
        with self._lock:
            return sorted((d - self._mono_us) / 1_000_000 for d, _, _ in self._sleepers)

    async def wait_for_sleepers(
        self, count: int = 1, *, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> None:
        """Return once at least ``count`` ``sleep`` calls are waiting.

        Raises :class:`~timer_core.errors.WaitTimedOut` after ``timeout`` real seconds (None:
        wait forever), saying how many were asleep: the code under test is then not running,
        or waits on something else than this clock.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watcher = (count, future)
        with self._lock:
            if len(self._sleepers) >= count:
                return
            self._watchers.append(watcher)
        try:
            await within(future, timeout, lambda: self._sleepers_seen(count))
        finally:
            with self._lock:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)

    def _sleepers_seen(self, count: int) -> str:
        return (
            f"waited for {count} sleep call(s) on the FakeClock, {self.sleepers} waiting: is "
            "the code under test started, and does it sleep on this clock (not another one, "
            "not asyncio.sleep)?"
        )

    def describe_sleepers(self) -> str:
        """One line on who is asleep on this clock, for a failing test's message."""
        pending = self.pending_sleeps()
        if not pending:
            return "nothing sleeps on the FakeClock"
        return (
            f"{len(pending)} sleep(s) on the FakeClock, the nearest ends in {pending[0]:g} s "
            f"of fake time: did the test forget clock.advance({pending[0]:g})?"
        )

    def _notify_watchers(self) -> None:
        """Resolve the watchers whose count is met; called with the lock held."""
        met = [w for w in self._watchers if len(self._sleepers) >= w[0]]
        for watcher in met:
            self._watchers.remove(watcher)
            _resolve(watcher[1])


def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _resolve(future: asyncio.Future[None]) -> None:
    """Complete ``future`` from any thread, on its own loop."""
    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        if not future.done():
            future.set_result(None)
    else:
        loop.call_soon_threadsafe(_set_if_pending, future)


def _set_if_pending(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
