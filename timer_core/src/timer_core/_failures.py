"""The timers a worker failed to deliver: backing off one by one, or quarantined.

The worker (:mod:`timer_core.worker`) keeps one :class:`FailureBook`, whatever its way out
(a broker, the host's handler). What fails, and when a timer is quarantined, is the
worker's to say; the book keeps the records, lists and retries the quarantined ones,
reports a quarantine and forgets the timers changed meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from datetime import datetime

import attrs

from timer_core._entry import TimerEntry, TimerKey, TimerState
from timer_core.errors import PublishError, StoreError
from timer_core.instrumentation import Instrumentation
from timer_core.ports import Clock, TimerStore

__all__ = ["FailureBook", "Failing", "QuarantinedTimer"]

# How often quarantined timers are checked against the store (cancelled, rescheduled).
_QUARANTINE_CHECK_S = 60.0


@attrs.frozen
class QuarantinedTimer:
    """A timer whose delivery kept failing: its ``DueTimeReached`` did not publish while
    others went out, or the host's handler failed it ``max_attempts`` times.

    It stays ``Scheduled`` in the store and is left out of every pass until it is retried
    (:meth:`Timer.retry_quarantined <timer_core.Timer.retry_quarantined>`) or the worker
    restarts.
    """

    entry: TimerEntry
    """The timer as last found due."""
    failures: int
    """Failed deliveries so far."""
    error: str
    """The last delivery error."""
    since: datetime
    """When it was quarantined (the worker's clock)."""


@attrs.define
class Failing:
    """One timer whose delivery failed: attempts so far, when to try again, the last error."""

    entry: TimerEntry
    failures: int = 0
    retry_at: float = 0.0
    """Monotonic time its backoff ends."""
    error: str = ""
    quarantined_at: datetime | None = None
    # The publishing worker's evidence: failures while other timers were published, and
    # the worker's count of published timers when this one last failed.
    strikes: int = 0
    published_then: int = 0


class FailureBook:
    """The records of one worker's failing timers, by key (in memory)."""

    def __init__(
        self,
        store: TimerStore,
        clock: Clock,
        instrumentation: Instrumentation,
        log: logging.Logger,
    ) -> None:
        self._log = log
        self._store = store
        self._clock = clock
        self._instrumentation = instrumentation
        self.records: dict[TimerKey, Failing] = {}
        self._next_check = 0.0

    def __bool__(self) -> bool:
        return bool(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, key: object) -> bool:
        return key in self.records

    def __iter__(self) -> Iterator[Failing]:
        return iter(self.records.values())

    def get(self, key: TimerKey) -> Failing | None:
        return self.records.get(key)

    def pop(self, key: TimerKey) -> Failing | None:
        return self.records.pop(key, None)

    def record_of(self, entry: TimerEntry, *, published_then: int = 0) -> Failing:
        """The timer's record, a new one if it has none or was rescheduled since (a
        rescheduled timer is a new one)."""
        record = self.records.get(entry.key)
        if record is None or record.entry.due_at != entry.due_at:
            record = Failing(entry, published_then=published_then)
            self.records[entry.key] = record
        return record

    @property
    def quarantined(self) -> list[QuarantinedTimer]:
        """The timers quarantined now, in the order they were."""
        return [
            QuarantinedTimer(record.entry, record.failures, record.error, record.quarantined_at)
            for record in self.records.values()
            if record.quarantined_at is not None
        ]

    def retry(self, keys: Iterable[TimerKey] | None = None) -> int:
        """Forget quarantined timers (all, or those of ``keys``), so they are tried again
        with a fresh count; returns how many."""
        wanted = None if keys is None else set(keys)
        retried = [
            key
            for key, record in self.records.items()
            if record.quarantined_at is not None and (wanted is None or key in wanted)
        ]
        for key in retried:
            del self.records[key]
        if retried:
            self._log.info("retrying %d quarantined timers", len(retried))
            self._report()
        return len(retried)

    def quarantine(
        self,
        record: Failing,
        error: PublishError,
        why: str,
        *,
        cause: BaseException | None = None,
    ) -> None:
        """Quarantine the timer of ``record`` (``why``: what its failures were), report it."""
        record.quarantined_at = self._clock.now()
        entry = record.entry
        self._log.error(
            "timer %s/%s (due %s) quarantined: %s (last error: %s); it stays Scheduled and "
            "is left out until retried (retry_quarantined)",
            entry.tenant_id,
            entry.service_call_id,
            entry.due_at.isoformat(),
            why,
            error,
            exc_info=cause,
            extra={"tenant_id": entry.tenant_id, "service_call_id": entry.service_call_id},
        )
        self._instrumentation.timer_quarantined(entry, error, record.failures)
        self._report()

    def _report(self) -> None:
        """Tell the instrumentation how many are quarantined now, and since when the oldest."""
        since = [r.quarantined_at for r in self.records.values() if r.quarantined_at is not None]
        self._instrumentation.quarantine_size(len(since))
        self._instrumentation.quarantine_oldest(min(since, default=None))

    async def forget_stale(self) -> None:
        """At most once a minute: drop quarantined timers cancelled, fired elsewhere or
        rescheduled meanwhile (a store error leaves it for the next time)."""
        now = self._clock.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _QUARANTINE_CHECK_S
        stale = []
        for key, record in list(self.records.items()):
            if record.quarantined_at is None:
                continue
            try:
                current = await self._store.get(key.tenant_id, key.service_call_id)
            except StoreError:
                return
            if (
                current is None
                or current.state is not TimerState.SCHEDULED
                or current.due_at != record.entry.due_at
            ):
                stale.append(key)
        for key in stale:
            self.records.pop(key, None)
        if stale:
            self._log.info("%d quarantined timers were cancelled or changed meanwhile", len(stale))
            self._report()
