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


#: While a purge is unfinished, a worker too busy to be idle still deletes one batch at a
#: time when it would purge, so that retention keeps up with a steady stream of firings, but
#: such batches take at most this share of its time.
FORCED_SHARE = 0.1


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
        self._forced_at = 0.0

    async def purge(self, next_due: datetime | None, interrupted: Callable[[], bool]) -> None:
        """Purge what is past retention, in idle time.

        Purging stops as soon as a timer is due (``next_due``) or ``interrupted()`` says so
        (a new timer scheduled, a stop: firing comes first) and goes on at the next idle
        moment, so a large first purge never holds firings back for more than a batch. A
        worker that is never idle long (timers coming due all the time) still deletes one
        batch per call while the purge is unfinished, at most :data:`FORCED_SHARE` of the
        time: otherwise fired timers would pile up for as long as the stream lasts.
        """
        clock = self._clock
        if self._next_at is not None and clock.monotonic() < self._next_at:
            return
        cutoff = clock.now() - self.keep
        deleted = 0
        finished = False
        forced = clock.monotonic() >= self._forced_at
        try:
            while forced or not interrupted():
                if not forced and next_due is not None and clock.now() >= next_due:
                    break
                started = clock.monotonic()
                batch = await self._store.purge_reached(cutoff, self.batch)
                if forced:
                    forced = False
                    took = clock.monotonic() - started
                    self._forced_at = clock.monotonic() + took * (1 / FORCED_SHARE - 1)
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
