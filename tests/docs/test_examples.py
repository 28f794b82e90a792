"""Every code example in docs/ and the README runs, so the documentation cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.markdown import DOCUMENTS, ROOT, fences_without_language, parse
from timer_adapters_nats.embedded import NatsServerProcess
from timer_adapters_sqlite import SqliteTimerStore


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


async def _seed_service_database(directory: Path) -> None:
    """A ``timer.db`` as the service leaves it: for pages that operate on one."""
    from datetime import UTC, datetime, timedelta

    from timer_core import TimerEntry

    now = datetime.now(UTC).replace(microsecond=0)
    async with SqliteTimerStore(directory / "timer.db") as store:
        fired = TimerEntry(
            "tenant-a", "call-1", now - timedelta(minutes=5), now - timedelta(hours=1)
        )
        await store.apply([fired, TimerEntry("tenant-a", "call-2", now + timedelta(hours=1), now)])
        await store.mark_reached([fired.reach(now - timedelta(minutes=5))])


class TestExamples:
    @pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
    def test_python_and_json_blocks_run_twice_in_one_folder(
        self, path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each Python block runs in order in one namespace, each JSON block is valid, and
        the page's examples run again in the same folder: a reader who runs an example
        twice finds it works twice (fresh keys, servers stopped), not a hang."""
        import asyncio

        monkeypatch.chdir(tmp_path)
        asyncio.run(_seed_service_database(tmp_path))
        for run in (1, 2):
            document = parse(path)
            try:
                for example in document.examples():
                    try:
                        example.evaluate()
                    except BaseException as exc:
                        exc.add_note(
                            f"in the example at {_name(path)}, line {example.line}, run {run}"
                        )
                        raise
            finally:
                for value in list(document.namespace.values()):
                    if isinstance(value, NatsServerProcess):
                        value.stop()

    @pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
    def test_every_code_block_names_its_language(self, path: Path) -> None:
        """No fenced block is left without a language, so none is skipped by accident."""
        assert fences_without_language(path) == []

    @pytest.mark.parametrize(
        "page", ["quickstart.md", "concepts.md", "contract.md", "adapters.md", "operations.md"]
    )
    def test_teaching_pages_hold_python_examples(self, page: str) -> None:
        """The pages that teach by example do hold Python examples (so they are tested)."""
        assert "```python" in (ROOT / "docs" / page).read_text()
