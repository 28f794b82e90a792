"""Scenario 3: the database is locked by another process, then its disk is full. Commands are
not acked while they cannot be stored and are stored once it recovers; the worker backs off
and recovers; the service stays up and does not spin."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attrs
import psutil
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from tests.chaos.conftest import ServiceFactory
from tests.chaos.rig import (
    AckLog,
    ChaosService,
    at_least,
    count_messages,
    db_rows,
    duplicates,
    read_events,
    report,
    service_backlog,
    wait_until,
    write_lock,
)
from tests.timer_service.process import http_get
from timer_adapters_nats import TimerClient
from timer_adapters_nats.embedded import NatsServerProcess
from timer_core.codec import encode_envelope

pytestmark = pytest.mark.chaos

LOCKED_S = 11.0
"""Longer than two of SQLite's 5 s busy timeouts: a command batch and the worker's mark
queued behind it both give up waiting, rather than only wait."""
FULL_S = 6.0
COMMANDS = 40
TIMERS_DUE = 40
#: The most CPU the service may use while the database is in trouble (in cores).
MAX_CPU = 0.5
#: The most failed worker passes per episode: the backoff doubles from 50 ms.
MAX_FAILED_PASSES = 15


@attrs.define
class Trouble:
    """What one episode of database trouble did to the service."""

    name: str
    seconds: float
    commands: dict[int, tuple[str, str]] = attrs.field(factory=dict)
    """Commands sent during the trouble: stream sequence -> timer key."""
    due: dict[tuple[str, str], datetime] = attrs.field(factory=dict)
    """Timers stored before the trouble and due during it."""
    cpu: float = 0.0
    """CPU seconds per wall second the service used during the trouble."""
    worker_errors: float = 0.0
    acked_during: int = 0
    stored_during: int = 0
    recovered_s: float = 0.0
    redelivered: int = 0


async def schedule_due_during(
    client: TimerClient, js: JetStreamContext, trouble: Trouble, starts_in: float
) -> None:
    """Store timers that come due while the trouble lasts, before it starts."""
    now = datetime.now(UTC)
    for index in range(TIMERS_DUE):
        at = now + timedelta(seconds=starts_in + (trouble.seconds - 1) * index / TIMERS_DUE)
        trouble.due[(f"{trouble.name}-due", f"call-{index}")] = at
    envelopes = [client.schedule_envelope(*key, at) for key, at in trouble.due.items()]
    assert await client.send_many(envelopes) == [None] * TIMERS_DUE

    async def all_acked() -> bool:
        return (await service_backlog(js)).settled

    await wait_until(all_acked, within=30, what="the timers to be stored")


async def during_trouble(
    service: ChaosService,
    client: TimerClient,
    js: JetStreamContext,
    acks: AckLog,
    trouble: Trouble,
    db: Path,
) -> None:
    """Send commands while the database is in trouble; measure CPU; check nothing is acked."""
    cpu_before, errors_before = service.cpu_seconds(), service.metric("timer_worker_errors_total")
    started = time.monotonic()
    for index in range(COMMANDS):
        key = (trouble.name, f"call-{index}")
        envelope = client.schedule_envelope(*key, datetime.now(UTC) + timedelta(hours=1))
        ack = await js.publish(
            client.subjects.commands(envelope.tenant_id),
            encode_envelope(envelope),
            headers={"Nats-Msg-Id": str(envelope.id)},
        )
        trouble.commands[ack.seq] = key
    while time.monotonic() - started < trouble.seconds:
        assert service.running, service.log()
        await asyncio.sleep(0.1)
    trouble.cpu = (service.cpu_seconds() - cpu_before) / (time.monotonic() - started)
    trouble.worker_errors = service.metric("timer_worker_errors_total") - errors_before
    trouble.acked_during = sum(acks.first(seq) is not None for seq in trouble.commands)
    stored = {(r["tenant_id"], r["service_call_id"]) for r in db_rows(db)}
    trouble.stored_during = len(stored & set(trouble.commands.values()))


async def recovered(
    service: ChaosService, js: JetStreamContext, acks: AckLog, trouble: Trouble, db: Path
) -> None:
    """Wait until every command of the trouble is stored and acked and every timer fired."""
    started = time.monotonic()

    def stored() -> bool:
        rows = {(r["tenant_id"], r["service_call_id"]): r["state"] for r in db_rows(db)}
        return all(key in rows for key in trouble.commands.values()) and all(
            rows.get(key) == "Reached" for key in trouble.due
        )

    await wait_until(
        lambda: stored() and all(acks.first(seq) for seq in trouble.commands),
        within=60,
        what=f"recovery from {trouble.name}",
    )
    trouble.recovered_s = time.monotonic() - started
    assert http_get(service.http_port, "/healthz")[0] == 200
    # Those the service had fetched during the trouble were handed back (nak) and delivered
    # again; the rest waited in the stream.
    trouble.redelivered = sum(
        max(delivered for _, _, delivered in acks.settled[seq]) > 1 for seq in trouble.commands
    )
    assert trouble.redelivered == sum("nak" in acks.kinds(seq) for seq in trouble.commands) > 0


class TestDatabaseTrouble:
    async def test_locked_then_full_database_delays_but_loses_nothing(
        self,
        tmp_path: Path,
        make_service: ServiceFactory,
        broker: NatsServerProcess,
        nc: Client,
        js: JetStreamContext,
    ) -> None:
        """Commands sent while another process holds the write lock, and while the disk is
        full, are acked only once stored; timers due meanwhile fire afterwards; the service
        stays up, backs off and uses well under a core."""
        db = tmp_path / "timer.db"
        service = make_service(TIMER_POLLING_INTERVAL=500)
        service.start()
        await asyncio.to_thread(service.wait_healthy, 60)
        acks = await AckLog().start(nc)
        locked, full = Trouble("locked", LOCKED_S), Trouble("full", FULL_S)
        async with TimerClient.connect(broker.url) as client:
            # Another process holds the database's write lock.
            await schedule_due_during(client, js, locked, starts_in=1.0)
            async with write_lock(db) as release:
                await during_trouble(service, client, js, acks, locked, db)
                await release()
            await recovered(service, js, acks, locked, db)

            # The disk is full: every write the service makes to a file fails. It is put on
            # the running process from outside as a file-size limit of one byte (SQLite gets
            # EFBIG where a full disk gives ENOSPC). PRAGMA max_page_count would not do: it
            # is a setting of the connection that sets it, so another connection setting it
            # never limits the service's own.
            await schedule_due_during(client, js, full, starts_in=1.0)
            process = psutil.Process(service.pid)
            limit = process.rlimit(psutil.RLIMIT_FSIZE)
            process.rlimit(psutil.RLIMIT_FSIZE, (1, limit[1]))
            try:
                await during_trouble(service, client, js, acks, full, db)
            finally:
                process.rlimit(psutil.RLIMIT_FSIZE, limit)
            await recovered(service, js, acks, full, db)

        await wait_until(
            lambda: at_least(count_messages(js, "TIMER_EVENTS"), 2 * TIMERS_DUE),
            within=30,
            what="every event",
        )
        events = await read_events(js)
        dups = duplicates(events)
        assert dups == 0
        assert {e.key for e in events} == set(locked.due) | set(full.due)
        assert all(e.reached_at >= e.due_at for e in events)
        await acks.stop()
        for trouble in (locked, full):
            assert trouble.acked_during == 0, trouble
            assert trouble.stored_during == 0, trouble
            assert trouble.cpu < MAX_CPU, trouble
            # Backing off: a handful of failed passes per episode, not a loop of them.
            assert trouble.worker_errors <= MAX_FAILED_PASSES, trouble
        failed_passes = service.count_lines("worker pass failed")
        assert service.terminate() == 0
        report(
            "database-trouble",
            locked_s=LOCKED_S,
            full_s=FULL_S,
            commands_per_episode=COMMANDS,
            timers_due_per_episode=TIMERS_DUE,
            locked_cpu_cores=round(locked.cpu, 3),
            locked_worker_errors=int(locked.worker_errors),
            locked_recovered_s=round(locked.recovered_s, 1),
            locked_redelivered=locked.redelivered,
            full_cpu_cores=round(full.cpu, 3),
            full_worker_errors=int(full.worker_errors),
            full_recovered_s=round(full.recovered_s, 1),
            full_redelivered=full.redelivered,
            failed_passes_logged=failed_passes,
            acked_while_unstorable=locked.acked_during + full.acked_during,
            duplicates=dups,
            peak_rss_mb=service.watch.peak_rss_mb,
        )
