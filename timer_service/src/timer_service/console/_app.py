"""The console's pages and actions: what each path shows, and what each form does."""

from __future__ import annotations

import asyncio
import functools
import importlib.resources
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from urllib.parse import parse_qs, urlencode

import attrs

from timer_adapters_nats import BrokerUnavailable, DeadLetter, DeadLetters
from timer_core import (
    Clock,
    CorrelationId,
    DueCursor,
    InvalidTimestamp,
    QuarantinedTimer,
    ServiceCallId,
    StoreError,
    TenantId,
    TimerCensus,
    TimerEntry,
    TimerKey,
    TimerLookup,
    TimerScheduler,
    TimerState,
    TimerStore,
    ValidationError,
)
from timer_core.instants import format_timestamp, parse_timestamp
from timer_core.redaction import redact_url
from timer_service.access import HttpAccess, HttpRequest, Refusal
from timer_service.census import BUCKETS, Census, TenantCensus, take_census, tenant_census
from timer_service.console._guard import (
    COOKIE,
    Sessions,
    action_refusal,
    page_refusal,
    session_of,
    sign_in_refusal,
)
from timer_service.console._html import (
    Html,
    ago,
    esc,
    field,
    form,
    join,
    layout,
    link,
    table,
    when,
)
from timer_service.http import Quarantine, Response

__all__ = ["Console"]

log = logging.getLogger("timer_service.console")

_HTML = "text/html; charset=utf-8"
_TEXT = "text/plain; charset=utf-8"
_PAGE_HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
]
_CSS = importlib.resources.files(__package__).joinpath("console.css").read_bytes()
# A clock face: the browser asks for an icon, and a missing one is a console error.
_ICON = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><circle cx="8" cy="8" r="7" '
    b'fill="#12263a"/><path d="M8 3v5l3 2" stroke="#fff" stroke-width="1.5" fill="none"/></svg>'
)
#: Rows on a page of a tenant's timers, and rows read at most to fill one when filtering
#: fired timers (which no index orders by due time): the page's cost stays bounded.
PAGE_SIZE = 50
SCAN_LIMIT = 2000
#: The overview's tenant census: tenants looked at, and each one's counts' cap.
TOP_TENANTS_SCANNED = 1000
TENANT_CAP = 1000
_TOP = 10
#: How long the overview's figures are shown before they are read again.
READING_FRESH_S = 30.0
#: The refresh periods a page offers (seconds); a page refreshes only when asked to.
REFRESH_S = (10, 30, 60)
_NOTICES = {
    "signed-in": "Signed in: actions are allowed for this session.",
    "signed-out": "Signed out.",
    "retried": "Put back for the next pass of the worker.",
    "retried-none": "Nothing to retry: the timer is no longer quarantined.",
    "cancel-sent": "Cancel sent: the timer is cancelled when the service applies it.",
    "cancelled": "Cancelled.",
    "cancel-noop": "Nothing to cancel: the timer has fired or is gone.",
    "replayed": "Replayed to its tenant's command subject.",
    "replay-kept": "Not replayed: see the reason on the dead letter.",
}


class Console:
    """The operator's web console, mounted on the service's HTTP endpoint under ``/console``.

    Reads through a store with the :class:`~timer_core.ports.TimerCensus` and
    :class:`~timer_core.ports.TimerLookup` capabilities, the worker's quarantine, and the
    dead-letter stream (``dead_letters`` makes its reader on first use); acts by retrying
    quarantined timers, replaying dead letters and cancelling timers (through the client
    ``commands`` makes, on the broker, when given; else the store).
    ``tenants`` limits everything it shows and does to those tenants. ``warnings`` gives the
    service's warnings (how acknowledged events can be lost, say), which head the overview.
    The overview's figures are read together, at one moment, and shown for
    ``reading_fresh_s`` while the next reading is taken in the background.
    """

    prefix = "/console"

    def __init__(
        self,
        *,
        store: TimerStore,
        quarantine: Quarantine,
        clock: Clock,
        access: HttpAccess,
        port: Callable[[], int],
        census_cap: int = 100_000,
        dead_letters: Callable[[], DeadLetters] | None = None,
        commands: Callable[[], TimerScheduler] | None = None,
        tenants: Sequence[str] | None = None,
        warnings: Callable[[], Sequence[str]] | None = None,
        reading_fresh_s: float = READING_FRESH_S,
    ) -> None:
        if not isinstance(store, TimerCensus) or not isinstance(store, TimerLookup):
            raise TypeError(
                f"the console needs a store with TimerCensus and TimerLookup: {store!r}"
            )
        self._store = store
        self._census_store: TimerCensus = store
        self._lookup: TimerLookup = store
        self._quarantine = quarantine
        self._clock = clock
        self._access = access
        self._port = port
        self._census_cap = census_cap
        self._dead_letters_of = dead_letters
        self._commands_of = commands
        self._warnings = warnings
        self._scope = None if tenants is None else frozenset(TenantId(t) for t in tenants)
        self.sessions = Sessions()
        self._reading: tuple[float, Reading] | None = None
        self._reading_fresh_s = reading_fresh_s
        self._reading_refresh: asyncio.Task[None] | None = None

    # -- dispatch -------------------------------------------------------------------------------

    async def handle(self, request: HttpRequest, body: bytes) -> Response:
        refusal = page_refusal(self._access, request, self._port())
        if refusal is not None:
            return refusal.status, _TEXT, f"{refusal.reason}\n".encode(), []
        path = request.path.rstrip("/") or "/"
        if path == "/console/static/console.css":
            return 200, "text/css; charset=utf-8", _CSS, [("Cache-Control", "max-age=3600")]
        if path == "/console/static/icon.svg":
            return 200, "image/svg+xml", _ICON, [("Cache-Control", "max-age=86400")]
        params = {k: v[0] for k, v in parse_qs(request.query).items()}
        if request.method == "POST":
            form_data = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
            return await self._post(request, path, form_data)
        if request.method not in ("GET", "HEAD"):
            return 405, _TEXT, b"method not allowed\n", []
        pages: dict[str, Callable[[Page], Awaitable[Html]]] = {
            "/console": self._overview,
            "/console/tenant": self._tenant,
            "/console/timer": self._timer,
            "/console/search": self._search,
            "/console/quarantine": self._quarantined,
            "/console/dead-letters": self._dead_letter_page,
            "/console/sign-in": self._sign_in_page,
        }
        render = pages.get(path)
        if render is None:
            return 404, _TEXT, b"not found\n", []
        page = Page(self, request, params, path)
        try:
            html = await render(page)
        except Redirect as redirect:
            return _see_other(redirect.location)
        except ValidationError as exc:
            page.status, page.error = 400, str(exc)
            html = Html("")
        except (StoreError, BrokerUnavailable) as exc:
            reason = redact_url(str(exc))  # a driver's message may carry a URL's password
            log.warning("console: %s %s failed: %s", request.method, request.path, reason)
            page.status, page.error = 503, f"the database or the broker did not answer: {reason}"
            html = Html("")
        return page.status, _HTML, page.render(html), list(_PAGE_HEADERS)

    @functools.cached_property
    def _dead_letters(self) -> DeadLetters | None:
        # Made on first use: the broker connection they need is not up when the console is.
        return None if self._dead_letters_of is None else self._dead_letters_of()

    @functools.cached_property
    def _commands(self) -> TimerScheduler | None:
        return None if self._commands_of is None else self._commands_of()

    # -- scope ----------------------------------------------------------------------------------

    def in_scope(self, tenant: str) -> bool:
        return self._scope is None or tenant in self._scope

    def _require_scope(self, tenant: TenantId) -> None:
        if not self.in_scope(tenant):
            raise ValidationError(
                f"tenant {tenant!r} is outside this console's TIMER_CONSOLE_TENANTS"
            )

    # -- pages ----------------------------------------------------------------------------------

    async def reading(self) -> Reading:
        """The overview's figures, all read at one moment: taken when first asked for, then
        again in the background once older than 30 s, so a page never waits for it but the
        first one."""
        if self._reading is None:
            await self._read()
        elif time.monotonic() - self._reading[0] >= self._reading_fresh_s and (
            self._reading_refresh is None or self._reading_refresh.done()
        ):
            self._reading_refresh = asyncio.create_task(self._read())
        assert self._reading is not None
        return self._reading[1]

    async def _read(self) -> None:
        now = self._clock.now()
        scope = None if self._scope is None else sorted(self._scope)
        try:
            # The census and the ranking count at the same instant, so that a tenant's
            # overdue timers are the census's overdue ones (the ranking only looks further).
            census = (
                None
                if scope is not None
                else await take_census(self._census_store, now, cap=self._census_cap)
            )
            rows, more = await tenant_census(
                self._census_store, now, tenants=TOP_TENANTS_SCANNED, cap=TENANT_CAP, only=scope
            )
        except StoreError as exc:
            if self._reading is None:
                raise
            log.warning("console: could not read the overview's figures again: %s", exc)
            return
        since = [q.since for q in self._quarantine.quarantined if self.in_scope(q.entry.tenant_id)]
        self._reading = (
            time.monotonic(),
            Reading(now, census, rows, more, len(since), min(since, default=None)),
        )

    async def _overview(self, page: Page) -> Html:
        reading = await self.reading()
        now = page.at = reading.at
        warnings = [] if self._warnings is None else self._warnings()
        parts: list[Html] = [Html(f'<p class="notice" role="alert">{esc(w)}</p>') for w in warnings]
        parts.append(_search_forms())
        if reading.census is not None:
            parts.append(_census_panel(reading.census))
        rows = reading.tenants
        by_pending = sorted(rows, key=lambda r: (-r.pending, r.tenant_id))[:_TOP]
        by_oldest = sorted(
            (r for r in rows if r.overdue), key=lambda r: (r.earliest_due_at, r.tenant_id)
        )[:_TOP]

        def count(n: int) -> str:
            return f"{n}+" if n >= TENANT_CAP else str(n)

        parts.append(Html('<div class="grid"><section class="panel">'))
        parts.append(
            table(
                "Tenants with the most pending timers",
                ["Tenant", "Pending", "Overdue"],
                [
                    (
                        link("/console/tenant", r.tenant_id, tenant=r.tenant_id),
                        count(r.pending),
                        count(r.overdue),
                    )
                    for r in by_pending
                ],
            )
        )
        parts.append(Html('</section><section class="panel">'))
        parts.append(
            table(
                "Tenants with the oldest overdue timer",
                ["Tenant", "Oldest overdue", "Overdue"],
                [
                    (
                        link("/console/tenant", r.tenant_id, tenant=r.tenant_id, state="scheduled"),
                        f"{ago(r.waited_s(now))}",
                        count(r.overdue),
                    )
                    for r in by_oldest
                ],
            )
        )
        parts.append(Html("</section></div>"))
        note = (
            f"Counts stop at {TENANT_CAP} per tenant (shown as {TENANT_CAP}+); "
            f"the first {TOP_TENANTS_SCANNED} tenants in id order are looked at"
            + (" (more exist)." if reading.more else ".")
            + f" These figures are read again every {self._reading_fresh_s:.0f} s at most."
        )
        parts.append(Html(f'<p class="muted">{esc(note)}</p>'))
        held = ""
        if reading.oldest_quarantined is not None:
            age = max(0.0, (now - reading.oldest_quarantined).total_seconds())
            held = f", the oldest held for {esc(ago(age))}"
        parts.append(
            Html(
                f"<p>{link('/console/quarantine', f'{reading.quarantined} quarantined timer(s)')}"
                f"{held} &middot; {link('/console/dead-letters', 'dead letters')}</p>"
            )
        )
        return join(parts)

    async def _tenant(self, page: Page) -> Html:
        tenant = TenantId(page.params.get("tenant", ""))
        self._require_scope(tenant)
        page.title = f"Tenant {tenant}"
        state = page.params.get("state", "scheduled")
        if state not in ("scheduled", "reached", "all"):
            raise ValidationError("state must be scheduled, reached or all")
        due_from = _instant(page.params.get("from"), "from")
        due_until = _instant(page.params.get("until"), "until")
        after = page.params.get("after")
        now = page.at = self._clock.now()
        next_after: str | None = None
        scanned_note = ""
        if state == "scheduled":
            cursor = None
            if after:
                due_text, _, call = after.partition("|")
                cursor = DueCursor(_instant(due_text, "after") or now, tenant, ServiceCallId(call))
            entries = await self._lookup.scheduled_for_tenant(
                tenant, due_from=due_from, due_until=due_until, limit=PAGE_SIZE + 1, after=cursor
            )
            if len(entries) > PAGE_SIZE:
                entries = entries[:PAGE_SIZE]
                last = entries[-1]
                next_after = f"{format_timestamp(last.due_at)}|{last.service_call_id}"
        else:
            entries, next_key = await self._lookup.scan_tenant(
                tenant,
                state=TimerState.REACHED if state == "reached" else None,
                due_from=due_from,
                due_until=due_until,
                limit=PAGE_SIZE,
                scan=SCAN_LIMIT,
                after=ServiceCallId(after) if after else None,
            )
            next_after = next_key
            scanned_note = (
                f"These come in service call id order; a page looks at {SCAN_LIMIT} timers at "
                "most (no index orders fired timers by due time), so one may show fewer than "
                f"{PAGE_SIZE} and the next carry on."
            )
        quarantined = {q.entry.key for q in self._quarantine.quarantined}
        rows = [
            (
                link(
                    "/console/timer", e.service_call_id, tenant=e.tenant_id, call=e.service_call_id
                ),
                _state_of(e, now, e.key in quarantined),
                when(e.due_at, now),
                e.correlation_id or "",
            )
            for e in entries
        ]
        filters = join(
            [
                Html('<form class="search" method="get" action="/console/tenant">'),
                Html(f'<input type="hidden" name="tenant" value="{esc(tenant)}">'),
                Html('<div class="field"><label for="f-state">State</label>'),
                Html('<select id="f-state" name="state">'),
                join(
                    Html(f'<option value="{v}"{" selected" if v == state else ""}>{n}</option>')
                    for v, n in (("scheduled", "Pending"), ("reached", "Fired"), ("all", "All"))
                ),
                Html("</select></div>"),
                field(
                    "from",
                    "Due from (UTC)",
                    page.params.get("from", ""),
                    hint="2030-01-31T09:00:00Z",
                ),
                field(
                    "until", "Due until (UTC)", page.params.get("until", ""), hint="empty: no end"
                ),
                Html('<button type="submit" class="primary">Filter</button></form>'),
            ]
        )
        pager = Html("")
        if next_after is not None:
            pager = Html(
                '<p class="pager">'
                + link(
                    "/console/tenant",
                    "Next page",
                    tenant=tenant,
                    state=state,
                    **{"from": page.params.get("from"), "until": page.params.get("until")},
                    after=next_after,
                )
                + "</p>"
            )
        caption = "Pending timers, earliest due first" if state == "scheduled" else "Timers"
        note = Html(f'<p class="muted">{esc(scanned_note)}</p>') if scanned_note else Html("")
        return join(
            [
                filters,
                table(caption, ["Service call", "State", "Due", "Correlation id"], rows),
                note,
                pager,
            ]
        )

    async def _timer(self, page: Page) -> Html:
        tenant = TenantId(page.params.get("tenant", ""))
        call = ServiceCallId(page.params.get("call", ""))
        self._require_scope(tenant)
        page.title = f"Timer {tenant} / {call}"
        record = await self._lookup.timer_record(tenant, call)
        now = page.at = self._clock.now()
        entry = record.entry
        quarantine = next(
            (q for q in self._quarantine.quarantined if q.entry.key == (tenant, call)), None
        )
        story: list[Html] = []
        facts: list[tuple[str, Html]] = [
            ("Tenant", link("/console/tenant", tenant, tenant=tenant)),
            ("Service call", esc(call)),
        ]
        if entry is not None:
            state = _state_of(entry, now, quarantine is not None)
            facts += [
                (
                    "State",
                    Html(f'<span class="state">{esc(state)}</span>'),
                ),
                ("Due", when(entry.due_at, now)),
                (
                    "Correlation id",
                    link("/console/search", entry.correlation_id, correlation=entry.correlation_id)
                    if entry.correlation_id
                    else Html("&ndash;"),
                ),
            ]
            if entry.trace_context is not None:
                facts.append(("Trace", esc(entry.trace_context.traceparent)))
            position = (
                f" (command #{record.command_position} of the commands stream)"
                if record.command_position is not None
                else ""
            )
            story.append(
                Html(
                    f"<li>Scheduled{esc(position)} at {when(entry.registered_at, now)}, "
                    f"due {when(entry.due_at, now)}. A reschedule replaces this line: the "
                    "store keeps a timer's latest schedule.</li>"
                )
            )
            if entry.reached_at is not None:
                late = (entry.reached_at - entry.due_at).total_seconds()
                story.append(
                    Html(
                        f"<li>Fired (DueTimeReached published and acknowledged) at "
                        f"{when(entry.reached_at, now)}, {esc(ago(late))} after its due time.</li>"
                    )
                )
            elif entry.due_at <= now and quarantine is None:
                overdue = ago((now - entry.due_at).total_seconds())
                story.append(Html(f"<li>Overdue by {esc(overdue)}: the next pass takes it.</li>"))
        if quarantine is not None:
            story.append(
                Html(
                    f"<li>Quarantined at {when(quarantine.since, now)} after "
                    f"{quarantine.failures} failed publishes; last error: "
                    f"<q>{esc(quarantine.error)}</q>. Left out of every pass until retried.</li>"
                )
            )
        if record.cancelled_at is not None:
            story.append(
                Html(
                    f"<li>Cancelled (command #{record.cancel_position}) at "
                    f"{when(record.cancelled_at, now)}.</li>"
                )
            )
        if entry is None and record.cancelled_at is None:
            story.append(
                Html(
                    "<li>No such timer: never scheduled, cancelled without a command position, "
                    "or fired and purged after the retention period.</li>"
                )
            )
        actions: list[Html] = []
        if page.can_act:
            back = {"tenant": tenant, "call": call, "back": "timer"}
            if quarantine is not None:
                actions.append(form("/console/actions/retry", "Retry now", back, csrf=page.csrf))
            if entry is not None and entry.is_scheduled:
                actions.append(
                    form(
                        "/console/actions/cancel", "Cancel timer", back, csrf=page.csrf, danger=True
                    )
                )
        facts_html = join(Html(f"<dt>{esc(k)}</dt><dd>{v}</dd>") for k, v in facts)
        return join(
            [
                Html(f'<dl class="facts">{facts_html}</dl><h2>Story</h2><ol class="story">'),
                join(story),
                Html("</ol>"),
                Html(f"<h2>Actions</h2><p>{join(actions)}</p>") if actions else Html(""),
            ]
        )

    async def _search(self, page: Page) -> Html:
        tenant_text = page.params.get("tenant", "").strip()
        call_text = page.params.get("call", "").strip()
        correlation_text = page.params.get("correlation", "").strip()
        page.title = "Search"
        tenant = TenantId(tenant_text) if tenant_text else None
        if tenant is not None:
            self._require_scope(tenant)
        if tenant is not None and call_text:
            ServiceCallId(call_text)
            raise Redirect("/console/timer?" + urlencode({"tenant": tenant, "call": call_text}))
        if not correlation_text:
            if tenant is not None:
                raise Redirect("/console/tenant?" + urlencode({"tenant": tenant}))
            raise ValidationError("give a tenant and a service call id, or a correlation id")
        correlation = CorrelationId(correlation_text)
        if tenant is not None:
            found = await self._store.find_by_correlation(tenant, correlation)
        else:
            found = await self._lookup.find_by_correlation_id(correlation, limit=PAGE_SIZE)
        found = [e for e in found if self.in_scope(e.tenant_id)]
        now = page.at = self._clock.now()
        quarantined = {q.entry.key for q in self._quarantine.quarantined}
        rows = [
            (
                link("/console/tenant", e.tenant_id, tenant=e.tenant_id),
                link(
                    "/console/timer", e.service_call_id, tenant=e.tenant_id, call=e.service_call_id
                ),
                _state_of(e, now, e.key in quarantined),
                when(e.due_at, now),
            )
            for e in found
        ]
        return join(
            [
                _search_forms(tenant_text, call_text, correlation_text),
                table(
                    f"Timers with correlation id {correlation}",
                    ["Tenant", "Service call", "State", "Due"],
                    rows,
                ),
            ]
        )

    async def _quarantined(self, page: Page) -> Html:
        page.title = "Quarantined timers"
        now = page.at = self._clock.now()
        items = [q for q in self._quarantine.quarantined if self.in_scope(q.entry.tenant_id)]

        def actions(q: QuarantinedTimer) -> Html:
            if not page.can_act:
                return Html("")
            key = {
                "tenant": q.entry.tenant_id,
                "call": q.entry.service_call_id,
                "back": "quarantine",
            }
            return join(
                [
                    form("/console/actions/retry", "Retry", key, csrf=page.csrf),
                    form("/console/actions/cancel", "Cancel", key, csrf=page.csrf, danger=True),
                ]
            )

        rows = [
            (
                link(
                    "/console/timer",
                    f"{q.entry.tenant_id} / {q.entry.service_call_id}",
                    tenant=q.entry.tenant_id,
                    call=q.entry.service_call_id,
                ),
                when(q.entry.due_at, now),
                q.failures,
                q.error,
                when(q.since, now),
                actions(q),
            )
            for q in items
        ]
        intro = (
            "A timer whose DueTimeReached kept failing to publish while others went out. It "
            "stays pending and is left out of every pass until retried; this instance's record "
            "(another instance keeps its own)."
        )
        headers = ["Timer", "Due", "Failures", "Last error", "Since", "Actions"]
        return _listing(intro, table("Quarantined timers", headers, rows))

    async def _dead_letter_page(self, page: Page) -> Html:
        page.title = "Dead letters"
        now = page.at = self._clock.now()
        if self._dead_letters is None:
            return Html('<p class="muted">No dead-letter stream on this service.</p>')
        tenant = page.params.get("tenant", "").strip()
        after_text = page.params.get("after", "0")
        if not after_text.isdigit():
            raise ValidationError("after must be a dead letter's sequence number")
        after = int(after_text)
        if tenant:
            if tenant != "_":
                self._require_scope(TenantId(tenant))
            elif self._scope is not None:
                raise ValidationError("unreadable tenants are outside TIMER_CONSOLE_TENANTS")
        tenants: list[str | None] = (
            [tenant] if tenant else [None] if self._scope is None else [*sorted(self._scope)]
        )
        letters: list[DeadLetter] = []
        for one in tenants:
            letters += await self._dead_letters.list(tenant=one, limit=PAGE_SIZE + 1, after=after)
        letters = sorted(letters, key=lambda letter: letter.seq)
        more = len(letters) > PAGE_SIZE
        letters = letters[:PAGE_SIZE]

        def actions(letter: DeadLetter) -> Html:
            if not page.can_act:
                return Html("")
            return form("/console/actions/replay", "Replay", {"seq": letter.seq}, csrf=page.csrf)

        rows = [
            (
                letter.seq,
                letter.tenant,
                when(letter.time, now),
                letter.reason,
                _preview(letter.data),
                actions(letter),
            )
            for letter in letters
        ]
        intro = (
            "Commands the service refused (undecodable, over quota), with why. Replay sends one "
            "back to its tenant's command subject, unchanged; fix its cause first "
            "(timer-service dlq replay --data sends a fixed one)."
        )
        filters = join(
            [
                Html('<form class="search" method="get" action="/console/dead-letters">'),
                field(
                    "tenant", "Tenant id", tenant, hint="_ for commands whose tenant was unreadable"
                ),
                Html('<button type="submit" class="primary">Filter</button></form>'),
            ]
        )
        pager = (
            [link("/console/dead-letters", "First page", tenant=tenant or None)] if after else []
        )
        if more:
            pager.append(
                link(
                    "/console/dead-letters",
                    "Next page",
                    tenant=tenant or None,
                    after=letters[-1].seq,
                )
            )
        caption = (
            f"Dead letters of {tenant}, oldest first" if tenant else "Dead letters, oldest first"
        )
        headers = ["Seq", "Tenant", "Time", "Reason", "Command", "Actions"]
        return join(
            [
                filters,
                _listing(intro, table(caption, headers, rows)),
                Html(f'<p class="pager">{join(pager)}</p>') if pager else Html(""),
            ]
        )

    async def _sign_in_page(self, page: Page) -> Html:
        page.title = "Sign in"
        if self._access.token is None:
            return Html(
                "<p>The console is read-only: set <code>TIMER_HTTP_TOKEN</code> on the service "
                "to allow actions.</p>"
            )
        return Html(
            '<form method="post" action="/console/sign-in" class="search">'
            + field("token", "Action token (TIMER_HTTP_TOKEN)", "", kind="password")
            + '<button type="submit" class="primary">Sign in</button></form>'
            '<p class="muted">The session lasts 8 hours, in this service only; the token is '
            "never stored in the browser.</p>"
        )

    # -- actions --------------------------------------------------------------------------------

    async def _post(self, request: HttpRequest, path: str, data: dict[str, str]) -> Response:
        port = self._port()
        if path == "/console/sign-in":
            refusal = sign_in_refusal(self._access, request, port, data.get("token"))
            if refusal is not None:
                return self._refused(request, refusal)
            session = self.sessions.open()
            log.info("console: signed in from %s", request.client)
            return _see_other(
                "/console?notice=signed-in",
                [("Set-Cookie", f"{COOKIE}={session}; Path=/console; HttpOnly; SameSite=Strict")],
            )
        actions: dict[str, Callable[[dict[str, str]], Awaitable[str]]] = {
            "/console/sign-out": self._sign_out,
            "/console/actions/retry": self._retry,
            "/console/actions/cancel": self._cancel,
            "/console/actions/replay": self._replay,
        }
        act = actions.get(path)
        if act is None:
            return 404, _TEXT, b"not found\n", []
        what = _describe(path, data)
        refusal = action_refusal(
            self._access, request, port, sessions=self.sessions, csrf=data.get("csrf"), what=what
        )
        if refusal is not None:
            return self._refused(request, refusal)
        try:
            notice = await act(data | {"session": session_of(request) or ""})
        except ValidationError as exc:
            return self._refused(request, Refusal(400, str(exc)))
        extra: list[tuple[str, str]] = []
        if path == "/console/sign-out":
            extra.append(
                ("Set-Cookie", f"{COOKIE}=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0")
            )
        return _see_other(
            _back(data) + ("&" if "?" in _back(data) else "?") + f"notice={notice}", extra
        )

    def _refused(self, request: HttpRequest, refusal: Refusal) -> Response:
        page = Page(self, request, {}, "")
        page.title, page.status, page.error = "Refused", refusal.status, refusal.reason
        html = Html(f"<p>{link('/console', 'Back to the overview')}</p>")
        return refusal.status, _HTML, page.render(html), list(_PAGE_HEADERS)

    async def _sign_out(self, data: dict[str, str]) -> str:
        self.sessions.close(data.get("session"))
        return "signed-out"

    def _key(self, data: dict[str, str]) -> TimerKey:
        key = TimerKey(TenantId(data.get("tenant", "")), ServiceCallId(data.get("call", "")))
        self._require_scope(key.tenant_id)
        return key

    async def _retry(self, data: dict[str, str]) -> str:
        key = self._key(data)
        retried = self._quarantine.retry_quarantined([key])
        log.info("console: retry of quarantined timer %s/%s: %d retried", *key, retried)
        return "retried" if retried else "retried-none"

    async def _cancel(self, data: dict[str, str]) -> str:
        key = self._key(data)
        if self._commands is not None:
            command = await self._commands.cancel(key.tenant_id, key.service_call_id)
            log.info("console: cancel of timer %s/%s sent as command %s", *key, command)
            return "cancel-sent"
        outcome = await self._store.cancel(*key)
        log.info("console: cancel of timer %s/%s: %s", *key, outcome)
        return "cancelled" if outcome == "cancelled" else "cancel-noop"

    async def _replay(self, data: dict[str, str]) -> str:
        if self._dead_letters is None:
            raise ValidationError("no dead-letter stream on this service")
        seq_text = data.get("seq", "")
        if not seq_text.isdigit():
            raise ValidationError("seq must be a dead letter's sequence number")
        if self._scope is not None:
            letters = [
                letter
                for tenant in sorted(self._scope)
                for letter in await self._dead_letters.list(tenant=tenant, limit=100_000)
                if letter.seq == int(seq_text)
            ]
            if not letters:
                raise ValidationError("that dead letter is outside this console's tenants")
        (result,) = await self._dead_letters.replay([int(seq_text)])
        log.info("console: replay of dead letter %d: %s", result.seq, result.outcome)
        return "replayed" if result.replayed else "replay-kept"


@attrs.frozen
class Reading:
    """The overview's figures, read at one moment (``at``) and shown together."""

    at: datetime
    census: Census | None
    """None for a console limited to some tenants (the census counts every tenant's)."""
    tenants: list[TenantCensus]
    more: bool
    quarantined: int
    oldest_quarantined: datetime | None = None
    """When the longest-held of them was quarantined (None: none is)."""


class Page:
    """One GET being answered: its parameters, session, and what the layout needs."""

    def __init__(
        self, console: Console, request: HttpRequest, params: dict[str, str], path: str
    ) -> None:
        self.console = console
        self.params = params
        self.path = path
        self.title = "Overview"
        self.status = 200
        self.error: str | None = None
        self.at: datetime | None = None
        """The moment the page's figures were read, shown with them."""
        refresh = params.get("refresh", "")
        self.refresh = int(refresh) if refresh.isdigit() and int(refresh) in REFRESH_S else None
        session = session_of(request)
        self.signed_in = console.sessions.valid(session)
        self.csrf = console.sessions.csrf(session) if self.signed_in and session else None
        self.actions_on = console._access.token is not None

    @property
    def can_act(self) -> bool:
        return self.actions_on and self.signed_in

    def render(self, body: Html) -> bytes:
        notice = _NOTICES.get(self.params.get("notice", ""))
        return layout(
            self.title,
            body,
            current=self.path,
            signed_in=self.signed_in,
            actions_on=self.actions_on,
            csrf=self.csrf,
            notice=notice,
            error=self.error,
            at=self.at,
            made_at=self.console._clock.now(),
            refresh=self._refresh_links() if self.at is not None else None,
            refresh_every=self.refresh,
            here=self._url(refresh=self.refresh),
        )

    def _url(self, **changes: object) -> str:
        """This page's address with ``changes`` to its query (None drops one; no notice)."""
        params: dict[str, object] = {k: v for k, v in self.params.items() if k != "notice"}
        params.update(changes)
        query = urlencode({k: str(v) for k, v in params.items() if v is not None})
        return self.path + ("?" + query if query else "")

    def _refresh_links(self) -> list[tuple[str, str, bool]]:
        """The refresh choices: (label, address, chosen)."""
        return [("off", self._url(refresh=None), self.refresh is None)] + [
            (f"every {n} s", self._url(refresh=n), self.refresh == n) for n in REFRESH_S
        ]


class Redirect(Exception):
    """Answer with 303 See Other to ``location`` (a console path)."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.location = location


def _see_other(location: str, headers: list[tuple[str, str]] | None = None) -> Response:
    return 303, _TEXT, b"see other\n", [("Location", location), *(headers or [])]


def _back(data: dict[str, str]) -> str:
    """Where an action returns: a fixed console page, never a URL from the form."""
    back = data.get("back")
    if back == "timer" and data.get("tenant") and data.get("call"):
        return "/console/timer?" + urlencode({"tenant": data["tenant"], "call": data["call"]})
    if back == "quarantine":
        return "/console/quarantine"
    if data.get("seq"):
        return "/console/dead-letters"
    return "/console"


def _describe(path: str, data: dict[str, str]) -> str:
    """One line naming an action for the log (ids only: they are validated tokens)."""
    what = path.removeprefix("/console/").removeprefix("actions/")
    if data.get("tenant") or data.get("call"):
        return f"{what} {data.get('tenant', '')!r}/{data.get('call', '')!r}"
    if data.get("seq"):
        return f"{what} dead letter {data['seq']!r}"
    return what


def _instant(text: str | None, name: str) -> datetime | None:
    if not text:
        return None
    text = text.strip()
    if "T" in text and not text.endswith("Z") and "+" not in text and text.count("-") <= 2:
        text += "Z"  # a datetime-local value: the console's times are UTC
    if len(text) == 17 and text.endswith("Z"):  # YYYY-MM-DDTHH:MMZ
        text = text[:-1] + ":00Z"
    try:
        return parse_timestamp(text)
    except InvalidTimestamp as exc:
        raise ValidationError(f"{name}: {exc}") from None


def _state_of(entry: TimerEntry, now: datetime, quarantined: bool) -> str:
    if entry.reached_at is not None:
        return "Fired"
    if quarantined:
        return "Quarantined"
    return "Overdue" if entry.due_at <= now else "Pending"


def _preview(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= 200 else text[:200] + "…"


def _listing(intro: str, listed: Html) -> Html:
    """A list page: one muted paragraph saying what it lists, then the table."""
    return Html(f'<p class="muted">{esc(intro)}</p>{listed}')


def _search_forms(tenant: str = "", call: str = "", correlation: str = "") -> Html:
    return join(
        [
            Html('<section class="panel"><h2>Find a timer</h2>'),
            Html('<form class="search" method="get" action="/console/search" role="search">'),
            field("tenant", "Tenant id", tenant),
            field("call", "Service call id", call),
            field("correlation", "or correlation id", correlation),
            Html('<button type="submit" class="primary">Search</button></form></section>'),
        ]
    )


def _census_panel(census: Census) -> Html:
    labels = {
        "overdue": "Overdue",
        "1m": "Due within a minute",
        "1h": "Within an hour",
        "1d": "Within a day",
        "later": "Later",
    }
    rows = [
        (labels[name], f"{census.counts[name]}{'+' if census.capped(name) else ''}")
        for name, _, _ in BUCKETS
    ]
    oldest = "none" if census.oldest_overdue_s == 0 else ago(census.oldest_overdue_s)
    return join(
        [
            Html('<section class="panel"><h2>Pending timers</h2>'),
            table("Pending timers by due time", ["Due", "Timers"], rows),
            Html(
                f"<p>Oldest overdue: <strong>{esc(oldest)}</strong>. "
                f'<span class="muted">Each bucket is counted up to {census.cap} '
                "(TIMER_CENSUS_CAP).</span></p></section>"
            ),
        ]
    )
