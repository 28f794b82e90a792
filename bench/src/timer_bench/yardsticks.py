"""The hand-written SQLite yardsticks: Timer's work done by plain ``sqlite3`` and nats-py, with
none of Timer's code, measured in the same rounds as what they measure."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import nats

from timer_bench.kit import now_ms, rate, stamp
from timer_bench.procs import CONSUMER
from timer_bench.sqlite import FIND_DUE, MARK_REACHED, UPSERT, Row, connect


def upserts(db: Path, rows: list[Row], batch: int) -> float:
    """``rows`` upserted ``batch`` per transaction (``executemany``); upserts/s."""
    connection = connect(db)
    try:
        started = time.perf_counter()
        for start in range(0, len(rows), batch):
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(UPSERT, rows[start : start + batch])
            connection.execute("COMMIT")
        return rate(len(rows), time.perf_counter() - started)
    finally:
        connection.close()


def due_event(
    tenant: str, call: str, correlation: str | None, due: str, now: str
) -> tuple[str, bytes, dict[str, str]]:
    """A ``DueTimeReached`` as the wire contract has it, built by hand: subject, body, headers."""
    firing = f"{tenant}.{call}.{due}"
    body = {
        "id": firing,
        "type": "DueTimeReached",
        "tenantId": tenant,
        "aggregateId": call,
        "timestampMs": now_ms(),
        "correlationId": correlation,
        "payload": {
            "_tag": "DueTimeReached",
            "tenantId": tenant,
            "serviceCallId": call,
            "dueAt": due,
            "reachedAt": now,
        },
    }
    encoded = json.dumps(body, separators=(",", ":")).encode()
    return f"timer.events.{tenant}.{call}", encoded, {"Nats-Msg-Id": firing}


async def fire_pipeline(db: Path, url: str, batch: int) -> tuple[float, int]:
    """Select ``batch`` due -> ``publish_async`` each, gather the acks -> mark them, one
    transaction, until none is due. Timers/s and how many were fired."""
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10)
    connection = connect(db)
    fired = 0
    try:
        started = time.perf_counter()
        while True:
            now = stamp(now_ms())
            rows = connection.execute(FIND_DUE, (now, batch)).fetchall()
            if not rows:
                break
            acks = []
            for tenant, call, correlation, due in rows:
                subject, body, headers = due_event(tenant, call, correlation, due, now)
                acks.append(await js.publish_async(subject, body, headers=headers))
            await asyncio.gather(*acks)
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(MARK_REACHED, [(now, t, c, d) for t, c, _, d in rows])
            connection.execute("COMMIT")
            fired += len(rows)
        return rate(fired, time.perf_counter() - started), fired
    finally:
        connection.close()
        await nc.close()


async def schedule_pipeline(db: Path, url: str, count: int, batch: int) -> tuple[float, int]:
    """Pull ``fetch(batch)`` on the service's durable consumer -> ``json.loads`` (no
    validation) -> one transaction of upserts -> ack each, until ``count`` are stored.
    Commands/s and how many were stored."""
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10)
    subscription = await js.pull_subscribe_bind(CONSUMER, "TIMER_COMMANDS")
    connection = connect(db)
    stored = 0
    deadline = time.monotonic() + 60 + count / 500
    try:
        started = time.perf_counter()
        while stored < count and time.monotonic() < deadline:
            try:
                messages = await subscription.fetch(batch, timeout=1)
            except TimeoutError:
                continue
            registered = stamp(now_ms())
            rows = []
            for message in messages:
                body = json.loads(message.data)
                payload = body["payload"]
                rows.append(
                    (
                        payload["tenantId"],
                        payload["serviceCallId"],
                        body.get("correlationId"),
                        payload["dueAt"],
                        registered,
                    )
                )
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany(UPSERT, rows)
            connection.execute("COMMIT")
            for message in messages:
                await message.ack()
            stored += len(messages)
        await nc.flush()
        return rate(stored, time.perf_counter() - started), stored
    finally:
        connection.close()
        await subscription.unsubscribe()
        await nc.close()
