"""TimerClient: the commands a host sends, exactly as the contract writes them."""

from __future__ import annotations

import errno
import re
from datetime import UTC, datetime, timedelta, timezone

import attrs
import nats
import pytest

from tests.ports import refused_port
from tests.timer_adapters_nats.jetstream import read_stream
from timer_adapters_memory import FakeClock
from timer_adapters_nats import BrokerUnavailable, NatsBroker, NatsSettings, TimerClient
from timer_core import InvalidIdentifier, InvalidTimestamp, PublishError
from timer_core.codec import decode_command
from timer_core.instants import to_epoch_ms

UUID7 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
NOW = datetime(2030, 3, 4, 5, 6, 7, 890000, tzinfo=UTC)


class TestSchedule:
    """schedule() publishes a complete ScheduleTimer and returns its id once acked."""

    async def test_envelope_key_by_key(self, broker: NatsBroker) -> None:
        """Subject, headers and every envelope key are what the contract says: no
        Nats-Msg-Id, whose duplicate window would span tenants."""
        client = TimerClient(broker, clock=FakeClock(NOW))
        due = datetime(2030, 3, 4, 7, 6, 7, 1000, tzinfo=timezone(timedelta(hours=2)))
        envelope_id = await client.schedule("tenant-a", "call-1", due, causation_id="cause-1")
        (held,) = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert held.subject == "timer.commands.tenant-a"
        assert "Nats-Msg-Id" not in held.headers
        assert UUID7.fullmatch(envelope_id)
        assert held.json() == {
            "id": envelope_id,
            "type": "ScheduleTimer",
            "tenantId": "tenant-a",
            "aggregateId": "call-1",
            "timestampMs": to_epoch_ms(NOW),
            "correlationId": envelope_id,
            "causationId": "cause-1",
            "payload": {
                "_tag": "ScheduleTimer",
                "tenantId": "tenant-a",
                "serviceCallId": "call-1",
                "dueAt": "2030-03-04T05:06:07.001Z",
            },
        }

    async def test_given_correlation_id_is_kept(self, broker: NatsBroker) -> None:
        """A correlation id passed in is sent as is, and no causationId key appears."""
        client = TimerClient(broker)
        await client.schedule("tenant-a", "call-1", NOW, correlation_id="req-42")
        (held,) = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert held.json()["correlationId"] == "req-42"
        assert "causationId" not in held.json()

    async def test_naive_due_time_is_refused_before_sending(self, broker: NatsBroker) -> None:
        """A due time without a zone raises InvalidTimestamp and nothing is published."""
        client = TimerClient(broker)
        with pytest.raises(InvalidTimestamp):
            await client.schedule("tenant-a", "call-1", datetime(2030, 1, 1))
        assert await read_stream(broker.jetstream, "TIMER_COMMANDS") == []

    @pytest.mark.parametrize(
        ("tenant", "call"), [("tenant a", "call"), ("tenant", "x.y"), ("", "c")]
    )
    async def test_bad_ids_are_refused(self, broker: NatsBroker, tenant: str, call: str) -> None:
        """Ids that are not 1-128 characters of [A-Za-z0-9_-] raise InvalidIdentifier."""
        with pytest.raises(InvalidIdentifier):
            await TimerClient(broker).schedule(tenant, call, NOW)


class TestCancel:
    """cancel() publishes a complete CancelTimer."""

    async def test_envelope_key_by_key(self, broker: NatsBroker) -> None:
        """A CancelTimer carries id, tenant, aggregate, timestamp and correlation."""
        client = TimerClient(broker, clock=FakeClock(NOW))
        envelope_id = await client.cancel("tenant-b", "call-9", correlation_id="req-1")
        (held,) = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert held.subject == "timer.commands.tenant-b"
        assert held.json() == {
            "id": envelope_id,
            "type": "CancelTimer",
            "tenantId": "tenant-b",
            "aggregateId": "call-9",
            "timestampMs": to_epoch_ms(NOW),
            "correlationId": "req-1",
            "payload": {"_tag": "CancelTimer", "tenantId": "tenant-b", "serviceCallId": "call-9"},
        }


class TestSending:
    """Sending is acked, deduplicated, batched, and fails loudly."""

    async def test_resent_envelope_is_stored_again_and_changes_nothing_more(
        self, broker: NatsBroker
    ) -> None:
        """The same envelope sent twice (a retry) is stored twice, both acked: applied, the
        second reschedules the timer to the same due time (a command is idempotent by its
        timer's key, and carries no Nats-Msg-Id another tenant could have used)."""
        client = TimerClient(broker)
        envelope = client.schedule_envelope("tenant-a", "call-1", NOW)
        await client.send(envelope)
        await client.send(envelope)
        held = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert [decode_command(m.data) for m in held] == [envelope, envelope]

    async def test_send_many_in_order(self, broker: NatsBroker) -> None:
        """send_many acks every command and the stream holds them in the order given."""
        client = TimerClient(broker, publish_window=8)
        envelopes = [
            client.schedule_envelope(f"tenant-{i % 3}", f"call-{i}", NOW + timedelta(seconds=i))
            for i in range(100)
        ]
        assert await client.send_many(envelopes) == [None] * 100
        held = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert [decode_command(m.data) for m in held] == envelopes

    async def test_no_stream_raises_publish_error(self, settings: NatsSettings) -> None:
        """Without a commands stream, schedule raises PublishError."""
        async with NatsBroker(attrs.evolve(settings, provision=False)) as broker:
            with pytest.raises(PublishError, match="no stream"):
                await TimerClient(broker).schedule("tenant-a", "call-1", NOW)


class TestConnect:
    """TimerClient.connect opens and closes its own connection."""

    async def test_connect_and_schedule(self, broker: NatsBroker, nats_url: str) -> None:
        """A client from connect() sends to the configured prefix."""
        async with TimerClient.connect(nats_url) as client:
            await client.schedule("tenant-a", "call-1", NOW)
        assert len(await read_stream(broker.jetstream, "TIMER_COMMANDS")) == 1

    async def test_from_a_plain_nats_client(self, nats_url: str) -> None:
        """A TimerClient over a nats-py client the host already has uses the given prefix."""
        settings = NatsSettings(url=nats_url, subject_prefix="acme.timer")
        async with NatsBroker(settings) as broker:
            nc = await nats.connect(nats_url)
            try:
                client = TimerClient(nc, subject_prefix="acme.timer")
                await client.cancel("tenant-a", "call-1")
            finally:
                await nc.close()
            (held,) = await read_stream(broker.jetstream, "TIMER_COMMANDS")
        assert held.subject == "acme.timer.commands.tenant-a"

    @pytest.mark.parametrize(
        ("credentials", "shown"),
        [("", ""), ("alice:s3cret-pw@", "alice:***@"), ("s3cret-token@", "***@")],
    )
    async def test_unreachable_names_the_url(self, credentials: str, shown: str) -> None:
        """connect() to a port that refuses connections raises BrokerUnavailable naming the
        URL and the refusal, with the URL's password or token redacted."""
        with refused_port() as port:
            url = f"nats://{credentials}127.0.0.1:{port}"
            with pytest.raises(BrokerUnavailable) as raised:
                async with TimerClient.connect(url, connect_timeout_s=0.3):
                    raise AssertionError("connected to a port that refuses connections")
        message = str(raised.value)
        assert f"cannot connect to NATS at nats://{shown}127.0.0.1:{port} " in message
        assert f"[Errno {errno.ECONNREFUSED}]" in message
        assert "s3cret" not in message
