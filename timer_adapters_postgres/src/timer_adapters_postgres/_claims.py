"""The claims one PostgreSQL store holds: each claimed timer's lease token, from ``find_due``
until its mark or release hands it back to fence them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import attrs

from timer_adapters_postgres._rows import due_order, entry_from_row
from timer_core import TimerEntry, TimerKey

__all__ = ["ClaimBook"]

# Keeps the book bounded when claims are taken over and never marked here.
_MOST_CLAIMS = 100_000


@attrs.frozen
class _Claim:
    token: int
    due_at: datetime


class ClaimBook:
    """The lease token of each timer this store claimed and has not marked or released."""

    def __init__(self) -> None:
        self._claims: dict[TimerKey, _Claim] = {}

    def clear(self) -> None:
        self._claims.clear()

    def track(self, rows: Sequence[Any]) -> list[TimerEntry]:
        """The claimed rows as entries in due order, their tokens kept for the fence."""
        claimed = sorted(
            ((entry_from_row(row), row.lease_token) for row in rows), key=lambda p: due_order(p[0])
        )
        for entry, token in claimed:
            self._claims.pop(entry.key, None)  # re-inserted last: the dict stays in claim order
            self._claims[entry.key] = _Claim(token, entry.due_at)
        while len(self._claims) > _MOST_CLAIMS:
            del self._claims[next(iter(self._claims))]
        return [entry for entry, _ in claimed]

    def hand_back(self, entries: Sequence[TimerEntry]) -> list[int | None]:
        """Each entry's token (None: not claimed here), no longer kept."""
        tokens: list[int | None] = []
        for entry in entries:
            claim = self._claims.pop(entry.key, None)
            tokens.append(None if claim is None else claim.token)
        return tokens
