"""Connecting to NATS: fail fast and clearly at start, then reconnect for as long as it takes.

:class:`NatsConnection` is the one connection the adapters of a deployment share: the event
publisher, the command source, the ``DueTimeReached`` consumer, the dead letters and
``TimerClient`` depend on it, never on :class:`~timer_adapters_nats.NatsBroker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import nkeys
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from timer_adapters_nats._settings import NatsSettings, server_urls
from timer_core import AsyncResource, NotRunning, TimerError
from timer_core.redaction import redact_url

__all__ = [
    "JETSTREAM_MISSING",
    "BrokerUnavailable",
    "NatsConnection",
    "close_client",
    "connect",
    "jetstream_unavailable",
]

log = logging.getLogger(__name__)

_AUTHORIZATION = "Authorization Violation"

#: Longest a client's close may take. nats-py's close flushes what is buffered and waits for
#: the socket to close; on TLS that waits for the server's answer to the close, which a
#: stalled or unreachable server never gives (asyncio waits 30 s for it, and a flush to a
#: full socket has no limit). Nothing is lost by giving up: a message or ack not yet sent
#: was never acknowledged, so JetStream delivers it again.
CLOSE_TIMEOUT_S = 2.0


class BrokerUnavailable(TimerError, ConnectionError):
    """The NATS server could not be reached (or JetStream is not enabled on it) at start, or
    did not answer a call that has no error of its own (listing dead letters)."""


#: What a JetStream API call raises when JetStream is off or does not answer.
JETSTREAM_MISSING = (
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
)


def jetstream_unavailable(exc: BaseException, url: str) -> BrokerUnavailable:
    """The :class:`BrokerUnavailable` for one of :data:`JETSTREAM_MISSING` from ``url``."""
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return BrokerUnavailable(
            f"JetStream is not enabled on the NATS server at {redact_url(url)}: {exc}"
        )
    return BrokerUnavailable(
        f"JetStream at {redact_url(url)} did not answer (is it enabled?): {type(exc).__name__}"
    )


class NatsConnection(AsyncResource):
    """One NATS connection and its JetStream context, opened from :class:`NatsSettings`.

    :meth:`start` connects (failing within ``connect_timeout_s`` with
    :class:`BrokerUnavailable` naming the URL, its secrets redacted), with the settings' TLS,
    authentication and inbox prefix; once connected the client reconnects forever.
    :meth:`aclose` flushes and closes. Both are idempotent; a closed connection can be
    started again (a new client).
    """

    def __init__(self, settings: NatsSettings) -> None:
        self.settings = settings
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._error_listeners: list[Callable[[Exception], None]] = []

    def on_server_error(self, listener: Callable[[Exception], None]) -> None:
        """Tell ``listener`` each error the server reports on the connection once it is up
        (nats-py hands a ``-ERR``, such as a refused publish's permissions violation, to the
        connection rather than to the call that caused it). Listeners must not raise."""
        self._error_listeners.append(listener)

    def _server_error(self, error: Exception) -> None:
        for listener in self._error_listeners:
            listener(error)

    @property
    def client(self) -> Client:
        """The underlying nats-py client; :class:`~timer_core.errors.NotRunning` before
        :meth:`start`."""
        if self._nc is None:
            raise NotRunning(_not_started(self))
        return self._nc

    @property
    def jetstream(self) -> JetStreamContext:
        """A JetStream context on the connection (API timeouts of ``ack_timeout_s``)."""
        if self._js is None:
            raise NotRunning(_not_started(self))
        return self._js

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up right now (false while reconnecting)."""
        return self._nc is not None and self._nc.is_connected

    async def start(self) -> None:
        """Connect; idempotent. Raises :class:`BrokerUnavailable` on failure."""
        if self._nc is not None:
            return
        settings = self.settings
        nc = await connect(
            settings.url,
            connect_timeout_s=settings.connect_timeout_s,
            reconnect_wait_s=settings.reconnect_wait_s,
            ping_interval_s=settings.ping_interval_s,
            name=settings.client_name,
            on_server_error=self._server_error,
            **settings.security_options(),
        )
        self._nc = nc
        self._js = nc.jetstream(timeout=settings.ack_timeout_s)

    async def aclose(self) -> None:
        """Flush what is buffered and close the connection; idempotent."""
        nc, self._nc, self._js = self._nc, None, None
        if nc is None or nc.is_closed:
            return
        await close_client(nc)


async def connect(
    url: str,
    *,
    connect_timeout_s: float,
    reconnect_wait_s: float = 0.5,
    ping_interval_s: float = 10.0,
    name: str | None = None,
    tls_ca_file: Path | str | None = None,
    tls_cert_file: Path | str | None = None,
    tls_key_file: Path | str | None = None,
    creds_file: Path | str | None = None,
    nkey_seed_file: Path | str | None = None,
    token: str | None = None,
    inbox_prefix: str = "_INBOX",
    on_server_error: Callable[[Exception], None] | None = None,
) -> Client:
    """A connected client that reconnects forever; :class:`BrokerUnavailable` within the timeout.

    nats-py with unlimited reconnects would also retry the first connect forever, so the whole
    first attempt is bounded here and the half-made client closed on failure. A refusal that
    retrying cannot cure (credentials refused, a certificate that does not verify, a server
    without TLS when TLS was asked for) fails at once. The security arguments are those of
    :class:`~timer_adapters_nats.NatsSettings`; every URL in a message or log line is
    redacted (:func:`timer_core.redact_url`). Once connected, each error nats-py reports is
    logged and handed to ``on_server_error``.
    """
    shown = redact_url(url)
    servers = server_urls(url)
    tls_wanted = (
        tls_ca_file is not None
        or tls_cert_file is not None
        or any(server.lower().startswith("tls://") for server in servers)
    )
    options = _security_options(
        shown, tls_wanted, tls_ca_file, tls_cert_file, tls_key_file, creds_file, nkey_seed_file
    )
    if token is not None:
        options["token"] = token
    last_error: list[BaseException] = []
    dropped: list[BaseException] = []  # the last attempts the server cut after TLS, in a row
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    connected = False

    async def on_error(error: Exception) -> None:
        if not connected:
            # The first connect's failures end in BrokerUnavailable, which names the last one.
            last_error.append(error)
            log.debug("NATS %s: %s", shown, _reason(error))
            if tls_wanted and isinstance(error, _DROPPED_AFTER_HANDSHAKE):
                if not any(error is seen for seen in dropped):  # nats-py may report it twice
                    dropped.append(error)
            else:
                dropped.clear()
            if len(dropped) >= TLS_DROPS_BEFORE_GIVING_UP and not refused.done():
                refused.set_result(
                    TlsDropped(len(dropped), certificate_given=tls_cert_file is not None)
                )
            elif _incurable(error) and not refused.done():
                refused.set_result(error)
        else:
            log.warning("NATS %s: %s", shown, _reason(error))
            if on_server_error is not None:
                on_server_error(error)

    async def on_disconnected() -> None:
        if not nc.is_closed:  # also called when we close it ourselves
            log.warning("disconnected from NATS %s; reconnecting", shown)

    async def on_reconnected() -> None:
        where = nc.connected_url.geturl() if nc.connected_url else url
        log.info("reconnected to NATS %s", redact_url(where))

    nc = _TlsOnlyClient() if tls_wanted else Client()
    attempt: asyncio.Future[None] = asyncio.ensure_future(
        nc.connect(
            servers=servers,
            name=name,
            inbox_prefix=inbox_prefix,
            connect_timeout=connect_timeout_s,  # type: ignore[arg-type]
            reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
            max_reconnect_attempts=-1,
            ping_interval=ping_interval_s,  # type: ignore[arg-type]
            max_outstanding_pings=3,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **options,
        )
    )
    try:
        waits: set[asyncio.Future[Any]] = {attempt, refused}
        await asyncio.wait(waits, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await attempt
            raise TimeoutError
        attempt.result()
        connected = True
    except Exception as exc:
        await _discard(nc)
        if refused.done():
            raise BrokerUnavailable(
                f"cannot connect to NATS at {shown}: {_reason(refused.result())}"
            ) from exc
        if not isinstance(exc, TimeoutError):  # nats-py gave up by itself
            raise BrokerUnavailable(f"cannot connect to NATS at {shown}: {_reason(exc)}") from exc
        reason = _reason(_most_telling(last_error)) if last_error else "no answer"
        raise BrokerUnavailable(
            f"cannot connect to NATS at {shown} within {connect_timeout_s:g}s: {reason}"
        ) from exc
    finally:
        refused.cancel()
    return nc


def _not_started(connection: NatsConnection) -> str:
    name = type(connection).__name__
    return f"{name} is not started: `await {name.lower()}.start()` or `async with {name}(...)`"


def _security_options(
    shown: str,
    tls_wanted: bool,
    ca_file: Path | str | None,
    cert_file: Path | str | None,
    key_file: Path | str | None,
    creds_file: Path | str | None,
    nkey_seed_file: Path | str | None,
) -> dict[str, Any]:
    """nats-py's ``connect`` arguments for TLS and NKey/JWT authentication (files checked)."""
    options: dict[str, Any] = {}
    if tls_wanted:
        try:
            context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
            if cert_file is not None:
                context.load_cert_chain(str(cert_file), None if key_file is None else str(key_file))
        except (OSError, ssl.SSLError) as exc:
            which = ", ".join(str(f) for f in (ca_file, cert_file, key_file) if f is not None)
            why = exc.reason if isinstance(exc, ssl.SSLError) else exc.strerror
            raise BrokerUnavailable(
                f"cannot connect to NATS at {shown}: cannot load the TLS files {which}: "
                f"{why or type(exc).__name__}"
            ) from exc
        options["tls"] = context
    for path, what, markers in (
        (creds_file, "a NATS .creds file", _CREDS_MARKERS),
        (nkey_seed_file, "an NKey seed file", ()),
    ):
        if path is not None and not _looks_like(Path(path), markers):
            raise BrokerUnavailable(
                f"cannot connect to NATS at {shown}: {path} is not {what} (or cannot be read)"
            )
    if creds_file is not None:
        options["user_credentials"] = str(creds_file)
    if nkey_seed_file is not None:
        options["nkeys_seed"] = str(nkey_seed_file)
    return options


class TlsNotOffered(nats.errors.Error):
    """The server's greeting does not ask for TLS, though this connection must be TLS."""

    def __str__(self) -> str:
        return "TLS was asked for but the server does not offer it"


#: A TLS 1.3 server tells a client it refuses its certificate only after the client's side of
#: the handshake is done; the client may read that alert (an :class:`ssl.SSLError`, refused at
#: once) or, when its CONNECT is written first, see only the connection cut (seen on Python
#: 3.14 on a busy machine, every attempt for 10 s). That many cuts in a row, each right after
#: TLS was set up, are taken as the same refusal: a server that is merely restarting refuses
#: the TCP connection instead.
TLS_DROPS_BEFORE_GIVING_UP = 3
_DROPPED_AFTER_HANDSHAKE = (BrokenPipeError, ConnectionResetError)


class TlsDropped(nats.errors.Error):
    """The server cut a TLS connection before the NATS handshake, on several attempts in a row."""

    def __init__(self, times: int, *, certificate_given: bool) -> None:
        super().__init__(times)
        self.times = times
        self.certificate_given = certificate_given

    def __str__(self) -> str:
        cause = (
            "does it accept this client certificate (signed by a CA it trusts)?"
            if self.certificate_given
            else "it requires a client certificate, and none is set (tls_cert_file)?"
        )
        return (
            f"the server cut the TLS connection {self.times} times in a row before the NATS "
            f"handshake was done, as a TLS server refuses a client's certificate: {cause}"
        )


class _TlsOnlyClient(Client):
    """A client that never sends its CONNECT (credentials included) over plain TCP.

    nats-py upgrades to TLS only when the server's INFO asks for it, on the first connect
    and on every reconnect alike; a server (or a man in the middle) that does not ask would
    get the credentials in the clear. nats-py builds CONNECT right after that decision, so
    refusing to build it is the one place to stop the attempt: it then fails like any other
    (the first connect with :class:`BrokerUnavailable`, a reconnect by trying again).
    """

    def _connect_command(self) -> bytes:
        # nats-py internals (2.x): the INFO of the server being connected to.
        if not self._server_info.get("tls_required"):
            raise TlsNotOffered
        command: bytes = super()._connect_command()
        return command


_CREDS_MARKERS = ("BEGIN NATS USER JWT", "BEGIN USER NKEY SEED")


def _looks_like(path: Path, markers: tuple[str, ...]) -> bool:
    """Whether ``path`` holds a .creds file (``markers``) or, without markers, one NKey seed.

    Checked before connecting, so a wrong file is named instead of failing deep inside the
    handshake; the content is never quoted.
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    if markers:
        return all(marker in text for marker in markers)
    try:
        nkeys.from_seed(bytearray(text.strip().encode())).wipe()
    except Exception:  # nkeys raises several kinds (padding, prefix, checksum) for bad seeds
        return False
    return True


def _incurable(error: BaseException) -> bool:
    """Whether retrying the first connect cannot help: refused credentials, bad TLS, bad keys."""
    if isinstance(error, nats.errors.AuthorizationError | ssl.SSLError | TlsNotOffered):
        return True
    if isinstance(error, nats.errors.Error):
        text = str(error).lower()
        return "authorization" in text or "authentication" in text
    return not isinstance(error, OSError | TimeoutError)


def _most_telling(errors: list[BaseException]) -> BaseException:
    """The error to name when the first connect gives up: the server's own last word if an
    attempt got one (``maximum account active connections exceeded``), not a later attempt's
    bare reset: a server that refuses and closes at once can reset the connection before
    the client has read why."""
    said = [error for error in errors if not isinstance(error, OSError | TimeoutError)]
    return (said or errors)[-1]


def _reason(error: BaseException) -> str:
    """One line saying what went wrong, with any URL in it redacted."""
    if isinstance(error, ssl.SSLCertVerificationError):
        text = f"TLS certificate verification failed: {error.verify_message or error.reason}"
    elif isinstance(error, ssl.SSLError) and error.reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        text = "TLS handshake failed: the server requires a client certificate"
    elif isinstance(error, ssl.SSLError):
        text = f"TLS handshake failed: {error.reason or error}"
    elif isinstance(error, nats.errors.AuthorizationError) or _AUTHORIZATION in str(error):
        text = "the server refused the credentials (Authorization Violation)"
    else:
        text = str(error).strip() or type(error).__name__
    first = text.splitlines()[0] if text else type(error).__name__
    return redact_url(first)


async def close_client(nc: Client, *, quiet: bool = False) -> None:
    """Close ``nc`` within :data:`CLOSE_TIMEOUT_S`; an error or a close that takes longer is
    logged (at DEBUG when ``quiet``), never raised: closing must not mask the caller's own
    exception, nor hold a shutdown up."""
    level = logging.DEBUG if quiet else logging.WARNING
    try:
        await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)
    except TimeoutError:
        log.log(
            level,
            "closing the NATS connection did not finish within %gs (the server does not "
            "answer); left to the operating system",
            CLOSE_TIMEOUT_S,
        )
    except Exception as exc:
        log.log(level, "closing the NATS connection failed: %s", exc)


async def _discard(nc: Client) -> None:
    await close_client(nc, quiet=True)  # a half-made client: nothing useful to do with it
