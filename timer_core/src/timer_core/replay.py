"""What a batch of schedules and cancels does to stored timers: the rule every store applies.

A store reads what it holds for the batch's keys (:class:`StoredKey`), hands both to
:func:`replay`, and writes the :class:`Replay` it gets back: the timers to insert, update and
delete, the cancel tombstones to keep, and each operation's :class:`CommandOutcome`. The
rules of :meth:`TimerStore.apply <timer_core.ports.TimerStore.apply>` (command order by
position, ``STALE``, ``IGNORED_REACHED``, tombstones, reschedules) are decided here, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

import attrs

from timer_core._entry import TimerEntry, TimerKey, TimerState
from timer_core._time import require_utc
from timer_core.ports import CommandOutcome, PositionedOperation, TimerOperation

__all__ = [
    "Replay",
    "StoredKey",
    "StoredTimer",
    "Tombstone",
    "marked",
    "new_timers",
    "new_timers_scheduled",
    "operation_keys",
    "replay",
]

_SCHEDULED = TimerState.SCHEDULED
_REACHED = TimerState.REACHED


@attrs.frozen(slots=True)
class StoredKey:
    """What a store holds for one timer key before a batch: nothing is ``StoredKey()``."""

    state: TimerState | None = None
    """The stored timer's state, or None when there is no timer with this key."""
    position: int | None = None
    """The command position stored with the timer (the last positioned schedule's)."""
    tombstone: int | None = None
    """The position of the key's cancel tombstone, or None when it has none."""


@attrs.frozen(slots=True)
class StoredTimer:
    """A ``Scheduled`` timer to write, with the command position to store beside it."""

    entry: TimerEntry
    position: int | None


@attrs.frozen(slots=True)
class Tombstone:
    """A positioned cancel to remember for ``key``: its position, and when it was applied
    (retention deletes tombstones by ``at``, see :meth:`TimerStore.purge_reached
    <timer_core.ports.TimerStore.purge_reached>`)."""

    key: TimerKey
    position: int
    at: datetime


@attrs.frozen
class Replay:
    """What a batch does: the writes to make, in any order, and one outcome per operation.

    Writing all of them, atomically, leaves the store as the operations applied one after the
    other would have.
    """

    outcomes: list[CommandOutcome]
    inserts: list[StoredTimer]
    """Timers for keys that had none: stored as they are."""
    updates: list[StoredTimer]
    """``Scheduled`` timers rescheduled: their ``due_at``, ``registered_at``,
    ``correlation_id``, ``trace_context`` and position become these (a claim on the old due
    time is dropped)."""
    deletes: list[TimerKey]
    """``Scheduled`` timers cancelled (with the position stored beside them)."""
    tombstones: list[Tombstone]
    """Tombstones to write (replacing the key's one, if it has one)."""


@attrs.define(slots=True)
class _Key:
    state: TimerState | None
    position: int | None
    tombstone: int | None
    entry: TimerEntry | None = None  # the timer to write, once a schedule applied


def replay(operations: Sequence[TimerOperation], stored: Mapping[TimerKey, StoredKey]) -> Replay:
    """What ``operations``, applied in order, do to what ``stored`` holds for their keys.

    ``stored`` has what the store holds for each key of the batch (a key it lacks holds
    nothing). The rules are :meth:`TimerStore.apply <timer_core.ports.TimerStore.apply>`'s;
    later operations see the effects of earlier ones. Raises ``ValueError`` for an entry
    that is not ``Scheduled`` or a position that is not a non-negative int, before deciding
    anything.
    """
    keys: dict[TimerKey, _Key] = {}
    outcomes: list[CommandOutcome] = []
    tombstones: dict[TimerKey, Tombstone] = {}
    nothing = StoredKey()
    for operation in operations:
        position: int | None = None
        at: datetime | None = None
        if isinstance(operation, PositionedOperation):
            position = operation.position
            if type(position) is not int or position < 0:
                raise ValueError(f"a command position is a non-negative int, got {position!r}")
            at = require_utc(operation.at, "at")
            operation = operation.operation
        if isinstance(operation, TimerEntry):
            if operation.state is not _SCHEDULED:
                raise ValueError(f"only Scheduled timers can be scheduled, got {operation}")
            key = operation.key
        else:
            key = TimerKey(*operation)
        held = keys.get(key)
        if held is None:
            was = stored.get(key, nothing)
            held = keys[key] = _Key(was.state, was.position, was.tombstone)
        if position is not None and (
            (held.position is not None and position < held.position)
            or (held.tombstone is not None and position < held.tombstone)
        ):
            outcomes.append(CommandOutcome.STALE)
            continue
        if isinstance(operation, TimerEntry):
            if held.state is _REACHED:
                # Nothing changes, the position included: a Reached timer is final.
                outcomes.append(CommandOutcome.IGNORED_REACHED)
                continue
            held.state, held.entry = _SCHEDULED, _unclaimed(operation)
            if position is not None:
                held.position = position
            outcomes.append(CommandOutcome.SCHEDULED)
            continue
        if position is not None and at is not None:
            held.tombstone = position
            tombstones[key] = Tombstone(key, position, at)
        if held.state is _SCHEDULED:
            # The timer goes, and the position stored with it: only a tombstone outlives it.
            held.state = held.entry = held.position = None
            outcomes.append(CommandOutcome.CANCELLED)
        else:
            outcomes.append(CommandOutcome.CANCEL_NOOP)
    inserts: list[StoredTimer] = []
    updates: list[StoredTimer] = []
    deletes: list[TimerKey] = []
    for key, held in keys.items():
        before = stored.get(key, nothing).state
        if held.entry is not None:
            write = StoredTimer(held.entry, held.position)
            (inserts if before is None else updates).append(write)
        elif before is _SCHEDULED and held.state is None:
            deletes.append(key)
    return Replay(outcomes, inserts, updates, deletes, list(tombstones.values()))


def _unclaimed(entry: TimerEntry) -> TimerEntry:
    """``entry`` as a store keeps it: without the claim a find may have put on it."""
    return entry if entry.claim is None else attrs.evolve(entry, claim=None)


def new_timers(operations: Sequence[TimerOperation]) -> list[StoredTimer] | None:
    """The timers a batch stores if none of its keys holds anything yet, else None.

    Only for a batch that schedules and names each key once (None for any other): with
    nothing stored for its keys, :func:`replay` inserts every timer and each outcome is
    ``SCHEDULED``. A store tries such a batch as inserts that fail, all of them, if any key
    holds a timer or a tombstone, and replays the batch when they fail: one statement for
    the usual batch instead of a read and a write.
    """
    timers: list[StoredTimer] = []
    # Plain tuples, not TimerKeys: once per command stored, on the schedule path.
    seen: set[tuple[str, str]] = set()
    for operation in operations:
        position: int | None = None
        if isinstance(operation, PositionedOperation):
            position = operation.position
            if type(position) is not int or position < 0:
                raise ValueError(f"a command position is a non-negative int, got {position!r}")
            operation = operation.operation
        if not isinstance(operation, TimerEntry):
            return None
        if operation.state is not _SCHEDULED:
            raise ValueError(f"only Scheduled timers can be scheduled, got {operation}")
        key = (operation.tenant_id, operation.service_call_id)
        if key in seen:
            return None
        seen.add(key)
        timers.append(StoredTimer(_unclaimed(operation), position))
    return timers


def operation_keys(operations: Sequence[TimerOperation]) -> list[TimerKey]:
    """The keys ``operations`` are for, each once, in the order they first appear: what a
    store reads before :func:`replay`."""
    keys: dict[TimerKey, None] = {}
    for operation in operations:
        if isinstance(operation, PositionedOperation | TimerEntry):
            keys[operation.key] = None
        else:
            keys[TimerKey(*operation)] = None
    return list(keys)


def new_timers_scheduled(timers: Sequence[StoredTimer]) -> list[CommandOutcome]:
    """The outcomes of a batch :func:`new_timers` gave, once its timers are all inserted."""
    return [CommandOutcome.SCHEDULED] * len(timers)


def marked(stored: TimerEntry | None, reached: TimerEntry) -> TimerEntry | None:
    """The timer a store keeps after marking ``reached`` (a ``Reached`` entry) over
    ``stored``, or None when the mark leaves it alone (see :meth:`TimerStore.mark_reached
    <timer_core.ports.TimerStore.mark_reached>`): only a timer still ``Scheduled`` at the due
    time that was read is marked, and only its state and ``reached_at`` change."""
    if reached.reached_at is None:
        raise ValueError(f"mark_reached needs Reached entries, got {reached}")
    if stored is None or not stored.is_scheduled or stored.due_at != reached.due_at:
        return None
    return _unclaimed(stored.reach(reached.reached_at))
