"""Dead letters as operators handle them: ``timer-service dlq list`` and ``dlq replay``.

One real service and nats-server for the module, the CLI as a subprocess the way an operator
runs it; each test works on its own tenants, so the tests do not depend on each other.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import nats
import pytest

from tests.timer_service.process import ServiceProcess, free_port
from timer_adapters_nats import DeadLetter, DeadLetters, NatsConnection, NatsSettings
from timer_adapters_nats.embedded import NatsServerProcess
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import TenantId, TimerEntry


def command(tenant: str, call: str, due: str, **extra: str) -> str:
    """A ScheduleTimer envelope as JSON text, ``due`` written as given."""
    envelope: dict[str, Any] = {
        "id": "0190b6a4-7e4e-7b3c-9a51-3f1e2d4c5b6a",
        "type": "ScheduleTimer",
        "tenantId": tenant,
        "timestampMs": 1,
        **extra,
        "payload": {
            "_tag": "ScheduleTimer",
            "tenantId": tenant,
            "serviceCallId": call,
            "dueAt": due,
        },
    }
    return json.dumps(envelope, separators=(",", ":"))


@attrs.frozen
class Deployment:
    """The running service: its environment, working directory and broker URL."""

    env: dict[str, str]
    cwd: Path
    url: str
    db_path: Path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A nats-server and ``timer-service run`` on it, shared by the module's tests."""
    root = tmp_path_factory.mktemp("dlq")
    server = NatsServerProcess(root / "nats", host="127.0.0.1", port=0)
    server.start()
    service: ServiceProcess | None = None
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env.update(
            TIMER_DB_PATH=str(root / "timer.db"),
            TIMER_BROKER_URL=server.url,
            TIMER_HTTP_PORT=str(free_port()),
            TIMER_POLLING_INTERVAL="1000",
        )
        service = ServiceProcess(env, root, root / "service.log").start()
        service.wait_healthy()
        yield Deployment(env, root, server.url, root / "timer.db")
    finally:
        if service is not None:
            service.kill_group()
        server.stop()


def cli(deployment: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``timer-service ARGS`` against the deployment, to completion."""
    return subprocess.run(
        [sys.executable, "-m", "timer_service.cli", *args],
        env=deployment.env,
        cwd=deployment.cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def acli(deployment: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """:func:`cli` off the event loop."""
    return await asyncio.to_thread(cli, deployment, *args)


async def dlq_json(deployment: Deployment, *extra: str) -> list[dict[str, Any]]:
    """``timer-service dlq list --json EXTRA``, parsed."""
    result = await acli(deployment, "dlq", "list", "--json", *extra)
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


async def publish(url: str, subject: str, data: str, headers: dict[str, str] | None = None) -> None:
    """Publish one raw message to JetStream and wait for its ack, as a producer would."""
    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish(subject, data.encode(), headers=headers)
    finally:
        await nc.close()


async def dead_letters(url: str, tenant: str) -> list[DeadLetter]:
    """The DLQ stream's dead letters of ``tenant`` right now."""
    async with NatsConnection(NatsSettings(url=url)) as connection:
        return await DeadLetters(connection).list(tenant=tenant, limit=1000)


async def until_dead_letters(url: str, tenant: str, count: int) -> list[DeadLetter]:
    """Wait (up to 20 s) until ``tenant`` has ``count`` dead letters; returns them."""
    async with asyncio.timeout(20):
        while len(found := await dead_letters(url, tenant)) != count:
            await asyncio.sleep(0.05)
    return found


async def until_timer(deployment: Deployment, tenant: str) -> list[TimerEntry]:
    """Wait (up to 20 s) until the service's database holds a timer of ``tenant``."""
    store = SqliteTimerStore(deployment.db_path)
    await store.start()
    try:
        async with asyncio.timeout(20):
            while not (found := await store.list_for_tenant(TenantId(tenant))):
                await asyncio.sleep(0.05)
    finally:
        await store.aclose()
    return found


class TestList:
    async def test_lists_each_dead_letter_with_its_reason(self, deployment: Deployment) -> None:
        """`dlq list --json` shows a rejected command's tenant, reason, bytes and time."""
        no_zone = command("list-b", "call-7", "2031-01-01T00:00:00")
        await publish(deployment.url, "timer.commands.list-a", "not json")
        await publish(deployment.url, "timer.commands.list-b", no_zone)
        await until_dead_letters(deployment.url, "list-a", 1)
        await until_dead_letters(deployment.url, "list-b", 1)
        (row_a,) = await dlq_json(deployment, "--tenant", "list-a")
        (row_b,) = await dlq_json(deployment, "--tenant", "list-b")
        assert row_a["subject"] == "timer.dlq.list-a"
        assert row_a["tenant"] == "list-a"
        assert row_a["reason"].startswith("$: not valid JSON")
        assert row_a["data"] == "not json"
        assert row_a["time"]
        assert row_b["reason"] == "payload.dueAt: timestamp '2031-01-01T00:00:00' has no time zone"
        assert row_b["data"] == no_zone
        everything = await dlq_json(deployment, "--limit", "1000")
        seqs = [row["seq"] for row in everything]
        assert seqs == sorted(seqs)
        assert {row_a["seq"], row_b["seq"]} <= set(seqs)

    async def test_unroutable_command_is_listed_under_underscore(
        self, deployment: Deployment
    ) -> None:
        """A command on a subject without a valid tenant token is listed as tenant `_`."""
        before = len(await dead_letters(deployment.url, "_"))
        await publish(deployment.url, "timer.commands.not.a.tenant", "{}")
        await until_dead_letters(deployment.url, "_", before + 1)
        rows = await dlq_json(deployment, "--tenant", "_")
        assert rows[-1]["subject"] == "timer.dlq._"
        assert rows[-1]["reason"].startswith("subject:")

    async def test_limit_and_plain_listing(self, deployment: Deployment) -> None:
        """Without --json one line per dead letter (seq, tenant, reason); --limit caps them."""
        for _ in range(3):
            await publish(deployment.url, "timer.commands.plain", "[]")
        await until_dead_letters(deployment.url, "plain", 3)
        result = await acli(deployment, "dlq", "list", "--tenant", "plain", "--limit", "2")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert len(lines) == 2
        assert all("plain" in line and "expected a JSON object" in line for line in lines)
        assert "2 dead letter(s)" in result.stderr

    async def test_settings_flags_work_after_the_action(self, deployment: Deployment) -> None:
        """--broker-url is accepted after `list` as well as before it."""
        await publish(deployment.url, "timer.commands.flags", "1")
        await until_dead_letters(deployment.url, "flags", 1)
        env = {k: v for k, v in deployment.env.items() if k != "TIMER_BROKER_URL"}
        elsewhere = attrs.evolve(deployment, env=env)
        after = await acli(
            elsewhere, "dlq", "list", "--tenant", "flags", "--broker-url", deployment.url
        )
        before = await acli(
            elsewhere, "dlq", "--broker-url", deployment.url, "list", "--tenant", "flags"
        )
        assert after.returncode == 0, after.stderr
        assert after.stdout == before.stdout
        assert len(after.stdout.splitlines()) == 1


class TestReplay:
    async def test_fixed_command_is_processed_and_leaves_the_dlq(
        self, deployment: Deployment
    ) -> None:
        """Replaying a dead letter with a fixed body stores the timer and removes the letter."""
        await publish(
            deployment.url, "timer.commands.fix", command("fix", "call-7", "2031-01-01T00:00:00")
        )
        (letter,) = await until_dead_letters(deployment.url, "fix", 1)
        fixed = deployment.cwd / "fixed.json"
        fixed.write_text(command("fix", "call-7", "2031-01-01T00:00:00Z"))
        result = await acli(deployment, "dlq", "replay", str(letter.seq), "--data", str(fixed))
        assert result.returncode == 0, result.stderr
        assert f"{letter.seq}  replayed to timer.commands.fix" in result.stdout
        (timer,) = await until_timer(deployment, "fix")
        assert (timer.service_call_id, timer.is_scheduled) == ("call-7", True)
        assert timer.due_at.isoformat() == "2031-01-01T00:00:00+00:00"
        assert await dead_letters(deployment.url, "fix") == []

    async def test_valid_dead_letter_is_replayed_unchanged(self, deployment: Deployment) -> None:
        """A valid command dead-lettered after too many failed deliveries is stored on replay."""
        await publish(
            deployment.url,
            "timer.dlq.valid",
            command("valid", "call-1", "2031-01-01T00:00:00.000Z", correlationId="req-9"),
            {
                "Timer-Error": "not stored after 100 deliveries: StoreUnavailable: disk full",
                "Timer-Original-Subject": "timer.commands.valid",
            },
        )
        (letter,) = await dead_letters(deployment.url, "valid")
        result = await acli(deployment, "dlq", "replay", str(letter.seq))
        assert result.returncode == 0, result.stderr
        (timer,) = await until_timer(deployment, "valid")
        assert (timer.service_call_id, timer.correlation_id) == ("call-1", "req-9")
        assert await dead_letters(deployment.url, "valid") == []

    async def test_unfixed_command_is_dead_lettered_again(self, deployment: Deployment) -> None:
        """Replaying a still-invalid command unchanged lands it back in the DLQ, same reason."""
        await publish(deployment.url, "timer.commands.again", "not json")
        (letter,) = await until_dead_letters(deployment.url, "again", 1)
        result = await acli(deployment, "dlq", "replay", "--all", "--tenant", "again")
        assert result.returncode == 0, result.stderr
        async with asyncio.timeout(20):
            while True:
                found = await dead_letters(deployment.url, "again")
                if found and found[0].seq != letter.seq:
                    break
                await asyncio.sleep(0.05)
        (again,) = found
        assert again.seq > letter.seq
        assert (again.reason, again.data) == (letter.reason, letter.data)

    async def test_fixed_command_still_invalid_is_kept(self, deployment: Deployment) -> None:
        """A --data body that does not decode is not sent; the dead letter stays."""
        await publish(deployment.url, "timer.commands.still", "not json")
        (letter,) = await until_dead_letters(deployment.url, "still", 1)
        broken = deployment.cwd / "broken.json"
        broken.write_text(command("still", "call-1", "tomorrow"))
        result = await acli(deployment, "dlq", "replay", str(letter.seq), "--data", str(broken))
        assert result.returncode == 1
        assert "still invalid: payload.dueAt" in result.stdout
        assert [d.seq for d in await dead_letters(deployment.url, "still")] == [letter.seq]

    async def test_unroutable_dead_letters_are_kept(self, deployment: Deployment) -> None:
        """`replay --all --tenant _` keeps the ones whose tenant is unreadable and exits 1."""
        before = len(await dead_letters(deployment.url, "_"))
        await publish(deployment.url, "timer.commands.bad.subject", "{}")
        await until_dead_letters(deployment.url, "_", before + 1)
        result = await acli(deployment, "dlq", "replay", "--all", "--tenant", "_")
        assert result.returncode == 1
        assert "kept: its tenant is unreadable" in result.stdout
        assert len(await dead_letters(deployment.url, "_")) == before + 1

    async def test_truncated_dead_letter_needs_a_fixed_body(self, deployment: Deployment) -> None:
        """A dead letter cut to fit the DLQ is listed as such and only replayed with --data."""
        await publish(
            deployment.url,
            "timer.dlq.cut",
            '{"id":"01b8d960',
            {
                "Timer-Error": "$: message of 1048576 bytes exceeds 1048576",
                "Timer-Truncated": "1048576",
            },
        )
        (row,) = await dlq_json(deployment, "--tenant", "cut")
        assert row["truncatedFrom"] == 1048576
        result = await acli(deployment, "dlq", "replay", str(row["seq"]))
        assert result.returncode == 1
        assert "replay it with --data" in result.stdout
        assert [d.seq for d in await dead_letters(deployment.url, "cut")] == [row["seq"]]
        fixed = deployment.cwd / "cut.json"
        fixed.write_text(command("cut", "call-1", "2031-01-01T00:00:00Z"))
        result = await acli(deployment, "dlq", "replay", str(row["seq"]), "--data", str(fixed))
        assert result.returncode == 0, result.stdout
        (timer,) = await until_timer(deployment, "cut")
        assert timer.service_call_id == "call-1"

    async def test_unknown_sequence_and_bad_arguments(self, deployment: Deployment) -> None:
        """An unknown sequence is reported (exit 1); --data with two sequences is refused (2)."""
        missing = await acli(deployment, "dlq", "replay", "999999")
        assert missing.returncode == 1
        assert "999999  not found" in missing.stdout
        fixed = deployment.cwd / "two.json"
        fixed.write_text(command("two", "call-1", "2031-01-01T00:00:00Z"))
        two = await acli(deployment, "dlq", "replay", "1", "2", "--data", str(fixed))
        assert two.returncode == 2
        assert "--data" in two.stderr
        nothing = await acli(deployment, "dlq", "replay")
        assert nothing.returncode == 2


class TestBrokerDown:
    def test_unreachable_broker_exits_with_a_one_line_error(self, tmp_path: Path) -> None:
        """With no broker to reach, `dlq list` fails within seconds naming TIMER_BROKER_URL."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env["TIMER_BROKER_URL"] = "nats://127.0.0.1:1"
        result = subprocess.run(
            [sys.executable, "-m", "timer_service.cli", "dlq", "list"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2
        assert result.stderr.startswith("timer-service: TIMER_BROKER_URL=nats://127.0.0.1:1")
        assert len(result.stderr.strip().splitlines()) == 1
