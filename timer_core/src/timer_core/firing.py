"""The firing pipeline: find due timers, hand each to a delivery, mark the delivered ``Reached``.

One object with named state. :meth:`FiringPipeline.step` finds the next due timers (shared
among tenants after a full batch, claimed from a leasing store) and hands them to its
:class:`~timer_core.delivery.Delivery` (a broker's publish, the host's handler). Each timer's
outcome comes back as it completes: a delivered timer joins the next mark (marks are
gathered, beside the deliveries), a failed one is handed back (its claim released) and
reported to :attr:`FiringPipeline.on_failed`. Nothing waits for a slow or failing timer:
the next finds go on while its delivery runs, and it is never handed out again meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import attrs

from timer_core._entry import TimerEntry, TimerKey
from timer_core._ids import TenantId
from timer_core._messages import DueTimeReached, MessageEnvelope
from timer_core._time import floor_ms
from timer_core.delivery import Delivery, PublishedEvents
from timer_core.errors import PublishError, StoreError
from timer_core.events import due_events
from timer_core.instrumentation import NO_INSTRUMENTATION, BatchObserver, Instrumentation
from timer_core.ports import (
    Clock,
    DueCursor,
    EnvelopeIdGenerator,
    EventPublisher,
    FindsDueByTenant,
    LeasesClaims,
    TimerStore,
    Uuid7EnvelopeIds,
)

__all__ = ["DrainReport", "DueBatch", "FiringPipeline", "FiringReport", "PublishedEvents"]

log = logging.getLogger(__name__)
#: Delivered timers marked together at most: a commit rewrites every page it touches, and on
#: SQLite marks of 100 cost about twice per timer what marks of 1,000 do (bench/README.md).
MARK_AT_ONCE = 1000
#: While deliveries run or a drain goes on, a mark waits up to this long (real time) for
#: more delivered timers to mark in the same commit. Only the ``Reached`` state waits.
_MARK_GATHER_S = 0.025
#: Most tenants a drain keeps a keyset cursor for (tenant fairness); a drain over more ends
#: after the batch that passes it and the next drain starts afresh.
_MAX_TENANT_CURSORS = 10_000
_LEASE_OVER = "not acknowledged before the claim lease ran out"
#: A page read ahead is handed out only this soon after its read began (seconds, on the
#: pipeline's clock); one that waited longer for places is read again.
_AHEAD_FRESH_S = 0.05
#: Most timers a page read ahead holds (at least ``batch_size``).
READ_AHEAD = 1000


@attrs.frozen
class FiringReport:
    """What one batch of the pipeline did (:meth:`FiringPipeline.fire`)."""

    found: int
    """Due timers read from the store (at most the batch size)."""
    fired: list[TimerEntry]
    """Timers delivered and marked ``Reached`` (each with its ``reached_at``)."""
    failed: list[tuple[TimerEntry, PublishError]]
    """Timers whose delivery failed; they stay ``Scheduled`` for a later pass."""
    cursor: DueCursor | None
    """The position of the last timer read, for keyset pagination past failures."""
    expired: list[TimerEntry] = attrs.field(factory=list)
    """Claimed timers not delivered because the store's claim lease ran out before the
    delivery could start; left ``Scheduled`` for a later claim (see
    :attr:`~timer_core.ports.LeasesClaims.claim_lease_s`)."""

    @property
    def batch_full(self) -> bool:
        """Whether the store may hold more due timers than this pass read."""
        return self.cursor is not None and self.found > 0


@attrs.frozen
class DrainReport:
    """What one :meth:`FiringPipeline.drain` did, in counts (a drain may fire millions)."""

    batches: int
    """Batches found and handed out."""
    fired: int
    """Timers delivered and marked ``Reached``."""
    failed: list[tuple[TimerEntry, PublishError]]
    """Timers whose delivery failed; they stay ``Scheduled`` for a later drain."""
    expired: int = 0
    """Claimed timers not delivered because their claim lease ran out first."""


@attrs.frozen
class DueBatch:
    """A batch of due timers as one find read them (from a leasing store, claimed them: each
    entry carries its claim), and when."""

    due: list[TimerEntry]
    now: datetime
    """The instant the timers were found due at, and are reached at."""
    started: float
    """``clock.monotonic()`` when the find started (a lease counts from then)."""
    cursor: DueCursor | None
    """The position of the last timer read when the batch was full, else None."""
    tenants: Mapping[TenantId, DueCursor] | None = None
    """Where each tenant's timers stand after this batch, for the next batch shared among
    tenants; None when the batch was not full."""


class _Sent:
    """A batch handed to the delivery, and the delivery's ``done``: each timer's outcome as
    it comes (called per timer, or told several delivered at once:
    :func:`~timer_core.ports.tell_delivered`), its marks."""

    __slots__ = (
        "batch",
        "call",
        "envelopes",
        "expired",
        "failed",
        "keys",
        "lease",
        "left",
        "observer",
        "pipeline",
        "reached",
        "results",
        "settled",
        "unmarked",
    )

    def __init__(
        self,
        pipeline: FiringPipeline,
        batch: DueBatch,
        envelopes: list[MessageEnvelope[DueTimeReached]],
        observer: BatchObserver,
    ) -> None:
        self.pipeline = pipeline
        self.batch = batch
        self.keys: list[TimerKey] = []
        """Each timer's key, in the batch's order (once handed out)."""
        self.envelopes = envelopes
        self.observer = observer
        self.results: list[PublishError | bool | None] = [False] * len(batch.due)
        self.left = len(batch.due)
        self.unmarked = 0
        self.reached: list[TimerEntry] = []
        self.failed: list[tuple[TimerEntry, PublishError]] = []
        self.expired: list[TimerEntry] = []
        self.call: asyncio.Future[None] | None = None
        self.lease: asyncio.Future[None] | None = None
        self.settled: asyncio.Future[None] | None = None

    def __call__(self, index: int, error: PublishError | None) -> None:
        self.pipeline._outcome(self, index, error)

    def delivered(self, indices: Sequence[int]) -> None:
        self.pipeline._delivered_many(self, indices)

    def fail_untold(self, error: PublishError) -> None:
        if self.left:
            for index, result in enumerate(self.results):
                if result is False:
                    self(index, error)


class FiringPipeline:
    """Finds due timers in ``store``, hands each to ``delivery``, marks the delivered.

    Delivery comes before the mark, so a crash in between delivers the same firing again
    (same envelope id) rather than losing it. A timer whose delivery fails stays
    ``Scheduled``, is handed back and does not stop the others. With a leasing store
    (:class:`~timer_core.ports.LeasesClaims`) nothing is delivered once the claim's lease may
    have run out, a publish is awaited only until then, and the mark carries the latest
    claim. Due timers for which :attr:`exclude` says so are left out (the worker's backoff
    and quarantine), their claims released.
    """

    def __init__(
        self,
        store: TimerStore,
        delivery: Delivery | EventPublisher,
        clock: Clock,
        *,
        batch_size: int,
        ids: EnvelopeIdGenerator | None = None,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
        mark_at_once: int = MARK_AT_ONCE,
    ) -> None:
        self.store = store
        self.delivery = (
            PublishedEvents(delivery, instrumentation=instrumentation)
            if isinstance(delivery, EventPublisher)
            else delivery
        )
        self.clock = clock
        self.batch_size = batch_size
        self.ids = ids or Uuid7EnvelopeIds()
        self.instrumentation = instrumentation
        self.mark_at_once = mark_at_once
        self.exclude: Callable[[TimerEntry], bool] | None = None
        """Due timers left out of every find while it says so (None: none)."""
        self.excluding: Callable[[], bool] = _always
        """Whether :attr:`exclude` may leave any out now (asked after each read, so a
        failure told while the read ran counts)."""
        self.on_failed: Callable[[TimerEntry, PublishError], None] | None = None
        """Told of each timer whose delivery failed, as it does."""
        self.on_delivered: Callable[[Sequence[TimerEntry]], None] | None = None
        """Told of the timers delivered, as they are (before their mark): those whose
        outcomes came in together at once."""
        self.on_change: Callable[[], None] | None = None
        """Told when a place frees up or a mark ends (the worker may look again)."""
        self.lease_s: float | None = (
            store.claim_lease_s if isinstance(store, LeasesClaims) else None
        )
        """How long the store's claims last (None: it takes none)."""
        self.in_flight = 0
        """Timers handed to the delivery whose outcome is not in yet."""
        self.window: int | None = None
        """Most timers in flight at once, when fewer than the delivery's places (the worker
        narrows it while nothing is delivered)."""
        self.cursor: DueCursor | None = None
        """Where the drain under way stands (None: the next find starts from the first)."""
        self.storing = 0
        """Commands being stored in this process now: no page is read ahead meanwhile (the
        worker's :meth:`~timer_core.worker.TimerWorker.storing_commands`)."""
        self._tenants: Mapping[TenantId, DueCursor] | None = None
        # Timers delivering or waiting for their mark, by key: the entry as last found (its
        # latest claim). Never handed out again while here.
        self._held: dict[TimerKey, TimerEntry] = {}
        # Delivered, mark not begun: (key, reached at, its batch or None for a re-mark).
        self._to_mark: list[tuple[TimerKey, datetime, _Sent | None]] = []
        self._marking_keys: set[TimerKey] = set()
        self._reclaimed: set[TimerKey] = set()
        # Marked while the find under way read: it may still see them Scheduled.
        self._just_marked: dict[TimerKey, TimerEntry] = {}
        self._marker: asyncio.Task[None] | None = None
        self._moved = asyncio.Event()  # an outcome came in, or a mark began or ended
        self._mark_full = asyncio.Event()
        self._closing = False
        self._batches: set[_Sent] = set()
        # The pages read ahead (see _prefetch), in order, each with where the drain stood.
        self._ahead: collections.deque[_Page] = collections.deque()
        self._spawned: set[asyncio.Future[None]] = set()
        self.retry_marks = False
        """Whether a failed mark is retried (the worker's) rather than raised (``fire``)."""
        self.mark_error: Exception | None = None
        """Why the last mark failed, while its timers wait to be marked again."""

    # -- what the worker reads ------------------------------------------------------------

    @property
    def room(self) -> int:
        """How many timers the next find may hand out."""
        window = self.delivery.places if self.window is None else self.window
        return max(0, min(self.batch_size, window - self.in_flight))

    @property
    def busy(self) -> bool:
        """Whether timers are delivering or waiting for their mark."""
        return bool(self._held) or bool(self._to_mark)

    @property
    def held(self) -> int:
        """Timers delivering or waiting for their mark."""
        return len(self._held)

    def holds(self, entry: TimerEntry) -> bool:
        """Whether this timer is delivering or waiting for its mark here."""
        return entry.key in self._held

    # -- one batch, and a drain ----------------------------------------------------------

    async def fire(self, after: DueCursor | None = None) -> FiringReport:
        """One batch: find due timers (after ``after``), deliver them, mark the delivered;
        returns once every outcome is in and marked. ``report.cursor`` is set when the
        batch was full, so the caller can continue after it."""
        batch = await self.find(after)
        if not batch.due:
            return FiringReport(0, [], [], None)
        sent = self.send(batch)
        await self.settle()
        return FiringReport(len(batch.due), sent.reached, sent.failed, batch.cursor, sent.expired)

    async def drain(self) -> DrainReport:
        """Find and hand out batch after batch while they come back full, then wait for
        every outcome and mark."""
        self.cursor, self._tenants = None, None
        sent: list[_Sent] = []
        try:
            while True:
                if self.room <= 0:
                    self._moved.clear()  # set when an outcome comes in (a place frees up)
                    await self._moved.wait()
                    continue
                found = await self.step()
                if found is not None:
                    sent.append(found)
                if self.cursor is None:
                    break
            await self.settle()
        finally:
            self.cursor, self._tenants = None, None
        return DrainReport(
            batches=len(sent),
            fired=sum(len(s.reached) for s in sent),
            failed=[failure for s in sent for failure in s.failed],
            expired=sum(len(s.expired) for s in sent),
        )

    async def step(self) -> _Sent | None:
        """Find the next due timers (up to :attr:`room`) where the drain stands and hand
        them out; the batch sent, if any. :attr:`cursor` is set while more may be due."""
        limit = self.room
        if limit <= 0:
            return None
        batch = await self._prefetched(limit)
        if batch is None:
            batch = await self.find(self.cursor, tenants=self._tenants, limit=limit)
        self.cursor, self._tenants = batch.cursor, batch.tenants
        if not batch.due:
            return None
        if self._prefetch():
            await asyncio.sleep(0)  # the read ahead is handed to the store before the send
        return self.send(batch)

    def restart(self) -> None:
        """End the drain under way: the next find starts from the first due timer."""
        self.cursor, self._tenants = None, None
        self.drop_read_ahead()

    def _prefetch(self) -> bool:
        """While a drain goes on, start reading its next page before this one is handed out,
        so the store's read runs beside the envelopes' making and the deliveries; on a store
        that takes no claims only (a page read ahead and then cut short or dropped costs
        nothing but the read). A page read ahead holds up to :data:`READ_AHEAD` timers,
        handed out ``batch_size`` (or the places free) at a time, the page after it read
        meanwhile: a find's cost is mostly per find (the tenants' shares), so larger pages
        cost less per timer."""
        if self._ahead or not self._reads_ahead():
            return False
        self._read_ahead(self.cursor, self._tenants)
        return True

    def _reads_ahead(self) -> bool:
        return not (self.lease_s is not None or self._closing or self.storing)

    def _read_ahead(
        self, cursor: DueCursor | None, tenants: Mapping[TenantId, DueCursor] | None
    ) -> None:
        if cursor is None:
            return  # the drain ends with the page before
        reading = asyncio.ensure_future(
            self.find(cursor, tenants=tenants, limit=max(self.batch_size, READ_AHEAD))
        )
        self._ahead.append(_Page(reading, cursor, tenants))

    async def _prefetched(self, limit: int) -> DueBatch | None:
        """The page read ahead, if it is where the drain stands and still fresh: at most
        ``limit`` timers of it (and of ``batch_size``), the rest kept for the next step."""
        if not self._ahead:
            return None
        page = self._ahead.popleft()
        if page.cursor is not self.cursor or page.tenants is not self._tenants:
            _drop(page.reading)
            self.drop_read_ahead()
            return None
        batch = await page.reading
        if self.clock.monotonic() - batch.started > _AHEAD_FRESH_S:
            # Read too long ago (a wait for places, a slow delivery): what it found may have
            # been cancelled or moved since, and its instant is no longer "now". Read again.
            self.drop_read_ahead()
            return None
        limit = min(limit, self.batch_size)
        if len(batch.due) <= limit:
            return batch
        due = batch.due if page.rest else _in_rounds(batch.due)
        # The first ``limit`` now, the drain standing after them (each tenant after its last
        # one taken, or where it stood before); the rest on the next step, and the page
        # after it read meanwhile.
        kept = due[:limit]
        positions = dict(page.tenants or {})
        cut = max(_advance(positions, kept))
        now = DueBatch(kept, batch.now, batch.started, cut, positions)
        rest = DueBatch(due[limit:], batch.now, batch.started, batch.cursor, batch.tenants)
        self._ahead.appendleft(_Page(_resolved(rest), now.cursor, now.tenants, rest=True))
        if len(self._ahead) == 1 and self._reads_ahead() and batch.cursor is not None:
            self._read_ahead(batch.cursor, batch.tenants)
            await asyncio.sleep(0)  # the read is handed to the store before this batch goes
        return now

    def drop_read_ahead(self) -> None:
        """Forget the pages read ahead (commands may have changed their timers): the next
        step reads afresh."""
        while self._ahead:
            _drop(self._ahead.popleft().reading)

    async def settle(self) -> None:
        """Wait until every timer handed out has its outcome, and every delivered one is
        marked; a failing mark raises (unless :attr:`retry_marks`)."""
        while self._batches or self._to_mark or self._spawned:
            waits: set[asyncio.Future[Any]] = {
                s.settled for s in self._batches if s.settled is not None
            } | self._spawned
            if self._to_mark:
                self._ensure_marker()
                if not self._more_coming():
                    self._mark_full.set()
            marker = self._marker
            if marker is not None:
                if marker.done():
                    self._marker = None
                    marker.result()  # its error, if the mark failed
                    continue
                waits.add(marker)
            self._moved.clear()
            moved = asyncio.ensure_future(self._moved.wait())
            try:
                await asyncio.wait(waits | {moved}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                moved.cancel()

    # -- find --------------------------------------------------------------------------

    async def find(
        self,
        after: DueCursor | None = None,
        *,
        tenants: Mapping[TenantId, DueCursor] | None = None,
        limit: int | None = None,
    ) -> DueBatch:
        """The next batch: in global due order after ``after``, or, after a full batch
        (``tenants`` given) from a store that can, shared among the tenants with due timers
        after their cursors. Timers held here (delivering, waiting for their mark) and
        excluded ones are left out; a leasing store's claims on the excluded are released,
        those on held ones kept for their mark."""
        store, clock = self.store, self.clock
        limit = self.batch_size if limit is None else limit
        started = clock.monotonic()
        now = floor_ms(clock.now())
        by_tenant = store if tenants is not None and isinstance(store, FindsDueByTenant) else None
        positions: dict[TenantId, DueCursor] = dict(tenants or {})
        self._just_marked.clear()
        while True:
            if by_tenant is not None:
                due = await by_tenant.find_due_by_tenant(now, limit, after=positions)
            else:
                due = await store.find_due(now, limit, after=after)
            full = len(due) >= limit
            cursor = DueCursor.of(due[-1]) if full else None
            if full:
                _advance(positions, due)
            if due and (self._held or self._just_marked):
                # One lookup per key in C first: mostly none of the page is held here.
                keys = [entry.key for entry in due]
                if not (
                    self._held.keys().isdisjoint(keys) and self._just_marked.keys().isdisjoint(keys)
                ):
                    due = [entry for entry in due if not self._held_back(entry, now)]
            exclude = self.exclude
            if due and exclude is not None and self.excluding():
                left_out = [entry for entry in due if exclude(entry)]
                if left_out:
                    due = [entry for entry in due if not exclude(entry)]
                    await self.release(left_out)
            if due and cursor is not None and len(positions) > _MAX_TENANT_CURSORS:
                # A backlog over more tenants than that: the drain ends after this batch, so
                # its memory stays bounded whatever the number of tenants.
                cursor = None
            if due or cursor is None:
                break
            after = cursor
        if not due:
            self.instrumentation.poll_completed(clock.monotonic() - started, 0)
            return DueBatch([], now, started, cursor, positions if cursor is not None else None)
        return DueBatch(due, now, started, cursor, positions if cursor is not None else None)

    def _held_back(self, entry: TimerEntry, now: datetime) -> bool:
        """Whether a timer found due is held here; a leasing store's new claim on it is kept
        for its mark (it fences out the one before)."""
        key = entry.key
        held = self._held.get(key)
        if held is not None:
            if entry.claim is not None and held.due_at == entry.due_at:
                self._held[key] = entry
                if key in self._marking_keys:
                    self._reclaimed.add(key)
            return True
        marked = self._just_marked.get(key)
        if marked is not None and marked.due_at == entry.due_at:
            # Marked while this find read. A leasing store's claim taken before the mark (and
            # fencing it out) leaves it Scheduled: marked again under that claim.
            if entry.claim is not None:
                assert marked.reached_at is not None
                self._held[key] = entry
                self._queue_marks([(key, marked.reached_at, None)])
            return True
        return False

    # -- deliver -----------------------------------------------------------------------

    def send(self, batch: DueBatch) -> _Sent:
        """Hand a found batch to the delivery (within its lease); returns at once."""
        due, now, clock = batch.due, batch.now, self.clock
        lease = self.lease_s
        within: float | None = None
        if lease is not None:
            within = batch.started + lease - clock.monotonic()
            if within <= 0:
                log.warning(
                    "claiming %d due timers outlasted the %.1fs lease; not delivering them",
                    len(due),
                    lease,
                )
                sent = _Sent(self, batch, [], NO_OBSERVER)
                sent.expired = list(due)
                sent.left = 0
                self._spawn(self.release(due))
                self.instrumentation.poll_completed(clock.monotonic() - batch.started, 0)
                return sent
        envelopes = due_events(due, now, self.ids)
        observer = self.instrumentation.firing_started(envelopes)
        sent = _Sent(self, batch, envelopes, observer)
        sent.keys = keys = [entry.key for entry in due]
        self._held.update(zip(keys, due, strict=True))
        self.in_flight += len(due)
        self._batches.add(sent)
        sent.settled = asyncio.get_running_loop().create_future()

        call = self.delivery.start(envelopes, sent)
        if within is not None and call is not None and not call.done():
            sent.call = call
            sent.lease = asyncio.ensure_future(self._lease_over(sent, within))
        return sent

    async def _lease_over(self, sent: _Sent, within: float) -> None:
        """At the end of the claim's lease, a publish still unacknowledged is cut off: its
        timers fail (one may still reach the broker: it carries the firing's id, so the
        broker drops it as a duplicate of the next instance's)."""
        await self.clock.sleep(within)
        call = sent.call
        if call is not None and not call.done():
            log.warning(
                "publishing %d due timers did not finish within their claim lease; "
                "they stay Scheduled for a later claim",
                sent.left,
            )
            call.cancel(_LEASE_OVER)

    def _outcome(self, sent: _Sent, index: int, error: PublishError | None) -> None:
        """One timer's outcome: marked with the next mark, or handed back."""
        if error is None:
            self._delivered_many(sent, (index,))
            return
        if sent.results[index] is not False:
            return  # told twice: the first counts
        sent.results[index] = error
        entry = sent.batch.due[index]
        self.in_flight -= 1
        sent.left -= 1
        latest = self._held.pop(sent.keys[index], entry)
        sent.failed.append((latest, error))
        self.instrumentation.publish_failed(latest, error)
        if self.on_failed is not None:
            self.on_failed(latest, error)
        if sent.left == 0:
            self._delivered(sent)
        self._moved.set()
        if self.on_change is not None:
            self.on_change()

    def _delivered_many(self, sent: _Sent, indices: Iterable[int]) -> None:
        """The timers at ``indices`` of a batch were delivered (one, or several whose
        outcomes came in together: acknowledgements, handler calls that ended on one turn,
        a batch handler's call): their bookkeeping in one step, not per timer."""
        results = sent.results
        due = sent.batch.due
        told = [index for index in indices if results[index] is False]  # the first counts
        if not told:
            return
        fresh = []
        keys = sent.keys
        now = sent.batch.now
        marks: list[tuple[TimerKey, datetime, _Sent | None]] = []
        for index in told:
            results[index] = None
            fresh.append(due[index])
            marks.append((keys[index], now, sent))
        count = len(fresh)
        self.in_flight -= count
        sent.left -= count
        sent.unmarked += count
        self._queue_marks(marks)
        if self.on_delivered is not None:
            self.on_delivered(fresh)
        if sent.left == 0:
            self._delivered(sent)
        self._moved.set()
        if self.on_change is not None:
            self.on_change()

    def _delivered(self, sent: _Sent) -> None:
        """Every outcome of a batch is in: report them; hand the failed back."""
        if sent.lease is not None:
            sent.lease.cancel()
        sent.observer.published([r if r is not False else None for r in sent.results])  # type: ignore[misc]
        if sent.failed:
            failed = sent.failed
            log.warning(
                "delivery failed for %d of %d due timers (first: %s/%s: %s); they stay Scheduled",
                len(failed),
                len(sent.batch.due),
                failed[0][0].tenant_id,
                failed[0][0].service_call_id,
                failed[0][1],
            )
            self._spawn(self.release([entry for entry, _ in failed]))
        if sent.unmarked == 0:
            self._finished(sent)

    def _finished(self, sent: _Sent) -> None:
        sent.observer.finished()
        self.instrumentation.poll_completed(
            self.clock.monotonic() - sent.batch.started, len(sent.reached)
        )
        self._batches.discard(sent)
        if sent.settled is not None and not sent.settled.done():
            sent.settled.set_result(None)

    # -- mark --------------------------------------------------------------------------

    async def marked_or(self, event: asyncio.Event) -> None:
        """Wait until the marks under way end, or ``event`` is set."""
        marker = self._marker
        if marker is None or marker.done() or event.is_set():
            return
        waking = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({marker, waking}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waking.cancel()

    def _queue_marks(self, marks: list[tuple[TimerKey, datetime, _Sent | None]]) -> None:
        """Queue delivered timers for the next mark: (key, reached at, its batch or None)."""
        to_mark = self._to_mark
        to_mark += marks
        self._ensure_marker()
        if len(to_mark) >= self.mark_at_once or not self._more_coming():
            self._mark_full.set()

    def _more_coming(self) -> bool:
        """Whether more delivered timers are coming at once: deliveries run, or a drain."""
        return bool(self.in_flight) or self.cursor is not None

    def _ensure_marker(self) -> asyncio.Task[None]:
        marker = self._marker
        if marker is not None and not self._closing:
            if self.mark_error is not None:
                return marker  # the worker retries it (mark_again)
            if marker.done() and not marker.cancelled() and marker.exception() is not None:
                return marker  # failed: settle() raises its error
        if self._marker is None or self._marker.done():
            self._marker = asyncio.ensure_future(self._mark_loop())
        return self._marker

    async def mark_again(self) -> None:
        """Retry the marks that failed (:attr:`mark_error`) now; raises if they fail again."""
        self.mark_error = None
        marker = self._marker
        if marker is None or marker.done():
            marker = self._marker = asyncio.ensure_future(self._mark_loop(gather=False))
        await marker
        if self.mark_error is not None:
            raise self.mark_error

    async def _mark_loop(self, *, gather: bool = True) -> None:
        """Mark delivered timers, gathered (up to :attr:`mark_at_once` a commit), until none
        are left or a mark fails (:attr:`mark_error`, unless :attr:`retry_marks` is off:
        then it raises)."""
        try:
            await self._mark_all(gather=gather)
        finally:
            self._moved.set()

    async def _mark_all(self, *, gather: bool) -> None:
        while self._to_mark:
            if (
                gather
                and len(self._to_mark) < self.mark_at_once
                and self._more_coming()
                and not self._closing
            ):
                self._mark_full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._mark_full.wait(), _MARK_GATHER_S)
            group, self._to_mark = (
                self._to_mark[: self.mark_at_once],
                self._to_mark[self.mark_at_once :],
            )
            held = self._held
            entries = [held[key]._reached(at) for key, at, _ in group]
            self._marking_keys = {key for key, _, _ in group}
            try:
                await self.store.mark_reached(entries)
            except Exception as exc:
                self._to_mark[:0] = group
                self._marking_keys = set()
                if not self.retry_marks:
                    for key, _, _ in self._to_mark:
                        held.pop(key, None)
                    self._to_mark = []
                    raise
                if self._closing:
                    log.warning(
                        "could not mark %d delivered timers at shutdown (%s); they will be "
                        "delivered again",
                        len(self._to_mark),
                        exc,
                    )
                    for key, _, _ in self._to_mark:
                        held.pop(key, None)
                    self._to_mark = []
                    return
                # The worker retries it as it retries a failed pass (mark_again).
                self.mark_error = exc
                if self.on_change is not None:
                    self.on_change()
                return
            self._marking_keys = set()
            marked: list[TimerEntry] = []
            for (key, at, sent), entry in zip(group, entries, strict=True):
                if key in self._reclaimed:
                    # Claimed anew while the mark ran, which that claim fenced out: again.
                    self._reclaimed.discard(key)
                    self._to_mark.append((key, at, sent))
                    continue
                held.pop(key, None)
                self._just_marked[key] = entry
                marked.append(entry)
                if sent is not None:
                    sent.reached.append(entry)
                    sent.unmarked -= 1
                    if sent.unmarked == 0 and sent.left == 0:
                        self._finished(sent)
            if marked:
                self.instrumentation.timers_fired(marked)
            if self.on_change is not None:
                self.on_change()

    async def close(self) -> None:
        """Stop: the deliveries under way end (see their ``aclose``), then the delivered are
        marked (a mark failing now is only logged: those timers are delivered again)."""
        self._closing = True
        self.drop_read_ahead()
        await self.delivery.aclose()
        for sent in list(self._batches):
            if sent.lease is not None:
                sent.lease.cancel()
        self._mark_full.set()
        marker = self._marker
        if self._to_mark:
            marker = self._ensure_marker()
        if marker is not None:
            try:
                await marker
            except Exception as exc:
                log.warning("marking delivered timers failed at shutdown (%s)", exc)
        while self._spawned:
            await asyncio.wait(set(self._spawned))

    # -- hand back ----------------------------------------------------------------------

    async def release(self, entries: Sequence[TimerEntry]) -> None:
        """Hand the claims ``entries`` carry back to a leasing store (nothing otherwise)."""
        store = self.store
        if not entries or not isinstance(store, LeasesClaims):
            return
        # Only a shortcut (leases run out anyway), so a failure here must not fail the pass.
        try:
            await store.release_claims(entries)
        except StoreError as exc:
            log.warning(
                "could not release %d timer claims (%s); their leases will expire",
                len(entries),
                exc,
            )

    def _spawn(self, work: Any) -> None:
        if not isinstance(self.store, LeasesClaims):
            work.close()
            return
        task = asyncio.ensure_future(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)


NO_OBSERVER = BatchObserver()


class _Page(NamedTuple):
    """A page read ahead (or what is left of one), and where the drain stood for it."""

    reading: asyncio.Future[DueBatch]
    cursor: DueCursor | None
    tenants: Mapping[TenantId, DueCursor] | None
    rest: bool = False
    """What is left of a page already cut (its timers already in rounds)."""


def _in_rounds(due: list[TimerEntry]) -> list[TimerEntry]:
    """A page read ahead, handed out a batch at a time, in rounds: every tenant's first
    timer, then every tenant's second... (each tenant's in due order), so the first batch of
    a page shares among its tenants as a find of that batch's size would."""
    ranks: dict[TenantId, int] = {}
    rank_of = []
    for entry in due:
        tenant_id = entry.tenant_id
        rank = ranks.get(tenant_id, 0)
        ranks[tenant_id] = rank + 1
        rank_of.append(rank)
    if len(ranks) == 1:
        return due
    order = sorted(range(len(due)), key=rank_of.__getitem__)  # stable: due order within
    return [due[index] for index in order]


def _advance(
    positions: dict[TenantId, DueCursor], entries: Sequence[TimerEntry]
) -> list[DueCursor]:
    """Each tenant of ``entries`` (each tenant's in due order) now stands at its last one:
    one cursor made per tenant; returns those cursors."""
    lasts = {entry.tenant_id: entry for entry in entries}
    cursors = []
    for tenant_id, entry in lasts.items():
        positions[tenant_id] = cursor = DueCursor.of(entry)
        cursors.append(cursor)
    return cursors


def _resolved(batch: DueBatch) -> asyncio.Future[DueBatch]:
    future: asyncio.Future[DueBatch] = asyncio.get_running_loop().create_future()
    future.set_result(batch)
    return future


def _drop(ahead: asyncio.Future[DueBatch]) -> None:
    """A page read ahead and not used: cancelled while it reads, else its outcome retrieved
    (a read that failed is the next find's to report, not an unretrieved task's)."""
    if ahead.done():
        if not ahead.cancelled():
            ahead.exception()
    else:
        ahead.cancel()


def _always() -> bool:
    return True
