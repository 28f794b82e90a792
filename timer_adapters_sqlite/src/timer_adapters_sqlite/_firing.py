"""Who fires a SQLite file's timers: an OS lock on a file beside the database
(``timers.db.firing-lock``), held by the one firing store, in this process or another, and
released when it closes or its process ends (docs/design.md, "One firing Timer per file")."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

from timer_core import StoreInUse

__all__ = ["FiringLock", "firing_lock_path"]

# Files this process holds, by (device, inode): the OS lock keeps other processes out; this
# keeps out a second holder in this very process too, whatever the file system's flock does
# (on NFS, Linux emulates it with POSIX locks, which a process never refuses itself).
_HELD: set[tuple[int, int]] = set()
_HELD_LOCK = threading.Lock()


def firing_lock_path(database: str) -> str | None:
    """The lock file of a database path; None for an in-memory database (private to its
    process and store: nothing to share)."""
    if database == ":memory:" or database == "":
        return None
    if database.startswith("file:"):
        # A URI filename: file:path?query (SQLite's own syntax).
        name, _, query = database[len("file:") :].partition("?")
        if name in ("", ":memory:") or "mode=memory" in query.split("&"):
            return None
        database = name
    # The file itself, however it is named (a symlink, a relative path): SQLite's unix VFS
    # opens the same, so two names of one database share one lock.
    return f"{os.path.realpath(database)}.firing-lock"


class FiringLock:
    """The lock on one database's firing: :meth:`acquire` or :class:`StoreInUse`;
    :meth:`release`. The file stays (removing it would race with another process opening it);
    it holds the owner's pid, for the message of the next one refused."""

    def __init__(self, database: str) -> None:
        self.database = database
        # The descriptor holding the OS lock, and the file's (device, inode).
        self._held: tuple[int, tuple[int, int]] | None = None

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(self) -> None:
        """Hold the lock (at once, or :class:`StoreInUse`); nothing to do when held."""
        path = firing_lock_path(self.database)
        if self.held or path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            # Checked before opening it: where flock is emulated with POSIX locks (NFS),
            # closing a second descriptor would drop this process's lock.
            if _key(os.stat(path)) in _HELD:
                raise self._refused("this process")
        # Not inherited by child processes (Python's default): a server a host starts must
        # not keep the lock after the host died.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            key = _key(os.fstat(fd))
            with _HELD_LOCK:
                if key in _HELD:
                    raise self._refused("this process")
                if not _try_lock(fd):
                    raise self._refused(_owner(fd))
                _HELD.add(key)
        except BaseException:
            os.close(fd)
            raise
        self._held = (fd, key)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._held is None:
            return
        (fd, key), self._held = self._held, None
        with _HELD_LOCK:
            _HELD.discard(key)
            # Closing the last descriptor releases the OS lock (before the key is free, so a
            # holder in this process cannot find the file unlocked by us and locked by the OS).
            os.close(fd)

    def _refused(self, owner: str) -> StoreInUse:
        return StoreInUse(
            f"another Timer fires the timers of {self.database} (in {owner}): a SQLite file "
            "serves one firing Timer at a time (each would fire every timer). Stop that one "
            "first, or schedule from here without firing (a SqliteTimerStore without a Timer, "
            "or schedule_in_transaction); several instances sharing the work need PostgreSQL "
            "(timer_adapters_postgres)",
            owner,
        )


def _key(stat: os.stat_result) -> tuple[int, int]:
    return (stat.st_dev, stat.st_ino)


def _owner(fd: int) -> str:
    """Who holds the lock file open at ``fd``, as its holder wrote it."""
    with contextlib.suppress(OSError, ValueError):
        os.lseek(fd, 0, os.SEEK_SET)
        return f"process {int(os.read(fd, 32).decode().strip())}"
    return "another process"  # not written yet, or unreadable (Windows locks the byte)


if sys.platform == "win32":  # pragma: no cover - not run in CI
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        # flock, not fcntl's POSIX locks: a POSIX lock is the process's, dropped when the
        # process closes any descriptor of the file, and never refused to the process itself.
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
