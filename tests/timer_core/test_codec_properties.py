"""Property tests of the wire codec: exact round trips, and total decoding of any input."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from timer_core import (
    CausationId,
    CorrelationId,
    DecodeError,
    EnvelopeId,
    InvalidIdentifier,
    MessageEnvelope,
    ServiceCallId,
    TenantId,
    TimerEntry,
)
from timer_core.codec import (
    MAX_NESTING,
    decode_command,
    decode_envelope,
    decode_event,
    encode_envelope,
    envelope_to_dict,
)
from timer_core.instants import format_timestamp
from timer_core.testing import strategies as ts

DECODERS = [decode_envelope, decode_command, decode_event]
ENVELOPE_KEYS = [
    "id",
    "type",
    "tenantId",
    "aggregateId",
    "timestampMs",
    "correlationId",
    "causationId",
    "payload",
]
REQUIRED_KEYS = {"id", "type", "tenantId", "timestampMs", "payload"}
PAYLOAD_KEYS = ["_tag", "tenantId", "serviceCallId", "dueAt", "reachedAt"]


def assert_names_a_field(error: DecodeError) -> None:
    """A decode error's message is one line that starts with the field it is about."""
    assert error.field
    assert str(error).startswith(f"{error.field}: ")
    assert error.reason
    assert "\n" not in str(error)


def decode_fails(data: bytes | str, decoder: Any = decode_envelope) -> DecodeError:
    """Decode ``data``, which must fail with a DecodeError (and nothing else)."""
    with pytest.raises(DecodeError) as caught:
        decoder(data)
    assert_names_a_field(caught.value)
    return caught.value


class TestRoundTrip:
    """Encoding then decoding gives back exactly the envelope that was encoded."""

    @given(ts.command_envelopes())
    def test_commands_round_trip(self, envelope: MessageEnvelope[Any]) -> None:
        """Every ScheduleTimer and CancelTimer envelope survives encode and decode_command."""
        assert decode_command(encode_envelope(envelope)) == envelope
        assert decode_envelope(encode_envelope(envelope)) == envelope

    @given(ts.event_envelopes())
    def test_events_round_trip(self, envelope: MessageEnvelope[Any]) -> None:
        """Every DueTimeReached envelope survives encode and decode_event."""
        assert decode_event(encode_envelope(envelope)) == envelope

    @given(ts.envelopes(ts.due_time_reached()))
    def test_events_with_every_optional_field_round_trip(
        self, envelope: MessageEnvelope[Any]
    ) -> None:
        """Events with or without aggregateId, correlationId and causationId round-trip."""
        assert decode_event(encode_envelope(envelope)) == envelope

    @given(ts.envelopes(ts.commands() | ts.due_time_reached()))
    def test_encoding_is_canonical(self, envelope: MessageEnvelope[Any]) -> None:
        """Re-encoding a decoded message gives the same bytes: one way to write each message."""
        data = encode_envelope(envelope)
        assert encode_envelope(decode_envelope(data)) == data
        assert data.decode("utf-8") == json.dumps(envelope_to_dict(envelope), separators=(",", ":"))

    @given(ts.envelopes(ts.commands() | ts.due_time_reached()))
    def test_absent_optional_keys_are_omitted(self, envelope: MessageEnvelope[Any]) -> None:
        """The encoding never writes null: absent optional keys are left out."""
        obj = json.loads(encode_envelope(envelope))
        assert None not in obj.values()
        assert ("correlationId" in obj) == (envelope.correlation_id is not None)
        assert ("causationId" in obj) == (envelope.causation_id is not None)
        assert obj["type"] == obj["payload"]["_tag"]
        assert obj["tenantId"] == obj["payload"]["tenantId"]

    @given(
        ts.schedule_timers().map(lambda p: p),
        ts.envelope_ids(),
        st.integers(-23 * 60, 23 * 60),
    )
    def test_numeric_offsets_read_as_the_same_instant(
        self, payload: Any, envelope_id: Any, offset_minutes: int
    ) -> None:
        """A dueAt written with a numeric offset decodes to the same UTC instant."""
        obj = envelope_to_dict(MessageEnvelope(id=envelope_id, payload=payload, timestamp_ms=0))
        zone = timezone(timedelta(minutes=offset_minutes))
        local = payload.due_at.astimezone(zone)
        obj["payload"]["dueAt"] = local.isoformat(timespec="milliseconds")
        decoded = decode_command(json.dumps(obj))
        assert decoded.payload.due_at == payload.due_at
        assert decoded.payload.due_at.utcoffset() == timedelta(0)

    @given(ts.schedule_timers(), ts.envelope_ids(), st.integers(1, 999_999))
    def test_sub_millisecond_due_times_round_up(
        self, payload: Any, envelope_id: Any, extra_ns: int
    ) -> None:
        """A dueAt with digits past the millisecond is rounded up, so it never fires early."""
        assume(payload.due_at < datetime(2999, 1, 1, tzinfo=UTC))
        obj = envelope_to_dict(MessageEnvelope(id=envelope_id, payload=payload, timestamp_ms=0))
        obj["payload"]["dueAt"] = format_timestamp(payload.due_at)[:-1] + f"{extra_ns:06d}Z"
        decoded = decode_command(json.dumps(obj))
        assert decoded.payload.due_at == payload.due_at + timedelta(milliseconds=1)


def envelope_shaped() -> st.SearchStrategy[dict[str, Any]]:
    """Objects with the envelope's keys (some missing) holding arbitrary JSON values."""
    value = ts.json_values(max_leaves=6)
    payload = st.fixed_dictionaries(
        {},
        optional={
            "_tag": st.sampled_from(["ScheduleTimer", "CancelTimer", "DueTimeReached"]) | value,
            "tenantId": ts.tenant_ids().map(str) | value,
            "serviceCallId": ts.service_call_ids().map(str) | value,
            "dueAt": st.just("2030-01-01T00:00:00.000Z") | st.text(max_size=30) | value,
            "reachedAt": st.just("2030-01-01T00:00:01.000Z") | value,
        },
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "id": ts.envelope_ids().map(str) | value,
            "type": st.sampled_from(["ScheduleTimer", "CancelTimer", "DueTimeReached"]) | value,
            "tenantId": ts.tenant_ids().map(str) | value,
            "aggregateId": ts.service_call_ids().map(str) | value,
            "timestampMs": st.integers() | value,
            "correlationId": ts.correlation_ids().map(str) | value,
            "causationId": ts.causation_ids().map(str) | value,
            "payload": payload | value,
        },
    )


class TestStrategies:
    """The shipped strategies generate what their names promise."""

    @given(
        ts.invalid_identifiers(),
        st.sampled_from([TenantId, ServiceCallId, CorrelationId, CausationId]),
    )
    def test_invalid_identifiers_are_rejected(self, value: Any, kind: Any) -> None:
        """Every value from invalid_identifiers is refused by every identifier type."""
        with pytest.raises(InvalidIdentifier):
            kind(value)

    @given(ts.invalid_envelope_ids())
    def test_invalid_envelope_ids_are_rejected(self, value: Any) -> None:
        """Every value from invalid_envelope_ids is refused by EnvelopeId."""
        with pytest.raises(InvalidIdentifier):
            EnvelopeId(value)

    @given(ts.utc_datetimes())
    def test_datetimes_are_utc_milliseconds(self, value: datetime) -> None:
        """utc_datetimes yields aware UTC datetimes with whole milliseconds."""
        assert value.tzinfo is UTC
        assert value.microsecond % 1000 == 0

    @given(ts.timer_entries())
    def test_timer_entries_are_consistent(self, entry: TimerEntry) -> None:
        """A generated Reached timer was reached at or after its due time."""
        if entry.reached_at is not None:
            assert entry.reached_at >= entry.due_at


class TestTotalDecoding:
    """Whatever arrives, decoding returns an envelope or raises DecodeError naming a field."""

    @given(ts.json_values(), st.sampled_from(DECODERS))
    def test_arbitrary_json(self, value: Any, decoder: Any) -> None:
        """Any JSON document decodes or fails with a DecodeError that names a field."""
        try:
            decoder(json.dumps(value))
        except DecodeError as error:
            assert_names_a_field(error)

    @given(envelope_shaped(), st.sampled_from(DECODERS))
    @settings(suppress_health_check=[HealthCheck.too_slow])
    def test_envelope_shaped_json(self, obj: dict[str, Any], decoder: Any) -> None:
        """Objects that look like envelopes, with any values, decode or fail cleanly."""
        try:
            decoder(json.dumps(obj))
        except DecodeError as error:
            assert_names_a_field(error)

    @given(st.binary(max_size=300), st.sampled_from(DECODERS))
    def test_arbitrary_bytes(self, data: bytes, decoder: Any) -> None:
        """Any bytes decode or fail with a DecodeError that names a field."""
        try:
            decoder(data)
        except DecodeError as error:
            assert_names_a_field(error)

    @given(st.text(max_size=300), st.sampled_from(DECODERS))
    def test_arbitrary_text(self, data: str, decoder: Any) -> None:
        """Any text, lone surrogates included, decodes or fails with a DecodeError."""
        try:
            decoder(data)
        except DecodeError as error:
            assert_names_a_field(error)

    @pytest.mark.parametrize(
        "data",
        [
            b"",
            b"null",
            b"[]",
            b'"x"',
            b"NaN",
            b'{"timestampMs": Infinity}',
            b"\xff\xfe",
            b"[" * 100_000,
            b"1" * 5000,
            b'{"a":' * 3000 + b"1" + b"}" * 3000,
            b" " * (1024 * 1024 + 1),
        ],
    )
    def test_hostile_documents(self, data: bytes) -> None:
        """Empty, deeply nested, huge or non-standard JSON fails with a DecodeError."""
        assert decode_fails(data).field == "$"

    @pytest.mark.parametrize("decoder", DECODERS)
    @pytest.mark.parametrize("place", ["extension", "payload extension", "id"])
    @given(commands=ts.command_envelopes(), events=ts.envelopes(ts.due_time_reached()))
    @settings(max_examples=5)
    def test_nesting_is_limited_alike_on_every_interpreter(
        self,
        decoder: Any,
        place: str,
        commands: MessageEnvelope[Any],
        events: MessageEnvelope[Any],
    ) -> None:
        """Objects and arrays nest at most MAX_NESTING levels (the envelope is the first):
        one level more is refused at "$" naming the limit, and so is a document nested far
        deeper than Python 3.11's recursion limit lets json.loads read (3.14 reads it)."""
        obj = envelope_to_dict(events if decoder is decode_event else commands)

        def nest(levels: int) -> str:
            """The document with arrays ``levels`` deep, the envelope counted, at ``place``."""
            holder, key, arrays = {
                "extension": (obj, "ext", levels - 1),
                "payload extension": (obj["payload"], "ext", levels - 2),
                "id": (obj, "id", levels - 1),
            }[place]
            holder[key] = "nested here"  # json.dumps itself would recurse too deep on 3.11
            return json.dumps(obj).replace('"nested here"', "[" * arrays + '"x"' + "]" * arrays)

        if place != "id":
            decoder(nest(MAX_NESTING))
        error = decode_fails(nest(MAX_NESTING + 1), decoder)
        assert (error.field, error.reason) == (
            "$",
            f"JSON is nested more than {MAX_NESTING} levels deep",
        )
        assert decode_fails(nest(3000), decoder).field == "$"

    @given(ts.command_envelopes(), st.sampled_from(["utf-16", "utf-32", "utf-8-sig"]))
    def test_only_utf8_is_read(self, envelope: MessageEnvelope[Any], encoding: str) -> None:
        """A valid message in another encoding, or with a byte-order mark, is rejected."""
        data = encode_envelope(envelope).decode().encode(encoding)
        assert decode_fails(data).field == "$"


def mutation_paths(obj: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every key path of an encoded envelope: top-level keys and payload keys."""
    return [(key,) for key in obj] + [("payload", key) for key in obj["payload"]]


def get_parent(obj: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """The object that holds the last key of ``path``."""
    return obj["payload"] if len(path) == 2 else obj


def wrong_type(path: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """JSON values of a type the key at ``path`` never accepts."""
    non_string = st.one_of(
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    if path == ("timestampMs",):
        return st.one_of(
            st.text(max_size=5),
            st.floats(allow_nan=False, allow_infinity=False),
            st.booleans(),
            st.lists(st.integers(), max_size=2),
            st.integers(min_value=2**53),
        )
    if path == ("payload",):
        return st.one_of(st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2))
    return non_string


def wire_name(path: tuple[str, ...]) -> str:
    """The field name a DecodeError uses for ``path``."""
    return ".".join(path)


class TestMutatedEnvelopes:
    """Breaking one field of a valid envelope is reported against that field."""

    @given(ts.envelopes(ts.commands() | ts.due_time_reached()), st.data())
    def test_dropped_key(self, envelope: MessageEnvelope[Any], data: st.DataObject) -> None:
        """Removing a required key fails on that key; removing an optional one still decodes."""
        obj = envelope_to_dict(envelope)
        path = data.draw(st.sampled_from(mutation_paths(obj)))
        del get_parent(obj, path)[path[-1]]
        if len(path) == 1 and path[0] not in REQUIRED_KEYS:
            decoded = decode_envelope(json.dumps(obj))
            assert decoded.id == envelope.id
            return
        error = decode_fails(json.dumps(obj))
        assert error.field == wire_name(path)
        if path != ("payload", "_tag"):
            assert "required" in error.reason

    @given(ts.envelopes(ts.commands() | ts.due_time_reached()), st.data())
    def test_null_value(self, envelope: MessageEnvelope[Any], data: st.DataObject) -> None:
        """A null anywhere, optional keys included, fails on that key."""
        obj = envelope_to_dict(envelope)
        path = data.draw(st.sampled_from(mutation_paths(obj)))
        get_parent(obj, path)[path[-1]] = None
        assert decode_fails(json.dumps(obj)).field == wire_name(path)

    @given(ts.envelopes(ts.commands() | ts.due_time_reached()), st.data())
    def test_wrong_type(self, envelope: MessageEnvelope[Any], data: st.DataObject) -> None:
        """A value of the wrong JSON type fails on that key."""
        obj = envelope_to_dict(envelope)
        path = data.draw(st.sampled_from(mutation_paths(obj)))
        get_parent(obj, path)[path[-1]] = data.draw(wrong_type(path))
        assert decode_fails(json.dumps(obj)).field == wire_name(path)

    @given(
        ts.envelopes(ts.commands() | ts.due_time_reached()),
        st.data(),
        ts.invalid_identifiers().filter(lambda v: isinstance(v, str)),
    )
    def test_invalid_identifier(
        self, envelope: MessageEnvelope[Any], data: st.DataObject, bad: str
    ) -> None:
        """An identifier outside the contract's alphabet or length fails on that key."""
        obj = envelope_to_dict(envelope)
        ids = [p for p in mutation_paths(obj) if p[-1] not in ("timestampMs", "payload", "type")]
        ids = [p for p in ids if p[-1] not in ("_tag", "dueAt", "reachedAt")]
        path = data.draw(st.sampled_from(ids))
        get_parent(obj, path)[path[-1]] = bad
        error = decode_fails(json.dumps(obj))
        assert error.field == wire_name(path)

    @given(ts.envelopes(ts.commands() | ts.due_time_reached()), ts.tenant_ids())
    def test_mismatched_tenant(self, envelope: MessageEnvelope[Any], other: str) -> None:
        """An envelope tenantId that differs from payload.tenantId fails on tenantId."""
        assume(other != envelope.tenant_id)
        obj = envelope_to_dict(envelope)
        obj["tenantId"] = other
        assert decode_fails(json.dumps(obj)).field == "tenantId"

    @given(ts.envelopes(ts.commands() | ts.due_time_reached()), ts.service_call_ids())
    def test_mismatched_aggregate(self, envelope: MessageEnvelope[Any], other: str) -> None:
        """An aggregateId that is not the payload's serviceCallId fails on aggregateId."""
        assume(other != envelope.payload.service_call_id)
        obj = envelope_to_dict(envelope)
        obj["aggregateId"] = other
        assert decode_fails(json.dumps(obj)).field == "aggregateId"

    @given(
        ts.envelopes(ts.commands() | ts.due_time_reached()),
        st.sampled_from(["ScheduleTimer", "CancelTimer", "DueTimeReached"]),
        st.booleans(),
    )
    def test_mismatched_type(
        self, envelope: MessageEnvelope[Any], other: str, change_tag: bool
    ) -> None:
        """A type that differs from payload._tag fails on type, whichever of the two changed."""
        assume(other != envelope.type)
        obj = envelope_to_dict(envelope)
        if change_tag:
            obj["payload"]["_tag"] = other
        else:
            obj["type"] = other
        assert decode_fails(json.dumps(obj)).field == "type"

    @given(st.text(min_size=1, max_size=12), ts.envelopes(ts.commands()))
    def test_unknown_tag(self, tag: str, envelope: MessageEnvelope[Any]) -> None:
        """A payload._tag that names no message fails on payload._tag."""
        assume(tag not in ("ScheduleTimer", "CancelTimer", "DueTimeReached"))
        obj = envelope_to_dict(envelope)
        obj["type"] = obj["payload"]["_tag"] = tag
        assert decode_fails(json.dumps(obj)).field == "payload._tag"

    @given(ts.envelopes(ts.commands()), st.dictionaries(st.text(max_size=8), ts.json_values(4)))
    def test_unknown_keys_are_ignored(
        self, envelope: MessageEnvelope[Any], extra: dict[str, Any]
    ) -> None:
        """Keys the contract does not know are ignored, at the top and in the payload."""
        obj = envelope_to_dict(envelope)
        known = set(ENVELOPE_KEYS) | set(PAYLOAD_KEYS)
        for key, value in extra.items():
            if key not in known:
                obj.setdefault(key, value)
                obj["payload"].setdefault(key, value)
        assert decode_envelope(json.dumps(obj)) == envelope

    @given(ts.command_envelopes())
    def test_a_command_is_not_an_event(self, envelope: MessageEnvelope[Any]) -> None:
        """decode_event refuses a command, naming the type field."""
        assert decode_fails(encode_envelope(envelope), decode_event).field == "type"

    @given(ts.event_envelopes())
    def test_an_event_is_not_a_command(self, envelope: MessageEnvelope[Any]) -> None:
        """decode_command refuses an event, naming the type field."""
        assert decode_fails(encode_envelope(envelope), decode_command).field == "type"

    @given(
        ts.envelopes(ts.schedule_timers()),
        st.sampled_from(
            [
                "2030-01-01T00:00:00",
                "2030-01-01 00:00:00Z",
                "2030-13-01T00:00:00Z",
                "2030-02-30T00:00:00Z",
                "2030-01-01T24:00:00Z",
                "2030-01-01T00:00:60Z",
                "0000-01-01T00:00:00Z",
                "2030-01-01T00:00:00+24:00",
                "9999-12-31T23:59:59.9999Z",
                "9999-12-31T23:00:00-01:00",
                "tomorrow",
                "",
            ]
        ),
    )
    def test_bad_timestamps(self, envelope: MessageEnvelope[Any], text: str) -> None:
        """A dueAt that is zoneless, impossible or out of range fails on payload.dueAt."""
        obj = envelope_to_dict(envelope)
        obj["payload"]["dueAt"] = text
        assert decode_fails(json.dumps(obj)).field == "payload.dueAt"
