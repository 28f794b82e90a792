"""The distribution's headless Chromium, driven over the DevTools protocol (``websockets``):
start it on a fresh profile, open pages, type, press keys, read the DOM, collect every
console error, take screenshots, and stop it by its pid."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import websockets

__all__ = ["Browser", "Tab", "chromium"]

#: The flags the brief asks for, plus a DevTools port of the browser's choosing.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)
_START_BUDGET_S = 30.0  # a cold start on a busy machine; it takes about a second when idle


class Browser:
    """A running Chromium: its pid and the DevTools HTTP endpoint."""

    def __init__(self, process: subprocess.Popen[bytes], devtools: str) -> None:
        self.process = process
        self.devtools = devtools

    def new_target(self) -> str:
        """Open a blank tab; its page WebSocket URL."""
        request = urllib.request.Request(f"{self.devtools}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(json.loads(response.read())["webSocketDebuggerUrl"])

    @contextlib.asynccontextmanager
    async def tab(self) -> AsyncIterator[Tab]:
        """A new tab with the page, runtime and log domains on, closed afterwards."""
        url = await asyncio.to_thread(self.new_target)
        async with websockets.connect(url, max_size=64 * 1024 * 1024) as socket:
            tab = Tab(socket)
            reading = asyncio.create_task(tab.read())
            try:
                for domain in ("Page", "Runtime", "Log"):
                    await tab.send(f"{domain}.enable")
                yield tab
            finally:
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading


@contextlib.contextmanager
def chromium(executable: str, profile: Path) -> Iterator[Browser]:
    """Start ``executable`` headless on the fresh profile ``profile``; stop it by its pid
    (its whole process group) on the way out, whatever happened."""
    profile.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [executable, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + _START_BUDGET_S
        while not active.exists() or not active.read_text().strip():
            if process.poll() is not None:
                raise RuntimeError(f"chromium exited with {process.returncode} at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium wrote no {active} in {_START_BUDGET_S} s")
            time.sleep(0.05)
        port = active.read_text().split()[0]
        yield Browser(process, f"http://127.0.0.1:{port}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


class Tab:
    """One page's DevTools session: commands answered by id, events kept for waiters."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: list[dict[str, Any]] = []
        self._event_added = asyncio.Event()
        #: Console errors, uncaught exceptions and failed loads the page reported.
        self.errors: list[str] = []

    async def read(self) -> None:
        async for raw in self._socket:
            message = json.loads(raw)
            if "id" in message:
                future = self._answers.pop(message["id"], None)
                if future is not None and not future.done():
                    future.set_result(message)
                continue
            self._note(message)
            self._events.append(message)
            self._event_added.set()

    def _note(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(json.dumps(params.get("args", []))[:500])
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"{entry.get('text')} ({entry.get('url', '')})")

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Run one DevTools command; its result (an error answer raises)."""
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[ident] = future
        await self._socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        answer = await asyncio.wait_for(future, timeout=30)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return dict(answer.get("result", {}))

    async def wait_for_event(self, method: str, *, since: int, budget_s: float = 30.0) -> None:
        """Wait for the event ``method`` among those that came after the first ``since``."""
        async with asyncio.timeout(budget_s):
            while not any(e.get("method") == method for e in self._events[since:]):
                self._event_added.clear()
                await self._event_added.wait()

    @contextlib.asynccontextmanager
    async def loading(self) -> AsyncIterator[None]:
        """Wait, after the block, for the page load the block started."""
        since = len(self._events)
        yield
        await self.wait_for_event("Page.loadEventFired", since=since)

    async def open(self, url: str) -> None:
        async with self.loading():
            await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (returned by value)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def text(self, selector: str) -> str:
        return str(await self.evaluate(f"document.querySelector({json.dumps(selector)}).innerText"))

    async def type_into(self, selector: str, text: str) -> None:
        """Focus the field and type ``text`` key by key, as a keyboard would."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", text=text)

    async def press(self, key: str) -> None:
        """Press and release one key (``Tab``, ``Enter``) on the focused element."""
        codes = {"Tab": 9, "Enter": 13}
        base = {"key": key, "code": key, "windowsVirtualKeyCode": codes[key]}
        extra = {"text": "\r"} if key == "Enter" else {}
        await self.send("Input.dispatchKeyEvent", type="keyDown", **base, **extra)
        await self.send("Input.dispatchKeyEvent", type="keyUp", **base)

    async def tab_to(self, selector: str, *, presses: int = 60) -> None:
        """Press Tab until the element ``selector`` has the focus (keyboard reachability)."""
        target = json.dumps(selector)
        for _ in range(presses):
            if await self.evaluate(f"document.activeElement === document.querySelector({target})"):
                return
            await self.press("Tab")
        raise AssertionError(f"{selector} is not reachable with the Tab key")

    async def viewport(self, width: int, height: int) -> None:
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )

    async def screenshot(self) -> bytes:
        """The whole page as a PNG."""
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        return base64.b64decode(shot["data"])
