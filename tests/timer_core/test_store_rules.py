"""The rules a store applies, decided in timer_core: a batch's replay and the fair share."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from timer_core import (
    CommandOutcome,
    PositionedOperation,
    ServiceCallId,
    TenantId,
    TimerEntry,
    TimerKey,
    TimerState,
)
from timer_core.fair_share import FairShare, longest_waiting_first, shares
from timer_core.replay import StoredKey, StoredTimer, Tombstone, new_timers, replay

T0 = datetime(2030, 1, 1, tzinfo=UTC)
KEY = TimerKey(TenantId("tenant-a"), ServiceCallId("call-1"))


def timer(due: int, call: str = "call-1") -> TimerEntry:
    """A Scheduled timer of tenant-a due ``due`` seconds after T0."""
    return TimerEntry(
        tenant_id="tenant-a",
        service_call_id=call,
        due_at=T0 + timedelta(seconds=due),
        registered_at=T0,
    )


def at(position: int, operation: TimerEntry | TimerKey) -> PositionedOperation:
    """``operation`` at command ``position``, applied at T0."""
    return PositionedOperation(operation, position, T0)


class TestReplay:
    def test_a_new_key_is_inserted(self) -> None:
        """A schedule of a key holding nothing is an insert, SCHEDULED."""
        result = replay([timer(5)], {})
        assert result.outcomes == [CommandOutcome.SCHEDULED]
        assert result.inserts == [StoredTimer(timer(5), None)]
        assert result.updates == result.deletes == result.tombstones == []

    def test_a_scheduled_key_is_updated_with_its_position(self) -> None:
        """A positioned reschedule of a Scheduled timer updates it and stores the position."""
        stored = {KEY: StoredKey(TimerState.SCHEDULED, 3)}
        result = replay([at(4, timer(9))], stored)
        assert result.updates == [StoredTimer(timer(9), 4)]
        assert result.inserts == []

    def test_an_unpositioned_reschedule_keeps_the_stored_position(self) -> None:
        """A plain reschedule leaves the key's position as it is."""
        result = replay([timer(9)], {KEY: StoredKey(TimerState.SCHEDULED, 3)})
        assert result.updates == [StoredTimer(timer(9), 3)]

    def test_older_than_the_timer_or_the_tombstone_is_stale(self) -> None:
        """A position below the stored timer's or the tombstone's changes nothing."""
        result = replay([at(2, timer(9)), at(4, KEY)], {KEY: StoredKey(TimerState.SCHEDULED, 3, 5)})
        assert result.outcomes == [CommandOutcome.STALE, CommandOutcome.STALE]
        assert (result.inserts, result.updates, result.deletes, result.tombstones) == (
            [],
            [],
            [],
            [],
        )

    def test_a_positioned_schedule_of_a_reached_timer_leaves_its_position(self) -> None:
        """IGNORED_REACHED changes nothing, the key's position included: an older command
        after it is IGNORED_REACHED too, not STALE."""
        result = replay([at(9, timer(5)), at(7, timer(6))], {KEY: StoredKey(TimerState.REACHED, 1)})
        assert result.outcomes == [CommandOutcome.IGNORED_REACHED] * 2
        assert result.updates == []

    def test_a_positioned_cancel_deletes_and_leaves_a_tombstone(self) -> None:
        """A positioned cancel of a Scheduled timer deletes it and writes a tombstone."""
        result = replay([at(4, KEY)], {KEY: StoredKey(TimerState.SCHEDULED, 3)})
        assert result.outcomes == [CommandOutcome.CANCELLED]
        assert result.deletes == [KEY]
        assert result.tombstones == [Tombstone(KEY, 4, T0)]

    def test_a_cancel_of_an_unknown_key_still_orders_it(self) -> None:
        """A positioned cancel of nothing is CANCEL_NOOP, and an older schedule is STALE."""
        result = replay([at(4, KEY), at(3, timer(5))], {})
        assert result.outcomes == [CommandOutcome.CANCEL_NOOP, CommandOutcome.STALE]
        assert result.tombstones == [Tombstone(KEY, 4, T0)]
        assert result.inserts == []

    def test_a_plain_cancel_drops_the_timers_position(self) -> None:
        """A plain cancel takes the timer's position with it: an older positioned schedule
        then stores a new timer."""
        result = replay([KEY, at(2, timer(5))], {KEY: StoredKey(TimerState.SCHEDULED, 3)})
        assert result.outcomes == [CommandOutcome.CANCELLED, CommandOutcome.SCHEDULED]
        assert result.updates == [StoredTimer(timer(5), 2)]
        assert result.deletes == []

    def test_schedule_then_cancel_of_a_new_key_writes_nothing(self) -> None:
        """Later operations see earlier ones: nothing is left to write."""
        result = replay([timer(5), KEY], {})
        assert result.outcomes == [CommandOutcome.SCHEDULED, CommandOutcome.CANCELLED]
        assert (result.inserts, result.deletes) == ([], [])

    def test_bad_input_raises_before_anything_is_decided(self) -> None:
        """A Reached entry or a negative position is refused with ValueError."""
        with pytest.raises(ValueError, match="only Scheduled"):
            replay([timer(5).reach(T0 + timedelta(seconds=6))], {})
        with pytest.raises(ValueError, match="non-negative"):
            replay([at(-1, KEY)], {})

    def test_new_timers_only_for_distinct_schedules(self) -> None:
        """new_timers gives a batch of distinct schedules, and None for anything else."""
        assert new_timers([at(1, timer(5)), timer(6, "call-2")]) == [
            StoredTimer(timer(5), 1),
            StoredTimer(timer(6, "call-2"), None),
        ]
        assert new_timers([timer(5), timer(6)]) is None
        assert new_timers([timer(5), KEY]) is None


class TestFairShare:
    def test_shares_add_up_and_the_first_get_the_rest(self) -> None:
        """10 among 3 is 4, 3, 3; 2 among 3 is one each to the first two."""
        assert shares(10, ["a", "b", "c"]) == [("a", 4), ("b", 3), ("c", 3)]
        assert shares(2, ["a", "b", "c"]) == [("a", 1), ("b", 1)]
        assert shares(0, ["a"]) == []

    def test_longest_waiting_first_breaks_ties_by_tenant(self) -> None:
        """Tenants go by earliest due timer, then by id."""
        earliest = {"b": T0, "c": T0 - timedelta(seconds=1), "a": T0}
        assert longest_waiting_first(earliest) == ["c", "a", "b"]

    def test_what_a_tenant_leaves_goes_to_those_that_took_their_share(self) -> None:
        """A tenant short of its share drops out; the others share what it left."""
        plan = FairShare(10, ["a", "b"])
        assert plan.next_round() == [("a", 5), ("b", 5)]
        assert plan.took({"a": 2, "b": 5}) == ["b"]
        assert plan.next_round() == [("b", 3)]
        plan.took({"b": 3})
        assert plan.left == 0
        assert plan.next_round() == []
