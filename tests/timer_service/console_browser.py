"""The console in a browser tab, driven from the event loop the console runs on: the docs
tests' Chromium driver (``tests/docs/browser.py``, synchronous) behind one awaitable facade,
for the browser tests and the docs' screenshots."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from tests.docs.browser import Chromium, Tab
from tests.timer_service.console_rig import TOKEN, ConsoleRig

__all__ = ["Page", "open_page", "sign_in"]

_KEYS = {"Tab": 9, "Enter": 13}


class Page:
    """One tab of the console, driven from the event loop the console runs on: each
    protocol call waits on a thread, so the console goes on answering meanwhile."""

    def __init__(self, browser: Chromium, tab: Tab) -> None:
        self.browser = browser
        self.tab = tab
        self.errors: list[str] = []

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(self.tab.call, method, params)

    async def evaluate(self, expression: str) -> Any:
        return await asyncio.to_thread(self.tab.evaluate, expression)

    async def open(self, url: str) -> None:
        await asyncio.to_thread(self.tab.open, url)
        self.collect_errors()

    async def after_navigation(self, action: Any) -> None:
        """Run ``action`` (a coroutine that makes the page navigate) and wait for the new
        page's load: the old one is marked first, so its own completeness does not count."""
        await self.evaluate("window.consoleTestOldPage = true")
        await action
        await asyncio.to_thread(
            self.tab.wait_for,
            "!window.consoleTestOldPage && document.readyState === 'complete'",
            "the next page to load",
        )
        self.collect_errors()

    async def text(self, selector: str) -> str:
        return str(await self.evaluate(f"document.querySelector({json.dumps(selector)}).innerText"))

    async def type_into(self, selector: str, text: str) -> None:
        """Focus the field and type ``text`` as a keyboard would."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.call("Input.insertText", {"text": text})

    async def press(self, key: str) -> None:
        """Press and release one key (``Tab``, ``Enter``) on the focused element."""
        base = {"key": key, "code": key, "windowsVirtualKeyCode": _KEYS[key]}
        down = {**base, "type": "keyDown", **({"text": "\r"} if key == "Enter" else {})}
        await self.call("Input.dispatchKeyEvent", down)
        await self.call("Input.dispatchKeyEvent", {**base, "type": "keyUp"})

    async def tab_to(self, selector: str, *, presses: int = 60) -> None:
        """Press Tab until the element ``selector`` has the focus (keyboard reachability)."""
        target = json.dumps(selector)
        for _ in range(presses):
            if await self.evaluate(f"document.activeElement === document.querySelector({target})"):
                return
            await self.press("Tab")
        raise AssertionError(f"{selector} is not reachable with the Tab key")

    async def screenshot(self) -> bytes:
        """The whole page as a PNG."""
        params = {"format": "png", "captureBeyondViewport": True}
        return base64.b64decode((await self.call("Page.captureScreenshot", params))["data"])

    def collect_errors(self) -> None:
        """Console errors, uncaught exceptions and failed loads this tab reported so far."""
        kept = []
        while not self.browser.events.empty():
            event = self.browser.events.get_nowait()
            if event.get("sessionId") != self.tab.session:
                kept.append(event)
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append(json.dumps(params.get("args", []))[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                self.errors.append(f"{params['entry'].get('text')} ({params['entry'].get('url')})")
        for event in kept:
            self.browser.events.put(event)


async def open_page(browser: Chromium, width: int = 1280, height: int = 900) -> Page:
    """A new tab ``width`` pixels wide, reporting console errors and log entries."""
    page = Page(browser, await asyncio.to_thread(browser.page, width, height))
    for domain in ("Runtime", "Log"):
        await page.call(f"{domain}.enable")
    return page


async def sign_in(page: Page, console: ConsoleRig) -> None:
    """Sign in through the sign-in form, typing the token and pressing Enter."""
    await page.open(console.base + "/console/sign-in")
    await page.type_into("#f-token", TOKEN)
    await page.after_navigation(page.press("Enter"))
    assert "Signed in" in await page.text(".notice")
