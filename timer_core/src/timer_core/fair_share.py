"""How one claim of due timers is shared among tenants, so no tenant waits for another's backlog.

A store that claims by tenant (:class:`~timer_core.ports.ClaimsByTenant`) lists the tenants
with due timers, orders them with :func:`longest_waiting_first` and claims in the rounds a
:class:`FairShare` plans: the arithmetic and its tie-breaks are decided here, once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Generic, TypeVar

__all__ = ["FairShare", "longest_waiting_first", "shares"]

_Tenant = TypeVar("_Tenant", bound=str)


def longest_waiting_first(earliest: Mapping[_Tenant, datetime]) -> list[_Tenant]:
    """The tenants by their earliest due timer, earliest first; a tie goes by tenant id."""
    return sorted(earliest, key=lambda tenant: (earliest[tenant], tenant))


def shares(left: int, tenants: Sequence[_Tenant]) -> list[tuple[_Tenant, int]]:
    """Equal shares of ``left`` timers among ``tenants``, in their order.

    What does not divide evenly goes one each to the first tenants; when fewer timers are
    left than tenants, the first ``left`` tenants get one each and the others none (they are
    left out of the list). Every share is at least one, and the shares add up to ``left``.
    """
    if left <= 0 or not tenants:
        return []
    taking = tenants[:left]
    share, extra = divmod(left, len(taking))
    return [(tenant, share + 1 if i < extra else share) for i, tenant in enumerate(taking)]


class FairShare(Generic[_Tenant]):
    """One claim of up to ``limit`` timers shared among ``tenants`` (longest waiting first).

    Each round gives every tenant still in play an equal share of what is left
    (:func:`shares`); a tenant that took its whole share may have more and plays the next
    round for what the others left of theirs; one that took less has no more. The claim ends
    when ``limit`` timers are taken or no tenant is left in play, so fewer than ``limit`` come
    back only when no more are due::

        plan = FairShare(limit, tenants)
        while round := plan.next_round():
            plan.took(claim_shares(round))  # {tenant: how many it got}
    """

    def __init__(self, limit: int, tenants: Iterable[_Tenant]) -> None:
        self._left = limit
        self._playing = list(tenants)
        self._round: list[tuple[_Tenant, int]] = []

    @property
    def left(self) -> int:
        """How many timers the claim may still take."""
        return self._left

    def next_round(self) -> list[tuple[_Tenant, int]]:
        """Each tenant's share in the next round, in order; empty when the claim is done."""
        self._round = shares(self._left, self._playing)
        return self._round

    def took(self, taken: Mapping[_Tenant, int]) -> list[_Tenant]:
        """Record what each tenant of the round got; returns those that took their whole
        share (they play the next round)."""
        self._left -= sum(taken.values())
        self._playing = [tenant for tenant, share in self._round if taken.get(tenant, 0) >= share]
        return list(self._playing)
