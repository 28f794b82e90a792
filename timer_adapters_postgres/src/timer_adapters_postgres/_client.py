"""Scheduling from synchronous code without a broker: each call one transaction of its own."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
import sqlalchemy.exc

from timer_adapters_postgres._connections import sqlalchemy_url
from timer_adapters_postgres._errors import translate_error
from timer_adapters_postgres._schema import migrate
from timer_adapters_postgres._writes import cancel_in_transaction, schedule_in_transaction
from timer_core import CancelTimer, Clock, CommandOutcome, ScheduleTimer, StoreClient, SystemClock

__all__ = ["PostgresTimerClient"]


class PostgresTimerClient(StoreClient):
    """Schedules and cancels timers from synchronous code on the stores' PostgreSQL database,
    with no broker (:class:`~timer_core.StoreClient`'s ``schedule``, ``cancel`` and
    ``close``).

    Each call is a transaction of its own, committed with ``synchronous_commit`` on (whatever
    the server's default) before it returns. Its ``NOTIFY`` wakes every
    :class:`PostgresTimerStore` listening on ``notify_channel``, whose
    :class:`~timer_core.Timer` fires the timer when it is due. To schedule as part of a
    transaction of your own (an order and its timeout together), use
    :func:`schedule_in_transaction` with that transaction's connection instead.

    ``PostgresTimerClient.open(url)`` (``postgresql://user:password@host:port/database``)
    creates the timer schema if the database has none yet; its pool holds ``pool_size``
    connections. A database that cannot be reached raises
    :class:`~timer_core.errors.StoreUnavailable`.
    """

    def __init__(self, engine: sa.Engine, clock: Clock, notify_channel: str) -> None:
        super().__init__(clock)
        self._engine = engine
        self._channel = notify_channel

    @classmethod
    def open(
        cls,
        url: str,
        *,
        clock: Clock | None = None,
        pool_size: int = 2,
        connect_timeout_s: float = 5.0,
        notify_channel: str = "timer_schedules",
    ) -> PostgresTimerClient:
        """A client of the timer stores on the database at ``url`` (schema made if missing)."""
        engine = sa.create_engine(
            sqlalchemy_url(url),
            pool_size=pool_size,
            pool_pre_ping=True,
            connect_args={
                "connect_timeout": max(1, round(connect_timeout_s)),
                # As the stores' own command connections: acknowledged means on disk.
                "options": "-c TimeZone=UTC -c synchronous_commit=on",
            },
        )
        try:
            with engine.begin() as connection:
                migrate(connection)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            engine.dispose()
            raise translate_error(exc, "migrate the timer schema") from exc
        return cls(engine, clock or SystemClock(), notify_channel)

    def _apply(self, command: ScheduleTimer | CancelTimer, now: datetime) -> CommandOutcome:
        channel = self._channel
        try:
            with self._engine.begin() as connection:
                if isinstance(command, ScheduleTimer):
                    return schedule_in_transaction(
                        connection, command, now=now, notify_channel=channel
                    )
                return cancel_in_transaction(connection, command, notify_channel=channel)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise translate_error(exc, "write timers") from exc

    def close(self) -> None:
        self._engine.dispose()
