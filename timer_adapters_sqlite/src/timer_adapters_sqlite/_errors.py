"""Translation of SQLite and SQLAlchemy errors into Timer's store errors."""

from __future__ import annotations

import sqlite3

import sqlalchemy.exc

from timer_core import StoreError, StoreUnavailable

__all__ = ["translate_error"]

# Primary result codes (the low byte of an extended code) that describe the database being
# busy, locked, full or failing underneath us: worth retrying later, so StoreUnavailable.
_TRANSIENT_CODES = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
    }
)


def translate_error(exc: BaseException, where: str) -> StoreError:
    """The :class:`StoreError` to raise (``from exc``) for a driver error on ``where``."""
    if isinstance(exc, StoreError):
        return exc
    cause: BaseException = exc
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
        cause = exc.orig
    if isinstance(cause, sqlite3.Error):
        code = getattr(cause, "sqlite_errorcode", None)
        name = getattr(cause, "sqlite_errorname", None) or type(cause).__name__
        message = f"SQLite {name} on {where}: {cause}"
        if code is not None and code & 0xFF in _TRANSIENT_CODES:
            return StoreUnavailable(message)
        if isinstance(cause, sqlite3.ProgrammingError) and "closed" in str(cause):
            return StoreUnavailable(message)
        return StoreError(message)
    if isinstance(cause, OSError):
        return StoreUnavailable(f"{type(cause).__name__} on {where}: {cause}")
    return StoreError(f"{type(cause).__name__} on {where}: {cause}")
