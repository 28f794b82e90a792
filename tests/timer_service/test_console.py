"""The operator's console over HTTP: its pages, its tenant scope, and the gate in front of its
actions (sign-in with the token, CSRF token, Origin and Host), on a real worker's quarantine."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attrs
import nats
import pytest

from tests.timer_service.console_rig import (
    POISON,
    TOKEN,
    ConsoleRig,
    HttpAnswer,
    console_rig,
    fetch,
)
from tests.timer_service.test_otel import Telemetry, running_service, settings_for
from timer_adapters_nats import TimerClient
from timer_service.console._html import ago, esc, table
from timer_service.settings import Settings, SettingsError

PAGES = [
    "/console",
    "/console/tenant?tenant=tenant-a",
    "/console/tenant?tenant=tenant-a&state=all",
    "/console/tenant?tenant=tenant-a&state=reached&from=2030-01-01T00:00:10Z",
    f"/console/timer?tenant=tenant-a&call={POISON}",
    "/console/timer?tenant=tenant-a&call=call-003",
    "/console/search?correlation=nothing-here",
    "/console/quarantine",
    "/console/dead-letters",
    "/console/sign-in",
]


@pytest.fixture
async def console() -> AsyncIterator[ConsoleRig]:
    async with console_rig() as rig:
        yield rig


def origin(rig: ConsoleRig) -> dict[str, str]:
    return {"Origin": rig.base}


async def sign_in(rig: ConsoleRig) -> tuple[str, str]:
    """Sign in with the token; the session cookie and the CSRF token of its forms."""
    answer = await fetch(
        rig.port, "/console/sign-in", method="POST", headers=origin(rig), form={"token": TOKEN}
    )
    assert answer.status == 303, answer
    cookie = (answer.header("set-cookie") or "").split(";")[0]
    page = await fetch(rig.port, "/console/quarantine", headers={"Cookie": cookie})
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page.body)
    assert match is not None, page.body
    return cookie, match.group(1)


async def retry(rig: ConsoleRig, headers: dict[str, str], csrf: str | None) -> HttpAnswer:
    form = {"tenant": "tenant-a", "call": POISON, "back": "timer"}
    if csrf is not None:
        form["csrf"] = csrf
    return await fetch(
        rig.port, "/console/actions/retry", method="POST", headers=headers, form=form
    )


class TestPages:
    @pytest.mark.parametrize("path", PAGES)
    async def test_each_page_renders(self, console: ConsoleRig, path: str) -> None:
        """Every page answers 200 with HTML that allows no script and no foreign resource."""
        answer = await fetch(console.port, path)
        assert answer.status == 200, answer.body
        assert answer.header("content-type") == "text/html; charset=utf-8"
        assert "default-src 'none'" in (answer.header("content-security-policy") or "")
        assert "<script" not in answer.body
        assert "http://" not in answer.body and "https://" not in answer.body

    async def test_the_timer_page_tells_its_story(self, console: ConsoleRig) -> None:
        """The quarantined timer's page shows its state, failures and last error."""
        answer = await fetch(console.port, f"/console/timer?tenant=tenant-a&call={POISON}")
        assert "Quarantined" in answer.body
        assert "refused on purpose" in answer.body
        fired = await fetch(console.port, "/console/timer?tenant=tenant-a&call=call-003")
        assert "Fired (DueTimeReached published and acknowledged)" in fired.body

    async def test_pages_of_a_tenant_follow_each_other(self, console: ConsoleRig) -> None:
        """The next-page link of a tenant's pending timers continues after the last row,
        with no timer twice and none left out."""
        seen: list[str] = []
        path: str | None = "/console/tenant?tenant=tenant-a&state=all"
        while path is not None:
            body = (await fetch(console.port, path)).body
            seen += re.findall(r"call=(call-\d+|poison)\">", body)
            match = re.search(r'<p class="pager"><a href="([^"]+)">Next page', body)
            path = None if match is None else match.group(1).replace("&amp;", "&")
        assert len(seen) == 121
        assert len(set(seen)) == 121

    async def test_search_by_key_leads_to_the_timer(self, console: ConsoleRig) -> None:
        """A search by tenant and service call id redirects to that timer's page."""
        answer = await fetch(console.port, f"/console/search?tenant=tenant-a&call={POISON}")
        assert answer.status == 303
        assert answer.header("location") == f"/console/timer?tenant=tenant-a&call={POISON}"

    async def test_bad_ids_get_a_clear_error(self, console: ConsoleRig) -> None:
        """An id that cannot be one is answered 400 with the reason, not a stack trace."""
        answer = await fetch(console.port, "/console/tenant?tenant=no%20spaces")
        assert answer.status == 400
        assert 'role="alert"' in answer.body

    async def test_a_database_down_is_a_clear_503(self, console: ConsoleRig) -> None:
        """With the store unavailable a page answers 503 saying so, not a dropped connection."""
        console.rig.store.set_unavailable(True)
        try:
            answer = await fetch(console.port, "/console/tenant?tenant=tenant-a")
        finally:
            console.rig.store.set_unavailable(False)
        assert answer.status == 503
        assert "did not answer" in answer.body

    async def test_a_foreign_host_is_refused(self, console: ConsoleRig) -> None:
        """A page asked for under another Host (a rebound DNS name) is refused."""
        answer = await fetch(console.port, "/console", headers={"Host": "evil.example:80"})
        assert answer.status == 403

    async def test_the_overview_ranks_tenants(self, console: ConsoleRig) -> None:
        """The overview shows the census and the tenants with pending and overdue timers."""
        body = (await fetch(console.port, "/console")).body
        assert "Pending timers by due time" in body
        assert "Tenants with the oldest overdue timer" in body
        assert "tenant-b" in body

    async def test_the_overview_shows_the_oldest_quarantines_age(self, console: ConsoleRig) -> None:
        """The overview says how many timers are quarantined and how long the oldest has
        been held, as of the moment its figures were read."""
        (quarantined,) = console.rig.worker.quarantined
        reading = await console.console.reading()
        held = ago((reading.at - quarantined.since).total_seconds())
        body = (await fetch(console.port, "/console")).body
        assert f"1 quarantined timer(s)</a>, the oldest held for {held}" in body


class TestActions:
    async def test_sign_in_then_retry_puts_the_timer_back(self, console: ConsoleRig) -> None:
        """Signed in, the Retry form of the timer page puts the quarantined timer back, and
        the token appears nowhere in what the console sends."""
        cookie, csrf = await sign_in(console)
        answer = await retry(console, {**origin(console), "Cookie": cookie}, csrf)
        assert answer.status == 303
        assert "notice=retried" in (answer.header("location") or "")
        assert console.rig.worker.quarantined == []
        page = await fetch(
            console.port, answer.header("location") or "", headers={"Cookie": cookie}
        )
        assert TOKEN not in page.body and TOKEN not in str(page.headers)

    async def test_the_session_cookie_is_strict(self, console: ConsoleRig) -> None:
        """The session cookie is HttpOnly, SameSite=Strict and scoped to /console."""
        answer = await fetch(
            console.port,
            "/console/sign-in",
            method="POST",
            headers=origin(console),
            form={"token": TOKEN},
        )
        cookie = answer.header("set-cookie") or ""
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console" in cookie
        assert TOKEN not in cookie

    async def test_a_wrong_token_does_not_sign_in(self, console: ConsoleRig) -> None:
        """A wrong token is refused with 401 and no cookie."""
        answer = await fetch(
            console.port,
            "/console/sign-in",
            method="POST",
            headers=origin(console),
            form={"token": "not-the-token-at-all"},
        )
        assert answer.status == 401
        assert answer.header("set-cookie") is None

    async def test_an_action_without_a_session_is_refused(self, console: ConsoleRig) -> None:
        """Without signing in, a retry is refused (401) and the timer stays quarantined."""
        answer = await retry(console, origin(console), None)
        assert answer.status == 401
        assert len(console.rig.worker.quarantined) == 1

    async def test_an_action_without_its_csrf_token_is_refused(self, console: ConsoleRig) -> None:
        """A signed-in browser's cookie alone (a forged form) does not act."""
        cookie, _ = await sign_in(console)
        answer = await retry(console, {**origin(console), "Cookie": cookie}, None)
        assert answer.status == 401
        forged = await retry(console, {**origin(console), "Cookie": cookie}, "0" * 64)
        assert forged.status == 401
        assert len(console.rig.worker.quarantined) == 1

    @pytest.mark.parametrize(
        "headers",
        [{}, {"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}],
        ids=["no-origin", "foreign-origin", "cross-site"],
    )
    async def test_cross_site_actions_are_refused(
        self, console: ConsoleRig, headers: dict[str, str]
    ) -> None:
        """A session's valid form sent without the console's Origin, from another origin,
        or marked cross-site by the browser is refused."""
        cookie, csrf = await sign_in(console)
        sent = {**headers, "Cookie": cookie}
        if "Origin" not in headers and headers:
            sent["Origin"] = console.base
        answer = await retry(console, sent, csrf)
        assert answer.status == 403
        assert len(console.rig.worker.quarantined) == 1

    async def test_without_a_token_the_console_is_read_only(self) -> None:
        """Without TIMER_HTTP_TOKEN no action form is shown and every action is refused."""
        async with console_rig(token=None) as rig:
            page = await fetch(rig.port, "/console/quarantine")
            assert "Read-only" in page.body
            assert 'method="post"' not in page.body
            answer = await retry(rig, origin(rig), None)
            assert answer.status == 403
            assert len(rig.rig.worker.quarantined) == 1

    async def test_cancel_removes_a_pending_timer(self, console: ConsoleRig) -> None:
        """The Cancel form cancels a pending timer (through the store without a broker)."""
        cookie, csrf = await sign_in(console)
        answer = await fetch(
            console.port,
            "/console/actions/cancel",
            method="POST",
            headers={**origin(console), "Cookie": cookie},
            form={"tenant": "tenant-b", "call": "later-0", "back": "timer", "csrf": csrf},
        )
        assert answer.status == 303
        assert "notice=cancelled" in (answer.header("location") or "")
        record = await console.rig.store.get("tenant-b", "later-0")  # type: ignore[arg-type]
        assert record is None

    async def test_actions_are_logged(
        self, console: ConsoleRig, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Each action, allowed or refused, leaves a log line naming it."""
        caplog.set_level("INFO")
        await retry(console, origin(console), None)
        cookie, csrf = await sign_in(console)
        await retry(console, {**origin(console), "Cookie": cookie}, csrf)
        messages = [r.getMessage() for r in caplog.records]
        assert any("refused (401)" in m for m in messages), messages
        assert any("allowed: console: retry 'tenant-a'/'poison'" in m for m in messages), messages


class TestScope:
    async def test_other_tenants_are_out_of_reach(self) -> None:
        """With a tenant scope, another tenant's pages and quarantined timers are not shown
        and its timers cannot be acted on."""
        async with console_rig(tenants=["tenant-b"]) as rig:
            page = await fetch(rig.port, "/console/tenant?tenant=tenant-a")
            assert page.status == 400
            assert "TIMER_CONSOLE_TENANTS" in page.body
            quarantine = await fetch(rig.port, "/console/quarantine")
            assert POISON not in quarantine.body
            overview = await fetch(rig.port, "/console")
            assert "tenant-a" not in overview.body
            assert "Pending timers by due time" not in overview.body


class TestHtml:
    def test_values_are_escaped(self) -> None:
        """Markup in a value (a dead letter's reason, an error) is shown as text."""
        assert esc('<script>"x"</script>') == "&lt;script&gt;&quot;x&quot;&lt;/script&gt;"
        assert "<b>" not in table("t", ["h"], [("<b>bold</b>",)])


class TestConsoleSettings:
    def test_console_and_scope_are_read(self) -> None:
        """TIMER_CONSOLE turns it on; TIMER_CONSOLE_TENANTS is a checked list of tenants."""
        settings = Settings.from_environment(
            {"TIMER_CONSOLE": "1", "TIMER_CONSOLE_TENANTS": "b, a,a"}
        )
        assert settings.console
        assert settings.console_tenants == ("a", "b")
        assert not Settings.from_environment({}).console
        with pytest.raises(SettingsError, match="TIMER_CONSOLE_TENANTS"):
            Settings.from_environment({"TIMER_CONSOLE_TENANTS": "ok, not ok"})


class TestInTheService:
    async def test_the_service_serves_the_console_with_its_dead_letters(
        self, tmp_path: Path, nats_url: str
    ) -> None:
        """With TIMER_CONSOLE on, the running service serves /console on its HTTP port,
        shows a command its source dead-lettered with the reason, scheduled timers in
        their tenant, and the census on /metrics; without a session, Replay is refused."""
        settings = attrs.evolve(
            settings_for(tmp_path, nats_url), console=True, http_token=TOKEN, census_interval_s=1.0
        )
        async with running_service(settings, Telemetry()) as service:
            await service.http.start()
            try:
                port = service.http.port
                async with TimerClient.connect(nats_url) as client:
                    await client.schedule("shop", "order-1", datetime.now(UTC) + timedelta(hours=2))
                nc = await nats.connect(nats_url)
                try:
                    await nc.jetstream().publish("timer.commands.shop", b"not json")
                finally:
                    await nc.close()
                deadline = asyncio.get_running_loop().time() + 30
                while True:
                    letters = await fetch(port, "/console/dead-letters")
                    tenant = await fetch(port, "/console/tenant?tenant=shop")
                    if "order-1" in tenant.body and "not json" in letters.body:
                        break
                    assert asyncio.get_running_loop().time() < deadline, letters.body
                    await asyncio.sleep(0.1)
                seq = re.search(
                    r"<td[^>]*><div>(\d+)</div></td><td[^>]*><div>shop</div></td>", letters.body
                )
                assert seq is not None, letters.body
                refused = await fetch(
                    port,
                    "/console/actions/replay",
                    method="POST",
                    headers={"Origin": f"http://127.0.0.1:{port}"},
                    form={"seq": seq.group(1)},
                )
                assert refused.status == 401
                await service.take_census()
                metrics = await fetch(port, "/metrics")
                assert 'timer_timers_due{due="1d"} 1.0' in metrics.body
            finally:
                await service.http.aclose()


class TestBehindATlsProxy:
    async def test_an_https_origin_of_the_same_host_may_act(self, console: ConsoleRig) -> None:
        """Behind a proxy that terminates TLS the browser's Origin is https://<host>: the
        sign-in and the actions accept it, and still refuse another host's."""
        host = f"127.0.0.1:{console.port}"
        answer = await fetch(
            console.port,
            "/console/sign-in",
            method="POST",
            headers={"Origin": f"https://{host}"},
            form={"token": TOKEN},
        )
        assert answer.status == 303
        cookie = (answer.header("set-cookie") or "").split(";")[0]
        page = await fetch(console.port, "/console/quarantine", headers={"Cookie": cookie})
        match = re.search(r'name="csrf" value="([0-9a-f]+)"', page.body)
        assert match is not None
        other = await retry(
            console, {"Origin": "https://evil.example", "Cookie": cookie}, match.group(1)
        )
        assert other.status == 403
        same = await retry(console, {"Origin": f"https://{host}", "Cookie": cookie}, match.group(1))
        assert same.status == 303
