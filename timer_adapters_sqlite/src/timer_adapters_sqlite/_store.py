"""``SqliteTimerStore``: the durable timer store on one SQLite file, group-committing writes.

The adapter: it validates, hands reads to the reader thread and writes to the writer thread
(:mod:`~timer_adapters_sqlite._threads`), and maps rows to entries
(:mod:`~timer_adapters_sqlite._rows`) with the statements of :mod:`~timer_adapters_sqlite._sql`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from operator import itemgetter
from typing import Any, TypeVar

import sqlalchemy as sa

from timer_adapters_sqlite._census import SqliteCensus, earliest_due, edge_of, stored_edge
from timer_adapters_sqlite._disk import driver_of
from timer_adapters_sqlite._errors import translate_error
from timer_adapters_sqlite._firing import FiringLock
from timer_adapters_sqlite._paths import database_path, require_directory
from timer_adapters_sqlite._rows import entries_read, entry_from_row, read_timestamp
from timer_adapters_sqlite._schema import StoreMode, Synchronous, check_schema, create_sqlite_engine
from timer_adapters_sqlite._sql import (
    COUNT_DUE,
    COUNT_FAR_BOUNDARY,
    COUNT_FAR_REST,
    COUNT_SCHEDULED_BOUNDARY,
    COUNT_SCHEDULED_FOR_TENANT,
    COUNT_SCHEDULED_REST,
    DUE_TENANTS,
    FIND_BY_CORRELATION,
    FIND_DUE,
    FIND_DUE_AFTER,
    FIND_DUE_FOR_TENANT,
    FIND_DUE_OF_TENANTS,
    GET,
    JSON_STATEMENTS,
    LIST_FOR_TENANT,
    MARK_REACHED,
    MARK_REACHED_JSON,
    MOVE_NEAR,
    PURGE_REACHED,
    PURGE_TOMBSTONES,
    SET_EDGE,
)
from timer_adapters_sqlite._threads import ApplyJob, CallJob, OpenJob, Reader, Writer
from timer_adapters_sqlite._writes import batch_of
from timer_core import (
    CommandOutcome,
    ConfigurationError,
    CorrelationId,
    DueCursor,
    ExclusiveFiring,
    FindsDueByTenant,
    RemoteScheduleCallback,
    ReportsRemoteSchedules,
    ServiceCallId,
    StoreError,
    StoreUnavailable,
    TenantId,
    TimerEntry,
    TimerOperation,
    TimerStore,
)
from timer_core.fair_share import FairShare
from timer_core.horizon import FarEdge
from timer_core.instants import format_timestamp, require_utc

__all__ = ["SqliteTimerStore"]

log = logging.getLogger(__name__)
# A row of COLUMNS in due order (due_at, tenant, call), and its tenant.
_DUE_ORDER = itemgetter(3, 0, 1)
_TENANT = itemgetter(0)
# Before every stored (due_at, service_call_id): no cursor yet.
_NO_CURSOR = ("", "")

T = TypeVar("T")


class SqliteTimerStore(
    TimerStore, FindsDueByTenant, ReportsRemoteSchedules, ExclusiveFiring, SqliteCensus
):
    """A :class:`~timer_core.ports.TimerStore` on a SQLite file, through SQLAlchemy.

    ``mode="standalone"`` (default): the timer owns the file. ``mode="shared"``: the file is
    the host's and already holds ``service_calls(tenant_id, service_call_id)``; the timer
    table then references it with ``ON DELETE CASCADE``, so deleting a service call deletes
    its timer. ``synchronous="FULL"`` (default) syncs every commit that stores commands
    (:meth:`apply`) to disk before it returns, so an acknowledged timer survives a power
    loss (a thread of its own syncs the log for all commits made meanwhile, so the writer
    never waits for the disk); marks of fired timers and purges return unsynced (a lost
    mark only fires the timer again, with the same envelope id). ``"NORMAL"`` commits everything
    unsynced: with WAL the database is never corrupted and every commit survives a crash of
    the process, but a power loss or an OS crash may lose the last commits, acknowledged
    commands included.
    ``busy_timeout_ms`` is how long a write waits for another process's lock before it
    raises :class:`~timer_core.errors.StoreUnavailable`. ``pragmas`` are extra per-connection
    pragmas (``cache_size``, ``max_page_count``, ...). ``max_group_operations`` bounds how
    many queued operations one group commit takes, to keep transactions short.

    Timers written by other connections (a host's own transaction, see
    :func:`schedule_in_transaction`; another process) are noticed within
    ``watch_interval_s``: the store checks SQLite's ``PRAGMA data_version``, which changes
    when any other connection commits, and then calls ``on_remote_schedule`` with the
    earliest due time, so the worker wakes (:class:`~timer_core.Timer` registers it through
    :meth:`watch_remote_schedules`). ``watch_interval_s=None`` turns the check off; the
    worker's poll stays the safety net either way.

    One :class:`~timer_core.Timer` at a time fires a file's timers: the Timer takes the
    file's firing lock at start (:meth:`acquire_firing`, an OS lock on
    ``<path>.firing-lock``), and a second one, in this process or another, is refused with
    :class:`~timer_core.errors.StoreInUse` until the first closes or its process ends.
    Stores that only schedule and read, here or in other processes, are never refused.

    Nothing is opened before :meth:`start`, which also applies the migrations.
    ``migrate=False`` (for read-only tools) creates and changes nothing at start: it
    refuses a missing file or one whose schema is not current
    (:class:`~timer_core.errors.SchemaNotFound` when there is none).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: StoreMode = "standalone",
        synchronous: Synchronous = "FULL",
        busy_timeout_ms: int = 5000,
        pragmas: Mapping[str, int | str] | None = None,
        max_group_operations: int = 10_000,
        on_remote_schedule: Callable[[datetime], None] | None = None,
        watch_interval_s: float | None = 0.1,
        migrate: bool = True,
    ) -> None:
        if mode not in ("standalone", "shared"):
            raise ConfigurationError(f"mode must be 'standalone' or 'shared', got {mode!r}")
        if synchronous not in ("NORMAL", "FULL"):
            raise ConfigurationError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        if busy_timeout_ms < 0:
            raise ConfigurationError(f"busy_timeout_ms must be >= 0, got {busy_timeout_ms}")
        if max_group_operations < 1:
            raise ConfigurationError(
                f"max_group_operations must be >= 1, got {max_group_operations}"
            )
        if watch_interval_s is not None and not watch_interval_s > 0:
            raise ConfigurationError(
                f"watch_interval_s must be positive or None, got {watch_interval_s}"
            )
        self.path = database_path(path)
        self.mode: StoreMode = mode
        self._synchronous: Synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._pragmas = dict(pragmas or {})
        self._max_group_operations = max_group_operations
        self.on_remote_schedule = on_remote_schedule
        """Called on the event loop with the earliest due time after another connection
        committed (see the class notes)."""
        self._watch_interval_s = watch_interval_s
        self._watch: asyncio.Task[None] | None = None
        self._migrate = migrate
        self._engine: sa.Engine | None = None
        self._writer: Writer | None = None
        self._reader: Reader | None = None
        self._far = FarEdge(self._advance_far)
        self._lifecycle = asyncio.Lock()
        self._firing = FiringLock(self.path)

    count_slice = 50_000
    """Index entries :meth:`count_scheduled` counts in one read (a few milliseconds)."""

    def __repr__(self) -> str:
        return f"SqliteTimerStore({self.path!r}, mode={self.mode!r})"

    @property
    def transactions_committed(self) -> int:
        """Write transactions committed since :meth:`start` (group commits count once)."""
        return 0 if self._writer is None else self._writer.transactions

    @property
    def checkpoints_completed(self) -> int:
        """WAL checkpoints run beside the writer since :meth:`start` (a thread of their own)."""
        return 0 if self._writer is None else self._writer.checkpoints

    @property
    def engine(self) -> sa.Engine:
        """The SQLAlchemy engine (after :meth:`start`), e.g. for a host's own queries."""
        if self._engine is None:
            raise StoreUnavailable(f"the timer store on {self.path} is not started")
        return self._engine

    async def start(self) -> None:
        # Opening switches the file to WAL and migrates it; another connection doing that at
        # the same moment (a second store or process) can make SQLite answer busy at once,
        # without waiting for the busy timeout, so opening is retried for that long.
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        while True:
            try:
                await self._start_once()
                return
            except StoreUnavailable as exc:
                busy = "SQLITE_BUSY" in str(exc) or "SQLITE_LOCKED" in str(exc)
                if not busy or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.05)

    async def _start_once(self) -> None:
        async with self._lifecycle:
            if self._writer is not None:
                return
            require_directory(self.path)
            if not self._migrate:
                # Checked reading only, before any connection could create or convert it.
                await asyncio.to_thread(check_schema, self.path)
            engine = create_sqlite_engine(
                self.path,
                synchronous=self._synchronous,
                busy_timeout_ms=self._busy_timeout_ms,
                pragmas=self._pragmas,
            )
            writer = Writer(engine, self.path, self._max_group_operations, self._synchronous)
            writer.start()
            reader = Reader(engine, self.path)
            reader.start()
            try:
                loop = asyncio.get_running_loop()
                opened: asyncio.Future[None] = loop.create_future()
                writer.submit(OpenJob(self.mode, opened, self._migrate))
                await opened
                # The first read opens the reader's connection: fail now, not at the first poll.
                reader_opened: asyncio.Future[None] = loop.create_future()
                reader.submit(CallJob(lambda _: None, reader_opened))
                await reader_opened
            except BaseException as exc:
                await self._shutdown(engine, writer, reader)
                if isinstance(exc, Exception) and not isinstance(exc, StoreError):
                    raise translate_error(exc, self.path) from exc
                raise
            self._engine, self._writer, self._reader = engine, writer, reader
            self._far.edge = await self._read(stored_edge)
            if self._watch_interval_s is not None:
                self._watch = asyncio.create_task(self._watch_other_commits(self._watch_interval_s))
            log.debug("timer store on %s started (%s mode)", self.path, self.mode)

    async def acquire_firing(self) -> None:
        """Make this store the one that fires the file's timers (an OS lock on
        ``<path>.firing-lock``), until :meth:`aclose` or the end of the process;
        :class:`~timer_core.errors.StoreInUse` while another holds it. Needs no
        :meth:`start`. :class:`~timer_core.Timer` calls it when it starts."""
        async with self._lifecycle:
            require_directory(self.path)
            try:
                await asyncio.to_thread(self._firing.acquire)
            except OSError as exc:
                raise StoreUnavailable(
                    f"cannot lock {self.path}'s firing (its .firing-lock file): {exc}"
                ) from exc

    async def aclose(self) -> None:
        async with self._lifecycle:
            try:
                await self._close_running()
            finally:
                # After the last write: the next owner never fires beside this one's marks.
                self._firing.release()

    async def _close_running(self) -> None:
        if self._writer is None or self._engine is None or self._reader is None:
            return
        await self._far.aclose()
        engine, writer, reader = self._engine, self._writer, self._reader
        self._engine = self._writer = self._reader = None
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        await self._shutdown(engine, writer, reader)
        log.debug("timer store on %s closed", self.path)

    @staticmethod
    async def _shutdown(engine: sa.Engine, writer: Writer, reader: Reader) -> None:
        # Reads and writes queued before the stop markers still run and resolve their callers.
        writer.stop()
        reader.stop()
        await asyncio.to_thread(writer.join)
        await asyncio.to_thread(reader.join)
        engine.dispose()

    def watch_remote_schedules(self, callback: RemoteScheduleCallback | None) -> bool:
        """Have ``callback(due_at)`` called after other connections commit timers.

        Returns False when the store was made with ``watch_interval_s=None`` (no watch).
        """
        self.on_remote_schedule = callback
        return self._watch_interval_s is not None

    async def _watch_other_commits(self, interval: float) -> None:
        """Hand ``on_remote_schedule`` the earliest due time whenever another connection
        committed (``data_version`` moved): one cheap pragma per interval otherwise."""
        last: int | None = None
        while True:
            try:
                last, due_at = await self._read(partial(_changes_since, last))
            except StoreError as exc:
                log.debug("checking %s for other connections' commits failed: %s", self.path, exc)
                due_at = None
            callback = self.on_remote_schedule
            if due_at is not None and callback is not None:
                try:
                    callback(due_at)
                except Exception:  # the host's callback must not end the watch
                    log.exception("the on_remote_schedule callback failed")
            await asyncio.sleep(interval)

    def _running_writer(self) -> Writer:
        writer = self._writer
        if writer is None:
            raise StoreUnavailable(f"the timer store on {self.path} is not started or closed")
        return writer

    async def _write(
        self, fn: Callable[[sa.Connection], T], *, shares_commit: bool = False, synced: bool = True
    ) -> T:
        writer = self._running_writer()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        writer.submit(CallJob(fn, future, shares_commit, synced))
        return await future

    async def _read(self, fn: Callable[[sa.Connection], T]) -> T:
        reader = self._reader
        if reader is None:
            raise StoreUnavailable(f"the timer store on {self.path} is not started or closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        reader.submit(CallJob(fn, future))
        return await future

    # -- writes ----------------------------------------------------------------------------

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        if not operations:
            return []
        batch = batch_of(operations)
        writer = self._running_writer()
        future: asyncio.Future[list[CommandOutcome]] = asyncio.get_running_loop().create_future()
        writer.submit(ApplyJob(batch, future))
        return await future

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        params = []
        # A firing batch shares one reached_at (the pass's `now`): format it once.
        reached: datetime | None = None
        reached_text = ""
        for entry in entries:
            if entry.reached_at is None:
                raise ValueError(f"mark_reached needs Reached entries, got {entry}")
            if entry.reached_at != reached:
                reached = entry.reached_at
                reached_text = format_timestamp(reached)
            params.append(
                (
                    reached_text,
                    entry.tenant_id,
                    entry.service_call_id,
                    format_timestamp(entry.due_at),
                )
            )
        if not params:
            return 0

        # Straight through the DBAPI connection: the poller's hot path (measured). One
        # statement for the batch unless a key repeats in it (UPDATE ... FROM would update
        # such a row once, with either reached_at; one by one, the first mark stays).
        def mark(connection: sa.Connection) -> int:
            driver = driver_of(connection)
            if JSON_STATEMENTS and len({row[1:3] for row in params}) == len(params):
                return driver.execute(MARK_REACHED_JSON, (json.dumps(params),)).rowcount
            return driver.executemany(MARK_REACHED, params).rowcount

        # Marks queued together (a drain's next batch behind this one) share one commit.
        # Unsynced (NORMAL): lost in a power cut, a mark only makes the timer fire again,
        # with the same envelope id (docs/design.md, "What a sync buys").
        return await self._write(mark, shares_commit=True, synced=False)

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        before = format_timestamp(require_utc(reached_before, "reached_before"))
        if limit <= 0:
            return 0
        deleted = 0
        while deleted < limit:
            # One slice a transaction: a mark or a command queued meanwhile runs between two
            # slices, never behind the whole purge (the writer takes its jobs in turn).
            slice_deleted, exhausted = await self._write(
                partial(_purge_slice, before, limit - deleted, self.purge_slice_s),
                synced=False,  # lost, it is done again
            )
            deleted += slice_deleted
            if exhausted:
                break
        return deleted

    purge_slice_s = 0.001
    """How long one transaction of :meth:`purge_reached` deletes for before it commits and
    lets the writes queued behind it run (a purge of many is a series of such slices):
    firing waits for one slice of a purge, not for all of it."""

    move_batch = 200
    """How many far timers one transaction moves near (~10 ms of the writer at 10M rows)."""

    async def _advance_far(self, target: datetime) -> datetime | None:
        """Move the far timers due before ``target`` near, a batch a transaction, and raise
        the edge to ``target`` with the last batch (timer_core.horizon); the stored edge."""
        target_text = format_timestamp(target)
        limit = self.move_batch

        def move(connection: sa.Connection) -> tuple[int, str | None]:
            driver = driver_of(connection)
            moved = driver.execute(MOVE_NEAR, (target_text, limit)).rowcount
            if moved < limit:
                driver.execute(SET_EDGE, (target_text,))
            return moved, edge_of(driver)

        while True:
            # Unsynced: lost in a power cut, a move leaves its timers far below an edge
            # that did not move either (the edge goes in the last batch's transaction).
            moved, edge = await self._write(move, synced=False)
            if moved < limit:
                return None if edge is None else read_timestamp(edge)

    # -- reads -----------------------------------------------------------------------------

    async def get(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> TimerEntry | None:
        params = {"tenant": TenantId(tenant_id), "call": ServiceCallId(service_call_id)}

        def get(connection: sa.Connection) -> TimerEntry | None:
            row = connection.execute(GET, params).first()
            return None if row is None else entry_from_row(row)

        return await self._read(get)

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        now_text = format_timestamp(require_utc(now, "now"))
        if limit <= 0:
            return []
        await self._far.before_find(now)
        sql: str
        args: tuple[Any, ...]
        if after is None:
            sql, args = FIND_DUE, (now_text, limit)
        else:
            cursor = DueCursor(*after)
            sql = FIND_DUE_AFTER
            args = (
                now_text,
                format_timestamp(require_utc(cursor.due_at, "after.due_at")),
                TenantId(cursor.tenant_id),
                ServiceCallId(cursor.service_call_id),
                limit,
            )

        # The poller's hot path: straight through the DBAPI connection, measured at a
        # fraction of the per-call cost of a SQLAlchemy execute (see bench/README.md).
        return await self._read(entries_read(sql, args))

    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        now_text = format_timestamp(require_utc(now, "now"))
        if limit <= 0:
            return []
        await self._far.before_find(now)
        cursors: dict[str, tuple[str, str]] = {
            TenantId(tenant): (_cursor_text(cursor.due_at), ServiceCallId(cursor.service_call_id))
            for tenant, cursor in after.items()
        }

        def find(connection: sa.Connection) -> list[TimerEntry]:
            driver = driver_of(connection)
            # When every due timer fits in this claim there is nothing to share out: one walk
            # of the due index (``limit + 1`` entries at most, counted, not read) instead of
            # the tenant scan below, a few seeks per tenant with pending timers, due or not
            # (2 ms a pass with a thousand tenants), which a steady stream of timers coming
            # due paid on every pass. The drain's cursors still leave out what it already
            # took.
            (count,) = driver.execute(COUNT_DUE, (now_text, limit + 1)).fetchone()
            if count <= limit:
                # In due order already (the statement's ORDER BY).
                due = driver.execute(FIND_DUE, (now_text, limit)).fetchall()
                return [
                    entry_from_row(row)
                    for row in due
                    if (row[3], row[1]) > cursors.get(row[0], _NO_CURSOR)
                ]
            # At most ``limit`` tenants take part (one timer each at least): the others are
            # not even listed, so a backlog over many tenants costs no memory per tenant.
            active = [row[0] for row in driver.execute(DUE_TENANTS, (now_text, limit))]
            found: list[Any] = []
            # The rounds and shares are timer_core.fair_share's; each round is a statement
            # per share size (two at most: what does not divide evenly goes one each to the
            # longest waiting).
            plan = FairShare(limit, active)
            while shares := plan.next_round():
                taken: Counter[str] = Counter()
                by_size: dict[int, list[str]] = {}
                for tenant, share in shares:
                    by_size.setdefault(share, []).append(tenant)
                for share, tenants in by_size.items():
                    wanted = [[tenant, *cursors.get(tenant, _NO_CURSOR)] for tenant in tenants]
                    rows = driver.execute(
                        FIND_DUE_OF_TENANTS, (json.dumps(wanted), now_text, share)
                    ).fetchall()
                    # Rows sort as their timers do: the stored instants are fixed-width text.
                    rows.sort(key=_DUE_ORDER)
                    taken.update(map(_TENANT, rows))
                    # Each tenant's last row (in due order) is where it now stands.
                    cursors.update({row[0]: (row[3], row[1]) for row in rows})
                    found += rows
                plan.took(taken)
            found.sort(key=_DUE_ORDER)
            return [entry_from_row(row) for row in found]

        return await self._read(find)

    async def find_due_for_tenant(
        self, tenant_id: TenantId, now: datetime, limit: int
    ) -> list[TimerEntry]:
        args = (TenantId(tenant_id), format_timestamp(require_utc(now, "now")), limit)
        if limit <= 0:
            return []
        await self._far.before_find(now)
        return await self._read(entries_read(FIND_DUE_FOR_TENANT, args))

    async def find_by_correlation(
        self, tenant_id: TenantId, correlation_id: CorrelationId
    ) -> list[TimerEntry]:
        params = {"tenant": TenantId(tenant_id), "correlation": CorrelationId(correlation_id)}

        def find(connection: sa.Connection) -> list[TimerEntry]:
            return [entry_from_row(row) for row in connection.execute(FIND_BY_CORRELATION, params)]

        return await self._read(find)

    async def list_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        limit: int = 1000,
        after: ServiceCallId | None = None,
    ) -> list[TimerEntry]:
        # "" sorts before every valid id, so one statement serves the first page too.
        params = {
            "tenant": TenantId(tenant_id),
            "after": "" if after is None else ServiceCallId(after),
            "limit": limit,
        }
        if limit <= 0:
            return []

        def find(connection: sa.Connection) -> list[TimerEntry]:
            return [entry_from_row(row) for row in connection.execute(LIST_FOR_TENANT, params)]

        return await self._read(find)

    async def next_due_at(self) -> datetime | None:
        return await self._read(earliest_due)

    async def count_scheduled_for_tenant(self, tenant_id: TenantId) -> int:
        args = (TenantId(tenant_id),)

        def count(connection: sa.Connection) -> int:
            (found,) = driver_of(connection).execute(COUNT_SCHEDULED_FOR_TENANT, args).fetchone()
            return int(found)

        return await self._read(count)

    async def count_scheduled(self) -> int:
        """Pending timers, counted in slices of :attr:`count_slice` index entries, each a read
        of its own: the poll runs between two slices instead of waiting for the whole count.
        Exact when nothing is written meanwhile; a timer rescheduled across the slice being
        counted may be counted twice or not at all (it is a gauge's reading)."""
        # "" sorts before every stored value, 0 before every rowid.
        near = await self._count_in_slices(
            COUNT_SCHEDULED_BOUNDARY, COUNT_SCHEDULED_REST, ("", "", "")
        )
        far = await self._count_in_slices(COUNT_FAR_BOUNDARY, COUNT_FAR_REST, ("", 0))
        return near + far

    async def _count_in_slices(
        self, boundary_sql: str, rest_sql: str, start: tuple[Any, ...]
    ) -> int:
        """Count an index's entries a slice a read: ``boundary_sql`` gives the key
        :attr:`count_slice` entries after a key, ``rest_sql`` how many are left after the
        last such key; ``start`` sorts before every stored key."""
        slice_ = self.count_slice
        total = 0
        after = start

        def boundary(connection: sa.Connection) -> tuple[Any, ...] | None:
            found = driver_of(connection).execute(boundary_sql, (*after, slice_)).fetchone()
            return None if found is None else tuple(found)

        def rest(connection: sa.Connection) -> int:
            (found,) = driver_of(connection).execute(rest_sql, after).fetchone()
            return int(found)

        while (last := await self._read(boundary)) is not None:
            total += slice_
            after = last
        return total + await self._read(rest)


def _cursor_text(due_at: datetime) -> str:
    """A cursor's due time as stored."""
    return format_timestamp(require_utc(due_at, "after.due_at"))


def _changes_since(last: int | None, connection: sa.Connection) -> tuple[int, datetime | None]:
    """``(data_version, earliest due time)`` when another connection committed since
    ``last``; the due time is None when nothing changed (or nothing is scheduled)."""
    driver = driver_of(connection)
    (version,) = driver.execute("PRAGMA data_version").fetchone()
    if last is None or version == last:
        return version, None
    return version, earliest_due(connection)


_PURGE_CHUNK = 16  # rows one statement of a purge slice deletes (then the clock is read)


def _purge_slice(
    before: str, most: int, budget_s: float, connection: sa.Connection
) -> tuple[int, bool]:
    """Delete fired timers (then cancel tombstones) older than ``before``, at most ``most``,
    in statements of :data:`_PURGE_CHUNK` until ``budget_s`` has passed; how many, and
    whether none older is left."""
    driver = driver_of(connection)
    started = time.perf_counter()
    deleted = 0
    for statement in (PURGE_REACHED.text, PURGE_TOMBSTONES.text):
        while deleted < most:
            chunk = min(_PURGE_CHUNK, most - deleted)
            done = driver.execute(statement, {"before": before, "limit": chunk}).rowcount
            deleted += done
            if done < chunk:
                break  # none left of this kind
            if time.perf_counter() - started >= budget_s:
                return deleted, False
        else:
            return deleted, False  # ``most`` reached: maybe more left
    return deleted, True
