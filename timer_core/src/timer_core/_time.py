"""UTC-only, millisecond-precision time: the one way Timer reads, writes and rounds instants."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from timer_core.errors import InvalidTimestamp

__all__ = [
    "ceil_ms",
    "floor_ms",
    "format_timestamp",
    "from_epoch_ms",
    "parse_timestamp",
    "require_utc",
    "to_epoch_ms",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)


def require_utc(value: datetime, what: str = "datetime") -> datetime:
    """Return ``value`` converted to UTC; a naive datetime is rejected, never guessed."""
    if value.__class__ is datetime and value.tzinfo is UTC:
        return value  # the hot path's case (every instant Timer makes), without utcoffset()
    if not isinstance(value, datetime):
        raise InvalidTimestamp(f"{what} must be a datetime, got {type(value).__name__}")
    offset = value.utcoffset()
    if offset is None:
        raise InvalidTimestamp(f"{what} has no time zone (naive datetimes are rejected)")
    if offset or value.tzinfo is not UTC:
        try:
            value = value.astimezone(UTC)
        except OverflowError:
            raise InvalidTimestamp(f"{what} {value.isoformat()} is out of range in UTC") from None
    return value


def is_utc_ms(value: datetime) -> bool:
    """Whether ``value`` is already an instant as Timer keeps them: a plain datetime in
    UTC at millisecond precision (what the converters would return unchanged)."""
    return value.__class__ is datetime and value.tzinfo is UTC and not value.microsecond % 1000


def floor_ms(value: datetime) -> datetime:
    """Drop sub-millisecond precision (used for 'now': never later than the real instant)."""
    rest = value.microsecond % 1000
    # Most instants are read back at milliseconds already: no new datetime for those.
    return value.replace(microsecond=value.microsecond - rest) if rest else value


def ceil_ms(value: datetime) -> datetime:
    """Round up to the millisecond (used for due times: a timer never fires early)."""
    rest = value.microsecond % 1000
    if rest == 0:
        return value
    try:
        return value.replace(microsecond=value.microsecond - rest) + _ONE_MS
    except OverflowError:
        # Only the last millisecond of year 9999 gets here: there is no later one.
        raise InvalidTimestamp(
            f"{value.isoformat()} rounds up to the next millisecond, past the last "
            "instant a datetime can hold"
        ) from None


def parse_timestamp(text: str, *, round_up: bool = False) -> datetime:
    """Parse an RFC 3339 timestamp with ``Z`` or a numeric offset into an aware UTC datetime.

    Sub-millisecond digits are dropped, or rounded up with ``round_up`` (for due times).
    """
    if not isinstance(text, str):
        raise InvalidTimestamp(f"expected an RFC 3339 string, got {type(text).__name__}")
    match = _RFC3339.fullmatch(text)
    if match is None:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?", text[:40]):
            raise InvalidTimestamp(f"timestamp {text[:40]!r} has no time zone")
        raise InvalidTimestamp(f"{_shorten(text)!r} is not an RFC 3339 timestamp")
    year, month, day, hour, minute, second, frac, zulu, sign, oh, om = match.groups()
    digits = (frac or "").ljust(9, "0")
    micro = int(digits[:6])
    extra = int(digits[6:]) > 0
    try:
        value = datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            micro,
            tzinfo=UTC,
        )
        if not zulu:
            offset = timedelta(hours=int(oh), minutes=int(om))
            if offset >= timedelta(hours=24):
                raise InvalidTimestamp(f"timestamp {text!r} has an offset out of range")
            value = value - offset if sign == "+" else value + offset
        if round_up:
            if extra:
                value = value + timedelta(microseconds=1)
            return ceil_ms(value)
        return floor_ms(value)
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, InvalidTimestamp):
            raise
        raise InvalidTimestamp(f"timestamp {text!r} is out of range: {exc}") from None


def format_timestamp(value: datetime) -> str:
    """Write ``YYYY-MM-DDTHH:MM:SS.sssZ`` (UTC, milliseconds); sortable as text."""
    value = require_utc(value)
    if value.__class__ is datetime:
        # isoformat() writes `YYYY-MM-DDTHH:MM:SS.ffffff+00:00` in C, with no fraction when it
        # is zero: cut to milliseconds, this is a fifth of the fields' formatting below (once
        # per timer stored, published or marked).
        text = value.isoformat()
        return text[:23] + "Z" if len(text) == 32 else text[:19] + ".000Z"
    return (
        f"{value.year:04d}-{value.month:02d}-{value.day:02d}T{value.hour:02d}:"
        f"{value.minute:02d}:{value.second:02d}.{value.microsecond // 1000:03d}Z"
    )


def to_epoch_ms(value: datetime) -> int:
    """Milliseconds since the Unix epoch, rounded down."""
    delta = require_utc(value) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def from_epoch_ms(ms: int) -> datetime:
    """The UTC instant ``ms`` milliseconds after the Unix epoch."""
    return _EPOCH + timedelta(milliseconds=ms)


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
