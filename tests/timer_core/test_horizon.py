"""timer_core.horizon: where the far edge goes, and when a find waits for it to move."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from timer_core.horizon import LEAD, FarEdge, edge_for

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


class _Store:
    """An advance that records its targets and stores the highest one."""

    def __init__(self) -> None:
        self.targets: list[datetime] = []
        self.stored: datetime | None = None
        self.gate = asyncio.Event()
        self.gate.set()
        self.called = asyncio.Event()
        self.fail = False

    async def advance(self, target: datetime) -> datetime | None:
        self.targets.append(target)
        self.called.set()
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("disk full")
        self.stored = target if self.stored is None else max(self.stored, target)
        return self.stored


def test_edges_fall_on_ten_minute_boundaries_20_to_30_minutes_ahead() -> None:
    """edge_for floors now + 30 min to a 10-minute boundary."""
    assert edge_for(T0) == T0 + timedelta(minutes=30)
    assert edge_for(T0 + timedelta(minutes=9, seconds=59)) == T0 + timedelta(minutes=30)
    assert edge_for(T0 + timedelta(minutes=10)) == T0 + timedelta(minutes=40)
    assert edge_for(T0 - timedelta(milliseconds=1)) == T0 + timedelta(minutes=20)


async def test_a_find_without_an_edge_or_past_it_waits_for_the_move() -> None:
    """With no edge known, or now at or past it, the move is awaited before the find."""
    store = _Store()
    far = FarEdge(store.advance)
    await far.before_find(T0)
    assert far.edge == T0 + timedelta(minutes=30)
    await far.before_find(T0 + timedelta(minutes=30))
    assert store.targets == [T0 + timedelta(minutes=30), T0 + timedelta(minutes=60)]
    assert far.edge == T0 + timedelta(minutes=60)


async def test_a_find_well_before_the_edge_moves_nothing() -> None:
    """Further than LEAD from the edge, a find costs no move at all."""
    store = _Store()
    far = FarEdge(store.advance)
    await far.before_find(T0)
    await far.before_find(far.edge - LEAD - timedelta(milliseconds=1))  # type: ignore[operator]
    assert len(store.targets) == 1


async def test_within_lead_of_the_edge_the_move_runs_beside_the_find() -> None:
    """Within LEAD of the edge a find does not wait: the move runs beside it, once."""
    store = _Store()
    far = FarEdge(store.advance)
    await far.before_find(T0)
    store.gate.clear()
    store.called.clear()
    near_edge = T0 + timedelta(minutes=25)
    await asyncio.wait_for(far.before_find(near_edge), 1)  # returns with the move blocked
    await asyncio.wait_for(store.called.wait(), 1)  # the move beside it has begun
    await far.before_find(near_edge)
    assert store.targets == [T0 + timedelta(minutes=30), edge_for(near_edge)]
    store.gate.set()
    await far.aclose()
    assert far.edge == edge_for(near_edge)


async def test_a_failed_move_beside_the_finds_is_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A move beside the finds that fails is logged; the next find starts another."""
    store = _Store()
    far = FarEdge(store.advance)
    await far.before_find(T0)
    store.fail = True
    await far.before_find(T0 + timedelta(minutes=25))
    await far.aclose()
    assert "moving the far edge" in caplog.text
    store.fail = False
    await far.before_find(T0 + timedelta(minutes=25))
    await far.aclose()
    assert far.edge == edge_for(T0 + timedelta(minutes=25))


async def test_the_edge_known_never_moves_back() -> None:
    """A store that reports an older edge (another moved it less far) leaves it."""
    store = _Store()
    far = FarEdge(store.advance)
    await far.before_find(T0 + timedelta(days=1))
    high = far.edge
    store.stored = None
    await far.move(T0 + timedelta(days=2))
    assert far.edge is not None and high is not None and far.edge > high
    await far.move(T0)
    assert far.edge == edge_for(T0 + timedelta(days=2))
