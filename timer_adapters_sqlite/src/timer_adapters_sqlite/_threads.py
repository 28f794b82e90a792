"""The store's threads: a reader and a writer, each on a connection of its own fed through a
queue, and the checkpointer and the syncer beside the writer. Results go back to each
caller's event loop.

All writes run on the one writer thread and connection; concurrent ``apply`` calls queued
while a transaction commits are written together in the next one (group commit). Reads run
on the reader thread, which WAL lets proceed while the writer writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import sqlalchemy as sa

from timer_adapters_sqlite._errors import translate_error
from timer_adapters_sqlite._schema import StoreMode, Synchronous, migrate_connection
from timer_adapters_sqlite._writes import Batch, write_batches
from timer_core import CommandOutcome, StoreError, StoreUnavailable

__all__ = ["ApplyJob", "CallJob", "OpenJob", "Reader", "Writer", "driver_of"]

log = logging.getLogger(__name__)


@attrs.define(slots=True)
class ApplyJob:
    """Operations of one ``apply`` call, group-committed with others queued with it."""

    batch: Batch
    future: asyncio.Future[Any]


@attrs.define(slots=True)
class CallJob:
    """A function of the thread's connection: a read, or on the writer a write that runs alone
    in its own ``BEGIN IMMEDIATE`` transaction (mark, purge)."""

    fn: Callable[[sa.Connection], Any]
    future: asyncio.Future[Any]
    shares_commit: bool = False
    """A write that may share its transaction with the like jobs queued right beside it (a
    drain's marks): one commit for them all, or each alone again if one of them fails."""
    synced: bool = True
    """Its caller hears back only once the commit is on disk (at ``synchronous="FULL"``);
    False for writes whose loss in a power cut costs no promise (marks, purges: see
    docs/design.md, "What a sync buys")."""


@attrs.define(slots=True)
class OpenJob:
    """Open the writer's connection and migrate the schema, on the writer thread."""

    mode: StoreMode
    future: asyncio.Future[Any]
    migrate: bool = True


_Job = ApplyJob | CallJob | OpenJob
_STOP = object()
"""Queued after the last job: the thread finishes what came before it, then ends."""

# (the caller's future, the result, or the error to raise in the caller)
_Result = tuple[asyncio.Future[Any], Any, BaseException | None]


def _settle(results: list[_Result]) -> None:
    """Resolve callers' futures; runs on their event loop."""
    for future, result, error in results:
        # A caller cancelled while its write was in flight: the write stands, nobody waits.
        if future.done():
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _deliver(results: list[_Result]) -> None:
    """Hand results to each caller's event loop: one wake-up per loop, not per caller."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Result]] = {}
    for result in results:
        by_loop.setdefault(result[0].get_loop(), []).append(result)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, batch)
        except RuntimeError:
            log.debug("event loop closed before a timer store result could be delivered")


class _ConnectionThread:
    """A daemon thread with a connection of its own, working through the jobs of its queue.

    :meth:`stop` queues the marker after which the thread finishes the jobs queued before it,
    fails any queued after it, closes its connection and ends; :meth:`join` waits for that.
    """

    _role = "worker"
    """What the thread does, in its name and log lines."""

    def __init__(self, engine: sa.Engine, where: str) -> None:
        self._engine = engine
        self._where = where
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._connection: sa.Connection | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"timer-sqlite-{self._role}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: _Job) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Finish the jobs queued so far, then close the connection and end the thread."""
        self._queue.put(_STOP)

    def join(self) -> None:
        self._thread.join()

    def _work(self) -> list[_Job]:
        """Run the jobs until the stop marker; returns those taken and not run."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            leftovers = self._work()
            # Nothing is submitted after the stop marker by the store; this is a safety net
            # so no caller could ever wait forever.
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, ApplyJob | CallJob | OpenJob):
                    leftovers.append(item)
            closed = StoreUnavailable(f"the timer store on {self._where} is closed")
            _deliver([(job.future, None, closed) for job in leftovers])
        finally:
            self._close()

    def _close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:
                log.exception("closing the %s connection of %s failed", self._role, self._where)
        self._connection = None


class Reader(_ConnectionThread):
    """The thread that reads, on its own connection, which WAL lets run beside the writer.

    A queue and one ``call_soon_threadsafe`` per result: measured, ``run_in_executor`` on a
    ThreadPoolExecutor made an empty poll about twice as slow and twice as costly in CPU.
    """

    _role = "reader"

    def _work(self) -> list[_Job]:
        while (job := self._queue.get()) is not _STOP:
            assert isinstance(job, CallJob)
            _deliver([self._read(job.fn, job.future)])
        return []

    def _read(self, fn: Callable[[sa.Connection], Any], future: asyncio.Future[Any]) -> _Result:
        try:
            if self._connection is None:
                self._connection = self._engine.connect()
            connection = self._connection
            try:
                return future, fn(connection), None
            finally:
                # Reads run in autocommit; this only resets SQLAlchemy's autobegun state.
                connection.rollback()
        except StoreError as exc:
            return future, None, exc
        except Exception as exc:
            return future, None, translate_error(exc, self._where)


# The writer checkpoints on its own only past this many WAL pages (32 MiB at 4 KiB pages):
# normally the checkpointer thread has copied the WAL back long before. Past the size limit
# the WAL file is cut back to it whenever it restarts.
_WRITER_AUTOCHECKPOINT_PAGES = 8192
_WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024
# The shortest time from one checkpoint's start to the next one's.
_CHECKPOINT_SPACING_S = 0.05


def driver_of(connection: sa.Connection) -> sqlite3.Connection:
    """The sqlite3 connection under a SQLAlchemy one, for the statements run directly."""
    driver = connection.connection.driver_connection
    assert isinstance(driver, sqlite3.Connection)
    return driver


class _Checkpointer:
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


class _Syncer:
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

    def submit(self, results: list[_Result]) -> None:
        self._queue.put(results)

    def stop(self) -> None:
        """Sync and deliver what was submitted, then end."""
        self._queue.put(_STOP)
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
                stopping = any(item is _STOP for item in items)
                results = [r for item in items if item is not _STOP for r in item]  # type: ignore[attr-defined]
                if results:
                    _deliver(self._synced(results))
        finally:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)

    def _synced(self, results: list[_Result]) -> list[_Result]:
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
                # No log: everything is in the database file (checkpointed); sync that.
                fd = os.open(self._path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
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


class Writer(_ConnectionThread):
    """The one thread that writes: drains the queue and commits each drained group at once.

    At ``synchronous="FULL"`` the connection commits at ``NORMAL`` and the callers of
    synced writes hear back through the :class:`_Syncer` once their commit is on disk.
    """

    _role = "writer"

    def __init__(
        self,
        engine: sa.Engine,
        where: str,
        max_group_operations: int,
        synchronous: Synchronous = "FULL",
    ) -> None:
        super().__init__(engine, where)
        self._max_ops = max_group_operations
        self._driver: sqlite3.Connection | None = None
        self._checkpointer = _Checkpointer(engine, where)
        self._syncer = _Syncer(where) if synchronous == "FULL" else None
        self.transactions = 0

    @property
    def syncs(self) -> int:
        """Syncs of the log the syncer made (each for every commit queued meanwhile)."""
        return 0 if self._syncer is None else self._syncer.syncs

    @property
    def checkpoints(self) -> int:
        """Checkpoints the checkpointer thread completed (the whole WAL copied back)."""
        return self._checkpointer.checkpoints

    def start(self) -> None:
        self._checkpointer.start()
        if self._syncer is not None:
            self._syncer.start()
        super().start()

    def _work(self) -> list[_Job]:
        held: list[_Job] = []
        stopping = False
        while not stopping:
            jobs, held, stopping = self._next_group(held)
            try:
                self._run_jobs(jobs)
            except Exception as exc:
                # A bug here must not kill the only writer and leave every caller waiting.
                log.exception("timer store writer on %s failed", self._where)
                error = StoreError(f"timer store writer on {self._where} failed: {exc!r}")
                _deliver([(job.future, None, error) for job in jobs])
        self._checkpointer.stop()
        if self._syncer is not None:
            self._syncer.stop()  # before the connection closes: the callers waiting hear back
        return held

    def _next_group(self, held: list[_Job]) -> tuple[list[_Job], list[_Job], bool]:
        """Wait for work, then take everything queued, up to the operation bound."""
        jobs: list[_Job] = []
        operations = 0
        incoming = list(held)
        if not incoming:
            incoming.append(self._queue.get())  # type: ignore[arg-type]
        while True:
            if incoming:
                item: object = incoming.pop(0)
            else:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return jobs, [], False
            if item is _STOP:
                return jobs, incoming, True
            assert isinstance(item, ApplyJob | CallJob | OpenJob)
            if isinstance(item, ApplyJob):
                if jobs and operations + len(item.batch) > self._max_ops:
                    return jobs, [item, *incoming], False
                operations += len(item.batch)
            jobs.append(item)

    def _run_jobs(self, jobs: list[_Job]) -> None:
        """Run consecutive apply jobs as one group, other jobs alone, keeping queue order."""
        index = 0
        while index < len(jobs):
            job = jobs[index]
            results: list[_Result]
            synced = True
            if isinstance(job, OpenJob):
                results = [self._open(job)]
                synced = False
                index += 1
            elif isinstance(job, CallJob) and job.shares_commit:
                calls: list[CallJob] = []
                while index < len(jobs):
                    following = jobs[index]
                    if not (isinstance(following, CallJob) and following.shares_commit):
                        break
                    calls.append(following)
                    index += 1
                results = self._call_group(calls)
                synced = any(call.synced for call in calls)
            elif isinstance(job, CallJob):
                results = [self._call(job)]
                synced = job.synced
                index += 1
            else:
                group: list[ApplyJob] = []
                while index < len(jobs) and isinstance(jobs[index], ApplyJob):
                    group.append(jobs[index])  # type: ignore[arg-type]
                    index += 1
                results = self._apply_group(group)
            if synced and self._syncer is not None:
                self._syncer.submit(results)
            else:
                _deliver(results)

    def _open(self, job: OpenJob) -> _Result:
        try:
            connection = self._engine.connect()
            self._connection = connection
            driver = self._driver = driver_of(connection)
            if self._syncer is not None:
                driver.execute("PRAGMA synchronous = NORMAL")  # the syncer syncs
            driver.execute(f"PRAGMA wal_autocheckpoint = {_WRITER_AUTOCHECKPOINT_PAGES}")
            driver.execute(f"PRAGMA journal_size_limit = {_WAL_SIZE_LIMIT_BYTES}")
            if job.migrate:
                migrate_connection(connection, mode=job.mode, where=self._where)
            return job.future, None, None
        except Exception as exc:
            self._close()
            return job.future, None, self._error(exc)

    def _close(self) -> None:
        super()._close()
        self._driver = None

    def _not_open(self) -> StoreUnavailable:
        return StoreUnavailable(f"the timer store on {self._where} is not open")

    def _call(self, job: CallJob) -> _Result:
        connection, driver = self._connection, self._driver
        if connection is None or driver is None:
            return job.future, None, self._not_open()
        try:
            driver.execute("BEGIN IMMEDIATE")
            try:
                result = job.fn(connection)
                driver.execute("COMMIT")
            except BaseException:
                self._rollback(driver)
                raise
            finally:
                # Statements run through SQLAlchemy autobegin on its side; the transaction
                # is ours (BEGIN IMMEDIATE above), so only SQLAlchemy's state is reset here.
                connection.rollback()
            self.transactions += 1
            self._checkpointer.poke()
            return job.future, result, None
        except Exception as exc:
            return job.future, None, self._error(exc)

    def _call_group(self, calls: list[CallJob]) -> list[_Result]:
        """Run writes queued together in one transaction; if one fails, each alone again."""
        if len(calls) == 1:
            return [self._call(calls[0])]
        connection, driver = self._connection, self._driver
        if connection is None or driver is None:
            closed = self._not_open()
            return [(job.future, None, closed) for job in calls]
        try:
            driver.execute("BEGIN IMMEDIATE")
            try:
                outcomes = [job.fn(connection) for job in calls]
                driver.execute("COMMIT")
            except BaseException:
                self._rollback(driver)
                raise
            finally:
                connection.rollback()  # SQLAlchemy's autobegun state only, as in _call
        except Exception as exc:
            error = self._error(exc)
            if isinstance(error, StoreUnavailable):
                return [(job.future, None, error) for job in calls]
            log.debug("%d writes sharing a commit failed (%s); retrying each", len(calls), error)
            return [self._call(job) for job in calls]
        self.transactions += 1
        self._checkpointer.poke()
        return [(job.future, outcome, None) for job, outcome in zip(calls, outcomes, strict=True)]

    def _apply_group(self, group: list[ApplyJob]) -> list[_Result]:
        driver = self._driver
        if driver is None:
            closed = self._not_open()
            return [(job.future, None, closed) for job in group]
        try:
            outcomes = self._apply_ops(driver, [job.batch for job in group])
        except Exception as exc:
            error = self._error(exc)
            if len(group) == 1 or isinstance(error, StoreUnavailable):
                return [(job.future, None, error) for job in group]
            # One caller's bad operation (a constraint, a missing service call) must not fail
            # the others that happened to share its transaction: redo them one by one.
            log.debug("group commit of %d calls failed (%s); retrying each", len(group), error)
            return [self._apply_alone(driver, job) for job in group]
        results: list[_Result] = []
        start = 0
        for job in group:
            end = start + len(job.batch)
            results.append((job.future, outcomes[start:end], None))
            start = end
        return results

    def _apply_alone(self, driver: sqlite3.Connection, job: ApplyJob) -> _Result:
        try:
            return job.future, self._apply_ops(driver, [job.batch]), None
        except Exception as exc:
            return job.future, None, self._error(exc)

    def _apply_ops(self, driver: sqlite3.Connection, batches: list[Batch]) -> list[CommandOutcome]:
        """Apply ``batches`` in order in one transaction of their own."""
        driver.execute("BEGIN IMMEDIATE")
        try:
            outcomes = write_batches(driver.cursor(), batches)
            driver.execute("COMMIT")
        except BaseException:
            self._rollback(driver)
            raise
        self.transactions += 1
        self._checkpointer.poke()
        return outcomes

    def _rollback(self, driver: sqlite3.Connection) -> None:
        if driver.in_transaction:
            try:
                driver.execute("ROLLBACK")
            except sqlite3.Error:
                log.exception("rollback on %s failed", self._where)

    def _error(self, exc: Exception) -> BaseException:
        if isinstance(exc, ValueError | TypeError):
            return exc
        return translate_error(exc, self._where)
