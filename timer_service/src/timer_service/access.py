"""Who may act through the service's HTTP endpoint: the token, ``Host`` and cross-site checks
every state-changing endpoint (and every one that shows tenants' data) passes first.

Every request names the endpoint in its ``Host`` header (:meth:`HttpAccess.host_refusal`):
the address it listens on, one of ``TIMER_HTTP_ALLOWED_HOSTS``, and for probes and scrapes
(``/healthz``, ``/metrics``) also one of ``TIMER_HTTP_PROBE_HOSTS``; a page that rebinds its
own name to the endpoint's address reads nothing. Probes and scrapes need no token; anything
that changes state or lists tenants' timers goes through :meth:`HttpAccess.check`, which wants

- ``Authorization: Bearer <TIMER_HTTP_TOKEN>`` (without the setting, such endpoints are
  off): a browser never sends it cross-site without a preflight, which this server never
  answers;
- a ``Host`` header naming the address the endpoint listens on (or one of
  ``TIMER_HTTP_ALLOWED_HOSTS``): a page that rebinds its own name to 127.0.0.1 is refused;
- no ``Origin`` but the endpoint's own, no ``Sec-Fetch-Site: cross-site``, and for a request
  with a body none of the content types a form can send without a preflight.

Each checked request is logged (refusals at ``WARNING``), with the client's address and
never the token.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping

import attrs

from timer_core.redaction import REDACTED
from timer_service.settings import Settings

__all__ = ["HttpAccess", "HttpRequest", "Refusal", "bearer"]

log = logging.getLogger("timer_service.access")

#: What a page may POST cross-site without a preflight (the "simple" content types).
_SIMPLE_CONTENT_TYPES = frozenset(
    ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")
)
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_WILDCARDS = ("", "0.0.0.0", "::")


@attrs.frozen
class HttpRequest:
    """The head of one HTTP/1.1 request: what a guard needs to decide on it."""

    method: str
    path: str
    query: str = ""
    headers: Mapping[str, str] = attrs.field(factory=dict)
    """Header names lower-cased; a repeated header keeps its first value."""
    client: str = ""
    """The peer's address, for the log."""

    @classmethod
    def parse(cls, head: bytes, client: str = "") -> HttpRequest:
        """The request whose head (request line and headers, up to the blank line) is ``head``."""
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path, _, query = rest.partition(" ")[0].partition("?")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                headers.setdefault(name.strip().lower(), value.strip())
        return cls(method, path, query, headers, client)

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or None."""
        return self.headers.get(name.lower())


@attrs.frozen
class Refusal:
    """Why a request was turned away: the HTTP status and one line for the client."""

    status: int
    reason: str


def _shown_secret(secret: str | None) -> str:
    return repr(None if secret is None else REDACTED)


def _lower_names(names: Iterable[str]) -> frozenset[str]:
    return frozenset(name.lower() for name in names)


@attrs.frozen
class HttpAccess:
    """The access rules of one HTTP endpoint listening on ``listen_host``.

    ``token`` is ``TIMER_HTTP_TOKEN`` (None: guarded endpoints are off);
    ``allowed_hosts`` are extra names a ``Host`` header may carry (a proxy's, a DNS name of
    the machine), ``TIMER_HTTP_ALLOWED_HOSTS``; ``probe_hosts`` are names only ``/healthz``
    and ``/metrics`` accept (a load balancer's or Prometheus's name for the service),
    ``TIMER_HTTP_PROBE_HOSTS``. A name given without a port is accepted with any port or
    none. Build it with :meth:`from_settings`.
    """

    token: str | None = attrs.field(repr=_shown_secret)
    listen_host: str = "127.0.0.1"
    allowed_hosts: frozenset[str] = attrs.field(default=frozenset(), converter=_lower_names)
    probe_hosts: frozenset[str] = attrs.field(default=frozenset(), converter=_lower_names)

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpAccess:
        """The rules ``settings`` ask for."""
        return cls(
            settings.http_token,
            settings.http_host,
            settings.http_allowed_hosts or (),
            settings.http_probe_hosts or (),
        )

    def host_refusal(
        self, request: HttpRequest, port: int, *, probe: bool = False
    ) -> Refusal | None:
        """Why ``request`` does not reach this endpoint by one of its names (None: it does).
        ``probe``: a health probe or a metrics scrape, which ``probe_hosts`` may name too."""
        host = (request.header("host") or "").lower()
        if self._host_allowed(host, port):
            return None
        if probe and (host in self.probe_hosts or _without_port(host) in self.probe_hosts):
            return None
        return Refusal(403, f"Host {host!r} is not this endpoint's address")

    def hosts(self, port: int) -> frozenset[str]:
        """The ``Host`` values accepted for an endpoint on ``port`` (besides IP literals,
        which a wildcard listen address accepts too: a rebound name is never one, and an
        allowed name given without a port, which is accepted with any port or none, as a
        proxy in front may listen on another)."""
        listen = self.listen_host.lower()
        names: set[str] = {name for name in self.allowed_hosts if _has_port(name)}
        if listen in _WILDCARDS:
            names.update(_LOOPBACK_NAMES)
            names.add(socket.gethostname().lower())
        elif _is_loopback(listen):
            names.update(_LOOPBACK_NAMES)
        else:
            names.add(f"[{listen}]" if ":" in listen else listen)
        return frozenset(n if _has_port(n) else f"{n}:{port}" for n in names)

    def check(self, request: HttpRequest, port: int, *, what: str) -> Refusal | None:
        """None when ``request`` may do ``what`` (one line for the log, like "retry
        quarantined timers"); else the :class:`Refusal` to answer with. Logs either way."""
        refusal = self._refusal(request, port)
        if refusal is None:
            log.info(
                "HTTP %s %s from %s allowed: %s", request.method, request.path, request.client, what
            )
        else:
            log.warning(
                "HTTP %s %s from %s refused (%d): %s",
                request.method,
                request.path,
                request.client,
                refusal.status,
                refusal.reason,
            )
        return refusal

    def _refusal(self, request: HttpRequest, port: int) -> Refusal | None:
        refusal = self.host_refusal(request, port)
        if refusal is not None:
            return refusal
        host = (request.header("host") or "").lower()
        origin = request.header("origin")
        if origin is not None and origin.lower() not in (f"http://{host}", f"https://{host}"):
            return Refusal(403, f"cross-site request from Origin {origin!r}")
        if (request.header("sec-fetch-site") or "").lower() == "cross-site":
            return Refusal(403, "cross-site request (Sec-Fetch-Site)")
        content_type = (request.header("content-type") or "").split(";")[0].strip().lower()
        if content_type in _SIMPLE_CONTENT_TYPES:
            return Refusal(415, f"content type {content_type} is not accepted here")
        if self.token is None:
            return Refusal(403, "set TIMER_HTTP_TOKEN on the service to use this endpoint")
        scheme, _, presented = (request.header("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), self.token.encode()
        ):
            return Refusal(401, "missing or wrong token (Authorization: Bearer TIMER_HTTP_TOKEN)")
        return None

    def _host_allowed(self, host: str, port: int) -> bool:
        if host in self.hosts(port) or _without_port(host) in self.allowed_hosts:
            return True
        if self.listen_host.lower() not in _WILDCARDS:
            return False
        name, _, given_port = host.rpartition(":")
        if given_port != str(port):
            return False
        try:
            ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            return False
        return True


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _has_port(name: str) -> bool:
    return name.rpartition(":")[2].isdigit() and not name.endswith("]")


def _without_port(host: str) -> str:
    return host.rpartition(":")[0] if _has_port(host) else host


def bearer(token: str | None) -> dict[str, str]:
    """The header a client of a guarded endpoint sends (none without a token)."""
    return {} if token is None else {"Authorization": f"Bearer {token}"}
