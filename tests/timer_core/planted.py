"""Four bugs a custom store can make, each planted into the reference memory store.

Each passed the whole shipped store contract once (issue 44): the contract now has a test
that each of them fails. ``planted_contract.py`` binds the contract to every one of them;
``test_planted_bugs.py`` runs it and asserts which fail.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from timer_adapters_memory import MemoryTimerStore
from timer_core import CommandOutcome, DueCursor, TenantId, TimerEntry, TimerKey, TimerOperation


class _Planted(MemoryTimerStore):
    """The memory store with one bug planted; each subclass says which."""

    def _plain_cancels(self, operations: Sequence[TimerOperation]) -> list[TimerKey]:
        """The keys of the cancels without a position in ``operations``."""
        return [TimerKey(*op) for op in operations if isinstance(op, TimerKey)]


class CancelDropsTombstone(_Planted):
    """A cancel without a position deletes the key's cancel tombstone (a stale positioned
    schedule is then accepted: SCHEDULED instead of STALE)."""

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        outcomes = await super().apply(operations)
        for key in self._plain_cancels(operations):
            self._storage.tombstones.pop(key, None)
        return outcomes


class CancelOfReachedDropsPosition(_Planted):
    """A cancel without a position of a ``Reached`` timer forgets the position stored with
    it (an older positioned schedule is then IGNORED_REACHED instead of STALE)."""

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        outcomes = await super().apply(operations)
        for key in self._plain_cancels(operations):
            timer = self._storage.timers.get(key)
            if timer is not None and not timer.is_scheduled:
                self._storage.positions[key] = None
        return outcomes


class KeepsTheCallersEntry(_Planted):
    """``apply`` keeps the caller's entry as it came, with the claim it carries (``get``
    then returns another store's claim)."""

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        outcomes = await super().apply(operations)
        for op, outcome in zip(operations, outcomes, strict=True):
            stored = self._storage.timers.get(op.key) if isinstance(op, TimerEntry) else None
            if stored == op and outcome is CommandOutcome.SCHEDULED:
                self._storage.timers[op.key] = op  # the same due time: the indexes still hold
        return outcomes


class FindsByTenantEarly(_Planted):
    """``find_due_by_tenant`` returns timers up to 999 ms before they are due."""

    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        return await super().find_due_by_tenant(
            now + timedelta(milliseconds=999), limit, after=after
        )


PLANTED: dict[str, type[MemoryTimerStore]] = {
    "CancelDropsTombstone": CancelDropsTombstone,
    "CancelOfReachedDropsPosition": CancelOfReachedDropsPosition,
    "KeepsTheCallersEntry": KeepsTheCallersEntry,
    "FindsByTenantEarly": FindsByTenantEarly,
}
