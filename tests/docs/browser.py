"""Headless Chromium (the system's, an OS tool) driven over the DevTools protocol, and the
built site served on loopback: what the browser checks of the docs need.

Chromium talks the protocol over a pipe (``--remote-debugging-pipe``: JSON messages, each
ended by a NUL byte, written to its fd 3 and read from its fd 4), so no client library and
no browser download is needed. It runs with a fresh profile and resolves no host name but
``127.0.0.1``: a page that needs the network shows it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.server
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: The flags every run gets: headless, no network of its own, nothing kept.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--remote-debugging-pipe",
)


def _flags(names: Sequence[str]) -> list[str]:
    rules = "".join(f"MAP {name} 127.0.0.1, " for name in names)
    return [
        flag.replace("MAP * ", f"{rules}MAP * ") if flag.startswith("--host-resolver") else flag
        for flag in FLAGS
    ]


class BrowserError(AssertionError):
    """Chromium answered a command with an error, or not in time."""


class Chromium:
    """One headless Chromium; :meth:`page` opens a tab and returns its session."""

    def __init__(self, executable: str, profile: Path, names: Sequence[str] = ()) -> None:
        """``names``: host names the browser resolves to 127.0.0.1 (no other resolves)."""
        to_browser, self._write_end = os.pipe()
        self._read_end, from_browser = os.pipe()
        # Above 4, so that putting them at 3 and 4 in the child overwrites neither.
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser, from_browser)]
        for fd in (to_browser, from_browser):
            os.close(fd)

        def pipes_at_3_and_4() -> None:
            os.dup2(ends[0], 3)  # dup2 leaves them open across exec; the rest close
            os.dup2(ends[1], 4)

        self.proc = subprocess.Popen(
            [executable, *_flags(names), f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,
            preexec_fn=pipes_at_3_and_4,
        )
        for fd in ends:
            os.close(fd)
        self._next_id = 0
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        with os.fdopen(self._read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        with self._lock:
                            waiting = self._replies.get(message["id"])
                        if waiting is not None:
                            waiting.put(message)
                    else:
                        self.events.put(message)

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        """The result of one protocol command (on a tab's ``session``, or the browser's)."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            reply: queue.Queue[dict[str, Any]] = queue.Queue()
            self._replies[ident] = reply
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write_end, json.dumps(message).encode() + b"\0")
        try:
            answer = reply.get(timeout=60)
        except queue.Empty:
            raise BrowserError(f"no answer to {method} in 60 s") from None
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return dict(answer.get("result", {}))

    def page(self, width: int, height: int = 900) -> Tab:
        """A new tab ``width`` CSS pixels wide, recording every request it makes."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        tab = Tab(self, session["sessionId"])
        tab.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
        )
        tab.call("Network.enable")
        tab.call("Page.enable")
        return tab

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._write_end)
        self.proc.kill()
        self.proc.wait(timeout=30)


class Tab:
    """One tab's session: commands, and the URLs it requested."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session
        self.requested: list[str] = []

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def _drain(self) -> None:
        while True:
            try:
                event = self.browser.events.get_nowait()
            except queue.Empty:
                return
            if (
                event.get("sessionId") == self.session
                and event.get("method") == "Network.requestWillBeSent"
            ):
                self.requested.append(event["params"]["request"]["url"])

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Loads ``url`` and waits for its load event."""
        self.call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'", what=f"{url} to load")

    def wait_for(self, expression: str, what: str, within: float = 30.0) -> None:
        """Until ``expression`` is true in the page (the event it means, polled)."""
        deadline = time.monotonic() + within
        while not self._settled(expression):
            if time.monotonic() > deadline:
                raise BrowserError(f"waited {within} s for {what}")
            time.sleep(0.05)

    def _settled(self, expression: str) -> bool:
        """``expression``'s truth; false while the page it was sent to is being replaced (a
        navigation under way answers an evaluation with "Inspected target navigated or
        closed", which only means the next page is not there yet)."""
        try:
            return bool(self.evaluate(expression))
        except BrowserError as exc:
            if "navigated or closed" in str(exc):
                return False
            raise

    def requests(self) -> list[str]:
        """Every URL the tab has requested so far."""
        self._drain()
        return list(self.requested)

    def shadow_html(self, selector: str) -> list[str]:
        """The inner HTML of the shadow root of each element matching ``selector``, closed
        roots included (the protocol sees through them; the page's scripts cannot)."""
        document = self.call("DOM.getDocument", {"depth": -1, "pierce": True})["root"]
        found = self.call(
            "DOM.querySelectorAll", {"nodeId": document["nodeId"], "selector": selector}
        )["nodeIds"]
        html = []
        for node_id in found:
            node = self.call("DOM.describeNode", {"nodeId": node_id, "depth": 1, "pierce": True})
            roots = node["node"].get("shadowRoots", [])
            for root in roots:
                html.append(
                    self.call("DOM.getOuterHTML", {"backendNodeId": root["backendNodeId"]})[
                        "outerHTML"
                    ]
                )
        return html


@contextlib.contextmanager
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (a free port); yields its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chromium(executable: str, profile: Path, names: Sequence[str] = ()) -> Iterator[Chromium]:
    """A headless Chromium with a fresh profile, killed (by its pid) when done; ``names``
    resolve to 127.0.0.1."""
    browser = Chromium(executable, profile, names)
    try:
        yield browser
    finally:
        browser.close()
