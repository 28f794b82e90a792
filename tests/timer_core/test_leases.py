"""The lease rules of a store several instances share, decided once in timer_core.leases."""

from __future__ import annotations

from datetime import UTC, datetime

import attrs
import pytest

from timer_core import TimerEntry
from timer_core.leases import Lease, claim_token

FREE = Lease()


class TestClaim:
    def test_a_free_timer_is_claimed_with_a_new_token(self) -> None:
        """A timer nobody holds is claimed for the lease, its token bumped."""
        assert FREE.claimed("a", 10.0, 30.0) == Lease("a", 40.0, 1)

    def test_another_owners_live_lease_is_not_claimable(self) -> None:
        """A lease is live up to and including its end; another owner cannot claim it."""
        held = FREE.claimed("a", 10.0, 30.0)
        assert not held.claimable_by("b", 40.0)
        with pytest.raises(ValueError, match="'b' cannot claim"):
            held.claimed("b", 40.0, 30.0)

    def test_an_expired_lease_is_claimable_by_anyone(self) -> None:
        """Once its lease ran out, another owner takes the timer over with the next token."""
        held = FREE.claimed("a", 10.0, 30.0)
        assert held.claimed("b", 40.001, 30.0) == Lease("b", 70.001, 2)

    def test_the_same_owner_claims_again_and_extends_its_lease(self) -> None:
        """A store re-claims its own timers: a new token and a lease from now."""
        held = FREE.claimed("a", 10.0, 30.0)
        assert held.claimed("a", 20.0, 30.0) == Lease("a", 50.0, 2)


class TestFence:
    def test_only_the_last_claim_settles(self) -> None:
        """A mark under the last claim counts, also after expiry while nobody claimed since;
        under an older claim, or another owner's, it does not."""
        first = FREE.claimed("a", 0.0, 1.0)
        assert first.settles("a", 1, 500.0)
        taken = first.claimed("b", 5.0, 1.0)
        assert not taken.settles("a", 1, 500.0)
        assert taken.settles("b", 2, 5.0)
        assert not taken.settles("a", 2, 5.0)

    def test_a_release_keeps_the_token_so_old_claims_stay_fenced(self) -> None:
        """Released, nobody holds the timer, but the claim released cannot settle again."""
        released = FREE.claimed("a", 0.0, 30.0).released()
        assert released == Lease(None, None, 1)
        assert released.claimable_by("b", 1.0)
        assert not released.settles("a", 1, 1.0)

    def test_an_unclaimed_mark_waits_for_nobody_to_hold_the_timer(self) -> None:
        """Without a claim, a mark counts only while no other owner holds a live lease."""
        held = FREE.claimed("a", 0.0, 30.0)
        assert not held.settles("b", None, 10.0)
        assert held.settles("a", None, 10.0)
        assert held.settles("b", None, 31.0)
        assert FREE.settles("b", None, 0.0)


class TestClaimToken:
    def test_the_token_is_an_int_claim_else_none(self) -> None:
        """An entry's claim is a lease token only when it is an int."""
        entry = TimerEntry(
            tenant_id="t",
            service_call_id="c",
            due_at=datetime(2030, 1, 1, tzinfo=UTC),
            registered_at=datetime(2030, 1, 1, tzinfo=UTC),
        )
        assert claim_token(attrs.evolve(entry, claim=7)) == 7
        assert claim_token(entry) is None
        assert claim_token(attrs.evolve(entry, claim="other-kind")) is None
        assert claim_token(attrs.evolve(entry, claim=True)) is None
