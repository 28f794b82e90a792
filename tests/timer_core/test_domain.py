"""Unit tests of the core's value types: identifiers, UTC millisecond time, the TimerEntry."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from timer_core import (
    Command,
    CorrelationId,
    DueTimeReached,
    EnvelopeId,
    IllegalTransition,
    InvalidIdentifier,
    InvalidTimestamp,
    MessageEnvelope,
    ScheduleTimer,
    ServiceCallId,
    TenantId,
    TimerEntry,
    TimerKey,
    TimerState,
    TraceContext,
    Uuid7EnvelopeIds,
)
from timer_core.commands import _operation
from timer_core.events import build_due_event, due_events
from timer_core.instants import format_timestamp, parse_timestamp, to_epoch_ms
from timer_core.testing import strategies as ts

T0 = datetime(2025, 11, 14, 10, 0, tzinfo=UTC)


class TestIdentifiers:
    @pytest.mark.parametrize(
        "value", ["tenant-a", "A_b-9", "x" * 128, "0b7e6a52-5d2c-4f0e-9c1d-3a8f2b6e4d10"]
    )
    def test_accepts_contract_tokens(self, value: str) -> None:
        """1-128 characters of [A-Za-z0-9_-] are valid ids, UUIDs included."""
        assert TenantId(value) == value
        assert ServiceCallId(value) == value

    @pytest.mark.parametrize("value", ["", "a.b", "a*", "a>", "a b", "x" * 129, "é"])
    def test_rejects_unsafe_tokens(self, value: str) -> None:
        """Anything that is not a safe subject token is rejected with the id's name."""
        with pytest.raises(InvalidIdentifier, match="tenantId"):
            TenantId(value)

    def test_rejects_non_strings(self) -> None:
        """A number is not an id."""
        with pytest.raises(InvalidIdentifier, match="must be a string"):
            CorrelationId(5)  # type: ignore[arg-type]

    def test_generated_envelope_ids_are_lowercase_uuid7(self) -> None:
        """Fresh envelope ids are UUID version 7 and pass their own validation."""
        value = EnvelopeId.generate()
        assert uuid.UUID(value).version == 7
        assert EnvelopeId(value) == value == value.lower()

    def test_firing_ids_are_stable_and_distinct(self) -> None:
        """A firing's id depends only on tenant, service call and due time."""
        ms = to_epoch_ms(T0)
        first = EnvelopeId.for_firing("t", "s", ms)
        assert first == EnvelopeId.for_firing("t", "s", ms)
        assert uuid.UUID(first).version == 7
        assert EnvelopeId(first) == first
        others = {
            EnvelopeId.for_firing("t", "s", ms + 1),
            EnvelopeId.for_firing("t2", "s", ms),
            EnvelopeId.for_firing("t", "s2", ms),
        }
        assert first not in others
        assert len(others) == 3

    @pytest.mark.parametrize(
        ("tenant", "call", "ms", "expected"),
        [
            ("t", "s", 0, "00000000-0000-7ee6-aeba-3bae52828f52"),
            ("tenant-7", "call-12345", 1764222222123, "019ac3d6-bf2b-7413-8165-958478742088"),
            ("\u00e9", "x", -5, "00000000-0000-7572-b5c9-c46b221d4de9"),
            ("a", "b", 1 << 50, "ffffffff-ffff-7010-a25a-445c265d8b37"),
        ],
    )
    def test_firing_ids_keep_their_values_across_versions(
        self, tenant: str, call: str, ms: int, expected: str
    ) -> None:
        """A firing's id is the one earlier releases computed, so a firing published before
        an upgrade and again after it is still dropped as a duplicate."""
        assert EnvelopeId.for_firing(tenant, call, ms) == expected

    def test_envelope_id_rejects_other_uuid_versions(self) -> None:
        """A UUID v4 is not a valid envelope id."""
        with pytest.raises(InvalidIdentifier, match="UUID v7"):
            EnvelopeId(str(uuid.uuid4()))


class TestTime:
    def test_writes_contract_format(self) -> None:
        """Timestamps are written as YYYY-MM-DDTHH:MM:SS.sssZ."""
        assert format_timestamp(T0 + timedelta(microseconds=123_999)) == "2025-11-14T10:00:00.123Z"

    @pytest.mark.parametrize(
        ("instant", "text"),
        [
            (datetime(1, 1, 1, tzinfo=UTC), "0001-01-01T00:00:00.000Z"),
            (datetime(999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC), "0999-12-31T23:59:59.999Z"),
            (datetime(2030, 1, 1, 12, 0, 0, 1_000, tzinfo=UTC), "2030-01-01T12:00:00.001Z"),
            (datetime(2030, 6, 30, 1, 2, 3, 456_789, tzinfo=UTC), "2030-06-30T01:02:03.456Z"),
            (datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC), "9999-12-31T23:59:59.999Z"),
        ],
    )
    def test_writes_the_edges_of_the_range(self, instant: datetime, text: str) -> None:
        """The first and last years, a year under 1000, a fraction under a millisecond."""
        assert format_timestamp(instant) == text

    @given(
        st.datetimes(
            min_value=datetime(1, 1, 2),
            max_value=datetime(9999, 12, 30),
            timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30))]),
        )
    )
    def test_writes_every_instant_field_by_field(self, value: datetime) -> None:
        """The text is the instant's UTC fields, milliseconds truncated, with or without a
        fraction and from any offset (the writer reads isoformat's text)."""
        utc = value.astimezone(UTC)
        assert format_timestamp(value) == (
            f"{utc.year:04d}-{utc.month:02d}-{utc.day:02d}T{utc.hour:02d}:{utc.minute:02d}:"
            f"{utc.second:02d}.{utc.microsecond // 1000:03d}Z"
        )

    def test_reads_offsets_as_utc(self) -> None:
        """A numeric offset is normalised to UTC."""
        assert parse_timestamp("2025-11-14T12:00:00+02:00") == T0

    def test_rejects_missing_zone(self) -> None:
        """A timestamp without a zone is rejected, not guessed."""
        with pytest.raises(InvalidTimestamp, match="no time zone"):
            parse_timestamp("2025-11-14T10:00:00")

    def test_rejects_out_of_range(self) -> None:
        """A valid-looking but impossible instant is rejected."""
        with pytest.raises(InvalidTimestamp, match="out of range"):
            parse_timestamp("2025-02-30T10:00:00Z")

    def test_due_times_round_up(self) -> None:
        """Sub-millisecond due times round up, so nothing fires early."""
        assert parse_timestamp("2025-11-14T10:00:00.0000001Z", round_up=True) == T0 + timedelta(
            milliseconds=1
        )

    def test_format_rejects_naive(self) -> None:
        """Naive datetimes are rejected at the boundary."""
        with pytest.raises(InvalidTimestamp, match="naive"):
            format_timestamp(datetime(2025, 1, 1))


class TestTimerEntry:
    def entry(self) -> TimerEntry:
        return TimerEntry("t", "s", due_at=T0, registered_at=T0 - timedelta(minutes=1))

    def test_new_timers_are_scheduled(self) -> None:
        """A new timer is Scheduled with no reached_at."""
        entry = self.entry()
        assert entry.state is TimerState.SCHEDULED
        assert entry.reached_at is None

    def test_reach_sets_state_and_time(self) -> None:
        """Reaching a due timer records when."""
        reached = self.entry().reach(T0 + timedelta(seconds=1))
        assert reached.state is TimerState.REACHED
        assert reached.reached_at == T0 + timedelta(seconds=1)

    def test_reach_twice_is_illegal(self) -> None:
        """Reached is final."""
        reached = self.entry().reach(T0)
        with pytest.raises(IllegalTransition, match="already Reached"):
            reached.reach(T0)

    def test_reach_before_due_is_illegal(self) -> None:
        """A timer cannot be reached before it is due."""
        with pytest.raises(IllegalTransition, match="cannot be reached"):
            self.entry().reach(T0 - timedelta(milliseconds=1))

    def test_reached_timer_is_never_rearmed(self) -> None:
        """Rescheduling a Reached timer raises."""
        with pytest.raises(IllegalTransition, match="never re-armed"):
            self.entry().reach(T0).reschedule(T0, T0, None)

    def test_due_is_inclusive(self) -> None:
        """A timer is due when dueAt <= now."""
        entry = self.entry()
        assert entry.is_due(T0)
        assert not entry.is_due(T0 - timedelta(milliseconds=1))

    def test_rejects_naive_due_time(self) -> None:
        """A naive due time is rejected."""
        with pytest.raises(InvalidTimestamp, match="dueAt"):
            TimerEntry("t", "s", due_at=datetime(2025, 1, 1), registered_at=T0)

    def test_normalises_offsets(self) -> None:
        """Aware non-UTC datetimes are stored as UTC."""
        plus2 = timezone(timedelta(hours=2))
        entry = TimerEntry(
            "t", "s", due_at=datetime(2025, 11, 14, 12, tzinfo=plus2), registered_at=T0
        )
        assert entry.due_at == T0
        assert entry.due_at.tzinfo is UTC

    def test_state_and_reached_at_agree(self) -> None:
        """reached_at is set exactly when the state is Reached."""
        with pytest.raises(IllegalTransition):
            TimerEntry("t", "s", due_at=T0, registered_at=T0, state=TimerState.REACHED)


class TestFiringIds:
    @pytest.mark.parametrize(
        ("tenant", "call", "due_ms", "expected"),
        [
            ("tenant-a", "call-1", 1767225600000, "019b76da-a800-728d-8683-03769b5ec313"),
            ("t", "s", 0, "00000000-0000-7ee6-aeba-3bae52828f52"),
            ("t", "s", -5, "00000000-0000-7909-9608-9d6f39b02df7"),
            ("tenant_X", "c-" + "z" * 100, (1 << 48) + 7, "ffffffff-ffff-7b44-94ac-8ccde42ac7e8"),
            ("a", "b", 1795316401123, "01a20132-43e3-790c-968e-cdd55d9df9b9"),
        ],
    )
    def test_firing_ids_never_change(
        self, tenant: str, call: str, due_ms: int, expected: str
    ) -> None:
        """A firing's id is pinned across versions: a re-publish after an upgrade must carry
        the same id, or JetStream's duplicate window would let the event through twice."""
        assert EnvelopeId.for_firing(tenant, call, due_ms) == expected


class TestHotPathConstruction:
    """The hot paths that skip the converters build exactly what the constructors build."""

    @given(
        ts.timer_entries(state=TimerState.SCHEDULED),
        st.integers(0, 10**9).map(lambda ms: timedelta(milliseconds=ms)),
    )
    def test_reach_equals_the_constructor(self, entry: TimerEntry, lateness: timedelta) -> None:
        """Every field of a reached entry, by value and type, is the constructor's."""
        reached_at = min(entry.due_at + lateness, ts.MAX_INSTANT)
        fast = entry.reach(reached_at)
        slow = TimerEntry(
            tenant_id=entry.tenant_id,
            service_call_id=entry.service_call_id,
            due_at=entry.due_at,
            registered_at=entry.registered_at,
            correlation_id=entry.correlation_id,
            state=TimerState.REACHED,
            reached_at=reached_at,
            trace_context=entry.trace_context,
        )
        assert fast == slow
        for field in attrs.fields(TimerEntry):
            assert type(getattr(fast, field.name)) is type(getattr(slow, field.name))

    @given(ts.timer_entries(state=TimerState.SCHEDULED), ts.utc_datetimes())
    def test_due_events_equal_the_constructors(self, entry: TimerEntry, reached: datetime) -> None:
        """A DueTimeReached envelope built on the hot path is the constructors' one."""
        fast = build_due_event(entry, reached)
        slow = MessageEnvelope(
            id=Uuid7EnvelopeIds().firing_id(entry),
            payload=DueTimeReached(
                tenant_id=entry.tenant_id,
                service_call_id=entry.service_call_id,
                due_at=entry.due_at,
                reached_at=reached,
            ),
            timestamp_ms=to_epoch_ms(reached),
            aggregate_id=entry.service_call_id,
            correlation_id=entry.correlation_id,
            trace_context=entry.trace_context,
        )
        assert fast == slow
        for field in attrs.fields(MessageEnvelope):
            assert type(getattr(fast, field.name)) is type(getattr(slow, field.name))
        for field in attrs.fields(DueTimeReached):
            assert type(getattr(fast.payload, field.name)) is type(
                getattr(slow.payload, field.name)
            )

    @given(st.lists(ts.timer_entries(state=TimerState.SCHEDULED), max_size=5), ts.utc_datetimes())
    def test_a_batchs_due_events_equal_build_due_event(
        self, entries: list[TimerEntry], reached: datetime
    ) -> None:
        """The events of a batch fired at one instant are build_due_event's, field by field."""
        fast = due_events(entries, reached, Uuid7EnvelopeIds())
        slow = [build_due_event(entry, reached) for entry in entries]
        assert fast == slow
        for one, other in zip(fast, slow, strict=True):
            for field in attrs.fields(MessageEnvelope):
                assert type(getattr(one, field.name)) is type(getattr(other, field.name))

    @given(ts.command_envelopes(), ts.utc_datetimes(), st.none() | ts.trace_contexts())
    def test_stored_entries_equal_the_constructors(
        self, envelope: MessageEnvelope[Command], now: datetime, trace: TraceContext | None
    ) -> None:
        """The entry a ScheduleTimer is stored as is the constructor's, field by field."""
        envelope = attrs.evolve(envelope, trace_context=trace)
        operation = _operation(envelope, now)
        command = envelope.payload
        if not isinstance(command, ScheduleTimer):
            assert operation == TimerKey(command.tenant_id, command.service_call_id)
            return
        slow = TimerEntry(
            tenant_id=command.tenant_id,
            service_call_id=command.service_call_id,
            due_at=command.due_at,
            registered_at=now,
            correlation_id=envelope.correlation_id,
            trace_context=trace,
        )
        assert operation == slow
        for field in attrs.fields(TimerEntry):
            assert type(getattr(operation, field.name)) is type(getattr(slow, field.name))

    @given(ts.timer_entries())
    def test_entries_read_back_equal_the_constructors(self, entry: TimerEntry) -> None:
        """An entry a store builds from its row's plain values is the validated one, by value
        and type."""
        fast = TimerEntry.from_storage(
            str(entry.tenant_id),
            str(entry.service_call_id),
            entry.due_at,
            entry.registered_at,
            None if entry.correlation_id is None else str(entry.correlation_id),
            entry.state,
            entry.reached_at,
            entry.trace_context,
        )
        assert fast == entry
        for field in attrs.fields(TimerEntry):
            assert type(getattr(fast, field.name)) is type(getattr(entry, field.name))

    @pytest.mark.parametrize(
        ("change", "error"),
        [
            ({"tenant_id": "a.b"}, InvalidIdentifier),
            ({"service_call_id": 'call"1'}, InvalidIdentifier),
            ({"correlation_id": ""}, InvalidIdentifier),
            ({"due_at": datetime(2026, 1, 1)}, InvalidTimestamp),
            ({"state": "Fired"}, ValueError),
            ({"state": TimerState.REACHED}, IllegalTransition),
        ],
    )
    def test_entries_read_back_are_still_checked(
        self, change: dict[str, object], error: type[Exception]
    ) -> None:
        """A row value no valid entry could have written raises the constructor's error."""
        values: dict[str, object] = {
            "tenant_id": "tenant-1",
            "service_call_id": "call-1",
            "due_at": datetime(2026, 1, 1, tzinfo=UTC),
            "registered_at": datetime(2026, 1, 1, tzinfo=UTC),
            "correlation_id": None,
            "state": TimerState.SCHEDULED,
            "reached_at": None,
            "trace_context": None,
        }
        with pytest.raises(error):
            TimerEntry.from_storage(**{**values, **change})  # type: ignore[arg-type]

    def test_entries_read_back_round_sub_millisecond_instants(self) -> None:
        """An instant with microseconds (a row no valid entry wrote) is rounded as the
        constructor rounds it, due time up."""
        due = datetime(2026, 1, 1, 0, 0, 0, 1, tzinfo=UTC)
        fast = TimerEntry.from_storage(
            "tenant-1", "call-1", due, due, None, TimerState.SCHEDULED, None, None
        )
        assert fast.due_at == datetime(2026, 1, 1, 0, 0, 0, 1000, tzinfo=UTC)
        assert fast.registered_at == datetime(2026, 1, 1, tzinfo=UTC)
