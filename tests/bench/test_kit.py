"""The benchmark kit's shared helpers: the statistics every figure rests on, and the order in
which alternated rounds run."""

from __future__ import annotations

import asyncio

from timer_bench import kit


class TestStatistics:
    def test_percentiles_are_nearest_rank(self) -> None:
        """p50 and p99 of 1..100 are 50 and 99, the max 100, the count 100."""
        assert kit.percentiles([float(x) for x in range(100, 0, -1)]) == {
            "count": 100,
            "p50_ms": 50.0,
            "p99_ms": 99.0,
            "max_ms": 100.0,
        }

    def test_median_ratio_is_of_the_rounds_own_ratios(self) -> None:
        """The median of per-round ratios, not the ratio of the medians: a slow round slows
        both of its sides and leaves its ratio alone."""
        assert kit.median_ratio([10.0, 100.0, 30.0], [10.0, 50.0, 20.0]) == 1.5
        assert kit.median([10.0, 100.0, 30.0]) / kit.median([10.0, 50.0, 20.0]) == 1.5
        assert kit.median_ratio([10.0, 20.0, 90.0], [10.0, 10.0, 90.0]) == 1.0

    def test_median_round_is_the_lower_middle_one(self) -> None:
        """Of an even count of rounds, the lower of the two middle ones is reported."""
        assert kit.median_round([4, 1, 3, 2], key=float) == 2


class TestAlternatedRounds:
    def test_sides_alternate_and_rotate(self) -> None:
        """Every side once a round, A, B, C then B, C, A: load from elsewhere hits all alike."""
        calls: list[tuple[str, int]] = []

        async def measure(side: str, round_: int) -> str:
            calls.append((side, round_))
            return f"{side}{round_}"

        taken = asyncio.run(kit.alternated(2, ["a", "b", "c"], measure))
        assert calls == [("a", 1), ("b", 1), ("c", 1), ("b", 2), ("c", 2), ("a", 2)]
        assert taken == [{"a": "a1", "b": "b1", "c": "c1"}, {"a": "a2", "b": "b2", "c": "c2"}]

    def test_a_yardstick_can_stay_first(self) -> None:
        """Without rotation the first side (a yardstick) runs right before the others."""
        calls: list[str] = []

        async def measure(side: str, round_: int) -> None:
            calls.append(side)

        asyncio.run(kit.alternated(2, ["raw", "timer"], measure, rotate=False))
        assert calls == ["raw", "timer", "raw", "timer"]

    def test_a_yardstick_can_lead_while_the_others_rotate(self) -> None:
        """With ``lead=1`` the yardstick runs first in every round and the versions it
        measures take turns to follow it."""
        calls: list[str] = []

        async def measure(side: str, round_: int) -> None:
            calls.append(side)

        asyncio.run(kit.alternated(2, ["raw", "new", "old"], measure, lead=1))
        assert calls == ["raw", "new", "old", "raw", "old", "new"]


class TestFormats:
    def test_stamps_read_back(self) -> None:
        """A stamp is the wire's UTC text, and reads back as the same epoch milliseconds."""
        assert kit.stamp(1_893_456_000_123) == "2030-01-01T00:00:00.123Z"
        assert kit.epoch_ms(kit.stamp(1_893_456_000_123)) == 1_893_456_000_123

    def test_markdown_table_aligns_each_column(self) -> None:
        """One header, one rule with the columns' alignment, one line a row."""
        table = kit.markdown_table("a | b", [("x", 1)], "lr")
        assert table == "| a | b |\n| --- | ---: |\n| x | 1 |"

    def test_the_machine_names_its_load(self) -> None:
        """A described machine says its cores and its load, so a shared machine shows."""
        machine = {"nproc": 2, "cpu": "CPU", "python": "3.11.7", "sqlite": "3.40.1"}
        text = kit.describe_machine({**machine, "load_average_start": [6.5]}, versions=["sqlite"])
        assert text == "2 cores (CPU), Python 3.11.7, SQLite 3.40.1; load average 6.5 at the start"
