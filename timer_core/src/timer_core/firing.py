"""The firing pipeline: find due timers, deliver them, mark what was delivered ``Reached``.

Three steps, each a seam of its own: :meth:`FiringPipeline.find` (what is found, and from a
leasing store claimed: a :class:`DueBatch`), a :class:`Delivery` (how a batch is delivered:
:class:`PublishedEvents` publishes each timer's ``DueTimeReached``), and
:meth:`FiringPipeline.mark` / :meth:`FiringPipeline.release` (how delivered timers are
marked, and the claims on the others handed back). :meth:`FiringPipeline.fire` runs one
batch through them; :meth:`FiringPipeline.drain` runs batch after batch, the store work of
neighbouring batches overlapping the delivery (see :mod:`timer_core._drain`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import attrs

from timer_core._entry import TimerEntry, TimerKey
from timer_core._ids import TenantId
from timer_core._messages import DueTimeReached, MessageEnvelope
from timer_core._time import floor_ms, is_utc_ms
from timer_core.errors import PublishError, StoreError
from timer_core.events import due_events
from timer_core.instrumentation import (
    NO_BATCH_OBSERVER,
    NO_INSTRUMENTATION,
    BatchObserver,
    Instrumentation,
)
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

__all__ = [
    "Delivered",
    "Delivery",
    "DrainReport",
    "DueBatch",
    "FiringPipeline",
    "FiringReport",
    "PendingMark",
    "PublishedEvents",
]

log = logging.getLogger(__name__)
#: Delivered timers a drain on a store without leases marks together at least: a commit
#: rewrites every page it touches, and on SQLite marks of 100 cost about twice per timer
#: what marks of 1,000 do (bench/README.md).
MARK_AT_ONCE = 1000
#: Most tenants a drain keeps a keyset cursor for (tenant fairness); a drain over more ends
#: after the batch that passes it and the next drain starts afresh.
_MAX_TENANT_CURSORS = 10_000


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
class PendingMark:
    """A drain's last mark, still running when the drain returned (``finish_marks=False``).

    The timers in :attr:`keys` are delivered and not yet ``Reached``. Hand it to the next
    drain (``carried=``), which leaves those timers out and lets the mark finish before its
    own; awaiting it waits for the mark (and raises its error).
    """

    marking: asyncio.Future[None]
    keys: frozenset[TimerKey]
    """The timers :attr:`marking` marks."""

    def done(self) -> bool:
        """Whether the mark has finished (or failed)."""
        return self.marking.done()

    def __await__(self) -> Generator[Any, None, None]:
        return self.marking.__await__()


@attrs.frozen
class DrainReport:
    """What one :meth:`FiringPipeline.drain` did, in counts (a drain may fire millions)."""

    batches: int
    """Batches found and fired (an empty first find counts as none)."""
    fired: int
    """Timers delivered and marked ``Reached``."""
    failed: list[tuple[TimerEntry, PublishError]]
    """Timers whose delivery failed; they stay ``Scheduled`` for a later drain."""
    expired: int = 0
    """Claimed timers not delivered because their claim lease ran out first."""
    unfinished_mark: PendingMark | None = None
    """With ``finish_marks=False``: the mark still running when the drain returned, else
    None."""


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

    def report(self, delivered: Delivered | None = None) -> FiringReport:
        """The batch's report, once ``delivered`` (and marked)."""
        if delivered is None:
            return FiringReport(len(self.due), [], [], self.cursor)
        return FiringReport(
            len(self.due), delivered.reached, delivered.failed, self.cursor, delivered.expired
        )


@attrs.frozen
class Delivered:
    """What delivering a batch came to: the timers delivered (as ``Reached`` entries), those
    that failed, those not tried because their claim ran out, and the instrumentation's
    observer of the batch (finished by the mark)."""

    reached: list[TimerEntry]
    failed: list[tuple[TimerEntry, PublishError]]
    expired: list[TimerEntry]
    observer: BatchObserver


class Delivery(Protocol):
    """How the pipeline delivers a batch of due timers.

    :class:`PublishedEvents` publishes each timer's ``DueTimeReached``; another delivery (a
    host's handler called per timer, say) plugs in here. A timer counts as delivered only
    once its result is None; the pipeline marks exactly those ``Reached``, and hands the
    claims on the others back.
    """

    @property
    def keeps_call_order(self) -> bool:
        """Whether deliveries of consecutive batches may overlap and still arrive in due
        order (the drain then sends the next batch while this one is acknowledged)."""
        ...

    async def deliver(
        self, due: Sequence[TimerEntry], now: datetime, within: float | None
    ) -> tuple[list[PublishError | None], BatchObserver]:
        """Deliver ``due`` reached at ``now``: one result per timer, in order (None:
        delivered), and the instrumentation's observer of the batch. With ``within``
        (seconds left of the claim's lease), stop waiting after that long: what is not
        delivered by then fails."""
        ...


@attrs.frozen
class PublishedEvents:
    """The delivery of a batch as ``DueTimeReached`` envelopes, published at once."""

    publisher: EventPublisher
    clock: Clock
    ids: EnvelopeIdGenerator = attrs.field(factory=Uuid7EnvelopeIds)
    instrumentation: Instrumentation = NO_INSTRUMENTATION

    @property
    def keeps_call_order(self) -> bool:
        return self.publisher.keeps_call_order

    async def deliver(
        self, due: Sequence[TimerEntry], now: datetime, within: float | None
    ) -> tuple[list[PublishError | None], BatchObserver]:
        envelopes = due_events(due, now, self.ids)
        observer = self.instrumentation.firing_started(envelopes)
        try:
            if within is None:
                results = await self.publisher.publish_many(envelopes)
            else:
                results = await self._publish_within(envelopes, within)
        except Exception as exc:
            observer.finished(exc)
            raise
        observer.published(results)
        return results, observer

    async def _publish_within(
        self, envelopes: list[MessageEnvelope[DueTimeReached]], budget: float
    ) -> list[PublishError | None]:
        """``publish_many``, but stop waiting after ``budget`` seconds (the rest of the lease).

        Envelopes not acknowledged by then count as failed. One may still reach the broker
        afterwards; it carries the firing's envelope id, so the broker drops it as a
        duplicate if the instance that took the timer over publishes it too.
        """
        publishing = asyncio.ensure_future(self.publisher.publish_many(envelopes))
        lease_over = asyncio.ensure_future(self.clock.sleep(budget))
        try:
            await asyncio.wait({publishing, lease_over}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lease_over.cancel()
            if not publishing.done():
                publishing.cancel()
                await asyncio.wait({publishing})  # nothing of this publish runs on after the pass
        if not publishing.cancelled():
            return publishing.result()
        log.warning(
            "publishing %d due timers did not finish within their claim lease; "
            "they stay Scheduled for a later claim",
            len(envelopes),
        )
        error = PublishError("not acknowledged before the claim lease ran out")
        return [error] * len(envelopes)


class FiringPipeline:
    """Finds due timers in ``store``, delivers them, marks what was delivered ``Reached``.

    Delivery comes before the mark, so a crash in between delivers the same firing again
    (same envelope id) rather than losing it. A timer whose delivery fails stays
    ``Scheduled`` and does not stop the others. With a leasing store
    (:class:`~timer_core.ports.LeasesClaims`), delivery is fenced by the lease: nothing is
    delivered once the lease may have run out, and a delivery is awaited only until then;
    timers not delivered are handed back (:meth:`release`). Due timers for which
    ``exclude(entry)`` is true are left out (the worker's per-timer backoff and quarantine).
    """

    def __init__(
        self,
        store: TimerStore,
        delivery: Delivery,
        clock: Clock,
        *,
        batch_size: int,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
        mark_at_once: int = MARK_AT_ONCE,
    ) -> None:
        self.store = store
        self.delivery = delivery
        self.clock = clock
        self.batch_size = batch_size
        self.instrumentation = instrumentation
        self.mark_at_once = mark_at_once
        """How many delivered timers a drain on a store without leases gathers before it
        marks them in one call (fewer when the drain ends first); a leasing store's batches
        are marked one by one, within their lease."""
        self.exclude: Callable[[TimerEntry], bool] | None = None
        """Due timers left out of every batch while it says so (None: none)."""
        self.lease_s: float | None = (
            store.claim_lease_s if isinstance(store, LeasesClaims) else None
        )
        """How long the store's claims last (None: it takes none)."""

    @classmethod
    def publishing(
        cls,
        store: TimerStore,
        publisher: EventPublisher,
        clock: Clock,
        *,
        batch_size: int,
        instrumentation: Instrumentation = NO_INSTRUMENTATION,
        mark_at_once: int = MARK_AT_ONCE,
    ) -> FiringPipeline:
        """The pipeline that publishes ``DueTimeReached`` envelopes to ``publisher`` (with
        the default envelope ids; pass a :class:`PublishedEvents` of other ids to
        the constructor instead)."""
        delivery = PublishedEvents(publisher, clock, instrumentation=instrumentation)
        return cls(
            store,
            delivery,
            clock,
            batch_size=batch_size,
            instrumentation=instrumentation,
            mark_at_once=mark_at_once,
        )

    async def fire(self, after: DueCursor | None = None) -> FiringReport:
        """One batch: find due timers (after ``after``), deliver them, mark the delivered.

        ``report.cursor`` is set when the batch was full, so the caller can continue after
        it without reading failed timers again first.
        """
        batch = await self.find(after)
        if not batch.due:
            return batch.report()
        delivered = await self.deliver(batch)
        if not delivered.expired:
            await self.mark(batch, delivered)
        return batch.report(delivered)

    async def drain(
        self,
        *,
        stopping: Callable[[], bool] | None = None,
        on_batch: Callable[[FiringReport], None] | None = None,
        finish_marks: bool = True,
        carried: PendingMark | None = None,
    ) -> DrainReport:
        """Fire batch after batch, in due order, until a batch comes back short (or
        ``stopping()``).

        Every batch is fired as :meth:`fire` fires it: delivered, then marked, each timer's
        delivery acknowledged before its mark. Batches follow each other by keyset cursor,
        so a batch whose delivery failed is stepped over, not read again; after a full batch
        from a :class:`~timer_core.ports.FindsDueByTenant` store, batches are shared among
        tenants. The store work of neighbouring batches overlaps the delivery: the next
        batch is read while this one is delivered, and this one is marked while the next
        one is delivered. Marks finish and are reported in due order (``on_batch`` gets
        each batch's report once it is marked); a store that takes no lease gets a batch's
        mark while the last one's may still run (two at most, so it may commit both at
        once), a leasing store one at a time. With a delivery that keeps the order of
        overlapping calls, the next batches are also sent while this one's
        acknowledgements come back: up to four in flight at batches of 100 or less (about
        400 events), two at 200 or more and with a leasing store. A leasing store's batch
        claimed ahead waits one delivery (milliseconds) of its lease, and its claim is
        released if the drain stops before delivering it.

        With ``finish_marks=False`` the drain returns while its last mark may still run,
        handed over in the report as a :class:`PendingMark`; the caller passes it to the
        next drain as ``carried``, which leaves its timers out of what it finds (they are
        delivered) and lets it finish before its own first mark. Not with a leasing store:
        its next claim could take over those timers (they are still leased to this owner)
        and fence their mark out, so its drain always finishes its marks.
        """
        from timer_core._drain import Drain  # the drain's state machine, over this pipeline

        drain = Drain(self, stopping=stopping, on_batch=on_batch, carried=carried)
        return await drain.run(finish_marks=finish_marks)

    async def find(
        self,
        after: DueCursor | None = None,
        *,
        tenants: Mapping[TenantId, DueCursor] | None = None,
        skip: Collection[TimerKey] = frozenset(),
    ) -> DueBatch:
        """The next batch: in global due order after ``after``, or, after a full batch
        (``tenants`` given) from a store that can, shared among the tenants with due timers
        after their cursors. Timers in ``skip`` (delivered, their mark still running) and
        excluded ones are left out; a leasing store's claims on the excluded are released."""
        store, clock, limit = self.store, self.clock, self.batch_size
        started = clock.monotonic()
        now = floor_ms(clock.now())
        by_tenant = store if tenants is not None and isinstance(store, FindsDueByTenant) else None
        positions: dict[TenantId, DueCursor] = dict(tenants or {})
        while True:
            if by_tenant is not None:
                due = await by_tenant.find_due_by_tenant(now, limit, after=positions)
            else:
                due = await store.find_due(now, limit, after=after)
            full = len(due) >= limit
            cursor = DueCursor.of(due[-1]) if full else None
            if full:
                # In due order: each tenant ends at its last one (one cursor made per tenant).
                lasts = {entry.tenant_id: entry for entry in due}
                for tenant_id, entry in lasts.items():
                    positions[tenant_id] = DueCursor.of(entry)
            if due and skip:
                due = [entry for entry in due if entry.key not in skip]
            exclude = self.exclude
            if due and exclude is not None:
                left_out = [entry for entry in due if exclude(entry)]
                if left_out:
                    due = [entry for entry in due if not exclude(entry)]
                    await self.release(left_out)
            if due and cursor is not None and len(positions) > _MAX_TENANT_CURSORS:
                # A backlog over more tenants than that: the drain ends after this batch, as
                # after a short one (the worker starts the next at once, its cursors empty),
                # so a drain's memory stays bounded whatever the number of tenants.
                cursor = None
            if due or cursor is None:
                break
            after = cursor
        if not due:
            self.instrumentation.poll_completed(clock.monotonic() - started, 0)
            return DueBatch([], now, started, None)
        return DueBatch(due, now, started, cursor, positions if cursor is not None else None)

    async def deliver(self, batch: DueBatch) -> Delivered:
        """Deliver a found batch (within its lease); what failed is released."""
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
                await self.release(due)
                self.instrumentation.poll_completed(clock.monotonic() - batch.started, 0)
                return Delivered([], [], due, NO_BATCH_OBSERVER)
        results, observer = await self.delivery.deliver(due, now, within)
        reached: list[TimerEntry] = []
        failed: list[tuple[TimerEntry, PublishError]] = []
        # `now` checked once for the batch, not converted again for each timer.
        now_is_instant = is_utc_ms(now)
        for entry, error in zip(due, results, strict=True):
            if error is None:
                reached.append(entry._reached(now) if now_is_instant else entry.reach(now))
            else:
                failed.append((entry, error))
                self.instrumentation.publish_failed(entry, error)
        if failed:
            log.warning(
                "delivery failed for %d of %d due timers (first: %s/%s: %s); they stay Scheduled",
                len(failed),
                len(due),
                failed[0][0].tenant_id,
                failed[0][0].service_call_id,
                failed[0][1],
            )
            await self.release([entry for entry, _ in failed])
        return Delivered(reached, failed, [], observer)

    async def mark(
        self,
        batch: DueBatch,
        delivered: Delivered,
        writing: asyncio.Future[int] | None = None,
    ) -> None:
        """Mark a delivered batch's timers ``Reached`` (``writing``: that mark, already
        started) and finish the batch's instrumentation."""
        await self.mark_together([(batch, delivered)], writing)

    async def mark_together(
        self,
        batches: Sequence[tuple[DueBatch, Delivered]],
        writing: asyncio.Future[int] | None = None,
    ) -> None:
        """:meth:`mark` for several delivered batches in one store call (``writing``: that
        call, already started); each batch's instrumentation is finished as :meth:`mark`
        finishes it."""
        reached = [entry for _, delivered in batches for entry in delivered.reached]
        if reached:
            try:
                await (self.store.mark_reached(reached) if writing is None else writing)
            except Exception as exc:
                for _, delivered in batches:
                    delivered.observer.finished(exc)
                raise
        instrumentation, now = self.instrumentation, self.clock.monotonic()
        for batch, delivered in batches:
            if delivered.reached:
                instrumentation.timers_fired(delivered.reached)
            delivered.observer.finished()
            instrumentation.poll_completed(now - batch.started, len(delivered.reached))

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
