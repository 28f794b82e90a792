"""The health and metrics endpoint: ``GET /healthz`` and ``GET /metrics`` on one small server,
and the worker's quarantine (``GET /quarantine``, ``POST /quarantine/retry``) for operators,
behind :class:`~timer_service.access.HttpAccess` (token, ``Host``, cross-site checks; every
request, probes included, must name the endpoint in its ``Host``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from typing import Protocol
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from timer_core import QuarantinedTimer, ServiceCallId, TenantId, TimerKey, ValidationError
from timer_core.instants import format_timestamp
from timer_service.access import HttpAccess, HttpRequest

__all__ = ["MAX_BODY", "HealthEndpoint", "Quarantine", "Response", "WebApp"]

log = logging.getLogger(__name__)

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    415: "Unsupported Media Type",
    413: "Content Too Large",
    303: "See Other",
    304: "Not Modified",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
#: The largest request body read (the console's forms are a few hundred bytes).
MAX_BODY = 64 * 1024
_TEXT = "text/plain; charset=utf-8"


class Quarantine(Protocol):
    """What the endpoint serves of a worker's quarantine (a ``Timer`` or a ``TimerWorker``)."""

    @property
    def quarantined(self) -> list[QuarantinedTimer]: ...

    def retry_quarantined(self, keys: Iterable[TimerKey] | None = None) -> int: ...


#: What a web application mounted on the endpoint answers: status, content type, body, and
#: extra headers.
Response = tuple[int, str, bytes, list[tuple[str, str]]]


class WebApp(Protocol):
    """Pages served under a path prefix of the endpoint (the console)."""

    prefix: str

    async def handle(self, request: HttpRequest, body: bytes) -> Response: ...


class HealthEndpoint:
    """A minimal asyncio HTTP/1.1 server for probes and scrapes (one request per connection).

    ``health()`` returns ``(healthy, details)``; ``/healthz`` answers 200 or 503 with the
    details as JSON. ``/metrics`` is ``prometheus_client``'s exposition of ``registry``.
    With a ``quarantine``: ``GET /quarantine`` lists its quarantined timers as JSON, and
    ``POST /quarantine/retry`` (``?tenant=T&call=C`` for one, nothing for all) retries them,
    answering ``{"retried": n}``; both only for requests ``access`` lets through (none
    without a token).
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Callable[[], tuple[bool, dict[str, object]]],
        quarantine: Quarantine | None = None,
        access: HttpAccess | None = None,
        app: WebApp | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._registry = registry
        self._health = health
        self._quarantine_of = quarantine
        self._access = access if access is not None else HttpAccess(None, host)
        self._app = app
        self._server: asyncio.Server | None = None
        # Open connections: a browser keeps idle ones, which closing ends (not cancels).
        self._connections: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        """The bound port (useful when configured as an ephemeral one)."""
        if self._server is None:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
            peer = writer.get_extra_info("peername")
            request = HttpRequest.parse(head, f"{peer[0]}:{peer[1]}" if peer else "")
            app = self._app
            headers: list[tuple[str, str]] = []
            if app is not None and (
                request.path == app.prefix or request.path.startswith(app.prefix + "/")
            ):
                length = request.header("content-length") or "0"
                if not length.isdigit() or int(length) > MAX_BODY:
                    status, content_type, body = 413, _TEXT, b"request body too large\n"
                else:
                    data = await asyncio.wait_for(reader.readexactly(int(length)), timeout=5.0)
                    status, content_type, body, headers = await app.handle(request, data)
            else:
                status, content_type, body = self._route(request)
                if status == 401:
                    headers = [("WWW-Authenticate", 'Bearer realm="timer"')]
            extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
            response = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
            )
            writer.write(response.encode("latin-1") + (b"" if request.method == "HEAD" else body))
            await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass
        except Exception:
            log.exception("health endpoint failed to answer")
        finally:
            self._connections.discard(writer)
            writer.close()

    def _route(self, request: HttpRequest) -> tuple[int, str, bytes]:
        method, path = request.method, request.path
        # A page on another site that rebinds its name to this address reads nothing here
        # either: probes and scrapes name the endpoint, or one of TIMER_HTTP_PROBE_HOSTS.
        refusal = self._access.host_refusal(
            request, self.port, probe=path in ("/healthz", "/metrics")
        )
        if refusal is not None:
            log.warning(
                "HTTP %s %s from %s refused (%d): %s",
                method,
                path,
                request.client,
                refusal.status,
                refusal.reason,
            )
            return refusal.status, _TEXT, f"{refusal.reason}\n".encode()
        if path.startswith("/quarantine") and self._quarantine_of is not None:
            return self._quarantine(request)
        if path not in ("/healthz", "/metrics"):
            return 404, _TEXT, b"not found\n"
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"method not allowed\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        healthy, details = self._health()
        body = json.dumps({"status": "ok" if healthy else "unhealthy", **details}).encode()
        return (200 if healthy else 503), "application/json", body + b"\n"

    def _guard(self, request: HttpRequest, what: str) -> tuple[int, str, bytes] | None:
        refusal = self._access.check(request, self.port, what=what)
        if refusal is None:
            return None
        return refusal.status, _TEXT, f"{refusal.reason}\n".encode()

    def _quarantine(self, request: HttpRequest) -> tuple[int, str, bytes]:
        worker = self._quarantine_of
        assert worker is not None
        method, path, query = request.method, request.path, request.query
        if path == "/quarantine":
            if method not in ("GET", "HEAD"):
                return 405, _TEXT, b"method not allowed\n"
            refused = self._guard(request, "list quarantined timers")
            if refused is not None:
                return refused
            rows = [
                {
                    "tenantId": q.entry.tenant_id,
                    "serviceCallId": q.entry.service_call_id,
                    "dueAt": format_timestamp(q.entry.due_at),
                    "failures": q.failures,
                    "error": q.error,
                    "since": format_timestamp(q.since),
                }
                for q in worker.quarantined
            ]
            return 200, "application/json", json.dumps(rows).encode() + b"\n"
        if path != "/quarantine/retry":
            return 404, _TEXT, b"not found\n"
        if method != "POST":
            return 405, _TEXT, b"method not allowed\n"
        refused = self._guard(request, "retry quarantined timers")
        if refused is not None:
            return refused
        params = parse_qs(query)
        tenant, call = params.get("tenant", [None])[0], params.get("call", [None])[0]
        if (tenant is None) != (call is None):
            return 400, _TEXT, b"give both tenant and call, or neither (all)\n"
        keys = None
        if tenant is not None and call is not None:
            try:
                keys = [TimerKey(TenantId(tenant), ServiceCallId(call))]
            except ValidationError as exc:
                return 400, _TEXT, f"{exc}\n".encode()
        retried = worker.retry_quarantined(keys)
        log.info("quarantine retry requested over HTTP: %d timers", retried)
        return 200, "application/json", json.dumps({"retried": retried}).encode() + b"\n"
