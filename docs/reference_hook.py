"""mkdocs hook: the API reference by topic, each package's main entry points first.

A page under ``docs/reference/`` that holds ``<!-- api: PACKAGE TOPIC -->`` gets, in its
place, one mkdocstrings block per name of ``PACKAGE.__all__`` that :data:`TOPICS` files
under that topic, in that order (not the alphabetical order of ``__all__``, which opens
with constants). A name a package exports that none of its topics lists goes to its
``other`` topic, so a new export is documented somewhere the day it appears; a listed name
the package no longer exports is left out.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

CORE: dict[str, tuple[str, ...]] = {
    "runtime": (
        "Timer",
        "TimerHealth",
        "TimerEntry",
        "TimerState",
        "TimerKey",
        "TimerScheduler",
        "QuarantinedTimer",
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
    ),
    "ports": (
        "TimerStore",
        "FindsDueByTenant",
        "LeasesClaims",
        "ReportsRemoteSchedules",
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
        "PublishError",
    ),
    "workflows": (
        "TimerWorker",
        "rejection_reason",
        "Instrumentation",
        "BatchObserver",
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
    ),
}

NATS: dict[str, tuple[str, ...]] = {
    "connecting": (
        "NatsBroker",
        "NatsSettings",
        "Subjects",
        "NatsConnection",
        "connect",
        "BrokerUnavailable",
    ),
    "producers": ("TimerClient", "CommandEnvelope"),
    "consumers": ("DueEventConsumer", "DueEventConsumerSettings", "DueEventDelivery"),
    "dead_letters": (
        "DeadLetters",
        "DeadLetter",
        "Replayed",
        "ERROR_HEADER",
        "ORIGINAL_SUBJECT_HEADER",
        "TRUNCATED_HEADER",
    ),
    "adapters": ("NatsEventPublisher", "NatsCommandSource", "AckedPublisher", "Outgoing", "Frame"),
    "embedded": ("NatsServerProcess", "NatsServerError", "find_nats_server"),
}

MEMORY: dict[str, tuple[str, ...]] = {
    "all": (
        "MemoryTimerClient",
        "FakeClock",
        "MemoryTimerStore",
        "MemoryEventBus",
        "MemorySubscription",
        "MemoryCommandSource",
    ),
}

#: Per package, its topics: each a tuple of exported names, in the order they are shown.
TOPICS: dict[str, dict[str, tuple[str, ...]]] = {
    "timer_core": CORE,
    "timer_adapters_nats": NATS,
    "timer_adapters_memory": MEMORY,
}

#: The heading level of each object, where a package's page groups them under ``##`` topics.
HEADING_LEVEL = {"timer_adapters_nats": 3}

#: A marker, with the heading just above it (left out with the marker when it has no names).
_MARKER = re.compile(r"^(## [^\n]*\n\n)?<!-- api: (\w+) (\w+) -->$", re.MULTILINE)


def names(package: str, topic: str) -> list[str]:
    """The exported names of ``package`` that a topic documents, in the page's order."""
    exported = list(importlib.import_module(package).__all__)
    if topic == "other":
        listed = {name for group in TOPICS[package].values() for name in group}
        return [name for name in exported if name not in listed]
    return [name for name in TOPICS[package][topic] if name in exported]


def blocks(package: str, topic: str) -> str:
    """The mkdocstrings blocks of a topic, one per name."""
    level = HEADING_LEVEL.get(package)
    options = f"\n    options:\n      heading_level: {level}" if level else ""
    return "\n\n".join(f"::: {package}.{name}{options}" for name in names(package, topic))


def _expand(match: re.Match[str]) -> str:
    heading, package, topic = match.groups()
    if not names(package, topic):
        return ""
    return (heading or "") + blocks(package, topic)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(_expand, markdown)
