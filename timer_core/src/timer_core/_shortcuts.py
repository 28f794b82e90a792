"""The codec's shortcuts for the messages Timer handles by the thousand: commands in and
``DueTimeReached`` out.

:func:`command` and :func:`due_event` give exactly what :mod:`timer_core.codec` gives,
several times faster, for the one canonical shape Timer's own writers produce
(``TimerClient``, the service), and None for anything else: the codec stays the only judge
of what is valid and the only author of error messages. Only the codec calls them, behind
``decode_command`` and ``encode_envelope``; tests in ``tests/timer_core`` hold the two equal.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from timer_core._ids import CausationId, CorrelationId, EnvelopeId, ServiceCallId, TenantId
from timer_core._messages import (
    CancelTimer,
    Command,
    DueTimeReached,
    MessageEnvelope,
    ScheduleTimer,
)
from timer_core._time import format_timestamp
from timer_core.errors import TimerError

__all__ = ["command", "due_event"]

# The one timestamp form Timer writes; anything else (offsets, other precisions) is the codec's.
# Hours 00-23 only: Python 3.14's fromisoformat reads 24:00 as the next midnight, which
# RFC 3339 and the codec refuse on every Python.
_CANONICAL_TIMESTAMP = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T(?:[01][0-9]|2[0-3]):[0-9]{2}:[0-9]{2}\.[0-9]{3}Z", re.ASCII
)
_ENVELOPE_KEYS = frozenset(
    ("id", "type", "tenantId", "aggregateId", "timestampMs", "correlationId", "causationId")
)
_SCHEDULE_KEYS = frozenset(("_tag", "tenantId", "serviceCallId", "dueAt"))
_CANCEL_KEYS = frozenset(("_tag", "tenantId", "serviceCallId"))
_OPTIONAL_IDS = ("aggregateId", "correlationId", "causationId")
_SAFE_INT = 2**53

_TOKEN = TenantId.pattern
# A command exactly as ``encode_envelope`` writes it (TimerClient's and the service's own
# form): the keys in that order, no whitespace, no escapes. One match checks every key,
# identifier and timestamp shape, so such a command needs neither a JSON parse nor the
# identifiers' own checks; the only checks left are the ones a pattern cannot make.
_EXACT_COMMAND = re.compile(
    rf'\{{"id":"(?P<id>{EnvelopeId.pattern})",'
    rf'"type":"(?P<type>ScheduleTimer|CancelTimer)",'
    rf'"tenantId":"(?P<tenant>{_TOKEN})",'
    rf'(?:"aggregateId":"(?P<aggregate>{_TOKEN})",)?'
    r'"timestampMs":(?P<ts>-?(?:0|[1-9][0-9]{0,15})),'
    rf'(?:"correlationId":"(?P<correlation>{_TOKEN})",)?'
    rf'(?:"causationId":"(?P<causation>{_TOKEN})",)?'
    r'"payload":\{"_tag":"(?P<tag>ScheduleTimer|CancelTimer)",'
    rf'"tenantId":"(?P<payload_tenant>{_TOKEN})",'
    rf'"serviceCallId":"(?P<call>{_TOKEN})"'
    r'(?:,"dueAt":"(?P<due>[0-9]{4}-[0-9]{2}-[0-9]{2}T(?:[01][0-9]|2[0-3]):[0-9]{2}:[0-9]{2}\.[0-9]{3}Z)")?'
    r"\}\}",
    re.ASCII,
)


def command(data: bytes | str, position: int | None = None) -> MessageEnvelope[Command] | None:
    """What the codec decodes from ``data`` when it is a plainly valid command, else None;
    in the exact form, built at ``position`` (checked by the caller), which the caller sets
    on any other.

    The caller has checked the size limit.
    """
    envelope = _exact_command(data, position)
    return envelope if envelope is not None else _canonical_command(data)


def _exact_command(
    data: bytes | str, position: int | None = None
) -> MessageEnvelope[Command] | None:
    """The envelope when ``data`` is a command in exactly the codec's own form, else None."""
    if len(data) > 2048:  # longer than any command of this form can be
        return None
    if isinstance(data, str):
        if not data.isascii():
            return None
        text = data
    else:
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            return None
    match = _EXACT_COMMAND.fullmatch(text)
    if match is None:
        return None
    (
        envelope_id,
        tag,
        tenant_text,
        aggregate,
        timestamp,
        correlation,
        causation,
        payload_tag,
        payload_tenant,
        call_text,
        due,
    ) = match.groups()
    if (
        payload_tag != tag
        or payload_tenant != tenant_text
        or (aggregate is not None and aggregate != call_text)
        or (due is None) != (tag == "CancelTimer")
    ):
        return None
    timestamp_ms = int(timestamp)
    if not -_SAFE_INT < timestamp_ms < _SAFE_INT:
        return None
    # Every identifier matched its type's pattern above: built without checking again.
    tenant_id = str.__new__(TenantId, tenant_text)
    service_call_id = str.__new__(ServiceCallId, call_text)
    command: Command
    if due is not None:
        try:  # the pattern admits impossible dates (month 13); the codec words that error
            due_at = datetime.fromisoformat(due)
        except ValueError:
            return None
        command = ScheduleTimer(tenant_id, service_call_id, due_at)
    else:
        command = CancelTimer(tenant_id, service_call_id)
    return MessageEnvelope(
        id=str.__new__(EnvelopeId, envelope_id),
        payload=command,
        timestamp_ms=timestamp_ms,
        aggregate_id=None if aggregate is None else service_call_id,
        correlation_id=(None if correlation is None else str.__new__(CorrelationId, correlation)),
        causation_id=None if causation is None else str.__new__(CausationId, causation),
        position=position,
    )


def _canonical_command(data: bytes | str) -> MessageEnvelope[Command] | None:
    """The envelope when ``data`` is a plainly valid command, else None (ask the codec)."""
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


class _LastStamp:
    """``format_timestamp`` remembering its last answer: a firing batch shares one ``reachedAt``."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        # One attribute, replaced whole, so threads never see a value with another's text.
        self._last: tuple[datetime | None, str] = (None, "")

    def __call__(self, value: datetime) -> str:
        last_value, text = self._last
        if value is not last_value:
            text = format_timestamp(value)
            self._last = (value, text)
        return text


_reached_text = _LastStamp()


def due_event(envelope: MessageEnvelope[DueTimeReached]) -> bytes | None:
    """What the codec encodes a ``DueTimeReached`` envelope to, or None (ask the codec).

    Every string in the event is a validated identifier, UUID or timestamp, none of which
    JSON escapes, so the text is written directly. An envelope holding anything but those
    types is left to the codec.
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
        return None
    tenant_id = payload.tenant_id
    # Joined, not an f-string: formatting the ids (str subclasses) costs a __format__ call
    # each, a quarter of the encoding's time, once per timer fired.
    return "".join(
        (
            '{"id":"',
            envelope.id,
            '","type":"DueTimeReached","tenantId":"',
            tenant_id,
            '",',
            "" if aggregate_id is None else '"aggregateId":"' + aggregate_id + '",',
            '"timestampMs":',
            str(envelope.timestamp_ms),
            ",",
            "" if correlation_id is None else '"correlationId":"' + correlation_id + '",',
            '"payload":{"_tag":"DueTimeReached","tenantId":"',
            tenant_id,
            '","serviceCallId":"',
            payload.service_call_id,
            '","dueAt":"',
            format_timestamp(payload.due_at),
            '","reachedAt":"',
            _reached_text(payload.reached_at),
            '"}}',
        )
    ).encode()
