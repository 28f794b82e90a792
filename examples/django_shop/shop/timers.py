"""Timer in a Django project, on Django's own database: the store the firing ``Timer`` runs on,
scheduling inside a ``transaction.atomic()`` block and outside one, the schema migration,
and the handler that expires an unpaid order when its payment timeout fires."""

from __future__ import annotations

import functools
import logging
from typing import Any
from urllib.parse import quote

from django.db import close_old_connections, connections

import timer_adapters_postgres
import timer_adapters_sqlite
from timer_core import (
    CancelTimer,
    CommandOutcome,
    DueTimeReached,
    MessageEnvelope,
    ScheduleTimer,
    StoreClient,
    SystemClock,
    TimerStore,
)

log = logging.getLogger("shop")
clock = SystemClock()


def _postgres_url(settings: dict[str, Any]) -> str:
    user = quote(settings["USER"] or "", safe="")
    password = quote(settings["PASSWORD"] or "", safe="")
    login = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    port = f":{settings['PORT']}" if settings["PORT"] else ""
    return f"postgresql://{login}{settings['HOST'] or 'localhost'}{port}/{settings['NAME']}"


def timer_database(using: str = "default") -> tuple[str, str]:
    """The database of Django's ``using`` alias: its vendor and where Timer finds it (the
    SQLite file, or the PostgreSQL URL)."""
    connection = connections[using]
    if connection.vendor == "sqlite":
        return "sqlite", str(connection.settings_dict["NAME"])
    if connection.vendor == "postgresql":
        return "postgresql", _postgres_url(connection.settings_dict)
    raise RuntimeError(f"Timer stores timers on SQLite or PostgreSQL, not {connection.vendor}")


def timer_store(using: str = "default") -> TimerStore:
    """The store of the firing Timer (``manage.py run_timer``), on Django's database."""
    vendor, where = timer_database(using)
    if vendor == "sqlite":
        return timer_adapters_sqlite.SqliteTimerStore(where)
    return timer_adapters_postgres.PostgresTimerStore(where)


def migrate_timer_schema(connection: Any) -> None:
    """Timer's schema on the database of Django's ``connection`` (the shop's migration)."""
    vendor, where = timer_database(connection.alias)
    if vendor == "sqlite":
        timer_adapters_sqlite.migrate(where)
        return
    with timer_adapters_postgres.PostgresTimerClient.open(where):
        pass  # opening the client brings the schema up to date


def schedule_with(command: ScheduleTimer, *, using: str = "default") -> CommandOutcome:
    """Schedule inside the caller's ``transaction.atomic(using=...)``: the timer exists if and
    only if that block commits."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        return timer_adapters_postgres.schedule_in_transaction(connection, command, now=clock.now())
    return timer_adapters_sqlite.schedule_in_transaction(connection, command, now=clock.now())


def cancel_with(command: CancelTimer, *, using: str = "default") -> CommandOutcome:
    """Cancel inside the caller's ``transaction.atomic(using=...)`` (see :func:`schedule_with`)."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        return timer_adapters_postgres.cancel_in_transaction(connection, command)
    return timer_adapters_sqlite.cancel_in_transaction(connection, command)


@functools.cache
def timers(using: str = "default") -> StoreClient:
    """Schedule and cancel outside any transaction of the shop's (a management command, a
    view that changes nothing else): each call commits on its own. One per process."""
    vendor, where = timer_database(using)
    if vendor == "sqlite":
        return timer_adapters_sqlite.SqliteTimerClient.open(where)
    return timer_adapters_postgres.PostgresTimerClient.open(where)


def close_timers() -> None:
    """Close the client of :func:`timers` (at the end of a process, or of a test class)."""
    if timers.cache_info().currsize:
        timers().close()
        timers.cache_clear()


def expire_order(event: MessageEnvelope[DueTimeReached]) -> None:
    """The firing Timer's handler: an order still unpaid when its timeout fires is expired.

    A plain function, so the Timer runs it in a thread of its own, where the ORM may block.
    Called at least once per timer (again after a crash before the timer was marked): the
    update is idempotent. Raising makes the Timer call it again later.
    """
    from shop.models import Order

    # As Django's request cycle does around a view: the connection is closed or kept as
    # CONN_MAX_AGE says (the Timer calls this in threads of its own, where nothing else would).
    close_old_connections()
    try:
        order_id = event.payload.service_call_id
        expired = Order.objects.filter(id=order_id, status="unpaid").update(status="expired")
        log.info("order %s: timeout fired, %s", order_id, "expired" if expired else "was paid")
    finally:
        close_old_connections()
