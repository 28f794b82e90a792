"""Timer over NATS JetStream: commands in, ``DueTimeReached`` events out, as the contract says.

:class:`NatsConnection` is the connection every adapter here is built on; :class:`NatsBroker`
is one that also provisions the streams and the consumer, and hands out the
:class:`NatsEventPublisher` and the command source (:class:`TenantCommandSource`, a
consumer per tenant, or :class:`NatsCommandSource`, one shared consumer); hosts send commands with
:class:`TimerClient` (:class:`SyncTimerClient` from synchronous code) and read the
``DueTimeReached`` events with :meth:`NatsBroker.due_events`;
operators list and replay rejected commands with :class:`DeadLetters`;
:mod:`timer_adapters_nats.embedded` runs a real ``nats-server``.
"""

from timer_adapters_nats._acked import AckedPublisher, Frame, Outgoing
from timer_adapters_nats._broker import NatsBroker
from timer_adapters_nats._client import CommandEnvelope, TimerClient
from timer_adapters_nats._connection import BrokerUnavailable, NatsConnection, connect
from timer_adapters_nats._dead_letters import (
    ERROR_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    TRUNCATED_HEADER,
    DeadLetter,
    DeadLetters,
    Replayed,
)
from timer_adapters_nats._events import (
    DueEventConsumer,
    DueEventConsumerSettings,
    DueEventDelivery,
)
from timer_adapters_nats._lanes import CommandBacklog, TenantCommandSource, command_backlog
from timer_adapters_nats._publisher import NatsEventPublisher
from timer_adapters_nats._settings import NatsSettings, Subjects
from timer_adapters_nats._source import NatsCommandSource
from timer_adapters_nats._sync_client import SyncTimerClient
from timer_adapters_nats.embedded import NatsServerError, NatsServerProcess, find_nats_server

__all__ = [
    "ERROR_HEADER",
    "ORIGINAL_SUBJECT_HEADER",
    "TRUNCATED_HEADER",
    "AckedPublisher",
    "BrokerUnavailable",
    "CommandBacklog",
    "CommandEnvelope",
    "DeadLetter",
    "DeadLetters",
    "DueEventConsumer",
    "DueEventConsumerSettings",
    "DueEventDelivery",
    "Frame",
    "NatsBroker",
    "NatsCommandSource",
    "NatsConnection",
    "NatsEventPublisher",
    "NatsServerError",
    "NatsServerProcess",
    "NatsSettings",
    "Outgoing",
    "Replayed",
    "Subjects",
    "SyncTimerClient",
    "TenantCommandSource",
    "TimerClient",
    "command_backlog",
    "connect",
    "find_nats_server",
]
