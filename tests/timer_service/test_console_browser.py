"""The console in a real browser: the distribution's headless Chromium, driven over the
DevTools protocol, against the console of a real worker holding a quarantined timer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.timer_service.browser import Browser, Tab, chromium
from tests.timer_service.console_rig import POISON, TOKEN, ConsoleRig, console_rig
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
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """Chromium from the distribution on a fresh profile, stopped by its pid afterwards."""
    executable = require_tool("chromium", "apt-get install chromium")
    with chromium(executable, tmp_path_factory.mktemp("chromium-profile")) as running:
        yield running


@pytest.fixture
async def console() -> AsyncIterator[ConsoleRig]:
    async with console_rig() as rig:
        yield rig


@pytest.fixture
async def tab(browser: Browser) -> AsyncIterator[Tab]:
    async with browser.tab() as opened:
        yield opened


async def sign_in(tab: Tab, console: ConsoleRig) -> None:
    """Sign in through the sign-in form, typing the token and pressing Enter."""
    await tab.open(console.base + "/console/sign-in")
    await tab.type_into("#f-token", TOKEN)
    async with tab.loading():
        await tab.press("Enter")
    assert "Signed in" in await tab.text(".notice")


class TestConsoleInChromium:
    @pytest.mark.parametrize("width", [1280, 390])
    async def test_pages_load_without_errors_and_fit(
        self, console: ConsoleRig, tab: Tab, width: int
    ) -> None:
        """Every page loads with no console error, and at 390 px nothing is wider than
        the screen (tables scroll inside their own region)."""
        await tab.viewport(width, 900)
        for path in PAGES:
            await tab.open(console.base + path)
            assert await tab.evaluate("document.querySelector('h1') !== null"), path
            overflow = await tab.evaluate("document.documentElement.scrollWidth")
            assert overflow <= width, f"{path} is {overflow} px wide at {width} px"
        assert tab.errors == []

    async def test_a_search_finds_the_timer(self, console: ConsoleRig, tab: Tab) -> None:
        """Typing a tenant and a service call id into the overview's search form and
        pressing Enter opens that timer's page."""
        await tab.open(console.base + "/console")
        await tab.type_into("#f-tenant", "tenant-a")
        await tab.type_into("#f-call", POISON)
        async with tab.loading():
            await tab.press("Enter")
        assert await tab.text("h1") == f"Timer tenant-a / {POISON}"
        assert "Quarantined" in await tab.text(".facts")
        assert tab.errors == []

    async def test_a_quarantined_timer_is_retried_and_then_fires(
        self, console: ConsoleRig, tab: Tab
    ) -> None:
        """Signed in, an operator reaches Retry with the keyboard on the quarantined
        timer's page; once the worker's next passes ran, the page shows it fired."""
        await sign_in(tab, console)
        console.rig.bus.fail_when(None)  # the cause is fixed; now retry it
        await tab.open(f"{console.base}/console/timer?tenant=tenant-a&call={POISON}")
        await tab.tab_to("form[action='/console/actions/retry'] button")
        async with tab.loading():
            await tab.press("Enter")
        assert "Put back" in await tab.text(".notice")
        assert console.rig.worker.quarantined == []
        await console.rig.run_until(80)
        await tab.open(f"{console.base}/console/timer?tenant=tenant-a&call={POISON}")
        assert await tab.text(".state") == "Fired"
        assert console.rig.attempts(POISON) > 0
        assert tab.errors == []

    async def test_an_action_without_the_token_is_refused(
        self, console: ConsoleRig, tab: Tab
    ) -> None:
        """A retry form posted from the console's own page without signing in (no session,
        no CSRF token) is refused, and the timer stays quarantined."""
        await tab.open(console.base + "/console/quarantine")
        async with tab.loading():
            await tab.evaluate(
                "(() => { const f = document.createElement('form'); f.method = 'post';"
                " f.action = '/console/actions/retry';"
                f" for (const [k, v] of [['tenant', 'tenant-a'], ['call', '{POISON}']]) {{"
                " const i = document.createElement('input'); i.type = 'hidden'; i.name = k;"
                " i.value = v; f.appendChild(i); }"
                " document.body.appendChild(f); f.submit(); })()"
            )
        assert await tab.text("h1") == "Refused"
        assert "sign in" in (await tab.text(".error")).lower()
        assert len(console.rig.worker.quarantined) == 1
