"""Instances that hear each other on the LISTEN channel share the tenants out: each claims
its own tenants' timers first, the others' only for what its own leave of a batch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest

from timer_adapters_postgres import PostgresTimerStore, _listener, _peers
from timer_core import TimerEntry

MakeStore = Callable[..., Awaitable[PostgresTimerStore]]

NOW = datetime.now(UTC).replace(microsecond=0)
TENANTS = [f"tenant-{n:02d}" for n in range(12)]


def due(tenant: str, n: int, *, earlier_s: float = 0) -> TimerEntry:
    return TimerEntry(
        tenant_id=tenant,
        service_call_id=f"call-{n}",
        due_at=NOW - timedelta(seconds=60 - n + earlier_s),
        registered_at=NOW - timedelta(seconds=180),
    )


async def hear_each_other(*stores: PostgresTimerStore) -> None:
    """Wait until every store heard every other one (each announces itself every second;
    nothing signals "heard", so this looks at the listeners, within a few announcements)."""
    async with asyncio.timeout(10):
        for store in stores:
            others = {other.owner_id for other in stores if other is not store}
            assert store.listener is not None
            while not others <= set(store.listener.peers(_peers.PEER_GONE_S)):
                await asyncio.sleep(0.05)


def owned_by(owner: str, owners: tuple[str, ...]) -> set[str]:
    return {tenant for tenant in TENANTS if _peers.assigned(tenant, owners) == owner}


class TestTenantsSharedOut:
    async def test_each_instance_claims_its_own_tenants_first(
        self, make_started_store: MakeStore, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Two instances that hear each other claim disjoint tenants while their own fill a
        batch; the announcements wake no worker."""
        woken: list[datetime] = []
        a = await make_started_store(owner_id="instance-a", on_remote_schedule=woken.append)
        b = await make_started_store(owner_id="instance-b")
        await a.apply([due(tenant, n) for tenant in TENANTS for n in range(5)])
        await hear_each_other(a, b)
        owners = ("instance-a", "instance-b")
        mine, theirs = owned_by("instance-a", owners), owned_by("instance-b", owners)
        assert mine and theirs  # 12 tenants over two instances: each owns some
        with caplog.at_level(logging.INFO, logger=_peers.__name__):
            claimed_a = await a.find_due_by_tenant(NOW, 2 * len(mine), after={})
        assert "instance-a shares the tenants with instance-b" in caplog.messages
        claimed_b = await b.find_due_by_tenant(NOW, 2 * len(theirs), after={})
        assert {entry.tenant_id for entry in claimed_a} == mine
        assert {entry.tenant_id for entry in claimed_b} == theirs
        assert woken == []

    async def test_the_others_tenants_fill_what_its_own_leave(
        self, make_started_store: MakeStore
    ) -> None:
        """A batch its own tenants cannot fill takes the rest from the other's tenants."""
        a = await make_started_store(owner_id="instance-a")
        b = await make_started_store(owner_id="instance-b")
        await a.apply([due(tenant, n) for tenant in TENANTS for n in range(5)])
        await hear_each_other(a, b)
        claimed = await a.find_due_by_tenant(NOW, 100, after={})
        assert len(claimed) == 5 * len(TENANTS)
        assert {entry.tenant_id for entry in claimed} == set(TENANTS)

    async def test_the_others_tenants_that_wait_longer_are_helped(
        self, make_started_store: MakeStore
    ) -> None:
        """Tenants of another instance whose earliest timers wait more than _HELP_BEHIND
        longer than this instance's own share its batches as if they were its own (the other
        instance is slow), those only a little behind do not."""
        a = await make_started_store(owner_id="instance-a")
        b = await make_started_store(owner_id="instance-b")
        await hear_each_other(a, b)
        owners = ("instance-a", "instance-b")
        mine, theirs = owned_by("instance-a", owners), owned_by("instance-b", owners)
        lagging = set(sorted(theirs)[: len(theirs) // 2])
        slightly = theirs - lagging
        behind = _peers.HELP_BEHIND.total_seconds()
        await a.apply(
            [due(tenant, n) for tenant in mine for n in range(5)]
            + [due(tenant, n, earlier_s=behind * 30) for tenant in lagging for n in range(5)]
            + [due(tenant, n, earlier_s=behind / 2) for tenant in slightly for n in range(5)]
        )
        claimed = await a.find_due_by_tenant(NOW, 2 * len(mine | lagging), after={})
        assert {entry.tenant_id for entry in claimed} == mine | lagging

    async def test_an_instance_not_heard_for_a_while_owns_nothing(
        self,
        make_started_store: MakeStore,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Once the other instance has been quiet for PEER_GONE_S, its tenants are shared
        among those still heard, here all claimed by the one left, and the log says so."""
        a = await make_started_store(owner_id="instance-a")
        b = await make_started_store(owner_id="instance-b")
        await a.apply([due(tenant, n) for tenant in TENANTS for n in range(5)])
        await hear_each_other(a, b)
        await b.aclose()
        later = _listener.monotonic() + _peers.PEER_GONE_S + 1
        monkeypatch.setattr(_listener, "monotonic", lambda: later)
        with caplog.at_level(logging.INFO, logger=_peers.__name__):
            claimed = await a.find_due_by_tenant(NOW, 2 * len(TENANTS), after={})
        assert {entry.tenant_id for entry in claimed} == set(TENANTS)
        assert "instance-a shares the tenants with no other instance" in caplog.messages

    async def test_a_store_that_does_not_listen_shares_with_no_one(
        self, make_started_store: MakeStore
    ) -> None:
        """Without LISTEN there is no one to hear: every due tenant shares each batch."""
        a = await make_started_store(owner_id="instance-a", listen=False)
        b = await make_started_store(owner_id="instance-b")
        await a.apply([due(tenant, n) for tenant in TENANTS for n in range(5)])
        assert b.listener is not None
        claimed = await a.find_due_by_tenant(NOW, 2 * len(TENANTS), after={})
        assert {entry.tenant_id for entry in claimed} == set(TENANTS)
