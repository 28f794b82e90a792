"""Who may do what in the console: sessions opened with ``TIMER_HTTP_TOKEN``, the CSRF token
of their forms, and the one gate every action passes (:func:`action_refusal`).

Pages are read-only for anyone who reaches the endpoint with its own ``Host`` (the endpoint
listens on loopback unless told otherwise); an action needs a session, its form's CSRF
token, and the browser's same-origin marks, then goes through the endpoint's
:class:`~timer_service.access.HttpAccess` rules like any other state-changing request, which
logs it. The token itself is never rendered, stored in a cookie or logged: a session is a
random id the service keeps in memory (gone at restart), and the CSRF token an HMAC of it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time

import attrs

from timer_service.access import HttpAccess, HttpRequest, Refusal

__all__ = [
    "COOKIE",
    "Sessions",
    "action_refusal",
    "page_refusal",
    "session_of",
    "sign_in_refusal",
]

log = logging.getLogger("timer_service.access")

#: The session cookie's name: HttpOnly, SameSite=Strict, Path=/console.
COOKIE = "timer_console"
_SESSION_S = 8 * 3600.0
_MAX_SESSIONS = 1000


@attrs.define
class Sessions:
    """The console's signed-in sessions, in memory: id -> expiry (monotonic seconds)."""

    ttl_s: float = _SESSION_S
    _open: dict[str, float] = attrs.field(factory=dict)
    _key: bytes = attrs.field(factory=lambda: secrets.token_bytes(32))

    def open(self) -> str:
        """A new session id (the oldest is dropped past a thousand)."""
        now = time.monotonic()
        self._open = {sid: until for sid, until in self._open.items() if until > now}
        while len(self._open) >= _MAX_SESSIONS:
            del self._open[next(iter(self._open))]
        session = secrets.token_urlsafe(32)
        self._open[session] = now + self.ttl_s
        return session

    def close(self, session: str | None) -> None:
        if session is not None:
            self._open.pop(session, None)

    def valid(self, session: str | None) -> bool:
        until = None if session is None else self._open.get(session)
        return until is not None and until > time.monotonic()

    def csrf(self, session: str) -> str:
        """The CSRF token the forms of ``session`` carry."""
        return hmac.new(self._key, session.encode(), hashlib.sha256).hexdigest()

    def csrf_valid(self, session: str | None, presented: str | None) -> bool:
        if session is None or presented is None or not self.valid(session):
            return False
        return hmac.compare_digest(self.csrf(session).encode(), presented.encode())


def session_of(request: HttpRequest) -> str | None:
    """The console session id the request's cookie carries, if any."""
    for part in (request.header("cookie") or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and value:
            return value
    return None


def page_refusal(access: HttpAccess, request: HttpRequest, port: int) -> Refusal | None:
    """Why a page may not be shown: a ``Host`` that is not the endpoint's (a rebound name),
    or a request a browser marked cross-site; None to show it."""
    refusal = access.host_refusal(request, port)
    if refusal is not None:
        return refusal
    if (request.header("sec-fetch-site") or "").lower() == "cross-site":
        return Refusal(403, "cross-site request (Sec-Fetch-Site)")
    return None


def action_refusal(
    access: HttpAccess,
    request: HttpRequest,
    port: int,
    *,
    sessions: Sessions,
    csrf: str | None,
    what: str,
) -> Refusal | None:
    """The one gate of every console action; None lets ``what`` happen (and logs it).

    Refused: without ``TIMER_HTTP_TOKEN`` (the console is read-only), without the browser's
    ``Origin`` (every browser sends it with a POST; its absence means a client that did not
    come from the console's own page), without a signed-in session and its form's CSRF
    token, and by the endpoint's own rules (``Host``, ``Origin``, ``Sec-Fetch-Site``).
    The session and CSRF token stand in for the bearer header a form cannot send.
    """
    if access.token is None:
        return _logged(
            request,
            Refusal(403, "the console is read-only: set TIMER_HTTP_TOKEN to allow actions"),
        )
    if request.header("origin") is None:
        return _logged(request, Refusal(403, "a console action needs the Origin header"))
    session = session_of(request)
    if not sessions.csrf_valid(session, csrf):
        return _logged(
            request,
            Refusal(401, "sign in to the console with TIMER_HTTP_TOKEN (or the form expired)"),
        )
    headers = {
        name: value
        for name, value in request.headers.items()
        if name not in ("content-type", "authorization")
    }
    headers["authorization"] = f"Bearer {access.token}"
    return access.check(attrs.evolve(request, headers=headers), port, what=f"console: {what}")


def _same_origin(request: HttpRequest) -> bool:
    """Whether the browser says the request comes from a page of this very host (over HTTP,
    or HTTPS through a proxy that terminates TLS)."""
    origin = (request.header("origin") or "").lower()
    host = (request.header("host") or "").lower()
    return bool(host) and origin in (f"http://{host}", f"https://{host}")


def _logged(request: HttpRequest, refusal: Refusal) -> Refusal:
    """``refusal``, logged like the endpoint's own refusals."""
    log.warning(
        "HTTP %s %s from %s refused (%d): %s",
        request.method,
        request.path,
        request.client,
        refusal.status,
        refusal.reason,
    )
    return refusal


def sign_in_refusal(
    access: HttpAccess, request: HttpRequest, port: int, presented: str | None
) -> Refusal | None:
    """Why a sign-in fails: no token configured, a cross-site form, or the wrong token."""
    if access.token is None:
        return Refusal(403, "the console is read-only: TIMER_HTTP_TOKEN is not set")
    if not _same_origin(request):
        return _logged(request, Refusal(403, "sign in from the console's own page"))
    refusal = page_refusal(access, request, port)
    if refusal is not None:
        return _logged(request, refusal)
    if presented is None or not hmac.compare_digest(presented.encode(), access.token.encode()):
        return _logged(request, Refusal(401, "wrong token"))
    return None
