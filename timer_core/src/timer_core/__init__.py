"""Timer's pure domain: timers, messages, ports and the runtime, with no I/O of its own.

Hosts run a :class:`Timer` over adapters (``timer_adapters_sqlite``, ``timer_adapters_nats``,
``timer_adapters_memory`` or their own) that implement :mod:`timer_core.ports`. This module
exports the domain, the runtime, the ports and the errors; the rest lives in submodules:
:mod:`timer_core.commands`, :mod:`timer_core.events` and :mod:`timer_core.firing` (the
workflows the runtime runs), :mod:`timer_core.replay` and :mod:`timer_core.fair_share` (the
rules a store applies), :mod:`timer_core.codec`, :mod:`timer_core.instants`,
:mod:`timer_core.trace`, :mod:`timer_core.redaction`, :mod:`timer_core.instrumentation` and
:mod:`timer_core.maintenance`.
"""

from timer_core._entry import TimerEntry, TimerKey, TimerState
from timer_core._ids import CausationId, CorrelationId, EnvelopeId, ServiceCallId, TenantId
from timer_core._messages import (
    CancelTimer,
    Command,
    DueTimeReached,
    Message,
    MessageEnvelope,
    MessageMetadata,
    ScheduleTimer,
    command_envelope,
)
from timer_core._runtime import Timer, TimerHealth
from timer_core._store_client import StoreClient
from timer_core._trace import TraceContext
from timer_core.errors import (
    ComponentFailed,
    ConfigurationError,
    DecodeError,
    HandlerFailed,
    IllegalTransition,
    InvalidIdentifier,
    InvalidTimestamp,
    NotRunning,
    PublishError,
    SchemaNotFound,
    SchemaVersionError,
    StoreError,
    StoreInUse,
    StoreUnavailable,
    TimerError,
    ValidationError,
    WaitTimedOut,
)
from timer_core.handlers import DueTimeBatchHandler, DueTimeHandler, HandlerSettings
from timer_core.instrumentation import BatchObserver, Instrumentation
from timer_core.ports import (
    AsyncResource,
    Clock,
    CommandBatchHandler,
    CommandOutcome,
    CommandSource,
    DatabaseWrapper,
    DueCursor,
    EnvelopeIdGenerator,
    EventPublisher,
    ExclusiveFiring,
    FindsDueByTenant,
    LeasesClaims,
    PendingTenant,
    PositionedOperation,
    RemoteScheduleCallback,
    ReportsRemoteSchedules,
    SharedClockStore,
    SystemClock,
    TimerCensus,
    TimerLookup,
    TimerOperation,
    TimerRecord,
    TimerScheduler,
    TimerStore,
    Uuid7EnvelopeIds,
    rejection_reason,
    tell_delivered,
    tell_results,
)
from timer_core.worker import QuarantinedTimer, TimerWorker

__all__ = [
    # the domain
    "CancelTimer",
    "CausationId",
    "Command",
    "CorrelationId",
    "DueTimeReached",
    "EnvelopeId",
    "Message",
    "MessageEnvelope",
    "NotRunning",
    "MessageMetadata",
    "ScheduleTimer",
    "ServiceCallId",
    "TenantId",
    "TimerEntry",
    "TimerKey",
    "TimerState",
    "TraceContext",
    "command_envelope",
    # the runtime
    "BatchObserver",
    "DueTimeBatchHandler",
    "DueTimeHandler",
    "HandlerSettings",
    "Instrumentation",
    "QuarantinedTimer",
    "Timer",
    "TimerHealth",
    "TimerWorker",
    # the ports
    "AsyncResource",
    "Clock",
    "CommandBatchHandler",
    "CommandOutcome",
    "CommandSource",
    "DatabaseWrapper",
    "DueCursor",
    "EnvelopeIdGenerator",
    "EventPublisher",
    "ExclusiveFiring",
    "FindsDueByTenant",
    "LeasesClaims",
    "PendingTenant",
    "PositionedOperation",
    "RemoteScheduleCallback",
    "ReportsRemoteSchedules",
    "SharedClockStore",
    "StoreClient",
    "SystemClock",
    "TimerCensus",
    "TimerLookup",
    "TimerOperation",
    "TimerRecord",
    "TimerScheduler",
    "TimerStore",
    "Uuid7EnvelopeIds",
    "rejection_reason",
    "tell_delivered",
    "tell_results",
    # the errors
    "ComponentFailed",
    "ConfigurationError",
    "DecodeError",
    "HandlerFailed",
    "IllegalTransition",
    "InvalidIdentifier",
    "InvalidTimestamp",
    "PublishError",
    "SchemaNotFound",
    "SchemaVersionError",
    "StoreError",
    "StoreInUse",
    "StoreUnavailable",
    "TimerError",
    "ValidationError",
    "WaitTimedOut",
]
