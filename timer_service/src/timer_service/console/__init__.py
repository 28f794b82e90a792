"""The operator's web console: the census, a tenant's timers, one timer's story, quarantined
timers and dead letters, with retry and cancel; served under ``/console`` on the service's
HTTP endpoint when ``TIMER_CONSOLE`` is on (docs/operations.md)."""

from timer_service.console._app import Console

__all__ = ["Console"]
