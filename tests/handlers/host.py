"""A host process for the crash test: a Timer on a SQLite file calling a handler that logs.

``python host.py DB LOG BLOCK``: calls for the service call named BLOCK log ``started`` and
then hang (until the process is killed); every other call logs ``started`` and ``done``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from timer_adapters_sqlite import SqliteTimerStore
from timer_core import DueTimeReached, HandlerSettings, MessageEnvelope, Timer


async def main(db: str, log_path: str, block: str) -> None:
    log = Path(log_path)

    def note(line: str) -> None:
        with log.open("a") as out:
            out.write(line + "\n")
            out.flush()

    async def handler(event: MessageEnvelope[DueTimeReached]) -> None:
        call = event.payload.service_call_id
        note(f"started {call}")
        if call == block:
            await asyncio.Event().wait()  # a handler still running when the host dies
        note(f"done {call}")

    settings = HandlerSettings(retry_delay_s=0.05)
    async with Timer(
        SqliteTimerStore(db), handler=handler, handler_settings=settings, polling_interval=0.5
    ):
        note("ready")
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
