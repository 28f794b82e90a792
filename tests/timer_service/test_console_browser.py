"""The console in a real browser: the distribution's headless Chromium, driven over the
DevTools protocol (the docs tests' driver, ``tests/docs/browser.py``), against the console of
a real worker holding a quarantined timer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.docs.browser import Chromium, chromium
from tests.timer_service.console_browser import open_page, sign_in
from tests.timer_service.console_rig import POISON, ConsoleRig, console_rig
from tests.tools import require_tool

pytestmark = pytest.mark.os_tool

PAGES = [
    "/console",
    "/console/tenant?tenant=tenant-a",
    "/console/tenant?tenant=tenant-a&state=all",
    f"/console/timer?tenant=tenant-a&call={POISON}",
    "/console/search?correlation=none",
    "/console/quarantine",
    "/console/dead-letters",
    "/console/sign-in",
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """Chromium from the distribution on a fresh profile, stopped by its pid afterwards."""
    executable = require_tool("chromium", "apt-get install chromium")
    with chromium(executable, tmp_path_factory.mktemp("chromium-profile")) as running:
        yield running


@pytest.fixture
async def console() -> AsyncIterator[ConsoleRig]:
    async with console_rig() as rig:
        yield rig


class TestConsoleInChromium:
    @pytest.mark.parametrize("width", [1280, 390])
    async def test_pages_load_without_errors_and_fit(
        self, console: ConsoleRig, browser: Chromium, width: int
    ) -> None:
        """Every page loads with no console error, and at 390 px nothing is wider than
        the screen (tables scroll inside their own region)."""
        page = await open_page(browser, width)
        for path in PAGES:
            await page.open(console.base + path)
            assert await page.evaluate("document.querySelector('h1') !== null"), path
            overflow = await page.evaluate("document.documentElement.scrollWidth")
            assert overflow <= width, f"{path} is {overflow} px wide at {width} px"
        assert page.errors == []

    async def test_a_search_finds_the_timer(self, console: ConsoleRig, browser: Chromium) -> None:
        """Typing a tenant and a service call id into the overview's search form and
        pressing Enter opens that timer's page."""
        page = await open_page(browser)
        await page.open(console.base + "/console")
        await page.type_into("#f-tenant", "tenant-a")
        await page.type_into("#f-call", POISON)
        await page.after_navigation(page.press("Enter"))
        assert await page.text("h1") == f"Timer tenant-a / {POISON}"
        assert "Quarantined" in await page.text(".facts")
        assert page.errors == []

    async def test_a_quarantined_timer_is_retried_and_then_fires(
        self, console: ConsoleRig, browser: Chromium
    ) -> None:
        """Signed in, an operator reaches Retry with the keyboard on the quarantined
        timer's page; once the worker's next passes ran, the page shows it fired."""
        page = await open_page(browser)
        await sign_in(page, console)
        console.rig.bus.fail_when(None)  # the cause is fixed; now retry it
        await page.open(f"{console.base}/console/timer?tenant=tenant-a&call={POISON}")
        await page.tab_to("form[action='/console/actions/retry'] button")
        await page.after_navigation(page.press("Enter"))
        assert "Put back" in await page.text(".notice")
        assert console.rig.worker.quarantined == []
        await console.rig.run_until(80)
        await page.open(f"{console.base}/console/timer?tenant=tenant-a&call={POISON}")
        assert await page.text(".state") == "Fired"
        assert console.rig.attempts(POISON) > 0
        assert page.errors == []

    async def test_an_action_without_the_token_is_refused(
        self, console: ConsoleRig, browser: Chromium
    ) -> None:
        """A retry form posted from the console's own page without signing in (no session,
        no CSRF token) is refused, and the timer stays quarantined."""
        page = await open_page(browser)
        await page.open(console.base + "/console/quarantine")
        await page.after_navigation(
            page.evaluate(
                "(() => { const f = document.createElement('form'); f.method = 'post';"
                " f.action = '/console/actions/retry';"
                f" for (const [k, v] of [['tenant', 'tenant-a'], ['call', '{POISON}']]) {{"
                " const i = document.createElement('input'); i.type = 'hidden'; i.name = k;"
                " i.value = v; f.appendChild(i); }"
                " document.body.appendChild(f); f.submit(); })()"
            )
        )
        assert await page.text("h1") == "Refused"
        assert "sign in" in (await page.text(".error")).lower()
        assert len(console.rig.worker.quarantined) == 1
