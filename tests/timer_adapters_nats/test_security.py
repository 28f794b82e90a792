"""Secured NATS: TLS, mutual TLS, NKey, password and token against real ``nats-server``s, and
clear, prompt failures for every wrong credential."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from tests.secure_nats import (
    DEPLOY_NATS,
    SecuredBrokers,
    hostport,
    make_pki,
    start_configured_server,
    start_server_from_file,
    tls_block,
)
from tests.timer_adapters_nats.jetstream import wait_until
from timer_adapters_nats import BrokerUnavailable, NatsBroker, NatsSettings, TimerClient
from timer_adapters_nats._connection import _most_telling

# Generous so a busy machine never hits it; a refusal must come well before it.
CONNECT_TIMEOUT_S = 10.0
PROMPT_S = CONNECT_TIMEOUT_S / 2
PASSWORD = "pw-Zq81xV"
TOKEN = "tok-Hn42bR"


class Servers(SecuredBrokers):
    """The shared secured servers, and the documented mutual-TLS recipe's."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, password=PASSWORD, token=TOKEN)
        # The recipe docs/security.md shows: mutual TLS and NKey users.
        self.mtls = self.add(
            start_server_from_file(
                root / "mtls",
                DEPLOY_NATS / "tls.conf",
                {
                    "NATS_TLS_CERT_FILE": str(self.pki.server_cert_file),
                    "NATS_TLS_KEY_FILE": str(self.pki.server_key_file),
                    "NATS_TLS_CA_FILE": str(self.pki.ca_file),
                    "TIMER_SERVICE_NKEY": self.nkey_user.public_key,
                },
            )
        )


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    started = Servers(tmp_path_factory.mktemp("secure-nats"))
    try:
        yield started
    finally:
        started.stop()


async def round_trip(settings: NatsSettings) -> None:
    """Start a provisioned broker on ``settings`` and have a command acked through it."""
    broker = NatsBroker(settings)
    await broker.start()
    try:
        client = TimerClient(broker)
        await client.schedule("tenant-a", "call-1", datetime.now(UTC) + timedelta(hours=1))
    finally:
        await broker.aclose()


async def refused(url: str, **options: Any) -> str:
    """Connect with wrong credentials; return the error, asserting it came promptly."""
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as caught:
        await round_trip(NatsSettings(url=url, connect_timeout_s=CONNECT_TIMEOUT_S, **options))
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert elapsed < PROMPT_S, f"took {elapsed:.1f}s: {message}"
    assert "\n" not in message
    return message


class TestWorkingConnections:
    """The right credentials connect, provision and publish."""

    async def test_tls_with_ca_file_and_nkey(self, servers: Servers) -> None:
        """A tls:// URL with the CA file and an NKey seed file gets a command acked."""
        await round_trip(
            NatsSettings(
                url=f"tls://{hostport(servers.tls)}",
                tls_ca_file=servers.pki.ca_file,
                nkey_seed_file=servers.nkey_user.seed_file,
            )
        )

    async def test_tls_with_password_in_url(self, servers: Servers) -> None:
        """A nats:// URL with a user and password, verified with the CA, gets a command acked."""
        await round_trip(
            NatsSettings(
                url=f"nats://alice:{PASSWORD}@{hostport(servers.tls)}",
                tls_ca_file=servers.pki.ca_file,
            )
        )

    async def test_mutual_tls_with_nkey(self, servers: Servers) -> None:
        """The documented recipe: a client certificate signed by the server's CA and an NKey
        user get a command acked."""
        await round_trip(
            NatsSettings(
                url=f"tls://{hostport(servers.mtls)}",
                tls_ca_file=servers.pki.ca_file,
                tls_cert_file=servers.pki.client_cert_file,
                tls_key_file=servers.pki.client_key_file,
                nkey_seed_file=servers.nkey_user.seed_file,
            )
        )

    async def test_creds_file_in_operator_mode(self, servers: Servers) -> None:
        """A .creds file (user JWT + NKey seed) of the server's account gets a command acked."""
        await round_trip(NatsSettings(url=servers.jwt.url, creds_file=servers.operator.creds_file))

    async def test_token_setting(self, servers: Servers) -> None:
        """The token setting authenticates against a token server."""
        await round_trip(NatsSettings(url=servers.token.url, token=TOKEN))

    async def test_token_in_url(self, servers: Servers) -> None:
        """A token given as the URL's user info authenticates too."""
        await round_trip(NatsSettings(url=f"nats://{TOKEN}@{hostport(servers.token)}"))

    async def test_timer_client_connect_takes_the_security_arguments(
        self, servers: Servers
    ) -> None:
        """TimerClient.connect accepts the same TLS and NKey arguments as NatsSettings."""
        settings = NatsSettings(
            url=f"tls://{hostport(servers.tls)}",
            tls_ca_file=servers.pki.ca_file,
            nkey_seed_file=servers.nkey_user.seed_file,
        )
        await round_trip(settings.__class__(url=settings.url, **settings.security_options()))
        # The commands stream exists now (provisioned above): a client can publish to it.
        async with TimerClient.connect(settings.url, **settings.security_options()) as client:
            await client.cancel("tenant-a", "call-1")


class TestWrongCredentials:
    """Each wrong credential fails promptly with one clear line and no secret in it."""

    async def test_bad_password(self, servers: Servers) -> None:
        """A wrong password is refused, and the message shows neither it nor a hang."""
        message = await refused(
            f"nats://alice:wrong-{PASSWORD}@{hostport(servers.tls)}",
            tls_ca_file=servers.pki.ca_file,
        )
        assert "refused the credentials" in message
        assert PASSWORD not in message
        assert "alice:***@" in message

    async def test_unknown_nkey(self, servers: Servers) -> None:
        """An NKey the server does not list is refused."""
        message = await refused(
            f"tls://{hostport(servers.tls)}",
            tls_ca_file=servers.pki.ca_file,
            nkey_seed_file=servers.stranger.seed_file,
        )
        assert "refused the credentials" in message
        assert servers.stranger.seed not in message

    async def test_creds_of_an_unknown_account(self, servers: Servers) -> None:
        """A user JWT signed by an account the operator never issued is refused."""
        message = await refused(servers.jwt.url, creds_file=servers.operator.stranger_creds_file)
        assert "refused the credentials" in message
        assert servers.operator.stranger_seed not in message

    async def test_untrusted_ca(self, servers: Servers) -> None:
        """A server certificate from a CA the client does not trust fails verification."""
        message = await refused(
            f"tls://{hostport(servers.tls)}",
            tls_ca_file=servers.pki.other_ca_file,
            nkey_seed_file=servers.nkey_user.seed_file,
        )
        assert "certificate verification failed" in message

    async def test_system_trust_store_by_default(self, servers: Servers) -> None:
        """Without a CA file, a tls:// URL verifies against the system's CAs (and fails here)."""
        message = await refused(
            f"tls://{hostport(servers.tls)}", nkey_seed_file=servers.nkey_user.seed_file
        )
        assert "certificate verification failed" in message

    async def test_missing_client_certificate(self, servers: Servers) -> None:
        """A server that verifies clients turns away a client without a certificate."""
        message = await refused(
            f"tls://{hostport(servers.mtls)}",
            tls_ca_file=servers.pki.ca_file,
            nkey_seed_file=servers.nkey_user.seed_file,
        )
        assert "requires a client certificate" in message

    async def test_client_certificate_from_another_ca(
        self, servers: Servers, tmp_path: Path
    ) -> None:
        """A client certificate the server's CA did not sign is turned away."""
        stranger = make_pki(tmp_path / "stranger")
        message = await refused(
            f"tls://{hostport(servers.mtls)}",
            tls_ca_file=servers.pki.ca_file,
            tls_cert_file=stranger.client_cert_file,
            tls_key_file=stranger.client_key_file,
            nkey_seed_file=servers.nkey_user.seed_file,
        )
        assert "TLS" in message

    async def test_wrong_token(self, servers: Servers) -> None:
        """A wrong token is refused and not shown."""
        message = await refused(servers.token.url, token=f"wrong-{TOKEN}")
        assert "refused the credentials" in message
        assert TOKEN not in message

    async def test_tls_asked_of_a_plain_server(self, servers: Servers) -> None:
        """Asking for TLS from a server that does not offer it fails instead of going plain."""
        message = await refused(
            f"tls://{hostport(servers.token)}", tls_ca_file=servers.pki.ca_file, token=TOKEN
        )
        assert "does not offer" in message

    async def test_missing_seed_file(self, servers: Servers, tmp_path: Path) -> None:
        """A seed file that does not exist is named in the error."""
        message = await refused(servers.token.url, nkey_seed_file=tmp_path / "absent.nk")
        assert "absent.nk" in message

    @pytest.mark.parametrize("setting", ["creds_file", "nkey_seed_file"])
    async def test_file_that_is_not_a_key(
        self, servers: Servers, tmp_path: Path, setting: str
    ) -> None:
        """A creds or seed file with something else in it is named, its content not quoted."""
        wrong = tmp_path / "wrong.txt"
        wrong.write_text(f"{TOKEN}\n")
        message = await refused(servers.jwt.url, **{setting: wrong})
        assert f"{wrong} is not" in message
        assert TOKEN not in message


class TestCutConnections:
    """A TLS server that cuts every attempt is taken as a refusal, not waited out."""

    async def test_a_server_that_cuts_every_tls_attempt_is_refused_promptly(self) -> None:
        """Connections reset before the NATS handshake, again and again, end the first connect.

        A TLS 1.3 server refusing a client certificate may show the client nothing but a cut
        connection (Python 3.14 on a busy machine); a listener here resets every connection.
        """
        cuts = 0

        async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal cuts
            cuts += 1
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()  # with linger 0: a reset, not a clean close

        server = await asyncio.start_server(cut, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            message = await refused(f"tls://127.0.0.1:{port}", reconnect_wait_s=0.05)
        finally:
            server.close()
            await server.wait_closed()
        assert "cut the TLS connection 3 times in a row" in message
        assert cuts >= 3


class TestSettings:
    """NatsSettings checks its security settings and never shows a secret."""

    def test_repr_hides_secrets(self) -> None:
        """repr shows the URL with its password and the token redacted."""
        text = repr(NatsSettings(url=f"nats://alice:{PASSWORD}@h:4222", token=TOKEN))
        assert PASSWORD not in text
        assert TOKEN not in text
        assert "alice:***@h:4222" in text

    def test_certificate_needs_its_key(self, tmp_path: Path) -> None:
        """A client certificate without a key is rejected at construction."""
        with pytest.raises(ValueError, match="together"):
            NatsSettings(url="nats://h:4222", tls_cert_file=tmp_path / "c.pem")

    def test_one_authentication_method(self, tmp_path: Path) -> None:
        """Two ways of authenticating at once are rejected at construction."""
        with pytest.raises(ValueError, match="one of"):
            NatsSettings(url="nats://h:4222", token=TOKEN, nkey_seed_file=tmp_path / "x.nk")


class TestReconnect:
    """Once connected over TLS, a reconnect never falls back to plain TCP."""

    async def test_reconnect_never_goes_plain(
        self, servers: Servers, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A plain server on the TLS server's port never gets the token; TLS back, it reconnects."""
        caplog.set_level(logging.WARNING)
        config = tls_block(servers.pki) + f'authorization {{ token: "{TOKEN}" }}\n'
        server = start_configured_server(tmp_path / "tls", config)
        port = server.port
        broker = NatsBroker(
            NatsSettings(
                url=f"tls://127.0.0.1:{port}",
                tls_ca_file=servers.pki.ca_file,
                token=TOKEN,
                reconnect_wait_s=0.05,
            )
        )
        await broker.start()
        try:
            server.stop()
            # Same port, same token, no TLS: a client that went plain would be let in.
            plain = start_configured_server(
                tmp_path / "plain", f'authorization {{ token: "{TOKEN}" }}\n', port=port
            )
            try:
                await wait_until(
                    lambda: "does not offer it" in caplog.text, what="a refused plain reconnect"
                )
                assert not broker.is_connected
            finally:
                plain.stop()
            server = start_configured_server(tmp_path / "tls-again", config, port=port)
            await wait_until(lambda: broker.is_connected, what="the TLS reconnect")
        finally:
            await broker.aclose()
            server.stop()


class TestGivingUpMessage:
    """The first connect's error names the server's own refusal over a later bare reset."""

    def test_the_servers_word_outranks_a_later_reset(self) -> None:
        """A refusal the server spelled out, then a reset that hid the next one: the refusal."""
        said = nats.errors.Error("nats: 'maximum account active connections exceeded'")
        reset = ConnectionResetError(104, "Connection reset by peer")
        assert _most_telling([said, reset, reset]) is said
        timeout = TimeoutError()
        assert _most_telling([reset, timeout]) is timeout  # nothing said: the last one
