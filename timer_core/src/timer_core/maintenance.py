"""Maintenance the worker runs in its idle time: retention of fired timers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from timer_core.errors import StoreError
from timer_core.ports import Clock, TimerStore

__all__ = ["Retention"]

log = logging.getLogger(__name__)


class Retention:
    """Deletes ``Reached`` timers fired longer ago than ``keep`` (and cancel tombstones as
    old), ``batch`` at a time, at most every ``every`` seconds."""

    def __init__(
        self, store: TimerStore, clock: Clock, *, keep: timedelta, batch: int, every: float
    ) -> None:
        self._store = store
        self._clock = clock
        self.keep = keep
        self.batch = batch
        self.every = every
        self._next_at: float | None = None

    async def purge(self, next_due: datetime | None, interrupted: Callable[[], bool]) -> None:
        """Purge what is past retention, in idle time only.

        Purging stops as soon as a timer is due (``next_due``) or ``interrupted()`` says so
        (a new timer scheduled, a stop: firing always comes first) and goes on at the next
        idle moment, so a large first purge never holds firings back.
        """
        clock = self._clock
        if self._next_at is not None and clock.monotonic() < self._next_at:
            return
        cutoff = clock.now() - self.keep
        deleted = 0
        finished = False
        try:
            while not interrupted():
                if next_due is not None and clock.now() >= next_due:
                    break
                batch = await self._store.purge_reached(cutoff, self.batch)
                deleted += batch
                if batch < self.batch:
                    finished = True
                    break
                await asyncio.sleep(0)
        except StoreError as exc:
            log.warning("retention purge failed (%s); trying again later", exc)
            finished = True
        if finished:
            self._next_at = clock.monotonic() + self.every
        if deleted:
            log.info("retention: deleted %d timers fired before %s", deleted, cutoff)
