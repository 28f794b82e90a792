"""The reference host: the ``timer-service`` command running Timer on SQLite or PostgreSQL and
NATS, configured from ``TIMER_*`` variables, with ``/healthz`` and ``/metrics``."""
