"""At the defaults, a command is acknowledged only after its commit was synced to disk: the
system calls of a real process, traced by ``strace``, show the write-ahead log's sync before
each acknowledgement."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from tests.tools import require_tool

pytestmark = pytest.mark.os_tool

ACKS = 40

# Stores one timer per apply() and writes "ack" to stdout right after each returns (what the
# service does with a command once apply() returned: acknowledge it); then fires them.
_WRITER = textwrap.dedent(
    """
    import asyncio, os, sys
    from datetime import UTC, datetime, timedelta
    from timer_adapters_sqlite import SqliteTimerStore
    from timer_core import TimerEntry

    async def main(path, synchronous, count):
        options = {} if synchronous == "default" else {"synchronous": synchronous}
        t0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
        async with SqliteTimerStore(path, watch_interval_s=None, **options) as store:
            for i in range(count):
                await store.schedule(TimerEntry(
                    tenant_id="tenant-a", service_call_id=f"call-{i}",
                    due_at=t0, registered_at=t0))
                os.write(1, f"ack call-{i}\\n".encode())
            due = await store.find_due(t0, count)
            for entry in due:
                await store.mark_reached([entry.reach(t0)])
                os.write(1, b"marked\\n")

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)
_SYNC = re.compile(r"(?:fdatasync|fsync)\(\d+<([^>]*)>")
_RESUMED = re.compile(r"<\.\.\. (?:fdatasync|fsync) resumed>.*= 0")


@attrs.frozen
class Trace:
    """What the trace shows: per line written to stdout, whether the log was synced since
    the previous one."""

    acks: list[bool]
    marks: list[bool]


def _traced(strace: str, db_path: Path, synchronous: str, out: Path) -> Trace:
    """Run the writer under strace (syncs and writes, with file names) and read the trace."""
    command = [strace, "-f", "-qq", "-y", "-e", "trace=fdatasync,fsync,write", "-o", str(out)]
    done = subprocess.run(
        [*command, sys.executable, "-c", _WRITER, str(db_path), synchronous, str(ACKS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ack ") == ACKS, done.stdout
    acks: list[bool] = []
    marks: list[bool] = []
    synced = False
    pending: dict[str, bool] = {}  # pid -> its unfinished sync is of the log
    for line in out.read_text().splitlines():
        pid, _, call = line.partition(" ")
        call = call.strip()
        sync = _SYNC.match(call)
        if sync is not None:
            of_log = sync.group(1).endswith("-wal")
            if "<unfinished" in call:
                pending[pid] = of_log
            elif of_log and call.endswith("= 0"):
                synced = True
        elif _RESUMED.match(call):
            synced = pending.pop(pid, False) or synced
        elif call.startswith("write(1<"):
            if '"ack ' in call:
                acks.append(synced)
            elif '"marked' in call:
                marks.append(synced)
            synced = False
    assert len(acks) == ACKS, out.read_text()[-2000:]
    return Trace(acks, marks)


class TestSyncedAcknowledgements:
    def test_each_acknowledged_command_was_synced_first_at_the_defaults(
        self, tmp_path: Path
    ) -> None:
        """With the store's defaults, every apply() returns only after the write-ahead log
        was synced (fdatasync) since the previous acknowledgement."""
        strace = require_tool("strace", "apt-get install strace")
        trace = _traced(strace, tmp_path / "timer.db", "default", tmp_path / "strace.txt")
        assert all(trace.acks), f"{trace.acks.count(False)} of {ACKS} acks came before a sync"

    def test_normal_acknowledges_without_a_sync_and_marks_stay_unsynced(
        self, tmp_path: Path
    ) -> None:
        """The trace tells the two apart: at NORMAL most acknowledgements come with no sync
        before them, and at the default the marks of fired timers are not synced one by one
        (they ride on the next synced commit)."""
        strace = require_tool("strace", "apt-get install strace")
        normal = _traced(strace, tmp_path / "normal.db", "NORMAL", tmp_path / "normal.txt")
        assert normal.acks.count(False) > ACKS // 2
        default = _traced(strace, tmp_path / "timer.db", "default", tmp_path / "default.txt")
        assert default.marks.count(False) > len(default.marks) // 2
