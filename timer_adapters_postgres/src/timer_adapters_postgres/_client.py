"""Scheduling from synchronous code without a broker: each call one transaction of its own."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Self, TypeVar

import sqlalchemy as sa
import sqlalchemy.exc

from timer_adapters_postgres._connections import sqlalchemy_url
from timer_adapters_postgres._errors import translate_error
from timer_adapters_postgres._schema import migrate
from timer_adapters_postgres._writes import cancel_in_transaction, schedule_in_transaction
from timer_core import CancelTimer, Clock, CommandOutcome, ScheduleTimer, SystemClock

_T = TypeVar("_T")

__all__ = ["PostgresTimerClient"]


class PostgresTimerClient:
    """Schedules and cancels timers from synchronous code (a Django or Flask view, a script, a
    cron job) on the stores' PostgreSQL database, with no broker.

    Each call is one transaction of its own, committed with ``synchronous_commit`` on (whatever
    the server's default) before it returns: the timer exists once ``schedule`` returned. Its
    ``NOTIFY`` wakes every :class:`PostgresTimerStore` listening on ``notify_channel``, whose
    :class:`~timer_core.Timer` fires the timer when it is due. To schedule as part of a
    transaction of your own (an order and its timeout together), use
    :func:`schedule_in_transaction` with that transaction's connection instead.

    ``PostgresTimerClient.open(url)`` (``postgresql://user:password@host:port/database``)
    creates the timer schema if the database has none yet; keep the client for the process's
    life (``close()`` at exit) or use it as ``with``. Any number of threads may call one
    client (its pool holds ``pool_size`` connections). Bad arguments raise
    :class:`~timer_core.errors.ValidationError` before anything is written; a database that
    cannot be reached, :class:`~timer_core.errors.StoreUnavailable`.
    """

    def __init__(self, engine: sa.Engine, clock: Clock, notify_channel: str) -> None:
        self._engine = engine
        self._clock = clock
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
        client = cls(engine, clock or SystemClock(), notify_channel)
        client._write(lambda connection: migrate(connection))
        return client

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
        return self._write(
            lambda connection: schedule_in_transaction(
                connection, command, now=now, notify_channel=self._channel
            )
        )

    def cancel(self, tenant_id: str, service_call_id: str) -> CommandOutcome:
        """Cancel the timer if it has not fired: ``CANCELLED``, else ``CANCEL_NOOP``."""
        command = CancelTimer(tenant_id, service_call_id)
        return self._write(
            lambda connection: cancel_in_transaction(
                connection, command, notify_channel=self._channel
            )
        )

    def _write(self, write: Callable[[sa.Connection], _T]) -> _T:
        try:
            with self._engine.begin() as connection:
                return write(connection)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise translate_error(exc, "write timers") from exc

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
