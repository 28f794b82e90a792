"""The console in a real browser: the distribution's headless Chromium, driven over the
DevTools protocol (the docs tests' driver, ``tests/docs/browser.py``), against the console of
a real worker holding a quarantined timer (and a real nats-server's dead letters): every
page, at 1280 and 390 px, refresh, one moment per page, paging, and the Host check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.docs.browser import Chromium, chromium
from tests.timer_service.console_browser import open_page, sign_in
from tests.timer_service.console_rig import POISON, ConsoleRig, console_rig
from tests.tools import require_tool
from timer_adapters_nats import ERROR_HEADER, DeadLetters, NatsBroker, NatsSettings

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


#: A name that resolves to the console's address in the browser: a rebound DNS name.
REBOUND = "rebound.example"


@pytest.fixture(scope="module")
def rebinding_browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """Chromium that resolves ``REBOUND`` to 127.0.0.1, as a rebinding attacker's page does."""
    executable = require_tool("chromium", "apt-get install chromium")
    profile = tmp_path_factory.mktemp("chromium-rebinding")
    with chromium(executable, profile, names=(REBOUND,)) as running:
        yield running


@pytest.fixture
async def fresh_console() -> AsyncIterator[ConsoleRig]:
    """The console rig whose overview reads its figures again on every page after the first
    (in the background: the page shows the previous reading)."""
    async with console_rig(reading_fresh_s=0.0) as rig:
        yield rig


@pytest.fixture
async def letters_console(nats_url: str) -> AsyncIterator[tuple[ConsoleRig, NatsBroker]]:
    """The console rig with the dead letters of a real nats-server: 57 of them, 52 of
    tenant-x and 5 of tenant-y among them."""
    async with NatsBroker(NatsSettings(url=nats_url)) as broker:
        for i in range(57):
            tenant = "tenant-y" if i % 14 == 0 else "tenant-x"
            await broker.jetstream.publish(
                f"timer.dlq.{tenant}", f"bad command {i}".encode(), headers={ERROR_HEADER: "bad"}
            )
        async with console_rig(dead_letters=DeadLetters(broker)) as rig:
            yield rig, broker


OVERVIEW_FIGURES = """(() => {
  const table = caption => [...document.querySelectorAll('table')].find(
    t => t.caption.innerText === caption);
  const census = [...table('Pending timers by due time').tBodies[0].rows]
    .find(r => r.cells[0].innerText === 'Overdue').cells[1].innerText;
  const ranking = [...table('Tenants with the most pending timers').tBodies[0].rows]
    .map(r => parseInt(r.cells[2].innerText, 10)).filter(n => !isNaN(n));
  return {
    moment: document.querySelector('.moment time').getAttribute('datetime'),
    note: document.querySelector('.moment').innerText,
    census: parseInt(census, 10),
    ranking: ranking.reduce((a, b) => a + b, 0),
    oldest: table('Tenants with the oldest overdue timer').tBodies[0].innerText,
  };
})()"""


class TestAWorkingDay:
    async def test_every_page_says_when_its_figures_were_read(
        self, console: ConsoleRig, browser: Chromium
    ) -> None:
        """Each page shows the moment its figures were read, as a machine-readable time."""
        page = await open_page(browser)
        for path in PAGES[:-1]:
            await page.open(console.base + path)
            stamp = await page.evaluate(
                "document.querySelector('.moment time')?.getAttribute('datetime')"
            )
            assert stamp is not None and stamp.endswith("Z"), path
        assert page.errors == []

    async def test_the_overview_shows_one_moment_and_the_ranking_agrees_with_the_census(
        self, fresh_console: ConsoleRig, browser: Chromium
    ) -> None:
        """The tenant ranking's overdue timers add up to the census's, page after page while
        timers fall due and the figures are read again; a page showing an earlier reading
        says when it was read, and its ages do not grow."""
        rig = fresh_console.rig
        rig.bus.fail_when(lambda event: True)  # nothing fires: timers pile up overdue
        page = await open_page(browser)
        await page.open(fresh_console.base + "/console")
        first = await page.evaluate(OVERVIEW_FIGURES)
        assert first["census"] == first["ranking"] >= 1
        await rig.run_until(60)  # forty more timers fall due, none fires
        await page.open(fresh_console.base + "/console")
        again = await page.evaluate(OVERVIEW_FIGURES)
        assert (again["moment"], again["census"], again["ranking"]) == (
            first["moment"],
            first["census"],
            first["ranking"],
        )
        assert again["oldest"] == first["oldest"]
        assert "before this page" in again["note"]
        await page.open(fresh_console.base + "/console")
        later = await page.evaluate(OVERVIEW_FIGURES)
        assert later["moment"] > first["moment"]
        assert later["census"] == later["ranking"] > first["census"]
        assert page.errors == []

    async def test_an_operator_turns_refresh_on_and_the_page_reloads_itself(
        self, console: ConsoleRig, browser: Chromium
    ) -> None:
        """Refresh is off until chosen; chosen with the keyboard, the page reloads itself at
        that period with no script (the page's policy allows none), and "off" stops it."""
        page = await open_page(browser)
        await page.open(console.base + "/console")
        assert await page.evaluate("document.querySelector('meta[http-equiv=refresh]')") is None
        await page.tab_to(".refresh a[href='/console?refresh=10']")
        await page.after_navigation(page.press("Enter"))
        assert await page.evaluate("location.search") == "?refresh=10"
        before = await page.evaluate("document.querySelector('.moment time').dateTime")
        await page.evaluate("window.consoleTestOldPage = true")
        await asyncio.to_thread(
            page.tab.wait_for,
            "!window.consoleTestOldPage && document.readyState === 'complete'",
            "the page to reload itself",
            25.0,
        )
        assert await page.evaluate("location.search") == "?refresh=10"
        assert await page.evaluate("document.querySelector('.moment time').dateTime") >= before
        await page.after_navigation(page.evaluate("document.querySelector('.refresh a').click()"))
        assert await page.evaluate("location.search") == ""
        assert await page.evaluate("document.querySelector('meta[http-equiv=refresh]')") is None
        page.collect_errors()
        assert page.errors == []

    async def test_dead_letters_page_and_filter_by_tenant(
        self, letters_console: tuple[ConsoleRig, NatsBroker], browser: Chromium
    ) -> None:
        """Dead letters come fifty to a page with a link to the next; a tenant typed into
        the filter shows that tenant's only."""
        console, _ = letters_console
        page = await open_page(browser)
        await page.open(console.base + "/console/dead-letters")
        rows = "[...document.querySelectorAll('tbody tr')].map(r => r.cells[1].innerText)"
        assert len(await page.evaluate(rows)) == 50
        await page.after_navigation(
            page.evaluate("[...document.querySelectorAll('.pager a')].pop().click()")
        )
        assert len(await page.evaluate(rows)) == 7
        await page.type_into("#f-tenant", "tenant-y")
        await page.after_navigation(page.press("Enter"))
        assert await page.evaluate(rows) == ["tenant-y"] * 5
        assert await page.evaluate("document.querySelector('.pager')") is None
        assert page.errors == []

    async def test_replay_is_on_screen_and_works_at_390_px(
        self, letters_console: tuple[ConsoleRig, NatsBroker], browser: Chromium
    ) -> None:
        """On a 390 px phone the dead letters stand one card each, the first one's Replay
        button lies on the screen, and pressing it replays that dead letter."""
        console, broker = letters_console
        page = await open_page(browser, 390, 800)
        await sign_in(page, console)
        await page.open(console.base + "/console/dead-letters?tenant=tenant-y")
        box = await page.evaluate(
            "(() => { const r = document.querySelector(\"form[action='/console/actions/replay']"
            ' button").getBoundingClientRect(); return [r.left, r.right]; })()'
        )
        assert 0 <= box[0] < box[1] <= 390, box
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390
        await page.tab_to("form[action='/console/actions/replay'] button")
        await page.after_navigation(page.press("Enter"))
        assert "Replayed" in await page.text(".notice")
        left = await DeadLetters(broker).list(tenant="tenant-y")
        assert len(left) == 4
        assert page.errors == []

    async def test_a_rebound_name_reads_nothing_from_any_endpoint(
        self, console: ConsoleRig, rebinding_browser: Chromium
    ) -> None:
        """Loaded by a name that is not the endpoint's (DNS rebinding), the console,
        /healthz and /metrics answer 403; by the endpoint's own address they answer."""
        page = await open_page(rebinding_browser)
        status = "performance.getEntriesByType('navigation')[0].responseStatus"
        for path in ("/console", "/healthz", "/metrics"):
            await page.open(f"http://{REBOUND}:{console.port}{path}")
            assert await page.evaluate(status) == 403, path
            assert "not this endpoint's address" in await page.text("body"), path
            await page.open(f"{console.base}{path}")
            assert await page.evaluate(status) == 200, path
