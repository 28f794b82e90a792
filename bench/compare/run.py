"""Timer beside its peers on the same machine: pgqueuer on PostgreSQL, APScheduler 4 on SQLite.

    uv run --all-packages python bench/compare/run.py            # about 5 minutes
    uv run --all-packages python bench/compare/run.py --rounds 1 --jobs 2000   # a quick look

Installs the peers, at the versions pinned in PEERS, into a virtualenv of their own in a
temporary directory (so they never enter Timer's environment), starts a PostgreSQL server
(tests/pg.py) and a nats-server on 127.0.0.1, and runs rounds of each system in turn, each
with its own raw yardstick measured in the same round. Writes bench/results/compare.json,
which docs/comparison.md renders (bench/compare/render.py).

Every system does the same three things through its own public API:

- **schedule**: ``--jobs`` jobs/timers due in an hour, created as fast as the API allows
  (batches of 100 where it has a batch call: pgqueuer's ``enqueue`` lists, Timer's
  ``TimerStore.apply``; one ``add_schedule`` at a time for APScheduler);
- **fire**: ``--jobs`` jobs/timers due now, stored before the worker starts, then one worker
  (batch 100 where it has one) runs until all have run; a job is a no-op for the peers,
  while Timer publishes each ``DueTimeReached`` to JetStream and waits for the ack;
- **lateness**: ``--rate`` new jobs/timers per second for ``--seconds``, each due 1-2 s
  ahead; start of execution (Timer: ``reachedAt``) minus the due time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import percentiles  # noqa: E402  (the peers' script: one way to take percentiles)

from tests.pg import start_cluster  # noqa: E402
from timer_adapters_nats import NatsBroker, NatsServerProcess, NatsSettings  # noqa: E402
from timer_adapters_sqlite import SqliteTimerStore  # noqa: E402
from timer_core import (  # noqa: E402
    ScheduleTimer,
    SystemClock,
    TimerEntry,
    TimerWorker,
    schedule_timer,
)

#: The peers and everything they import, pinned: the versions the figures are for.
PEERS = {
    "pgqueuer": "1.6.0",
    "asyncpg": "0.32.0",
    "apscheduler[sqlalchemy]": "4.0.0a6",
    "sqlalchemy[asyncio]": "2.1.9",
    "greenlet": "3.5.6",
    "aiosqlite": "0.22.1",
    "sniffio": "1.3.1",  # APScheduler 4.0.0a6 imports it; newer anyio no longer pulls it in
}
#: PostgreSQL as durable as Timer's SQLite default (WAL, synchronous=NORMAL): every commit
#: survives a crash of the process, the last ones may be lost on power loss.
POSTGRES = {"fsync": "on", "synchronous_commit": "off", "full_page_writes": "on"}
RESULTS = ROOT / "bench" / "results" / "compare.json"
PEERS_SCRIPT = Path(__file__).with_name("peers.py")
BATCH = 100


def progress(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_peer_env(directory: Path) -> Path:
    """A virtualenv with the pinned peers; returns its python."""
    venv = directory / "peers-venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    pins = [f"{name}=={version}" for name, version in PEERS.items()]
    subprocess.run(["uv", "pip", "install", "-q", "-p", str(python), *pins], check=True)
    return python


# --- Timer ---------------------------------------------------------------------------------


def _batch(start: int, jobs: int) -> range:
    return range(start, min(jobs, start + BATCH))


def _entry(i: int, due: datetime, now: datetime) -> TimerEntry:
    return TimerEntry(f"tenant-{i % 50}", f"call-{i}", due, now)


async def timer_round(directory: Path, nats_url: str, jobs: int, rate: int, seconds: float) -> Any:
    clock = SystemClock()

    # Schedule: TimerStore.apply in batches of 100, due in an hour.
    async with SqliteTimerStore(directory / "schedule.db") as store:
        now = clock.now()
        later = now + timedelta(hours=1)
        started = time.perf_counter()
        for start in range(0, jobs, BATCH):
            await store.apply([_entry(i, later, now) for i in _batch(start, jobs)])
        schedule_per_s = jobs / (time.perf_counter() - started)

    broker = NatsBroker(NatsSettings(url=nats_url))
    async with broker:
        # Fire: timers due now, stored before the worker starts; published with acks + marked.
        async with SqliteTimerStore(directory / "fire.db") as store:
            now = clock.now()
            for start in range(0, jobs, BATCH):
                await store.apply([_entry(i, now, now) for i in _batch(start, jobs)])
            worker = TimerWorker(
                store, broker.publisher, clock, polling_interval=5.0, batch_size=BATCH
            )
            started = time.perf_counter()
            running = asyncio.create_task(worker.run())
            while await store.count_scheduled():
                await asyncio.sleep(0.01)
            fire_per_s = jobs / (time.perf_counter() - started)
            worker.stop()
            await running

        # Lateness: `rate` ScheduleTimer/s through schedule_timer, due 1-2 s ahead.
        async with SqliteTimerStore(directory / "steady.db") as store:
            worker = TimerWorker(
                store, broker.publisher, clock, polling_interval=5.0, batch_size=BATCH
            )
            running = asyncio.create_task(worker.run())
            total = int(rate * seconds)
            started = time.perf_counter()
            for i in range(total):
                due = clock.now() + timedelta(milliseconds=random.randint(1000, 2000))
                await schedule_timer(store, ScheduleTimer("tenant-a", f"call-{i}", due), clock)
                worker.notify_scheduled(due)
                await asyncio.sleep(max(0.0, (i + 1) / rate - (time.perf_counter() - started)))
            deadline = time.perf_counter() + seconds + 60
            while await store.count_scheduled() and time.perf_counter() < deadline:
                await asyncio.sleep(0.05)
            worker.stop()
            await running
            lateness = [
                (entry.reached_at - entry.due_at).total_seconds() * 1000
                for entry in await store.list_for_tenant("tenant-a", limit=total + 1)
                if entry.reached_at is not None
            ]

    return {
        "schedule_per_s": round(schedule_per_s, 1),
        "fire_per_s": round(fire_per_s, 1),
        "fired": len(lateness),
        "lateness": percentiles(lateness),
        "yardstick": await timer_yardstick(directory / "raw.db", nats_url, jobs),
    }


async def timer_yardstick(path: Path, nats_url: str, jobs: int) -> dict[str, float]:
    """Raw sqlite3 + nats-py doing Timer's work on Timer's own schema (created by the store):
    the store's upsert, 100 a commit; then select 100 due -> acked JetStream publishes ->
    mark them, one commit per batch."""
    import nats

    async with SqliteTimerStore(path):
        pass  # creates the schema, with its indexes
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    started = time.perf_counter()
    for start in range(0, jobs, BATCH):
        connection.execute("BEGIN")
        connection.executemany(
            "INSERT INTO timer_schedules (tenant_id, service_call_id, correlation_id, due_at, "
            "registered_at, state) VALUES (?, ?, NULL, ?, ?, 'Scheduled') "
            "ON CONFLICT (tenant_id, service_call_id) DO UPDATE SET due_at = excluded.due_at, "
            "correlation_id = excluded.correlation_id, registered_at = excluded.registered_at "
            "WHERE timer_schedules.state = 'Scheduled'",
            [(f"tenant-{i % 50}", f"call-{i}", now, now) for i in _batch(start, jobs)],
        )
        connection.execute("COMMIT")
    upsert_per_s = jobs / (time.perf_counter() - started)

    client = await nats.connect(nats_url)
    js = client.jetstream()
    started, done = time.perf_counter(), 0
    while True:
        rows = connection.execute(
            "SELECT tenant_id, service_call_id FROM timer_schedules WHERE state = 'Scheduled' "
            "AND due_at <= ? ORDER BY due_at, tenant_id, service_call_id LIMIT ?",
            (now, BATCH),
        ).fetchall()
        if not rows:
            break
        acks = [
            await js.publish_async(f"timer.events.{t}.{c}", b"{}", headers={"Nats-Msg-Id": c})
            for t, c in rows
        ]
        await asyncio.gather(*acks)
        connection.execute("BEGIN")
        connection.executemany(
            "UPDATE timer_schedules SET state = 'Reached', reached_at = ? "
            "WHERE tenant_id = ? AND service_call_id = ? AND state = 'Scheduled'",
            [(now, t, c) for t, c in rows],
        )
        connection.execute("COMMIT")
        done += len(rows)
    pipeline_per_s = done / (time.perf_counter() - started)
    await client.close()
    connection.close()
    return {"insert_per_s": round(upsert_per_s, 1), "claim_delete_per_s": round(pipeline_per_s, 1)}


# --- the run -------------------------------------------------------------------------------


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over the rounds, with every round's value kept beside it."""

    def pick(path: tuple[str, ...]) -> list[float]:
        values = []
        for r in rounds:
            value: Any = r
            for key in path:
                value = value[key]
            values.append(float(value))
        return values

    figures = {}
    for path in [
        ("schedule_per_s",),
        ("fire_per_s",),
        ("lateness", "p50_ms"),
        ("lateness", "p99_ms"),
        ("yardstick", "insert_per_s"),
        ("yardstick", "claim_delete_per_s"),
    ]:
        values = pick(path)
        figures[".".join(path)] = {"median": round(statistics.median(values), 1), "rounds": values}
    schedule, insert = pick(("schedule_per_s",)), pick(("yardstick", "insert_per_s"))
    fire, claim = pick(("fire_per_s",)), pick(("yardstick", "claim_delete_per_s"))
    figures["schedule_vs_raw"] = {
        "median": round(statistics.median(s / y for s, y in zip(schedule, insert, strict=True)), 2)
    }
    figures["fire_vs_raw"] = {
        "median": round(statistics.median(f / y for f, y in zip(fire, claim, strict=True)), 2)
    }
    return figures


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": sys.version.split()[0],
        "sqlite": sqlite3.sqlite_version,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=10_000, help="for Timer and pgqueuer")
    parser.add_argument("--apscheduler-jobs", type=int, default=1_000)
    parser.add_argument("--rate", type=int, default=20, help="steady jobs/s for lateness")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="timer-compare-"))
    os.chmod(scratch, 0o755)  # the PostgreSQL server runs as its own user when we are root
    info = machine()
    started = time.monotonic()
    progress(f"peers into {scratch}: {', '.join(f'{k} {v}' for k, v in PEERS.items())}")
    python = make_peer_env(scratch)
    (scratch / "pg").mkdir()
    os.chmod(scratch / "pg", 0o755)
    pg = start_cluster(scratch / "pg", POSTGRES)
    nats_server = NatsServerProcess(scratch / "nats", host="127.0.0.1", port=0)
    nats_server.start()
    rounds: dict[str, list[dict[str, Any]]] = {"timer": [], "pgqueuer": [], "apscheduler": []}
    try:
        with pg.admin() as connection:
            row = connection.execute("SHOW server_version").fetchone()
            pg_version = f"PostgreSQL {row[0] if row else '?'}"
        dsn = f"postgresql://{pg.user}@127.0.0.1:{pg.port}/postgres"
        for n in range(1, args.rounds + 1):
            common = ["--rate", str(args.rate), "--seconds", str(args.seconds)]
            common += ["--yardstick-jobs", str(args.jobs)]
            rate = (args.rate, args.seconds)
            progress(f"round {n}: Timer")
            (scratch / f"timer-{n}").mkdir()
            timer = timer_round(scratch / f"timer-{n}", nats_server.url, args.jobs, *rate)
            rounds["timer"].append(asyncio.run(timer))
            progress(f"round {n}: pgqueuer")
            rounds["pgqueuer"].append(
                _peer(python, ["pgqueuer", "--dsn", dsn, "--jobs", str(args.jobs), *common])
            )
            progress(f"round {n}: APScheduler")
            (scratch / f"aps-{n}").mkdir()
            rounds["apscheduler"].append(
                _peer(
                    python,
                    [
                        "apscheduler",
                        "--db",
                        str(scratch / f"aps-{n}" / "aps.db"),
                        "--jobs",
                        str(args.apscheduler_jobs),
                        *common,
                    ],
                )
            )
    finally:
        nats_server.stop()
        pg.stop()
        frozen = subprocess.run(
            ["uv", "pip", "freeze", "-p", str(python)], capture_output=True, text=True, check=False
        ).stdout.split()
        shutil.rmtree(scratch, ignore_errors=True)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    info["postgres"] = pg_version
    document = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - started, 1),
        "machine": info,
        "timer_version": importlib.metadata.version("timer-core"),
        "peers": PEERS,
        "peer_environment": frozen,
        "settings": {
            "rounds": args.rounds,
            "jobs": {
                "timer": args.jobs,
                "pgqueuer": args.jobs,
                "apscheduler": args.apscheduler_jobs,
            },
            "batch": BATCH,
            "steady_rate_per_s": args.rate,
            "steady_seconds": args.seconds,
            "postgres": POSTGRES,
            "sqlite": "WAL, synchronous=NORMAL (Timer's default; set on APScheduler's engine too)",
        },
        "systems": {name: median_round(r) for name, r in rounds.items()},
        "rounds": rounds,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    progress(f"wrote {args.output} in {document['seconds']} s")
    print(json.dumps(document["systems"], indent=1))
    return 0


def _peer(python: Path, arguments: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), str(PEERS_SCRIPT), *arguments], capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"{arguments[0]} failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    sys.exit(main())
