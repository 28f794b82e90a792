"""The timer store on PostgreSQL, shared by several timer-service instances through leased claims.

Blocking SQLAlchemy/psycopg calls run in a small thread pool of the store's own; the
claims and the marks of fired batches run on two connections used from the event loop
(see :mod:`._lanes`), and so does the ``LISTEN`` connection (see :mod:`._listener`). The
SQL is in :mod:`._sql`, writes in :mod:`._writes`, claims by tenant in :mod:`._tenants`
and the instances sharing the tenants out in :mod:`._peers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, TypeVar

import sqlalchemy as sa
import sqlalchemy.exc

from timer_adapters_postgres._census import PostgresCensus
from timer_adapters_postgres._clock import DatabaseClock
from timer_adapters_postgres._connections import (
    Connections,
    default_owner_id,
    scheduled_as_batch,
    sqlalchemy_url,
)
from timer_adapters_postgres._errors import is_retryable, translate_error
from timer_adapters_postgres._lanes import StatementLane
from timer_adapters_postgres._listener import ScheduleListener
from timer_adapters_postgres._peers import Peers
from timer_adapters_postgres._rows import (
    due_order,
    entry_from_row,
    int_array,
    text_array,
    timestamp_array,
)
from timer_adapters_postgres._sql import (
    CLAIM_AFTER_SQL,
    CLAIM_FIRST_SQL,
    CLAIM_PLANNING,
    COUNT_SCHEDULED,
    COUNT_SCHEDULED_FOR_TENANT,
    FIRST_EDGE,
    MARK,
    MARK_SQL,
    MOVE_NEAR_ALL,
    MOVE_NEAR_SKIPPING,
    NEXT_DUE,
    PURGE,
    PURGE_TOMBSTONES,
    RAISE_EDGE,
    READ_CLOCK,
    READ_EDGE,
    RELEASE,
    TRY_LOCK_FAR_EDGE,
    select_by_correlation,
    select_due_for_tenant,
    select_for_tenant,
    select_timer,
)
from timer_adapters_postgres._tenants import TenantClaims
from timer_adapters_postgres._writes import ATTEMPTS, RacingInsert, apply_operations, insert_new
from timer_core import (
    CommandOutcome,
    CorrelationId,
    DueCursor,
    FindsDueByTenant,
    LeasesClaims,
    RemoteScheduleCallback,
    ReportsRemoteSchedules,
    ServiceCallId,
    StoreUnavailable,
    TenantId,
    TimerEntry,
    TimerOperation,
    TimerStore,
)
from timer_core.horizon import FarEdge
from timer_core.instants import require_utc
from timer_core.leases import claim_token
from timer_core.redaction import redact_url

__all__ = ["MOVE_BATCH", "PostgresTimerStore"]

log = logging.getLogger(__name__)

#: Far timers made near per statement of an advance (each its own transaction, ~10 ms).
MOVE_BATCH = 200

_T = TypeVar("_T")


class PostgresTimerStore(
    TimerStore, FindsDueByTenant, LeasesClaims, ReportsRemoteSchedules, PostgresCensus
):
    """:class:`~timer_core.ports.TimerStore` on PostgreSQL, for one or several instances.

    :meth:`find_due` *claims* what it returns: each timer is leased to this store's
    ``owner_id`` for ``lease_s`` seconds, so concurrent instances never get the same timer;
    an instance that dies leaves its claims to be taken over when the lease runs out.
    :meth:`mark_reached` is fenced: it only marks a claimed timer while this store's claim is
    the latest one. Lease expiry is judged by the database clock (``now()``), the one clock
    every instance shares; due times are judged by the ``now`` the core passes in, which
    :meth:`shared_clock` reads from the same database clock (see
    :class:`~timer_core.ports.SharedClockStore`).

    Scheduling sends ``NOTIFY`` on ``notify_channel`` with the due time; every started store
    (``listen=True``) ``LISTEN``\\ s and calls ``on_remote_schedule(due_at)`` for timers
    scheduled by other stores, so the worker wakes for them: :class:`~timer_core.Timer`
    registers its worker through :meth:`watch_remote_schedules`. The poll stays the safety net.
    """

    def __init__(
        self,
        url: str,
        *,
        owner_id: str | None = None,
        lease_s: float = 30.0,
        on_remote_schedule: Callable[[datetime], None] | None = None,
        listen: bool = True,
        notify_channel: str = "timer_schedules",
        notify_horizon_s: float | None = None,
        pool_size: int = 5,
        connect_timeout_s: float = 5.0,
        statement_timeout_s: float | None = 30.0,
        migrate: bool = True,
        clock_skew_warning_s: float | None = 1.0,
    ) -> None:
        """Configure the store; nothing connects before :meth:`start`.

        ``url``: ``postgresql://user:password@host:port/database`` (``postgresql+psycopg://``
        too). ``owner_id`` names this instance in leases (default: host, pid and a random
        suffix). ``notify_horizon_s``: only timers due at most this long after they were
        registered are announced (None: all); later ones are found by the poll anyway.
        ``migrate=False`` refuses a database whose schema is not already current.
        ``pool_size`` connections read and write; claims and marks take two more of their own
        (used from the event loop), the database clock one more, and ``listen=True`` one for
        ``LISTEN``. ``clock_skew_warning_s``: a WARNING is logged while this host's wall clock
        is further than this off the database's (None: never; see :meth:`shared_clock`).
        """
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        self._url = sqlalchemy_url(url)
        self._owner_id = owner_id or default_owner_id()
        if len(self._owner_id) > 200:
            raise ValueError("owner_id must be at most 200 characters")
        self._lease_s = float(lease_s)
        self._lease = timedelta(seconds=lease_s)
        self.on_remote_schedule = on_remote_schedule
        """Called on the event loop with the due time of each timer another store scheduled."""
        self._listen = listen
        self._channel = notify_channel
        self._horizon = None if notify_horizon_s is None else timedelta(seconds=notify_horizon_s)
        self._pool_size = pool_size
        self._connections = Connections(
            self._url, pool_size, connect_timeout_s, statement_timeout_s
        )
        self._migrate = migrate
        self._engine: sa.Engine | None = None
        self._autocommit: sa.Engine | None = None
        # Claims, and the marks of fired batches: the drain's statements, run from the loop.
        self._claiming: StatementLane | None = None
        self._marking: StatementLane | None = None
        self._peers = Peers(self._owner_id, lambda: self._listener)
        self._tenant_claims = TenantClaims(self._owner_id, self._lease, self._peers)
        self._executor: ThreadPoolExecutor | None = None
        # Where the purge under way got to: the latest reached_at it deleted (see PURGE).
        self._purged_to: datetime | None = None
        self._listener: ScheduleListener | None = None
        self._announcing: asyncio.Task[None] | None = None
        self._lifecycle = asyncio.Lock()
        self._clock_lane: StatementLane | None = None
        # The far edge (timer_core.horizon): moved before a find that reached it.
        self._far = FarEdge(self._advance)
        self._clock = DatabaseClock(
            self._read_clock,
            skew_warning_s=clock_skew_warning_s,
            where=f"PostgreSQL {self._url.host or 'local'}:{self._url.port or 5432}",
        )

    @property
    def owner_id(self) -> str:
        """This store's name in the leases it takes."""
        return self._owner_id

    @property
    def claim_lease_s(self) -> float:
        """How long a timer returned by :meth:`find_due` stays claimed by this store."""
        return self._lease_s

    def shared_clock(self) -> DatabaseClock:
        """The database's clock (``clock_timestamp()``), read at :meth:`start` and every 2 s
        after on a connection of its own: ``now`` is never ahead of the database, whatever
        this host's wall clock says, and its ``skew_s`` is how far this host's is off."""
        return self._clock

    async def _read_clock(self) -> datetime:
        lane = self._clock_lane
        if lane is None:
            raise StoreUnavailable("the PostgreSQL timer store is not started (or closed)")
        (row,) = await lane.fetch("read the database clock", READ_CLOCK, {})
        return require_utc(row.now, "the database clock")

    @property
    def listener(self) -> ScheduleListener | None:
        """The ``LISTEN`` side, once started with ``listen=True``."""
        return self._listener

    def __repr__(self) -> str:
        return (
            f"PostgresTimerStore({redact_url(self._url.render_as_string())!r}, "
            f"owner_id={self._owner_id!r})"
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, migrate the schema (or check it) and start listening. Idempotent."""
        async with self._lifecycle:
            if self._engine is not None:
                return
            engine = self._connections.engine()
            executor = ThreadPoolExecutor(
                self._pool_size,
                thread_name_prefix="timer-postgres",
                initializer=scheduled_as_batch,
            )
            listener: ScheduleListener | None = None
            try:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(
                    executor,
                    functools.partial(
                        self._connections.prepare_schema, engine, migrating=self._migrate
                    ),
                )
                self._far.edge = await loop.run_in_executor(executor, _first_edge, engine)
                if self._listen:
                    listener = ScheduleListener(
                        self._connections.conninfo(),
                        self._channel,
                        self._owner_id,
                        self._on_remote_schedule,
                        connect_timeout_s=self._connections.connect_timeout_s,
                    )
                    await listener.start()
                self._clock_lane = self._connections.lane()
                await self._clock.start()
            except BaseException:
                executor.shutdown(wait=False)
                engine.dispose()
                if listener is not None:
                    await listener.aclose()
                await self._close_clock()
                raise
            self._engine = engine
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
            self._claiming = self._connections.lane(CLAIM_PLANNING)
            self._marking = self._connections.lane()
            self._executor = executor
            self._listener = listener
            if listener is not None:
                self._announcing = asyncio.create_task(
                    self._peers.announce(lambda: self._marking, self._channel),
                    name=f"timer-announce-{self._channel}",
                )
            log.info("timer store started on %r as %s", self, self._owner_id)

    async def aclose(self) -> None:
        """Stop listening, let the calls in flight finish, close the connections."""
        async with self._lifecycle:
            announcing, self._announcing = self._announcing, None
            if announcing is not None:
                announcing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await announcing
            await self._far.aclose()
            await self._close_clock()
            listener, self._listener = self._listener, None
            engine, self._engine, self._autocommit = self._engine, None, None
            lanes = [lane for lane in (self._claiming, self._marking) if lane is not None]
            self._claiming = self._marking = None
            executor, self._executor = self._executor, None
            if listener is not None:
                await listener.aclose()
            for lane in lanes:
                await lane.aclose()
            if executor is not None:
                await asyncio.to_thread(executor.shutdown, wait=True)
            if engine is not None:
                engine.dispose()
            self._tenant_claims.forget()
            self._peers.forget()

    async def _close_clock(self) -> None:
        await self._clock.aclose()
        lane, self._clock_lane = self._clock_lane, None
        if lane is not None:
            await lane.aclose()

    def watch_remote_schedules(self, callback: RemoteScheduleCallback | None) -> bool:
        """Have ``callback(due_at)`` called for timers other stores schedule (``LISTEN``).

        Returns False when the store was made with ``listen=False`` (nothing is reported).
        """
        self.on_remote_schedule = callback
        return self._listen

    def _on_remote_schedule(self, due_at: datetime) -> None:
        callback = self.on_remote_schedule
        if callback is not None:
            callback(due_at)

    # -- running blocking work -----------------------------------------------------------

    async def _run(
        self,
        action: str,
        work: Callable[[sa.Connection], _T],
        *,
        atomic: bool = False,
    ) -> _T:
        """Run ``work`` in the store's threads: one transaction if ``atomic``, else autocommit."""
        engine = self._engine if atomic else self._autocommit
        executor = self._executor
        if engine is None or executor is None:
            raise StoreUnavailable("the PostgreSQL timer store is not started (or closed)")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, self._attempt, engine, action, work)
        except RuntimeError as exc:  # the executor was shut down under us
            if self._executor is None:
                raise StoreUnavailable("the PostgreSQL timer store is closed") from exc
            raise

    @staticmethod
    def _attempt(engine: sa.Engine, action: str, work: Callable[[sa.Connection], _T]) -> _T:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                with engine.begin() as conn:
                    return work(conn)
            except RacingInsert:
                log.debug("%s raced with another writer; attempt %d", action, attempt)
            except sqlalchemy.exc.DBAPIError as exc:
                if not is_retryable(exc) or attempt == ATTEMPTS:
                    raise translate_error(exc, action) from exc
                log.debug("%s conflicted (%s); attempt %d", action, exc.orig, attempt)
            except sqlalchemy.exc.SQLAlchemyError as exc:
                raise translate_error(exc, action) from exc
        raise StoreUnavailable(f"PostgreSQL: could not {action} after {ATTEMPTS} attempts")

    # -- writes ----------------------------------------------------------------------------

    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        if not operations:
            return []
        ops = list(operations)
        # New timers only (the usual batch): one autocommit statement, which inserts all of
        # them or none. Should any key hold something, the general way runs, in a transaction
        # of its own. Bad input raises in timer_core.replay, before anything is written.
        applied = await self._run(
            "apply timer commands",
            lambda conn: insert_new(conn, ops, self._channel, self._owner_id, self._wake_at),
        )
        if applied is None:
            applied = await self._run(
                "apply timer commands", lambda conn: self._apply(conn, ops), atomic=True
            )
        outcomes, wake_at = applied
        log.debug("applied %d operations (wake-up sent for %s)", len(ops), wake_at)
        return outcomes

    def _apply(
        self, conn: sa.Connection, ops: list[TimerOperation]
    ) -> tuple[list[CommandOutcome], datetime | None]:
        return apply_operations(conn, ops, self._channel, self._owner_id, self._wake_at)

    def _wake_at(self, scheduled: list[TimerEntry]) -> datetime | None:
        horizon = self._horizon
        due = [
            e.due_at for e in scheduled if horizon is None or e.due_at - e.registered_at <= horizon
        ]
        return min(due, default=None)

    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        if not entries:
            return 0
        for entry in entries:
            if entry.reached_at is None:
                raise ValueError(f"timer {entry.tenant_id}/{entry.service_call_id} is not Reached")
        tokens = [claim_token(entry) for entry in entries]
        # A firing batch shares one reached_at: one statement then, else one per value.
        groups: dict[datetime | None, list[int]] = {}
        for index, entry in enumerate(entries):
            groups.setdefault(entry.reached_at, []).append(index)
        statements = [
            {
                "owner": self._owner_id,
                "reached_at": reached_at,
                "tenant_ids": text_array([entries[i].tenant_id for i in indexes]),
                "service_call_ids": text_array([entries[i].service_call_id for i in indexes]),
                "due_ats": timestamp_array([entries[i].due_at for i in indexes]),
                "tokens": int_array([tokens[i] for i in indexes]),
            }
            for reached_at, indexes in groups.items()
        ]

        if len(statements) == 1:  # a fired batch: one autocommit statement, from the loop
            return await self._lane_of("marking").execute(
                "mark timers reached", MARK_SQL, statements[0]
            )

        def mark(conn: sa.Connection) -> int:
            return sum(conn.execute(MARK, params).rowcount for params in statements)

        return await self._run("mark timers reached", mark, atomic=True)

    def _lane_of(self, name: str) -> StatementLane:
        lane = self._claiming if name == "claiming" else self._marking
        if lane is None:
            raise StoreUnavailable("the PostgreSQL timer store is not started (or closed)")
        return lane

    async def release_claims(self, entries: Sequence[TimerEntry]) -> None:
        """Drop this store's claims on ``entries`` so any instance may claim them at once."""
        tokens = [claim_token(entry) for entry in entries]
        claimed = [
            (e.key, token) for e, token in zip(entries, tokens, strict=True) if token is not None
        ]
        if not claimed:
            return
        params = {
            "owner": self._owner_id,
            "tenant_ids": text_array([key.tenant_id for key, _ in claimed]),
            "service_call_ids": text_array([key.service_call_id for key, _ in claimed]),
            "tokens": int_array([token for _, token in claimed]),
        }
        await self._run("release timer claims", lambda conn: conn.execute(RELEASE, params))

    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        if limit <= 0:
            return 0
        before = require_utc(reached_before)
        after = self._purged_to

        def purge(conn: sa.Connection) -> tuple[int, int, datetime | None]:
            params = {"before": before, "after": after, "limit": limit}
            timers, last = conn.execute(PURGE, params).one()
            tombstones = 0
            if timers < limit:
                rest = {"before": before, "limit": limit - timers}
                tombstones = conn.execute(PURGE_TOMBSTONES, rest).rowcount
            return int(timers), tombstones, last

        timers, tombstones, last = await self._run("purge reached timers", purge)
        # A batch of fewer timers than the limit ends this purge of timers: the next one
        # starts from the oldest again.
        self._purged_to = last if timers >= limit else None
        return timers + tombstones

    # -- the far edge ------------------------------------------------------------------------

    @property
    def far_edge(self) -> datetime | None:
        """The far edge as this store last read or raised it (None: none known)."""
        return self._far.edge

    async def _advance(self, target: datetime) -> datetime | None:
        """Make every far timer due before ``target`` near and raise the stored edge to
        ``target`` (never lower it); the stored edge (timer_core.horizon's ``advance``).

        The batches run in transactions of their own; the last one and the edge's rise in
        one, under the edge's lock taken exclusive: no writer is then between reading the
        edge and committing, so none commits a timer far below the new edge. While writers
        hold it, the edge stays (every far timer committed due before ``target`` is near all
        the same) and the next find tries again.
        """
        stored = await self._run("read the far edge", lambda conn: conn.execute(READ_EDGE).scalar())
        if stored is not None and stored >= target:
            return require_utc(stored)
        params = {"target": target, "limit": MOVE_BATCH}

        def move(conn: sa.Connection) -> int:
            return conn.execute(MOVE_NEAR_SKIPPING, params).rowcount

        def last(conn: sa.Connection) -> tuple[bool, datetime | None]:
            if not conn.execute(TRY_LOCK_FAR_EDGE).scalar_one():
                return True, None
            if conn.execute(MOVE_NEAR_ALL, params).rowcount >= MOVE_BATCH:
                return False, None  # more came meanwhile: committed, batches again
            return True, conn.execute(RAISE_EDGE, {"target": target}).scalar_one()

        while True:
            while await self._run("move far timers near", move) >= MOVE_BATCH:
                pass
            done, raised = await self._run("raise the far edge", last, atomic=True)
            if done:
                break
        if raised is None:
            log.debug("the far edge's lock is held by a writer; the edge stays at %s", stored)
            return None if stored is None else require_utc(stored)
        return require_utc(raised)

    # -- claiming ----------------------------------------------------------------------------

    async def find_due(
        self, now: datetime, limit: int, *, after: DueCursor | None = None
    ) -> list[TimerEntry]:
        """Claim up to ``limit`` due timers (see :class:`PostgresTimerStore`), in due order."""
        if limit <= 0:
            return []
        await self._far.before_find(require_utc(now))
        params: dict[str, Any] = {
            "owner": self._owner_id,
            "lease": self._lease,
            "now": require_utc(now),
            "limit": limit,
        }
        statement = CLAIM_FIRST_SQL
        if after is not None:
            statement = CLAIM_AFTER_SQL
            params.update(
                after_due=after.due_at,
                after_tenant=after.tenant_id,
                after_call=after.service_call_id,
            )
        # On the claiming connection too: with no statistics yet (a new table's first
        # storm), the walk of ix_timer_schedules_due became a bitmap scan of every due timer
        # and a sort, 16 ms against 0.4 for a claim of 100 at 20,000 due.
        rows = await self._lane_of("claiming").fetch("claim due timers", statement, params)
        return _claimed(rows)

    async def find_due_by_tenant(
        self, now: datetime, limit: int, *, after: Mapping[TenantId, DueCursor]
    ) -> list[TimerEntry]:
        """Claim up to ``limit`` due timers shared among tenants (see the port)."""
        if limit <= 0:
            return []
        await self._far.before_find(require_utc(now))
        lane = self._lane_of("claiming")
        return _claimed(await self._tenant_claims.claim(lane, require_utc(now), limit, after))

    @property
    def sharing_with(self) -> tuple[str, ...]:
        """The other instances this store shares the tenants with: those heard on the
        ``LISTEN`` channel lately (none when not listening)."""
        return self._peers.sharing_with

    # -- reads -----------------------------------------------------------------------------

    async def get(self, tenant_id: TenantId, service_call_id: ServiceCallId) -> TimerEntry | None:
        statement = select_timer(tenant_id, service_call_id)
        row = await self._run("read a timer", lambda conn: conn.execute(statement).first())
        return None if row is None else entry_from_row(row)

    async def find_due_for_tenant(
        self, tenant_id: TenantId, now: datetime, limit: int
    ) -> list[TimerEntry]:
        if limit <= 0:
            return []
        await self._far.before_find(require_utc(now))
        statement = select_due_for_tenant(tenant_id, require_utc(now), limit)
        return await self._entries("read a tenant's due timers", statement)

    async def find_by_correlation(
        self, tenant_id: TenantId, correlation_id: CorrelationId
    ) -> list[TimerEntry]:
        statement = select_by_correlation(tenant_id, correlation_id)
        return await self._entries("read timers by correlation id", statement)

    async def list_for_tenant(
        self,
        tenant_id: TenantId,
        *,
        limit: int = 1000,
        after: ServiceCallId | None = None,
    ) -> list[TimerEntry]:
        if limit <= 0:
            return []
        statement = select_for_tenant(tenant_id, limit, after)
        return await self._entries("list a tenant's timers", statement)

    async def next_due_at(self) -> datetime | None:
        params = {"owner": self._owner_id}
        value = await self._run(
            "read the next due time", lambda conn: conn.execute(NEXT_DUE, params).scalar()
        )
        return None if value is None else require_utc(value)

    async def count_scheduled_for_tenant(self, tenant_id: TenantId) -> int:
        params = {"tenant": tenant_id}
        return await self._count(
            "count a tenant's scheduled timers", COUNT_SCHEDULED_FOR_TENANT, params
        )

    async def count_scheduled(self) -> int:
        return await self._count("count scheduled timers", COUNT_SCHEDULED, {})

    async def _count(self, action: str, statement: sa.TextClause, params: dict[str, Any]) -> int:
        return int(
            await self._run(action, lambda conn: conn.execute(statement, params).scalar_one())
        )

    async def _entries(self, action: str, statement: sa.Select[Any]) -> list[TimerEntry]:
        rows = await self._run(action, lambda conn: conn.execute(statement).all())
        return [entry_from_row(row) for row in rows]


def _first_edge(engine: sa.Engine) -> datetime | None:
    """The stored far edge, set from the database's clock first if there was none."""
    try:
        with engine.begin() as conn:
            conn.execute(FIRST_EDGE)
            edge = conn.execute(READ_EDGE).scalar()
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise translate_error(exc, "read the far edge") from exc
    return None if edge is None else require_utc(edge)


def _claimed(rows: Sequence[Any]) -> list[TimerEntry]:
    """The claimed rows as entries in due order, each carrying its claim (the lease token)."""
    claimed = [entry_from_row(row, claim=row.lease_token) for row in rows]
    claimed.sort(key=due_order)
    return claimed
