"""The broker: connecting, failing clearly, and provisioning streams and the consumer."""

from __future__ import annotations

import re

import attrs
import pytest
from nats.js.api import AckPolicy, StorageType, StreamConfig

from tests.conftest import NatsServerFactory
from tests.ports import refused_port
from tests.timer_adapters_nats.jetstream import read_stream, wait_until
from tests.timer_adapters_nats.test_publisher import firing
from timer_adapters_nats import (
    BrokerUnavailable,
    DeadLetters,
    NatsBroker,
    NatsConnection,
    NatsEventPublisher,
    NatsServerProcess,
    NatsSettings,
)


class TestProvisioning:
    """start() creates what the contract names, and is idempotent."""

    async def test_streams_and_consumer(self, broker: NatsBroker) -> None:
        """Three file-backed streams on the prefix's subjects, a durable explicit-ack consumer."""
        js = broker.jetstream
        expected = {
            "TIMER_COMMANDS": "timer.commands.>",
            "TIMER_EVENTS": "timer.events.>",
            "TIMER_DLQ": "timer.dlq.>",
        }
        for name, subject in expected.items():
            config = (await js.stream_info(name)).config
            assert config.subjects == [subject]
            assert config.storage == StorageType.FILE
            assert config.num_replicas == 1
            # Commands need no window, and theirs would span tenants (issue 43).
            window = 0.1 if name == "TIMER_COMMANDS" else 120
            assert config.duplicate_window is not None and config.duplicate_window >= window
        consumer = (await js.consumer_info("TIMER_COMMANDS", "timer")).config
        assert consumer.durable_name == "timer"  # the library default; the service passes its own
        assert consumer.ack_policy == AckPolicy.EXPLICIT
        assert consumer.ack_wait == broker.settings.ack_wait_s
        assert consumer.max_deliver == broker.settings.max_deliver
        assert consumer.filter_subject == "timer.commands.>"

    async def test_custom_prefix_and_consumer_name(self, nats_url: str) -> None:
        """Subjects follow the prefix and the consumer takes the configured name."""
        settings = NatsSettings(
            url=nats_url,
            subject_prefix="acme.t",
            consumer_name="acme-timer",
            per_tenant_intake=False,
        )
        async with NatsBroker(settings) as broker:
            events = (await broker.jetstream.stream_info("TIMER_EVENTS")).config
            consumer = await broker.jetstream.consumer_info("TIMER_COMMANDS", "acme-timer")
        assert events.subjects == ["acme.t.events.>"]
        assert consumer.config.filter_subject == "acme.t.commands.>"

    async def test_idempotent_and_keeps_messages(self, settings: NatsSettings) -> None:
        """Starting again keeps the streams' messages and updates the consumer's settings."""
        async with NatsBroker(settings) as first:
            await first.jetstream.publish("timer.events.t.c", b"{}")
        changed = attrs.evolve(settings, ack_wait_s=12.0)
        async with NatsBroker(changed) as second:
            events = await second.jetstream.stream_info("TIMER_EVENTS")
            consumer = await second.jetstream.consumer_info("TIMER_COMMANDS", "timer")
        assert events.state.messages == 1
        assert consumer.config.ack_wait == 12.0

    async def test_existing_stream_is_left_alone(self, settings: NatsSettings) -> None:
        """A stream an operator created with other limits keeps them."""
        async with NatsBroker(attrs.evolve(settings, provision=False)) as bare:
            await bare.jetstream.add_stream(
                StreamConfig(
                    name="TIMER_EVENTS",
                    subjects=["timer.events.>"],
                    storage=StorageType.FILE,
                    max_msgs=10,
                    duplicate_window=300,
                )
            )
        async with NatsBroker(settings) as broker:
            config = (await broker.jetstream.stream_info("TIMER_EVENTS")).config
        assert config.max_msgs == 10
        assert config.duplicate_window == 300

    async def test_provision_off_creates_nothing(self, settings: NatsSettings) -> None:
        """With provision=False, start() only connects."""
        async with NatsBroker(attrs.evolve(settings, provision=False)) as broker:
            names = await broker.jetstream.streams_info()
        assert names == []


class TestConnecting:
    """Connection failures are quick and name the URL; a connected broker rides out outages."""

    async def test_unreachable_server_names_the_url(self) -> None:
        """An unreachable server raises BrokerUnavailable naming the URL and the configured
        connect timeout, the bound that ended the attempt (nats-py alone would retry forever)."""
        with refused_port() as port:
            settings = NatsSettings(url=f"nats://127.0.0.1:{port}", connect_timeout_s=0.5)
            broker = NatsBroker(settings)
            # Only the timeout's expiry words it so; how soon after is the machine's load
            # (tests/timer_adapters_nats/test_bad_input.py::TestConnectTimeout bounds it).
            failure = f"cannot connect to NATS at {settings.url} within 0.5s: "
            with pytest.raises(BrokerUnavailable, match=re.escape(failure)):
                await broker.start()
        assert not broker.is_connected

    async def test_server_without_jetstream(self, nats_server_factory: NatsServerFactory) -> None:
        """A server without JetStream fails the start with a message saying so."""
        server = nats_server_factory(jetstream=False)
        server.start()
        broker = NatsBroker(NatsSettings(url=server.url, connect_timeout_s=2.0))
        with pytest.raises(BrokerUnavailable, match="JetStream"):
            await broker.start()
        assert not broker.is_connected

    async def test_reconnects_after_an_outage(
        self, broker: NatsBroker, nats_server: NatsServerProcess
    ) -> None:
        """is_connected goes false while the server is away and true once it is back."""
        assert broker.is_connected
        nats_server.stop()
        await wait_until(lambda: not broker.is_connected, what="the disconnect")
        nats_server.start()
        await wait_until(lambda: broker.is_connected, what="the reconnect")

    async def test_close_is_idempotent(self, settings: NatsSettings) -> None:
        """aclose() twice is fine, and the client is gone afterwards."""
        broker = NatsBroker(settings)
        await broker.start()
        await broker.aclose()
        await broker.aclose()
        assert not broker.is_connected
        with pytest.raises(RuntimeError):
            _ = broker.client


class TestConnection:
    """A NatsConnection alone: connects and closes, provisions nothing, serves the adapters."""

    async def test_a_connection_only_connects(self, settings: NatsSettings) -> None:
        """Starting a connection creates no stream, even with provisioning on in its settings."""
        async with NatsConnection(settings) as connection:
            assert connection.is_connected
            assert await connection.jetstream.streams_info() == []
        assert not connection.is_connected

    async def test_adapters_are_built_on_a_connection(
        self, broker: NatsBroker, settings: NatsSettings
    ) -> None:
        """An event published through a plain connection is stored in the broker's stream."""
        envelope = firing(1)
        async with NatsConnection(settings) as connection:
            await NatsEventPublisher(connection).publish(envelope)
            assert await DeadLetters(connection).list() == []
        (held,) = await read_stream(broker.jetstream, settings.events_stream)
        assert held.headers["Nats-Msg-Id"] == envelope.id

    async def test_unstarted_connection_says_so(self, settings: NatsSettings) -> None:
        """client and jetstream before start() raise RuntimeError naming the connection."""
        connection = NatsConnection(settings)
        with pytest.raises(RuntimeError, match="NatsConnection is not started"):
            _ = connection.client
        with pytest.raises(RuntimeError, match="NatsConnection is not started"):
            _ = connection.jetstream


class TestSettings:
    """Settings are checked when they are made."""

    @pytest.mark.parametrize("prefix", ["", "timer.", "a b", "timer.*", "timer.>"])
    def test_bad_prefix(self, prefix: str) -> None:
        """A prefix with empty tokens, spaces or wildcards is refused."""
        with pytest.raises(ValueError, match="subject_prefix"):
            NatsSettings(url="nats://x", subject_prefix=prefix)

    @pytest.mark.parametrize(
        ("field", "value"), [("publish_window", 0), ("ack_timeout_s", 0.0), ("max_deliver", 1)]
    )
    def test_bad_numbers(self, field: str, value: float) -> None:
        """Non-positive sizes and timeouts, and a max_deliver of 1, are refused."""
        with pytest.raises(ValueError, match=field):
            NatsSettings(url="nats://x", **{field: value})

    def test_nak_delay_doubles_up_to_the_cap(self) -> None:
        """The redelivery delay doubles per delivery and stops at max_nak_delay_s."""
        settings = NatsSettings(url="nats://x", nak_delay_s=1.0, max_nak_delay_s=5.0)
        assert [settings.nak_delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
