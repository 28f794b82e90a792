"""The lease rules a store shared by several instances follows: claim, expiry, re-claim, fence.

A leasing store (:class:`~timer_core.ports.LeasesClaims`) keeps one :class:`Lease` per
``Scheduled`` timer: who holds it, until when, and a token every claim bumps. The rules of
:class:`~timer_core.ports.LeasesClaims` are decided here, once; the memory store applies
them to its leases, and the PostgreSQL store's SQL states the same predicates on its lease
columns (``lease_owner``, ``lease_until``, ``lease_token``), checked against each other by
:class:`timer_core.testing.TimerStoreLeaseContract`.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from timer_core._entry import TimerEntry

__all__ = ["Lease", "claim_token"]


@attrs.frozen(slots=True)
class Lease:
    """Who holds a timer (``owner``) until when (``until``, on the clock the store's leases
    run on), and the ``token`` of the last claim. A released lease keeps its token, so a
    claim made before the release stays fenced."""

    owner: str | None = None
    until: float | None = None
    token: int = 0

    def held_by_another(self, owner: str, now: float) -> bool:
        """Whether another owner holds it at ``now`` (its lease has not run out: a lease is
        live up to and including its ``until``)."""
        return (
            self.owner is not None
            and self.owner != owner
            and self.until is not None
            and self.until >= now
        )

    def claimable_by(self, owner: str, now: float) -> bool:
        """Whether ``owner`` may claim it at ``now``: nobody holds it, its lease ran out, or
        ``owner`` holds it already (a store re-claims its own timers, extending the lease)."""
        return not self.held_by_another(owner, now)

    def claimed(self, owner: str, now: float, lease_s: float) -> Lease:
        """The lease after ``owner`` claims it at ``now`` for ``lease_s`` seconds: a new token.

        Raises ``ValueError`` when it is not :meth:`claimable_by` ``owner``.
        """
        if not self.claimable_by(owner, now):
            raise ValueError(f"{owner!r} cannot claim a timer {self.owner!r} holds")
        return Lease(owner, now + lease_s, self.token + 1)

    def released(self) -> Lease:
        """The lease given up (by a release, a mark or a reschedule): nobody holds it; the
        token stays, so an older claim is still fenced."""
        return Lease(None, None, self.token)

    def settles(self, owner: str, claim: Hashable | None, now: float) -> bool:
        """The fence: whether ``owner`` may mark (or release) the timer with an entry carrying
        ``claim`` (:attr:`TimerEntry.claim <timer_core.TimerEntry.claim>`).

        Under a claim, only while that very claim is the last one and ``owner``'s (nobody
        claimed the timer since, even if the lease ran out meanwhile). Without a claim (the
        entry was never claimed by this store), only while nobody else holds it.
        """
        if claim is None:
            return not self.held_by_another(owner, now)
        return self.owner == owner and self.token == claim


def claim_token(entry: TimerEntry) -> int | None:
    """The lease token a claimed entry carries, or None when it carries none (or another
    kind of store's claim, which is then treated as no claim)."""
    claim = entry.claim
    return claim if type(claim) is int else None
