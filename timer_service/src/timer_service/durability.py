"""Whether what the broker acknowledges is on disk: read at start, said in the log, on
``/healthz`` and in the console.

JetStream acknowledges a stored message before it forces it to disk, unless the server runs
with ``jetstream { sync_interval: always }``; until then a power loss (or an OS crash) of the
server can lose acknowledged commands and ``DueTimeReached`` events of timers already marked
``Reached``, which never fire again. The embedded server syncs before it acknowledges
(``TIMER_EMBEDDED_NATS_SYNC=always``, the default). Of an external server the service reads
what it can: the replicas of its events stream and, where ``TIMER_BROKER_MONITOR_URL`` names
the server's monitoring endpoint, its sync setting (``/varz``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Any

import attrs

from timer_service.settings import Settings

__all__ = ["BrokerDurability", "read_monitor", "read_durability"]

log = logging.getLogger(__name__)

#: nats-server's ``sync_interval`` default.
DEFAULT_SYNC_INTERVAL_S = 120.0


@attrs.frozen
class BrokerDurability:
    """What is known of how the broker keeps what it acknowledged."""

    embedded: bool
    replicas: int | None
    """The events stream's replicas (None: could not be read)."""
    sync_always: bool | None
    """Whether the server syncs every write before acknowledging it (None: not known)."""
    sync_interval_s: float | None = None
    """The server's ``sync_interval`` when it does not sync always (None: not known)."""
    unknown_because: str | None = None
    """Why the sync setting is not known, when it is not."""

    @property
    def on_disk(self) -> bool:
        """Whether an acknowledged event is on disk: the server syncs before acknowledging."""
        return self.sync_always is True

    def risk(self) -> str | None:
        """One line saying how acknowledged events can be lost on power loss, or None."""
        if self.on_disk:
            return None
        interval = self.sync_interval_s or DEFAULT_SYNC_INTERVAL_S
        what = (
            "acknowledged commands and DueTimeReached events of timers already marked "
            "Reached (which never fire again)"
        )
        replicas = self.replicas or 1
        if self.sync_always is None:
            where = (
                f"cannot tell whether the broker syncs to disk before it acknowledges "
                f"({self.unknown_because}); at nats-server's default (sync_interval "
                f"{interval:g}s) a power loss"
            )
        else:
            where = (
                f"the broker syncs to disk only every {interval:g}s (JetStream "
                "sync_interval), so a power loss"
            )
        if replicas >= 3:
            scope = f"of {replicas // 2 + 1} of the {replicas} servers at once"
        elif self.embedded:
            scope = "of this machine"
        else:
            scope = "of the server" if replicas == 1 else f"of the {replicas} servers at once"
        fix = (
            "TIMER_EMBEDDED_NATS_SYNC=always"
            if self.embedded
            else "jetstream { sync_interval: always } on every server"
        )
        return f"{where} {scope} can lose {what}; {fix} makes every acknowledgement mean on disk"

    def health(self) -> dict[str, object]:
        """The ``/healthz`` details: whether acknowledged events are known to be on disk."""
        details: dict[str, object] = {"broker_acks_on_disk": self.sync_always}
        risk = self.risk()
        if risk is not None:
            details["broker_durability"] = risk
        return details


def read_monitor(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The JetStream configuration the monitoring endpoint's ``/varz`` shows (blocking)."""
    with urllib.request.urlopen(url.rstrip("/") + "/varz", timeout=timeout_s) as response:
        varz = json.loads(response.read())
    config = varz.get("jetstream", {}).get("config")
    if not isinstance(config, dict):
        raise ValueError("its /varz shows no JetStream configuration")
    return config


async def read_durability(settings: Settings, replicas: int | None) -> BrokerDurability:
    """What the settings and the broker's monitoring endpoint tell of its durability."""
    if settings.embedded_broker:
        always = settings.embedded_nats_sync == "always"
        return BrokerDurability(
            embedded=True,
            replicas=replicas,
            sync_always=always,
            sync_interval_s=None if always else DEFAULT_SYNC_INTERVAL_S,
        )
    monitor = settings.broker_monitor_url
    if monitor is None:
        return BrokerDurability(
            embedded=False,
            replicas=replicas,
            sync_always=None,
            unknown_because="set TIMER_BROKER_MONITOR_URL to its monitoring endpoint to check",
        )
    try:
        config = await asyncio.to_thread(read_monitor, monitor)
    except (OSError, ValueError, urllib.error.URLError) as exc:
        return BrokerDurability(
            embedded=False,
            replicas=replicas,
            sync_always=None,
            unknown_because=f"TIMER_BROKER_MONITOR_URL: cannot read it: {exc}",
        )
    interval_ns = config.get("sync_interval")
    return BrokerDurability(
        embedded=False,
        replicas=replicas,
        sync_always=bool(config.get("sync_always", False)),
        sync_interval_s=interval_ns / 1e9 if isinstance(interval_ns, int) and interval_ns else None,
    )
