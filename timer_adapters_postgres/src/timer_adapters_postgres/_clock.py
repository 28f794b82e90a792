"""The database's clock as a :class:`~timer_core.ports.Clock`: the one clock that decides when
a timer is due for every instance sharing a PostgreSQL database, never ahead of it.

Why the database's: with each instance judging ``due_at <= now`` by its own wall clock, one
whose clock ran 3 s ahead claimed every timer first and published all of them up to 3 s
early (issue 28). The database is the one clock every instance already shares (leases are
judged by its ``now()``), so due-ness and ``reachedAt`` are judged by it too.

How it stays never ahead: a reading of ``clock_timestamp()`` is taken by the database
somewhere between the instant the query was sent and the instant its answer arrived, so at
the receive instant the database's time is at least the reading (a lower bound) and at most
the reading plus the round trip (an upper bound). :meth:`DatabaseClock.now` extends the
lower bound on the monotonic clock, counting elapsed time short by :data:`DRIFT` (the most
two disciplined clocks' rates differ), so it stays a lower bound between readings. A new
reading keeps whichever lower bound is higher, unless the old one is above the new upper
bound: then the database's clock was stepped back and the new reading is taken as it is.
Sleeps stay on the monotonic clock; the host's wall clock is read only to measure the skew.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from timer_core import StoreError, StoreUnavailable

__all__ = ["DRIFT", "DatabaseClock"]

log = logging.getLogger(__name__)

#: How much faster than the database's clock this host's monotonic clock may run, as a
#: fraction (500 ppm: the most a kernel slews a clock NTP disciplines). Elapsed monotonic time
#: is counted short by this much, so :meth:`DatabaseClock.now` stays a lower bound between
#: readings; at a refresh every 2 s it costs at most 1 ms of lateness.
DRIFT = 500e-6
#: While the skew stays past the warning threshold, it is logged again this often.
_WARN_AGAIN_S = 600.0
#: The skew shown is that of the quickest of this many latest readings (its error is at most
#: half its round trip, and a busy host or database stretches some round trips a lot).
_SKEW_READINGS = 15
#: Readings taken back to back at start, so the first skew shown is a good one.
_FIRST_READINGS = 3

DatabaseReading = Callable[[], Awaitable[datetime]]
"""Reads the database's clock once (``SELECT clock_timestamp()``): an aware datetime."""


class DatabaseClock:
    """A :class:`~timer_core.ports.Clock` whose ``now`` is the database's time, never ahead.

    :meth:`start` takes a first reading (through ``read``) and then refreshes every
    ``refresh_s`` seconds; ``now`` before the first reading raises
    :class:`~timer_core.errors.StoreUnavailable`. A failed refresh leaves the clock running
    on the last reading (still a lower bound). :attr:`skew_s` is the host's wall clock minus
    the database's, as last measured; past ``skew_warning_s`` (None: never) a WARNING says
    so, again every ten minutes while it lasts, and an INFO line when it is back within.
    """

    def __init__(
        self,
        read: DatabaseReading,
        *,
        refresh_s: float = 2.0,
        skew_warning_s: float | None = 1.0,
        where: str = "the database",
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be positive, got {refresh_s}")
        if skew_warning_s is not None and not skew_warning_s > 0:
            raise ValueError(f"skew_warning_s must be positive or None, got {skew_warning_s}")
        self._read = read
        self._refresh_s = refresh_s
        self._skew_warning_s = skew_warning_s
        self._where = where
        self._monotonic = monotonic
        self._wall = wall
        # The lower bound: the database's time at the monotonic instant ``_anchor_mono``.
        self._anchor: datetime | None = None
        self._anchor_mono = 0.0
        self._skew_s: float | None = None
        self._round_trip_s: float | None = None
        self._readings: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=_SKEW_READINGS
        )
        self._warned_at: float | None = None
        self._judging = True  # whether a reading judges the skew (not while start reads)
        self._refreshing: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"DatabaseClock({self._where}, skew_s={self._skew_s})"

    # -- the Clock protocol ----------------------------------------------------------------

    def now(self) -> datetime:
        """The database's time now, or a little before it (never after it)."""
        anchor = self._anchor
        if anchor is None:
            raise StoreUnavailable(f"the clock of {self._where} was not read yet (not started)")
        return anchor + _seconds((self._monotonic() - self._anchor_mono) * (1 - DRIFT))

    def monotonic(self) -> float:
        return self._monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    # -- what it measured ------------------------------------------------------------------

    @property
    def source(self) -> str:
        """Which clock decides: ``"database"``."""
        return "database"

    @property
    def skew_s(self) -> float | None:
        """This host's wall clock minus the database's, in seconds (None before the first
        reading), from the quickest of the latest readings (every 2 s; the database read at
        the middle of the round trip). Positive: the host is ahead."""
        return self._skew_s

    @property
    def round_trip_s(self) -> float | None:
        """How long the reading behind :attr:`skew_s` took: twice the most it can be off."""
        return self._round_trip_s

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the database's clock (errors raised), then keep refreshing it. Idempotent."""
        if self._refreshing is not None:
            return
        # The skew is judged once the first readings are in: on a busy host the first round
        # trip alone can be stretched well past the quickest of them.
        self._judging = False
        try:
            for _ in range(_FIRST_READINGS):
                await self.refresh()
        finally:
            self._judging = True
        self._judge_skew(self._monotonic())
        self._refreshing = asyncio.create_task(self._refresh_forever(), name="timer-db-clock")

    async def aclose(self) -> None:
        """Stop refreshing; ``now`` goes on from the last reading."""
        refreshing, self._refreshing = self._refreshing, None
        if refreshing is not None:
            refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refreshing

    async def refresh(self) -> None:
        """Take one reading of the database's clock and fold it in (errors raised)."""
        sent = self._monotonic()
        database = await self._read()
        received = self._monotonic()
        self.observe(sent, database, received, self._wall())

    def observe(self, sent: float, database: datetime, received: float, host_wall: float) -> None:
        """Fold in one reading: ``database`` was read between the monotonic instants ``sent``
        and ``received``; ``host_wall`` is this host's wall clock (Unix seconds) at
        ``received``."""
        round_trip = max(0.0, received - sent)
        lower = database
        upper = database + _seconds(round_trip * (1 + DRIFT))
        if self._anchor is not None:
            kept = self._anchor + _seconds((received - self._anchor_mono) * (1 - DRIFT))
            # Above the new upper bound, the old one is wrong: the database's clock was set
            # back. Otherwise both are lower bounds and the higher one is the tighter.
            if lower < kept <= upper:
                lower = kept
        self._anchor, self._anchor_mono = lower, received
        # The database read its clock about halfway through the round trip: compare the
        # host's wall clock then.
        skew = (host_wall - round_trip / 2) - (database - _EPOCH).total_seconds()
        self._readings.append((round_trip, skew))
        # The quickest; of equally quick ones the latest.
        self._round_trip_s, self._skew_s = min(reversed(self._readings), key=_round_trip)
        if self._judging:
            self._judge_skew(received)

    # -- inside ------------------------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except StoreError as exc:
                if not failing:
                    log.warning(
                        "could not read the clock of %s (going on from the last reading): %s",
                        self._where,
                        exc,
                    )
                failing = True
                continue
            if failing:
                log.info("reading the clock of %s again", self._where)
            failing = False

    def _judge_skew(self, at: float) -> None:
        threshold, skew = self._skew_warning_s, self._skew_s
        if threshold is None or skew is None:
            return
        if abs(skew) > threshold:
            if self._warned_at is None or at - self._warned_at >= _WARN_AGAIN_S:
                self._warned_at = at
                log.warning(
                    "this host's clock is %+.3f s off the clock of %s (%s): the database's "
                    "clock decides when timers are due, so none fires early, but fix this "
                    "host's time synchronisation (NTP, chrony)",
                    skew,
                    self._where,
                    "ahead" if skew > 0 else "behind",
                )
        elif self._warned_at is not None:
            self._warned_at = None
            log.info(
                "this host's clock is back within %.3f s of the clock of %s (%+.3f s)",
                threshold,
                self._where,
                skew,
            )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _round_trip(reading: tuple[float, float]) -> float:
    return reading[0]


def _seconds(value: float) -> timedelta:
    # Rounded down to the microsecond: timedelta(seconds=...) rounds to the nearest one,
    # which could put a lower bound a microsecond past the database.
    return timedelta(microseconds=math.floor(value * 1_000_000))
