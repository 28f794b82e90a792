"""Timer operations written in a transaction: the store's applies and a host's own
(``schedule_in_transaction``) go through :func:`apply_operations`, which writes what
:func:`timer_core.replay.replay` decides over the keys' locked rows."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import attrs
import psycopg
import sqlalchemy as sa
import sqlalchemy.exc
import sqlalchemy.orm

from timer_adapters_postgres._errors import translate_error
from timer_adapters_postgres._host_connection import (
    HostConnection,
    PsycopgWriter,
    psycopg_connection,
)
from timer_adapters_postgres._listener import notify_payload
from timer_adapters_postgres._rows import (
    STATES,
    int_array,
    key_columns,
    timer_columns,
    timestamp_array,
)
from timer_adapters_postgres._sql import (
    DELETE,
    INSERT,
    INSERT_NEW_AUTOCOMMIT,
    INSERT_NEW_IN_TRANSACTION,
    LOCK_FAR_EDGE,
    LOCK_KEYS,
    LOCK_TOMBSTONES,
    NOTIFY,
    RESCHEDULE,
    TOMBSTONE,
    UNIQUE_VIOLATION,
)
from timer_core import (
    CancelTimer,
    CommandOutcome,
    ConfigurationError,
    PositionedOperation,
    ScheduleTimer,
    StoreUnavailable,
    TimerEntry,
    TimerKey,
    TimerOperation,
)
from timer_core.commands import scheduled_entry
from timer_core.replay import (
    StoredKey,
    new_timers,
    new_timers_scheduled,
    operation_keys,
    replay,
)

__all__ = [
    "ATTEMPTS",
    "RacingInsert",
    "apply_operations",
    "cancel_in_transaction",
    "insert_new",
    "schedule_in_transaction",
]

log = logging.getLogger(__name__)

ATTEMPTS = 5  # for deadlocks, serialisation failures and racing inserts
# The NOTIFY payload's owner for a host's own transactions: no store skips it as its own.
_HOST_TRANSACTION = "host-transaction"


class RacingInsert(Exception):
    """Another transaction inserted a key this apply saw absent; run the apply again."""


def insert_new(
    conn: sa.Connection,
    ops: list[TimerOperation],
    channel: str,
    owner_id: str,
    wake_at_of: Callable[[list[TimerEntry]], datetime | None],
) -> tuple[list[CommandOutcome], datetime | None] | None:
    """Apply ``ops`` in one statement if they only schedule new timers: their outcomes and
    the wake-up sent; None when the general way must run (in autocommit, nothing of the batch
    was inserted then; in a transaction, maybe some)."""
    timers = new_timers(ops)
    if not timers:
        return None
    entries = [timer.entry for timer in timers]
    wake_at = wake_at_of(entries)
    params: dict[str, Any] = timer_columns(timers)
    autocommit = conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    quietly, notifying = INSERT_NEW_AUTOCOMMIT if autocommit else INSERT_NEW_IN_TRANSACTION
    statement = quietly
    if wake_at is not None:
        statement = notifying
        params.update(channel=channel, payload=notify_payload(wake_at, owner_id))
    try:
        inserted = conn.execute(statement, params).scalar_one()
    except sqlalchemy.exc.IntegrityError as exc:
        if not autocommit or getattr(exc.orig, "sqlstate", None) != UNIQUE_VIOLATION:
            raise
        return None  # another writer inserted one of the keys: nothing was inserted
    if inserted != len(entries):
        return None
    return new_timers_scheduled(timers), wake_at


def apply_operations(
    conn: sa.Connection,
    ops: list[TimerOperation],
    channel: str,
    owner_id: str,
    wake_at_of: Callable[[list[TimerEntry]], datetime | None],
) -> tuple[list[CommandOutcome], datetime | None]:
    """Apply ``ops`` in order in the transaction open on ``conn`` and ``NOTIFY`` the earliest
    new due time (``wake_at_of``) on ``channel``: the store's transactions and a host's own
    (:func:`schedule_in_transaction`) write timers through this one function. What to write
    is :func:`timer_core.replay.replay`'s to decide, over the keys' rows locked first.
    Raises :class:`RacingInsert` when another transaction inserted one of the keys
    meanwhile."""
    # The far edge's lock before any timer row's (see LOCK_FAR_EDGE).
    conn.execute(LOCK_FAR_EDGE, {})
    keys = key_columns(operation_keys(ops))
    stored = {
        TimerKey(row.tenant_id, row.service_call_id): StoredKey(
            STATES[row.state], row.command_position
        )
        for row in conn.execute(LOCK_KEYS, keys)
    }
    if any(isinstance(op, PositionedOperation) for op in ops):
        # Only positioned operations are held to the tombstones' positions.
        for row in conn.execute(LOCK_TOMBSTONES, keys):
            key = TimerKey(row.tenant_id, row.service_call_id)
            stored[key] = attrs.evolve(stored.get(key, StoredKey()), tombstone=row.command_position)
    replayed = replay(ops, stored)
    if replayed.inserts:
        inserted = conn.execute(INSERT, timer_columns(replayed.inserts)).all()
        if len(inserted) != len(replayed.inserts):
            raise RacingInsert
    if replayed.updates:
        conn.execute(RESCHEDULE, timer_columns(replayed.updates))
    if replayed.deletes:
        conn.execute(DELETE, key_columns(replayed.deletes))
    if tombstones := replayed.tombstones:
        conn.execute(
            TOMBSTONE,
            {
                **key_columns([tombstone.key for tombstone in tombstones]),
                "positions": int_array([tombstone.position for tombstone in tombstones]),
                "cancelled_ats": timestamp_array([tombstone.at for tombstone in tombstones]),
            },
        )
    wake_at = wake_at_of([timer.entry for timer in replayed.inserts + replayed.updates])
    if wake_at is not None:
        # Delivered on commit only, so listeners never look for an uncommitted timer.
        conn.execute(NOTIFY, {"channel": channel, "payload": notify_payload(wake_at, owner_id)})
    return replayed.outcomes, wake_at


def schedule_in_transaction(
    connection: HostConnection,
    command: ScheduleTimer,
    *,
    now: datetime,
    correlation_id: str | None = None,
    notify_channel: str = "timer_schedules",
) -> CommandOutcome:
    """Schedule (or reschedule) a timer inside the caller's own transaction on the database.

    The timer exists if and only if that transaction commits. A ``NOTIFY`` on
    ``notify_channel`` (the stores' ``notify_channel``) goes out in the same transaction, so
    PostgreSQL delivers it on commit only: every listening :class:`PostgresTimerStore` then
    reports it (``watch_remote_schedules``) and its worker wakes. ``now`` is the caller's
    clock reading (the timer's ``registered_at``); adapters never read the clock.
    ``connection`` is on the stores' database: a SQLAlchemy :class:`~sqlalchemy.Connection`
    or ORM :class:`~sqlalchemy.orm.Session` (a transaction is begun if none is; on
    SQLAlchemy's asyncio API, call this through ``run_sync``), a plain psycopg
    ``Connection`` not in autocommit mode (the write opens its transaction; the caller
    commits), or a wrapper of one such as Django's ``django.db.connection`` inside
    ``transaction.atomic()``. The timer schema must be there (start a store once, or call
    :func:`migrate`). The correlation id is ``correlation_id`` or the command's own.

    Returns ``SCHEDULED``, or ``IGNORED_REACHED`` when the timer already fired (it is never
    re-armed). The timer's row stays locked until the transaction ends. Raises
    :class:`~timer_core.errors.StoreError` when the write fails; the caller's transaction is
    then theirs to roll back.
    """
    entry = scheduled_entry(command, now, correlation_id=correlation_id)
    (outcome,) = _write_in_transaction(connection, [entry], notify_channel)
    return outcome


def cancel_in_transaction(
    connection: HostConnection,
    command: CancelTimer,
    *,
    notify_channel: str = "timer_schedules",
) -> CommandOutcome:
    """Cancel a ``Scheduled`` timer inside the caller's own transaction (see
    :func:`schedule_in_transaction`): ``CANCELLED`` once that commits, or ``CANCEL_NOOP``
    when the timer is unknown or already fired."""
    key = TimerKey(command.tenant_id, command.service_call_id)
    (outcome,) = _write_in_transaction(connection, [key], notify_channel)
    return outcome


def _write_in_transaction(
    connection: HostConnection, ops: list[TimerOperation], channel: str
) -> list[CommandOutcome]:
    if isinstance(connection, sqlalchemy.orm.Session):
        connection = connection.connection()
    if isinstance(connection, sa.Connection):
        if connection.dialect.name != "postgresql":
            raise ConfigurationError(
                "timer_adapters_postgres needs a PostgreSQL connection, "
                f"got {connection.dialect.name}"
            )
        if not connection.in_transaction():
            connection.begin()
        writer: Any = connection
    else:
        # Statements go through the caller's psycopg connection as they would through
        # SQLAlchemy's: the same functions write, over an adapter with its few calls.
        writer = PsycopgWriter(psycopg_connection(connection))
    for attempt in range(1, ATTEMPTS + 1):
        try:
            applied = insert_new(writer, ops, channel, _HOST_TRANSACTION, _earliest_due)
            if applied is None:
                applied = apply_operations(writer, ops, channel, _HOST_TRANSACTION, _earliest_due)
            return applied[0]
        except RacingInsert:
            # The racing transaction has committed (the insert waited for it): its row is
            # visible to the next statement at READ COMMITTED, so looking again is enough.
            log.debug("scheduling in a host transaction raced; attempt %d", attempt)
        except (sqlalchemy.exc.SQLAlchemyError, psycopg.Error) as exc:
            raise translate_error(exc, "schedule a timer in the caller's transaction") from exc
    raise StoreUnavailable(
        f"PostgreSQL: another transaction kept inserting the same timer ({ATTEMPTS} attempts)"
    )


def _earliest_due(scheduled: list[TimerEntry]) -> datetime | None:
    return min((entry.due_at for entry in scheduled), default=None)
