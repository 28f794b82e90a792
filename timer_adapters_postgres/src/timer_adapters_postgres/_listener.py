"""``LISTEN`` for timers scheduled by other instances, so their workers wake before the next poll.

Each store holds one dedicated autocommit psycopg connection in the event loop. A lost
connection is re-opened with backoff; since notifications sent meanwhile are lost, the
callback is then called once with the earliest instant (a "look again" hint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from time import monotonic

import psycopg
from psycopg import sql

from timer_core import StoreUnavailable
from timer_core.instants import from_epoch_ms, to_epoch_ms

__all__ = ["EARLIEST", "ScheduleListener", "notify_payload", "parse_payload", "peer_payload"]

log = logging.getLogger(__name__)

#: Passed to the callback after a reconnect: earlier than any wake-up, so the worker looks.
EARLIEST = datetime.min.replace(tzinfo=UTC)

_RECONNECT_INITIAL_S = 0.1
_RECONNECT_MAX_S = 5.0
# An instance's "I am here" on the channel (see PostgresTimerStore): not a schedule's
# payload, so listeners that do not know it ignore it.
_PEER = "peer "
# Instances remembered at most; those not heard for a minute are forgotten first.
_MOST_PEERS = 256
_FORGOTTEN_S = 60.0


def notify_payload(due_at: datetime, owner_id: str) -> str:
    """The ``NOTIFY`` payload for a timer due at ``due_at`` scheduled by ``owner_id``."""
    return f"{to_epoch_ms(due_at)} {owner_id}"


def peer_payload(owner_id: str) -> str:
    """The ``NOTIFY`` payload by which the instance ``owner_id`` says it is there."""
    return _PEER + owner_id


def parse_payload(payload: str) -> tuple[datetime, str] | None:
    """``(due_at, owner_id)`` from a payload, or None if it is not one of ours."""
    millis, _, owner = payload.partition(" ")
    try:
        return from_epoch_ms(int(millis)), owner
    except (ValueError, OverflowError):
        return None


class ScheduleListener:
    """Delivers the due times other instances ``NOTIFY`` on ``channel`` to ``deliver``.

    Notifications from ``own_id`` (this store's own schedules) are skipped: the host wakes
    its own worker directly.
    """

    def __init__(
        self,
        conninfo: str,
        channel: str,
        own_id: str,
        deliver: Callable[[datetime], None],
        *,
        connect_timeout_s: float,
    ) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._own_id = own_id
        self._deliver = deliver
        self._connect_timeout = max(1, round(connect_timeout_s))
        self._conn: psycopg.AsyncConnection[tuple[object, ...]] | None = None
        self._task: asyncio.Task[None] | None = None
        # Other instances heard on the channel, and when (time.monotonic()).
        self._peers: dict[str, float] = {}

    def peers(self, within_s: float) -> list[str]:
        """The other instances heard on the channel in the last ``within_s`` seconds."""
        now = monotonic()
        return sorted(owner for owner, at in self._peers.items() if now - at <= within_s)

    async def start(self) -> None:
        """Connect and ``LISTEN``; raises :class:`StoreUnavailable` if the server is down."""
        if self._task is not None:
            return
        try:
            self._conn = await self._connect()
        except psycopg.Error as exc:
            raise StoreUnavailable(f"PostgreSQL failed to LISTEN: {exc}") from exc
        self._task = asyncio.create_task(self._run(), name=f"timer-listen-{self._channel}")

    async def aclose(self) -> None:
        """Stop listening and close the connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close()

    async def _connect(self) -> psycopg.AsyncConnection[tuple[object, ...]]:
        conn = await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, connect_timeout=self._connect_timeout
        )
        try:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    async def _run(self) -> None:
        delay = _RECONNECT_INITIAL_S
        while True:
            if self._conn is None:
                try:
                    self._conn = await self._connect()
                except psycopg.Error as exc:
                    log.warning("LISTEN connection failed (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(_RECONNECT_MAX_S, delay * 2)
                    continue
                delay = _RECONNECT_INITIAL_S
                log.info("LISTEN on %s re-established", self._channel)
                self._hand_over(EARLIEST)  # what was sent while we were away is lost
            try:
                async for notify in self._conn.notifies():
                    self._on_notify(notify.payload)
                reason = "the server closed it"
            except psycopg.Error as exc:
                reason = str(exc)
            log.warning("LISTEN connection lost (%s); reconnecting", reason)
            await self._close()

    def _on_notify(self, payload: str) -> None:
        if payload.startswith(_PEER):
            self._heard(payload[len(_PEER) :])
            return
        parsed = parse_payload(payload)
        if parsed is None:
            log.debug("ignoring notification %r on %s", payload, self._channel)
            return
        due_at, owner = parsed
        if owner != self._own_id:
            self._hand_over(due_at)

    def _heard(self, owner: str) -> None:
        if not owner or owner == self._own_id:
            return
        now = monotonic()
        self._peers[owner] = now
        if len(self._peers) > _MOST_PEERS:
            for old in [o for o, at in self._peers.items() if now - at > _FORGOTTEN_S]:
                del self._peers[old]

    def _hand_over(self, due_at: datetime) -> None:
        try:
            self._deliver(due_at)
        except Exception:  # the host's callback must not kill the listener
            log.exception("the on_remote_schedule callback failed")
