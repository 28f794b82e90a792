"""Validated identifiers: strings that are safe as NATS subject tokens and SQL keys."""

from __future__ import annotations

import hashlib
import re
from typing import ClassVar, Self

import uuid_utils

from timer_core.errors import InvalidIdentifier

__all__ = [
    "CausationId",
    "CorrelationId",
    "EnvelopeId",
    "ServiceCallId",
    "TenantId",
]

_TOKEN_PATTERN = r"[A-Za-z0-9_-]{1,128}"
_UUID7_PATTERN = r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
_TOKEN = re.compile(_TOKEN_PATTERN)
_UUID7 = re.compile(_UUID7_PATTERN)


class _Token(str):
    """A string of 1 to 128 characters from ``[A-Za-z0-9_-]``, checked on construction."""

    __slots__ = ()
    kind: ClassVar[str] = "identifier"
    #: The regular expression a value must match in full (for decoders that check a whole
    #: message with one pattern and then build ids with ``str.__new__``).
    pattern: ClassVar[str] = _TOKEN_PATTERN

    def __new__(cls, value: str) -> Self:
        if type(value) is cls:
            return value
        if not isinstance(value, str):
            raise InvalidIdentifier(f"{cls.kind} must be a string, got {type(value).__name__}")
        if _TOKEN.fullmatch(value) is None:
            raise InvalidIdentifier(
                f"{cls.kind} must be 1-128 characters of [A-Za-z0-9_-], got {_show(value)}"
            )
        return super().__new__(cls, value)


class TenantId(_Token):
    """The tenant a timer belongs to; every store query but the poller's is scoped by it."""

    __slots__ = ()
    kind = "tenantId"


class ServiceCallId(_Token):
    """The service call a timer is for; with the tenant, the timer's key."""

    __slots__ = ()
    kind = "serviceCallId"


class CorrelationId(_Token):
    """The request trace id carried from the ``ScheduleTimer`` to its ``DueTimeReached``."""

    __slots__ = ()
    kind = "correlationId"


class CausationId(_Token):
    """The id of the message that caused this one."""

    __slots__ = ()
    kind = "causationId"


class EnvelopeId(str):
    """A message id: a lowercase UUID version 7 string."""

    __slots__ = ()
    #: The regular expression a value must match in full.
    pattern: ClassVar[str] = _UUID7_PATTERN

    def __new__(cls, value: str) -> Self:
        if type(value) is cls:
            return value
        if not isinstance(value, str):
            raise InvalidIdentifier(f"id must be a string, got {type(value).__name__}")
        if _UUID7.fullmatch(value) is None:
            raise InvalidIdentifier(f"id must be a lowercase UUID v7, got {_show(value)}")
        return super().__new__(cls, value)

    @classmethod
    def generate(cls) -> EnvelopeId:
        """A fresh, time-ordered UUID v7."""
        return str.__new__(cls, str(uuid_utils.uuid7()))

    @classmethod
    def for_firing(cls, tenant_id: str, service_call_id: str, due_at_ms: int) -> EnvelopeId:
        """The id of the firing of one timer at one due time: the same on every re-publish.

        A UUID v7 whose time field is the due time and whose random bits are a SHA-256 of the
        timer key and due time, so every instance and every restart computes the same id
        without storing it (contract, semantics 6).
        """
        # Joined, not an f-string: the ids are str subclasses, which an f-string formats
        # through a __format__ call each (once per timer fired). The id is cut from the hex
        # digest rather than from bytes rebuilt and hexed again: a third of the cost.
        digest = _sha256("\x00".join((tenant_id, service_call_id, str(due_at_ms))).encode())
        hex_digest = digest.hexdigest()
        ms = f"{min(max(due_at_ms, 0), _MAX_MS):012x}"
        # 48 bits of time; version 7 and the low 12 bits of the digest's first two bytes;
        # variant 0b10 and the low 62 bits of its next eight.
        return str.__new__(
            cls,
            f"{ms[:8]}-{ms[8:]}-7{hex_digest[1:4]}-{_VARIANT[hex_digest[4]]}{hex_digest[5:8]}"
            f"-{hex_digest[8:20]}",
        )


#: The first hex digit of the variant byte: ``0b10`` over the digest's two low bits of it.
_VARIANT = {digit: "89ab"[int(digit, 16) & 0b11] for digit in "0123456789abcdef"}
_MAX_MS = (1 << 48) - 1
_sha256 = hashlib.sha256


def _show(value: str) -> str:
    return repr(value) if len(value) <= 40 else repr(value[:40]) + f"... ({len(value)} chars)"
