"""The far edge of a store that keeps timers far ahead apart from those coming due.

A SQL store's due-order indexes take each new timer at a random point when timers are set
days or weeks ahead, a page written per index per timer in a large table. A store may
instead keep the timers due at or after a *far edge* out of them (in indexes that only
take appends), and move them in as the edge passes them. What the store must guarantee is
one invariant, whatever clocks its writers read: **every pending timer due before the edge
is near** (in the due-order indexes). Then a find at ``now`` sees every due timer as long
as ``now`` is before the edge, which :class:`FarEdge` sees to: the store calls
:meth:`FarEdge.before_find` with the ``now`` of each find, and the edge is moved (by the
store's ``advance``) before the find reads when ``now`` has reached it, or beside the
finds, well ahead, when ``now`` comes within :data:`LEAD` of it.

The store's ``advance(target)`` moves every far timer due before ``target`` near and then,
in the same transaction as its last move, raises the stored edge to ``target`` (never
lowers it), and returns the stored edge. Edges are multiples of :data:`BUCKET`, so a
store can keep far timers by bucket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

__all__ = ["AHEAD", "BUCKET", "LEAD", "FarEdge", "edge_for"]

log = logging.getLogger(__name__)

BUCKET = timedelta(minutes=10)
"""Edges fall on multiples of this (from the Unix epoch)."""
AHEAD = timedelta(minutes=30)
"""A new edge is the bucket boundary at or before ``now + AHEAD``: at least 20 minutes
ahead, so that timers set less than that ahead are written near."""
LEAD = timedelta(minutes=10)
"""The edge is moved beside the finds once ``now`` comes this close to it."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def edge_for(now: datetime) -> datetime:
    """The edge a store moves to at ``now``: ``now + AHEAD`` floored to a :data:`BUCKET`."""
    ahead = now + AHEAD - _EPOCH
    return _EPOCH + ahead - ahead % BUCKET


class FarEdge:
    """The far edge as one store object last knew it, and the moves that keep it ahead.

    ``advance`` is the store's (see the module notes); another store object or process may
    have moved the edge meanwhile, which ``advance`` reports back. Moves run one at a time.
    """

    def __init__(self, advance: Callable[[datetime], Awaitable[datetime | None]]) -> None:
        self._advance = advance
        self.edge: datetime | None = None
        """The stored edge as last read or written (None: none known yet)."""
        self._lock = asyncio.Lock()
        self._ahead: asyncio.Task[None] | None = None

    async def before_find(self, now: datetime) -> None:
        """Make sure every timer due at ``now`` is near before a find at ``now`` reads."""
        edge = self.edge
        if edge is not None and now + LEAD < edge:
            return
        if edge is None or now >= edge:
            await self.move(now)
        elif self._ahead is None or self._ahead.done():
            self._ahead = asyncio.ensure_future(self._move_beside(now))

    async def move(self, now: datetime) -> None:
        """Move the edge to :func:`edge_for` ``now`` unless it is there already."""
        target = edge_for(now)
        async with self._lock:
            if self.edge is not None and self.edge >= target:
                return
            stored = await self._advance(target)
            if stored is not None and (self.edge is None or stored > self.edge):
                self.edge = stored

    async def _move_beside(self, now: datetime) -> None:
        try:
            await self.move(now)
        except Exception as exc:  # the next find tries again, awaited once it must
            log.warning("moving the far edge of the timer store failed (%s); retried", exc)

    async def aclose(self) -> None:
        """Wait for a move under way beside the finds (the store closes after it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await asyncio.gather(ahead, return_exceptions=True)
