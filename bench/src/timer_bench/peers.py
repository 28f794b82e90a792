"""One round of a peer scheduler, run by :mod:`timer_bench.compare` inside the peers' own
virtualenv (Timer is not installed there; ``bench/src`` is on its path for the kit)::

    python -m timer_bench.peers pgqueuer --dsn postgresql://... --jobs 10000 --rate 20 ...
    python -m timer_bench.peers apscheduler --db /tmp/x.db --jobs 1000 --rate 20 ...

Prints one JSON object: the peer's schedule and fire rates, its lateness under a steady load,
and its raw yardstick (the same database work done by hand) measured in the same process.
Only the standard library, the kit's :mod:`timer_bench.kit` and the peer's own packages are
imported here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from timer_bench.kit import percentiles

BATCH = 100


# --- pgqueuer on PostgreSQL ----------------------------------------------------------------


async def pgqueuer_round(
    dsn: str, jobs: int, rate: int, seconds: float, yardstick_jobs: int, pending: int = 0
) -> dict[str, Any]:
    import asyncpg
    from pgqueuer import Queries, QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.types import QueueExecutionMode

    setup = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(setup))
    try:
        await queries.uninstall()
    except Exception:  # not installed yet
        pass
    await queries.install()
    table = queries.qbe.settings.queue_table
    if pending:
        # Jobs of an entrypoint no worker serves, due over the next 30 days from tomorrow.
        await setup.execute(
            f"INSERT INTO {table} (priority, status, entrypoint, execute_after, payload) "
            "SELECT 0, 'queued', 'pending', now() + interval '1 day' "
            f"+ random() * interval '30 days', NULL FROM generate_series(1, {pending})"
        )
        await setup.execute(f"VACUUM ANALYZE {table}")

    # Schedule: jobs due in an hour, enqueued in batches of 100 (its batch API).
    started = time.perf_counter()
    for start in range(0, jobs, BATCH):
        n = min(BATCH, jobs - start)
        await queries.enqueue(["noop"] * n, [None] * n, [0] * n, [timedelta(hours=1)] * n)
    schedule_per_s = jobs / (time.perf_counter() - started)
    await queries.clear_queue("noop")

    # Fire: jobs due now, executed by one QueueManager (batch 100) until the queue is drained.
    for start in range(0, jobs, BATCH):
        n = min(BATCH, jobs - start)
        await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
    executed = 0

    async def work(qm_connection: Any, on_job: Any, mode: Any) -> None:
        qm = QueueManager(Queries(AsyncpgDriver(qm_connection)))

        @qm.entrypoint("noop")  # type: ignore[untyped-decorator]
        async def noop(job: Any) -> None:
            on_job(job)

        await qm.run(batch_size=BATCH, mode=mode, dequeue_timeout=timedelta(seconds=0.5))

    def count(job: Any) -> None:
        nonlocal executed
        executed += 1

    started = time.perf_counter()
    await work(await asyncpg.connect(dsn), count, QueueExecutionMode.drain)
    fire_per_s = executed / (time.perf_counter() - started)
    assert executed == jobs, (executed, jobs)

    # Lateness: `rate` jobs/s for `seconds`, each due 1-2 s ahead; start of execution - due.
    lateness: list[float] = []
    total = int(rate * seconds)
    done = asyncio.Event()

    def late(job: Any) -> None:
        lateness.append((datetime.now(UTC) - job.execute_after).total_seconds() * 1000)
        if len(lateness) == total:
            done.set()

    qm_connection = await asyncpg.connect(dsn)
    runner = asyncio.create_task(work(qm_connection, late, QueueExecutionMode.continuous))
    started = time.perf_counter()
    for i in range(total):
        await queries.enqueue("noop", None, 0, timedelta(milliseconds=random.randint(1000, 2000)))
        await asyncio.sleep(max(0.0, (i + 1) / rate - (time.perf_counter() - started)))
    await asyncio.wait_for(done.wait(), seconds + 60)
    runner.cancel()
    try:
        await runner
    except (asyncio.CancelledError, Exception):
        pass

    yardstick = await pg_yardstick(setup, table, yardstick_jobs)
    await queries.uninstall()
    await setup.close()
    return {
        "schedule_per_s": round(schedule_per_s, 1),
        "fire_per_s": round(fire_per_s, 1),
        "lateness": percentiles(lateness),
        "yardstick": yardstick,
    }


async def pg_yardstick(connection: Any, table: str, jobs: int) -> dict[str, float]:
    """Raw asyncpg doing pgqueuer's database work on pgqueuer's own table (its indexes and
    triggers included): insert 100 rows a statement from arrays, then claim 100 due rows
    (``FOR UPDATE SKIP LOCKED``) and delete them."""
    started = time.perf_counter()
    for start in range(0, jobs, BATCH):
        n = min(BATCH, jobs - start)
        await connection.execute(
            f"INSERT INTO {table} (priority, status, entrypoint, execute_after, payload) "
            "SELECT p, 'queued', e, a, b "
            "FROM unnest($1::int[], $2::text[], $3::timestamptz[], $4::bytea[]) AS u(p, e, a, b)",
            [0] * n,
            ["raw"] * n,
            [datetime.now(UTC)] * n,
            [None] * n,
        )
    insert_per_s = jobs / (time.perf_counter() - started)
    started, done = time.perf_counter(), 0
    while True:
        ids = await connection.fetch(
            f"UPDATE {table} SET status = 'picked' WHERE id IN (SELECT id FROM {table} "
            "WHERE status = 'queued' AND entrypoint = 'raw' AND execute_after <= now() "
            "ORDER BY priority DESC, id FOR UPDATE SKIP LOCKED LIMIT $1) RETURNING id",
            BATCH,
        )
        if not ids:
            break
        await connection.execute(
            f"DELETE FROM {table} WHERE id = ANY($1::bigint[])", [r["id"] for r in ids]
        )
        done += len(ids)
    claim_per_s = done / (time.perf_counter() - started)
    return {"insert_per_s": round(insert_per_s, 1), "claim_delete_per_s": round(claim_per_s, 1)}


# --- APScheduler 4 on SQLite ---------------------------------------------------------------

_EXECUTED: list[float] = []


async def noop(due: float) -> None:
    """The job APScheduler runs (a coroutine: its async executor, no thread hop): records how
    late it started (ms)."""
    _EXECUTED.append((time.time() - due) * 1000)


async def apscheduler_round(
    db: str, jobs: int, rate: int, seconds: float, yardstick_jobs: int
) -> dict[str, Any]:
    from apscheduler import AsyncScheduler
    from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
    from apscheduler.triggers.date import DateTrigger
    from sqlalchemy import event
    from sqlalchemy.ext.asyncio import create_async_engine

    def store(phase: str) -> SQLAlchemyDataStore:
        # The same SQLite settings as Timer's store here: WAL, synchronous=NORMAL.
        engine = create_async_engine(f"sqlite+aiosqlite:///{db}.{phase}")

        @event.listens_for(engine.sync_engine, "connect")
        def pragmas(connection: Any, record: Any) -> None:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")

        return SQLAlchemyDataStore(engine)

    # Schedule: one add_schedule per job (it has no batch API), due in an hour.
    async with AsyncScheduler(store("schedule")) as scheduler:
        later = datetime.now(UTC) + timedelta(hours=1)
        started = time.perf_counter()
        for i in range(jobs):
            await scheduler.add_schedule(noop, DateTrigger(later), id=f"s{i}", args=[0.0])
        schedule_per_s = jobs / (time.perf_counter() - started)

    # Fire: jobs due now, added before the scheduler runs; time until all have run.
    _EXECUTED.clear()
    async with AsyncScheduler(store("fire")) as scheduler:
        now = datetime.now(UTC)
        for i in range(jobs):
            await scheduler.add_schedule(noop, DateTrigger(now), id=f"f{i}", args=[0.0])
        started = time.perf_counter()
        await scheduler.start_in_background()
        deadline = started + 600
        while len(_EXECUTED) < jobs and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        fire_per_s = len(_EXECUTED) / (time.perf_counter() - started)
        await scheduler.stop()

    # Lateness: `rate` schedules/s for `seconds`, each due 1-2 s ahead.
    _EXECUTED.clear()
    total = int(rate * seconds)
    async with AsyncScheduler(store("steady")) as scheduler:
        await scheduler.start_in_background()
        started = time.perf_counter()
        for i in range(total):
            due = time.time() + random.randint(1000, 2000) / 1000
            await scheduler.add_schedule(
                noop, DateTrigger(datetime.fromtimestamp(due, UTC)), id=f"l{i}", args=[due]
            )
            await asyncio.sleep(max(0.0, (i + 1) / rate - (time.perf_counter() - started)))
        deadline = time.perf_counter() + seconds + 120
        while len(_EXECUTED) < total and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        await scheduler.stop()
    lateness = list(_EXECUTED)

    return {
        "schedule_per_s": round(schedule_per_s, 1),
        "fire_per_s": round(fire_per_s, 1),
        "fired": len(lateness),
        "lateness": percentiles(lateness),
        "yardstick": sqlite_yardstick(db + ".raw", yardstick_jobs),
    }


def sqlite_yardstick(path: str, jobs: int) -> dict[str, float]:
    """Raw sqlite3 doing a scheduler's work: one insert per commit (as add_schedule does),
    then select + delete of due rows in batches of 100, one commit each."""
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS raw_schedules (id TEXT PRIMARY KEY, "
        "next_fire_time REAL NOT NULL, task TEXT NOT NULL, args BLOB)"
    )
    connection.execute("CREATE INDEX IF NOT EXISTS due ON raw_schedules (next_fire_time)")
    now = time.time()
    started = time.perf_counter()
    for i in range(jobs):
        connection.execute("BEGIN")
        connection.execute("INSERT INTO raw_schedules VALUES (?, ?, 'noop', x'00')", (f"r{i}", now))
        connection.execute("COMMIT")
    insert_per_s = jobs / (time.perf_counter() - started)
    started, done = time.perf_counter(), 0
    while True:
        connection.execute("BEGIN IMMEDIATE")
        rows = connection.execute(
            "SELECT id FROM raw_schedules WHERE next_fire_time <= ? ORDER BY next_fire_time "
            "LIMIT ?",
            (time.time(), BATCH),
        ).fetchall()
        connection.executemany("DELETE FROM raw_schedules WHERE id = ?", rows)
        connection.execute("COMMIT")
        if not rows:
            break
        done += len(rows)
    claim_per_s = done / (time.perf_counter() - started)
    connection.close()
    return {"insert_per_s": round(insert_per_s, 1), "claim_delete_per_s": round(claim_per_s, 1)}


# --- awa on PostgreSQL ---------------------------------------------------------------------


async def awa_round(
    dsn: str, jobs: int, rate: int, seconds: float, yardstick_jobs: int, pending: int = 0
) -> dict[str, Any]:
    """awa at its defaults (200 ms polling): jobs with ``run_at``, inserted 100 at a time by
    its COPY batch call; a handler records how late it started."""
    from dataclasses import dataclass

    import awa

    @dataclass
    class Noop:
        due: float

    ran: list[float] = []
    client = awa.AsyncClient(dsn)
    await client.migrate()

    @client.task(Noop, queue="compare")  # type: ignore[untyped-decorator]
    async def handle(job: Any) -> None:
        ran.append((time.time() - job.args.due) * 1000)

    # Pending: jobs due tomorrow, inserted 10,000 a call.
    tomorrow = datetime.now(UTC) + timedelta(days=1)
    for start in range(0, pending, 10_000):
        n = min(10_000, pending - start)
        await client.insert_many_copy([Noop(0.0)] * n, queue="compare", run_at=tomorrow)

    # Schedule: jobs due in an hour, 100 a call.
    later = datetime.now(UTC) + timedelta(hours=1)
    started = time.perf_counter()
    for start in range(0, jobs, BATCH):
        n = min(BATCH, jobs - start)
        await client.insert_many_copy([Noop(0.0)] * n, queue="compare", run_at=later)
    schedule_per_s = jobs / (time.perf_counter() - started)

    # Fire: jobs due now, inserted before the workers start; from the start until all ran.
    due = time.time()
    for start in range(0, jobs, BATCH):
        n = min(BATCH, jobs - start)
        await client.insert_many_copy([Noop(due)] * n, queue="compare")
    started = time.perf_counter()
    await client.start([("compare", BATCH)])
    deadline = started + 600
    while len(ran) < jobs and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    fire_per_s = len(ran) / (time.perf_counter() - started)

    # Lateness: `rate` jobs/s for `seconds`, each due 1-2 s ahead.
    ran.clear()
    total = int(rate * seconds)
    started = time.perf_counter()
    for i in range(total):
        at = time.time() + random.randint(1000, 2000) / 1000
        await client.insert(Noop(at), queue="compare", run_at=datetime.fromtimestamp(at, UTC))
        await asyncio.sleep(max(0.0, (i + 1) / rate - (time.perf_counter() - started)))
    deadline = time.perf_counter() + seconds + 120
    while len(ran) < total and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    lateness = list(ran)
    await client.shutdown()
    await client.close()
    return {
        "schedule_per_s": round(schedule_per_s, 1),
        "fire_per_s": round(fire_per_s, 1),
        "fired": len(lateness),
        "lateness": percentiles(lateness),
        "yardstick": await plain_pg_yardstick(dsn, yardstick_jobs),
    }


# --- DBOS: delayed workflows on PostgreSQL or SQLite ---------------------------------------

_RAN: list[float] = []


def dbos_round(
    url: str, jobs: int, rate: int, seconds: float, yardstick_jobs: int
) -> dict[str, Any]:
    """DBOS at its defaults: a queue (polled every second), each job a workflow enqueued with
    ``SetEnqueueOptions(delay_seconds=...)``; a workflow records how late it started."""
    from dbos import DBOS, SetEnqueueOptions

    DBOS(config={"name": "compare", "system_database_url": url, "run_admin_server": False})

    @DBOS.workflow()  # type: ignore[untyped-decorator]
    def noop(due: float) -> None:
        _RAN.append((time.time() - due) * 1000)

    DBOS.launch()
    queue = DBOS.register_queue("compare")
    try:
        # Schedule: one enqueue per job (no batch call), each due in an hour.
        started = time.perf_counter()
        for _ in range(jobs):
            with SetEnqueueOptions(delay_seconds=3600):
                queue.enqueue(noop, 0.0)
        schedule_per_s = jobs / (time.perf_counter() - started)

        # Fire: jobs all due at one instant, enqueued before it; from then until all ran.
        _RAN.clear()
        due = time.time() + 1.0 + 1.5 * jobs / schedule_per_s
        for _ in range(jobs):
            with SetEnqueueOptions(delay_seconds=max(0.0, due - time.time())):
                queue.enqueue(noop, due)
        deadline = due + 600
        while len(_RAN) < jobs and time.time() < deadline:
            time.sleep(0.01)
        fire_per_s = len(_RAN) / max(1e-9, time.time() - due)

        # Lateness: `rate` jobs/s for `seconds`, each due 1-2 s ahead.
        _RAN.clear()
        total = int(rate * seconds)
        started = time.perf_counter()
        for i in range(total):
            delay = random.randint(1000, 2000) / 1000
            with SetEnqueueOptions(delay_seconds=delay):
                queue.enqueue(noop, time.time() + delay)
            time.sleep(max(0.0, (i + 1) / rate - (time.perf_counter() - started)))
        deadline = time.time() + seconds + 120
        while len(_RAN) < total and time.time() < deadline:
            time.sleep(0.01)
        lateness = list(_RAN)
    finally:
        DBOS.destroy()
    if url.startswith("sqlite"):
        yardstick = sqlite_yardstick(url.removeprefix("sqlite:///") + ".raw", yardstick_jobs)
    else:
        yardstick = asyncio.run(plain_pg_yardstick(url, yardstick_jobs))
    return {
        "schedule_per_s": round(schedule_per_s, 1),
        "fire_per_s": round(fire_per_s, 1),
        "fired": len(lateness),
        "lateness": percentiles(lateness),
        "yardstick": yardstick,
    }


async def plain_pg_yardstick(dsn: str, jobs: int) -> dict[str, float]:
    """Raw asyncpg doing a one-at-a-time enqueue's work: one insert a commit into a plain
    table with a due-time index; then claim 100 due (``FOR UPDATE SKIP LOCKED``) and delete
    them, one commit each."""
    import asyncpg

    connection = await asyncpg.connect(dsn)
    await connection.execute(
        "CREATE TABLE IF NOT EXISTS raw_jobs (id bigserial PRIMARY KEY, "
        "execute_after timestamptz NOT NULL, payload bytea)"
    )
    await connection.execute("CREATE INDEX IF NOT EXISTS raw_jobs_due ON raw_jobs (execute_after)")
    started = time.perf_counter()
    for _ in range(jobs):
        await connection.execute(
            "INSERT INTO raw_jobs (execute_after, payload) VALUES (now(), NULL)"
        )
    insert_per_s = jobs / (time.perf_counter() - started)
    started, done = time.perf_counter(), 0
    while True:
        async with connection.transaction():
            ids = await connection.fetch(
                "SELECT id FROM raw_jobs WHERE execute_after <= now() ORDER BY execute_after "
                "LIMIT $1 FOR UPDATE SKIP LOCKED",
                BATCH,
            )
            if ids:
                await connection.execute(
                    "DELETE FROM raw_jobs WHERE id = ANY($1::bigint[])", [r["id"] for r in ids]
                )
        if not ids:
            break
        done += len(ids)
    claim_per_s = done / (time.perf_counter() - started)
    await connection.close()
    return {"insert_per_s": round(insert_per_s, 1), "claim_delete_per_s": round(claim_per_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("peer", choices=["pgqueuer", "apscheduler", "dbos", "awa"])
    parser.add_argument("--dsn")
    parser.add_argument("--db")
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--rate", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--yardstick-jobs", type=int, required=True)
    parser.add_argument("--pending", type=int, default=0, help="future jobs stored first")
    args = parser.parse_args()
    if args.peer == "dbos":
        result = dbos_round(args.dsn, args.jobs, args.rate, args.seconds, args.yardstick_jobs)
        print(json.dumps(result))
        return
    if args.peer == "awa":
        run = awa_round(
            args.dsn, args.jobs, args.rate, args.seconds, args.yardstick_jobs, args.pending
        )
    elif args.peer == "pgqueuer":
        run = pgqueuer_round(
            args.dsn, args.jobs, args.rate, args.seconds, args.yardstick_jobs, args.pending
        )
    else:
        run = apscheduler_round(args.db, args.jobs, args.rate, args.seconds, args.yardstick_jobs)
    result = asyncio.run(run)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
