"""Translation of SQLAlchemy and psycopg errors into Timer's store errors."""

from __future__ import annotations

import psycopg
import sqlalchemy.exc

from timer_core import StoreError, StoreUnavailable

__all__ = ["is_retryable", "translate_error"]

# SQLSTATE classes and codes that say "not now" rather than "never": connection failures,
# lock/serialisation conflicts, resource exhaustion and operator intervention (shutdown,
# statement timeout).
_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58")
_TRANSIENT_CODES = ("55P03", "55006", "25P03")
# Conflicts a transaction can simply run again (serialization failure, deadlock).
_RETRYABLE_CODES = ("40001", "40P01")


def _sqlstate(exc: BaseException) -> str | None:
    origin = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
    return getattr(origin, "sqlstate", None)


def is_retryable(exc: BaseException) -> bool:
    """Whether running the same transaction again may succeed at once."""
    return _sqlstate(exc) in _RETRYABLE_CODES


def translate_error(exc: BaseException, action: str) -> StoreError:
    """The :class:`StoreError` to raise for ``exc``, a driver error while doing ``action``."""
    state = _sqlstate(exc)
    origin = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
    detail = str(origin).strip().splitlines()[0] if str(origin).strip() else type(origin).__name__
    message = f"PostgreSQL failed to {action}: {detail}"
    transient = (
        (state is not None and (state[:2] in _TRANSIENT_CLASSES or state in _TRANSIENT_CODES))
        or (isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated)
        or isinstance(
            origin,
            psycopg.OperationalError | psycopg.InterfaceError | sqlalchemy.exc.TimeoutError,
        )
        or (state is None and isinstance(exc, sqlalchemy.exc.DisconnectionError))
    )
    return StoreUnavailable(message) if transient else StoreError(message)
