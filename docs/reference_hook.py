"""mkdocs hook: the ``timer_core`` API reference in pages by topic, main entry points first.

Each page under ``docs/reference/`` that holds ``<!-- api: TOPIC -->`` gets, in its place,
one mkdocstrings block per name of ``timer_core.__all__`` that :data:`TOPICS` files under
that topic, in that order. A name ``timer_core`` exports that no topic lists goes to the
``other`` topic, so a new export is documented somewhere the day it appears; a listed name
the package no longer exports is left out.
"""

from __future__ import annotations

import re
from typing import Any

import timer_core

TOPICS: dict[str, tuple[str, ...]] = {
    "runtime": (
        "Timer",
        "TimerHealth",
        "TimerEntry",
        "TimerState",
        "TimerKey",
        "TimerScheduler",
        "QuarantinedTimer",
        "schedule_timer",
        "cancel_timer",
        "scheduled_entry",
        "SystemClock",
        "Clock",
    ),
    "messages": (
        "MessageEnvelope",
        "MessageMetadata",
        "Message",
        "Command",
        "ScheduleTimer",
        "CancelTimer",
        "DueTimeReached",
        "TraceContext",
        "TenantId",
        "ServiceCallId",
        "CorrelationId",
        "CausationId",
        "EnvelopeId",
        "command_envelope",
        "build_due_event",
        "encode_envelope",
        "decode_envelope",
        "decode_command",
        "decode_event",
        "envelope_to_dict",
        "envelope_from_dict",
        "format_timestamp",
        "parse_timestamp",
        "to_epoch_ms",
        "from_epoch_ms",
        "floor_ms",
        "ceil_ms",
        "require_utc",
        "MAX_MESSAGE_BYTES",
        "TRACEPARENT_HEADER",
        "TRACESTATE_HEADER",
    ),
    "ports": (
        "TimerStore",
        "EventPublisher",
        "CommandSource",
        "CommandBatchHandler",
        "RemoteScheduleCallback",
        "EnvelopeIdGenerator",
        "Uuid7EnvelopeIds",
        "AsyncResource",
        "TimerOperation",
        "PositionedOperation",
        "CommandOutcome",
        "DueCursor",
        "PendingMark",
        "PublishError",
    ),
    "workflows": (
        "TimerWorker",
        "handle_commands",
        "fire_due_timers",
        "drain_due_timers",
        "DrainReport",
        "FiringReport",
        "rejection_reason",
        "Instrumentation",
        "NO_INSTRUMENTATION",
        "BatchObserver",
        "NO_BATCH_OBSERVER",
    ),
    "errors": (
        "TimerError",
        "ValidationError",
        "InvalidIdentifier",
        "InvalidTimestamp",
        "DecodeError",
        "IllegalTransition",
        "StoreError",
        "StoreUnavailable",
        "SchemaNotFound",
        "SchemaVersionError",
        "ComponentFailed",
        "redact_url",
        "REDACTED",
    ),
}

_MARKER = re.compile(r"^<!-- api: (\w+) -->$", re.MULTILINE)


def names(topic: str) -> list[str]:
    """The exported names a topic's page documents, in the page's order."""
    exported = list(timer_core.__all__)
    if topic == "other":
        listed = {name for group in TOPICS.values() for name in group}
        return [name for name in exported if name not in listed]
    return [name for name in TOPICS[topic] if name in exported]


def blocks(topic: str) -> str:
    """The mkdocstrings blocks of a topic, one per name."""
    return "\n\n".join(f"::: timer_core.{name}" for name in names(topic))


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(lambda match: blocks(match.group(1)), markdown)
