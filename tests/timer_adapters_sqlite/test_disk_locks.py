"""The syncer never opens (and so never closes) a descriptor of the database file: closing
one drops every POSIX lock the process's connections hold on it (SQLite's "How To Corrupt
An SQLite Database File", section 2.2), and another process could then write under them."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from timer_adapters_sqlite._disk import Syncer

_TRY_WRITE = """
import sqlite3, sys
connection = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)
try:
    connection.execute("BEGIN IMMEDIATE")
except sqlite3.OperationalError as exc:
    print("locked" if "locked" in str(exc) else f"error: {exc}")
else:
    print("took the write lock")
"""


def other_process_tries_to_write(path: Path) -> str:
    """What another process gets when it asks for the write lock at once."""
    done = subprocess.run(
        [sys.executable, "-c", _TRY_WRITE, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_a_sync_without_a_log_keeps_this_process_locks(tmp_path: Path) -> None:
    """With no log file to sync, the syncer leaves the database file alone: a write lock
    this process holds still keeps another process out afterwards."""
    path = tmp_path / "timer.db"
    holder = sqlite3.connect(path, isolation_level=None)  # rollback journal: no -wal file
    try:
        holder.execute("CREATE TABLE t (x INTEGER)")
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("INSERT INTO t VALUES (1)")
        assert other_process_tries_to_write(path) == "locked"
        syncer = Syncer(str(path))
        syncer._sync()
        assert other_process_tries_to_write(path) == "locked"
        holder.execute("COMMIT")
    finally:
        holder.close()
