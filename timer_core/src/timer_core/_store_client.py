"""What the broker-less synchronous clients share: ``schedule`` and ``cancel`` as commands
applied straight to a store's database, each in one transaction of its own."""

from __future__ import annotations

import abc
from datetime import datetime
from types import TracebackType
from typing import Self

from timer_core._messages import CancelTimer, ScheduleTimer
from timer_core.ports import Clock, CommandOutcome

__all__ = ["StoreClient"]


class StoreClient(abc.ABC):
    """Schedules and cancels timers from synchronous code (a Django or Flask view, a script, a
    cron job) on a store's database, with no broker and no event loop.

    Each call is one transaction of its own, committed before it returns, which wakes a
    running :class:`~timer_core.Timer` on that database. Bad arguments raise
    :class:`~timer_core.errors.ValidationError` before anything is written; the database's
    failures, :class:`~timer_core.errors.StoreError`. Any number of threads may call one
    client; keep it for the process's life (``close()`` at exit) or use it as ``with``.
    ``timer_adapters_sqlite.SqliteTimerClient`` and
    ``timer_adapters_postgres.PostgresTimerClient`` implement :meth:`_apply` and
    :meth:`close`.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

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
        return self._apply(command, self._clock.now())

    def cancel(self, tenant_id: str, service_call_id: str) -> CommandOutcome:
        """Cancel the timer if it has not fired: ``CANCELLED``, else ``CANCEL_NOOP``."""
        return self._apply(CancelTimer(tenant_id, service_call_id), self._clock.now())

    @abc.abstractmethod
    def _apply(self, command: ScheduleTimer | CancelTimer, now: datetime) -> CommandOutcome:
        """Apply ``command`` in one committed transaction (``now``: its ``registered_at``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the database connections."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
