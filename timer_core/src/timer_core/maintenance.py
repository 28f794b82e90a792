"""Maintenance the worker runs in its idle time: retention of fired timers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from timer_core.errors import StoreError
from timer_core.instrumentation import NO_INSTRUMENTATION, Instrumentation
from timer_core.ports import Clock, TimerStore

__all__ = ["COMMANDS_QUIET_S", "Retention"]

log = logging.getLogger(__name__)


#: While a purge is unfinished, a worker too busy to be idle still deletes one batch at a
#: time when it would purge, so that retention keeps up with a steady stream of firings, but
#: such batches take at most this share of its time. A fired timer costs about as much to
#: delete as to fire on a large table (0.08 ms a row on PostgreSQL at 10,000,000 rows, the
#: expired rows on pages all over the table); a SQLite batch's time also counts the marks
#: and commands the writer runs between its slices. At a quarter, a SQLite service at
#: 10,000,000 rows purged 1.6-2.3 times its fire rate, short of the 2.5 it owed; at half,
#: what it owes (:data:`OWED_PER_FIRED`) is the bound.
FORCED_SHARE = 0.5

#: A busy worker told how many timers it fired (``purge(fired=...)``) deletes no more in
#: its busy time than this many expired timers for each one it fired since: enough to keep
#: up with the timers that expire (those fired a retention period ago, about as many) and to
#: work off a backlog of them, without deleting far faster than needed. Each deletion dirties
#: pages and leaves a dead row for the database to clean up, and on a large table that work
#: slows every statement beside it (purging 15 times the fire rate took a PostgreSQL
#: service's lateness p99 from 17 ms to 250 ms at 1,000 timers a second; on SQLite at
#: 10,000,000 rows, 1,000 timers a second, the p99 was 4 ms without a purge, 9-13 ms purging
#: about twice the fire rate, 14-32 ms at 2.5 times (depending on the file) and 20-35 ms at
#: 3 times).
OWED_PER_FIRED = 2.5

#: What a busy worker may owe at most, in batches of ``batch``: one that could not purge for
#: a while (a purge finished and waiting for the next, a slow database) does not make up for
#: it in a burst.
OWED_MOST_BATCHES = 4

#: With ``fired`` given, a worker whose next timer is due at least this far ahead (or none)
#: is idle: it purges as much as that time holds. In the gaps of a steady stream (a timer due
#: every few milliseconds) it deletes only what it owes for what it fired.
IDLE_S = 1.0

#: Retention's idle purge gives way to commands as it does to firing: it does not start a
#: batch beyond what it owes while the last batch of commands was stored less than this
#: long ago (seconds), and goes on in the next idle moment. A storm of new timers then
#: takes the store's whole writing time (on SQLite one writer serves both; at 10,000,000
#: rows with a backlog of expired ones the purge cost a storm of 20,000 new timers a sixth
#: of its rate on PostgreSQL). A busy worker still deletes what it owes for what it fired.
COMMANDS_QUIET_S = 0.25


class CommandsStored:
    """What a worker knows of the commands stored beside it: when the last batch was, for
    retention to give way to them (:data:`COMMANDS_QUIET_S`), and how many cancellations
    so far (their tombstones expire as fired timers do)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.last_at: float | None = None
        """Monotonic time the last batch was stored; None before the first."""
        self.cancelled = 0
        """Cancellations stored so far."""

    def stored(self, *, cancelled: int = 0) -> None:
        """A batch of commands was just stored, ``cancelled`` of them cancellations."""
        self.last_at = self._clock.monotonic()
        self.cancelled += cancelled

    def busy(self) -> bool:
        """Whether a batch was stored less than :data:`COMMANDS_QUIET_S` ago."""
        last = self.last_at
        return last is not None and self._clock.monotonic() - last < COMMANDS_QUIET_S


#: How long one batch should take (seconds): firing waits for a batch under way, so the
#: batch shrinks (down to one timer) when a batch takes longer, and grows back (up to
#: ``batch``) when one takes less than half of it.
BATCH_BUDGET = 0.01


class Retention:
    """Deletes ``Reached`` timers fired longer ago than ``keep`` (and cancel tombstones as
    old), at most ``batch`` at a time, at most every ``every`` seconds."""

    def __init__(
        self,
        store: TimerStore,
        clock: Clock,
        *,
        keep: timedelta,
        batch: int,
        every: float,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
    ) -> None:
        self._store = store
        self._instrumentation = instrumentation
        self._clock = clock
        self.keep = keep
        self.batch = batch
        self.every = every
        self._next_at: float | None = None
        self._forced_at = 0.0
        self._size = batch
        self._took = 0.0
        self._fired: int | None = None  # the worker's count of fired timers at the last call
        self._owed = 0.0  # deletions a busy worker's purge may still make (with ``fired``)

    @property
    def size(self) -> int:
        """How many timers the next batch deletes at most: ``batch``, or fewer while a batch
        of that many took longer than :data:`BATCH_BUDGET`."""
        return self._size

    async def purge(
        self,
        next_due: datetime | None,
        interrupted: Callable[[], bool],
        *,
        fired: int | None = None,
        commands: Callable[[], bool] | None = None,
    ) -> None:
        """Purge what is past retention, in idle time.

        Purging stops as soon as ``interrupted()`` says so (a new timer scheduled, a stop:
        firing comes first) or the next batch, taking as long as the last one did, would
        run past ``next_due``, and goes on at the next idle moment; a batch takes about
        :data:`BATCH_BUDGET`, so a large first purge never holds firings back for long. A
        worker that is never idle long (timers coming due all the time) still deletes one
        batch per call while the purge is unfinished, at most :data:`FORCED_SHARE` of the
        time: otherwise fired timers would pile up for as long as the stream lasts. With
        ``fired`` (how many timers the worker has fired so far, a running count), such a
        batch, and any batch while the next timer is due within :data:`IDLE_S`, also waits
        until the worker fired enough timers since to owe it: at most
        :data:`OWED_PER_FIRED` deletions for each. While ``commands()`` says commands are
        being stored, no batch starts beyond those: what is owed (with ``fired``) and the
        forced one (without).
        """
        clock = self._clock
        if fired is not None:
            if self._fired is not None:
                owed = self._owed + OWED_PER_FIRED * max(0, fired - self._fired)
                self._owed = min(owed, OWED_MOST_BATCHES * self.batch)
            self._fired = fired
        if self._next_at is not None and clock.monotonic() < self._next_at:
            return
        cutoff = clock.now() - self.keep
        deleted = 0
        finished = False
        forced = clock.monotonic() >= self._forced_at and (
            fired is None or self._owed >= self._size
        )
        try:
            while forced or not interrupted():
                last = timedelta(seconds=self._took)
                if not forced:
                    if next_due is not None and clock.now() + last >= next_due:
                        break
                    owes = fired is not None and self._owed >= self._size
                    if fired is not None and not owes and _soon(next_due, clock):
                        break
                    if not owes and commands is not None and commands():
                        break  # commands come first; what is owed is still deleted
                size = self._size
                started = clock.monotonic()
                batch = await self._store.purge_reached(cutoff, size)
                took = clock.monotonic() - started
                self._took = took
                self._size = _resized(size, took, self.batch)
                if forced:
                    forced = False
                    self._forced_at = clock.monotonic() + took * (1 / FORCED_SHARE - 1)
                self._owed = max(0, self._owed - batch)
                deleted += batch
                if batch:
                    self._instrumentation.timers_purged(batch)
                if batch < size:
                    finished = True
                    break
                await asyncio.sleep(0)
        except StoreError as exc:
            log.warning("retention purge failed (%s); trying again later", exc)
            finished = True
        if finished:
            self._next_at = clock.monotonic() + self.every
            self._owed = 0  # nothing left to owe: what expires meanwhile waits for the next
        if deleted:
            log.info("retention: deleted %d timers fired before %s", deleted, cutoff)


def _soon(next_due: datetime | None, clock: Clock) -> bool:
    """Whether a timer is due within :data:`IDLE_S` (the worker is not idle)."""
    return next_due is not None and next_due - clock.now() < timedelta(seconds=IDLE_S)


def _resized(size: int, took: float, most: int) -> int:
    """The next batch's size after one of ``size`` took ``took`` seconds."""
    if took > BATCH_BUDGET:
        return max(1, int(size * BATCH_BUDGET / took))
    if took < BATCH_BUDGET / 2:
        return min(most, size * 2)
    return size
