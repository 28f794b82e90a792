"""The worker: an asyncio loop that runs the firing pipeline, waking on the earliest due time.

It sleeps until the next timer is due, never longer than the polling interval (the safety
net for timers written behind its back), and is woken at once when a timer is scheduled
earlier than its current wake-up. One worker for every way out: a broker's publisher or the
host's handler (:mod:`timer_core.handlers`), plugged into the pipeline as its delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from timer_core._checks import require_count, require_seconds
from timer_core._entry import TimerEntry, TimerKey
from timer_core._failures import Failing, FailureBook, QuarantinedTimer
from timer_core._waits import sleep_unless
from timer_core.delivery import Delivery
from timer_core.errors import PublishError, StoreError, ValidationError
from timer_core.firing import FiringPipeline
from timer_core.handlers import HandlerCalls
from timer_core.instrumentation import NO_INSTRUMENTATION, Instrumentation
from timer_core.maintenance import CommandsStored, Retention
from timer_core.ports import (
    Clock,
    EnvelopeIdGenerator,
    EventPublisher,
    LeasesClaims,
    TimerStore,
)

__all__ = ["QuarantinedTimer", "TimerWorker"]

log = logging.getLogger(__name__)

# While timers are held back (delivering, backing off) a leasing store's next due time may
# be one of them, and looking past them would claim timers: the worker looks this often
# instead (less often when only quarantined timers are held). Other stores are asked for
# the first timer past them.
_MASKED_POLL_S = 0.02
_QUARANTINED_POLL_S = 0.25
_RETRY_EPSILON_S = 0.001
# Publishes failed in a row, in batches: after this many the drain ends instead of stepping
# through the whole backlog (a backoff record per due timer); at twice as many the broker is
# taken to be down: until something is published again, the timers backing off go on doing
# so and no more are taken on.
_OUTAGE_BATCHES = 2
# Loop turns the worker gives deliveries under way before it works out its sleep: one that
# answers without I/O (the memory bus) has answered by then, so the sleep is the right one.
_SETTLING_YIELDS = 50


class TimerWorker:
    """Runs a :class:`~timer_core.firing.FiringPipeline` until stopped.

    - drains a backlog without sleeping while finds come back full; the next timers are
      found and handed out while earlier ones are still being delivered, each marked once
      its own delivery succeeded;
    - a timer whose delivery fails stays ``Scheduled`` and backs off on its own. Published
      (``publisher`` is an :class:`EventPublisher`): doubling from ``initial_backoff``,
      never past the polling interval; quarantined after ``quarantine_after`` failures
      while other timers were published (the broker works: this timer is the problem); an
      outage (nothing published) backs off but never quarantines, and after a few batches
      takes no more timers on. Handled (``publisher`` is the host's handler delivery, see
      :mod:`timer_core.handlers`): after ``HandlerSettings.retry_delay``, quarantined after
      ``max_attempts`` failures. A quarantined timer is reported (log,
      :meth:`Instrumentation.timer_quarantined`), listed in :attr:`quarantined` and left out
      until :meth:`retry_quarantined`; the list is kept in memory;
    - a failing pass (store down) is logged and retried with capped exponential backoff;
      the loop never dies of one bad pass;
    - with ``retention``, deletes ``Reached`` timers fired longer ago than that, beside its
      sleep (see :class:`~timer_core.maintenance.Retention`);
    - :meth:`stop` ends the finds; deliveries under way end (a handler's get its shutdown
      grace), what was delivered is marked, then :meth:`run` returns.
    """

    def __init__(
        self,
        store: TimerStore,
        publisher: EventPublisher | Delivery,
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
        rng: random.Random | None = None,
    ) -> None:
        require_seconds("polling_interval", polling_interval)
        require_count("batch_size", batch_size)
        require_seconds("initial_backoff", initial_backoff)
        require_seconds("max_backoff", max_backoff)
        if retention is not None and not (
            isinstance(retention, timedelta) and retention > timedelta(0)
        ):
            raise ValidationError(
                f"retention must be a positive timedelta or None (keep forever), got {retention!r}"
            )
        require_count("retention_batch", retention_batch)
        require_seconds("retention_every", retention_every)
        if quarantine_after is not None:
            require_count("quarantine_after", quarantine_after)
        self._store = store
        self._clock = clock
        self._interval = polling_interval
        self._batch_size = batch_size
        self._instrumentation = instrumentation
        self._firing = FiringPipeline(
            store, publisher, clock, batch_size=batch_size, ids=ids, instrumentation=instrumentation
        )
        self._firing.retry_marks = True
        self._firing.on_failed = self._failed
        self._firing.on_delivered = self._delivered
        self._firing.on_change = self._changed
        delivery = self._firing.delivery
        self._handler = delivery.settings if isinstance(delivery, HandlerCalls) else None
        self._rng = rng or random.Random()
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._leasing = isinstance(store, LeasesClaims)
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
        self._starved = False  # every place taken: a freed one wakes the worker
        self._running = False
        self.last_pass_at: float | None = None
        """Monotonic time the last pass completed without a store error (for health checks)."""
        self.passes = 0
        """How many passes completed."""
        self._purging: asyncio.Task[None] | None = None
        self._quarantine_after = quarantine_after
        self._failing = FailureBook(store, clock, instrumentation, log)
        self._firing.exclude = self._left_out
        self._firing.excluding = self._failing.__bool__
        self._published = 0
        self._published_before = 0  # when the drain under way began
        self._failed_in_a_row = 0
        self._commands = CommandsStored(clock)
        self._drain_started = 0.0
        self._drain_seen: set[TimerKey] = set()

    # -- what the Timer reads and calls ---------------------------------------------------

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
        cursor = self._firing.cursor
        if cursor is not None and due_at < cursor.due_at:
            self._firing.restart()  # due before where the drain stands: start over
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

    @contextlib.contextmanager
    def storing_commands(self) -> Iterator[None]:
        """Around the storing of commands in this process: no page of due timers is read
        ahead meanwhile, and one read before is dropped after (it may hold a timer they
        cancel or move)."""
        firing = self._firing
        firing.storing += 1
        firing.drop_read_ahead()
        try:
            yield
        finally:
            firing.storing -= 1
            firing.drop_read_ahead()

    async def wait_until_idle(self) -> None:
        """Return once the worker sleeps with nothing due that it knows of, nothing being
        delivered or waiting for its mark, no wake-up pending and no purge under way: every
        timer due by the clock's now was delivered (or is backing off). A test waits for
        this before asserting that nothing fired."""
        while not self._idle_now():
            if self._asleep.is_set():
                await asyncio.sleep(0)  # woken: let it run its pass first
                if self._firing.busy:
                    await asyncio.sleep(0.001)  # deliveries run on real time
            else:
                await self._asleep.wait()

    def _idle_now(self) -> bool:
        return (
            self._asleep.is_set()
            and not self._wake.is_set()
            and self._clock.monotonic() < self._sleep_until
            and not self._firing.busy
            and (self._purging is None or self._purging.done())
        )

    def stop(self) -> None:
        """Ask :meth:`run` to stop finding timers and wind down (see the class notes)."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Fire due timers until :meth:`stop`; never raises for a failed pass."""
        if self._running:
            raise RuntimeError("this worker is already running")
        self._running = True
        try:
            await self._loop()
        finally:
            await self._firing.close()
            if self._purging is not None:
                await self._purging  # it ends after its batch under way: stopping interrupts it
                self._purging = None
            self._running = False

    async def _loop(self) -> None:
        store_failures = 0
        firing = self._firing
        while not self._stop.is_set():
            self._wake.clear()
            self._wake_at = None
            if firing.room <= 0:
                await self._wait_for_room()
                continue
            try:
                if firing.cursor is None:
                    self._published_before = self._published
                    self._drain_started = self._clock.monotonic()
                    self._drain_seen.clear()
                if firing.mark_error is not None:
                    await firing.mark_again()  # a failed mark is a failed pass
                await firing.step()
            except Exception as exc:  # one bad pass must not kill the loop
                firing.restart()
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
            self.last_pass_at = self._clock.monotonic()
            self.passes += 1
            outage = self._failed_in_a_row // self._batch_size
            if self._handler is None and outage >= _OUTAGE_BATCHES:
                # Nothing published for a few batches: the drain ends here, and once the
                # broker looks down the worker waits as a timer failing that often would.
                firing.restart()
                await self._quiesce()
                outage = self._failed_in_a_row // self._batch_size
                if outage >= 2 * _OUTAGE_BATCHES:
                    await self._sleep(self._backoff(outage), wakeable=False)
                    continue
            if firing.cursor is not None:
                await asyncio.sleep(0)  # a long drain still lets the rest of the host run
                continue
            if not self._failing and self._drain_seen:
                self._drain_seen.clear()
            await self._idle()

    async def _quiesce(self) -> None:
        """Before a sleep: a few turns of the loop for the deliveries under way (one that
        answers without I/O, the memory bus, has answered after them), then, when only
        marks are left (a store's round trip), until they end or a wake-up: until then the
        store's next due time may be one of the timers being marked."""
        firing = self._firing
        for _ in range(_SETTLING_YIELDS):
            if not firing.in_flight or self._wake.is_set():
                break
            await asyncio.sleep(0)
        if firing.busy and firing.in_flight == 0 and firing.mark_error is None:
            await firing.marked_or(self._wake if not self._stop.is_set() else self._stop)

    async def _wait_for_room(self) -> None:
        """Every place is taken: wait until enough free up (a quarter of a batch, or all),
        or the worker is stopped."""
        # A pass of its own (health sees the worker alive while long calls run), and a
        # sleep on the clock, never past the polling interval.
        self.last_pass_at = self._clock.monotonic()
        self.passes += 1
        self._starved = True
        self._sleep_until = self._clock.monotonic() + self._interval
        try:
            await self._sleep(self._interval, wakeable=True)
        finally:
            self._starved = False

    def _changed(self) -> None:
        """The pipeline freed a place or ended a mark."""
        firing = self._firing
        if firing.mark_error is not None:
            self._wake.set()
        elif self._starved:
            wanted = max(1, min(self._batch_size, firing.delivery.places) // 4)
            if firing.room >= wanted or firing.in_flight == 0:
                self._wake.set()
        elif self._asleep.is_set() and not firing.busy:
            self._wake.set()  # what was held no longer hides the next due time

    # -- outcomes ----------------------------------------------------------------------------

    def _delivered(self, entries: Sequence[TimerEntry]) -> None:
        self._published += len(entries)
        self._failed_in_a_row = 0
        self._firing.window = None
        if not self._failing:
            return
        for entry in entries:
            record = self._failing.pop(entry.key)
            if record is not None and record.failures > 1:
                log.info(
                    "timer %s/%s delivered after %d failed attempts",
                    entry.tenant_id,
                    entry.service_call_id,
                    record.failures,
                )

    def _failed(self, entry: TimerEntry, error: PublishError) -> None:
        if self._stop.is_set() and self._handler is not None:
            return  # cut off by the shutdown: delivered again after the next start
        now = self._clock.monotonic()
        settings = self._handler
        if settings is not None:
            record = self._failing.record_of(entry)
            record.failures += 1
            record.error = str(error)
            if record.failures >= settings.max_attempts:
                why = f"its handler failed {record.failures} times"
                self._failing.quarantine(record, error, why, cause=error.__cause__)
                return
            delay = settings.retry_delay(record.failures, self._rng.random())
            record.retry_at = now + delay
            log.warning(
                "%s; attempt %d of %d, next in %.3fs",
                error,
                record.failures,
                settings.max_attempts,
                delay,
            )
        else:
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= self._batch_size:
                # A batch's worth failed, nothing published: one batch at a time until
                # something is (a broker down is not sent the whole backlog).
                self._firing.window = self._batch_size
            if (
                self._failed_in_a_row >= 2 * _OUTAGE_BATCHES * self._batch_size
                and entry.key not in self._failing
            ):
                return  # the broker looks down: no new records, it stays Scheduled
            # A first failure counts as a strike if others were published in this drain.
            record = self._failing.record_of(entry, published_then=self._published_before)
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
        # A retry sooner than the planned wake-up: the sleep must be shortened (a worker not
        # asleep works its sleep out once the deliveries under way have answered).
        if self._asleep.is_set() or self._starved:
            self._wake.set()

    def _left_out(self, entry: TimerEntry) -> bool:
        """Whether this due timer sits out the pass: quarantined, or backing off."""
        self._drain_seen.add(entry.key)
        record = self._failing.get(entry.key)
        if record is None:
            return False
        if record.entry.due_at != entry.due_at:  # rescheduled: a new timer
            self._failing.pop(entry.key)
            return False
        return record.quarantined_at is not None or not self._retry_due(record)

    def _retry_due(self, record: Failing, at: float | None = None) -> bool:
        """Whether its backoff is over (at monotonic time ``at``, default now)."""
        # Within a millisecond counts as over: a clock's rounding must not make a sleep of
        # nothing that ends with the timer still left out.
        now = self._clock.monotonic() if at is None else at
        return record.retry_at <= now + _RETRY_EPSILON_S

    def _forget_settled_backoffs(self) -> None:
        """Drop backoffs that were over when the last drain began and whose timer it did not
        find (cancelled, rescheduled or delivered elsewhere): no retry will come."""
        gone = [
            key
            for key, record in self._failing.records.items()
            if record.quarantined_at is None
            and self._retry_due(record, self._drain_started)
            and key not in self._drain_seen
            and not self._firing.holds(record.entry)
        ]
        for key in gone:
            self._failing.pop(key)

    def _next_retry_in(self) -> float | None:
        """Seconds until the first backing-off timer may be tried again, if any."""
        pending = [r for r in self._failing if r.quarantined_at is None]
        if not pending:
            return None
        if any(self._retry_due(record) for record in pending):
            return 0.0
        return min(record.retry_at for record in pending) - self._clock.monotonic()

    # -- sleeping -----------------------------------------------------------------------

    async def _idle(self) -> None:
        """Nothing more is due now: purge expired timers if it is time, then sleep until due."""
        await self._quiesce()
        if self._wake.is_set() or self._firing.mark_error is not None:
            return
        now = self._clock.now()
        try:
            next_due = await self._next_due(now)
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
        # Once more: what answered meanwhile (a failure sets a retry) is in before the sleep.
        await self._quiesce()
        if self._wake.is_set() or self._firing.mark_error is not None:
            return
        now = self._clock.now()
        delay = self._interval
        if next_due is not None:
            delay = min(delay, max(0.0, (next_due - now).total_seconds()))
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

    async def _next_due(self, now: datetime) -> datetime | None:
        """The earliest due time of a timer not held back here, as far as can be told."""
        held = self._firing.held + len(self._failing)
        if not held:
            return await self._store.next_due_at()
        if self._leasing:
            # Looking past held timers would claim timers not due: poll instead.
            only_quarantined = not self._firing.busy and all(
                record.quarantined_at is not None for record in self._failing
            )
            poll = _QUARANTINED_POLL_S if only_quarantined else _MASKED_POLL_S
            return now + timedelta(seconds=poll)
        horizon = now + timedelta(seconds=self._interval)
        for entry in await self._store.find_due(horizon, held + 1):
            if not self._firing.holds(entry) and not self._left_out(entry):
                return entry.due_at
        return None

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

    # -- health ---------------------------------------------------------------------------

    def quarantine_age(self) -> float | None:
        """Seconds the longest-quarantined timer has been held (the worker's clock); None
        when none is."""
        oldest = min(
            (r.quarantined_at for r in self._failing if r.quarantined_at is not None),
            default=None,
        )
        if oldest is None:
            return None
        return max(0.0, (self._clock.now() - oldest).total_seconds())


async def _logged(purge: Coroutine[Any, Any, None]) -> None:
    """A purge run beside the worker: an unexpected error is logged, never lost."""
    try:
        await purge
    except Exception:
        log.exception("retention purge failed; trying again at the next idle moment")
