"""Scenario 1: the service is SIGKILLed at random moments and restarted, again and again, while a
driver schedules and cancels thousands of timers; nothing acked is lost, nothing fires early,
no cancel the service acked before the due time is undone, and nothing is published twice."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from tests.chaos.conftest import ServiceFactory
from tests.chaos.rig import (
    AckLog,
    ChaosService,
    Event,
    at_least,
    count_messages,
    db_rows,
    duplicates,
    read_events,
    read_stream,
    report,
    service_backlog,
    wait_until,
    write_lock,
)
from timer_adapters_nats import TimerClient
from timer_adapters_nats.embedded import NatsServerProcess
from timer_core import MessageEnvelope
from timer_core.codec import encode_envelope
from timer_core.instants import ceil_ms
from timer_service.settings import Settings

pytestmark = pytest.mark.chaos

TENANTS = 12
KILLS = 10
#: Timers scheduled per driver tick (one tick every TICK_S while the kills go on).
PER_TICK = 12
TICK_S = 0.1
#: A cancel counts as binding only when the service had acked it this long before the due
#: time; a cancel still in flight at the due time may legitimately lose to the firing.
CANCEL_MARGIN = timedelta(milliseconds=100)
#: The service's default ack wait: how long after its death a killed instance's commands
#: come back.
ACK_WAIT_S = Settings().ack_wait_s
#: What storing a fetched batch and firing a due timer may take on a busy machine, on top
#: of the mechanism's own delays (redelivery after the ack wait, the restart).
SLACK_S = 2.0


@attrs.define
class Plan:
    """What the driver sent and JetStream acknowledged."""

    due: dict[tuple[str, str], datetime] = attrs.field(factory=dict)
    """Every acked ScheduleTimer: key -> due time."""
    cancels: dict[tuple[str, str], int] = attrs.field(factory=dict)
    """Every acked CancelTimer: key -> its stream sequence in TIMER_COMMANDS."""
    unacked: int = 0


async def drive(
    client: TimerClient, js: JetStreamContext, plan: Plan, stop: asyncio.Event, rng: random.Random
) -> None:
    """Schedule PER_TICK timers every tick across tenants, and cancel about one in eight."""
    tick = 0
    while not stop.is_set():
        now = datetime.now(UTC)
        batch = []
        for n in range(PER_TICK):
            key = (f"tenant-{rng.randrange(TENANTS)}", f"call-{tick}-{n}")
            # A quarter already due, the rest over the next seconds. Those to be cancelled
            # are due later, so that their cancel has a chance to be applied in time.
            cancel = rng.random() < 0.125
            offset = rng.uniform(3.0, 8.0) if cancel else rng.uniform(-2.0, 6.0)
            batch.append((key, now + timedelta(seconds=offset), cancel))
        envelopes = [client.schedule_envelope(*key, due) for key, due, _ in batch]
        results = await client.send_many(envelopes)
        to_cancel = []
        for (key, due, cancel), error in zip(batch, results, strict=True):
            if error is not None:
                plan.unacked += 1
                continue
            plan.due[key] = ceil_ms(due)  # as the command carries it
            if cancel:
                to_cancel.append(key)
        for key in to_cancel:
            plan.cancels[key] = await send(js, client, client.cancel_envelope(*key))
        tick += 1
        await asyncio.sleep(TICK_S)


async def send(js: JetStreamContext, client: TimerClient, envelope: MessageEnvelope[Any]) -> int:
    """Publish one command as TimerClient would; returns its sequence in TIMER_COMMANDS."""
    ack = await js.publish(
        client.subjects.commands(envelope.tenant_id),
        encode_envelope(envelope),
        headers={"Nats-Msg-Id": str(envelope.id)},
    )
    return int(ack.seq)


async def crash_repeatedly(service: ChaosService, rng: random.Random, kills: int) -> list[str]:
    """Kill the service ``kills`` times at random moments, restarting it after each."""
    moments = []
    for _ in range(kills):
        if rng.random() < 0.25:
            # While it starts: opening the database, provisioning, the first passes.
            delay = rng.uniform(0.5, 4.0)
            moments.append(f"start+{delay:.1f}s")
        else:
            await asyncio.to_thread(service.wait_healthy, 60)
            delay = rng.uniform(0.05, 1.5)
            moments.append(f"healthy+{delay:.1f}s")
        await asyncio.sleep(delay)
        service.kill()
        service.start()
    return moments


async def history(
    js: JetStreamContext,
    acks: AckLog,
    keys: list[tuple[str, str]],
    plan: Plan,
    events: list[Event],
) -> str:
    """What happened to these timers' commands and events, for a failure message."""
    lines = []
    commands = await read_stream(js, "TIMER_COMMANDS")
    for key in keys:
        lines.append(f"{key} due {plan.due[key].isoformat()}:")
        for msg in commands:
            payload = json.loads(msg.data)["payload"]
            if (payload["tenantId"], payload["serviceCallId"]) == key:
                seq = msg.metadata.sequence.stream
                settled = [
                    f"{kind}@{at.time().isoformat()}#{delivered}"
                    for kind, at, delivered in acks.settled.get(seq, [])
                ]
                lines.append(f"  seq {seq} {payload['_tag']}: {settled}")
        for event in events:
            if event.key == key:
                lines.append(f"  event reachedAt {event.reached_at.time().isoformat()}")
    return "\n".join(lines)


class TestCrashes:
    async def test_nothing_acked_is_lost_nothing_fires_early_or_twice(
        self,
        tmp_path: Path,
        make_service: ServiceFactory,
        broker: NatsServerProcess,
        nc: Client,
        js: JetStreamContext,
    ) -> None:
        """Through repeated SIGKILLs every acked timer fires once, never early, and no cancel
        acked before the due time is lost."""
        seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 10**6))
        # Kills and commands from two generators, so a seed replays both (CHAOS_SEED=...).
        kill_rng, driver_rng = random.Random(seed), random.Random(seed + 1)
        service = make_service(TIMER_POLLING_INTERVAL=500)
        service.start()
        await asyncio.to_thread(service.wait_healthy, 60)

        plan, acks = Plan(), await AckLog().start(nc)
        stop_driver = asyncio.Event()
        started = time.monotonic()
        async with TimerClient.connect(broker.url) as client:
            driver = asyncio.create_task(drive(client, js, plan, stop_driver, driver_rng))
            try:
                moments = await crash_repeatedly(service, kill_rng, KILLS - 1)
                # The last crash comes after the driver stopped, so the commands the final
                # run needs are not held for a whole ack wait by a dead predecessor.
                stop_driver.set()
                await driver
                moments += await crash_repeatedly(service, kill_rng, 1)
                restarted_at = datetime.now(UTC)
                await asyncio.to_thread(service.wait_healthy, 60)
                ready_s = (datetime.now(UTC) - restarted_at).total_seconds()
                kill_phase_s = time.monotonic() - started

                async def all_acked() -> bool:
                    return (await service_backlog(js)).settled

                # In-flight commands of a killed instance come back after the ack wait.
                await wait_until(all_acked, within=90, what="every command to be acked")
            finally:
                stop_driver.set()
                await asyncio.gather(driver, return_exceptions=True)
                await acks.stop()

        cancelled = set(plan.cancels)
        expected = set(plan.due) - cancelled
        last_due = max(plan.due.values())

        async def all_fired() -> bool:
            if datetime.now(UTC) <= last_due or await count_messages(js, "TIMER_EVENTS") < len(
                expected
            ):
                return False
            return expected <= {event.key for event in await read_events(js)}

        await wait_until(all_fired, within=60, interval=0.5, what="every timer to fire")
        # One more pass after the last due time, so a timer wrongly left Scheduled would fire.
        polls = service.metric("timer_polling_duration_seconds_count")
        await wait_until(
            lambda: service.metric("timer_polling_duration_seconds_count") >= polls + 2,
            within=10,
            what="two more polls",
        )
        drain_s = time.monotonic() - started - kill_phase_s
        events = await read_events(js)

        per_key = Counter(event.key for event in events)
        missing = expected - set(per_key)
        assert not missing, f"{len(missing)} acked timers never fired, e.g. {sorted(missing)[:5]}"
        early = [e for e in events if e.reached_at < e.due_at or e.stored_at < e.due_at]
        assert not early, f"{len(early)} fired early, e.g. {early[:3]}"
        wrong_due = [e for e in events if e.due_at != plan.due.get(e.key, e.due_at)]
        assert not wrong_due, wrong_due[:3]

        binding = {
            key
            for key, seq in plan.cancels.items()
            if (acked := acks.first(seq)) is not None and acked <= plan.due[key] - CANCEL_MARGIN
        }
        fired_despite_cancel = sorted(binding & set(per_key))
        assert not fired_despite_cancel, (
            f"{len(fired_despite_cancel)} timers fired although their cancel was acked before "
            f"they were due: " + await history(js, acks, fired_despite_cancel[:3], plan, events)
        )
        duplicates = sum(count - 1 for count in per_key.values())
        assert duplicates == 0, [key for key, count in per_key.items() if count > 1][:5]

        # The database agrees: every Reached timer has its event, none of the expected ones is
        # left Scheduled, and an event without a Reached row is one whose cancel came between
        # its publish and its mark (the race a cancel may lose).
        rows = await asyncio.to_thread(db_rows, tmp_path / "timer.db")
        state = {(r["tenant_id"], r["service_call_id"]): r["state"] for r in rows}
        reached = {key for key, value in state.items() if value == "Reached"}
        assert reached <= set(per_key)
        assert all(state.get(key) == "Reached" for key in expected)
        cancel_won_after_publish = set(per_key) - reached
        assert cancel_won_after_publish <= cancelled - binding
        assert service.terminate() == 0
        redelivered = sum(
            max(delivered for _, _, delivered in settled) > 1 for settled in acks.settled.values()
        )
        lateness = max((e.reached_at - e.due_at).total_seconds() for e in events)
        # Timers due after the last restart wait at most for the commands the dead instance
        # held (the ack wait) and for the restart itself.
        after_restart = [
            (e.reached_at - e.due_at).total_seconds() for e in events if e.due_at >= restarted_at
        ]
        late_after_restart = max(after_restart, default=0.0)
        assert late_after_restart <= ready_s + ACK_WAIT_S + SLACK_S, (
            f"timers due after the last restart fired up to {late_after_restart:.1f}s late "
            f"(the restart took {ready_s:.1f}s, the ack wait is {ACK_WAIT_S}s)"
        )
        report(
            "crash",
            seed=seed,
            timers=len(plan.due),
            cancels=len(plan.cancels),
            binding_cancels=len(binding),
            cancelled_fired_anyway=len(cancelled & set(per_key)),
            cancelled_after_publish=len(cancel_won_after_publish),
            unacked_sends=plan.unacked,
            kills=service.kills,
            starts=service.starts,
            kill_moments=",".join(moments),
            events=len(events),
            duplicates=duplicates,
            early=len(early),
            missing=len(missing),
            redelivered_commands=redelivered,
            starts_waiting_for_a_dead_instance=service.count_lines("are unsettled"),
            max_lateness_s=round(lateness, 1),
            due_after_last_restart=len(after_restart),
            max_lateness_due_after_last_restart_s=round(late_after_restart, 1),
            last_restart_ready_s=round(ready_s, 1),
            kill_phase_s=round(kill_phase_s, 1),
            time_to_drain_s=round(drain_s, 1),
            peak_rss_mb=service.watch.peak_rss_mb,
        )


class TestCrashMidBatch:
    async def test_a_cancel_is_not_undone_by_the_schedule_a_dead_instance_held(
        self,
        tmp_path: Path,
        make_service: ServiceFactory,
        broker: NatsServerProcess,
        nc: Client,
        js: JetStreamContext,
    ) -> None:
        """A ScheduleTimer delivered to an instance that dies before acking it comes back
        only after the ack wait; the CancelTimer sent after it must still win."""
        service = make_service(TIMER_POLLING_INTERVAL=500)
        service.start()
        await asyncio.to_thread(service.wait_healthy, 60)
        acks = await AckLog().start(nc)
        key = ("tenant-a", "call-1")

        async def consumer() -> tuple[int, int]:
            backlog = await service_backlog(js)
            return backlog.pending, backlog.in_hand

        # The schedule reaches the service, which cannot store it (another process holds the
        # write lock) and dies with it in hand.
        async with (
            write_lock(tmp_path / "timer.db") as release,
            TimerClient.connect(broker.url) as client,
        ):
            # Due well after both commands are settled: only their order decides.
            due = datetime.now(UTC) + timedelta(minutes=5)
            schedule_seq = await send(js, client, client.schedule_envelope(*key, due))
            await wait_until(
                lambda: _equals(consumer(), (0, 1)), within=10, what="the schedule in hand"
            )
            service.kill()
            await release()
            cancel_seq = await send(js, client, client.cancel_envelope(*key))

        started = time.monotonic()
        service.start()
        await asyncio.to_thread(service.wait_healthy, 60)
        await wait_until(
            lambda: acks.first(schedule_seq) is not None and acks.first(cancel_seq) is not None,
            within=90,
            what="both commands to be acked",
        )
        settled_s = time.monotonic() - started
        await acks.stop()
        # Had the schedule come after the cancel, the timer would be stored now, to fire.
        rows = await asyncio.to_thread(db_rows, tmp_path / "timer.db")
        schedule_acked, cancel_acked = acks.first(schedule_seq), acks.first(cancel_seq)
        assert schedule_acked is not None and cancel_acked is not None
        assert rows == [], rows
        assert schedule_acked <= cancel_acked
        assert service.terminate() == 0
        report(
            "crash-mid-batch",
            schedule_deliveries=max(d for _, _, d in acks.settled[schedule_seq]),
            cancel_deliveries=max(d for _, _, d in acks.settled[cancel_seq]),
            both_acked_after_restart_s=round(settled_s, 1),
        )


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


class TestRecoveryAfterKill:
    async def test_commands_held_by_a_killed_instance_are_reapplied_within_the_ack_wait(
        self,
        tmp_path: Path,
        make_service: ServiceFactory,
        broker: NatsServerProcess,
        nc: Client,
        js: JetStreamContext,
    ) -> None:
        """SIGKILLed with 200 commands in hand and restarted at once, the service re-applies
        them about one ack wait after the kill, and timers due after the restart (theirs and
        one scheduled just after it) fire on time once their command is applied."""
        service = make_service(TIMER_POLLING_INTERVAL=500)
        service.start()
        await asyncio.to_thread(service.wait_healthy, 60)
        acks = await AckLog().start(nc)
        sent: dict[tuple[str, str], int] = {}
        due: dict[tuple[str, str], datetime] = {}

        async def in_hand() -> int:
            return (await service_backlog(js)).in_hand

        async with (
            write_lock(tmp_path / "timer.db") as release,
            TimerClient.connect(broker.url) as client,
        ):
            # 200 commands reach the service, which cannot store them (another process holds
            # the write lock): a batch in the handler, the next read ahead, the rest queued.
            soon = datetime.now(UTC) + timedelta(seconds=6)
            envelopes = []
            for n in range(200):
                key = (f"tenant-{n % 4}", f"held-{n}")
                due[key] = ceil_ms(soon + timedelta(milliseconds=10 * n))
                envelopes.append(client.schedule_envelope(*key, due[key]))
            assert await client.send_many(envelopes) == [None] * len(envelopes)
            await wait_until(
                lambda: at_least(in_hand(), 100), within=10, what="commands in the service's hand"
            )
            delivered = (await service_backlog(js)).delivered
            for msg in await read_stream(js, "TIMER_COMMANDS"):
                payload = json.loads(msg.data)["payload"]
                sent[(payload["tenantId"], payload["serviceCallId"])] = msg.metadata.sequence.stream
            held = {
                key: seq
                for key, seq in sent.items()
                if seq <= delivered.get(f"timer.commands.{key[0]}", 0)
            }
            killed_at = datetime.now(UTC)
            service.kill()
            await release()
            service.start()
            restarted_at = datetime.now(UTC)
            # Scheduled just after the restart, due 2 s later, by a tenant of the held ones.
            fresh: dict[tuple[str, str], int] = {}
            for n in range(5):
                key = (f"tenant-{n % 4}", f"fresh-{n}")
                due[key] = ceil_ms(restarted_at + timedelta(seconds=2, milliseconds=100 * n))
                fresh[key] = await send(js, client, client.schedule_envelope(*key, due[key]))
        await asyncio.to_thread(service.wait_healthy, 60)
        ready_s = (datetime.now(UTC) - restarted_at).total_seconds()
        every = {**sent, **fresh}
        await wait_until(
            lambda: all(acks.first(seq) is not None for seq in every.values()),
            within=60,
            what="every command acked",
        )
        await wait_until(
            lambda: at_least(count_messages(js, "TIMER_EVENTS"), len(due)),
            within=60,
            what="every timer fired",
        )
        await acks.stop()
        events = await read_events(js)
        assert service.terminate() == 0

        def acked_after(seqs: Iterable[int], moment: datetime) -> float:
            return max((acks.first(seq) or moment) - moment for seq in seqs).total_seconds()

        assert {event.key for event in events} == set(due)
        assert duplicates(events) == 0
        assert all(e.reached_at >= e.due_at for e in events)
        held_acked_s = acked_after(held.values(), killed_at)
        queued_acked_s = acked_after(sent.values(), restarted_at)
        fresh_acked_s = acked_after(fresh.values(), restarted_at)
        # Held commands come back one ack wait after the kill (or once the restarted instance
        # is up, if that is later); later commands are held back until then, not longer.
        assert held_acked_s <= max(ACK_WAIT_S, ready_s) + SLACK_S
        assert queued_acked_s <= max(ACK_WAIT_S, ready_s) + SLACK_S
        assert fresh_acked_s <= max(ACK_WAIT_S, ready_s) + SLACK_S
        # A timer fires as soon as it is due and its command applied.
        applied = {key: acks.first(seq) for key, seq in every.items()}
        late = {
            e.key: (e.reached_at - max(e.due_at, applied[e.key] or e.due_at)).total_seconds()
            for e in events
        }
        assert max(late.values()) <= SLACK_S, sorted(late.items(), key=lambda kv: -kv[1])[:3]
        lateness = [(e.reached_at - e.due_at).total_seconds() for e in events]
        report(
            "recovery-after-kill",
            ack_wait_s=ACK_WAIT_S,
            commands=len(sent),
            held_commands=len(held),
            restart_ready_s=round(ready_s, 1),
            held_acked_after_kill_s=round(held_acked_s, 1),
            held_acked_after_restart_s=round(acked_after(held.values(), restarted_at), 1),
            all_acked_after_restart_s=round(queued_acked_s, 1),
            fresh_acked_after_restart_s=round(fresh_acked_s, 1),
            max_lateness_s=round(max(lateness), 1),
            fresh_max_lateness_s=round(
                max(lateness[i] for i, e in enumerate(events) if e.key in fresh), 1
            ),
            starts_waiting_for_a_dead_instance=service.count_lines("are unsettled"),
        )
