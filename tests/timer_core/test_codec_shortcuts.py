"""The codec's shortcuts (``timer_core._shortcuts``, behind ``decode_command`` and
``encode_envelope``) give exactly what the codec's own reading and writing give, for any input."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from timer_core import DecodeError, DueTimeReached, MessageEnvelope, ScheduleTimer
from timer_core._shortcuts import command as command_shortcut
from timer_core._shortcuts import due_event as due_event_shortcut
from timer_core.codec import _decode_command as codec_decode_command
from timer_core.codec import _encode_envelope as encode_envelope
from timer_core.codec import decode_command, envelope_to_dict
from timer_core.codec import encode_envelope as encode_event
from timer_core.testing import strategies as ts


def codec_outcome(decoder: Any, data: bytes) -> tuple[str, object]:
    """What ``decoder`` makes of ``data``: the envelope, or the DecodeError's message."""
    try:
        return "envelope", decoder(data)
    except DecodeError as exc:
        return "error", str(exc)


def mutations() -> st.SearchStrategy[Any]:
    """Edits of a command's JSON object: a key dropped, replaced, added, or a date rewritten."""
    keys = st.sampled_from(
        ["id", "type", "tenantId", "aggregateId", "timestampMs", "correlationId", "causationId"]
    )
    payload_keys = st.sampled_from(["_tag", "tenantId", "serviceCallId", "dueAt", "extra"])
    dates = st.sampled_from(
        [
            "2030-01-01T00:00:00Z",
            "2030-01-01T00:00:00.5Z",
            "2030-01-01T00:00:00.123456Z",
            "2030-01-01T01:00:00.000+01:00",
            "2030-01-01t00:00:00.000z",
            "2030-02-30T00:00:00.000Z",
            "2030-01-01T24:00:00.000Z",
            "2030-01-01T00:00:60.000Z",
            "2030-01-01T00:00:00.000",
            "2030-01-01 00:00:00.000Z",
        ]
    )
    return st.one_of(
        st.tuples(st.just("drop"), keys | st.just("payload")),
        st.tuples(st.just("set"), keys | st.just("payload"), ts.json_values(max_leaves=3)),
        st.tuples(st.just("set"), st.just("id"), ts.invalid_envelope_ids()),
        st.tuples(st.just("set"), st.just("tenantId"), ts.invalid_identifiers()),
        st.tuples(st.just("add"), st.text(max_size=8), ts.json_values(max_leaves=3)),
        st.tuples(st.just("drop_payload"), payload_keys),
        st.tuples(st.just("set_payload"), payload_keys, ts.json_values(max_leaves=3)),
        st.tuples(st.just("set_payload"), st.just("serviceCallId"), ts.invalid_identifiers()),
        st.tuples(st.just("set_payload"), st.just("dueAt"), dates),
    )


def mutate(obj: dict[str, Any], mutation: tuple[Any, ...]) -> dict[str, Any]:
    kind, key, *value = mutation
    payload = obj.get("payload")
    if kind == "drop":
        obj.pop(key, None)
    elif kind in ("set", "add"):
        obj[key] = value[0]
    elif isinstance(payload, dict):
        if kind == "drop_payload":
            payload.pop(key, None)
        else:
            payload[key] = value[0]
    return obj


class TestDecodeCommand:
    """``decode_command`` is the codec's own reading, shortcut or not."""

    @given(ts.command_envelopes())
    def test_valid_commands_decode_as_the_codec_decodes_them(
        self, envelope: MessageEnvelope[Any]
    ) -> None:
        """Every valid command written by the codec takes the shortcut, to the envelope it
        came from, as bytes and as text."""
        data = encode_envelope(envelope)
        assert command_shortcut(data) is not None
        assert decode_command(data) == codec_decode_command(data) == envelope
        assert decode_command(data.decode()) == envelope

    @pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
    @given(ts.command_envelopes(), st.integers(min_value=0, max_value=2**63))
    def test_a_position_is_set_on_the_decoded_envelope(
        self, separators: tuple[str, str], envelope: MessageEnvelope[Any], position: int
    ) -> None:
        """``position=`` gives the envelope at that position, as ``at_position`` would, written
        in the exact form or spaced; without it the position is None."""
        data = json.dumps(envelope_to_dict(envelope), separators=separators).encode()
        decoded = decode_command(data, position=position)
        assert decoded == envelope
        assert decoded.position == position == envelope.at_position(position).position
        assert decode_command(data).position is None

    @pytest.mark.parametrize("position", [-1, 1.0, "7", True])
    def test_a_position_that_is_no_sequence_number_is_refused(self, position: Any) -> None:
        """A negative or non-int position is a ValueError naming it, before any decoding."""
        data = b'{"not": "even a command"}'
        with pytest.raises(ValueError, match="position must be a non-negative int"):
            decode_command(data, position=position)

    @pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
    def test_hour_24_is_refused_on_every_python(self, separators: tuple[str, str]) -> None:
        """``T24:00`` is no RFC 3339 time, though Python 3.14's fromisoformat reads it as
        the next midnight: refused by the shortcut and the codec alike, compact or spaced."""
        schedule = ScheduleTimer("tenant-a", "call-1", datetime(2030, 1, 1, tzinfo=UTC))
        envelope_id = "01b8dac5-b400-7179-84fb-2914bb7f2a08"
        obj = envelope_to_dict(MessageEnvelope(id=envelope_id, payload=schedule, timestamp_ms=0))
        obj["payload"]["dueAt"] = "2030-01-01T24:00:00.000Z"
        data = json.dumps(obj, separators=separators).encode()
        with pytest.raises(DecodeError, match="hour"):
            decode_command(data)

    @pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
    @given(ts.command_envelopes(), st.lists(mutations(), min_size=1, max_size=3))
    def test_edited_commands_decode_or_fail_as_the_codec_does(
        self,
        separators: tuple[str, str],
        envelope: MessageEnvelope[Any],
        edits: list[tuple[Any, ...]],
    ) -> None:
        """After any edits the result, an envelope or the error message, is the codec's,
        written spaced or compactly (the exact-form shortcut's input) alike."""
        obj = envelope_to_dict(envelope)
        for edit in edits:
            obj = mutate(obj, edit)
        data = json.dumps(obj, separators=separators).encode()
        assert codec_outcome(decode_command, data) == codec_outcome(codec_decode_command, data)

    @given(
        ts.command_envelopes(),
        st.lists(
            st.tuples(st.integers(min_value=0), st.sampled_from(list(b'"{}:,-.0179AZaz_ \\xe9'))),
            min_size=1,
            max_size=3,
        ),
    )
    def test_commands_with_bytes_changed_decode_or_fail_as_the_codec_does(
        self, envelope: MessageEnvelope[Any], changes: list[tuple[int, int]]
    ) -> None:
        """A canonical command with any bytes overwritten gets the codec's answer."""
        data = bytearray(encode_envelope(envelope))
        for position, byte in changes:
            data[position % len(data)] = byte
        assert codec_outcome(decode_command, bytes(data)) == codec_outcome(
            codec_decode_command, bytes(data)
        )

    @pytest.mark.parametrize(
        ("find", "replace"),
        [
            (
                '"_tag":"ScheduleTimer","tenantId":"tenant-a"',
                '"_tag":"ScheduleTimer","tenantId":"tenant-b"',
            ),
            ('"aggregateId":"call-1"', '"aggregateId":"call-2"'),
            ('"type":"ScheduleTimer"', '"type":"CancelTimer"'),
            ('"_tag":"ScheduleTimer"', '"_tag":"CancelTimer"'),
            (',"dueAt":"2030-01-01T00:00:00.000Z"', ""),
            ('"dueAt":"2030-01-01T00:00:00.000Z"', '"dueAt":"2030-13-01T00:00:00.000Z"'),
            ('"timestampMs":1', '"timestampMs":9007199254740993'),
            ('"timestampMs":1', '"timestampMs":-0'),
            ('"timestampMs":1', '"timestampMs":01'),
        ],
    )
    def test_near_misses_of_the_exact_form_get_the_codecs_answer(
        self, find: str, replace: str
    ) -> None:
        """Each check the exact-form shortcut makes beyond its pattern matches the codec."""
        data = (
            '{"id":"0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b","type":"ScheduleTimer",'
            '"tenantId":"tenant-a","aggregateId":"call-1","timestampMs":1,'
            '"payload":{"_tag":"ScheduleTimer","tenantId":"tenant-a","serviceCallId":"call-1",'
            '"dueAt":"2030-01-01T00:00:00.000Z"}}'
        )
        assert find in data
        edited = data.replace(find, replace).encode()
        assert codec_outcome(decode_command, edited) == codec_outcome(codec_decode_command, edited)

    @given(ts.command_envelopes())
    def test_shortcut_builds_the_codecs_types(self, envelope: MessageEnvelope[Any]) -> None:
        """Every field of a shortcut decode has exactly the type the codec gives it."""
        data = encode_envelope(envelope)
        fast, slow = decode_command(data), codec_decode_command(data)
        for name in ("id", "aggregate_id", "correlation_id", "causation_id", "timestamp_ms"):
            assert type(getattr(fast, name)) is type(getattr(slow, name))
        for name in ("tenant_id", "service_call_id"):
            assert type(getattr(fast.payload, name)) is type(getattr(slow.payload, name))
        if isinstance(slow.payload, ScheduleTimer):
            assert fast.payload.due_at.tzinfo is slow.payload.due_at.tzinfo

    @given(st.binary(max_size=200) | ts.json_values().map(lambda v: json.dumps(v).encode()))
    def test_any_bytes_decode_or_fail_as_the_codec_does(self, data: bytes) -> None:
        """Arbitrary bytes and JSON values get the codec's answer."""
        assert codec_outcome(decode_command, data) == codec_outcome(codec_decode_command, data)

    @pytest.mark.parametrize(
        "due_at",
        ["2030-01-01T01:00:00.000+01:00", "2030-01-01T00:00:00.0001Z", "2030-01-01T00:00:00Z"],
    )
    def test_timestamps_in_other_forms_are_read_by_the_codec(self, due_at: str) -> None:
        """Offsets, other precisions and no fraction decode exactly as the codec reads them."""
        data = json.dumps(
            {
                "id": "0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b",
                "type": "ScheduleTimer",
                "tenantId": "tenant-a",
                "timestampMs": 1,
                "payload": {
                    "_tag": "ScheduleTimer",
                    "tenantId": "tenant-a",
                    "serviceCallId": "call-1",
                    "dueAt": due_at,
                },
            }
        ).encode()
        decoded = decode_command(data)
        assert decoded == codec_decode_command(data)
        assert isinstance(decoded.payload, ScheduleTimer)
        assert decoded.payload.due_at.tzinfo is UTC

    def test_an_event_is_not_a_command(self) -> None:
        """A DueTimeReached fails as the codec fails it."""
        event = MessageEnvelope(
            id="0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b",
            payload=DueTimeReached(
                "tenant-a", "call-1", datetime(2030, 1, 1, tzinfo=UTC), datetime.now(UTC)
            ),
            timestamp_ms=1,
        )
        data = encode_envelope(event)
        assert codec_outcome(decode_command, data) == codec_outcome(codec_decode_command, data)
        assert codec_outcome(decode_command, data)[0] == "error"


class TestEncodeEvent:
    """``encode_envelope`` of an event writes the codec's own bytes, shortcut or not."""

    @given(ts.event_envelopes())
    def test_events_as_the_service_publishes_them(
        self, envelope: MessageEnvelope[DueTimeReached]
    ) -> None:
        """Every DueTimeReached the timer publishes takes the shortcut, to the codec's bytes."""
        assert due_event_shortcut(envelope) is not None
        assert encode_event(envelope) == encode_envelope(envelope)

    @given(ts.envelopes(ts.due_time_reached()))
    def test_events_with_any_optional_fields(
        self, envelope: MessageEnvelope[DueTimeReached]
    ) -> None:
        """With or without aggregateId, correlationId and causationId: the codec's bytes."""
        assert encode_event(envelope) == encode_envelope(envelope)

    @given(ts.event_envelopes(), st.lists(ts.utc_datetimes(), min_size=2, max_size=5))
    def test_consecutive_reached_times(
        self, envelope: MessageEnvelope[DueTimeReached], reached: list[datetime]
    ) -> None:
        """The remembered reachedAt text never leaks from one event into the next."""
        for moment in reached:
            payload = envelope.payload
            event = MessageEnvelope(
                id=envelope.id,
                payload=DueTimeReached(
                    payload.tenant_id, payload.service_call_id, payload.due_at, moment
                ),
                timestamp_ms=envelope.timestamp_ms,
                aggregate_id=envelope.aggregate_id,
                correlation_id=envelope.correlation_id,
            )
            assert encode_event(event) == encode_envelope(event)

    def test_instants_in_another_zone_are_written_in_utc(self) -> None:
        """A due time given with an offset is written as the codec writes it, in UTC."""
        plus_two = timezone(timedelta(hours=2))
        event = MessageEnvelope(
            id="0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b",
            payload=DueTimeReached(
                "tenant-a",
                "call-1",
                datetime(2030, 1, 1, 2, tzinfo=plus_two),
                datetime(2030, 1, 1, 0, 0, 1, 999999, tzinfo=UTC),
            ),
            timestamp_ms=7,
            aggregate_id="call-1",
        )
        assert encode_event(event) == encode_envelope(event)
        assert b'"dueAt":"2030-01-01T00:00:00.000Z"' in encode_event(event)
