"""Connecting to NATS: fail fast and clearly at start, then reconnect for as long as it takes."""

from __future__ import annotations

import asyncio
import logging

import nats
from nats.aio.client import Client

from timer_core import TimerError

__all__ = ["BrokerUnavailable", "connect"]

log = logging.getLogger(__name__)


class BrokerUnavailable(TimerError, ConnectionError):
    """The NATS server could not be reached (or JetStream is not enabled on it) at start."""


async def connect(
    url: str,
    *,
    connect_timeout_s: float,
    reconnect_wait_s: float = 0.5,
    ping_interval_s: float = 10.0,
    name: str | None = None,
) -> Client:
    """A connected client that reconnects forever; :class:`BrokerUnavailable` within the timeout.

    nats-py with unlimited reconnects would also retry the first connect forever, so the whole
    first attempt is bounded here and the half-made client closed on failure.
    """
    last_error: list[BaseException] = []
    connected = False

    async def on_error(error: Exception) -> None:
        if not connected:
            # The first connect's failures end in BrokerUnavailable, which names the last one.
            last_error.append(error)
            log.debug("NATS %s: %s", url, error or type(error).__name__)
        else:
            log.warning("NATS %s: %s", url, error or type(error).__name__)

    async def on_disconnected() -> None:
        if not nc.is_closed:  # also called when we close it ourselves
            log.warning("disconnected from NATS %s; reconnecting", url)

    async def on_reconnected() -> None:
        log.info("reconnected to NATS %s", nc.connected_url.geturl() if nc.connected_url else url)

    nc = Client()
    try:
        await asyncio.wait_for(
            nc.connect(
                servers=[part.strip() for part in url.split(",") if part.strip()],
                name=name,
                connect_timeout=connect_timeout_s,  # type: ignore[arg-type]
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
                max_reconnect_attempts=-1,
                ping_interval=ping_interval_s,  # type: ignore[arg-type]
                max_outstanding_pings=3,
                allow_reconnect=True,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            ),
            timeout=connect_timeout_s,
        )
        connected = True
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await _discard(nc)
        cause = last_error[-1] if last_error else exc
        reason = str(cause) or type(cause).__name__
        if isinstance(exc, TimeoutError) and not last_error:
            reason = "no answer"
        raise BrokerUnavailable(
            f"cannot connect to NATS at {url} within {connect_timeout_s:g}s: {reason}"
        ) from exc
    return nc


async def _discard(nc: Client) -> None:
    try:
        await nc.close()
    except Exception as exc:  # nothing useful to do with a half-made client's close error
        log.debug("closing an unconnected NATS client failed: %s", exc)
