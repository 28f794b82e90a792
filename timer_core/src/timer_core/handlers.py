"""In-process delivery: the host's own function is called with each ``DueTimeReached``, no broker.

:class:`HandlerWorker` takes the place of :class:`~timer_core.TimerWorker` when a
:class:`~timer_core.Timer` is given ``handler=`` instead of a publisher. Each due timer is
handed to the handler in a task of its own and marked ``Reached`` only once the handler
returned, so a timer whose handler fails, hangs or is cut off by a crash stays ``Scheduled``
and is delivered again: at least once, never early. One timer's handler holds back only that
timer: it is retried on its own (exponential backoff with jitter) and quarantined after
:attr:`HandlerSettings.max_attempts`; a slow one takes only one of
:attr:`HandlerSettings.max_concurrency` places.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import math
import random
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, TypeAlias, cast

import attrs

from timer_core._entry import TimerEntry, TimerKey
from timer_core._failures import FailureBook, QuarantinedTimer
from timer_core._messages import DueTimeReached, MessageEnvelope
from timer_core._time import floor_ms
from timer_core._waits import sleep_unless
from timer_core.errors import HandlerFailed, StoreError, ValidationError
from timer_core.events import due_events
from timer_core.instrumentation import NO_INSTRUMENTATION, BatchObserver, Instrumentation
from timer_core.maintenance import CommandsStored, Retention
from timer_core.ports import (
    Clock,
    DueCursor,
    EnvelopeIdGenerator,
    LeasesClaims,
    TimerStore,
    Uuid7EnvelopeIds,
)

__all__ = ["DueTimeHandler", "HandlerSettings", "HandlerWorker"]

log = logging.getLogger(__name__)

#: The host's handler: called with each ``DueTimeReached`` envelope; a coroutine function is
#: awaited on the event loop, a plain function runs in a thread. Returning means "handled":
#: the timer is then marked ``Reached``. Raising (or outliving the timeout) means "not yet".
DueTimeHandler: TypeAlias = Callable[[MessageEnvelope[DueTimeReached]], Awaitable[None] | None]

_Call: TypeAlias = Callable[[MessageEnvelope[DueTimeReached]], Coroutine[Any, Any, None]]

# While timers it knows of are held back (running, backing off) a leasing store's next due
# time may be one of them, and looking past them would claim timers: the worker looks this
# often instead. Other stores are asked for the first timer past them.
_MASKED_POLL_S = 0.02
_QUARANTINED_POLL_S = 0.25
_MARK_BATCH = 1000
# While a drain goes on, a mark waits up to this long (real time, as the calls run
# on) for more handled timers to mark in the same commit, unless _MARK_BATCH are waiting:
# each commit rewrites the pages it touched, and on SQLite marks of ~60 timers cost 2.4x
# per timer what marks of 1,000 do (bench/README.md). Only the Reached state waits; the
# calls do not, and nothing is delivered later for it.
_MARK_GATHER_S = 0.025


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValidationError(f"{attribute.name} must be a positive number, got {value!r}")


def _count(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"{attribute.name} must be a whole number >= 1, got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value <= 1:
        raise ValidationError(f"{attribute.name} must be between 0 and 1, got {value!r}")


@attrs.frozen
class HandlerSettings:
    """How a :class:`~timer_core.Timer` calls its handler. Times are in seconds."""

    max_concurrency: int = attrs.field(default=100, validator=_count)
    """Most handler calls running at once (a sync handler's thread pool has as many)."""
    timeout_s: float = attrs.field(default=60.0, validator=_positive)
    """A call still running after this long counts as failed (an async one is cancelled; a
    sync one's thread cannot be, its result is ignored) and is retried."""
    max_attempts: int = attrs.field(default=10, validator=_count)
    """Failed calls of one timer before it is quarantined (listed, left out until retried)."""
    retry_delay_s: float = attrs.field(default=1.0, validator=_positive)
    """Delay before the second attempt; it doubles with each failure."""
    max_retry_delay_s: float = attrs.field(default=300.0, validator=_positive)
    """Cap of the doubling delay."""
    jitter: float = attrs.field(default=0.5, validator=_fraction)
    """Up to this fraction of each delay is taken off at random, so timers that failed
    together (a dependency down) are not all retried at the same moment."""
    shutdown_grace_s: float = attrs.field(default=10.0, validator=_positive)
    """On close, how long calls in flight may finish; the rest are cancelled, stay
    ``Scheduled`` and are delivered again after the restart."""

    def retry_delay(self, failures: int, draw: float) -> float:
        """The delay after ``failures`` failed calls; ``draw`` in [0, 1) takes off jitter."""
        doubled = self.retry_delay_s * 2 ** min(failures - 1, 30)
        return float(min(self.max_retry_delay_s, doubled) * (1 - self.jitter * draw))


class _Batch:
    """The timers one pass handed out together: their calls, one deadline for all (they
    started together), and the instrumentation's observer, told when the last one ended."""

    __slots__ = (
        "deadline",
        "entries",
        "envelopes",
        "keys",
        "left",
        "observer",
        "reached_at",
        "results",
        "tasks",
    )

    def __init__(
        self,
        observer: BatchObserver,
        entries: list[TimerEntry],
        keys: list[TimerKey],
        envelopes: list[MessageEnvelope[DueTimeReached]],
        reached_at: datetime,
    ) -> None:
        self.observer = observer
        self.entries = entries
        self.keys = keys
        self.envelopes = envelopes
        self.reached_at = reached_at
        self.tasks: list[asyncio.Task[None]] = []
        self.results: list[HandlerFailed | None] = [None] * len(entries)
        self.left = len(entries)
        self.deadline: asyncio.TimerHandle | None = None

    def done(self, index: int, error: HandlerFailed | None) -> None:
        self.results[index] = error
        self.left -= 1
        if self.left == 0:
            if self.deadline is not None:
                self.deadline.cancel()
            self.observer.published(self.results)
            self.observer.finished()


class HandlerWorker:
    """Hands due timers to the host's handler until stopped; see the module's docstring.

    - Each pass finds due timers (a page of ``batch_size`` at a time, past those held back),
      starts a call for each while places are free, and goes on while pages come back full.
      A leasing store's claims on timers it could not start are released. On a store without
      claims the next page is read while this one is handed out, and dropped (read again
      later) unless the very next pass can take it.
    - A call that returns has its timer marked ``Reached`` (marks are batched, beside the
      calls); one that raises or times out is retried after its own delay and quarantined
      after ``max_attempts`` (:attr:`quarantined`, :meth:`retry_quarantined`); the others are
      not delayed. Quarantine is kept in memory: after a restart the timer is tried again.
    - Instrumentation is the broker path's: ``firing_started`` per pass (its observer sees
      the handlers' results as the publish results), ``timers_fired`` once marked,
      ``publish_failed`` and ``timer_quarantined`` with a :class:`HandlerFailed`.
    - :meth:`stop` ends the passes; calls in flight get ``shutdown_grace_s`` to finish, the
      rest are cancelled and stay ``Scheduled``; what finished is marked before :meth:`run`
      returns.
    """

    def __init__(
        self,
        store: TimerStore,
        handler: DueTimeHandler,
        clock: Clock,
        *,
        settings: HandlerSettings | None = None,
        polling_interval: float = 5.0,
        batch_size: int = 100,
        ids: EnvelopeIdGenerator | None = None,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
        retention: timedelta | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not callable(handler):
            raise ValidationError(f"handler must be callable, got {handler!r}")
        self._store = store
        self._handler = handler
        self._is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 (an object with async __call__)
        )
        self._clock = clock
        self._settings = settings or HandlerSettings()
        self._interval = polling_interval
        self._batch_size = batch_size
        self._ids = ids or Uuid7EnvelopeIds()
        self._instrumentation = instrumentation
        self._retention = (
            None
            if retention is None
            else Retention(
                store,
                clock,
                keep=retention,
                batch=500,
                every=60.0,
                instrumentation=self._instrumentation,
            )
        )
        self._rng = rng or random.Random()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._asleep = asyncio.Event()
        self._sleep_until = 0.0  # monotonic end of the idle sleep
        self._marks_wanted = asyncio.Event()  # the first handled timer waits for its mark
        self._marks_ready = asyncio.Event()  # a full mark's worth waits, or no drain goes on
        self._wake_at: datetime | None = None
        self._commands = CommandsStored(clock)  # what retention gives way to
        self._running: dict[TimerKey, tuple[TimerEntry, asyncio.Task[None]]] = {}
        self._timed_out: set[TimerKey] = set()
        self._to_mark: list[TimerEntry] = []  # handled (as Reached entries), mark not begun
        self._to_mark_keys: list[TimerKey] = []  # their keys, in the same order
        self._marking: dict[TimerKey, datetime] = {}  # handled, not marked yet: key -> due_at
        # Marked (as these Reached entries) while the find in flight read: that read may
        # still see them Scheduled.
        self._just_marked: dict[TimerKey, TimerEntry] = {}
        # Claims a leasing store's find took anew on timers waiting for their mark.
        self._reclaimed: dict[TimerKey, Hashable] = {}
        self._failing = FailureBook(store, clock, instrumentation, log)
        self._cursor: DueCursor | None = None
        # The next page of a drain, read while this one is handed out: (its cursor, its
        # reading of the clock, the read).
        self._ahead: tuple[DueCursor, datetime, asyncio.Future[list[TimerEntry]]] | None = None
        self._reads_ahead = not isinstance(store, LeasesClaims)
        self._drain_started = 0.0
        self._drain_seen: set[TimerKey] = set()
        self._starved = False
        self._executor: ThreadPoolExecutor | None = None
        self.last_pass_at: float | None = None
        """Monotonic time the last pass completed without a store error (for health checks)."""
        self.passes = 0
        """How many passes completed."""

    # -- what the Timer reads and calls ---------------------------------------------------

    @property
    def quarantined(self) -> list[QuarantinedTimer]:
        """Timers whose handler failed ``max_attempts`` times, in the order they were."""
        return self._failing.quarantined

    def retry_quarantined(self, keys: Iterable[TimerKey] | None = None) -> int:
        """Put quarantined timers (all, or those of ``keys``) back with a fresh count of
        attempts; returns how many. Wakes the worker."""
        retried = self._failing.retry(keys)
        if retried:
            self._wake.set()
        return retried

    def notify_scheduled(self, due_at: datetime) -> None:
        """A timer is due at ``due_at``: wake now if that is before the planned wake-up."""
        if self._cursor is not None and due_at < self._cursor.due_at:
            self._cursor = None  # due before the page the drain is at: start over
        if self._wake_at is None or due_at < self._wake_at:
            self._wake.set()

    @property
    def last_applied_at(self) -> float | None:
        """Monotonic time a batch of commands was last stored (:meth:`notify_applied`);
        None before the first."""
        return self._commands.last_at

    def notify_applied(self, *, cancelled: int = 0) -> None:
        """A batch of commands was just stored: retention's purge gives way to them (see
        :meth:`TimerWorker.notify_applied <timer_core.worker.TimerWorker.notify_applied>`)."""
        self._commands.stored(cancelled=cancelled)  # (its purge is paced by time alone)

    def stop(self) -> None:
        """Ask :meth:`run` to stop handing out timers and wind down (see the class notes)."""
        self._stop.set()
        self._wake.set()
        self._marks_ready.set()

    async def wait_until_idle(self) -> None:
        """Return once nothing due is waiting, running or waiting for its mark."""
        while not self._idle_now():
            if self._asleep.is_set():
                await asyncio.sleep(0)
                if self._running or self._marking:
                    await asyncio.sleep(0.001)  # handlers run on real time
            else:
                await self._asleep.wait()

    def _idle_now(self) -> bool:
        return (
            self._asleep.is_set()
            and not self._wake.is_set()
            and self._clock.monotonic() < self._sleep_until
            and not self._running
            and not self._marking
        )

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Hand out due timers until :meth:`stop`; never raises for a failed pass."""
        marker = asyncio.create_task(self._mark_loop(), name="timer handler marks")
        try:
            await self._loop()
        finally:
            await self._wind_down()
            self._marks_wanted.set()
            self._stop.set()
            await marker
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._wake.clear()
            self._wake_at = None
            try:
                more = await self._pass()
            except Exception as exc:  # one bad pass must not kill the loop
                failures += 1
                delay = min(self._interval, 0.05 * 2 ** min(failures - 1, 30))
                self._instrumentation.worker_error(exc)
                log.log(
                    logging.WARNING if isinstance(exc, StoreError) else logging.ERROR,
                    "handler worker pass failed (%s); retrying in %.2fs",
                    exc,
                    delay,
                    exc_info=not isinstance(exc, StoreError),
                )
                await self._sleep(delay, wakeable=False)
                continue
            failures = 0
            if more:
                await asyncio.sleep(0)  # let the calls just started run
                continue
            self._drop_ahead()
            self._marks_ready.set()  # the drain is over: what waits is marked now
            await self._idle()
        self._drop_ahead()

    def _drop_ahead(self) -> None:
        """Forget the page read ahead (a pass that could not take it: it is read again)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            reading = ahead[2]
            reading.cancel()
            if reading.done() and not reading.cancelled():
                reading.exception()  # retrieved: a failed read ahead is not an error

    async def _pass(self) -> bool:
        """One page of due timers handed out; whether to look again at once."""
        started = self._clock.monotonic()
        free = self._settings.max_concurrency - len(self._running)
        self._starved = free <= 0
        if self._starved:
            return False
        if self._cursor is None:  # a drain from the first due timer begins
            self._drain_started = started
            self._drain_seen.clear()
        # No more than there are places for: a page read beyond them would be read again.
        limit = min(self._batch_size, free)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self._cursor:
            # The page read ahead, while the last one was handed out.
            _, now, reading = ahead
            page = await reading
            full = len(page) >= self._batch_size or len(page) > limit
            del page[limit:]
        else:
            if ahead is not None:
                ahead[2].cancel()  # a new drain began (a timer due earlier): read afresh
            now = self._clock.now()
            page = await self._find_due(now, limit, self._cursor)
            full = len(page) == limit
        self._cursor = _cursor_of(page[-1]) if full else None
        keys = [entry.key for entry in page]
        if self._failing:
            self._drain_seen.update(keys)
            if not full:
                self._forget_settled_backoffs()
        if self._holds_any(keys):
            # Held back here (running, waiting for or just past its mark, backing off).
            taken = [self._eligible(entry, key) for entry, key in zip(page, keys, strict=True)]
            if not all(taken):
                page = [entry for entry, take in zip(page, taken, strict=True) if take]
                keys = [key for key, take in zip(keys, taken, strict=True) if take]
        if full and self._reads_ahead:
            # The next page is read while this one is handed out (a store without claims:
            # a page not handed out at once is only dropped, and read again later).
            cursor, at = self._cursor, self._clock.now()
            assert cursor is not None
            reading = asyncio.ensure_future(self._find_due(at, self._batch_size, cursor))
            self._ahead = (cursor, at, reading)
        if page:
            self._start(page, keys, now)
        self.last_pass_at = self._clock.monotonic()
        self.passes += 1
        self._instrumentation.poll_completed(self.last_pass_at - started, len(page))
        return full

    def _forget_settled_backoffs(self) -> None:
        """At the end of a drain: drop backoffs that were over when it began and whose timer
        it did not find (cancelled, rescheduled or fired elsewhere), so no retry is waited
        for that will never come."""
        gone = [
            key
            for key, record in self._failing.records.items()
            if record.quarantined_at is None
            and record.retry_at <= self._drain_started
            and key not in self._drain_seen
        ]
        for key in gone:
            self._failing.pop(key)

    async def _find_due(
        self, now: datetime, limit: int, after: DueCursor | None
    ) -> list[TimerEntry]:
        """The store's due timers; what marks finished before this read began it sees
        ``Reached``, so only those marked while it reads are still held back after it."""
        self._just_marked.clear()
        return await self._store.find_due(now, limit, after=after)

    def _holds_any(self, keys: list[TimerKey]) -> bool:
        """Whether any of ``keys`` is held back here: a drain's page usually holds none,
        while the marks of the pages before it are pending, and one lookup per key in C
        tells so at a fraction of :meth:`_eligible`'s cost per timer."""
        return not (
            self._running.keys().isdisjoint(keys)
            and self._marking.keys().isdisjoint(keys)
            and self._just_marked.keys().isdisjoint(keys)
            and self._failing.records.keys().isdisjoint(keys)
        )

    def _eligible(self, entry: TimerEntry, key: TimerKey) -> bool:
        """Whether a timer found due is to be handed out now (not held back here)."""
        due_at = entry.due_at
        held = self._running.get(key)
        if held is not None:
            if entry.claim is not None and held[0].due_at == due_at:
                # A leasing store's find claimed it anew while its call runs: that claim
                # fences out the earlier one, so the mark must carry it.
                self._running[key] = (entry, held[1])
            return False
        if self._marking.get(key) == due_at:
            if entry.claim is not None:
                self._reclaimed[key] = entry.claim  # as above, while its mark waits
            return False
        marked = self._just_marked.get(key)
        if marked is not None and marked.due_at == due_at:
            # Marked while this find read. A leasing store's claim (taken before the mark,
            # which it then fenced out) leaves it Scheduled: marked again with that claim.
            if entry.claim is not None:
                self._marking[key] = due_at
                self._queue_mark(key, attrs.evolve(marked, claim=entry.claim))
            return False
        record = self._failing.get(key)
        if record is None:
            return True
        if record.entry.due_at != due_at:  # rescheduled: a new timer
            self._failing.pop(key)
            return True
        return record.quarantined_at is None and record.retry_at <= self._clock.monotonic()

    def _start(self, entries: list[TimerEntry], keys: list[TimerKey], now: datetime) -> None:
        # One instant for the batch, as the broker path has: the events' fast path.
        reached_at = floor_ms(now)
        envelopes = due_events(entries, reached_at, self._ids)
        observer = self._instrumentation.firing_started(envelopes)
        batch = _Batch(observer, entries, keys, envelopes, reached_at)
        loop = asyncio.get_running_loop()
        running = self._running
        call = self._call
        tasks = batch.tasks
        # The loop's own tasks, made directly (a fifth of a call's cost) unless the host set
        # a task factory, which then makes them.
        task_of: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]] = (
            functools.partial(asyncio.Task, loop=loop)
            if loop.get_task_factory() is None
            else loop.create_task
        )
        for index, entry in enumerate(entries):
            task = task_of(call(batch, index))
            tasks.append(task)
            running[keys[index]] = (entry, task)
        batch.deadline = loop.call_later(self._settings.timeout_s, self._time_out, batch)

    async def _call(self, batch: _Batch, index: int) -> None:
        """One timer's call, in a task of its own; its outcome is noted as it ends."""
        envelope = batch.envelopes[index]
        try:
            if self._is_async:
                await cast(_Call, self._handler)(envelope)
            else:
                await self._call_in_thread(envelope)
        except asyncio.CancelledError:
            self._failed(batch, index, None, cancelled=True)
            raise
        except Exception as exc:
            self._failed(batch, index, exc, cancelled=False)
        else:
            self._handled(batch, index)

    async def _call_in_thread(self, envelope: MessageEnvelope[DueTimeReached]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self._settings.max_concurrency, thread_name_prefix="timer-handler"
            )
        context = contextvars.copy_context()
        await asyncio.get_running_loop().run_in_executor(
            self._executor, context.run, self._handler, envelope
        )

    def _time_out(self, batch: _Batch) -> None:
        for key, task in zip(batch.keys, batch.tasks, strict=True):
            if not task.done():
                self._timed_out.add(key)
                task.cancel()

    def _handled(self, batch: _Batch, index: int) -> None:
        """The handler returned: the timer waits for its mark (with the latest claim)."""
        key = batch.keys[index]
        entry, _ = self._running.pop(key)
        self._marking[key] = entry.due_at
        self._queue_mark(key, entry._reached(batch.reached_at))
        if self._failing.records:
            self._failing.pop(key)
        batch.done(index, None)
        if self._starved or self._asleep.is_set():
            self._wake.set()  # a place is free

    def _queue_mark(self, key: TimerKey, reached: TimerEntry) -> None:
        to_mark = self._to_mark
        if not to_mark:
            self._marks_wanted.set()
        to_mark.append(reached)
        self._to_mark_keys.append(key)
        if len(to_mark) >= _MARK_BATCH or not self._draining():
            self._marks_ready.set()

    def _failed(
        self, batch: _Batch, index: int, error: Exception | None, *, cancelled: bool
    ) -> None:
        """The call raised, timed out or was cancelled: the timer stays ``Scheduled``."""
        key = batch.keys[index]
        entry, _ = self._running.pop(key)
        if not self._draining():
            self._marks_ready.set()  # the marks waiting for more need not wait
        timed_out = key in self._timed_out
        self._timed_out.discard(key)
        if cancelled and not timed_out:
            # Cut off by the shutdown: it stays Scheduled and is delivered again later.
            batch.done(index, HandlerFailed(f"{_name(entry)}: cancelled by the shutdown"))
            return
        why = (
            f"timed out after {self._settings.timeout_s:g}s"
            if error is None
            else f"{type(error).__name__}: {error}"
        )
        failure = HandlerFailed(f"the handler of {_name(entry)} failed: {why}")
        failure.__cause__ = error
        self._note_failure(entry, failure, error)
        batch.done(index, failure)
        if self._starved or self._asleep.is_set():
            self._wake.set()  # a place is free, or a held-back timer no longer masks others

    def _note_failure(
        self, entry: TimerEntry, failure: HandlerFailed, error: BaseException | None
    ) -> None:
        record = self._failing.record_of(entry)
        record.failures += 1
        record.error = str(failure)
        settings = self._settings
        self._instrumentation.publish_failed(entry, failure)
        if record.failures >= settings.max_attempts:
            why = f"its handler failed {record.failures} times"
            self._failing.quarantine(record, failure, why, cause=error)
            return
        delay = settings.retry_delay(record.failures, self._rng.random())
        record.retry_at = self._clock.monotonic() + delay
        log.warning(
            "%s; attempt %d of %d, next in %.3fs",
            failure,
            record.failures,
            settings.max_attempts,
            delay,
            exc_info=error,
        )
        # A retry sooner than the planned wake-up: the sleep must be shortened.
        self._wake.set()

    # -- marks --------------------------------------------------------------------------

    async def _mark_loop(self) -> None:
        failures = 0
        while True:
            if not self._to_mark:
                if self._stop.is_set() and not self._running:
                    return
                self._marks_wanted.clear()
                await self._marks_wanted.wait()
                continue
            await self._gather_marks()
            batch, self._to_mark = self._to_mark[:_MARK_BATCH], self._to_mark[_MARK_BATCH:]
            keys = self._to_mark_keys[:_MARK_BATCH]
            del self._to_mark_keys[:_MARK_BATCH]
            if self._reclaimed:
                batch = [
                    self._latest_claim(key, entry) for key, entry in zip(keys, batch, strict=True)
                ]
            try:
                await self._store.mark_reached(batch)
            except Exception as exc:
                failures += 1
                self._to_mark[:0] = batch
                self._to_mark_keys[:0] = keys
                if self._stop.is_set() and not self._running:
                    log.warning(
                        "could not mark %d handled timers at shutdown (%s); they will be "
                        "delivered again",
                        len(self._to_mark),
                        exc,
                    )
                    return
                delay = min(self._interval, 0.05 * 2 ** min(failures - 1, 30))
                log.warning("marking handled timers failed (%s); retrying in %.2fs", exc, delay)
                await self._sleep(delay, wakeable=False)
                continue
            failures = 0
            if self._reclaimed:
                # Claimed anew while the mark ran: that mark was fenced out, so again.
                again = [i for i, key in enumerate(keys) if key in self._reclaimed]
                if again:
                    self._to_mark[:0] = [batch[i] for i in again]
                    self._to_mark_keys[:0] = [keys[i] for i in again]
                    left = set(again)
                    batch = [entry for i, entry in enumerate(batch) if i not in left]
                    keys = [key for i, key in enumerate(keys) if i not in left]
            marking, just_marked = self._marking, self._just_marked
            for key, entry in zip(keys, batch, strict=True):
                if marking.get(key) == entry.due_at:
                    del marking[key]
                    just_marked[key] = entry
            self._instrumentation.timers_fired(batch)
            if not marking:
                self._wake.set()  # a test's wait_until_idle is waiting for this

    def _draining(self) -> bool:
        """Whether more handled timers are coming at once: calls run, or a drain is on."""
        return bool(self._running) or self._cursor is not None

    async def _gather_marks(self) -> None:
        """While draining, wait up to :data:`_MARK_GATHER_S` for a full mark's worth."""
        if len(self._to_mark) >= _MARK_BATCH or not self._draining() or self._stop.is_set():
            return
        self._marks_ready.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._marks_ready.wait(), _MARK_GATHER_S)

    def _latest_claim(self, key: TimerKey, entry: TimerEntry) -> TimerEntry:
        claim = self._reclaimed.pop(key, None)
        return entry if claim is None else attrs.evolve(entry, claim=claim)

    # -- sleeping -----------------------------------------------------------------------

    async def _idle(self) -> None:
        now = self._clock.now()
        delay = self._interval
        next_due: datetime | None = None
        # With every place taken, a call that ends wakes the worker; until then it waits.
        if len(self._running) < self._settings.max_concurrency:
            next_due = await self._next_due(now)
            if next_due is not None:
                delay = min(delay, max(0.0, (next_due - now).total_seconds()))
            retry_in = self._next_retry_in()
            if retry_in is not None:
                delay = min(delay, retry_in)
        if self._retention is not None:
            await self._retention.purge(
                next_due,
                lambda: self._stop.is_set() or self._wake.is_set(),
                commands=self._commands.busy,
            )
        if self._failing:
            await self._failing.forget_stale()
        self._wake_at = now + timedelta(seconds=delay)
        self._sleep_until = self._clock.monotonic() + delay
        self._asleep.set()
        try:
            await self._sleep(delay, wakeable=True)
        finally:
            self._asleep.clear()

    async def _next_due(self, now: datetime) -> datetime | None:
        """The earliest due time of a timer not held back here, as far as can be told."""
        held = len(self._running) + len(self._marking) + len(self._failing)
        if not held:
            return await self._store.next_due_at()
        if isinstance(self._store, LeasesClaims):
            # Looking past held timers would claim timers not due: poll instead, less often
            # when only quarantined timers are held (the broker path's masked poll).
            quarantined_only = not (self._running or self._marking) and all(
                record.quarantined_at is not None for record in self._failing
            )
            poll = _QUARANTINED_POLL_S if quarantined_only else _MASKED_POLL_S
            return now + timedelta(seconds=poll)
        horizon = now + timedelta(seconds=self._interval)
        for entry in await self._find_due(horizon, held + 1, None):
            if self._eligible(entry, entry.key):
                return entry.due_at
        return None

    def _next_retry_in(self) -> float | None:
        pending = [r.retry_at for r in self._failing if r.quarantined_at is None]
        if not pending:
            return None
        return max(0.0, min(pending) - self._clock.monotonic())

    async def _sleep(self, seconds: float, *, wakeable: bool) -> None:
        interrupt = self._wake if wakeable else self._stop
        await sleep_unless(self._clock, seconds, interrupt, stop=self._stop)

    # -- shutdown -----------------------------------------------------------------------

    async def _wind_down(self) -> None:
        """Give calls in flight the grace period, cancel the rest, release their claims."""
        if not self._running:
            return
        tasks = [task for _, task in self._running.values()]
        log.info(
            "waiting up to %gs for %d handler calls", self._settings.shutdown_grace_s, len(tasks)
        )
        _, late = await asyncio.wait(tasks, timeout=self._settings.shutdown_grace_s)
        if not late:
            return
        unfinished = [entry for entry, task in list(self._running.values()) if task in late]
        for task in late:
            task.cancel()
        await asyncio.wait(late)
        log.warning(
            "%d handler calls did not finish within %gs of the shutdown; they stay Scheduled "
            "and are delivered again",
            len(unfinished),
            self._settings.shutdown_grace_s,
        )
        if unfinished and isinstance(self._store, LeasesClaims):
            try:
                await self._store.release_claims(unfinished)
            except StoreError as exc:
                log.warning("releasing unfinished timers' claims failed (%s)", exc)


def _cursor_of(entry: TimerEntry) -> DueCursor:
    return DueCursor(entry.due_at, entry.tenant_id, entry.service_call_id)


def _name(entry: TimerEntry) -> str:
    return f"{entry.tenant_id}/{entry.service_call_id}"
