"""Timer beside its peers on the same machine, round by round: Timer on PostgreSQL beside
pgqueuer and DBOS (delayed workflows) on the same PostgreSQL server; Timer on SQLite beside
APScheduler 4 and DBOS on SQLite with Timer's settings; each with its own raw yardstick
measured in the same round.

The peers, at the versions pinned in ``PEERS``, go into a virtualenv of their own in a
temporary directory (never into Timer's environment). Every system does the same three
things through its public API: **schedule** ``--jobs`` jobs due in an hour (batches of 100
where it has a batch call), **fire** ``--jobs`` jobs due now with one worker (batch 100;
each job a no-op for the peers, an acked JetStream publish for Timer), and **lateness** of
``--rate`` new jobs a second due 1-2 s ahead.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from timer_adapters_nats import NatsBroker, NatsServerProcess, NatsSettings
from timer_adapters_postgres import PostgresTimerStore
from timer_adapters_sqlite import SqliteTimerStore
from timer_bench import kit, sqlite, yardsticks
from timer_bench.large import PostgresLarge
from timer_bench.procs import postgres
from timer_bench.watched import WatchedPublisher
from timer_core import SystemClock, TenantId, Timer, TimerEntry, TimerStore

#: The peers and everything they import, pinned: the versions the figures are for.
PEERS = {
    "pgqueuer": "1.6.0",
    "asyncpg": "0.32.0",
    "apscheduler[sqlalchemy]": "4.0.0a6",
    "sqlalchemy[asyncio]": "2.1.9",
    "greenlet": "3.5.6",
    "aiosqlite": "0.22.1",
    "sniffio": "1.3.1",  # APScheduler 4.0.0a6 imports it; newer anyio no longer pulls it in
    "dbos": "3.4.0",
    "awa-pg": "0.6.9",
}
#: Every system of the race: (key, how its round runs).
SYSTEMS = (
    "timer",
    "timer-postgres",
    "pgqueuer",
    "dbos-postgres",
    "awa",
    "apscheduler",
    "dbos-sqlite",
)
#: PostgreSQL as durable as the SQLite every system runs on here (WAL, synchronous=NORMAL):
#: every commit survives a crash of the process, the last ones may be lost on power loss.
POSTGRES = {"fsync": "on", "synchronous_commit": "off", "full_page_writes": "on"}
BATCH = 100
#: Timer's SQLite as the peers' (Timer's own default, FULL, also syncs each command commit).
TIMER_SYNCHRONOUS: Final = "NORMAL"


def peer_python(directory: Path) -> Path:
    """A virtualenv with the pinned peers; its python."""
    venv = directory / "peers-venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    pins = [f"{name}=={version}" for name, version in PEERS.items()]
    subprocess.run(["uv", "pip", "install", "-q", "-p", str(python), *pins], check=True)
    return python


def peer_round(python: Path, arguments: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [str(python), "-m", "timer_bench.peers", *arguments],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{arguments[0]} failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


async def timer_round(
    directory: Path,
    nats_url: str,
    jobs: int,
    rate: int,
    seconds: float,
    postgres_url: Callable[[str], str] | None = None,
) -> Any:
    """Timer's three phases on SQLite files in ``directory``, or (``postgres_url``: a fresh
    database's URL by name) on PostgreSQL databases of their own."""
    clock = SystemClock()

    def make(phase: str) -> TimerStore:
        if postgres_url is None:
            return SqliteTimerStore(directory / f"{phase}.db", synchronous=TIMER_SYNCHRONOUS)
        return PostgresTimerStore(postgres_url(phase), owner_id=f"compare-{phase}")

    def batches(due: Any, now: Any) -> list[list[TimerEntry]]:
        entries = [TimerEntry(f"tenant-{i % 50}", f"call-{i}", due, now) for i in range(jobs)]
        return [entries[start : start + BATCH] for start in range(0, jobs, BATCH)]

    async with make("schedule") as store:
        now = clock.now()
        watch = kit.Stopwatch()
        for batch in batches(now + timedelta(hours=1), now):
            await store.apply(batch)
        schedule_per_s = kit.rate(jobs, watch.elapsed())

    async with NatsBroker(NatsSettings(url=nats_url)) as broker:
        async with make("fire") as store:
            now = clock.now()
            for batch in batches(now, now):
                await store.apply(batch)
            watched = WatchedPublisher(broker.publisher, jobs)
            fire_per_s = kit.rate(jobs, await watched.fire_all(store, batch=BATCH))

        total = int(rate * seconds)
        store = make("steady")
        async with Timer(store, broker.publisher) as timer:
            watch = kit.Stopwatch()
            for i in range(total):
                due = clock.now() + timedelta(milliseconds=random.randint(1000, 2000))
                await timer.schedule("tenant-a", f"call-{i}", due)
                await asyncio.sleep(max(0.0, (i + 1) / rate - watch.elapsed()))
            while await store.count_scheduled() and watch.elapsed() < seconds + 60:
                await asyncio.sleep(0.05)
            fired = await store.list_for_tenant(TenantId("tenant-a"), limit=total + 1)
        lateness = [(e.reached_at - e.due_at).total_seconds() * 1000 for e in fired if e.reached_at]

    return {
        "schedule_per_s": schedule_per_s,
        "fire_per_s": fire_per_s,
        "fired": len(lateness),
        "lateness": kit.percentiles(lateness),
        "yardstick": (
            await timer_yardstick(directory / "raw.db", nats_url, jobs)
            if postgres_url is None
            else await timer_pg_yardstick(postgres_url("raw"), nats_url, jobs)
        ),
    }


async def timer_yardstick(path: Path, nats_url: str, jobs: int) -> dict[str, float]:
    """Timer's work by hand on Timer's schema: upserts 100 a commit; then select 100 due ->
    acked JetStream publishes -> mark them, one commit per batch."""
    now = kit.now_ms()
    rows = list(sqlite.timer_rows(jobs, prefix="raw", due_ms=lambda i: now - 1000))
    insert_per_s = yardsticks.upserts(sqlite.create(path), rows, BATCH)
    claim_per_s, _ = await yardsticks.fire_pipeline(path, nats_url, BATCH)
    return {"insert_per_s": insert_per_s, "claim_delete_per_s": claim_per_s}


async def timer_pg_yardstick(url: str, nats_url: str, jobs: int) -> dict[str, float]:
    """Timer's work by hand on Timer's PostgreSQL schema: ``INSERT ... SELECT FROM unnest``
    of 100 rows a statement; then claim 100 due (``FOR UPDATE SKIP LOCKED``), acked
    JetStream publishes, one ``UPDATE`` marking them ``Reached``, one commit per batch."""
    import nats
    import psycopg

    async with PostgresTimerStore(url, owner_id="raw", listen=False):
        pass  # Timer's schema, made by its migrations
    conninfo = url.replace("postgresql+psycopg://", "postgresql://")
    now = datetime.now(UTC)
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        watch = kit.Stopwatch()
        for start in range(0, jobs, BATCH):
            ids = [f"raw-{i}" for i in range(start, min(jobs, start + BATCH))]
            await conn.execute(
                "INSERT INTO timer_schedules (tenant_id, service_call_id, due_at, registered_at) "
                "SELECT 'tenant-' || (n %% 50), c, %s, %s FROM unnest(%s::text[]) "
                "WITH ORDINALITY AS u(c, n) ON CONFLICT (tenant_id, service_call_id) DO UPDATE "
                "SET due_at = excluded.due_at WHERE timer_schedules.state = 'Scheduled'",
                (now, now, ids),
            )
        insert_per_s = kit.rate(jobs, watch.elapsed())
        nc = await nats.connect(nats_url)
        js = nc.jetstream(timeout=10)
        watch, done = kit.Stopwatch(), 0
        while True:
            async with conn.transaction():
                rows = await (
                    await conn.execute(
                        "SELECT tenant_id, service_call_id, due_at FROM timer_schedules "
                        "WHERE state = 'Scheduled' AND due_at <= now() "
                        "ORDER BY due_at, tenant_id, service_call_id LIMIT %s "
                        "FOR UPDATE SKIP LOCKED",
                        (BATCH,),
                    )
                ).fetchall()
                if not rows:
                    break
                acks = [
                    js.publish(
                        f"timer.events.{tenant}",
                        json.dumps({"tenantId": tenant, "serviceCallId": call}).encode(),
                        stream="TIMER_EVENTS",
                    )
                    for tenant, call, _ in rows
                ]
                await asyncio.gather(*acks)
                await conn.execute(
                    "UPDATE timer_schedules SET state = 'Reached', reached_at = now() "
                    "WHERE (tenant_id, service_call_id) IN "
                    "(SELECT * FROM unnest(%s::text[], %s::text[]))",
                    ([r[0] for r in rows], [r[1] for r in rows]),
                )
            done += len(rows)
        claim_per_s = kit.rate(done, watch.elapsed())
        await nc.close()
    return {"insert_per_s": insert_per_s, "claim_delete_per_s": claim_per_s}


FIGURES = (
    "schedule_per_s",
    "fire_per_s",
    "lateness.p50_ms",
    "lateness.p99_ms",
    "yardstick.insert_per_s",
    "yardstick.claim_delete_per_s",
)


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over the rounds with every round's value; and each rate's
    median of per-round ratios to its yardstick."""

    def pick(path: str) -> list[float]:
        values = []
        for one in rounds:
            value: Any = one
            for key in path.split("."):
                value = value[key]
            values.append(float(value))
        return values

    out: dict[str, Any] = {
        path: {"median": round(kit.median(pick(path)), 1), "rounds": pick(path)} for path in FIGURES
    }
    for rate, yardstick, name in (
        ("schedule_per_s", "yardstick.insert_per_s", "schedule_vs_raw"),
        ("fire_per_s", "yardstick.claim_delete_per_s", "fire_vs_raw"),
    ):
        out[name] = {"median": round(kit.median_ratio(pick(rate), pick(yardstick)), 2)}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one round of 1,000 jobs, 3 s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=10_000, help="for Timer and pgqueuer")
    parser.add_argument("--apscheduler-jobs", type=int, default=1_000)
    parser.add_argument("--dbos-jobs", type=int, default=2_000)
    parser.add_argument("--systems", help="comma-separated (default: all of the scenario)")
    parser.add_argument(
        "--pending",
        type=int,
        default=None,
        help="future jobs stored in each PostgreSQL system's table first (compare-pending: "
        "1,000,000; not DBOS: its API enqueues one at a time)",
    )
    parser.add_argument("--rate", type=int, default=20, help="steady jobs/s for lateness")
    parser.add_argument("--seconds", type=float, default=10.0)


#: compare-pending: the PostgreSQL systems whose tables can be filled in bulk.
PENDING_SYSTEMS = "timer-postgres,pgqueuer,awa"


def main(args: argparse.Namespace) -> int:
    with_pending = args.scenario == "compare-pending"
    if args.pending is None:
        args.pending = (20_000 if args.quick else 1_000_000) if with_pending else 0
    if args.systems is None:
        args.systems = PENDING_SYSTEMS if with_pending else ",".join(SYSTEMS)
    if args.quick:
        args.rounds, args.jobs, args.apscheduler_jobs, args.seconds = 1, 1_000, 200, 3.0
        args.dbos_jobs = 200
    scratch = Path(tempfile.mkdtemp(prefix="timer-compare-"))
    os.chmod(scratch, 0o755)
    machine = kit.machine()
    kit.progress(f"peers: {', '.join(f'{k} {v}' for k, v in PEERS.items())}")
    python = peer_python(scratch)
    server = NatsServerProcess(scratch / "nats", host="127.0.0.1", port=0)
    systems = [name for name in args.systems.split(",") if name]
    if unknown := set(systems) - set(SYSTEMS):
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    try:
        with postgres(POSTGRES) as pg:
            with pg.admin() as connection:
                row = connection.execute("SHOW server_version").fetchone()
                machine["postgres"] = f"PostgreSQL {row[0] if row else '?'}"
            server.start()
            dsn = f"postgresql://{pg.user}@127.0.0.1:{pg.port}/postgres"
            common = ["--rate", str(args.rate), "--seconds", str(args.seconds)]
            common += ["--yardstick-jobs", str(args.jobs), "--pending", str(args.pending)]

            def measure(system: str, n: int) -> dict[str, Any]:
                kit.progress(f"round {n}: {system}")
                work = scratch / f"{system}-{n}"
                work.mkdir()
                if system == "timer":
                    return asyncio.run(
                        timer_round(work, server.url, args.jobs, args.rate, args.seconds)
                    )
                if system == "timer-postgres":

                    def database(phase: str) -> str:
                        name = f"timer_{n}_{phase}"
                        if not args.pending:
                            return str(pg.create_database(name))
                        loader = PostgresLarge(pg)
                        loader.create(name)
                        loader.load(name, args.pending, 0, kit.now_ms())
                        return str(pg.url(name))

                    urls = {p: database(p) for p in ("schedule", "fire", "steady", "raw")}
                    return asyncio.run(
                        timer_round(
                            work, server.url, args.jobs, args.rate, args.seconds, urls.__getitem__
                        )
                    )
                if system == "dbos-postgres":
                    url = f"postgresql://{pg.user}@127.0.0.1:{pg.port}/dbos_{n}"
                    return peer_round(
                        python, ["dbos", "--dsn", url, "--jobs", str(args.dbos_jobs), *common]
                    )
                if system == "awa":
                    url = f"postgresql://{pg.user}@127.0.0.1:{pg.port}/awa_{n}"
                    pg.create_database(f"awa_{n}")
                    return peer_round(
                        python, ["awa", "--dsn", url, "--jobs", str(args.jobs), *common]
                    )
                if system == "dbos-sqlite":
                    url = f"sqlite:///{work / 'dbos.db'}"
                    return peer_round(
                        python, ["dbos", "--dsn", url, "--jobs", str(args.dbos_jobs), *common]
                    )
                if system == "pgqueuer":
                    return peer_round(
                        python, ["pgqueuer", "--dsn", dsn, "--jobs", str(args.jobs), *common]
                    )
                db = str(work / "aps.db")
                return peer_round(
                    python,
                    ["apscheduler", "--db", db, "--jobs", str(args.apscheduler_jobs), *common],
                )

            for one in asyncio.run(
                kit.alternated(args.rounds, list(rounds), _in_thread(measure), rotate=False)
            ):
                for system, result in one.items():
                    rounds[system].append(result)
    finally:
        server.stop()
        frozen = subprocess.run(
            ["uv", "pip", "freeze", "-p", str(python)], capture_output=True, text=True, check=False
        ).stdout.split()
        shutil.rmtree(scratch, ignore_errors=True)
    document = {
        "date": kit.today(),
        "machine": machine,
        "timer_version": importlib.metadata.version("timer-core"),
        "peers": PEERS,
        "peer_environment": frozen,
        "settings": {
            "rounds": args.rounds,
            "jobs": {
                "timer": args.jobs,
                "timer-postgres": args.jobs,
                "pgqueuer": args.jobs,
                "apscheduler": args.apscheduler_jobs,
                "dbos-postgres": args.dbos_jobs,
                "awa": args.jobs,
                "dbos-sqlite": args.dbos_jobs,
            },
            "batch": BATCH,
            "pending": args.pending,
            "steady_rate_per_s": args.rate,
            "steady_seconds": args.seconds,
            "postgres": POSTGRES,
            "sqlite": (
                "WAL, synchronous=NORMAL on every system "
                "(not Timer's default, FULL, which also syncs each command commit)"
            ),
        },
        "systems": {name: medians(r) for name, r in rounds.items()},
        "rounds": rounds,
    }
    kit.write_result(document, args.output)
    from timer_bench.render import compare_block

    print(compare_block(document))
    return 0


def _in_thread(measure: Any) -> Any:
    """``measure`` off the event loop (Timer's round runs a loop of its own)."""

    async def run(system: str, n: int) -> Any:
        return await asyncio.to_thread(measure, system, n)

    return run
