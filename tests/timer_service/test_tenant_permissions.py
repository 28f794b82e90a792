"""The per-tenant account recipe (deploy/nats/tenants.conf, written by ``timer-service
nats-config``, shown in docs/security.md) on a real ``nats-server`` with the real service:
a hostile tenant tries every attack of issue 33, direct, through reply subjects and over
HTTP; each is refused or without effect, and both tenants' timers still flow."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from nats.js.api import ConsumerConfig

from tests.secure_nats import DEPLOY_NATS
from tests.timer_service.process import http_get
from tests.timer_service.tenant_rig import REFUSED_WAIT_S, TenantDeployment, connected, running
from timer_adapters_nats import DueEventConsumerSettings, NatsBroker, TimerClient
from timer_core import PublishError
from timer_core.codec import encode_envelope
from timer_service.tenancy import nats_config

RECIPE = DEPLOY_NATS / "tenants.conf"
TENANTS = ("tenant-a", "tenant-b")
PASSWORDS = {
    "timer-service": "service-pw-1",
    "tenant-a": "tenant-a-pw-2",
    "tenant-b": "tenant-b-pw-3",
}
HTTP_TOKEN = "http-token-for-the-attack-tests"
VIOLATION = "permissions violation"
# Tenants read their own consumer, which the service made (TIMER_TENANTS).
READ_ONLY = DueEventConsumerSettings(provision=False)


class Deployment(TenantDeployment):
    """The recipe's server and the service logged in as its user."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, RECIPE, TENANTS, PASSWORDS, {"TIMER_HTTP_TOKEN": HTTP_TOKEN})


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from running(Deployment(tmp_path_factory.mktemp("tenants")))


async def next_event_ids(broker: NatsBroker, user: str, count: int) -> list[str]:
    """The service call ids of the next ``count`` events the tenant's own consumer reads."""
    seen: list[str] = []
    async with broker.due_events(user, tenant_id=user, settings=READ_ONLY) as events:
        async for delivery in events:
            async with delivery:
                seen.append(delivery.event.service_call_id)
            if len(seen) == count:
                break
    return seen


async def each_tenant_round_trips(deployment: Deployment, name: str) -> None:
    """Each tenant schedules ``<name>-<tenant>`` due now and reads its DueTimeReached."""
    due = datetime.now(UTC) + timedelta(milliseconds=200)
    for user in TENANTS:
        async with connected(deployment, user) as broker:
            await TimerClient(broker).schedule(user, f"{name}-{user}", due)
            ids = await asyncio.wait_for(next_event_ids(broker, user, 1), 30)
            assert ids == [f"{name}-{user}"]


def violations(caplog: pytest.LogCaptureFixture, subject: str) -> list[str]:
    """The client's log lines reporting the server's refusal of ``subject`` (quoted).

    nats-py lower-cases the server's whole error line, the subject included.
    """
    messages = [record.getMessage().lower() for record in caplog.records]
    return [text for text in messages if VIOLATION in text and subject.lower() in text]


async def wait_for_violations(caplog: pytest.LogCaptureFixture, subjects: list[str]) -> None:
    """Until the server's -ERR for each subject arrived (after the PONG of a flush)."""
    for _ in range(200):
        if all(violations(caplog, f'"{subject}"') for subject in subjects):
            return
        await asyncio.sleep(0.02)
    missing = [s for s in subjects if not violations(caplog, f'"{s}"')]
    raise AssertionError(f"no permissions violation for {missing}:\n{caplog.text}")


async def broker_state(service: NatsBroker) -> dict[str, Any]:
    """What a hostile tenant must not change: when each stream and consumer was created,
    how many dead letters there are, and the events and commands of tenant B."""
    js = service.jetstream
    state: dict[str, Any] = {}
    for stream in ("TIMER_COMMANDS", "TIMER_EVENTS", "TIMER_DLQ"):
        info = await js.stream_info(stream, subjects_filter=">")
        state[stream] = (info.created, info.state.messages, dict(info.state.subjects or {}))
    for stream, consumer in (
        ("TIMER_COMMANDS", "timer-service_tenant-a"),
        ("TIMER_COMMANDS", "timer-service_tenant-b"),
        ("TIMER_EVENTS", "tenant-a"),
        ("TIMER_EVENTS", "tenant-b"),
    ):
        state[consumer] = (await js.consumer_info(stream, consumer)).created
    # B's commands ever stored: those its consumer delivered and those still pending (the
    # stream itself keeps only what waits: stored ones are removed).
    lane = await js.consumer_info("TIMER_COMMANDS", "timer-service_tenant-b")
    state["commands of tenant-b"] = lane.delivered.consumer_seq + (lane.num_pending or 0)
    return state


class TestTheRecipe:
    def test_shipped_file_is_what_the_generator_writes(self) -> None:
        """deploy/nats/tenants.conf is `timer-service nats-config tenant-a tenant-b`, unedited."""
        assert RECIPE.read_text() == nats_config(list(TENANTS))

    async def test_service_serves_both_tenants(self, deployment: Deployment) -> None:
        """Each tenant schedules its own timer and reads its own DueTimeReached."""
        await each_tenant_round_trips(deployment, "own")


class TestDirectAttacks:
    @pytest.mark.parametrize("command", ["schedule", "cancel"])
    async def test_cannot_send_commands_for_another_tenant(
        self, deployment: Deployment, caplog: pytest.LogCaptureFixture, command: str
    ) -> None:
        """Tenant A's command on tenant B's subject is refused by the server, never stored."""
        caplog.set_level(logging.WARNING)
        async with connected(deployment, "tenant-a") as broker:
            client = TimerClient(broker)
            send = (
                client.schedule("tenant-b", "stolen", datetime.now(UTC))
                if command == "schedule"
                else client.cancel("tenant-b", "stolen")
            )
            with pytest.raises(PublishError):
                await send
        assert violations(caplog, '"timer.commands.tenant-b"'), caplog.text
        async with connected(deployment, "timer-service") as service:
            try:
                last = await service.jetstream.get_last_msg(
                    "TIMER_COMMANDS", "timer.commands.tenant-b"
                )
            except nats.js.errors.NotFoundError:  # B's stored commands left the stream
                stored = b""
            else:
                stored = last.data or b""
        assert b"stolen" not in stored

    async def test_cannot_cancel_another_tenants_timer_through_its_own_subject(
        self, deployment: Deployment
    ) -> None:
        """A CancelTimer for B sent on A's own subject is dead-lettered: B's timer still fires."""
        async with connected(deployment, "tenant-b") as b:
            await TimerClient(b).schedule(
                "tenant-b", "kept", datetime.now(UTC) + timedelta(seconds=1)
            )
            async with connected(deployment, "tenant-a") as a:
                forged = TimerClient(a).cancel_envelope("tenant-b", "kept")
                ack = await a.jetstream.publish("timer.commands.tenant-a", encode_envelope(forged))
                assert ack.seq > 0  # stored: A may publish on its own subject
            assert await asyncio.wait_for(next_event_ids(b, "tenant-b", 1), 30) == ["kept"]

    async def test_cannot_subscribe_to_anything_but_its_inbox(
        self, deployment: Deployment, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Subscriptions to B's events, to anything of Timer's or to everything are refused."""
        caplog.set_level(logging.WARNING)
        subjects = ["timer.events.tenant-b.>", "timer.>", "$JS.ACK.>", ">"]
        async with connected(deployment, "tenant-a") as broker:
            for subject in subjects:
                await broker.client.subscribe(subject)
            await broker.client.flush()
            await wait_for_violations(caplog, subjects)

    async def test_inboxes_show_nothing_of_others(self, deployment: Deployment) -> None:
        """A subscription to every inbox A may read sees nothing of B's or the service's
        replies while B schedules and reads a timer (each account has inboxes of its own)."""
        async with connected(deployment, "tenant-a") as a:
            seen: list[str] = []

            async def note(msg: Any) -> None:
                seen.append(msg.subject)

            await a.client.subscribe("_INBOX.>", cb=note)
            await a.client.flush()
            async with connected(deployment, "tenant-b") as b:
                due = datetime.now(UTC) + timedelta(milliseconds=200)
                await TimerClient(b).schedule("tenant-b", "sniffed", due)
                assert await asyncio.wait_for(next_event_ids(b, "tenant-b", 1), 30) == ["sniffed"]
            await a.client.flush()
        assert seen == []

    async def test_cannot_reach_any_jetstream_api(
        self, deployment: Deployment, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Creating, inspecting, pulling from or deleting B's or the service's consumers,
        purging or reading the streams, publishing into B's subjects or to the service's
        inbox: every one is refused by the server."""
        caplog.set_level(logging.WARNING)
        async with connected(deployment, "tenant-a") as broker:
            js = broker.jetstream
            snooping = ConsumerConfig(
                name="tenant-a", durable_name="tenant-a", filter_subject="timer.events.tenant-b.>"
            )
            with pytest.raises(asyncio.TimeoutError):
                await js.add_consumer("TIMER_EVENTS", snooping, timeout=REFUSED_WAIT_S)
            with pytest.raises(asyncio.TimeoutError):
                await js.consumer_info("TIMER_EVENTS", "tenant-b", timeout=REFUSED_WAIT_S)
            with pytest.raises(asyncio.TimeoutError):
                await js.get_msg("TIMER_EVENTS", subject="timer.events.tenant-b.own-tenant-b")
            direct = [
                "$JS.API.CONSUMER.MSG.NEXT.TIMER_EVENTS.tenant-b",
                "$JS.API.CONSUMER.DELETE.TIMER_COMMANDS.timer-service_tenant-b",
                "$JS.API.CONSUMER.DELETE.TIMER_EVENTS.tenant-b",
                "$JS.API.STREAM.PURGE.TIMER_DLQ",
                "$JS.ACK.TIMER_EVENTS.tenant-b.1.1.1.1.0",
                "timer.events.tenant-b.injected",
                "timer.dlq.tenant-b",
                "_INBOX.timer-service.forged",
            ]
            for subject in direct:
                await broker.client.publish(subject, b"{}")
            await broker.client.flush()
            await wait_for_violations(
                caplog,
                [
                    "$JS.API.CONSUMER.CREATE.TIMER_EVENTS.tenant-a.timer.events.tenant-b.>",
                    "$JS.API.CONSUMER.INFO.TIMER_EVENTS.tenant-b",
                    "$JS.API.STREAM.MSG.GET.TIMER_EVENTS",
                    *direct,
                ],
            )


class TestReplySubjectAttacks:
    async def test_replies_never_reach_the_service_or_another_tenant(
        self, deployment: Deployment, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Requests on each subject A may use, with reply subjects naming JetStream API calls
        (consumer delete, stream purge, stream delete) and B's events, dead letters and
        commands, change nothing: every stream and consumer is the same one as before, with
        the same messages, and the service recreated nothing."""
        caplog.set_level(logging.WARNING)
        carriers = [
            ("$JS.API.CONSUMER.MSG.NEXT.TIMER_EVENTS.tenant-a", b'{"batch":1,"no_wait":true}'),
            ("timer.commands.tenant-a", b"not a command"),
            ("$JS.ACK.TIMER_EVENTS.tenant-a.1.1.1.1.0", b"+ACK"),
        ]
        replies = [
            "$JS.API.CONSUMER.DELETE.TIMER_COMMANDS.timer-service_tenant-b",
            "$JS.API.CONSUMER.DELETE.TIMER_EVENTS.tenant-b",
            "$JS.API.STREAM.PURGE.TIMER_DLQ",
            "$JS.API.STREAM.DELETE.TIMER_EVENTS",
            "timer.events.tenant-b.injected",
            "timer.dlq.tenant-b",
            "timer.commands.tenant-b",
        ]
        async with connected(deployment, "timer-service") as service:
            # Something to purge: B's own bad command, dead-lettered. The deployment is the
            # module's: wait for this one, not for what earlier tests left in the stream.
            already = (await service.jetstream.stream_info("TIMER_DLQ")).state.messages
            async with connected(deployment, "tenant-b") as b:
                forged = TimerClient(b).cancel_envelope("tenant-a", "x")
                await b.jetstream.publish("timer.commands.tenant-b", encode_envelope(forged))
            await wait_for_dead_letters(service, already + 1)
            before = await broker_state(service)
            async with connected(deployment, "tenant-a") as a:
                for subject, body in carriers:
                    for reply in replies:
                        await a.client.publish(subject, body, reply=reply)
                await a.client.flush()
                # A's own round trip through its command subject: the server has handled
                # every request above by the time this one's ack comes back.
                await TimerClient(a).schedule("tenant-a", "after-attacks", far_future())
            # Whatever the service's watch would have recreated by now, it would be new.
            await asyncio.sleep(1.5)
            after = await broker_state(service)
        assert after["TIMER_DLQ"][0] == before["TIMER_DLQ"][0]
        assert after["TIMER_EVENTS"] == before["TIMER_EVENTS"]
        for consumer in (
            "timer-service_tenant-a",
            "timer-service_tenant-b",
            "tenant-a",
            "tenant-b",
        ):
            assert after[consumer] == before[consumer], consumer
        dlq_before, dlq_after = before["TIMER_DLQ"][2], after["TIMER_DLQ"][2]
        assert dlq_after.get("timer.dlq.tenant-b") == dlq_before.get("timer.dlq.tenant-b")
        assert after["TIMER_DLQ"][1] >= before["TIMER_DLQ"][1]  # never purged
        assert after["commands of tenant-b"] == before["commands of tenant-b"]
        assert "was missing; recreated it" not in deployment.service.log()
        assert not violations(caplog, "timer.commands.tenant-a")  # allowed subjects, accepted


class TestHttpAttacks:
    def post(self, port: int, headers: dict[str, str]) -> int:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/quarantine/retry", method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    def test_quarantine_endpoints_want_the_token_host_and_origin(
        self, deployment: Deployment
    ) -> None:
        """POST /quarantine/retry without the token, with a foreign Origin or a wrong Host, or
        as a cross-site form is refused; GET /quarantine needs the token; with it both work."""
        port = deployment.service.http_port
        token = {"Authorization": f"Bearer {HTTP_TOKEN}"}
        assert self.post(port, {}) == 401
        assert self.post(port, {"Authorization": "Bearer not-the-token-at-all"}) == 401
        assert self.post(port, {**token, "Origin": "http://evil.example"}) == 403
        assert self.post(port, {**token, "Host": f"rebound.example:{port}"}) == 403
        assert self.post(port, {**token, "Content-Type": "text/plain"}) == 415
        status, _ = http_get(port, "/quarantine")
        assert status == 401
        assert self.post(port, token) == 200
        listing = urllib.request.Request(f"http://127.0.0.1:{port}/quarantine", headers=token)
        with urllib.request.urlopen(listing, timeout=10) as response:
            assert json.loads(response.read()) == []
        log = deployment.service.log()
        assert "refused (401)" in log
        assert "refused (403)" in log
        assert HTTP_TOKEN not in log


class TestAfterTheAttacks:
    async def test_both_tenants_still_schedule_and_receive(self, deployment: Deployment) -> None:
        """After every attack, each tenant still schedules its timer and reads its event."""
        await each_tenant_round_trips(deployment, "still")
        status, _ = http_get(deployment.service.http_port, "/healthz")
        assert status == 200


def far_future() -> datetime:
    return datetime.now(UTC) + timedelta(days=30)


async def wait_for_dead_letters(service: NatsBroker, count: int) -> None:
    for _ in range(300):
        info = await service.jetstream.stream_info("TIMER_DLQ")
        if info.state.messages >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} dead letters")
