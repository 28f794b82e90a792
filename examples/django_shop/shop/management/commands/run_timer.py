"""``python manage.py run_timer``: the process that fires the shop's timers, run beside the web
workers (one or more on PostgreSQL; one on SQLite), stopped by SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from shop.timers import expire_order, timer_store
from timer_core import Timer


class Command(BaseCommand):
    help = "Fire the shop's timers: expire orders whose payment timeout came due."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default="default", help="Django's database alias")
        parser.add_argument(
            "--polling-interval",
            type=float,
            default=5.0,
            help="seconds between two looks at the table when nothing wakes the Timer sooner",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        asyncio.run(self.run(options["database"], options["polling_interval"]))

    async def run(self, using: str, polling_interval: float) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        store = timer_store(using)
        async with Timer(store, handler=expire_order, polling_interval=polling_interval):
            self.stdout.write(f"firing timers on {using!r}; SIGTERM or Ctrl-C stops", ending="\n")
            self.stdout.flush()
            await stop.wait()
        self.stdout.write("stopped", ending="\n")
