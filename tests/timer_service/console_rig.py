"""A console over a real worker on the memory adapters, with one quarantined timer: what the
console's HTTP and browser tests drive (the endpoint on a free loopback port)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence

import attrs

from tests.timer_core.test_poison import POISON, Rig
from timer_adapters_nats import DeadLetters
from timer_service.access import HttpAccess
from timer_service.console import Console
from timer_service.http import HealthEndpoint
from timer_service.metrics import PrometheusInstrumentation

__all__ = ["POISON", "TOKEN", "ConsoleRig", "HttpAnswer", "console_rig", "fetch"]

#: The action token (TIMER_HTTP_TOKEN) of a rig made with actions on.
TOKEN = "console-token-0123456789abcdef"


@attrs.define
class ConsoleRig:
    """The worker rig, its console, and the port the console answers on."""

    rig: Rig
    console: Console
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def console_rig(
    *,
    token: str | None = TOKEN,
    tenants: Sequence[str] | None = None,
    warnings: Sequence[str] = (),
    dead_letters: DeadLetters | None = None,
    reading_fresh_s: float = 30.0,
) -> AsyncIterator[ConsoleRig]:
    """A worker that quarantined the poison timer of tenant-a (and fired some of 120 others,
    tenant-b holds three more far ahead), with the console on a free loopback port, showing
    the service's ``warnings`` (and the ``dead_letters`` of a broker, when given)."""
    metrics = PrometheusInstrumentation()
    rig = Rig(instrumentation=metrics)
    await rig.store.start()
    rig.bus.fail_when(lambda event: event.payload.service_call_id == POISON)
    rig.task = asyncio.ensure_future(rig.worker.run())
    access = HttpAccess(token)
    endpoint: HealthEndpoint | None = None

    def port() -> int:
        assert endpoint is not None
        return endpoint.port

    console = Console(
        store=rig.store,
        quarantine=rig.worker,
        clock=rig.clock,
        access=access,
        port=port,
        tenants=tenants,
        warnings=lambda: list(warnings),
        dead_letters=None if dead_letters is None else functools.partial(lambda d: d, dead_letters),
        reading_fresh_s=reading_fresh_s,
    )
    endpoint = HealthEndpoint(
        "127.0.0.1",
        0,
        metrics.registry,
        lambda: (True, {}),
        quarantine=rig.worker,
        access=access,
        app=console,
    )
    await endpoint.start()
    try:
        await rig.schedule(POISON, 0)
        for i in range(120):
            await rig.schedule(f"call-{i:03}", 0.5 * i)
        for i in range(3):
            await rig.schedule(f"later-{i}", 86_400 * (i + 2), tenant="tenant-b")
        await rig.run_until(40)
        assert len(rig.worker.quarantined) == 1
        yield ConsoleRig(rig, console, endpoint.port)
    finally:
        await endpoint.aclose()
        rig.worker.stop()
        await asyncio.wait_for(rig.task, 5)


@attrs.frozen
class HttpAnswer:
    status: int
    headers: dict[str, str]
    body: str

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


async def fetch(
    port: int,
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    form: dict[str, str] | None = None,
) -> HttpAnswer:
    """One raw HTTP/1.1 request to the endpoint, with exactly the headers given (Host
    defaults to the endpoint's own): what a browser, a script or an attacker may send."""
    from urllib.parse import urlencode

    body = b"" if form is None else urlencode(form).encode()
    sent = {"Host": f"127.0.0.1:{port}", **(headers or {})}
    if form is not None:
        sent.setdefault("Content-Type", "application/x-www-form-urlencoded")
        sent["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in sent.items())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode("latin-1") + b"\r\n" + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    head_text, _, payload = raw.partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    answer_headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        answer_headers.setdefault(name.strip().lower(), value.strip())
    return HttpAnswer(int(lines[0].split()[1]), answer_headers, payload.decode("utf-8", "replace"))
