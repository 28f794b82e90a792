"""The drain's state machine: batch after batch through a :class:`~timer_core.firing.
FiringPipeline`, the store work of neighbouring batches overlapping their delivery."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import attrs

from timer_core._entry import TimerEntry, TimerKey
from timer_core.errors import PublishError
from timer_core.firing import (
    Delivered,
    DrainReport,
    DueBatch,
    FiringPipeline,
    FiringReport,
    PendingMark,
)

__all__ = ["Drain"]

log = logging.getLogger(__name__)

# Deliveries in flight at once in a drain, with a delivery that keeps their order: enough
# for about this many events (JetStream acks the first while the last are sent), at least
# two (the next batch sent while this one's acks come back), at most this many batches.
_SENT_EVENTS = 400
_MOST_SENT = 4


def _sent_at_once(batch_size: int, *, leasing: bool) -> int:
    """How many batches' deliveries a drain has in flight (with a delivery that keeps their
    order): two for big batches and for a leasing store (its claims wait for no one), up to
    four of small ones (batches of 100, the default)."""
    if leasing:
        return 2
    return max(2, min(_MOST_SENT, _SENT_EVENTS // max(batch_size, 1)))


@attrs.define
class _Sent:
    """A batch whose delivery is under way."""

    batch: DueBatch
    delivering: asyncio.Future[Delivered]


class Drain:
    """One :meth:`FiringPipeline.drain <timer_core.firing.FiringPipeline.drain>`: its
    batches in flight, read ahead, and being marked, by name."""

    def __init__(
        self,
        pipeline: FiringPipeline,
        *,
        stopping: Callable[[], bool] | None,
        on_batch: Callable[[FiringReport], None] | None,
        carried: PendingMark | None,
    ) -> None:
        self.pipeline = pipeline
        self.stopping: Callable[[], bool] = stopping or (lambda: False)
        self.on_batch = on_batch
        # A store that takes no lease may hand its last mark over to the next drain.
        self.carries = pipeline.lease_s is None
        self.skip: frozenset[TimerKey] = (
            carried.keys if carried is not None and self.carries else frozenset()
        )
        # With a delivery that keeps the order of its calls, the next batches are read and
        # sent while the acks of those before come back: up to ``depth`` in flight.
        self.overlap = pipeline.delivery.keeps_call_order
        self.depth = (
            _sent_at_once(pipeline.batch_size, leasing=not self.carries) if self.overlap else 1
        )
        # One batch more is read while ``depth`` are in flight (not claimed ahead of its turn
        # by a leasing store whose deliveries overlap: its lease would run while it waits).
        self.holds = self.carries or not self.overlap
        self.sending: deque[_Sent] = deque()
        self.ready: DueBatch | None = None  # read, waiting for a delivery to end to be sent
        self.ahead: asyncio.Task[DueBatch] | None = None  # a find under way
        # The last mark started (or the carried one), and what it marks once this drain
        # started a mark of its own (else the carried keys).
        self.marking: asyncio.Future[None] | None = None if carried is None else carried.marking
        self.marked: list[TimerEntry] | None = None
        # The mark before ``marking``, when that one was queued behind it (never with a
        # leasing store): this one's own timers are marked by the time ``marking`` is done.
        self.earlier: asyncio.Future[None] | None = None
        # Delivered batches waiting to be marked together (a store without leases), and how
        # many timers they hold.
        self.gathered: list[tuple[DueBatch, Delivered]] = []
        self.gathered_timers = 0
        self.batches = self.fired = self.expired = 0
        self.failed: list[tuple[TimerEntry, PublishError]] = []

    async def run(self, *, finish_marks: bool) -> DrainReport:
        """Drain; the report, with the last mark handed over unless ``finish_marks``."""
        first = await self._find_after(None)
        if not first.due and self.on_batch is not None:
            self.on_batch(first.report())
        last = first  # the last batch read: the next one is read after it
        if first.due:
            self._send(first)
        unfinished: asyncio.Future[None] | None = None
        try:
            while self.sending:
                last = await self._read_ahead(last)
                await self._settle_oldest()
                await asyncio.sleep(0)  # a long drain still lets the command consumer run
            if self.earlier is not None:
                settled, self.earlier = self.earlier, None
                await settled  # only the last mark may be handed over
            if self.marking is not None:
                previous, self.marking = self.marking, None
                if finish_marks or not self.carries or previous.done():
                    await previous
                else:
                    unfinished = previous
        finally:
            await self._end()
        return DrainReport(
            batches=self.batches,
            fired=self.fired,
            failed=self.failed,
            expired=self.expired,
            unfinished_mark=None if unfinished is None else self._pending(unfinished),
        )

    def _find_after(self, batch: DueBatch | None) -> asyncio.Task[DueBatch]:
        """The batch after ``batch`` (the first without): by its cursor, or shared among
        tenants after theirs."""
        find = self.pipeline.find(
            None if batch is None else batch.cursor,
            tenants=None if batch is None else batch.tenants,
            skip=self.skip,
        )
        return asyncio.ensure_future(find)

    def _send(self, batch: DueBatch) -> None:
        self.sending.append(_Sent(batch, asyncio.ensure_future(self.pipeline.deliver(batch))))

    async def _read_ahead(self, last: DueBatch) -> DueBatch:
        """Read ahead while the batches sent are delivered: send what was read while fewer
        than ``depth`` are in flight, and hold one more, read, until one finishes; the last
        batch read."""
        while (
            self.ready is None
            and (self.holds or len(self.sending) < self.depth)
            and last.cursor is not None
            and not self.stopping()
            # With two in flight and the oldest done, that one is marked and reported first.
            and (len(self.sending) < 2 or not self.sending[0].delivering.done())
        ):
            self.ahead = self._find_after(last)
            last, self.ahead = await self.ahead, None
            if not last.due:
                break
            if self.stopping():
                await self.pipeline.release(last.due)  # read ahead, never delivered
                break
            if len(self.sending) < self.depth:
                self._send(last)
            else:
                self.ready = last
        return last

    async def _settle_oldest(self) -> None:
        """The oldest batch sent: once delivered, counted and its mark queued; then what was
        read ahead is sent (unless stopping meanwhile)."""
        sent = self.sending.popleft()
        delivered = await sent.delivering
        self.batches += 1
        self.fired += len(delivered.reached)
        self.failed += delivered.failed
        self.expired += len(delivered.expired)
        if self.ready is not None:
            waiting, self.ready = self.ready, None
            if self.stopping():
                await self.pipeline.release(waiting.due)
            else:
                self._send(waiting)
        if not self.carries:
            await self._start_mark([(sent.batch, delivered)])
            return
        self.gathered.append((sent.batch, delivered))
        self.gathered_timers += len(delivered.reached)
        # Marked together once enough are delivered, or when no batch follows in this drain,
        # or at once after a batch with failures (the caller hears of them without delay: a
        # broker down ends the drain after a few batches).
        if (
            self.gathered_timers >= self.pipeline.mark_at_once
            or not self.sending
            or delivered.failed
            or delivered.expired
        ):
            group, self.gathered, self.gathered_timers = self.gathered, [], 0
            await self._start_mark(group)

    async def _start_mark(self, group: list[tuple[DueBatch, Delivered]]) -> None:
        """Start marking delivered batches (queued behind the last mark, two in flight at
        most; a leasing store's one at a time)."""
        if self.earlier is not None:
            settled, self.earlier = self.earlier, None
            await settled  # two marks in flight at most
        previous, self.marking = self.marking, None
        if previous is not None and not self.carries:
            await previous  # a leasing store: one mark at a time
            previous = None
        self.marking = asyncio.ensure_future(self._mark(group, after=previous))
        self.earlier = previous
        self.marked = [entry for _, delivered in group for entry in delivered.reached]

    async def _mark(
        self,
        group: list[tuple[DueBatch, Delivered]],
        *,
        after: asyncio.Future[None] | None,
    ) -> None:
        """Mark delivered batches in one store call, then report each; with ``after`` (the
        previous mark, still running), the mark is queued at once, right behind that one (a
        store may commit both in one transaction), and finished and reported after it (whose
        error is the drain's to raise). A batch whose claims ran out is not marked."""
        marked = [(batch, delivered) for batch, delivered in group if not delivered.expired]
        writing: asyncio.Future[int] | None = None
        if after is not None:
            reached = [entry for _, delivered in marked for entry in delivered.reached]
            if reached:
                writing = asyncio.ensure_future(self.pipeline.store.mark_reached(reached))
            await asyncio.wait({after})
        if marked:
            await self.pipeline.mark_together(marked, writing)
        if self.on_batch is not None:
            for batch, delivered in group:
                self.on_batch(batch.report(delivered))

    def _pending(self, marking: asyncio.Future[None]) -> PendingMark:
        marked = self.marked
        keys = self.skip if marked is None else frozenset(entry.key for entry in marked)
        return PendingMark(marking, keys)

    async def _end(self) -> None:
        """Ending, early or not: a delivery in flight is cancelled (its timers stay Scheduled
        and are delivered again later, under the same ids), the last marks are finished, and
        a batch read ahead and never delivered is handed back."""
        for sent in self.sending:
            delivering = sent.delivering
            if not delivering.done():
                delivering.cancel()
                await asyncio.wait({delivering})
            if not delivering.cancelled():
                delivering.exception()  # retrieved: the drain's own error is what is raised
        if self.gathered:
            # Delivered, never marked (the drain failed meanwhile): marked now if the store
            # lets it, else they are delivered again later, under the same ids.
            group, self.gathered, self.gathered_timers = self.gathered, [], 0
            await self._start_mark(group)
        for marking in (self.earlier, self.marking):
            if marking is None:
                continue
            try:
                await marking
            except Exception as exc:  # the drain is failing already; this one is only logged
                log.warning("marking a fired batch failed (%s); it will be published again", exc)
        if self.ahead is not None:
            try:
                found = await self.ahead
            except Exception:  # nothing was claimed, so nothing to hand back
                found = None
            if found is not None and found.due:
                await self.pipeline.release(found.due)
        if self.ready is not None:
            await self.pipeline.release(self.ready.due)  # read ahead, never delivered
