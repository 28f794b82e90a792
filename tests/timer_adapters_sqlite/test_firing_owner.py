"""One firing Timer per SQLite file: a second one, in this process or another, is refused at
start with StoreInUse naming the fix, while scheduling and reading from anywhere keep
working; the ownership ends with close, and with its process (SIGKILL included)."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from timer_adapters_sqlite import SqliteTimerStore
from timer_core import (
    DueTimeReached,
    ExclusiveFiring,
    MessageEnvelope,
    ScheduleTimer,
    StoreInUse,
    Timer,
)
from timer_core.commands import schedule_timer
from timer_core.ports import SystemClock

#: How long a Python process with Timer imported takes to start, schedule or fire on a busy
#: machine (the mechanisms under test answer at once).
BUDGET_S = 60.0

# A firing Timer in a process of its own: says "firing <pid>" once started, prints each
# fired service call id, and stops when its stdin closes.
_OWNER = textwrap.dedent(
    """
    import asyncio, os, sys
    from timer_adapters_sqlite import SqliteTimerStore
    from timer_core import Timer

    def fired(event):
        print("fired", event.payload.service_call_id, flush=True)

    async def main():
        async with Timer(SqliteTimerStore(sys.argv[1]), handler=fired, polling_interval=0.05):
            print("firing", os.getpid(), flush=True)
            await asyncio.to_thread(sys.stdin.read)

    asyncio.run(main())
    """
)

# Schedules two timers, due now, from a process that fires nothing: one in the host's own
# sqlite3 transaction and another through a store without a Timer; prints the second's
# outcome and the first's id as read back.
_SCHEDULER = textwrap.dedent(
    """
    import asyncio, sqlite3, sys
    from datetime import UTC, datetime
    from timer_adapters_sqlite import SqliteTimerStore, schedule_in_transaction
    from timer_core import ScheduleTimer
    from timer_core.commands import schedule_timer
    from timer_core.ports import SystemClock

    path, now = sys.argv[1], datetime.now(UTC)
    connection = sqlite3.connect(path)
    schedule_in_transaction(connection, ScheduleTimer("tenant-a", "in-transaction", now), now=now)
    connection.commit()
    connection.close()

    async def main():
        store = SqliteTimerStore(path)
        await store.start()
        try:
            command = ScheduleTimer("tenant-a", "through-a-store", now)
            print(await schedule_timer(store, command, SystemClock()), flush=True)
            print((await store.get("tenant-a", "in-transaction")).service_call_id, flush=True)
        finally:
            await store.aclose()

    asyncio.run(main())
    """
)


class Owner:
    """:data:`_OWNER` on a database file: started, read line by line, stopped or killed."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _OWNER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("")  # it exited

    def line(self) -> str:
        """The next line it prints (fails with its stderr if it exits first)."""
        line = self._lines.get(timeout=BUDGET_S)
        if not line:
            self.proc.wait(BUDGET_S)
            assert self.proc.stderr is not None
            raise AssertionError(f"owner exited {self.proc.returncode}: {self.proc.stderr.read()}")
        return line

    def wait_firing(self) -> int:
        """Until it fires the file's timers; its pid."""
        word, pid = self.line().split()
        assert word == "firing"
        return int(pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(BUDGET_S)


@pytest.fixture
def owner(db_path: Path) -> Iterator[Owner]:
    """A firing Timer on :func:`db_path` in another process, killed at teardown."""
    proc = Owner(db_path)
    try:
        yield proc
    finally:
        proc.kill()
        for pipe in (proc.proc.stdin, proc.proc.stderr):
            assert pipe is not None
            pipe.close()


class Handled:
    """A handler that keeps the service call ids it was called with, and wakes waiters."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._changed = asyncio.Event()

    async def __call__(self, event: MessageEnvelope[DueTimeReached]) -> None:
        self.calls.append(event.payload.service_call_id)
        self._changed.set()

    async def wait_for(self, *calls: str) -> None:
        async with asyncio.timeout(BUDGET_S):
            while not set(calls) <= set(self.calls):
                self._changed.clear()
                await self._changed.wait()


def firing_timer(path: Path, handler: Handled | None = None) -> Timer:
    return Timer(SqliteTimerStore(path), handler=handler or Handled(), polling_interval=0.05)


async def schedule_due(path: Path, *calls: str) -> None:
    """Store timers due now through a store that fires nothing."""
    store = SqliteTimerStore(path)
    await store.start()
    try:
        now = datetime.now(UTC)
        for call in calls:
            await schedule_timer(store, ScheduleTimer("tenant-a", call, now), SystemClock())
    finally:
        await store.aclose()


def assert_names_the_fix(error: StoreInUse, path: Path) -> None:
    message = str(error)
    assert f"another Timer fires the timers of {path}" in message
    assert "Stop that one first" in message
    assert "schedule_in_transaction" in message
    assert "PostgreSQL" in message


class TestInThisProcess:
    async def test_a_second_firing_timer_is_refused_at_start(self, db_path: Path) -> None:
        """While one Timer fires a file, a second on a store of its own is refused at
        ``async with`` with StoreInUse naming the fix, before it handles any timer; the
        first handles each timer once."""
        first, second = Handled(), Handled()
        await schedule_due(db_path, *(f"call-{n}" for n in range(40)))
        async with firing_timer(db_path, first):
            refused = firing_timer(db_path, second)
            with pytest.raises(StoreInUse) as caught:
                async with refused:
                    pytest.fail("the second Timer started")
            assert_names_the_fix(caught.value, db_path)
            assert caught.value.owner == "this process"
            assert not refused.health().running
            await first.wait_for(*(f"call-{n}" for n in range(40)))
        assert sorted(first.calls) == sorted(f"call-{n}" for n in range(40))
        assert second.calls == []

    async def test_the_same_store_object_given_to_a_second_timer_is_refused(
        self, db_path: Path
    ) -> None:
        """The store object a running Timer fires from, given to a second Timer: refused at
        start with StoreInUse naming the fix (one Timer per store object), the first
        handles each timer once, and the object runs a new Timer once the first is closed."""
        first, second, after = Handled(), Handled(), Handled()
        calls = [f"call-{n}" for n in range(40)]
        await schedule_due(db_path, *calls)
        store = SqliteTimerStore(db_path)
        async with Timer(store, handler=first, polling_interval=0.05):
            refused = Timer(store, handler=second, polling_interval=0.05)
            with pytest.raises(StoreInUse) as caught:
                async with refused:
                    pytest.fail("the second Timer started")
            assert "a store object serves one Timer at a time" in str(caught.value)
            assert "Close that Timer first, or share it" in str(caught.value)
            assert caught.value.owner == "this process"
            await first.wait_for(*calls)
            await schedule_due(db_path, "after-the-refusal")
            await first.wait_for("after-the-refusal")
        assert sorted(first.calls) == sorted([*calls, "after-the-refusal"])
        assert second.calls == []
        await schedule_due(db_path, "next-timer")
        async with Timer(store, handler=after, polling_interval=0.05):
            await after.wait_for("next-timer")
        assert after.calls == ["next-timer"]

    async def test_the_refusal_comes_before_the_constructor_does_io(self, db_path: Path) -> None:
        """Making the second Timer raises nothing and touches nothing; only starting it is
        refused (the constructor does no I/O)."""
        async with firing_timer(db_path):
            refused = firing_timer(db_path)
            with pytest.raises(StoreInUse):
                await refused.start()

    async def test_closing_the_owner_lets_the_next_one_fire(self, db_path: Path) -> None:
        """Once the first Timer is closed, a new one on the same file starts and fires."""
        async with firing_timer(db_path):
            pass
        await schedule_due(db_path, "after")
        handled = Handled()
        async with firing_timer(db_path, handled):
            await handled.wait_for("after")

    async def test_a_refused_timer_leaves_the_owner_firing(self, db_path: Path) -> None:
        """The owner fires timers scheduled after a second Timer was refused."""
        handled = Handled()
        async with firing_timer(db_path, handled):
            with pytest.raises(StoreInUse):
                async with firing_timer(db_path):
                    pass
            await schedule_due(db_path, "later")
            await handled.wait_for("later")

    async def test_another_name_of_the_same_file_is_refused(self, db_path: Path) -> None:
        """A symlink to the database is the same file: its Timer is refused too."""
        link = db_path.parent / "link.db"
        async with firing_timer(db_path):
            link.symlink_to(db_path)
            with pytest.raises(StoreInUse):
                async with firing_timer(link):
                    pass

    async def test_stores_that_only_schedule_and_read_are_never_refused(
        self, db_path: Path
    ) -> None:
        """Beside a firing Timer, another store on the file starts, schedules, reads and
        closes, and the Timer fires what it scheduled."""
        handled = Handled()
        async with firing_timer(db_path, handled):
            await schedule_due(db_path, "from-a-store")
            await handled.wait_for("from-a-store")
            reader = SqliteTimerStore(db_path, migrate=False)
            await reader.start()
            try:
                # The handler runs before its timer is marked Reached: wait for the mark.
                deadline = asyncio.get_running_loop().time() + BUDGET_S
                while (scheduled := await reader.count_scheduled()) and (
                    asyncio.get_running_loop().time() < deadline
                ):
                    await asyncio.sleep(0.01)
                assert scheduled == 0
            finally:
                await reader.aclose()


class TestTheCapability:
    async def test_the_store_takes_the_lock_file_beside_the_database(self, db_path: Path) -> None:
        """acquire_firing needs no start, is idempotent on its holder, and leaves the lock
        file, holding the owner's pid, beside the database."""
        store = SqliteTimerStore(db_path)
        assert isinstance(store, ExclusiveFiring)
        await store.acquire_firing()
        await store.acquire_firing()
        lock = db_path.parent / "timer.db.firing-lock"
        assert lock.read_text().strip() == str(os.getpid())
        await store.aclose()
        other = SqliteTimerStore(db_path)
        await other.acquire_firing()
        await other.aclose()

    async def test_an_in_memory_database_needs_no_lock(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A ``:memory:`` database is its store's alone: two stores on one each fire, and no
        lock file is made."""
        monkeypatch.chdir(tmp_path)
        first, second = SqliteTimerStore(":memory:"), SqliteTimerStore(":memory:")
        await first.acquire_firing()
        await second.acquire_firing()
        await first.aclose()
        await second.aclose()
        assert await asyncio.to_thread(os.listdir, tmp_path) == []

    async def test_a_missing_directory_is_a_configuration_error(self, tmp_path: Path) -> None:
        """The lock is not taken in a directory that does not exist: the store's own
        ConfigurationError says so."""
        from timer_core import ConfigurationError

        store = SqliteTimerStore(tmp_path / "absent" / "timer.db")
        with pytest.raises(ConfigurationError, match="does not exist"):
            await store.acquire_firing()


class TestAcrossProcesses:
    async def test_a_timer_beside_another_process_owner_is_refused(
        self, db_path: Path, owner: Owner
    ) -> None:
        """A firing Timer in another process makes this one's start fail with StoreInUse
        naming that process and the fix."""
        pid = await asyncio.to_thread(owner.wait_firing)
        with pytest.raises(StoreInUse) as caught:
            async with firing_timer(db_path):
                pass
        assert_names_the_fix(caught.value, db_path)
        assert caught.value.owner == f"process {pid}"

    async def test_a_sigkilled_owner_does_not_block_the_restart(
        self, db_path: Path, owner: Owner
    ) -> None:
        """After the owning process is killed with SIGKILL, a new Timer starts on the file at
        once and fires the timers left."""
        await asyncio.to_thread(owner.wait_firing)
        await asyncio.to_thread(owner.kill)
        assert owner.proc.returncode == -signal.SIGKILL
        await schedule_due(db_path, "left-behind")
        handled = Handled()
        async with firing_timer(db_path, handled):
            await handled.wait_for("left-behind")

    async def test_another_process_schedules_and_reads_beside_the_owner(
        self, db_path: Path
    ) -> None:
        """While this process fires the file, another schedules in its own sqlite3
        transaction and through a store without a Timer, and reads back: both timers fire
        here, once each."""
        handled = Handled()
        async with firing_timer(db_path, handled):
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", _SCHEDULER, str(db_path)],
                capture_output=True,
                text=True,
                timeout=BUDGET_S,
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout.split() == ["scheduled", "in-transaction"]
            await handled.wait_for("in-transaction", "through-a-store")
        assert sorted(handled.calls) == ["in-transaction", "through-a-store"]

    def test_the_other_process_fires_what_this_one_schedules(
        self, db_path: Path, owner: Owner
    ) -> None:
        """The owner in another process fires a timer this process scheduled in its own
        transaction."""
        from timer_adapters_sqlite import schedule_in_transaction

        owner.wait_firing()
        now = datetime.now(UTC)
        connection = sqlite3.connect(db_path)
        try:
            schedule_in_transaction(
                connection, ScheduleTimer("tenant-a", "from-here", now), now=now
            )
            connection.commit()
        finally:
            connection.close()
        assert owner.line() == "fired from-here"
