"""Scheduling from synchronous code without a broker: each call one transaction of its own."""

from __future__ import annotations

import os
from datetime import datetime

import sqlalchemy as sa
import sqlalchemy.exc

from timer_adapters_sqlite._errors import translate_error
from timer_adapters_sqlite._in_transaction import cancel_in_transaction, schedule_in_transaction
from timer_adapters_sqlite._schema import Synchronous, create_sqlite_engine, migrate
from timer_core import CancelTimer, Clock, CommandOutcome, ScheduleTimer, StoreClient, SystemClock

__all__ = ["SqliteTimerClient"]


class SqliteTimerClient(StoreClient):
    """Schedules and cancels timers from synchronous code on the store's SQLite file, with no
    broker (:class:`~timer_core.StoreClient`'s ``schedule``, ``cancel`` and ``close``).

    Each call is a transaction of its own, committed (and synced, at the default
    ``synchronous="FULL"``) before it returns; the :class:`SqliteTimerStore` of a running
    :class:`~timer_core.Timer` on the same file sees the commit within its
    ``watch_interval_s`` and fires the timer when it is due. To schedule as part of a
    transaction of your own (an order and its timeout together), use
    :func:`schedule_in_transaction` with that transaction's connection instead.

    ``SqliteTimerClient.open(path)`` creates the timer schema if the file has none yet.
    Writers take the file's write lock in turn, each waiting up to ``busy_timeout_ms`` for it
    (then :class:`~timer_core.errors.StoreUnavailable`).
    """

    def __init__(self, engine: sa.Engine, clock: Clock) -> None:
        super().__init__(clock)
        self._engine = engine
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

    def _apply(self, command: ScheduleTimer | CancelTimer, now: datetime) -> CommandOutcome:
        try:
            with self._engine.connect() as connection:
                # The engine leaves transactions to us: take the write lock up front, so a
                # busy file is waited for here rather than failing half way.
                connection.exec_driver_sql("BEGIN IMMEDIATE")
                if isinstance(command, ScheduleTimer):
                    outcome = schedule_in_transaction(connection, command, now=now)
                else:
                    outcome = cancel_in_transaction(connection, command)
                connection.commit()
                return outcome
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise translate_error(exc, self._where) from exc

    def close(self) -> None:
        self._engine.dispose()
