"""The adapter page's example store and bindings, run as the conformance suites they claim to be.

The Python blocks of docs/adapters.md are executed here at import, and the test classes
they define are collected by pytest like any other: the page's store is certified by the
real ``TimerStoreContract``, not just shown.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.docs.markdown import DOCS, ROOT, parse
from timer_core import CommandOutcome, PositionedOperation, TimerEntry, TimerKey, TimerOperation
from timer_core.replay import Tombstone
from timer_core.testing import TimerStoreContract


def _page_namespace() -> dict[str, Any]:
    document = parse(DOCS / "adapters.md")
    for example in document.examples():
        example.evaluate()
    return document.namespace


_namespace = _page_namespace()
TestDictTimerStore = _namespace["TestDictTimerStore"]
TestMemoryEventBus = _namespace["TestMemoryEventBus"]


def test_the_example_store_passes_mypy_strict(tmp_path: Path) -> None:
    """The page's DictTimerStore block, saved as a module, passes ``mypy --strict``."""
    module = tmp_path / "dict_timer_store.py"
    module.write_text(_store_block())
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(module)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _store_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "adapters.md").read_text(), re.S)
    (store,) = [block for block in blocks if "class DictTimerStore(TimerStore)" in block]
    return str(store)


def test_the_example_store_is_short_and_decides_no_outcome() -> None:
    """The page's store is at most 120 lines and names no outcome: timer_core decides them."""
    store = _store_block()
    assert len(store.splitlines()) <= 120
    assert "CommandOutcome." not in store
    assert "replay(" in store


DictTimerStore = _namespace["DictTimerStore"]
Database = _namespace["Database"]


class _PurgeIgnoringItsLimit(DictTimerStore):  # type: ignore[misc,valid-type]
    async def purge_reached(self, reached_before: datetime, limit: int) -> int:
        purged: int = await super().purge_reached(reached_before, limit)
        old = [k for k, t in self._db.tombstones.items() if t.at < reached_before]
        for key in old:
            del self._db.tombstones[key]
        return purged + len(old)


class _KeepingTheCallersEntry(DictTimerStore):  # type: ignore[misc,valid-type]
    async def mark_reached(self, entries: Sequence[TimerEntry]) -> int:
        changed = 0
        for entry in entries:
            stored = self._db.timers.get(entry.key)
            if stored is not None and stored.is_scheduled and stored.due_at == entry.due_at:
                self._db.timers[entry.key] = entry
                changed += 1
        return changed


class _PositioningAReachedTimer(DictTimerStore):  # type: ignore[misc,valid-type]
    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        outcomes: list[CommandOutcome] = await super().apply(operations)
        for operation, outcome in zip(operations, outcomes, strict=True):
            if isinstance(operation, PositionedOperation) and outcome is (
                CommandOutcome.IGNORED_REACHED
            ):
                self._db.positions[operation.key] = operation.position
        return outcomes


class _PlainCancelKeepingThePosition(DictTimerStore):  # type: ignore[misc,valid-type]
    async def apply(self, operations: Sequence[TimerOperation]) -> list[CommandOutcome]:
        kept = {
            key: (self._db.positions.get(key), timer.registered_at)
            for key, timer in self._db.timers.items()
        }
        outcomes: list[CommandOutcome] = await super().apply(operations)
        for operation, outcome in zip(operations, outcomes, strict=True):
            if outcome is CommandOutcome.CANCELLED and isinstance(operation, tuple):
                position, at = kept.get(TimerKey(*operation), (None, None))
                if position is not None and at is not None:
                    key = TimerKey(*operation)
                    self._db.tombstones[key] = Tombstone(key, position, at)
        return outcomes


async def _failures(store_class: type[Any]) -> list[str]:
    """The TimerStoreContract tests (those of one started store) that ``store_class`` fails."""
    failed = []
    for name in dir(TimerStoreContract):
        test = getattr(TimerStoreContract, name)
        if not name.startswith("test_") or list(inspect.signature(test).parameters) != [
            "self",
            "store",
        ]:
            continue
        store = store_class(Database())
        await store.start()
        try:
            await test(TimerStoreContract(), store)
        except AssertionError:
            failed.append(name)
        finally:
            await store.aclose()
    return failed


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "bug",
    [
        _PurgeIgnoringItsLimit,
        _KeepingTheCallersEntry,
        _PositioningAReachedTimer,
        _PlainCancelKeepingThePosition,
    ],
)
async def test_the_suite_fails_a_store_with_a_known_bug(bug: type[Any]) -> None:
    """Each of four bugs a user's store could carry (a tombstone purge past its limit, a mark
    keeping the caller's entry, the two decided cases decided otherwise) fails the suite."""
    assert await _failures(bug)
    assert await _failures(DictTimerStore) == []
