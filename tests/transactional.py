"""Shared by the transactional-scheduling tests of the SQL stores: a worker that must be woken
by a host's commit, and a host process killed inside its transaction."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

from timer_adapters_memory import MemoryEventBus
from timer_core import SystemClock, TimerStore, TimerWorker

# Far longer than any test waits: a timer fired within a test was fired by a wake-up.
NEVER_POLL_S = 600.0


@contextlib.asynccontextmanager
async def waiting_worker(store: TimerStore) -> AsyncIterator[MemoryEventBus]:
    """A running worker on ``store``, asleep after its first pass, woken only through the
    store's ``watch_remote_schedules``; yields the bus it publishes to."""
    bus = MemoryEventBus()
    worker = TimerWorker(store, bus, SystemClock(), polling_interval=NEVER_POLL_S)
    assert store.watch_remote_schedules(worker.notify_scheduled)
    running = asyncio.create_task(worker.run())
    try:
        while worker.passes < 1:  # the first pass is done: from now on it sleeps
            await asyncio.sleep(0.01)
        yield bus
    finally:
        worker.stop()
        await running


def kill_inside_transaction(code: str) -> None:
    """Run ``code`` (which prints ``in transaction`` once its writes are made but not
    committed, then waits) in a new Python process and SIGKILL it at that moment."""
    script = textwrap.dedent(code) + "\nimport sys, time\nprint('in transaction', flush=True)\n"
    script += "time.sleep(600)\n"
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if line.strip() != "in transaction":
            _, errors = process.communicate(timeout=30)
            raise AssertionError(f"the host process failed before killing it: {errors}")
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
