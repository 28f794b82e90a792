"""The timer's workflows: apply commands, and fire due timers (publish, then mark)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Collection, Coroutine, Generator, Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from timer_core._entry import TimerEntry, TimerKey, TimerState, _unchecked_entry
from timer_core._ids import CorrelationId, EnvelopeId, TenantId
from timer_core._messages import (
    CancelTimer,
    Command,
    DueTimeReached,
    MessageEnvelope,
    ScheduleTimer,
    _unchecked_due_event,
)
from timer_core._time import floor_ms, is_utc_ms, to_epoch_ms
from timer_core._trace import TraceContext
from timer_core.errors import PublishError, StoreError, ValidationError
from timer_core.instrumentation import (
    NO_BATCH_OBSERVER,
    NO_INSTRUMENTATION,
    BatchObserver,
    Instrumentation,
)
from timer_core.ports import (
    Clock,
    CommandOutcome,
    DueCursor,
    EnvelopeIdGenerator,
    EventPublisher,
    PositionedOperation,
    TimerOperation,
    TimerStore,
    Uuid7EnvelopeIds,
)

__all__ = [
    "DrainReport",
    "FiringReport",
    "PendingMark",
    "build_due_event",
    "cancel_timer",
    "drain_due_timers",
    "fire_due_timers",
    "handle_commands",
    "schedule_timer",
    "scheduled_entry",
]

log = logging.getLogger(__name__)
_DEFAULT_IDS = Uuid7EnvelopeIds()
#: Most tenants a drain keeps a keyset cursor for (tenant fairness); a drain over more ends
#: after the batch that passes it and the next drain starts afresh.
_MAX_TENANT_CURSORS = 10_000


def _operation(envelope: MessageEnvelope[Command], now: datetime) -> TimerOperation:
    operation = _unpositioned(envelope, now)
    position = envelope.position
    return operation if position is None else PositionedOperation(operation, position, now)


def _unpositioned(envelope: MessageEnvelope[Command], now: datetime) -> TimerEntry | TimerKey:
    command = envelope.payload
    if isinstance(command, ScheduleTimer):
        correlation_id = envelope.correlation_id
        if (
            type(command) is ScheduleTimer
            and (correlation_id is None or type(correlation_id) is CorrelationId)
            and is_utc_ms(now)
        ):
            # The hot path, once per command stored: a ScheduleTimer's fields are already
            # of the entry's types and forms (its converters ran).
            return _unchecked_entry(
                command.tenant_id,
                command.service_call_id,
                command.due_at,
                now,
                correlation_id,
                TimerState.SCHEDULED,
                None,
                envelope.trace_context,
            )
        return scheduled_entry(
            command, now, correlation_id=correlation_id, trace_context=envelope.trace_context
        )
    return TimerKey(command.tenant_id, command.service_call_id)


async def handle_commands(
    store: TimerStore,
    envelopes: Sequence[MessageEnvelope[Command]],
    clock: Clock,
    *,
    instrumentation: Instrumentation = NO_INSTRUMENTATION,
    max_pending_per_tenant: int | None = None,
) -> list[CommandOutcome]:
    """Apply a batch of decoded commands in order, in one store transaction.

    An envelope with a :attr:`~timer_core.MessageEnvelope.position` is applied as a
    :class:`~timer_core.ports.PositionedOperation`: older than what its timer already saw,
    it changes nothing (``STALE``). With ``max_pending_per_tenant``, a ``ScheduleTimer``
    that would give its tenant more ``Scheduled`` timers than that is refused
    (``OVER_QUOTA``, not applied; the command source dead-letters it); reschedules and
    cancels always pass. Several instances admitting at the same moment may each go up to
    the cap. Returns once every command is durably applied (the caller may then ack them
    all); raises :class:`~timer_core.errors.StoreError` if none could be.
    """
    if not envelopes:
        return []
    now = floor_ms(clock.now())
    observer = instrumentation.commands_started(envelopes)
    try:
        refused: set[int] = set()
        if max_pending_per_tenant is not None:
            refused = await _over_quota(store, envelopes, max_pending_per_tenant)
        if refused:
            admitted = [e for i, e in enumerate(envelopes) if i not in refused]
            applied = iter(await store.apply([_operation(envelope, now) for envelope in admitted]))
            outcomes = [
                CommandOutcome.OVER_QUOTA if i in refused else next(applied)
                for i in range(len(envelopes))
            ]
            log.warning(
                "%d ScheduleTimer commands over the cap of %d pending timers per tenant refused",
                len(refused),
                max_pending_per_tenant,
            )
        else:
            outcomes = await store.apply([_operation(envelope, now) for envelope in envelopes])
    except Exception as exc:
        observer.finished(exc)
        raise
    instrumentation.commands_handled(envelopes, outcomes)
    observer.finished()
    if log.isEnabledFor(logging.DEBUG):
        for envelope, outcome in zip(envelopes, outcomes, strict=True):
            log.debug(
                "%s %s/%s -> %s (correlation %s)",
                envelope.type,
                envelope.tenant_id,
                envelope.payload.service_call_id,
                outcome.value,
                envelope.correlation_id,
            )
    return outcomes


async def _over_quota(
    store: TimerStore, envelopes: Sequence[MessageEnvelope[Command]], cap: int
) -> set[int]:
    """The indexes of the ``ScheduleTimer`` commands that would take their tenant past
    ``cap`` pending timers. One count per tenant in the batch; only a tenant near its cap
    has the keys of its commands read, to follow the batch in order."""
    by_tenant: dict[TenantId, list[int]] = {}
    for index, envelope in enumerate(envelopes):
        by_tenant.setdefault(envelope.tenant_id, []).append(index)
    refused: set[int] = set()
    for tenant_id, indexes in by_tenant.items():
        schedules = sum(isinstance(envelopes[i].payload, ScheduleTimer) for i in indexes)
        if not schedules:
            continue
        pending = await store.count_scheduled_for_tenant(tenant_id)
        if pending + schedules <= cap:
            continue
        calls = {envelopes[i].payload.service_call_id for i in indexes}
        stored = {call: await store.get(tenant_id, call) for call in calls}
        scheduled = {call for call, e in stored.items() if e is not None and e.is_scheduled}
        reached = {call for call, e in stored.items() if e is not None and not e.is_scheduled}
        for index in indexes:
            command = envelopes[index].payload
            call = command.service_call_id
            if isinstance(command, ScheduleTimer):
                if call in scheduled or call in reached:
                    continue  # a reschedule, or ignored: no new pending timer
                if pending >= cap:
                    refused.add(index)
                    continue
                scheduled.add(call)
                pending += 1
            elif call in scheduled:
                scheduled.discard(call)
                pending -= 1
    return refused


async def schedule_timer(
    store: TimerStore,
    command: ScheduleTimer,
    clock: Clock,
    *,
    correlation_id: str | None = None,
    trace_context: TraceContext | None = None,
) -> CommandOutcome:
    """Store or reschedule one timer; a ``Reached`` timer is never re-armed."""
    entry = scheduled_entry(
        command, clock.now(), correlation_id=correlation_id, trace_context=trace_context
    )
    return await store.schedule(entry)


def scheduled_entry(
    command: ScheduleTimer,
    now: datetime,
    *,
    correlation_id: str | None = None,
    trace_context: TraceContext | None = None,
) -> TimerEntry:
    """The ``Scheduled`` timer a ``ScheduleTimer`` received at ``now`` stores; its
    correlation id is ``correlation_id`` or else the command's own (both, differing, is a
    :class:`~timer_core.errors.ValidationError`)."""
    carried = command.correlation_id
    if carried is not None and correlation_id is not None and carried != correlation_id:
        raise ValidationError(
            f"two correlation ids for {command.tenant_id}/{command.service_call_id}: "
            f"{carried!r} on the ScheduleTimer and {correlation_id!r} beside it; give one"
        )
    return TimerEntry(
        tenant_id=command.tenant_id,
        service_call_id=command.service_call_id,
        due_at=command.due_at,
        registered_at=floor_ms(now),
        correlation_id=correlation_id if correlation_id is not None else carried,
        trace_context=trace_context,
    )


async def cancel_timer(store: TimerStore, command: CancelTimer) -> CommandOutcome:
    """Remove a ``Scheduled`` timer; a no-op for a ``Reached`` or unknown one."""
    return await store.cancel(command.tenant_id, command.service_call_id)


def build_due_event(
    entry: TimerEntry, reached_at: datetime, ids: EnvelopeIdGenerator = _DEFAULT_IDS
) -> MessageEnvelope[DueTimeReached]:
    """The ``DueTimeReached`` envelope for firing ``entry`` at ``reached_at`` (contract 5, 6)."""
    envelope_id = ids.firing_id(entry)
    if (
        type(entry) is not TimerEntry
        or type(envelope_id) is not EnvelopeId
        or not is_utc_ms(reached_at)
    ):
        return MessageEnvelope(
            id=envelope_id,
            payload=DueTimeReached(
                tenant_id=entry.tenant_id,
                service_call_id=entry.service_call_id,
                due_at=entry.due_at,
                reached_at=reached_at,
            ),
            timestamp_ms=to_epoch_ms(reached_at),
            aggregate_id=entry.service_call_id,
            correlation_id=entry.correlation_id,
            trace_context=entry.trace_context,
        )
    # The hot path, once per timer fired: every value is already of its field's type and
    # form (a TimerEntry's fields, a UTC millisecond instant), so the converters are not run
    # again.
    return _unchecked_due_event(
        envelope_id,
        entry.tenant_id,
        entry.service_call_id,
        entry.due_at,
        reached_at,
        to_epoch_ms(reached_at),
        entry.correlation_id,
        entry.trace_context,
    )


def _due_events(
    due: Sequence[TimerEntry], now: datetime, ids: EnvelopeIdGenerator
) -> list[MessageEnvelope[DueTimeReached]]:
    """:func:`build_due_event` for each timer of a batch fired at ``now``, with ``now``'s
    checks and epoch milliseconds made once per batch rather than once per timer (the fire
    path); the default ids only (another generator's ``firing_id`` is its own)."""
    if type(ids) is not Uuid7EnvelopeIds or not is_utc_ms(now):
        return [build_due_event(entry, now, ids) for entry in due]
    now_ms = to_epoch_ms(now)
    for_firing = EnvelopeId.for_firing
    return [
        _unchecked_due_event(
            for_firing(entry.tenant_id, entry.service_call_id, to_epoch_ms(entry.due_at)),
            entry.tenant_id,
            entry.service_call_id,
            entry.due_at,
            now,
            now_ms,
            entry.correlation_id,
            entry.trace_context,
        )
        if type(entry) is TimerEntry
        else build_due_event(entry, now, ids)
        for entry in due
    ]


@attrs.frozen
class FiringReport:
    """What one call of :func:`fire_due_timers` did."""

    found: int
    """Due timers read from the store (at most the batch size)."""
    fired: list[TimerEntry]
    """Timers published and marked ``Reached`` (each with its ``reached_at``)."""
    failed: list[tuple[TimerEntry, PublishError]]
    """Timers whose publish failed; they stay ``Scheduled`` for a later pass."""
    cursor: DueCursor | None
    """The position of the last timer read, for keyset pagination past failures."""
    expired: list[TimerEntry] = attrs.field(factory=list)
    """Claimed timers not published because the store's claim lease ran out before the
    publish could start; left ``Scheduled`` for a later claim (see
    :attr:`~timer_core.ports.TimerStore.claim_lease_s`)."""

    @property
    def batch_full(self) -> bool:
        """Whether the store may hold more due timers than this pass read."""
        return self.cursor is not None and self.found > 0


async def fire_due_timers(
    store: TimerStore,
    publisher: EventPublisher,
    clock: Clock,
    *,
    batch_size: int,
    ids: EnvelopeIdGenerator = _DEFAULT_IDS,
    after: DueCursor | None = None,
    instrumentation: Instrumentation = NO_INSTRUMENTATION,
) -> FiringReport:
    """Fire one batch: find due timers, publish them all at once, mark the published ones.

    Publish comes before mark, so a crash in between re-publishes the same firing (same
    envelope id) rather than losing it. A timer whose publish fails stays ``Scheduled`` and
    does not stop the others. ``report.cursor`` is set when the batch was full, so the caller
    can continue after it without re-reading failed timers first.

    With a leasing store (``store.claim_lease_s`` set), publishing is fenced by the lease:
    nothing is published once the lease may have run out (the batch is reported as
    ``expired``), and the publish is awaited only until then (the unacknowledged ones
    fail). Timers not fired are handed back with :meth:`TimerStore.release_claims`.
    """
    found = await _find(store, clock, batch_size, after, instrumentation)
    if not found.due:
        return found.report([], [])
    fired, failed, expired, observer = await _publish(
        store, publisher, clock, found, ids, instrumentation
    )
    if not expired:
        await _mark(store, clock, found, fired, instrumentation, observer)
    return found.report(fired, failed, expired)


@attrs.frozen
class PendingMark:
    """A drain's last mark, still running when the drain returned (``finish_marks=False``).

    The timers in :attr:`keys` are published and not yet ``Reached``. Hand it to the next
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
    """What one call of :func:`drain_due_timers` did, in counts (a drain may fire millions)."""

    batches: int
    """Batches found and fired (an empty first find counts as none)."""
    fired: int
    """Timers published and marked ``Reached``."""
    failed: list[tuple[TimerEntry, PublishError]]
    """Timers whose publish failed; they stay ``Scheduled`` for a later drain."""
    expired: int = 0
    """Claimed timers not published because their claim lease ran out first."""
    unfinished_mark: PendingMark | None = None
    """With ``finish_marks=False``: the mark still running when the drain returned, else
    None."""


def _never() -> bool:
    return False


async def drain_due_timers(
    store: TimerStore,
    publisher: EventPublisher,
    clock: Clock,
    *,
    batch_size: int,
    ids: EnvelopeIdGenerator = _DEFAULT_IDS,
    instrumentation: Instrumentation = NO_INSTRUMENTATION,
    stopping: Callable[[], bool] = _never,
    on_batch: Callable[[FiringReport], None] | None = None,
    finish_marks: bool = True,
    carried: PendingMark | None = None,
    exclude: Callable[[TimerEntry], bool] | None = None,
) -> DrainReport:
    """Fire batch after batch, in due order, until a batch comes back short (or ``stopping``).

    Every batch is fired as :func:`fire_due_timers` fires it: published, then marked, each
    timer's publish acknowledged before its mark. Batches follow each other by keyset cursor,
    so a batch whose publish failed is stepped over, not read again. The store work of
    neighbouring batches overlaps the broker work: the next batch is read while this one
    is published, and this one is marked while the next one is published. Marks finish and
    are reported in due order; a store that takes no lease gets a batch's mark while the
    last one's may still run (two at most, so it may commit both at once), a leasing store
    one at a time. With a publisher that keeps the order of concurrent calls
    (:attr:`~timer_core.ports.EventPublisher.keeps_call_order`), the next batches are also
    sent while this one's acknowledgements come back: up to four in flight at batches of
    100 or less (about 400 events), two at 200 or more and with a leasing store. The drain
    returns only once every mark it started is done.
    A leasing store is drained the same way: the batch claimed ahead waits one publish
    (milliseconds) of its lease, and its claim is released if the drain stops before
    publishing it. ``on_batch`` gets each batch's report once it is marked.

    With ``finish_marks=False`` the drain returns while its last mark may still run, handed
    over in the report as a :class:`PendingMark`; the caller passes it to the next drain as
    ``carried``, which leaves its timers out of what it finds (they are published) and lets
    it finish before its own first mark. A firer under steady load thus looks for the next
    due timers while the last ones are being marked.
    Not with a leasing store: its next claim could take over those timers (they are still
    leased to this owner) and fence their mark out, so its drain always finishes its marks.

    Due timers for which ``exclude(entry)`` is true are left out (the worker's per-timer
    backoff and quarantine); a leasing store's claims on them are released at once.
    """
    carries = store.claim_lease_s is None  # may hand its last mark over to the next drain
    fired = batches = expired = 0
    failed: list[tuple[TimerEntry, PublishError]] = []
    skip = carried.keys if carried is not None and carries else frozenset()
    found = await _find(store, clock, batch_size, None, instrumentation, skip, exclude=exclude)
    if not found.due and on_batch is not None:
        on_batch(found.report([], []))
    ahead: asyncio.Task[_Found] | None = None
    marking: asyncio.Future[None] | None = None if carried is None else carried.marking
    # What ``marking`` marks once this drain started a mark of its own (else the carried).
    marked: list[TimerEntry] | None = None
    # The mark before ``marking``, when that one was queued behind it (never with a leasing
    # store): this one's own timers, published, are marked by the time ``marking`` is done.
    earlier: asyncio.Future[None] | None = None

    def find_after(batch: _Found) -> Coroutine[Any, Any, _Found]:
        """The batch after ``batch``: by its cursor, or shared among tenants after theirs."""
        return _find(
            store,
            clock,
            batch_size,
            batch.cursor,
            instrumentation,
            skip,
            batch.tenants,
            exclude=exclude,
        )

    def publish(batch: _Found) -> asyncio.Future[_Published]:
        return asyncio.ensure_future(_publish(store, publisher, clock, batch, ids, instrumentation))

    # With a publisher that keeps the order of its calls, the next batches are read and sent
    # while the acks of those before come back: up to ``depth`` publishes in flight.
    overlap = publisher.keeps_call_order
    depth = _sent_at_once(batch_size, leasing=not carries) if overlap else 1
    sending: deque[tuple[_Found, asyncio.Future[_Published]]] = deque()
    if found.due:
        sending.append((found, publish(found)))
    last = found  # the last batch read: the next one is read after it
    ready: _Found | None = None  # read, and waiting for a publish to finish to be sent
    # One batch more is read while ``depth`` are in flight (not claimed ahead of its turn by
    # a leasing store whose publishes overlap: its lease would run while it waits).
    holds = carries or not overlap
    try:
        while sending:
            # Read ahead while the batches sent are published: send what was read while
            # fewer than ``depth`` are in flight, and hold one more, read, until one finishes.
            while (
                ready is None
                and (holds or len(sending) < depth)
                and last.cursor is not None
                and not stopping()
                # With two in flight and the oldest done, that one is marked and reported first.
                and (len(sending) < 2 or not sending[0][1].done())
            ):
                ahead = asyncio.ensure_future(find_after(last))
                last, ahead = await ahead, None
                if not last.due:
                    break
                if stopping():
                    await _release(store, last.due)  # read ahead, never published
                    break
                if len(sending) < depth:
                    sending.append((last, publish(last)))
                else:
                    ready = last
            found, publishing = sending.popleft()
            reached, lost, late, observer = await publishing
            batches += 1
            fired += len(reached)
            failed += lost
            expired += len(late)
            if earlier is not None:
                settled, earlier = earlier, None
                await settled  # two marks in flight at most
            previous, marking = marking, None
            if previous is not None and not carries:
                await previous  # a leasing store: one mark at a time
                previous = None
            marking = asyncio.ensure_future(
                _mark_and_report(
                    store,
                    clock,
                    found,
                    reached,
                    lost,
                    late,
                    instrumentation,
                    observer,
                    on_batch,
                    after=previous,
                )
            )
            earlier, marked = previous, reached
            if ready is not None:  # read ahead: sent only now, unless stopping meanwhile
                waiting, ready = ready, None
                if stopping():
                    await _release(store, waiting.due)
                else:
                    sending.append((waiting, publish(waiting)))
            await asyncio.sleep(0)  # a long drain still lets the command consumer run
        unfinished: asyncio.Future[None] | None = None
        if earlier is not None:
            settled, earlier = earlier, None
            await settled  # only the last mark may be handed over
        if marking is not None:
            previous, marking = marking, None
            if finish_marks or not carries or previous.done():
                await previous
            else:
                unfinished = previous
    finally:
        for _, sent in sending:
            # Ending early (an error, a cancellation): a publish in flight is cancelled; its
            # timers stay Scheduled and are published again later, under the same ids.
            if not sent.done():
                sent.cancel()
                await asyncio.wait({sent})
            if not sent.cancelled():
                sent.exception()  # retrieved: the drain's own error is what is raised
        await _settle_drain(store, ahead, earlier, marking)
        if ready is not None:
            await _release(store, ready.due)  # read ahead, never published
    return DrainReport(
        batches=batches,
        fired=fired,
        failed=failed,
        expired=expired,
        unfinished_mark=(
            None
            if unfinished is None
            else PendingMark(
                unfinished,
                frozenset(skip) if marked is None else frozenset(entry.key for entry in marked),
            )
        ),
    )


# Publishes in flight at once in a drain, with a publisher that keeps their order: enough
# for about this many events (JetStream acks the first while the last are sent), at least
# two (the next batch sent while this one's acks come back), at most this many batches.
_SENT_EVENTS = 400
_MOST_SENT = 4


def _sent_at_once(batch_size: int, *, leasing: bool) -> int:
    """How many batches' publishes a drain has in flight (with a publisher that keeps their
    order): two for big batches and for a leasing store (its claims wait for no one), up to
    four of small ones (batches of 100, the default)."""
    if leasing:
        return 2
    return max(2, min(_MOST_SENT, _SENT_EVENTS // max(batch_size, 1)))


async def _settle_drain(
    store: TimerStore,
    ahead: asyncio.Task[_Found] | None,
    *markings: asyncio.Future[None] | None,
) -> None:
    """A drain ending early (stop, error) still finishes its last marks; a batch read ahead
    and never published is handed back."""
    for marking in markings:
        if marking is None:
            continue
        try:
            await marking
        except Exception as exc:  # the drain is failing already; this one is only logged
            log.warning("marking a fired batch failed (%s); it will be published again", exc)
    if ahead is not None:
        try:
            found = await ahead
        except Exception:  # nothing was claimed, so nothing to hand back
            return
        if found.due:
            await _release(store, found.due)


@attrs.frozen
class _Found:
    """A batch of due timers as one find read it, and when."""

    due: list[TimerEntry]
    now: datetime
    started: float
    cursor: DueCursor | None
    # Where each tenant's timers stand after this batch (its last one read), for the next
    # batch shared among tenants; None when the batch was not full.
    tenants: Mapping[TenantId, DueCursor] | None = None

    def report(
        self,
        fired: list[TimerEntry],
        failed: list[tuple[TimerEntry, PublishError]],
        expired: list[TimerEntry] | None = None,
    ) -> FiringReport:
        return FiringReport(
            found=len(self.due),
            fired=fired,
            failed=failed,
            cursor=self.cursor,
            expired=expired or [],
        )


async def _find(
    store: TimerStore,
    clock: Clock,
    batch_size: int,
    after: DueCursor | None,
    instrumentation: Instrumentation,
    skip: Collection[TimerKey] = frozenset(),
    tenants: Mapping[TenantId, DueCursor] | None = None,
    *,
    exclude: Callable[[TimerEntry], bool] | None = None,
) -> _Found:
    """One batch: in global due order, or, after a full batch (``tenants`` given) from a
    store that can, shared among the tenants with due timers (tenant fairness)."""
    started = clock.monotonic()
    now = floor_ms(clock.now())
    shared = tenants is not None and store.finds_due_by_tenant
    positions: dict[TenantId, DueCursor] = dict(tenants or {})
    while True:
        if shared:
            due = await store.find_due_by_tenant(now, batch_size, after=positions)
        else:
            due = await store.find_due(now, batch_size, after=after)
        full = len(due) >= batch_size
        cursor = DueCursor.of(due[-1]) if full else None
        if full:
            # In due order: each tenant ends at its last one (one cursor made per tenant).
            lasts = {entry.tenant_id: entry for entry in due}
            for tenant_id, entry in lasts.items():
                positions[tenant_id] = DueCursor.of(entry)
        if due and skip:  # published by the drain before, their mark still running
            due = [entry for entry in due if entry.key not in skip]
        if due and exclude is not None:
            left_out = [entry for entry in due if exclude(entry)]
            if left_out:
                due = [entry for entry in due if not exclude(entry)]
                if store.claim_lease_s is not None:
                    await _release(store, left_out)
        if due and cursor is not None and len(positions) > _MAX_TENANT_CURSORS:
            # A backlog over more tenants than that: the drain ends after this batch, as
            # after a short one (the worker starts the next at once, its cursors empty), so
            # a drain's memory stays bounded whatever the number of tenants.
            cursor = None
        if due or cursor is None:
            break
        after = cursor
    if not due:
        instrumentation.poll_completed(clock.monotonic() - started, 0)
        return _Found(due=[], now=now, started=started, cursor=None)
    return _Found(
        due=due,
        now=now,
        started=started,
        cursor=cursor,
        tenants=positions if cursor is not None else None,
    )


_Published = tuple[
    list[TimerEntry], list[tuple[TimerEntry, PublishError]], list[TimerEntry], BatchObserver
]


async def _publish(
    store: TimerStore,
    publisher: EventPublisher,
    clock: Clock,
    found: _Found,
    ids: EnvelopeIdGenerator,
    instrumentation: Instrumentation,
) -> tuple[
    list[TimerEntry], list[tuple[TimerEntry, PublishError]], list[TimerEntry], BatchObserver
]:
    """Publish a found batch (within its lease); the reached entries, failures and expired,
    and the instrumentation's observer of the batch (to be finished by the mark)."""
    due, now = found.due, found.now
    lease = store.claim_lease_s
    deadline = None if lease is None else found.started + lease
    if deadline is not None and clock.monotonic() >= deadline:
        log.warning(
            "claiming %d due timers outlasted the %.1fs lease; not publishing them", len(due), lease
        )
        await _release(store, due)
        instrumentation.poll_completed(clock.monotonic() - found.started, 0)
        return [], [], due, NO_BATCH_OBSERVER
    envelopes = _due_events(due, now, ids)
    observer = instrumentation.firing_started(envelopes)
    try:
        if deadline is None:
            results = await publisher.publish_many(envelopes)
        else:
            results = await _publish_within(
                publisher, envelopes, clock, deadline - clock.monotonic()
            )
    except Exception as exc:
        observer.finished(exc)
        raise
    observer.published(results)
    reached: list[TimerEntry] = []
    failed: list[tuple[TimerEntry, PublishError]] = []
    # `now` checked once for the batch, not converted again for each timer.
    now_is_instant = is_utc_ms(now)
    for entry, error in zip(due, results, strict=True):
        if error is None:
            reached.append(entry._reached(now) if now_is_instant else entry.reach(now))
        else:
            failed.append((entry, error))
            instrumentation.publish_failed(entry, error)
    if failed:
        log.warning(
            "publish failed for %d of %d due timers (first: %s/%s: %s); they stay Scheduled",
            len(failed),
            len(due),
            failed[0][0].tenant_id,
            failed[0][0].service_call_id,
            failed[0][1],
        )
        await _release(store, [entry for entry, _ in failed])
    return reached, failed, [], observer


async def _mark(
    store: TimerStore,
    clock: Clock,
    found: _Found,
    reached: list[TimerEntry],
    instrumentation: Instrumentation,
    observer: BatchObserver = NO_BATCH_OBSERVER,
    writing: asyncio.Future[int] | None = None,
) -> None:
    if reached:
        try:
            await (store.mark_reached(reached) if writing is None else writing)
        except Exception as exc:
            observer.finished(exc)
            raise
        instrumentation.timers_fired(reached)
    observer.finished()
    instrumentation.poll_completed(clock.monotonic() - found.started, len(reached))


async def _mark_and_report(
    store: TimerStore,
    clock: Clock,
    found: _Found,
    reached: list[TimerEntry],
    failed: list[tuple[TimerEntry, PublishError]],
    expired: list[TimerEntry],
    instrumentation: Instrumentation,
    observer: BatchObserver,
    on_batch: Callable[[FiringReport], None] | None,
    *,
    after: asyncio.Future[None] | None = None,
) -> None:
    """Mark a published batch, then report it; with ``after`` (the previous batch's mark,
    still running), the mark is queued at once, right behind that one (a store may commit
    both in one transaction), and finished and reported after it (whose error is the
    drain's to raise)."""
    writing: asyncio.Future[int] | None = None
    if after is not None:
        if reached and not expired:
            writing = asyncio.ensure_future(store.mark_reached(reached))
        await asyncio.wait({after})
    if not expired:
        await _mark(store, clock, found, reached, instrumentation, observer, writing)
    if on_batch is not None:
        on_batch(found.report(reached, failed, expired))


async def _publish_within(
    publisher: EventPublisher,
    envelopes: list[MessageEnvelope[DueTimeReached]],
    clock: Clock,
    budget: float,
) -> list[PublishError | None]:
    """``publish_many``, but stop waiting after ``budget`` seconds (the rest of the lease).

    Envelopes not acknowledged by then count as failed. One may still reach the broker
    afterwards; it carries the firing's envelope id, so the broker drops it as a duplicate
    if the instance that took the timer over publishes it too.
    """
    publishing = asyncio.ensure_future(publisher.publish_many(envelopes))
    lease_over = asyncio.ensure_future(clock.sleep(budget))
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


async def _release(store: TimerStore, entries: Sequence[TimerEntry]) -> None:
    # Only a shortcut (leases run out anyway), so a failure here must not fail the pass.
    try:
        await store.release_claims(entries)
    except StoreError as exc:
        log.warning(
            "could not release %d timer claims (%s); their leases will expire", len(entries), exc
        )
