"""Statements the drain runs once per batch, on connections of the store's own in the event loop.

A claim and a mark per batch of due timers are the store's hottest statements. Run in the
store's thread pool, each one woke a thread and then the loop again, and with several
instances on a busy machine the thread and the loop kept taking the GIL from each other.
A :class:`StatementLane` holds one autocommit psycopg connection used from the event loop
itself: a statement is sent and its rows read by the loop's selector, no thread involved.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.rows import namedtuple_row

from timer_adapters_postgres._errors import is_retryable, translate_error
from timer_core import StoreUnavailable

__all__ = ["StatementLane", "pyformat"]

log = logging.getLogger(__name__)

_ATTEMPTS = 5  # for deadlocks and serialisation failures, as the store's own calls
_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def pyformat(statement: sa.TextClause) -> str:
    """``statement``'s SQL with its ``:name`` parameters written as psycopg's ``%(name)s``."""
    text = statement.text
    if "%" in text:
        raise ValueError("a statement for a lane must not contain '%'")
    return _NAMED.sub(r"%(\1)s", text)


class StatementLane:
    """One autocommit connection, opened on first use and again after it was lost.

    Statements run one at a time, each in its own implicit transaction; one that failed on
    a conflict (deadlock, serialisation failure) runs again. Errors are raised as the
    store raises them (:func:`translate_error`): a lost connection is
    :class:`~timer_core.StoreUnavailable` once, and the next statement reconnects.

    A statement runs to its end even when the caller is cancelled meanwhile (its result is
    then dropped), as a call into the store's thread pool does: the connection is never
    left in the middle of an exchange with the server.
    """

    def __init__(self, conninfo: str, *, options: str, connect_timeout_s: float) -> None:
        self._conninfo = conninfo
        self._options = options
        self._connect_timeout = max(1, round(connect_timeout_s))
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self.statements: list[str] | None = None
        """When a list (tests), every statement sent is appended to it."""

    async def fetch(self, action: str, sql: str, params: Mapping[str, Any]) -> list[Any]:
        """The rows ``sql`` returns (named tuples)."""
        rows, _ = await self._shielded(action, sql, params, fetch=True)
        return rows

    async def execute(self, action: str, sql: str, params: Mapping[str, Any]) -> int:
        """The number of rows ``sql`` changed."""
        _, count = await self._shielded(action, sql, params, fetch=False)
        return count

    async def aclose(self) -> None:
        """Close the connection once the statement in flight (if any) is done."""
        async with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
            if conn is not None:
                await conn.close()

    async def _shielded(
        self, action: str, sql: str, params: Mapping[str, Any], *, fetch: bool
    ) -> tuple[list[Any], int]:
        running = asyncio.ensure_future(self._run(action, sql, params, fetch=fetch))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            # The statement finishes on its own; its outcome is nobody's to raise.
            running.add_done_callback(_retrieved)
            raise

    async def _run(
        self, action: str, sql: str, params: Mapping[str, Any], *, fetch: bool
    ) -> tuple[list[Any], int]:
        async with self._lock:
            for attempt in range(1, _ATTEMPTS + 1):
                conn = await self._connection(action)
                if self.statements is not None:
                    self.statements.append(sql)
                try:
                    cursor = await conn.execute(sql, params)
                    rows: Sequence[Any] = await cursor.fetchall() if fetch else ()
                    return list(rows), cursor.rowcount
                except psycopg.Error as exc:
                    if conn.broken or conn.closed:
                        self._conn = None
                        await _close_quietly(conn)
                    if not is_retryable(exc) or attempt == _ATTEMPTS:
                        raise translate_error(exc, action) from exc
                    log.debug("%s conflicted (%s); attempt %d", action, exc, attempt)
            raise AssertionError("unreachable")  # pragma: no cover

    async def _connection(self, action: str) -> psycopg.AsyncConnection[Any]:
        if self._closed:
            raise StoreUnavailable("the PostgreSQL timer store is closed")
        if self._conn is None:
            try:
                self._conn = await psycopg.AsyncConnection.connect(
                    self._conninfo,
                    autocommit=True,
                    row_factory=namedtuple_row,
                    options=self._options,
                    connect_timeout=self._connect_timeout,
                    application_name="timer",
                )
            except psycopg.Error as exc:
                raise translate_error(exc, action) from exc
        return self._conn


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _close_quietly(conn: psycopg.AsyncConnection[Any]) -> None:
    try:
        await conn.close()
    except psycopg.Error:  # it is broken already
        pass
