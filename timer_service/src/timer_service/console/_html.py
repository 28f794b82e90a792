"""The console's HTML: one layout and a few building blocks, every value escaped on the way in.

Server-rendered, no script: pages work with JavaScript off, and the Content-Security-Policy
allows nothing but the console's own stylesheet.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from urllib.parse import urlencode

from timer_core.instants import format_timestamp

__all__ = [
    "Html",
    "ago",
    "esc",
    "field",
    "form",
    "layout",
    "link",
    "table",
    "when",
]


class Html(str):
    """Markup already escaped: the only kind of string the blocks below insert as is."""

    __slots__ = ()


def esc(value: object) -> Html:
    """``value`` as text inside HTML (attributes included); Html passes through."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def join(parts: Iterable[Html]) -> Html:
    return Html("".join(parts))


def link(path: str, text: object, **params: object) -> Html:
    """An ``<a>`` to a console path with query parameters (None ones left out)."""
    query = urlencode({k: str(v) for k, v in params.items() if v is not None and v != ""})
    href = path + ("?" + query if query else "")
    return Html(f'<a href="{esc(href)}">{esc(text)}</a>')


def ago(seconds: float) -> str:
    """A duration as an operator reads it: ``3 s``, ``4 min``, ``2 h``, ``5 d``."""
    seconds = abs(seconds)
    for size, unit in ((86_400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}".replace(".0 ", " ")
    return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def when(value: datetime | None, now: datetime | None) -> Html:
    """A ``<time>`` with the instant in UTC and how far from ``now`` it is (None: not)."""
    if value is None:
        return Html("&ndash;")
    stamp = format_timestamp(value)
    if now is None:
        return Html(f'<time datetime="{esc(stamp)}">{esc(stamp.replace("T", " "))}</time>')
    delta = (value - now).total_seconds()
    relative = (
        "now" if abs(delta) < 0.5 else (f"in {ago(delta)}" if delta > 0 else f"{ago(delta)} ago")
    )
    return Html(
        f'<time datetime="{esc(stamp)}">{esc(stamp.replace("T", " "))}</time>'
        f' <span class="muted">({esc(relative)})</span>'
    )


def table(caption: str, headers: Sequence[str], rows: Iterable[Sequence[object]]) -> Html:
    """A table with a caption and column headers; an empty one says so."""
    # Four columns and more become one card per row on a phone, each cell's content beside
    # its column's name, so that every cell and its buttons are on the screen without
    # scrolling sideways.
    wide = len(headers) >= 4
    body = [
        "<tr>"
        + "".join(
            f'<td data-label="{esc(header)}"><div>{esc(cell)}</div></td>'
            if wide
            else f"<td>{esc(cell)}</td>"
            for header, cell in zip(headers, row, strict=True)
        )
        + "</tr>"
        for row in rows
    ]
    if not body:
        body = [f'<tr><td colspan="{len(headers)}" class="muted">None.</td></tr>']
    head = "".join(f'<th scope="col">{esc(h)}</th>' for h in headers)
    wide_class = ' class="wide"' if wide else ""
    return Html(
        f'<div class="scroll" role="region" aria-label="{esc(caption)}" tabindex="0">'
        f"<table{wide_class}><caption>{esc(caption)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def field(name: str, label: str, value: object = "", *, kind: str = "text", hint: str = "") -> Html:
    """A labelled input (the label's ``for`` names it; a hint is tied by aria-describedby)."""
    ident = f"f-{name}"
    described = f' aria-describedby="{ident}-hint"' if hint else ""
    hint_html = f'<small id="{ident}-hint" class="muted">{esc(hint)}</small>' if hint else ""
    return Html(
        f'<div class="field"><label for="{ident}">{esc(label)}</label>'
        f'<input id="{ident}" name="{esc(name)}" type="{esc(kind)}" value="{esc(value)}"'
        f' autocomplete="off"{described}>{hint_html}</div>'
    )


def form(
    action: str,
    button: str,
    fields: Mapping[str, object],
    *,
    csrf: str | None,
    danger: bool = False,
) -> Html:
    """A POST form of hidden fields and one button, carrying the session's CSRF token."""
    hidden = "".join(
        f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">'
        for k, v in {**fields, "csrf": csrf}.items()
        if v is not None
    )
    kind = "danger" if danger else "primary"
    return Html(
        f'<form method="post" action="{esc(action)}" class="inline">{hidden}'
        f'<button type="submit" class="{kind}">{esc(button)}</button></form>'
    )


_NAV = (
    ("/console", "Overview"),
    ("/console/quarantine", "Quarantine"),
    ("/console/dead-letters", "Dead letters"),
)


def layout(
    title: str,
    body: Html,
    *,
    current: str,
    signed_in: bool,
    actions_on: bool,
    csrf: str | None,
    notice: str | None = None,
    error: str | None = None,
    at: datetime | None = None,
    made_at: datetime | None = None,
    refresh: Sequence[tuple[str, str, bool]] | None = None,
    refresh_every: int | None = None,
    here: str = "",
) -> bytes:
    """The whole page: header with navigation and sign-in state, a notice, the moment the
    page's figures were read with the refresh choices, the body.

    ``at``: when the page's figures were read (``made_at``: when the page was made).
    ``refresh_every``: the page reloads ``here`` after that many seconds, by the browser's
    own ``<meta http-equiv="refresh">`` (no script; the page's policy allows it).
    """
    nav = "".join(
        f'<li><a href="{path}"{" aria-current=page" if path == current else ""}>{name}</a></li>'
        for path, name in _NAV
    )
    if not actions_on:
        who = Html('<span class="muted">Read-only (TIMER_HTTP_TOKEN not set)</span>')
    elif signed_in:
        who = form("/console/sign-out", "Sign out", {}, csrf=csrf)
    else:
        who = link("/console/sign-in", "Sign in to act")
    message = ""
    if notice:
        message = f'<p class="notice" role="status">{esc(notice)}</p>'
    if error:
        message += f'<p class="error" role="alert">{esc(error)}</p>'
    moment = ""
    if at is not None:
        moment = f'<p class="moment">Figures as of {when(at, None)}'
        if made_at is not None and (made_at - at).total_seconds() >= 1:
            moment += f" (read {esc(ago((made_at - at).total_seconds()))} before this page)"
        if refresh:
            choices = " &middot; ".join(
                f'<a href="{esc(url)}" aria-current="true">{esc(label)}</a>'
                if chosen
                else f'<a href="{esc(url)}">{esc(label)}</a>'
                for label, url, chosen in refresh
            )
            moment += f'. <span class="refresh">Refresh: {choices}</span>'
        moment += "</p>"
    reload = (
        f'<meta http-equiv="refresh" content="{refresh_every}; url={esc(here)}">'
        if refresh_every
        else ""
    )
    document = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{reload}"
        f"<title>{esc(title)} · Timer console</title>"
        '<link rel="icon" href="/console/static/icon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="/console/static/console.css"></head><body>'
        '<a class="skip" href="#main">Skip to content</a>'
        '<header><p class="brand"><a href="/console">Timer console</a></p>'
        f'<nav aria-label="Console"><ul>{nav}</ul></nav><div class="who">{who}</div></header>'
        f'<main id="main"><h1>{esc(title)}</h1>{message}{moment}{body}</main></body></html>'
    )
    return document.encode()
