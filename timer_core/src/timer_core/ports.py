"""The ports Timer's workflows talk through. Their docstrings are the contract adapters keep.

Adapters translate every driver error into :mod:`timer_core.errors`; the conformance suite in
:mod:`timer_core.testing` checks each promise written here.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import NamedTuple, Protocol, Self, runtime_checkable

import attrs

from timer_core._census import PendingTenant, TimerCensus, TimerLookup, TimerRecord
from timer_core._entry import TimerEntry, TimerKey
from timer_core._ids import CorrelationId, EnvelopeId, ServiceCallId, TenantId
from timer_core._messages import Command, DueTimeReached, MessageEnvelope
from timer_core._time import to_epoch_ms
from timer_core.errors import PublishError

__all__ = [
    "AsyncResource",
    "Clock",
    "CommandBatchHandler",
    "CommandOutcome",
    "CommandSource",
    "DatabaseWrapper",
    "DueCursor",
    "EnvelopeIdGenerator",
    "EventPublisher",
    "ExclusiveFiring",
    "FindsDueByTenant",
    "LeasesClaims",
    "PendingTenant",
    "RemoteScheduleCallback",
    "ReportsRemoteSchedules",
    "PositionedOperation",
    "SharedClockStore",
    "SystemClock",
    "TimerCensus",
    "TimerLookup",
    "TimerOperation",
    "TimerRecord",
    "TimerScheduler",
    "TimerStore",
    "Uuid7EnvelopeIds",
    "rejection_reason",
    "tell_delivered",
    "tell_results",
]


class CommandOutcome(enum.StrEnum):
    """What a command did to the store."""

    SCHEDULED = "scheduled"
    """A ``ScheduleTimer`` stored a new timer or rescheduled a ``Scheduled`` one."""
    IGNORED_REACHED = "ignored_reached"
    """A ``ScheduleTimer`` for a ``Reached`` timer: nothing changed (no re-arm)."""
    CANCELLED = "cancelled"
    """A ``CancelTimer`` removed a ``Scheduled`` timer."""
    CANCEL_NOOP = "cancel_noop"
    """A ``CancelTimer`` for a ``Reached`` or unknown timer: nothing changed."""
    STALE = "stale"
    """A command older (by :attr:`PositionedOperation.position`) than one already applied to
    the same timer, e.g. redelivered after a broker crash: nothing changed."""
    OVER_QUOTA = "over_quota"
    """A ``ScheduleTimer`` for a new timer of a tenant already at its cap of pending timers
    (``handle_commands(max_pending_per_tenant=...)``): refused, nothing changed. A command
    source dead-letters it with :func:`rejection_reason` instead of acknowledging it."""


def rejection_reason(envelope: MessageEnvelope[Command], outcome: CommandOutcome) -> str | None:
    """The one-line dead-letter reason for a command its handler refused, else None."""
    if outcome is not CommandOutcome.OVER_QUOTA:
        return None
    return (
        f"tenant {str(envelope.tenant_id)!r} is at its cap of pending timers "
        "(max_pending_per_tenant): "
        f"ScheduleTimer for {str(envelope.payload.service_call_id)!r} refused; cancel "
        "timers or let them fire first"
    )


class DueCursor(NamedTuple):
    """A position in the due-timer order ``(due_at, tenant_id, service_call_id)``."""

    due_at: datetime
    tenant_id: TenantId
    service_call_id: ServiceCallId

    @classmethod
    def of(cls, entry: TimerEntry) -> DueCursor:
        """The cursor just at ``entry``: a query ``after`` it starts with the next timer."""
        return cls(entry.due_at, entry.tenant_id, entry.service_call_id)


@attrs.frozen(slots=True)
class PositionedOperation:
    """A schedule or cancel at its command's position in an ordered source.

    ``position`` orders the commands of one timer key: a JetStream stream sequence, for the
    commands a :class:`CommandSource` delivers. The store remembers, per key, the highest
    position applied (a cancel leaves a *tombstone* with it); an operation whose position is
    lower is ``STALE`` and changes nothing. ``at`` is when the command was applied (the
    tombstone's time, for retention). Operations without a position (a plain
    :class:`TimerEntry` or :class:`TimerKey`, e.g. scheduled in process) are always applied.
    """

    operation: TimerEntry | TimerKey
    position: int
    at: datetime

    @property
    def key(self) -> TimerKey:
        """The key of the timer the operation is for."""
        operation = self.operation
        return operation.key if isinstance(operation, TimerEntry) else TimerKey(*operation)


#: A write the store applies: a :class:`TimerEntry` schedules (upsert), a :class:`TimerKey`
#: cancels; either may come wrapped in a :class:`PositionedOperation`.
TimerOperation = TimerEntry | TimerKey | PositionedOperation

#: What :meth:`TimerStore.watch_remote_schedules` calls: the due time of a timer scheduled
#: by another writer of the same storage. Runs on the event loop; must not block.
RemoteScheduleCallback = Callable[[datetime], None]


class AsyncResource:
    """Something with an explicit lifecycle: ``await start()`` ... ``await aclose()``.

    ``async with resource:`` does both. Subclasses override the two hooks (the defaults do
    nothing); no I/O happens in ``__init__``.
    """

    async def start(self) -> None:
        """Acquire resources. Idempotent. The default does nothing."""

    async def aclose(self) -> None:
        """Release resources. Idempotent. The default does nothing."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class TimerStore(AsyncResource, abc.ABC):
    """Durable storage of timers, keyed by ``(tenant_id, service_call_id)``.

    Every method that reads or writes timers is scoped by tenant, except :meth:`find_due`,
    :meth:`next_due_at`, :meth:`count_scheduled` and :meth:`purge_reached`, which the worker
    runs across tenants. Instants are aware UTC datetimes at millisecond precision and come
    back exactly as stored. Failures raise :class:`~timer_core.errors.StoreError`
    (:class:`~timer_core.errors.StoreUnavailable` for transient ones: locked, full, down),
    never a driver's own exception. Methods are safe to call concurrently from one event loop.
    """

    async def start(self) -> None:
        """Open connections and apply migrations. Idempotent. The default does nothing."""

    async def aclose(self) -> None:
        """Release resources; writes already returned stay durable. The default does nothing."""

    @abc.abstractmethod
    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        """Apply schedules and cancels in the given order, atomically, and durably.

        A :class:`TimerEntry` (state ``Scheduled``) is an upsert: a new key is stored; a key
        that is ``Scheduled`` gets the entry's ``due_at``, ``registered_at``,
        ``correlation_id`` and ``trace_context`` (outcome ``SCHEDULED`` either way); a
        ``Reached`` key is left untouched (``IGNORED_REACHED``). A :class:`TimerKey` cancels:
        a ``Scheduled`` timer is deleted (``CANCELLED``); a ``Reached`` or unknown key is a
        no-op (``CANCEL_NOOP``).
        Later operations see the effects of earlier ones. Returns one outcome per operation,
        in order, only after all of them are committed durably; on error none is applied.

        A :class:`PositionedOperation` is first held to command order: its key's position is
        the highest position applied to it so far (by a schedule, stored with the timer, or
        a cancel, kept as a tombstone even where there is no timer to delete); an operation
        with a lower position changes nothing (``STALE``). Otherwise it is applied as above
        and, if it changed the key, its position becomes the key's (the same position again
        is the same command redelivered, applied again). Two cases decided: a positioned
        schedule of a ``Reached`` timer changes nothing, its position included
        (``IGNORED_REACHED``; a positioned cancel of one still leaves its tombstone); a cancel
        without a position deletes a ``Scheduled`` timer together with the position stored
        with it and leaves no tombstone (a tombstone already there stays). Other operations
        without a position are always applied and leave the key's position as it is.

        These rules are :func:`timer_core.replay.replay`'s: a store reads what it holds for
        the batch's keys, hands it over with the batch, and writes what comes back, so it
        decides no outcome itself.
        """

    async def schedule(self, entry: TimerEntry) -> CommandOutcome:
        """Upsert one timer (see :meth:`apply`)."""
        (outcome,) = await self.apply([entry])
        return outcome

    async def cancel(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> CommandOutcome:
        """Cancel one timer (see :meth:`apply`)."""
        (outcome,) = await self.apply([TimerKey(tenant_id, service_call_id)])
        return outcome

    @abc.abstractmethod
    async def get(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> TimerEntry | None:
        """The tenant's timer for this service call, ``Scheduled`` or ``Reached``, or None."""

    @abc.abstractmethod
    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        """Up to ``limit`` ``Scheduled`` timers of all tenants with ``due_at <= now``.

        Ordered by ``(due_at, tenant_id, service_call_id)``; with ``after``, only timers
        strictly after that position (keyset pagination). Served by an index: its cost
        grows with ``limit``, not with the number of stored timers.

        A store shared by several instances (a :class:`LeasesClaims`) *claims* the timers it
        returns for its :attr:`~LeasesClaims.claim_lease_s`: no other store's ``find_due``
        returns them until they are marked, released (:meth:`~LeasesClaims.release_claims`)
        or the lease runs out. Each entry it returns carries its claim
        (:attr:`TimerEntry.claim <timer_core.TimerEntry.claim>`), which goes back to the
        store with the entry's mark or release; the store keeps no book of them. The same
        store may claim its own claimed timers again.
        """

    @abc.abstractmethod
    async def find_due_for_tenant(
        self, tenant_id: TenantId, now: datetime, limit: int
    ) -> list[TimerEntry]:
        """Like :meth:`find_due` for one tenant only, in ``due_at`` order."""

    async def count_scheduled_for_tenant(self, tenant_id: TenantId) -> int:
        """How many of this tenant's timers are ``Scheduled`` (the per-tenant quota's count).

        The default pages through :meth:`list_for_tenant`; stores count from an index.
        """
        count, after = 0, None
        while page := await self.list_for_tenant(tenant_id, limit=1000, after=after):
            count += sum(1 for entry in page if entry.is_scheduled)
            after = page[-1].service_call_id
        return count

    @abc.abstractmethod
    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        """Record firings, all in one transaction; returns how many timers changed.

        Each entry is a timer in state ``Reached`` (as made by :meth:`TimerEntry.reach`). The
        stored timer with its key gets the entry's state and ``reached_at``, nothing else (its
        own correlation id, ``registered_at`` and trace context stay), and only while it is
        ``Scheduled`` with the same ``due_at``: a timer rescheduled, cancelled or already
        marked since it was read is left alone, so a second mark keeps the first
        ``reached_at``. A leasing store (:class:`LeasesClaims`) also leaves alone a timer
        that another claim took over since the claim the entry carries (the fence: a slow
        instance never overwrites the new owner's work).
        """

    @abc.abstractmethod
    async def find_by_correlation(
        self, tenant_id: TenantId, correlation_id: CorrelationId
    ) -> list[TimerEntry]:
        """The tenant's timers scheduled with this correlation id, in key order."""

    @abc.abstractmethod
    async def list_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        limit: int = 1000,
        after: ServiceCallId | None = None,
    ) -> list[TimerEntry]:
        """The tenant's timers in ``service_call_id`` order, after ``after``, up to ``limit``."""

    @abc.abstractmethod
    async def next_due_at(self) -> datetime | None:
        """The earliest ``due_at`` of any ``Scheduled`` timer, or None when none is pending.

        The worker sleeps until then, so a store must never answer later than a timer it
        would find due (a timer left out here fires late by up to the worker's polling
        interval), whether the timer is near or set weeks ahead. ``Reached`` timers and
        cancel tombstones never count. A leasing store (:class:`LeasesClaims`) leaves out
        the timers another instance holds under a live lease (it is firing them: counting
        them would make this worker wake for timers it cannot claim) and counts its own
        claims and expired leases (which it may claim).
        """

    @abc.abstractmethod
    async def count_scheduled(self) -> int:
        """How many timers of all tenants are ``Scheduled``."""

    @abc.abstractmethod
    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        """Delete up to ``limit`` ``Reached`` timers fired before ``reached_before``.

        Retention: returns how many were deleted; ``Scheduled`` timers are never deleted.
        Cancel tombstones (see :meth:`apply`) written before ``reached_before`` are deleted
        too, oldest first, within the same ``limit`` and count: timers and tombstones
        together never exceed ``limit``.
        """


class FindsDueByTenant(abc.ABC):
    """A store that can share a find among tenants (a capability a :class:`TimerStore` may
    have): a drain that finds more timers due than one batch holds goes on with batches
    shared among tenants, so no tenant waits for another's backlog."""

    @abc.abstractmethod
    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        """Up to ``limit`` ``Scheduled`` timers with ``due_at <= now``, shared among tenants.

        Each tenant's timers come in its own order ``(due_at, service_call_id)``, and for a
        tenant in ``after`` only those strictly after its cursor there. How ``limit`` is
        shared is :mod:`timer_core.fair_share`'s rule: tenants are served longest waiting
        first (earliest due timer, then tenant id), each with an equal share of what is left
        (what does not divide evenly goes one each to the first; with fewer left than
        tenants, the first get one each), in rounds: what a tenant leaves of its share goes
        to those that took all of theirs, so fewer than ``limit`` come back only when no
        more are due. The result is in ``(due_at, tenant_id, service_call_id)`` order. A
        leasing store claims them as :meth:`TimerStore.find_due` does. Its cost grows with
        the number of tenants that have pending timers and with ``limit``, not with a
        tenant's backlog.
        """


class LeasesClaims(abc.ABC):
    """A store several instances share (a capability a :class:`TimerStore` may have): what
    its :meth:`~TimerStore.find_due` returns is claimed for a lease, each entry carrying its
    claim (:attr:`TimerEntry.claim <timer_core.TimerEntry.claim>`), and its
    :meth:`~TimerStore.mark_reached` is fenced: it leaves alone a timer that another claim
    took over since the find returned it (a slow instance never overwrites the new owner's
    work). The conformance suite is :class:`timer_core.testing.TimerStoreLeaseContract`.

    The rules, per ``Scheduled`` timer, each store instance being one owner
    (:class:`timer_core.leases.Lease` decides them; a store keeps one lease per timer):

    - **Claim.** A find claims a timer that nobody holds, whose lease ran out, or that this
      same owner holds already (a re-claim: the owner's lease is extended); a timer another
      owner holds under a live lease is skipped, not waited for. Every claim gives the timer
      a new claim (a token) that goes out with the entry; two claims never share a timer.
    - **Expiry.** A lease runs ``claim_lease_s`` from the find, on the clock the store's
      leases run on (the database's, for a shared database), and is live up to and
      including its end.
    - **Fence.** A mark or a release with an entry carrying a claim counts only while that
      claim is the timer's last and this owner's (even after the lease ran out, as long as
      nobody claimed the timer since). A mark with an entry carrying no claim counts only
      while no other owner holds the timer; a release carrying no claim does nothing.
    - **Release.** A mark, a release and a reschedule end the lease (anyone may claim the
      timer at once); the claim counter is kept, so an older claim stays fenced. A cancel
      deletes the timer with its lease.
    - :meth:`~TimerStore.next_due_at` leaves out what other owners hold (see there).
    """

    @property
    @abc.abstractmethod
    def claim_lease_s(self) -> float:
        """How long timers returned by :meth:`~TimerStore.find_due` stay claimed, in seconds.

        Counted from the moment ``find_due`` was called. The firing pipeline publishes a
        claimed timer only within that time, so an instance that stalled past its lease (its
        timers possibly claimed by another by now) does not publish them.
        """

    @abc.abstractmethod
    async def release_claims(self, entries: Sequence[TimerEntry]) -> None:
        """Give up the claims ``entries`` carry, on timers that will not be fired now.

        Other instances may then claim them at once instead of after the lease. A timer
        claimed again since (or an entry without a claim) is left alone.
        """


class ReportsRemoteSchedules(abc.ABC):
    """A store that can tell of timers other writers schedule in the same storage (a
    capability a :class:`TimerStore` may have): PostgreSQL's ``LISTEN/NOTIFY``, SQLite's
    watch of its file. Without it, the worker's poll finds such timers within its polling
    interval."""

    @abc.abstractmethod
    def watch_remote_schedules(self, callback: RemoteScheduleCallback | None) -> bool:
        """Have ``callback(due_at)`` called on the event loop soon after another writer's
        schedule commits, so the worker wakes for a timer due before its next look.

        Schedules made through this very instance need not be reported: their caller wakes
        the worker itself. ``None`` stops the calls. Returns whether anything will be
        reported (a store configured not to watch returns False).
        :class:`~timer_core.Timer` registers its worker here at start.
        """


class ExclusiveFiring(abc.ABC):
    """A store whose timers one :class:`~timer_core.Timer` at a time may fire (a capability a
    :class:`TimerStore` may have): SQLite's, where nothing claims timers between instances, so
    two firing Timers on one file would each fire every timer. :class:`~timer_core.Timer`
    calls :meth:`acquire_firing` once when it starts, after starting the store and before its
    worker runs; a second firing Timer is thus refused at ``start()`` / ``async with``.
    Scheduling and reading (other stores on the same storage, a host's own transaction) are
    never refused."""

    @abc.abstractmethod
    async def acquire_firing(self) -> None:
        """Make this instance the one that fires the storage's timers, until :meth:`aclose
        <AsyncResource.aclose>` or the end of its process (a process killed with ``SIGKILL``
        leaves nothing behind that would refuse its restart).

        Raises :class:`~timer_core.errors.StoreInUse`, naming the fix, while another
        instance, in this process or another, holds it. Idempotent on the instance that holds
        it (a host may take it before starting anything else beside the store).
        """


class EventPublisher(AsyncResource, abc.ABC):
    """Publishes ``DueTimeReached`` envelopes to the broker, at least once.

    An envelope counts as published only once the broker acknowledged it durably. Publishing
    the same envelope id twice is allowed (re-publish after a crash) and the broker is
    expected to drop the duplicate within its duplicate window.
    """

    async def start(self) -> None:
        """Connect. Idempotent. The default does nothing."""

    async def aclose(self) -> None:
        """Disconnect after the publishes in flight. The default does nothing."""

    @property
    def keeps_call_order(self) -> bool:
        """Whether the envelopes of concurrent :meth:`publish_many` calls reach the broker
        call after call (all of one call's before any of a later call's).

        When true, the worker sends the next batch while the last one's acknowledgements
        come back, and events still reach the stream in due order. The default is False
        (one batch at a time).
        """
        return False

    @abc.abstractmethod
    async def publish_many(
        self, envelopes: Sequence[MessageEnvelope[DueTimeReached]]
    ) -> list[PublishError | None]:
        """Publish a batch, several in flight at once; one result per envelope, in order.

        ``None`` means acknowledged; a :class:`PublishError` means that envelope was not
        (refused, timed out, disconnected). One failure never fails the others. Never
        raises for a single envelope's failure.
        """

    async def publish_each(
        self,
        envelopes: Sequence[MessageEnvelope[DueTimeReached]],
        done: Callable[[int, PublishError | None], None],
    ) -> None:
        """Publish a batch as :meth:`publish_many` does, and tell ``done(i, result)`` each
        envelope's result as soon as it is known, exactly once each; returns once all are.

        The firing pipeline publishes through this, so that one envelope whose
        acknowledgement is slow holds back only its own timer. The default tells every
        result when :meth:`publish_many` returns; a publisher that learns of each
        acknowledgement apart (JetStream's) overrides it.
        """
        tell_results(done, await self.publish_many(envelopes))

    async def publish(self, envelope: MessageEnvelope[DueTimeReached]) -> None:
        """Publish one envelope; raises :class:`PublishError` unless acknowledged."""
        (error,) = await self.publish_many([envelope])
        if error is not None:
            raise error


CommandBatchHandler = Callable[
    [Sequence[MessageEnvelope[Command]]], Awaitable[Sequence[CommandOutcome]]
]


class CommandSource(AsyncResource, abc.ABC):
    """Delivers decoded commands from the broker to the timer, at least once.

    A message that cannot be decoded is dead-lettered by the source (with the
    :class:`~timer_core.errors.DecodeError` message as reason) and never reaches the
    handler. A batch is acknowledged only after the handler returned for it; if the handler
    raises, the batch is not acknowledged and is redelivered later. Commands for one timer
    key reach the handler in the order they were sent.

    Like the other ports it is an :class:`AsyncResource`: ``start()`` connects (the default
    does nothing), ``aclose()`` stops it (:meth:`stop`).
    """

    @abc.abstractmethod
    async def run(self, handler: CommandBatchHandler) -> None:
        """Fetch and hand over batches until :meth:`stop` is called, then return."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop fetching; the batch in the handler is finished (and acked) before run returns.

        A fetch waiting for commands is ended, not waited out: with no batch in the
        handler, run returns promptly (a host's stop must not hang on a long poll).
        Idempotent."""

    async def aclose(self) -> None:
        """Stop (see :meth:`stop`). Idempotent."""
        await self.stop()


class TimerScheduler(Protocol):
    """What a host's producer needs of Timer: schedule and cancel, each returning an id.

    :class:`timer_adapters_nats.TimerClient` implements it over NATS, and
    :class:`timer_adapters_memory.MemoryTimerClient` over an in-memory
    :class:`~timer_core.Timer`, so a host's code typed against this protocol runs in its
    tests without a broker. Both validate their arguments before anything is sent: a bad id
    or a naive or out-of-range ``due_at`` raises :class:`~timer_core.errors.ValidationError`.
    """

    async def schedule(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> EnvelopeId:
        """Ask for ``DueTimeReached`` at ``due_at`` (aware); a later call reschedules.

        Returns the command's envelope id. The correlation id defaults to that id. A timer
        that already fired is never re-armed.
        """
        ...

    async def cancel(
        self,
        tenant_id: str,
        service_call_id: str,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> EnvelopeId:
        """Cancel the timer if it has not fired yet (a no-op otherwise); returns the id."""
        ...


class DatabaseWrapper(Protocol):
    """A wrapper around a host's DB-API connection, such as Django's ``django.db.connection``:
    what ``schedule_in_transaction`` reads of it to write through the connection it wraps."""

    @property
    def vendor(self) -> str:
        """The database it is on (``sqlite``, ``postgresql``)."""
        ...

    @property
    def connection(self) -> object:
        """The DB-API connection it wraps (None before it connected)."""
        ...

    def ensure_connection(self) -> None:
        """Connect if not connected yet."""
        ...


@runtime_checkable
class Clock(Protocol):
    """Where Timer reads the time: the wall clock to compare due times, a monotonic one to wait.

    ``now`` is an aware UTC datetime and may jump (NTP, manual change); ``sleep`` waits on the
    monotonic clock and is unaffected by such jumps.
    """

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clocks: ``datetime.now(UTC)``, ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


@runtime_checkable
class SharedClockStore(Protocol):
    """A store whose storage keeps the clock every instance sharing it decides by.

    With instances sharing one database, each judging ``due_at <= now`` by its own wall
    clock, the one whose clock runs ahead fires everything early; the database's clock is
    the one they all share. :class:`~timer_core.Timer` made without a ``clock`` uses
    :meth:`shared_clock` for due times and ``reachedAt`` (PostgreSQL's store offers one).
    """

    def shared_clock(self) -> Clock:
        """The storage's clock (ready once the store is started): ``now`` never ahead of it."""
        ...


class EnvelopeIdGenerator(Protocol):
    """Makes envelope ids: fresh ones for commands, stable ones for firings."""

    def new_id(self) -> EnvelopeId:
        """A fresh UUID v7."""
        ...

    def firing_id(self, entry: TimerEntry) -> EnvelopeId:
        """The id of firing ``entry`` at its ``due_at``: the same every time it is asked."""
        ...


class Uuid7EnvelopeIds:
    """Default ids: random UUID v7s, and firing ids derived from key and due time."""

    def new_id(self) -> EnvelopeId:
        return EnvelopeId.generate()

    def firing_id(self, entry: TimerEntry) -> EnvelopeId:
        return EnvelopeId.for_firing(
            entry.tenant_id, entry.service_call_id, to_epoch_ms(entry.due_at)
        )


def tell_delivered(
    done: Callable[[int, PublishError | None], None], indices: Sequence[int]
) -> None:
    """Tell ``done`` that the envelopes at ``indices`` were delivered, in one step where it
    takes them so (the firing pipeline's ``done`` has a ``delivered(indices)``: outcomes
    that came in together are its bookkeeping once, not per timer); any other callable is
    told one by one. For :meth:`EventPublisher.publish_each`'s implementations."""
    many: Callable[[Sequence[int]], None] | None = getattr(done, "delivered", None)
    if many is not None:
        many(indices)
        return
    for index in indices:
        done(index, None)


def tell_results(
    done: Callable[[int, PublishError | None], None], results: Sequence[PublishError | None]
) -> None:
    """Tell ``done`` one result per envelope of a call, all known at once: the delivered
    together (:func:`tell_delivered`) first, then each failure beside them."""
    tell_delivered(done, [index for index, result in enumerate(results) if result is None])
    for index, result in enumerate(results):
        if result is not None:
            done(index, result)
