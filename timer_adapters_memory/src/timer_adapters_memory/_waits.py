"""How the test kit waits: never forever. Each wait has a timeout (real seconds) and fails with
:class:`~timer_core.errors.WaitTimedOut` saying what it waited for and what it saw."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from timer_core import WaitTimedOut

__all__ = ["DEFAULT_TIMEOUT_S", "within"]

_T = TypeVar("_T")

#: How long a wait helper waits unless told otherwise (real seconds): far longer than any
#: in-memory step takes on a busy machine, far shorter than a test runner's own timeout.
DEFAULT_TIMEOUT_S = 10.0


async def within(waiting: Awaitable[_T], timeout: float | None, what: Callable[[], str]) -> _T:
    """``await waiting``, or raise :class:`WaitTimedOut` with ``what()`` after ``timeout``
    seconds (None waits forever, for a caller that really means it)."""
    if timeout is None:
        return await waiting
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    try:
        return await asyncio.wait_for(waiting, timeout)
    except TimeoutError:
        raise WaitTimedOut(f"gave up after {timeout:g} s: {what()}") from None
