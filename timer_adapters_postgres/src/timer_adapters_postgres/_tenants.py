"""Claims shared among tenants (``find_due_by_tenant``): which tenants take part and in what
order here; how the claim is shared among them is timer_core.fair_share's to decide."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from time import monotonic
from typing import Any

import attrs

from timer_adapters_postgres._lanes import StatementLane
from timer_adapters_postgres._peers import Peers
from timer_adapters_postgres._rows import int_array, text_array, timestamp_array
from timer_adapters_postgres._sql import (
    CLAIM_BY_TENANT_SQL,
    CLAIM_FIRST_SQL,
    DUE_FITS_SQL,
    DUE_TENANTS_NEAR_SQL,
    DUE_TENANTS_SQL,
)
from timer_core import DueCursor, TenantId
from timer_core.fair_share import FairShare

__all__ = ["DUE_WALKED", "TENANTS_REUSED_S", "TenantClaims"]

# (When they were fewer than TENANTS_LISTED, i.e. every tenant with due timers, the next
# claims of the drain reuse the list for up to TENANTS_REUSED_S, less those whose share came
# back short: a claim is then one statement. A tenant that falls due meanwhile waits that
# long. The list costs a seek per tenant with pending timers, due or not: 27-48 ms at 1,000
# tenants and 10,000,000 pending, so it is listed whole, not a claim's worth of tenants at a
# time, and read again at most a few times a second however many claims a backlog takes.)
TENANTS_REUSED_S = 0.5
#: Most tenants one list holds (those waiting longest); a backlog over more is listed
#: again once these are served.
TENANTS_LISTED = 10_000
#: The most entries of the due index a list of the tenants due walks (the due timers, in due
#: order); a backlog over more is listed by a seek per tenant with pending timers instead.
DUE_WALKED = 2_000
_BEFORE_ALL = datetime(1, 1, 1, tzinfo=UTC)
_ACTION = "claim due timers by tenant"


@attrs.frozen
class _Listed:
    """The tenants a claim listed (all those due), for the next claims of the drain."""

    tenants: list[str]
    limit: int
    read_at: float  # time.monotonic()
    earliest: dict[str, datetime]


class TenantClaims:
    """One store's claims by tenant: the tenants due listed (or the last list reused), this
    instance's own first (:class:`Peers`), then every tenant's share in one statement a round.
    """

    def __init__(self, owner_id: str, lease: timedelta, peers: Peers) -> None:
        self._base = {"owner": owner_id, "lease": lease}
        self._peers = peers
        self._listed: _Listed | None = None

    def forget(self) -> None:
        """Drop the list of tenants (the store closed)."""
        self._listed = None

    async def claim(
        self, lane: StatementLane, now: datetime, limit: int, after: Mapping[TenantId, DueCursor]
    ) -> list[Any]:
        """The rows of up to ``limit`` due timers claimed, shared among tenants."""
        if not after:
            # A drain's first claim: when all that is due fits, it is claimed in due order
            # (those another instance holds are skipped), with no list of tenants at all.
            params = {**self._base, "now": now, "limit": limit}
            fits = await lane.fetch(_ACTION, DUE_FITS_SQL, params)
            if fits and fits[0][0]:
                self._listed = None
                return await lane.fetch(_ACTION, CLAIM_FIRST_SQL, params)
        claim = _Claim(lane, {**self._base, "now": now}, limit, after)
        listed, self._listed = self._listed, None
        read_at = monotonic()
        if listed is None or listed.limit != limit or read_at - listed.read_at >= TENANTS_REUSED_S:
            earliest = await _due_tenants(lane, now)
            listed = _Listed(list(earliest), limit, read_at, earliest)
        # Each tenant's claim starts at its earliest due timer as listed (or after its
        # cursor), not at the head of its range: the entries of its fired timers there stay
        # in the index until a vacuum. One stored meanwhile with an earlier due time waits
        # for the list to be read again (TENANTS_REUSED_S at most), or for a drain whose
        # first claim holds all that is due (claimed in due order, no list).
        claim.floors = listed.earliest
        # Every tenant due was listed: those not reached and those that fill their share
        # take part in the next claims.
        complete = len(listed.tenants) < TENANTS_LISTED
        again: list[str] = []
        # This instance's own tenants first, the others' only for what they leave.
        for group in self._peers.by_preference(listed.tenants, listed.earliest):
            if len(claim.rows) >= limit:
                again += group  # not reached: all of them may share the next claim
            else:
                again += await claim.take(group)
        if complete and len(claim.rows) >= limit and again:
            self._listed = _Listed(again, limit, listed.read_at, listed.earliest)
        return claim.rows


async def _due_tenants(lane: StatementLane, now: datetime) -> dict[str, datetime]:
    """The tenants with due timers (at most TENANTS_LISTED, those waiting longest) and the
    earliest due time of each, longest waiting first."""
    rows = await lane.fetch(_ACTION, DUE_TENANTS_NEAR_SQL, {"now": now, "walk": DUE_WALKED})
    if rows and rows[0].walked >= DUE_WALKED:
        # More due than the walk takes: a seek per tenant with pending timers instead. At
        # most TENANTS_LISTED, so a backlog over many tenants costs bounded memory.
        params = {"now": now, "limit": TENANTS_LISTED}
        rows = await lane.fetch(_ACTION, DUE_TENANTS_SQL, params)
    else:
        rows = sorted(rows, key=lambda row: (row.due_at, row.tenant_id))[:TENANTS_LISTED]
    return {row.tenant_id: row.due_at for row in rows}


class _Claim:
    """One claim by tenant under way: the rows claimed so far, each tenant's cursor."""

    def __init__(
        self,
        lane: StatementLane,
        base: dict[str, Any],
        limit: int,
        after: Mapping[TenantId, DueCursor],
    ) -> None:
        self._lane = lane
        self._base = base
        self._limit = limit
        self._cursors: dict[str, tuple[datetime, str]] = {
            tenant: (cursor.due_at, cursor.service_call_id) for tenant, cursor in after.items()
        }
        self.rows: list[Any] = []
        self.floors: Mapping[str, datetime] = {}
        """Each listed tenant's earliest due time: where its claim starts without a cursor."""

    async def take(self, active: list[str]) -> list[str]:
        """Claim shares of ``active``'s tenants, in the rounds timer_core's FairShare plans;
        the tenants the next claim may share among (those its first round left wanting)."""
        plan = FairShare(self._limit - len(self.rows), active)
        again: list[str] | None = None
        while shares := plan.next_round():
            tenants = [tenant for tenant, _ in shares]
            starts = [
                self._cursors.get(tenant) or (self.floors.get(tenant, _BEFORE_ALL), "")
                for tenant in tenants
            ]
            params = {
                **self._base,
                "tenants": text_array(tenants),
                "after_dues": timestamp_array([start[0] for start in starts]),
                "after_calls": text_array([start[1] for start in starts]),
                "shares": int_array([share for _, share in shares]),
            }
            by_tenant: dict[str, list[Any]] = {}
            for row in await self._lane.fetch(_ACTION, CLAIM_BY_TENANT_SQL, params):
                by_tenant.setdefault(row.tenant_id, []).append(row)
            for tenant in tenants:
                mine = sorted(
                    by_tenant.get(tenant, ()), key=lambda row: (row.due_at, row.service_call_id)
                )
                self.rows += mine
                if mine:
                    self._cursors[tenant] = (mine[-1].due_at, mine[-1].service_call_id)
            more = plan.took({tenant: len(mine) for tenant, mine in by_tenant.items()})
            if again is None:
                # Those not reached this claim first (the list is longest waiting first),
                # then those that took their whole share and may have more.
                again = active[len(tenants) :] + more
        return again or []
