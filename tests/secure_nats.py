"""Secured ``nats-server`` processes for tests: a CA and certificates made here (trustme), NKey
users, tokens, and servers started from a config file written beside their store.

Used by the adapter's security tests, the service's secrets test and the per-tenant
authorization recipe's test.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import nkeys
import pytest
import trustme

from timer_adapters_nats.embedded import NatsServerProcess

__all__ = [
    "DEPLOY_NATS",
    "SecuredBrokers",
    "hostport",
    "NKeyUser",
    "Pki",
    "make_pki",
    "new_nkey_user",
    "start_configured_server",
    "start_server_from_file",
    "OperatorMode",
    "make_operator_mode",
]

#: The nats-server configurations the docs show (docs/security.md).
DEPLOY_NATS = Path(__file__).resolve().parents[1] / "deploy" / "nats"


@attrs.frozen
class Pki:
    """PEM files of one test CA: the server's certificate for 127.0.0.1, a client's, and a
    second CA that trusts neither (for "untrusted" failures)."""

    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path
    other_ca_file: Path


def make_pki(directory: Path) -> Pki:
    """Make a CA, a server certificate for ``127.0.0.1``/``localhost`` and a client one."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("timer-service.example")
    pki = Pki(
        ca_file=directory / "ca.pem",
        server_cert_file=directory / "server.pem",
        server_key_file=directory / "server.key",
        client_cert_file=directory / "client.pem",
        client_key_file=directory / "client.key",
        other_ca_file=directory / "other-ca.pem",
    )
    ca.cert_pem.write_to_path(str(pki.ca_file))
    server.cert_chain_pems[0].write_to_path(str(pki.server_cert_file))
    for pem in server.cert_chain_pems[1:]:
        pem.write_to_path(str(pki.server_cert_file), append=True)
    server.private_key_pem.write_to_path(str(pki.server_key_file))
    client.cert_chain_pems[0].write_to_path(str(pki.client_cert_file))
    client.private_key_pem.write_to_path(str(pki.client_key_file))
    trustme.CA().cert_pem.write_to_path(str(pki.other_ca_file))
    return pki


@attrs.frozen
class NKeyUser:
    """An NKey user: its public key (for the server's config) and its seed file."""

    public_key: str
    seed: str
    seed_file: Path


def new_nkey_user(directory: Path, name: str) -> NKeyUser:
    """A fresh NKey user whose seed is written to ``directory/<name>.nk`` (mode 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public_key = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = directory / f"{name}.nk"
    seed_file.write_bytes(seed + b"\n")
    seed_file.chmod(0o600)
    return NKeyUser(public_key=public_key, seed=seed.decode(), seed_file=seed_file)


def tls_block(pki: Pki, *, verify_clients: bool = False) -> str:
    """A server ``tls {}`` block with the PKI's server certificate (and client checks)."""
    lines = [
        f'  cert_file: "{pki.server_cert_file}"',
        f'  key_file: "{pki.server_key_file}"',
        f'  ca_file: "{pki.ca_file}"',
        "  timeout: 5",
    ]
    if verify_clients:
        lines.append("  verify: true")
    return "tls {\n" + "\n".join(lines) + "\n}\n"


def start_configured_server(
    store_dir: Path, config: str, *, port: int = 0, extra_args: Sequence[str] = ()
) -> NatsServerProcess:
    """Start a JetStream ``nats-server`` on 127.0.0.1 (``port``, 0 = a free one) with
    ``config`` as its file.

    The caller stops it (by pid, through :meth:`NatsServerProcess.stop`).
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    config_file = store_dir / "server.conf"
    config_file.write_text(config)
    server = NatsServerProcess(
        store_dir / "js",
        host="127.0.0.1",
        port=port,
        extra_args=["-c", str(config_file), *extra_args],
    )
    server.start()
    return server


def start_server_from_file(
    store_dir: Path, config_file: Path, environment: Mapping[str, str]
) -> NatsServerProcess:
    """Start a JetStream ``nats-server`` on a free 127.0.0.1 port from a configuration file
    that reads ``$VARIABLES`` from its environment (the deploy/ recipes do)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in environment.items():
            patch.setenv(key, value)
        server = NatsServerProcess(store_dir, host="127.0.0.1", extra_args=["-c", str(config_file)])
        server.start()
    return server


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _new_key(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def _public(key: nkeys.KeyPair) -> str:
    return str(key.public_key.decode())


def encode_jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, object]) -> str:
    """A NATS JWT (``ed25519-nkey``) for ``subject`` signed by ``issuer``: what ``nsc`` makes.

    The ``jti`` is the base32 SHA-512/256 of the claims without it, as the Go library does.
    """
    claims: dict[str, object] = {
        "jti": "",
        "iat": int(time.time()),
        "iss": _public(issuer),
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    digest = hashlib.new("sha512_256", json.dumps(claims).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    header = _b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64url(json.dumps(claims).encode())
    signature = _b64url(issuer.sign(f"{header}.{body}".encode()))
    return f"{header}.{body}.{signature}"


def _creds(jwt: str, seed: bytes) -> str:
    return (
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
    )


_UNLIMITED_ACCOUNT = {
    "limits": {
        "subs": -1,
        "data": -1,
        "payload": -1,
        "imports": -1,
        "exports": -1,
        "wildcards": True,
        "conn": -1,
        "leaf": -1,
        "mem_storage": -1,
        "disk_storage": -1,
        "streams": -1,
        "consumer": -1,
    },
    "type": "account",
}
_UNLIMITED_USER = {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user"}


@attrs.frozen
class OperatorMode:
    """An operator-mode server's configuration (memory resolver, JetStream account) and the
    ``.creds`` files of a user of its account and of a user of an account it does not know."""

    config: str
    creds_file: Path
    stranger_creds_file: Path
    user_seed: str
    stranger_seed: str


def make_operator_mode(directory: Path) -> OperatorMode:
    """Operator, system account, a JetStream-enabled account and its user, as ``nsc`` would."""
    directory.mkdir(parents=True, exist_ok=True)
    operator = _new_key(nkeys.PREFIX_BYTE_OPERATOR)
    system = _new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    account = _new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    stranger_account = _new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    operator_jwt = encode_jwt(
        operator,
        _public(operator),
        "timer-operator",
        {"type": "operator", "system_account": _public(system)},
    )
    system_jwt = encode_jwt(operator, _public(system), "SYS", {"type": "account"})
    account_jwt = encode_jwt(operator, _public(account), "timer", _UNLIMITED_ACCOUNT)
    creds = {}
    for name, issuer in (("service", account), ("stranger", stranger_account)):
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        user = _public(nkeys.from_seed(bytearray(seed)))
        jwt = encode_jwt(issuer, user, name, _UNLIMITED_USER)
        path = directory / f"{name}.creds"
        path.write_text(_creds(jwt, seed))
        path.chmod(0o600)
        creds[name] = (path, seed.decode())
    config = (
        f'operator: "{operator_jwt}"\n'
        f"system_account: {_public(system)}\n"
        "resolver: MEMORY\n"
        "resolver_preload: {\n"
        f'  {_public(system)}: "{system_jwt}"\n'
        f'  {_public(account)}: "{account_jwt}"\n'
        "}\n"
    )
    return OperatorMode(
        config, creds["service"][0], creds["stranger"][0], creds["service"][1], creds["stranger"][1]
    )


def hostport(server: NatsServerProcess) -> str:
    """``host:port`` of a started server, for URLs with a scheme or credentials of one's own."""
    return f"{server.host}:{server.port}"


class SecuredBrokers:
    """The servers of the security tests, started at once, stopped by :meth:`stop`.

    ``tls``: TLS (the PKI's certificate), a user ``alice`` with ``password`` and the NKey
    user ``nkey_user``; ``token``: plain, authenticated by ``token``; ``jwt``: operator mode
    (JWT accounts, memory resolver). ``stranger`` is an NKey user no server knows.
    """

    def __init__(self, root: Path, *, password: str, token: str) -> None:
        self.pki = make_pki(root / "pki")
        self.nkey_user = new_nkey_user(root / "keys", "service")
        self.stranger = new_nkey_user(root / "keys", "stranger")
        self.operator = make_operator_mode(root / "operator")
        self.servers: list[NatsServerProcess] = []
        users = (
            "authorization {\n  users: [\n"
            f'    {{user: alice, password: "{password}"}}\n'
            f'    {{nkey: "{self.nkey_user.public_key}"}}\n'
            "  ]\n}\n"
        )
        try:
            self.tls = self.add(start_configured_server(root / "tls", tls_block(self.pki) + users))
            self.token = self.add(
                start_configured_server(root / "token", f'authorization {{ token: "{token}" }}\n')
            )
            self.jwt = self.add(start_configured_server(root / "jwt", self.operator.config))
        except BaseException:
            self.stop()
            raise

    def add(self, server: NatsServerProcess) -> NatsServerProcess:
        """Stop ``server`` with the others."""
        self.servers.append(server)
        return server

    @property
    def seeds(self) -> tuple[str, ...]:
        """Every NKey seed these servers' users have: secrets never to be printed."""
        return (
            self.nkey_user.seed,
            self.stranger.seed,
            self.operator.user_seed,
            self.operator.stranger_seed,
        )

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
