"""Instants as Timer keeps them: aware UTC datetimes at millisecond precision, the contract's
ISO-8601 text and epoch milliseconds."""

from timer_core._time import (
    ceil_ms,
    floor_ms,
    format_timestamp,
    from_epoch_ms,
    parse_timestamp,
    require_utc,
    to_epoch_ms,
)

__all__ = [
    "ceil_ms",
    "floor_ms",
    "format_timestamp",
    "from_epoch_ms",
    "parse_timestamp",
    "require_utc",
    "to_epoch_ms",
]
