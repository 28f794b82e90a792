"""The store's threads: a reader and a writer, each on a connection of its own fed through a
queue, and the checkpointer and the syncer (:mod:`._disk`) beside the writer. Results go
back to each caller's event loop.

All writes run on the one writer thread and connection; concurrent ``apply`` calls queued
while a transaction commits are written together in the next one (group commit). Reads run
on the reader thread, which WAL lets proceed while the writer writes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import attrs
import sqlalchemy as sa

from timer_adapters_sqlite._disk import (
    STOP,
    WAL_SIZE_LIMIT_BYTES,
    WRITER_AUTOCHECKPOINT_PAGES,
    Checkpointer,
    Result,
    Syncer,
    deliver,
    driver_of,
)
from timer_adapters_sqlite._errors import translate_error
from timer_adapters_sqlite._schema import StoreMode, Synchronous, migrate_connection
from timer_adapters_sqlite._writes import Batch, write_batches
from timer_core import CommandOutcome, StoreError, StoreUnavailable

__all__ = ["ApplyJob", "CallJob", "OpenJob", "Reader", "Writer"]

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
        self._queue.put(STOP)

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
            deliver([(job.future, None, closed) for job in leftovers])
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
        while (job := self._queue.get()) is not STOP:
            assert isinstance(job, CallJob)
            deliver([self._read(job.fn, job.future)])
        return []

    def _read(self, fn: Callable[[sa.Connection], Any], future: asyncio.Future[Any]) -> Result:
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


class Writer(_ConnectionThread):
    """The one thread that writes: drains the queue and commits each drained group at once.

    At ``synchronous="FULL"`` the connection commits at ``NORMAL`` and the callers of
    synced writes hear back through the :class:`~._disk.Syncer` once their commit is on disk.
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
        self._checkpointer = Checkpointer(engine, where)
        self._syncer = Syncer(where) if synchronous == "FULL" else None
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
                deliver([(job.future, None, error) for job in jobs])
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
            if item is STOP:
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
            results: list[Result]
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
                deliver(results)

    def _open(self, job: OpenJob) -> Result:
        try:
            connection = self._engine.connect()
            self._connection = connection
            driver = self._driver = driver_of(connection)
            if self._syncer is not None:
                driver.execute("PRAGMA synchronous = NORMAL")  # the syncer syncs
            driver.execute(f"PRAGMA wal_autocheckpoint = {WRITER_AUTOCHECKPOINT_PAGES}")
            driver.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
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

    def _call(self, job: CallJob) -> Result:
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

    def _call_group(self, calls: list[CallJob]) -> list[Result]:
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

    def _apply_group(self, group: list[ApplyJob]) -> list[Result]:
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
        results: list[Result] = []
        start = 0
        for job in group:
            end = start + len(job.batch)
            results.append((job.future, outcomes[start:end], None))
            start = end
        return results

    def _apply_alone(self, driver: sqlite3.Connection, job: ApplyJob) -> Result:
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
