"""Instances that hear each other on the ``LISTEN`` channel share the tenants out: each says
it is there, and claims its own tenants' timers first (rendezvous hashing)."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta

from timer_adapters_postgres._lanes import StatementLane
from timer_adapters_postgres._listener import ScheduleListener, peer_payload
from timer_adapters_postgres._sql import ANNOUNCE
from timer_core import StoreError

__all__ = ["HELP_BEHIND", "PEER_EVERY_S", "PEER_GONE_S", "Peers", "assigned"]

log = logging.getLogger(__name__)

# Instances say they are there this often on the LISTEN channel, and one not heard for
# PEER_GONE_S no longer owns tenants (see Peers.by_preference).
PEER_EVERY_S = 1.0
PEER_GONE_S = 3.5
# ... and another instance's tenant whose earliest timer waits this much longer than this
# instance's own earliest is claimed as if it were its own (the other is behind).
HELP_BEHIND = timedelta(seconds=1)


def assigned(tenant: str, owners: Sequence[str]) -> str:
    """The instance among ``owners`` that claims ``tenant`` first (rendezvous hashing)."""
    return max(owners, key=lambda owner: zlib.crc32(f"{owner}\0{tenant}".encode()))


class Peers:
    """The other instances one store shares the tenants with, as its listener hears them."""

    def __init__(self, owner_id: str, listener: Callable[[], ScheduleListener | None]) -> None:
        self._owner_id = owner_id
        self._listener = listener
        # The other instances the tenants were last shared with (None: no claim yet).
        self._sharing: tuple[str, ...] | None = None

    def forget(self) -> None:
        """Start afresh (the store closed): the next claim logs whom it shares with."""
        self._sharing = None

    @property
    def sharing_with(self) -> tuple[str, ...]:
        """The other instances heard on the ``LISTEN`` channel in the last ``PEER_GONE_S``
        (none when not listening)."""
        listener = self._listener()
        return () if listener is None else tuple(listener.peers(PEER_GONE_S))

    async def announce(self, lane: Callable[[], StatementLane | None], channel: str) -> None:
        """Say on the ``LISTEN`` channel that this instance is there, every ``PEER_EVERY_S``,
        while ``lane()`` gives a connection to say it on."""
        params = {"channel": channel, "payload": peer_payload(self._owner_id)}
        while (connection := lane()) is not None:
            try:
                await connection.execute("announce this instance", ANNOUNCE, params)
            except StoreError as exc:  # the others take its tenants over meanwhile
                log.debug("could not announce this instance: %s", exc)
            await asyncio.sleep(PEER_EVERY_S)

    def by_preference(
        self, tenants: list[str], earliest: Mapping[str, datetime]
    ) -> list[list[str]]:
        """``tenants`` (in their order) as this instance's own, then the others'.

        Instances that hear each other on the ``LISTEN`` channel (each says it is there
        every ``PEER_EVERY_S``) share the tenants out by rendezvous hashing over those heard
        in the last ``PEER_GONE_S``: each claims its own tenants' timers first and the
        others' only when its own cannot fill a batch, so no instance walks past the timers
        another one leased, nor works on the same pages. A tenant whose instance went quiet
        is taken over once it has not been heard for ``PEER_GONE_S``; one whose earliest
        due timer (``earliest``) waits ``HELP_BEHIND`` longer than this instance's own
        earliest is claimed as if it were this instance's own, so a slow instance's tenants
        do not fall behind the others'.
        """
        peers = self.sharing_with
        if peers != self._sharing:
            self._sharing = peers
            log.info(
                "%s shares the tenants with %s",
                self._owner_id,
                ", ".join(peers) if peers else "no other instance",
            )
        if not peers:
            return [tenants]
        owners = (self._owner_id, *peers)
        own = {tenant for tenant in tenants if assigned(tenant, owners) == self._owner_id}
        dues = [earliest[tenant] for tenant in own if tenant in earliest]
        if dues:
            behind = min(dues) - HELP_BEHIND
            own.update(t for t in tenants if t in earliest and earliest[t] < behind)
        return [[t for t in tenants if t in own], [t for t in tenants if t not in own]]
