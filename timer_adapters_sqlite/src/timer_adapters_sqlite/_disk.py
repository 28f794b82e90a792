"""What keeps the SQLite writer's log on disk beside it: the checkpointer thread (WAL pages
copied back into the database file) and the syncer thread (commits synced before their
callers hear back), and how results reach each caller's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from typing import Any

import sqlalchemy as sa

from timer_core import StoreUnavailable

__all__ = [
    "WAL_SIZE_LIMIT_BYTES",
    "WRITER_AUTOCHECKPOINT_PAGES",
    "Checkpointer",
    "STOP",
    "Result",
    "Syncer",
    "deliver",
    "driver_of",
]

log = logging.getLogger("timer_adapters_sqlite._threads")

STOP = object()
"""Queued after the last job: the thread finishes what came before it, then ends."""

# (the caller's future, the result, or the error to raise in the caller)
Result = tuple[asyncio.Future[Any], Any, BaseException | None]


def _settle(results: list[Result]) -> None:
    """Resolve callers' futures; runs on their event loop."""
    for future, result, error in results:
        # A caller cancelled while its write was in flight: the write stands, nobody waits.
        if future.done():
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def deliver(results: list[Result]) -> None:
    """Hand results to each caller's event loop: one wake-up per loop, not per caller."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Result]] = {}
    for result in results:
        by_loop.setdefault(result[0].get_loop(), []).append(result)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, batch)
        except RuntimeError:
            log.debug("event loop closed before a timer store result could be delivered")


# The writer checkpoints on its own past this many WAL pages (8 MiB at 4 KiB pages). Under a
# steady stream of commits the checkpointer thread's checkpoints seldom find the whole WAL
# copied (commits land meanwhile), so the WAL restarts only after the writer's own
# checkpoint, and that one holds the writer for as long as the WAL is: at ten million rows,
# purging 2.5 times a 1,000/s stream, 8,192 pages held it 15-60 ms about once a second and
# 65,536 pages 100-140 ms every few seconds (lateness p99 15-32 ms and 50-53 ms), 2,048
# pages briefly and often (p99 15-16 ms, max 30-42 ms against 57-198); schedule storms kept
# their rate (bench/README.md, "The purge's share of the tail"). Past the size limit the
# WAL file is cut back to it whenever it restarts.
WRITER_AUTOCHECKPOINT_PAGES = 2048
WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024
# The shortest time from one checkpoint's start to the next one's.
_CHECKPOINT_SPACING_S = 0.05


def driver_of(connection: sa.Connection) -> sqlite3.Connection:
    """The sqlite3 connection under a SQLAlchemy one, for the statements run directly."""
    driver = connection.connection.driver_connection
    assert isinstance(driver, sqlite3.Connection)
    return driver


class Checkpointer:
    """The thread that copies committed WAL pages back into the database file.

    SQLite's default has the committing connection checkpoint every 1000 WAL pages, and a
    batch of upserts with random keys dirties pages all over five indexes: nearly every
    commit of 1000 timers paid for a checkpoint (copy and sync) before the writer could
    take the next batch. Here, after each commit, a PASSIVE checkpoint on a connection of
    its own runs beside the writer (it never blocks writers or readers).
    Measured: 1000-upsert transactions 13,000 -> 21,000/s (bench/README.md).

    Checkpoints start at most every ``spacing_s``: the commits of that time are copied back
    by one checkpoint. Small, frequent commits (the marks of a drain, 100 timers each) keep
    rewriting the same index pages, and a checkpoint per commit copied and synced each of
    them again every time (a third of a core at batch 100, bench/README.md).
    """

    def __init__(
        self, engine: sa.Engine, where: str, spacing_s: float = _CHECKPOINT_SPACING_S
    ) -> None:
        self._engine = engine
        self._where = where
        self._spacing_s = spacing_s
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="timer-sqlite-checkpointer", daemon=True
        )
        self.checkpoints = 0

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """A commit happened: checkpoint when the one in progress (if any) is done."""
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        connection: sa.Connection | None = None
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopped.is_set():
                    return
                started = time.monotonic()
                try:
                    if connection is None:
                        connection = self._engine.connect()
                    busy, frames, copied = (
                        driver_of(connection).execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    )
                    if not busy and frames == copied:
                        self.checkpoints += 1  # the WAL is all in the file now
                except Exception as exc:
                    # The writer's own checkpoint past the page limit is the fallback.
                    log.debug("checkpoint of %s failed: %s", self._where, exc)
                    if connection is not None:
                        with contextlib.suppress(Exception):
                            connection.close()
                        connection = None
                # Commits meanwhile wait for the next checkpoint (pokes are kept).
                self._stopped.wait(max(0.0, self._spacing_s - (time.monotonic() - started)))
        finally:
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()


class Syncer:
    """The thread that puts commits on disk before their callers hear back (``FULL``).

    The writer commits at ``NORMAL`` (the write-ahead log written, not synced) and hands the
    results here; this thread syncs the log (``fsync``) and only then resolves the callers,
    one sync for every commit queued meanwhile. At ``FULL`` in SQLite's own way the sync ran
    inside the commit, holding the write lock: every write queued behind it, the marks of
    fired timers too, waited for the disk (steady 1,000 timers/s: p99 lateness 40-52 ms
    against 25-29 at ``NORMAL`` on a loaded machine, bench/README.md).

    The log is written in order, so a sync covers every commit before it. A commit whose
    frames a checkpoint copied into the database file before the sync is durable there: a
    checkpoint syncs the database file before the log can be restarted. A failed sync fails
    its callers (:class:`~timer_core.errors.StoreUnavailable`): their commands are not
    acknowledged and come again, applied idempotently.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._fd: int | None = None
        self._thread = threading.Thread(target=self._run, name="timer-sqlite-syncer", daemon=True)
        self.syncs = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, results: list[Result]) -> None:
        self._queue.put(results)

    def stop(self) -> None:
        """Sync and deliver what was submitted, then end."""
        self._queue.put(STOP)
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            stopping = False
            while not stopping:
                items = [self._queue.get()]
                with contextlib.suppress(queue.Empty):
                    while True:
                        items.append(self._queue.get_nowait())
                stopping = any(item is STOP for item in items)
                results = [r for item in items if item is not STOP for r in item]  # type: ignore[attr-defined]
                if results:
                    deliver(self._synced(results))
        finally:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)

    def _synced(self, results: list[Result]) -> list[Result]:
        if all(error is not None for _, _, error in results):
            return results  # nothing was committed
        try:
            self._sync()
        except OSError as exc:
            failed = StoreUnavailable(f"could not sync {self._path}'s log to disk: {exc}")
            log.error("%s", failed)
            return [(future, None, error or failed) for future, _, error in results]
        self.syncs += 1
        return results

    def _sync(self) -> None:
        if self._fd is None:
            try:
                self._fd = os.open(f"{self._path}-wal", os.O_RDONLY)
            except FileNotFoundError:
                # No log: SQLite removes it only after checkpointing it into the database
                # file and syncing that, so there is nothing left to sync. The database file
                # itself is never opened here: closing a descriptor of it would drop every
                # POSIX lock this process's connections hold on it (SQLite's "How To Corrupt
                # An SQLite Database File", 2.2), letting another process reset the log under
                # them.
                return
            # The log's name in its directory must survive too (once: it is kept open).
            directory = os.open(os.path.dirname(os.path.abspath(self._path)), os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        try:
            os.fsync(self._fd)
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise
