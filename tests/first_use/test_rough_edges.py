"""A new user's first mistakes get a clear error of Timer's own, at once (issue 27's rough edges).

Each test names the mistake; all the errors are ``timer_core.errors`` types, so a host catches
``TimerError`` and a test matches the message.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from timer_adapters_memory import FakeClock, MemoryEventBus, MemoryTimerStore
from timer_adapters_nats import (
    DueEventConsumer,
    DueEventConsumerSettings,
    NatsBroker,
    NatsSettings,
)
from timer_adapters_sqlite import SqliteTimerStore
from timer_core import (
    ConfigurationError,
    NotRunning,
    ScheduleTimer,
    Timer,
    TimerError,
    ValidationError,
    command_envelope,
)
from timer_core.codec import decode_command, encode_envelope
from timer_core.commands import scheduled_entry

NOW = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
ENVELOPE_ID = "0190c6a0-0000-7000-8000-000000000000"


class TestScheduleTimerCorrelation:
    def test_schedule_timer_takes_a_correlation_id_like_timer_schedule(self) -> None:
        """ScheduleTimer(correlation_id=...) is accepted and becomes the timer's correlation id."""
        command = ScheduleTimer("shop-1", "order-1", NOW, correlation_id="req-1")
        assert scheduled_entry(command, NOW).correlation_id == "req-1"

    def test_it_travels_on_the_envelope_not_in_the_payload(self) -> None:
        """On the wire the correlation id is the envelope's; the payload's JSON is unchanged."""
        command = ScheduleTimer("shop-1", "order-1", NOW, correlation_id="req-1")
        wire = encode_envelope(command_envelope(command, ENVELOPE_ID, NOW))
        assert wire.count(b"req-1") == 1
        decoded = decode_command(wire)
        assert decoded.correlation_id == "req-1"
        assert decoded.payload == command  # equality ignores the correlation id

    def test_an_invalid_correlation_id_is_refused_where_it_is_used(self) -> None:
        """A malformed correlation id fails with the identifier's own ValidationError."""
        command = ScheduleTimer("shop-1", "order-1", NOW, correlation_id="not valid!")
        with pytest.raises(ValidationError):
            scheduled_entry(command, NOW)


class TestTimerArguments:
    def test_a_path_where_a_store_belongs_is_refused_at_construction(self) -> None:
        """Timer("t.db", bus) fails in the constructor, naming the store that was meant."""
        with pytest.raises(ConfigurationError, match=r"store must be a TimerStore.*str 't\.db'"):
            Timer("t.db", MemoryEventBus())  # type: ignore[arg-type]

    def test_a_wrong_publisher_is_refused_at_construction(self) -> None:
        """A publisher that is not an EventPublisher fails at once."""
        with pytest.raises(ConfigurationError, match="publisher must be an EventPublisher"):
            Timer(MemoryTimerStore(), object())  # type: ignore[arg-type]

    def test_a_wrong_clock_is_refused_at_construction(self) -> None:
        """A clock without now/monotonic/sleep fails at once."""
        with pytest.raises(ConfigurationError, match="clock must be a Clock"):
            Timer(MemoryTimerStore(), MemoryEventBus(), clock=42)  # type: ignore[arg-type]

    async def test_a_timer_runs_once_and_says_so(self) -> None:
        """Starting a Timer twice raises NotRunning (a RuntimeError too)."""
        async with Timer(MemoryTimerStore(), MemoryEventBus(), clock=FakeClock(NOW)) as timer:
            pass
        with pytest.raises(NotRunning, match="runs only once"):
            await timer.start()


class TestSqliteStorePath:
    @pytest.mark.parametrize(
        ("given", "hint"),
        [
            ("sqlite:///payments.db", "SqliteTimerStore('payments.db')"),
            ("postgresql://timer:secret@db/timers", "PostgresTimerStore"),
            ("https://example.com/t.db", "path of a SQLite file"),
        ],
    )
    def test_a_url_is_a_configuration_error_naming_the_fix(self, given: str, hint: str) -> None:
        """A URL where a file path belongs fails in the constructor, saying what to pass."""
        with pytest.raises(ConfigurationError) as caught:
            SqliteTimerStore(given)
        assert hint in str(caught.value)
        assert "secret" not in str(caught.value)

    def test_something_else_than_a_path_is_refused(self) -> None:
        """A number where a path belongs fails at once."""
        with pytest.raises(ConfigurationError, match="path of its SQLite file"):
            SqliteTimerStore(3)  # type: ignore[arg-type]

    async def test_a_missing_directory_is_a_configuration_error_not_unavailable(
        self, tmp_path: Path
    ) -> None:
        """A file in a directory that does not exist is a configuration error at start."""
        store = SqliteTimerStore(tmp_path / "no-such-dir" / "t.db")
        with pytest.raises(ConfigurationError, match=r"no-such-dir.*does not exist"):
            await store.start()


class TestNatsSettings:
    @pytest.mark.parametrize(
        "url", ["http://127.0.0.1:4222", "localhost:4222", "nats://a:4222,127.0.0.1:4223"]
    )
    def test_a_url_nats_cannot_use_is_refused_at_once(self, url: str) -> None:
        """A scheme other than nats/tls/ws/wss, or none, fails in the settings' constructor."""
        with pytest.raises(ConfigurationError, match=r"must start with nats://"):
            NatsSettings(url=url)

    def test_a_url_without_a_scheme_gets_the_likely_fix(self) -> None:
        """localhost:4222 is answered with nats://localhost:4222."""
        with pytest.raises(ConfigurationError, match="nats://localhost:4222"):
            NatsSettings(url="localhost:4222")

    def test_a_password_in_a_bad_url_is_not_shown(self) -> None:
        """The error redacts the URL's secrets."""
        with pytest.raises(ConfigurationError) as caught:
            NatsSettings(url="http://user:hunter2@host:4222")
        assert "hunter2" not in str(caught.value)

    def test_good_urls_pass(self) -> None:
        """nats, tls, ws and wss URLs, and clusters of them, are accepted."""
        NatsSettings(url="nats://127.0.0.1:4222, tls://h:4443,ws://h:8080,wss://h")

    def test_bad_names_are_validation_errors(self) -> None:
        """Invalid consumer and stream names raise the library's ValidationError."""
        with pytest.raises(ValidationError, match="consumer_name"):
            NatsSettings(url="nats://127.0.0.1:4222", consumer_name="timer.v2")
        with pytest.raises(ValidationError, match="consumer name"):
            DueEventConsumer(NatsBroker(NatsSettings(url="nats://127.0.0.1:4222")), "billing v2")
        with pytest.raises(ValidationError, match="max_deliver"):
            DueEventConsumerSettings(max_deliver=0)

    def test_library_defaults_do_not_claim_to_be_the_service(self) -> None:
        """A library user's connection and consumer are not named timer-service by default."""
        settings = NatsSettings(url="nats://127.0.0.1:4222")
        assert (settings.consumer_name, settings.client_name) == ("timer", "timer")


class TestNotStarted:
    def test_a_broker_used_before_start_raises_not_running(self) -> None:
        """NatsBroker.client before start() is a NotRunning naming how to start it."""
        broker = NatsBroker(NatsSettings(url="nats://127.0.0.1:4222"))
        with pytest.raises(NotRunning, match=r"NatsBroker is not started.*start\(\)"):
            _ = broker.client
        with pytest.raises(NotRunning):
            _ = broker.jetstream
        assert issubclass(NotRunning, TimerError) and issubclass(NotRunning, RuntimeError)
