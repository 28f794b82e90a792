"""What a SQLite store is opened on: a file path, refused at once when it is a URL or its
directory does not exist (a configuration error, not the transient ``StoreUnavailable``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from timer_core import ConfigurationError

__all__ = ["database_path", "require_directory"]

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# A SQLite file named with SQLAlchemy's URL: sqlite:///relative.db, sqlite:////absolute.db
_SQLITE_URL = re.compile(r"sqlite(?:\+[A-Za-z0-9_]+)?:///(?P<path>[^?]+)")


def database_path(path: object) -> str:
    """``path`` as a string, or :class:`ConfigurationError` saying what was expected."""
    if not isinstance(path, str | os.PathLike):
        raise ConfigurationError(
            f"SqliteTimerStore takes the path of its SQLite file, e.g. 'timers.db'; "
            f"got {type(path).__name__} {path!r}"[:300]
        )
    text = os.fspath(path)
    if not isinstance(text, str):
        raise ConfigurationError(f"SqliteTimerStore takes a text path, got {text!r}")
    if _URL.match(text) is None:
        return text
    sqlite = _SQLITE_URL.fullmatch(text)
    if sqlite is not None:
        hint = f"pass the file's path instead: SqliteTimerStore({sqlite['path']!r})"
    elif text.startswith(("postgres://", "postgresql://", "postgresql+")):
        hint = "for PostgreSQL use timer_adapters_postgres.PostgresTimerStore(url)"
    else:
        hint = "pass the path of a SQLite file, e.g. 'timers.db'"
    shown = text.split("@")[-1] if "@" in text else text  # never a password in an error
    raise ConfigurationError(f"SqliteTimerStore takes a file path, not a URL ({shown!r}): {hint}")


def require_directory(path: str) -> None:
    """Refuse a file whose directory does not exist: SQLite creates files, not directories,
    and says only SQLITE_CANTOPEN."""
    if path == ":memory:" or path.startswith("file:"):
        return
    directory = Path(path).parent
    if not directory.is_dir():
        raise ConfigurationError(
            f"the directory {str(directory)!r} of the SQLite file {path!r} does not exist: "
            "create it first (the store creates the file, not its directories)"
        )
