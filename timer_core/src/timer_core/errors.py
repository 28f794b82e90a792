"""The error vocabulary of Timer: every adapter translates its driver's errors into these."""

from __future__ import annotations

__all__ = [
    "ComponentFailed",
    "ConfigurationError",
    "DecodeError",
    "HandlerFailed",
    "IllegalTransition",
    "InvalidIdentifier",
    "InvalidTimestamp",
    "NotRunning",
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


class TimerError(Exception):
    """Base class of every error Timer raises on purpose."""


class ValidationError(TimerError, ValueError):
    """A value from outside does not satisfy the contract."""


class InvalidIdentifier(ValidationError):
    """An identifier is not 1-128 characters of ``[A-Za-z0-9_-]`` (or not a UUID v7 for ids)."""


class InvalidTimestamp(ValidationError):
    """A timestamp is malformed, out of range, or has no time zone."""


class ConfigurationError(ValidationError):
    """A setting or constructor argument that cannot work: a URL where a file path is wanted,
    a directory that does not exist, an object of the wrong type. Raised at once, by the
    constructor, before any I/O; the message names the argument and what was expected."""


class DecodeError(ValidationError):
    """A message could not be decoded; ``field`` names the JSON path and ``reason`` says why.

    ``str(error)`` is one line, suitable for the ``Timer-Error`` dead-letter header.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}" if field else reason)


class IllegalTransition(TimerError):
    """A timer was asked to move between states in a way its state machine forbids."""


class StoreError(TimerError):
    """The timer store failed to read or write; the operation may be retried."""


class StoreUnavailable(StoreError):
    """The store is locked, full, closed or unreachable right now (transient)."""


class StoreInUse(StoreError):
    """Another :class:`~timer_core.Timer` fires this store's timers, in this process or
    another: a store that serves one firing Timer at a time (SQLite's, see
    :class:`~timer_core.ports.ExclusiveFiring`) refuses a second one when it starts, until the
    first is closed or its process has ended; and on every store, one store object given to a
    second Timer while the first runs is refused when the second starts. Scheduling and
    reading through the store (or another one on the same file) are never refused. The
    message names the fix; ``owner`` says who holds the store (``"process 1234"``,
    ``"this process"``)."""

    def __init__(self, message: str, owner: str) -> None:
        self.owner = owner
        super().__init__(message)


class SchemaVersionError(StoreError):
    """The database was written by a newer Timer than this one; refusing to touch it."""


class SchemaNotFound(StoreError):
    """The database holds no Timer schema, and the store was opened not to create one
    (``migrate=False``, as read-only tools open it)."""


class PublishError(TimerError):
    """An event was not acknowledged by the broker; the timer stays ``Scheduled``."""


class HandlerFailed(PublishError):
    """The host's handler (``Timer(store, handler=...)``) raised or timed out on a timer's
    ``DueTimeReached``: the in-process counterpart of an event the broker did not take. The
    timer stays ``Scheduled`` and is retried; the handler's own exception is the cause."""


class ComponentFailed(TimerError):
    """A component of a running :class:`~timer_core.Timer` (its worker or its command loop)
    stopped on its own; the cause is chained. Raised by ``Timer.wait()`` and on leaving
    ``async with Timer(...)``."""


class NotRunning(TimerError, RuntimeError):
    """A component was used before it was started (``await start()`` or ``async with``), or
    after it was closed; the message names the component and how to start it."""


class WaitTimedOut(TimerError, TimeoutError):
    """A test kit's wait (:mod:`timer_adapters_memory`) did not see what it waited for within
    its timeout; the message says what it waited for, what it saw, and the usual cause (a
    ``FakeClock`` nobody advanced)."""
