"""JSON encoding and decoding of envelopes, exactly as the wire contract writes them.

Decoding is total: any input either becomes a valid :class:`MessageEnvelope` or raises
:class:`~timer_core.errors.DecodeError`, whose one-line message names the field and why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar, cast

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from timer_core import _shortcuts
from timer_core._ids import (
    CausationId,
    CorrelationId,
    EnvelopeId,
    ServiceCallId,
    TenantId,
)
from timer_core._messages import (
    CancelTimer,
    Command,
    DueTimeReached,
    Message,
    MessageEnvelope,
    ScheduleTimer,
    require_position,
)
from timer_core._time import format_timestamp, parse_timestamp
from timer_core.errors import DecodeError, ValidationError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "decode_command",
    "decode_envelope",
    "decode_event",
    "encode_envelope",
    "envelope_from_dict",
    "envelope_to_dict",
]

#: Larger messages are rejected before JSON parsing (NATS' own default limit is 1 MiB).
MAX_MESSAGE_BYTES = 1024 * 1024
#: Objects and arrays nested deeper are rejected, whatever the interpreter's own recursion
#: limit lets ``json.loads`` read (Python 3.14's reads far deeper than 3.11's).
MAX_NESTING = 64

_T = TypeVar("_T")
_PAYLOAD_TYPES: dict[str, type[Message]] = {
    "ScheduleTimer": ScheduleTimer,
    "CancelTimer": CancelTimer,
    "DueTimeReached": DueTimeReached,
}
_WIRE_NAMES = {
    "tenant_id": "tenantId",
    "service_call_id": "serviceCallId",
    "due_at": "dueAt",
    "reached_at": "reachedAt",
}
_OPTIONAL_ENVELOPE_KEYS = ("aggregateId", "correlationId", "causationId")
_PAYLOAD_FIELDS = {
    tag: [
        _WIRE_NAMES.get(field.name, field.name)
        for field in attrs.fields(cls)
        if field.init and field.metadata.get("wire", True)
    ]
    for tag, cls in _PAYLOAD_TYPES.items()
}


@attrs.frozen
class _WireEnvelope:
    """The envelope's own fields as they stand in JSON, before cross-field checks."""

    id: EnvelopeId
    type: str
    tenantId: TenantId
    timestampMs: int
    payload: dict[str, Any]
    aggregateId: ServiceCallId | None = None
    correlationId: CorrelationId | None = None
    causationId: CausationId | None = None


def _strict(kind: type[_T], check: Callable[[Any], _T]) -> Callable[[Any, Any], _T]:
    def hook(value: Any, _: Any) -> _T:
        return check(value)

    return hook


def _int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {_json_type(value)}")
    if not -(2**53) < value < 2**53:
        raise ValueError(f"integer {value} is out of range")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_json_type(value)}")
    return value


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {_json_type(value)}")
    return value


def _timestamp(value: Any) -> datetime:
    if not isinstance(value, str):
        raise ValueError(f"expected an RFC 3339 string, got {_json_type(value)}")
    return parse_timestamp(value, round_up=True)


def _id_hook(kind: type[_T]) -> Callable[[Any, Any], _T]:
    def hook(value: Any, _: Any) -> _T:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {_json_type(value)}")
        return kind(value)  # type: ignore[call-arg]

    return hook


def _build_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False, detailed_validation=True)
    for kind in (TenantId, ServiceCallId, CorrelationId, CausationId, EnvelopeId):
        conv.register_structure_hook(kind, _id_hook(kind))
        conv.register_unstructure_hook(kind, str)
    conv.register_structure_hook(int, _strict(int, _int))
    conv.register_structure_hook(str, _strict(str, _str))
    conv.register_structure_hook_func(lambda t: t == dict[str, Any], _strict(dict, _object))
    conv.register_structure_hook(datetime, _strict(datetime, _timestamp))
    conv.register_unstructure_hook(datetime, format_timestamp)
    for tag, cls in _PAYLOAD_TYPES.items():
        renames = {
            field.name: override(rename=_WIRE_NAMES[field.name])
            for field in attrs.fields(cls)
            if field.name in _WIRE_NAMES
        }
        # Fields off the wire (ScheduleTimer.correlation_id) are neither read nor written.
        off_wire = {
            field.name: override(omit=True)
            for field in attrs.fields(cls)
            if not field.metadata.get("wire", True)
        }
        structure = make_dict_structure_fn(
            cls,
            conv,
            **renames,  # type: ignore[arg-type]
            **off_wire,  # type: ignore[arg-type]
        )
        conv.register_structure_hook(cls, structure)
        unstructure = make_dict_unstructure_fn(
            cls,
            conv,
            tag=override(omit=True),
            **renames,  # type: ignore[arg-type]
            **off_wire,  # type: ignore[arg-type]
        )
        conv.register_unstructure_hook(cls, _with_tag(tag, unstructure))
    return conv


def _with_tag(
    tag: str, unstructure: Callable[[Any], dict[str, Any]]
) -> Callable[[Any], dict[str, Any]]:
    def hook(payload: Any) -> dict[str, Any]:
        return {"_tag": tag, **unstructure(payload)}

    return hook


_converter = _build_converter()


def envelope_to_dict(envelope: MessageEnvelope[Any]) -> dict[str, Any]:
    """The envelope as the contract's JSON object; absent optional keys are omitted."""
    out: dict[str, Any] = {
        "id": str(envelope.id),
        "type": envelope.type,
        "tenantId": str(envelope.tenant_id),
    }
    if envelope.aggregate_id is not None:
        out["aggregateId"] = str(envelope.aggregate_id)
    out["timestampMs"] = envelope.timestamp_ms
    if envelope.correlation_id is not None:
        out["correlationId"] = str(envelope.correlation_id)
    if envelope.causation_id is not None:
        out["causationId"] = str(envelope.causation_id)
    out["payload"] = _converter.unstructure(envelope.payload)
    return out


def encode_envelope(envelope: MessageEnvelope[Any]) -> bytes:
    """UTF-8 JSON bytes of the envelope."""
    if type(envelope.payload) is DueTimeReached:
        # Once per timer fired: written directly (same bytes) when every field is canonical.
        encoded = _shortcuts.due_event(envelope)
        if encoded is not None:
            return encoded
    return _encode_envelope(envelope)


def _encode_envelope(envelope: MessageEnvelope[Any]) -> bytes:
    """The codec's own encoding, which :func:`_shortcuts.due_event` must equal."""
    return json.dumps(envelope_to_dict(envelope), separators=(",", ":")).encode()


def envelope_from_dict(obj: Any) -> MessageEnvelope[Message]:
    """Check a parsed JSON value against the contract and build the envelope it describes."""
    if not isinstance(obj, dict):
        raise DecodeError("$", f"expected a JSON object, got {_json_type(obj)}")
    for key in _OPTIONAL_ENVELOPE_KEYS:
        if key in obj and obj[key] is None:
            raise DecodeError(key, "must be omitted when absent, not null")
    wire = _structure(obj, _WireEnvelope, "")
    tag = wire.payload.get("_tag")
    if not isinstance(tag, str) or tag not in _PAYLOAD_TYPES:
        known = ", ".join(_PAYLOAD_TYPES)
        raise DecodeError("payload._tag", f"must be one of {known}, got {_show(tag)}")
    if wire.type != tag:
        raise DecodeError("type", f"{wire.type!r} does not match payload._tag {tag!r}")
    # Only the message's own fields: an unknown key is ignored even when it is null.
    for key in _PAYLOAD_FIELDS[tag]:
        if key in wire.payload and wire.payload[key] is None:
            raise DecodeError(f"payload.{key}", "must not be null")
    payload = _structure(wire.payload, _PAYLOAD_TYPES[tag], "payload.")
    if payload.tenant_id != wire.tenantId:
        raise DecodeError(
            "tenantId",
            f"envelope tenant {wire.tenantId!r} does not match payload tenant "
            f"{payload.tenant_id!r}",
        )
    if wire.aggregateId is not None and wire.aggregateId != payload.service_call_id:
        raise DecodeError(
            "aggregateId",
            f"{wire.aggregateId!r} does not match payload.serviceCallId "
            f"{payload.service_call_id!r}",
        )
    return MessageEnvelope(
        id=wire.id,
        payload=payload,
        timestamp_ms=wire.timestampMs,
        aggregate_id=wire.aggregateId,
        correlation_id=wire.correlationId,
        causation_id=wire.causationId,
    )


def decode_envelope(data: bytes | str) -> MessageEnvelope[Message]:
    """Decode any Timer message; raises :class:`DecodeError` on anything the contract forbids."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise DecodeError("$", f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        # json.loads would also guess UTF-16/32 from raw bytes; the contract says UTF-8 only.
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise DecodeError("$", _TOO_DEEP) from None
    except UnicodeDecodeError as exc:
        raise DecodeError("$", f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    except ValueError as exc:
        raise DecodeError("$", f"not valid JSON: {exc}") from None
    if _nested_too_deeply(obj):
        raise DecodeError("$", _TOO_DEEP)
    return envelope_from_dict(obj)


_TOO_DEEP = f"JSON is nested more than {MAX_NESTING} levels deep"


def _nested_too_deeply(obj: Any) -> bool:
    """Whether objects and arrays in ``obj`` nest deeper than :data:`MAX_NESTING`."""
    level, depth = ([obj] if isinstance(obj, dict | list) else []), 0
    while level:
        depth += 1
        if depth > MAX_NESTING:
            return True
        level = [
            child
            for value in level
            for child in (value.values() if isinstance(value, dict) else value)
            if isinstance(child, dict | list)
        ]
    return False


def decode_command(data: bytes | str, *, position: int | None = None) -> MessageEnvelope[Command]:
    """Decode a ``ScheduleTimer`` or ``CancelTimer``; an event here is a :class:`DecodeError`.

    ``position`` (where the command sits in its source's order, not on the wire) is set on
    the envelope as :meth:`MessageEnvelope.at_position` would, without a copy.
    """
    require_position(position)
    envelope = None
    if len(data) <= MAX_MESSAGE_BYTES:
        # Once per command stored: a plainly valid one (the form TimerClient writes) is read
        # several times faster than cattrs reads it, to the same envelope.
        envelope = _shortcuts.command(data, position)
    if envelope is None:
        envelope = _decode_command(data)
    # The exact form is built at its position; the others are given it here.
    return envelope if envelope.position == position else envelope.at_position(position)


def _decode_command(data: bytes | str) -> MessageEnvelope[Command]:
    """The codec's own reading of a command, which :func:`_shortcuts.command` must equal."""
    envelope = decode_envelope(data)
    if isinstance(envelope.payload, DueTimeReached):
        raise DecodeError("type", "DueTimeReached is an event, not a command")
    return cast(MessageEnvelope[Command], envelope)


def decode_event(data: bytes | str) -> MessageEnvelope[DueTimeReached]:
    """Decode a ``DueTimeReached`` event; a command here is a :class:`DecodeError`."""
    envelope = decode_envelope(data)
    if not isinstance(envelope.payload, DueTimeReached):
        raise DecodeError("type", f"{envelope.type} is a command, not an event")
    return cast(MessageEnvelope[DueTimeReached], envelope)


def _structure(obj: dict[str, Any], cls: type[_T], prefix: str) -> _T:
    try:
        return _converter.structure(obj, cls)
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        field, reason = _first_failure(exc)
        raise DecodeError(prefix + field if field else prefix.rstrip("."), reason) from None
    except ValidationError as exc:
        raise DecodeError(prefix.rstrip(".") or "$", str(exc)) from None


def _first_failure(exc: BaseException) -> tuple[str, str]:
    """Walk cattrs' exception group to the first leaf: its JSON path and its reason."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            name = ""
            for note in getattr(sub, "__notes__", ()):
                name = getattr(note, "name", "") or name
            field, reason = _first_failure(sub)
            wire = _WIRE_NAMES.get(name, name)
            return (f"{wire}.{field}" if field else wire), reason
        return "", str(exc)
    if isinstance(exc, KeyError):
        return "", "is required"
    return "", str(exc)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
