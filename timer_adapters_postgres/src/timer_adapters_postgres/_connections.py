"""How the PostgreSQL store connects: its URL, the session settings of every connection, the
engine (thread pool side) and the lanes (event loop side), and the schema check at start."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Sequence
from typing import Any

import attrs
import sqlalchemy as sa
import sqlalchemy.exc

from timer_adapters_postgres._errors import translate_error
from timer_adapters_postgres._lanes import StatementLane
from timer_adapters_postgres._schema import SCHEMA_VERSION, migrate, schema_version
from timer_core import SchemaNotFound, SchemaVersionError, StoreError
from timer_core.redaction import redact_url

__all__ = ["Connections", "default_owner_id", "scheduled_as_batch", "sqlalchemy_url"]

log = logging.getLogger(__name__)


def scheduled_as_batch() -> None:
    """Run the calling thread (one of the store's) as batch work on Linux (SCHED_BATCH).

    A thread the event loop hands a statement to, when woken on a busy machine, preempted
    the loop's thread, which still held the GIL it needed: both waited, and the switches
    cost CPU. A batch thread does not preempt on waking; it gets the same share of CPU. With
    four instances on two cores this cut a fired timer's CPU (services, PostgreSQL and
    nats-server) from 0.098-0.105 to 0.084-0.085 ms (bench/README.md, issue 14). Elsewhere,
    or where it is not allowed, threads keep the default policy.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:  # a sandbox refusing it: the default policy works, only slower
        log.debug("could not run the PostgreSQL store's threads as SCHED_BATCH", exc_info=True)


# Raises synchronous_commit from off to on for the session; any other level (local,
# remote_write, on, remote_apply) already waits for the local WAL flush and is kept.
_SYNCHRONOUS_COMMIT = (
    "SELECT set_config('synchronous_commit', 'on', false) "
    "WHERE current_setting('synchronous_commit') = 'off'"
)


def _commit_synchronously(dbapi_connection: Any, _record: object) -> None:
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True  # a SELECT must not leave a transaction open
    try:
        dbapi_connection.execute(_SYNCHRONOUS_COMMIT)
    finally:
        dbapi_connection.autocommit = autocommit


def default_owner_id() -> str:
    """This instance's name in leases: host, pid and a random suffix."""
    return f"{socket.gethostname()[:160]}-{os.getpid()}-{secrets.token_hex(4)}"


def sqlalchemy_url(url: str) -> sa.URL:
    """``url`` as SQLAlchemy's psycopg 3 URL; ``ValueError`` (password redacted) if it is
    not a PostgreSQL one."""
    try:
        parsed = sa.make_url(url)
    except sqlalchemy.exc.ArgumentError as exc:
        raise ValueError(f"not a PostgreSQL URL: {redact_url(url)!r}") from exc
    backend, _, driver = parsed.drivername.partition("+")
    if backend not in ("postgresql", "postgres") or driver not in ("", "psycopg"):
        raise ValueError(
            f"not a PostgreSQL URL for psycopg 3: {redact_url(parsed.render_as_string())!r} "
            "(use postgresql://user:password@host:port/database)"
        )
    return parsed.set(drivername="postgresql+psycopg")


@attrs.frozen
class Connections:
    """The store's connection settings, and the connections made from them."""

    url: sa.URL
    pool_size: int
    connect_timeout_s: float
    statement_timeout_s: float | None

    def options(self, settings: Sequence[tuple[str, str]] = ()) -> str:
        """libpq ``options``: the session settings every connection of the store starts with."""
        options = "-c TimeZone=UTC"
        if self.statement_timeout_s is not None:
            options += f" -c statement_timeout={round(self.statement_timeout_s * 1000)}"
        return options + "".join(f" -c {name}={value}" for name, value in settings)

    def conninfo(self) -> str:
        """The URL as psycopg's own connections (the listener's, the lanes') take it."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    def lane(self, settings: Sequence[tuple[str, str]] = ()) -> StatementLane:
        """A connection of its own used from the event loop, with these session settings."""
        return StatementLane(
            self.conninfo(),
            options=self.options(settings),
            connect_timeout_s=self.connect_timeout_s,
        )

    def engine(self) -> sa.Engine:
        """The pooled engine the store's threads use (most recently used connection first)."""
        engine = sa.create_engine(
            self.url,
            pool_size=self.pool_size,
            max_overflow=0,
            pool_use_lifo=True,
            pool_timeout=self.connect_timeout_s,
            connect_args={
                "connect_timeout": max(1, round(self.connect_timeout_s)),
                "options": self.options(),
                "application_name": "timer",
            },
        )
        # The pool's connections store the commands the service then acknowledges: their
        # commits wait for the WAL flush whatever the server's default (the marks' and
        # claims' lanes keep it: a lost mark or claim only means a duplicate publish).
        sa.event.listen(engine, "connect", _commit_synchronously)
        return engine

    def prepare_schema(self, engine: sa.Engine, *, migrating: bool) -> None:
        """Migrate the schema (``migrating``), or refuse a database whose schema is not
        current."""
        try:
            with engine.begin() as conn:
                if migrating:
                    migrate(conn)
                    return
                found = schema_version(conn)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise translate_error(exc, "prepare the timer schema") from exc
        if found == 0:
            raise SchemaNotFound(f"no Timer schema in {redact_url(self.url.render_as_string())}")
        if found > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the database has Timer schema version {found}, newer than {SCHEMA_VERSION}"
            )
        if found < SCHEMA_VERSION:
            raise StoreError(
                f"the database has Timer schema version {found}, not {SCHEMA_VERSION}, and "
                "migrations are turned off"
            )
