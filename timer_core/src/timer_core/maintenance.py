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
#: such batches take at most this share of its time. A fired timer costs about as much to
#: delete as to fire on a large PostgreSQL table (0.08 ms a row at 10,000,000 rows, the
#: expired rows on pages all over the table): keeping up twice over with a steady stream
#: takes a sixth of the time or so.
FORCED_SHARE = 0.25

#: How long one batch should take (seconds): firing waits for a batch under way, so the
#: batch shrinks (down to one timer) when a batch takes longer, and grows back (up to
#: ``batch``) when one takes less than half of it.
BATCH_BUDGET = 0.01


class Retention:
    """Deletes ``Reached`` timers fired longer ago than ``keep`` (and cancel tombstones as
    old), at most ``batch`` at a time, at most every ``every`` seconds."""

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
        self._size = batch
        self._took = 0.0

    @property
    def size(self) -> int:
        """How many timers the next batch deletes at most: ``batch``, or fewer while a batch
        of that many took longer than :data:`BATCH_BUDGET`."""
        return self._size

    async def purge(self, next_due: datetime | None, interrupted: Callable[[], bool]) -> None:
        """Purge what is past retention, in idle time.

        Purging stops as soon as ``interrupted()`` says so (a new timer scheduled, a stop:
        firing comes first) or the next batch, taking as long as the last one did, would
        run past ``next_due``, and goes on at the next idle moment; a batch takes about
        :data:`BATCH_BUDGET`, so a large first purge never holds firings back for long. A
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
                last = timedelta(seconds=self._took)
                if not forced and next_due is not None and clock.now() + last >= next_due:
                    break
                size = self._size
                started = clock.monotonic()
                batch = await self._store.purge_reached(cutoff, size)
                took = clock.monotonic() - started
                self._took = took
                self._size = _resized(size, took, self.batch)
                if forced:
                    forced = False
                    self._forced_at = clock.monotonic() + took * (1 / FORCED_SHARE - 1)
                deleted += batch
                if batch < size:
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


def _resized(size: int, took: float, most: int) -> int:
    """The next batch's size after one of ``size`` took ``took`` seconds."""
    if took > BATCH_BUDGET:
        return max(1, int(size * BATCH_BUDGET / took))
    if took < BATCH_BUDGET / 2:
        return min(most, size * 2)
    return size
