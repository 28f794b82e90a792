"""Durability across processes: what a store acknowledged survives its process dying."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from timer_adapters_sqlite import SqliteTimerStore
from timer_core import StoreUnavailable

from .conftest import T0, entry

_WRITER = textwrap.dedent(
    """
    import asyncio, os, sys
    from datetime import UTC, datetime, timedelta
    from timer_adapters_sqlite import SqliteTimerStore
    from timer_core import TimerEntry

    async def main(path, count, crash):
        store = SqliteTimerStore(path)
        await store.start()
        t0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
        for i in range(count):
            await store.schedule(TimerEntry(
                tenant_id="tenant-a", service_call_id=f"call-{i}",
                due_at=t0 + timedelta(seconds=i), registered_at=t0, correlation_id="trace"))
            print(f"call-{i}", flush=True)
        if crash:
            os._exit(0)  # no aclose: the process just ends after the last acknowledgement
        await store.aclose()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "crash"))
    """
)


def _writer(path: Path, count: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(count), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


class TestDurability:
    async def test_timer_stored_by_one_process_is_due_in_the_next(self, db_path: Path) -> None:
        """A timer a process stored (then exited without closing) is found due by a new one."""
        process = _writer(db_path, 1, "crash")
        try:
            out, err = await asyncio.to_thread(process.communicate, timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 0, err
        assert out.split() == ["call-0"]
        async with SqliteTimerStore(db_path) as store:
            due = await store.find_due(T0, 10)
        assert due == [entry(call="call-0", correlation="trace")]

    async def test_acknowledged_timers_survive_a_kill(self, db_path: Path) -> None:
        """Every timer acknowledged before SIGKILL is there for the next process."""
        process = _writer(db_path, 100_000, "close")
        acknowledged: list[str] = []
        try:
            assert process.stdout is not None
            stdout = process.stdout
            while len(acknowledged) < 200:
                line = await asyncio.to_thread(stdout.readline)
                assert line, process.stderr.read() if process.stderr else "writer died"
                acknowledged.append(line.strip())
            process.kill()
        finally:
            if process.poll() is None:
                process.kill()
            await asyncio.to_thread(process.wait)
        async with SqliteTimerStore(db_path) as store:
            stored = {
                t.service_call_id for t in await store.list_for_tenant("tenant-a", limit=10**6)
            }  # type: ignore[arg-type]
            assert set(acknowledged) <= stored
            due = await store.find_due(T0 + timedelta(seconds=199), 1000)
        assert [t.service_call_id for t in due[:200]] == [f"call-{i}" for i in range(200)]


class TestSyncer:
    async def test_a_failed_sync_fails_the_apply_but_not_the_marks(
        self, db_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """At FULL, when syncing the log fails, apply() raises StoreUnavailable (so the command
        is not acknowledged and comes again), while a mark, which waits for no sync, succeeds;
        once syncing works again, so does apply()."""
        async with SqliteTimerStore(db_path) as store:
            await store.schedule(entry(call="call-0"))

            def broken(fd: int) -> None:
                raise OSError(5, "Input/output error")

            monkeypatch.setattr(os, "fsync", broken)
            with pytest.raises(StoreUnavailable, match="could not sync"):
                await store.schedule(entry(call="call-1"))
            # call-1 was committed, only not known to be on disk: its command comes again.
            due = await store.find_due(T0, 10)
            assert await store.mark_reached([e.reach(T0) for e in due]) == len(due) == 2
            monkeypatch.undo()
            await store.schedule(entry(call="call-2"))
            assert store._writer is not None and store._writer.syncs >= 2
