"""The checks of a numeric setting, written once: a wrong value is refused at once with a
:class:`~timer_core.errors.ValidationError` naming the setting and what it must be."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from timer_core.errors import ValidationError


def require_seconds(name: str, value: float) -> None:
    # bool is an int; NaN fails every comparison; infinity would never wake.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValidationError(f"{name} must be a positive number of seconds, got {value!r}")


def require_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"{name} must be a whole number of at least 1, got {value!r}")


def require_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValidationError(f"{name} must be between 0 and 1, got {value!r}")


def field_check(check: Callable[[str, Any], None]) -> Callable[[object, Any, Any], None]:
    """``check`` as an attrs validator: the field's name is the setting's."""
    return lambda _instance, attribute, value: check(attribute.name, value)
