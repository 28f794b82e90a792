"""PostgreSQL secured as docs/security.md shows it: TLS with a verified server and a client
certificate, a password, and the service's role owning only its schema (deploy/postgres/),
on a real server started with SSL by the test."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import attrs
import psycopg
import pytest
import trustme

from tests.pg import PostgresCluster, start_cluster
from tests.timer_service.process import ServiceProcess, free_port
from timer_adapters_postgres import PostgresTimerStore
from timer_core import StoreError, TimerEntry

ROOT = Path(__file__).resolve().parents[2]
ROLE_SQL = ROOT / "deploy" / "postgres" / "timer-role.sql"
HBA = ROOT / "deploy" / "postgres" / "pg_hba.conf"
PASSWORD = "pg-SECRET-7f3a"
DATABASE = "timer"


@attrs.frozen
class SecuredPostgres:
    cluster: PostgresCluster
    ca_file: Path
    other_ca_file: Path
    client_cert_file: Path
    client_key_file: Path

    def url(
        self,
        *,
        password: str = PASSWORD,
        sslmode: str = "verify-full",
        ca_file: Path | None = None,
        client_certificate: bool = True,
    ) -> str:
        """The service's URL: role ``timer``, TLS options as query parameters."""
        query = {"sslmode": sslmode, "sslrootcert": str(ca_file or self.ca_file)}
        if client_certificate:
            query |= {"sslcert": str(self.client_cert_file), "sslkey": str(self.client_key_file)}
        params = "&".join(f"{key}={quote(value, safe='/')}" for key, value in query.items())
        return (
            f"postgresql://timer:{quote(password)}@127.0.0.1:{self.cluster.port}/{DATABASE}"
            f"?{params}"
        )


def hba_lines() -> list[str]:
    return [
        line for line in HBA.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


@pytest.fixture(scope="module")
def secured() -> Iterator[SecuredPostgres]:
    root = Path(tempfile.mkdtemp(prefix="timer-pg-tls-"))  # start_cluster hands it over
    pki = Path(tempfile.mkdtemp(prefix="timer-pg-pki-"))
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    # verify-full client certificates: the common name is the role's name.
    client = ca.issue_cert("timer.example", common_name="timer")
    files = {name: pki / name for name in ("ca", "other", "srv", "srv.key", "cli", "cli.key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    trustme.CA().cert_pem.write_to_path(str(files["other"]))
    server.cert_chain_pems[0].write_to_path(str(files["srv"]))
    server.private_key_pem.write_to_path(str(files["srv.key"]))
    client.cert_chain_pems[0].write_to_path(str(files["cli"]))
    client.private_key_pem.write_to_path(str(files["cli.key"]))
    files["cli.key"].chmod(0o600)  # libpq refuses a key others can read
    cluster: PostgresCluster | None = None
    try:
        cluster = start_cluster(
            root, tls=(files["srv"], files["srv.key"], files["ca"]), hba=hba_lines()
        )
        with cluster.admin() as admin:
            admin.execute(f"CREATE DATABASE {DATABASE} TEMPLATE template0")
        with psycopg.connect(cluster.conninfo(DATABASE), autocommit=True) as conn:
            conn.execute(ROLE_SQL.read_text())
            conn.execute(f"ALTER ROLE timer PASSWORD '{PASSWORD}'")
        yield SecuredPostgres(cluster, files["ca"], files["other"], files["cli"], files["cli.key"])
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pki, ignore_errors=True)


def admin_query(secured: SecuredPostgres, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(secured.cluster.conninfo(DATABASE), autocommit=True) as conn:
        return list(conn.execute(sql).fetchall())


async def refused(url: str) -> str:
    store = PostgresTimerStore(url, connect_timeout_s=5.0)
    with pytest.raises(StoreError) as caught:
        await store.start()
    await store.aclose()
    message = str(caught.value)
    assert PASSWORD not in message
    assert PASSWORD not in repr(store)
    return message


class TestSecuredStore:
    """The store over TLS as the unprivileged role."""

    async def test_store_works_over_tls_as_a_role_owning_only_its_schema(
        self, secured: SecuredPostgres
    ) -> None:
        """Migrations, writes, reads and LISTEN all work, over TLS, in the role's schema."""
        now = datetime.now(UTC).replace(microsecond=0)
        async with PostgresTimerStore(secured.url()) as store:
            await store.apply([TimerEntry("tenant-a", "call-1", now + timedelta(hours=1), now)])
            found = await store.get("tenant-a", "call-1")
            assert found is not None and found.service_call_id == "call-1"
            assert store.listener is not None
            connections = admin_query(
                secured,
                "SELECT s.ssl, s.client_dn FROM pg_stat_ssl s JOIN pg_stat_activity a "
                "USING (pid) WHERE a.usename = 'timer'",
            )
        assert connections, "no connection of role timer seen"
        assert all(ssl and "timer" in str(dn) for ssl, dn in connections), connections
        assert admin_query(
            secured, "SELECT rolsuper, rolcreatedb FROM pg_roles WHERE rolname = 'timer'"
        ) == [(False, False)]
        tables = admin_query(
            secured,
            "SELECT schemaname, tableowner FROM pg_tables WHERE tablename LIKE 'timer%' "
            "GROUP BY 1, 2",
        )
        assert tables == [("timer", "timer")]

    async def test_plain_connection_is_rejected(self, secured: SecuredPostgres) -> None:
        """sslmode=disable meets the pg_hba.conf rule that rejects the role without TLS."""
        message = await refused(secured.url(sslmode="disable", client_certificate=False))
        assert "no encryption" in message or "rejects" in message

    async def test_untrusted_server_certificate(self, secured: SecuredPostgres) -> None:
        """verify-full against a CA that did not sign the server's certificate fails."""
        message = await refused(secured.url(ca_file=secured.other_ca_file))
        assert "certificate verify failed" in message

    async def test_missing_client_certificate(self, secured: SecuredPostgres) -> None:
        """Without a client certificate the server refuses the role."""
        message = await refused(secured.url(client_certificate=False))
        assert "certificate" in message

    async def test_wrong_password(self, secured: SecuredPostgres) -> None:
        """A wrong password is refused, and neither password is shown."""
        message = await refused(secured.url(password="wrong-" + PASSWORD))
        assert "password authentication failed" in message


class TestService:
    """timer-service configured with the documented URL."""

    def test_service_runs_on_the_secured_database(
        self, secured: SecuredPostgres, tmp_path: Path, nats_url: str
    ) -> None:
        """The service becomes healthy on TLS PostgreSQL as the unprivileged role."""
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env.update(
            TIMER_DATABASE_URL=secured.url(),
            TIMER_BROKER_URL=nats_url,
            TIMER_HTTP_PORT=str(free_port()),
            TIMER_POLLING_INTERVAL="200",
        )
        service = ServiceProcess(env, tmp_path, tmp_path / "service.log")
        try:
            service.start()
            service.wait_healthy()
            assert service.terminate() == 0
        finally:
            service.kill_group()
        assert PASSWORD not in service.log()
