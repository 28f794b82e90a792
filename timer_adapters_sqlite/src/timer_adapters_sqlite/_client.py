"""Scheduling from synchronous code without a broker: each call one transaction of its own."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Self, TypeVar

import sqlalchemy as sa
import sqlalchemy.exc

from timer_adapters_sqlite._errors import translate_error
from timer_adapters_sqlite._in_transaction import cancel_in_transaction, schedule_in_transaction
from timer_adapters_sqlite._schema import Synchronous, create_sqlite_engine, migrate
from timer_core import CancelTimer, Clock, CommandOutcome, ScheduleTimer, SystemClock

_T = TypeVar("_T")

__all__ = ["SqliteTimerClient"]


class SqliteTimerClient:
    """Schedules and cancels timers from synchronous code (a Django or Flask view, a script, a
    cron job) on the store's SQLite file, with no broker.

    Each call is one transaction of its own, committed (and synced, at the default
    ``synchronous="FULL"``) before it returns: the timer exists once ``schedule`` returned.
    The :class:`SqliteTimerStore` of a running :class:`~timer_core.Timer` on the same file
    sees the commit within its ``watch_interval_s`` and fires the timer when it is due. To
    schedule as part of a transaction of your own (an order and its timeout together), use
    :func:`schedule_in_transaction` with that transaction's connection instead.

    ``SqliteTimerClient.open(path)`` creates the timer schema if the file has none yet; keep
    the client for the process's life (``close()`` at exit) or use it as ``with``. Any number
    of threads may call one client: writers take the file's write lock in turn, each waiting
    up to ``busy_timeout_ms`` for it (then :class:`~timer_core.errors.StoreUnavailable`).
    Bad arguments raise :class:`~timer_core.errors.ValidationError` before anything is
    written.
    """

    def __init__(self, engine: sa.Engine, clock: Clock) -> None:
        self._engine = engine
        self._clock = clock
        self._where = str(engine.url.database)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        synchronous: Synchronous = "FULL",
        busy_timeout_ms: int = 5000,
    ) -> SqliteTimerClient:
        """A client of the timer store in the SQLite file ``path`` (schema made if missing)."""
        engine = create_sqlite_engine(
            path, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms
        )
        migrate(engine)
        return cls(engine, clock or SystemClock())

    def schedule(
        self,
        tenant_id: str,
        service_call_id: str,
        due_at: datetime,
        *,
        correlation_id: str | None = None,
    ) -> CommandOutcome:
        """Ask for ``DueTimeReached`` at ``due_at`` (aware); a later call reschedules.

        Returns ``SCHEDULED``, or ``IGNORED_REACHED`` when the timer already fired (a fired
        timer is never re-armed).
        """
        command = ScheduleTimer(tenant_id, service_call_id, due_at, correlation_id=correlation_id)
        now = self._clock.now()
        return self._write(lambda connection: schedule_in_transaction(connection, command, now=now))

    def cancel(self, tenant_id: str, service_call_id: str) -> CommandOutcome:
        """Cancel the timer if it has not fired: ``CANCELLED``, else ``CANCEL_NOOP``."""
        command = CancelTimer(tenant_id, service_call_id)
        return self._write(lambda connection: cancel_in_transaction(connection, command))

    def _write(self, write: Callable[[sa.Connection], _T]) -> _T:
        try:
            with self._engine.connect() as connection:
                # The engine leaves transactions to us: take the write lock up front, so a
                # busy file is waited for here rather than failing half way.
                connection.exec_driver_sql("BEGIN IMMEDIATE")
                outcome = write(connection)
                connection.commit()
                return outcome
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise translate_error(exc, self._where) from exc

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
