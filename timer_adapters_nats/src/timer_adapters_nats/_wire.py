"""The codec's hot paths on the broker side: commands in and ``DueTimeReached`` out, per message.

:func:`decode_command` and :func:`encode_event` give exactly what :mod:`timer_core.codec`
gives, several times faster, for the messages the service handles by the thousand: they take
the one canonical shape Timer's own writers produce (``TimerClient``, the service) straight,
and hand anything else to the codec, which stays the only judge of what is valid and the
only author of error messages.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from timer_core import (
    CancelTimer,
    Command,
    DueTimeReached,
    MessageEnvelope,
    ScheduleTimer,
    ServiceCallId,
    TimerError,
    encode_envelope,
)
from timer_core import decode_command as codec_decode_command
from timer_core.codec import MAX_MESSAGE_BYTES

__all__ = ["decode_command", "encode_event"]

# The one timestamp form Timer writes; anything else (offsets, other precisions) is the codec's.
_CANONICAL_TIMESTAMP = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z", re.ASCII
)
_ENVELOPE_KEYS = frozenset(
    ("id", "type", "tenantId", "aggregateId", "timestampMs", "correlationId", "causationId")
)
_SCHEDULE_KEYS = frozenset(("_tag", "tenantId", "serviceCallId", "dueAt"))
_CANCEL_KEYS = frozenset(("_tag", "tenantId", "serviceCallId"))
_OPTIONAL_IDS = ("aggregateId", "correlationId", "causationId")
_SAFE_INT = 2**53


def decode_command(data: bytes) -> MessageEnvelope[Command]:
    """:func:`timer_core.decode_command`, with a shortcut for the canonical shape."""
    envelope = _canonical_command(data)
    return envelope if envelope is not None else codec_decode_command(data)


def _canonical_command(data: bytes) -> MessageEnvelope[Command] | None:
    """The envelope when ``data`` is a plainly valid command, else None (ask the codec)."""
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        obj: Any = json.loads(data)
    except Exception:  # not JSON, not UTF-8, too deep: the codec says which
        return None
    if type(obj) is not dict:
        return None
    payload = obj.pop("payload", None)
    if type(payload) is not dict or not obj.keys() <= _ENVELOPE_KEYS:
        return None
    tag = payload.get("_tag")
    if tag == "ScheduleTimer":
        if payload.keys() != _SCHEDULE_KEYS:
            return None
    elif tag != "CancelTimer" or payload.keys() != _CANCEL_KEYS:
        return None
    tenant_id = obj.get("tenantId")
    service_call_id = payload["serviceCallId"]
    timestamp_ms = obj.get("timestampMs")
    if (
        obj.get("type") != tag
        or type(tenant_id) is not str
        or payload["tenantId"] != tenant_id
        or type(service_call_id) is not str
        or type(timestamp_ms) is not int
        or not -_SAFE_INT < timestamp_ms < _SAFE_INT
        or type(obj.get("id")) is not str
    ):
        return None
    for key in _OPTIONAL_IDS:
        if key in obj and type(obj[key]) is not str:
            return None
    aggregate_id = obj.get("aggregateId")
    if aggregate_id is not None and aggregate_id != service_call_id:
        return None
    try:
        command: Command
        if tag == "ScheduleTimer":
            due_at = payload["dueAt"]
            if type(due_at) is not str or _CANONICAL_TIMESTAMP.fullmatch(due_at) is None:
                return None
            command = ScheduleTimer(tenant_id, service_call_id, datetime.fromisoformat(due_at))
        else:
            command = CancelTimer(tenant_id, service_call_id)
        return MessageEnvelope(
            id=obj["id"],
            payload=command,
            timestamp_ms=timestamp_ms,
            aggregate_id=None if aggregate_id is None else ServiceCallId(aggregate_id),
            correlation_id=obj.get("correlationId"),
            causation_id=obj.get("causationId"),
        )
    except (TimerError, ValueError):  # an invalid id or date: the codec words the error
        return None


def _utc_text(value: datetime) -> str:
    """``format_timestamp`` of an instant already in UTC (as the message types keep them)."""
    return value.isoformat(timespec="milliseconds")[:-6] + "Z"


class _LastStamp:
    """``_utc_text`` remembering its last answer: a firing batch shares one ``reachedAt``."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        # One attribute, replaced whole, so threads never see a value with another's text.
        self._last: tuple[datetime | None, str] = (None, "")

    def __call__(self, value: datetime) -> str:
        last_value, text = self._last
        if value is not last_value:
            text = _utc_text(value)
            self._last = (value, text)
        return text


_reached_text = _LastStamp()


def encode_event(envelope: MessageEnvelope[DueTimeReached]) -> bytes:
    """:func:`timer_core.encode_envelope` of a ``DueTimeReached``: the same bytes, faster.

    Every string in the event is a validated identifier, UUID or timestamp, none of which
    JSON escapes, so the text is written directly. An envelope holding anything but those
    types goes through the codec.
    """
    payload = envelope.payload
    aggregate_id = envelope.aggregate_id
    correlation_id = envelope.correlation_id
    if (
        type(payload) is not DueTimeReached
        or envelope.causation_id is not None
        or (aggregate_id is not None and type(aggregate_id) is not ServiceCallId)
        or type(envelope.timestamp_ms) is not int
        or payload.due_at.tzinfo is not UTC
        or payload.reached_at.tzinfo is not UTC
    ):
        return encode_envelope(envelope)
    tenant_id = payload.tenant_id
    head = f'{{"id":"{envelope.id}","type":"DueTimeReached","tenantId":"{tenant_id}",'
    if aggregate_id is not None:
        head += f'"aggregateId":"{aggregate_id}",'
    head += f'"timestampMs":{envelope.timestamp_ms},'
    if correlation_id is not None:
        head += f'"correlationId":"{correlation_id}",'
    return (
        f'{head}"payload":{{"_tag":"DueTimeReached","tenantId":"{tenant_id}",'
        f'"serviceCallId":"{payload.service_call_id}","dueAt":"{_utc_text(payload.due_at)}",'
        f'"reachedAt":"{_reached_text(payload.reached_at)}"}}}}'
    ).encode()
