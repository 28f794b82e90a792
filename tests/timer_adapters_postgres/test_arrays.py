"""The array literals the store sends instead of letting psycopg adapt lists element by
element: PostgreSQL reads back exactly the values given, whatever their characters."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timer_adapters_postgres._rows import int_array, text_array, timestamp_array

# PostgreSQL's text cannot hold NUL; anything else can be in a tracestate or an id.
TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)))


def read_back(sql: psycopg.Connection[Any], literal: str, kind: str) -> list[Any]:
    row = sql.execute(f"SELECT CAST(%s AS {kind}[])", (literal,)).fetchone()
    assert row is not None
    return list(row[0])


class TestTextArrays:
    def test_identifiers_quotes_backslashes_nulls_and_the_word_null(
        self, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        values = ["tenant-a", "", "NULL", None, 'say "hi"', "back\\slash", "a,b", "{x}", " sp "]
        assert read_back(postgres_sql, text_array(values), "text") == values

    def test_empty(self, postgres_sql: psycopg.Connection[Any]) -> None:
        assert read_back(postgres_sql, text_array([]), "text") == []

    # The connection only reads: nothing of one example is left for the next.
    @settings(
        max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(values=st.lists(st.one_of(st.none(), TEXT), max_size=8))
    def test_any_text(
        self, postgres_sql: psycopg.Connection[Any], values: list[str | None]
    ) -> None:
        assert read_back(postgres_sql, text_array(values), "text") == values


class TestOtherArrays:
    def test_timestamps_keep_their_instant_to_the_microsecond(
        self, postgres_sql: psycopg.Connection[Any]
    ) -> None:
        base = datetime(2026, 11, 24, 7, 40, 12, 345000, tzinfo=UTC)
        values = [
            base,
            base + timedelta(microseconds=1),
            datetime(1, 1, 1, tzinfo=UTC),
            base.astimezone(timezone(timedelta(hours=-5, minutes=-30))),
        ]
        assert read_back(postgres_sql, timestamp_array(values), "timestamptz") == values
        assert read_back(postgres_sql, timestamp_array([]), "timestamptz") == []

    def test_integers_and_nulls(self, postgres_sql: psycopg.Connection[Any]) -> None:
        values = [0, -1, None, 2**63 - 1, 7]
        assert read_back(postgres_sql, int_array(values), "bigint") == values
        assert read_back(postgres_sql, int_array([]), "bigint") == []
