"""Secured ``nats-server`` processes for tests: a CA and certificates made here (trustme), NKey
users, tokens, and servers started from a config file written beside their store.

Used by the adapter's security tests, the service's secrets test and the per-tenant
authorization recipe's test.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import nkeys
import pytest
import trustme

from timer_adapters_nats.embedded import NatsServerProcess

__all__ = [
    "DEPLOY_NATS",
    "NKeyUser",
    "Pki",
    "make_pki",
    "new_nkey_user",
    "start_configured_server",
    "start_server_from_file",
]

#: The nats-server configurations the docs show (docs/operations.md, Securing Timer).
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
    store_dir: Path, config: str, *, extra_args: Sequence[str] = ()
) -> NatsServerProcess:
    """Start a JetStream ``nats-server`` on a free 127.0.0.1 port with ``config`` as its file.

    The caller stops it (by pid, through :meth:`NatsServerProcess.stop`).
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    config_file = store_dir / "server.conf"
    config_file.write_text(config)
    server = NatsServerProcess(
        store_dir / "js", host="127.0.0.1", extra_args=["-c", str(config_file), *extra_args]
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
