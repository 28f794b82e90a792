"""The worker: an asyncio loop that fires due timers, waking on the earliest due time.

It sleeps until the next timer is due, never longer than the polling interval (the safety
net for timers written behind its back), and is woken at once when a timer is scheduled
earlier than its current wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine, Iterable
from datetime import datetime, timedelta
from typing import Any

from timer_core._entry import TimerEntry, TimerKey
from timer_core._failures import Failing, FailureBook, QuarantinedTimer
from timer_core._waits import sleep_unless
from timer_core.errors import PublishError, StoreError, ValidationError
from timer_core.firing import (
    DrainReport,
    FiringPipeline,
    FiringReport,
    PendingMark,
    PublishedEvents,
)
from timer_core.instrumentation import NO_INSTRUMENTATION, Instrumentation
from timer_core.maintenance import CommandsStored, Retention
from timer_core.ports import (
    Clock,
    EnvelopeIdGenerator,
    EventPublisher,
    TimerStore,
    Uuid7EnvelopeIds,
)

__all__ = ["QuarantinedTimer", "TimerWorker"]

log = logging.getLogger(__name__)

# While a timer left out (backing off, quarantined) is the store's earliest due one, the
# store's next due time says nothing of the others: the worker then looks this often.
_MASKED_POLL_S = 0.25
_RETRY_EPSILON_S = 0.001
# Batches in a row of which nothing was published: after this many the drain ends instead
# of stepping through the whole backlog (which would leave a backoff record per due timer, a
# million for a million); the next drain looks past them at once (they may be poison timers,
# the broker fine) and, when its batches fail as well, the broker is taken to be down: no
# more timers are backed off one by one until something is published again.
_OUTAGE_BATCHES = 2


class TimerWorker:
    """Runs :meth:`FiringPipeline.drain <timer_core.firing.FiringPipeline.drain>` until
    stopped.

    - drains a backlog batch after batch without sleeping while batches come back full,
      reading and marking batches while their neighbours are published;
    - continues past timers whose publish failed (keyset cursor) and backs off each of them
      on its own (doubling from ``initial_backoff``, never past the polling interval), so a
      timer that cannot be published delays no other timer, and a broker outage does not
      spin: after two batches in a row of which nothing was published, the drain ends; the
      next looks past them at once and, when it cannot publish either, the broker is taken
      to be down: until something is published again, the timers backing off go on doing
      so and no more are taken on, so an outage over a backlog of any size keeps backoff
      records of a few batches' timers, not of every due one;
    - a timer whose publish fails ``quarantine_after`` times while other timers are
      published (the broker works: this timer is the problem) is quarantined: reported
      (log, :meth:`Instrumentation.timer_quarantined`), listed in :attr:`quarantined` and
      left out until :meth:`retry_quarantined`. The record is kept in memory: after a
      restart such a timer is tried again and, still failing, quarantined again. During an
      outage (nothing published) failures back off but never count towards it;
    - a failing pass (store down) is logged and retried with capped exponential backoff;
      the loop never dies of one bad pass;
    - with ``retention``, deletes ``Reached`` timers fired longer ago than that, in batches
      of at most ``retention_batch`` (fewer when a batch takes over 10 ms), beside its
      sleep (a timer coming due is fired meanwhile), freely with nothing due for a second,
      else at most two and a half for each timer it fired, and at most every ``retention_every``
      seconds once caught up;
    - :meth:`stop` lets the pass in flight finish, then :meth:`run` returns.
    """

    def __init__(
        self,
        store: TimerStore,
        publisher: EventPublisher,
        clock: Clock,
        *,
        polling_interval: float = 5.0,
        batch_size: int = 100,
        ids: EnvelopeIdGenerator | None = None,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
        initial_backoff: float = 0.05,
        max_backoff: float = 30.0,
        retention: timedelta | None = None,
        retention_batch: int = 500,
        retention_every: float = 60.0,
        quarantine_after: int | None = 10,
    ) -> None:
        _require_seconds("polling_interval", polling_interval)
        _require_count("batch_size", batch_size)
        _require_seconds("initial_backoff", initial_backoff)
        _require_seconds("max_backoff", max_backoff)
        if retention is not None and not (
            isinstance(retention, timedelta) and retention > timedelta(0)
        ):
            raise ValidationError(
                f"retention must be a positive timedelta or None (keep forever), got {retention!r}"
            )
        _require_count("retention_batch", retention_batch)
        _require_seconds("retention_every", retention_every)
        if quarantine_after is not None:
            _require_count("quarantine_after", quarantine_after)
        self._store = store
        self._clock = clock
        self._interval = polling_interval
        self._instrumentation = instrumentation
        delivery = PublishedEvents(publisher, clock, ids or Uuid7EnvelopeIds(), instrumentation)
        self._firing = FiringPipeline(
            store, delivery, clock, batch_size=batch_size, instrumentation=instrumentation
        )
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._retention = (
            None
            if retention is None
            else Retention(
                store,
                clock,
                keep=retention,
                batch=retention_batch,
                every=retention_every,
                instrumentation=instrumentation,
            )
        )
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        # Set while the worker sleeps in its idle wait: nothing due that it knows of.
        self._asleep = asyncio.Event()
        self._sleep_until = 0.0  # monotonic end of the idle sleep
        self._wake_at: datetime | None = None
        self._running = False
        self.last_pass_at: float | None = None
        """Monotonic time the last pass completed without a store error (for health checks)."""
        self.passes = 0
        """How many passes completed."""
        # The last drain's mark, still running.
        self._marking: PendingMark | None = None
        # Retention's purge under way beside the worker's sleep (see _idle).
        self._purging: asyncio.Task[None] | None = None
        self._quarantine_after = quarantine_after
        # Timers whose last publish failed, by key, until one succeeds (or they are retried).
        self._failing = FailureBook(store, clock, instrumentation, log)
        self._published = 0
        # The commands stored beside the worker: retention's purge beyond what it owes
        # waits for a quiet moment (see notify_applied).
        self._commands = CommandsStored(clock)
        self._drain_started = 0.0
        # Batches in a row (across drains) of which none was published.
        self._unpublished_batches = 0

    @property
    def quarantined(self) -> list[QuarantinedTimer]:
        """The timers quarantined now, in the order they were."""
        return self._failing.quarantined

    def retry_quarantined(self, keys: Iterable[TimerKey] | None = None) -> int:
        """Put quarantined timers (all, or those of ``keys``) back in the next pass, with a
        fresh count of failures; returns how many. Wakes the worker."""
        retried = self._failing.retry(keys)
        if retried:
            self._wake.set()
        return retried

    def notify_scheduled(self, due_at: datetime) -> None:
        """Tell the worker a timer is due at ``due_at``; it wakes now if that is earlier."""
        if self._wake_at is None or due_at < self._wake_at:
            self._wake.set()

    @property
    def last_applied_at(self) -> float | None:
        """Monotonic time a batch of commands was last stored (:meth:`notify_applied`);
        None before the first."""
        return self._commands.last_at

    def notify_applied(self, *, cancelled: int = 0) -> None:
        """Tell the worker a batch of commands was just stored (``cancelled`` of them
        cancelled a timer). Retention's idle purge gives way to commands as it does to due
        timers: it starts no batch beyond what it owes until they have been quiet for
        :data:`~timer_core.maintenance.COMMANDS_QUIET_S`; a cancellation's tombstone counts,
        as a fired timer does, towards what a busy worker owes."""
        self._commands.stored(cancelled=cancelled)

    async def wait_until_idle(self) -> None:
        """Return once the worker sleeps with nothing due that it knows of, no wake-up
        pending and no purge under way: every timer due by the clock's now was fired (or is
        backing off). A test waits for this before asserting that nothing fired."""
        while (
            not self._asleep.is_set()
            or self._wake.is_set()
            or self._clock.monotonic() >= self._sleep_until  # its sleep is over: a pass is due
            or (self._purging is not None and not self._purging.done())
        ):
            if self._asleep.is_set():
                await asyncio.sleep(0)  # woken: let it run its pass first
            else:
                await self._asleep.wait()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the pass in flight."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    async def run(self) -> None:
        """Fire due timers until :meth:`stop`; never raises for a failed pass."""
        if self._running:
            raise RuntimeError("this worker is already running")
        self._running = True
        try:
            await self._loop()
        finally:
            await self._finish_marking()
            if self._purging is not None:
                await self._purging  # it ends after its batch under way: stopping interrupts it
                self._purging = None
            self._running = False

    async def _loop(self) -> None:
        store_failures = 0
        while not self._stop.is_set():
            self._wake.clear()
            self._wake_at = None
            try:
                report = await self._drain()
                self._published += report.fired
                if self._marking is not None and not report.failed:
                    if report.fired:
                        # More may have come due while these were published: look again
                        # at once, while their mark runs, instead of waiting for it.
                        continue
                    if await self._marked_or_woken():
                        continue  # a new timer was announced: look for it beside the mark
                # A failed mark is a failed pass: it backs off like one.
                await self._finish_marking(quietly=False)
            except Exception as exc:  # one bad pass must not kill the loop
                store_failures += 1
                delay = self._backoff(store_failures)
                self._instrumentation.worker_error(exc)
                level = logging.WARNING if isinstance(exc, StoreError) else logging.ERROR
                log.log(
                    level,
                    "worker pass failed (%s); retrying in %.2fs",
                    exc,
                    delay,
                    exc_info=not isinstance(exc, StoreError),
                )
                await self._sleep(delay, wakeable=False)
                continue
            store_failures = 0
            if report.failed:
                if self._unpublished_batches >= 2 * _OUTAGE_BATCHES:
                    # Nothing published in this drain nor the one before: the broker looks
                    # down. The timers backing off already back off further; no new ones are
                    # taken on (their records would grow with the backlog: these stay
                    # Scheduled and come first in a later drain), and the worker waits as a
                    # timer that failed that many times would (never past the interval).
                    known = [failed for failed in report.failed if failed[0].key in self._failing]
                    self._note_failures(known, fired=report.fired)
                    await self._sleep(self._backoff(self._unpublished_batches), wakeable=False)
                    continue
                # The drain stepped over them; each is left out until its own backoff ends,
                # so the next drain looks for the others at once.
                self._note_failures(report.failed, fired=report.fired)
                continue
            await self._idle()

    async def _drain(self) -> DrainReport:
        carried, self._marking = self._marking, None
        self._drain_started = self._clock.monotonic()
        try:
            self._firing.exclude = self._left_out if self._failing else None
            report = await self._firing.drain(
                stopping=self._drain_over,
                on_batch=self._batch_done,
                finish_marks=False,
                carried=carried,
            )
        except BaseException:
            if carried is not None:
                await _quietly(carried)
            raise
        self._marking = report.unfinished_mark
        return report

    async def _marked_or_woken(self) -> bool:
        """Wait for the last drain's mark, or a wake-up; whether it was a wake-up first.

        Until the mark is done the store's next due time may be one of the timers being
        marked, so it is no guide for sleeping; a new timer is announced by a wake-up.
        """
        assert self._marking is not None
        waking: asyncio.Future[object] = asyncio.ensure_future(self._wake.wait())
        marking: asyncio.Future[object] = self._marking.marking  # type: ignore[assignment]
        try:
            await asyncio.wait({marking, waking}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waking.cancel()
        return not self._marking.done()

    async def _finish_marking(self, *, quietly: bool = True) -> None:
        """Wait for the last drain's mark; its failure is raised unless ``quietly`` (then
        only logged: the timers stay ``Scheduled`` and are published again later)."""
        marking, self._marking = self._marking, None
        if marking is not None:
            if quietly:
                await _quietly(marking)
            else:
                await marking

    def _drain_over(self) -> bool:
        """Whether the drain should end: stopping, or the broker looks down."""
        return self._stop.is_set() or self._unpublished_batches >= _OUTAGE_BATCHES

    def _batch_done(self, report: FiringReport) -> None:
        self.last_pass_at = self._clock.monotonic()
        self.passes += 1
        if report.fired:
            self._unpublished_batches = 0
        elif report.failed:
            self._unpublished_batches += 1
        if self._failing:
            for entry in report.fired:
                record = self._failing.pop(entry.key)
                if record is not None and record.failures > 1:
                    log.info(
                        "timer %s/%s published after %d failed attempts",
                        entry.tenant_id,
                        entry.service_call_id,
                        record.failures,
                    )

    def _left_out(self, entry: TimerEntry) -> bool:
        """Whether this due timer sits out the pass: quarantined, or backing off."""
        record = self._failing.get(entry.key)
        if record is None or record.entry.due_at != entry.due_at:
            return False  # a rescheduled timer is a new one
        return record.quarantined_at is not None or not self._retry_due(record)

    def _retry_due(self, record: Failing, at: float | None = None) -> bool:
        """Whether its backoff is over (at monotonic time ``at``, default now)."""
        # Within a millisecond counts as over: a clock's rounding must not make a sleep of
        # nothing that ends with the timer still left out.
        now = self._clock.monotonic() if at is None else at
        return record.retry_at <= now + _RETRY_EPSILON_S

    def _note_failures(self, failed: list[tuple[TimerEntry, PublishError]], *, fired: int) -> None:
        """Back each failed timer off on its own; quarantine the ones that keep failing
        while others are published."""
        now = self._clock.monotonic()
        published_before = self._published - fired
        for entry, error in failed:
            record = self._failing.record_of(entry, published_then=published_before)
            record.entry = entry
            record.failures += 1
            if self._published > record.published_then:
                record.strikes += 1
            record.published_then = self._published
            record.error = str(error)
            record.retry_at = now + self._backoff(record.failures)
            if (
                self._quarantine_after is not None
                and record.strikes >= self._quarantine_after
                and record.quarantined_at is None
            ):
                self._failing.quarantine(
                    record,
                    error,
                    f"its publish failed {record.failures} times while other timers were published",
                )

    def _forget_settled_backoffs(self) -> None:
        """Drop backoffs that were over when the last drain began: that drain did not find
        the timer failing again, so it was cancelled, rescheduled or fired elsewhere."""
        over = [
            key
            for key, record in self._failing.records.items()
            if record.quarantined_at is None and self._retry_due(record, self._drain_started)
        ]
        for key in over:
            self._failing.pop(key)

    def _next_retry_in(self) -> float | None:
        """Seconds until the first backing-off timer may be tried again, if any."""
        pending = [r for r in self._failing if r.quarantined_at is None]
        if not pending:
            return None
        if any(self._retry_due(record) for record in pending):
            return 0.0
        return min(record.retry_at for record in pending) - self._clock.monotonic()

    async def _idle(self) -> None:
        """Nothing more is due now: purge expired timers if it is time, then sleep until due."""
        try:
            next_due = await self._store.next_due_at()
        except StoreError as exc:
            log.warning("could not read the next due time (%s); polling again later", exc)
            next_due = None
        if self._retention is not None and (self._purging is None or self._purging.done()):
            # Beside the sleep, not before it: a timer coming due is fired on time while a
            # batch is under way (which stops the purge after it).
            expired_later = self._published + self._commands.cancelled  # expires in turn
            purge = self._retention.purge(
                next_due, self._purge_interrupted, fired=expired_later, commands=self._commands.busy
            )
            self._purging = asyncio.ensure_future(_logged(purge))
        if self._failing:
            self._forget_settled_backoffs()
            await self._failing.forget_stale()
        now = self._clock.now()
        delay = self._interval
        if next_due is not None:
            until_due = (next_due - now).total_seconds()
            if until_due <= 0 and self._failing:
                # Most likely a timer left out: the next one's due time is unknown.
                delay = min(delay, _MASKED_POLL_S)
            else:
                delay = min(delay, max(0.0, until_due))
        retry_in = self._next_retry_in()
        if retry_in is not None:
            delay = min(delay, retry_in)
        self._wake_at = now + timedelta(seconds=delay)
        self._sleep_until = self._clock.monotonic() + delay
        self._asleep.set()
        try:
            await self._sleep(delay, wakeable=True)
        finally:
            self._asleep.clear()

    def _purge_interrupted(self) -> bool:
        """Whether retention's idle batches should stop: the worker is no longer asleep with
        nothing due (woken, stopping, or passing again)."""
        return self._stop.is_set() or self._wake.is_set() or not self._asleep.is_set()

    def _backoff(self, failures: int) -> float:
        # Never past the polling interval: it is the longest the worker may go without
        # looking, so a broker or database that comes back is used within one interval.
        exponential = self._initial_backoff * 2 ** min(failures - 1, 30)
        return float(min(self._max_backoff, self._interval, exponential))

    async def _sleep(self, seconds: float, *, wakeable: bool) -> None:
        interrupt = self._wake if wakeable else self._stop
        await sleep_unless(self._clock, seconds, interrupt, stop=self._stop)


def _require_seconds(name: str, value: float) -> None:
    # bool is an int; NaN fails every comparison; infinity would never wake.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValidationError(f"{name} must be a positive number of seconds, got {value!r}")


def _require_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"{name} must be a whole number of at least 1, got {value!r}")


async def _quietly(marking: PendingMark) -> None:
    try:
        await marking
    except Exception as exc:
        log.warning("marking fired timers failed (%s); they will be published again", exc)


async def _logged(purge: Coroutine[Any, Any, None]) -> None:
    """A purge run beside the worker: an unexpected error is logged, never lost."""
    try:
        await purge
    except Exception:
        log.exception("retention purge failed; trying again at the next idle moment")
