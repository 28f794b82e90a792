"""Secrets stay secret: every setting that can carry one is fed a marked secret, the real
``timer-service`` goes through its failure paths (bad host, refused credentials, untrusted
certificate, unknown NKey, bad database password) and a healthy run with a broker restart,
and no output, log line, ``/healthz`` or ``/metrics`` body ever shows one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import PostgresCluster
from tests.ports import refused_port, refused_ports
from tests.secure_nats import DEPLOY_NATS, SecuredBrokers, hostport, start_server_from_file
from tests.timer_service.process import ServiceProcess, free_port, http_get
from timer_core.redaction import redact_url
from timer_service.settings import Settings, SettingsError

# Every secret is marked so that a grep finds it however it was cut or quoted.
NATS_PASSWORD = "SECRETnatsPW1"
NATS_TOKEN = "SECRETnatsTOKEN2"
WRONG_PASSWORD = "SECRETwrongPW3"
WRONG_TOKEN = "SECRETwrongTOKEN4"
DB_PASSWORD = "SECRETdbPW5"
DB_QUERY_PASSWORD = "SECRETdbQUERY6"
HTTP_TOKEN = "SECREThttpTOKEN7"
SECRETS = (
    NATS_PASSWORD,
    NATS_TOKEN,
    WRONG_PASSWORD,
    WRONG_TOKEN,
    DB_PASSWORD,
    DB_QUERY_PASSWORD,
    HTTP_TOKEN,
)
CONNECT_TIMEOUT_S = 5.0  # the service's default


class Brokers(SecuredBrokers):
    """The shared secured servers, with this module's marked secrets."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, password=NATS_PASSWORD, token=NATS_TOKEN)

    @property
    def secrets(self) -> tuple[str, ...]:
        return (*SECRETS, *self.seeds)


@pytest.fixture(scope="module")
def brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Brokers]:
    started = Brokers(tmp_path_factory.mktemp("secrets-nats"))
    try:
        yield started
    finally:
        started.stop()


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
    env.update(TIMER_DB_PATH=str(tmp_path / "timer.db"), TIMER_HTTP_PORT="0")
    return env


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timer_service.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_no_secret(text: str, secrets: tuple[str, ...], where: str) -> None:
    for secret in secrets:
        assert secret not in text, f"{where} shows the secret {secret!r}:\n{text}"


def failing_run(
    brokers: Brokers, tmp_path: Path, *, command: tuple[str, ...] = ("run",), **env: str
) -> str:
    """Run a subcommand that must fail at start; return its one-line error (all output
    checked for secrets)."""
    environment = {**base_env(tmp_path), "TIMER_LOG_LEVEL": "DEBUG", **env}
    args = [*command]
    if command[0] in ("schedule", "cancel"):
        args += ["tenant-a", "call-1"] + (["--in", "1h"] if command[0] == "schedule" else [])
    result = run_cli(args, environment, tmp_path)
    output = result.stdout + result.stderr
    assert_no_secret(output, brokers.secrets, f"`timer-service {' '.join(command)}`")
    assert result.returncode != 0, output
    return result.stderr.strip().splitlines()[-1]


class TestFailurePaths:
    """The service and its commands fail clearly without showing a secret."""

    def test_bad_host(self, brokers: Brokers, tmp_path: Path) -> None:
        """An unreachable cluster of two URLs, a password and a token in them, stays redacted."""
        with refused_ports(2) as (first, second):
            url = (
                f"nats://alice:{NATS_PASSWORD}@127.0.0.1:{first},"
                f"nats://{NATS_TOKEN}@127.0.0.1:{second}"
            )
            line = failing_run(brokers, tmp_path, TIMER_BROKER_URL=url)
        assert "TIMER_BROKER_URL=nats://alice:***@127.0.0.1:" in line
        assert "nats://***@127.0.0.1:" in line

    def test_refused_password(self, brokers: Brokers, tmp_path: Path) -> None:
        """A refused password is reported as refused, promptly, without the password."""
        line = failing_run(
            brokers,
            tmp_path,
            TIMER_BROKER_URL=f"nats://alice:{WRONG_PASSWORD}@{hostport(brokers.tls)}",
            TIMER_BROKER_TLS_CA_FILE=str(brokers.pki.ca_file),
        )
        assert "refused the credentials" in line

    def test_refused_token_setting(self, brokers: Brokers, tmp_path: Path) -> None:
        """A wrong TIMER_BROKER_TOKEN is refused without being shown."""
        line = failing_run(
            brokers, tmp_path, TIMER_BROKER_URL=brokers.token.url, TIMER_BROKER_TOKEN=WRONG_TOKEN
        )
        assert "refused the credentials" in line

    def test_untrusted_certificate(self, brokers: Brokers, tmp_path: Path) -> None:
        """A server certificate the CA file does not vouch for fails, token unshown."""
        line = failing_run(
            brokers,
            tmp_path,
            TIMER_BROKER_URL=f"tls://{NATS_TOKEN}@{hostport(brokers.tls)}",
            TIMER_BROKER_TLS_CA_FILE=str(brokers.pki.other_ca_file),
        )
        assert "certificate verification failed" in line

    def test_unknown_nkey(self, brokers: Brokers, tmp_path: Path) -> None:
        """An NKey seed the server does not know is refused; the seed is never printed."""
        line = failing_run(
            brokers,
            tmp_path,
            TIMER_BROKER_URL=f"tls://{hostport(brokers.tls)}",
            TIMER_BROKER_TLS_CA_FILE=str(brokers.pki.ca_file),
            TIMER_BROKER_NKEY_SEED_FILE=str(brokers.stranger.seed_file),
        )
        assert "refused the credentials" in line

    def test_refused_creds_file(self, brokers: Brokers, tmp_path: Path) -> None:
        """A .creds file of an account the operator does not know is refused, seed unshown."""
        line = failing_run(
            brokers,
            tmp_path,
            TIMER_BROKER_URL=brokers.jwt.url,
            TIMER_BROKER_CREDS_FILE=str(brokers.operator.stranger_creds_file),
        )
        assert "refused the credentials" in line

    def test_unreachable_database(self, brokers: Brokers, tmp_path: Path) -> None:
        """A PostgreSQL URL with a password and a password parameter is redacted in the error."""
        with refused_port() as port:
            url = (
                f"postgresql://timer:{DB_PASSWORD}@127.0.0.1:{port}/timer"
                f"?sslmode=disable&password={DB_QUERY_PASSWORD}"
            )
            line = failing_run(
                brokers,
                tmp_path,
                TIMER_DB_PATH="",
                TIMER_DATABASE_URL=url,
                TIMER_BROKER_URL=f"nats://{NATS_TOKEN}@{hostport(brokers.token)}",
            )
        assert "TIMER_DATABASE_URL" in line

    @pytest.mark.parametrize("command", [("schedule",), ("cancel",), ("dlq", "list")])
    def test_commands_that_publish(
        self, brokers: Brokers, tmp_path: Path, command: tuple[str, ...]
    ) -> None:
        """schedule, cancel and dlq refuse a wrong password without showing it."""
        line = failing_run(
            brokers,
            tmp_path,
            command=command,
            TIMER_BROKER_URL=f"nats://alice:{WRONG_PASSWORD}@{hostport(brokers.tls)}",
            TIMER_BROKER_TLS_CA_FILE=str(brokers.pki.ca_file),
        )
        assert "refused the credentials" in line

    def test_inspect_with_a_bad_database(self, brokers: Brokers, tmp_path: Path) -> None:
        """inspect against an unreachable database does not show its password."""
        with refused_port() as port:
            url = f"postgresql://timer:{DB_PASSWORD}@127.0.0.1:{port}/timer"
            environment = {**base_env(tmp_path), "TIMER_DB_PATH": "", "TIMER_DATABASE_URL": url}
            result = run_cli(["inspect", "tenant-a"], environment, tmp_path)
        assert result.returncode != 0
        assert_no_secret(result.stdout + result.stderr, brokers.secrets, "inspect")

    def test_bad_settings_values(self, brokers: Brokers, tmp_path: Path) -> None:
        """A malformed URL or token is rejected with its secret redacted."""
        for variable, value in (
            ("TIMER_BROKER_URL", f"nats://alice:{NATS_PASSWORD}@host with space"),
            ("TIMER_DATABASE_URL", f"postgresql://timer:{DB_PASSWORD}@db/x y"),
            ("TIMER_BROKER_TOKEN", f"{NATS_TOKEN} {NATS_TOKEN}"),
        ):
            line = failing_run(brokers, tmp_path, **{variable: value})
            assert variable in line


class TestHealthyRun:
    """A running service that reconnects shows no secret in its logs or endpoints."""

    def test_logs_and_endpoints(
        self, brokers: Brokers, tmp_path: Path, postgres_cluster: PostgresCluster
    ) -> None:
        """DEBUG logs through start, a broker restart and shutdown, /healthz and /metrics."""
        database = postgres_cluster.create_database("secrets")
        # The test cluster trusts loopback, so the password is not checked: it is still a
        # secret the service must not print.
        db_url = database.replace(
            f"{postgres_cluster.user}@", f"{postgres_cluster.user}:{DB_PASSWORD}@"
        )
        env = {
            **base_env(tmp_path),
            "TIMER_DB_PATH": "",
            "TIMER_DATABASE_URL": f"{db_url}?password={DB_QUERY_PASSWORD}",
            "TIMER_BROKER_URL": f"nats://alice:{NATS_PASSWORD}@{hostport(brokers.tls)}",
            "TIMER_BROKER_TLS_CA_FILE": str(brokers.pki.ca_file),
            "TIMER_HTTP_PORT": str(free_port()),
            "TIMER_LOG_LEVEL": "DEBUG",
            "TIMER_POLLING_INTERVAL": "200",
            "TIMER_HTTP_TOKEN": HTTP_TOKEN,
        }
        service = ServiceProcess(env, tmp_path, tmp_path / "service.log")
        try:
            service.start()
            service.wait_healthy()
            sent = run_cli(["schedule", "tenant-a", "call-1", "--in", "1s"], env, tmp_path)
            assert sent.returncode == 0, sent.stderr
            assert_no_secret(sent.stdout + sent.stderr, brokers.secrets, "schedule")
            # The HTTP actions, with the token and without: logged, the token never.
            listed = run_cli(["quarantine", "list"], env, tmp_path)
            assert listed.returncode == 0, listed.stderr
            refused = run_cli(
                ["quarantine", "retry", "--all"], {**env, "TIMER_HTTP_TOKEN": ""}, tmp_path
            )
            assert "HTTP 401" in refused.stderr
            assert_no_secret(
                listed.stdout + listed.stderr + refused.stderr, brokers.secrets, "quarantine"
            )
            # A broker restart makes the client log its disconnect, errors and reconnect.
            brokers.tls.stop()
            brokers.tls.start()
            service.wait_healthy()
            bodies = [http_get(service.http_port, path)[1] for path in ("/healthz", "/metrics")]
            assert service.terminate() == 0
        finally:
            service.kill_group()
        log = service.log()
        assert "reconnected to NATS nats://alice:***@" in log
        assert_no_secret(log, brokers.secrets, "the service's log")
        for body in bodies:
            assert_no_secret(body, brokers.secrets, "an HTTP endpoint")
        postgres_cluster.drop_database("secrets")


class TestStalledBroker:
    """A broker that stops answering does not hold the service's shutdown up."""

    # What the shutdown may wait for with the broker silent: the last acks and the pull
    # inbox (the ack timeout, 5 s, each) and the connection's close (2 s). Without the bound
    # on the close, a TLS close alone waits 30 s for the server's answer.
    STOP_BUDGET_S = 25.0

    def test_sigterm_exits_while_the_tls_broker_is_stopped(
        self, brokers: Brokers, tmp_path: Path
    ) -> None:
        """With its TLS broker frozen (SIGSTOP), SIGTERM still ends the service, exit 0."""
        env = {
            **base_env(tmp_path),
            "TIMER_BROKER_URL": f"nats://alice:{NATS_PASSWORD}@{hostport(brokers.tls)}",
            "TIMER_BROKER_TLS_CA_FILE": str(brokers.pki.ca_file),
            "TIMER_HTTP_PORT": str(free_port()),
        }
        service = ServiceProcess(env, tmp_path, tmp_path / "service.log")
        broker_pid = brokers.tls.pid
        assert broker_pid is not None
        try:
            service.start()
            service.wait_healthy()
            os.kill(broker_pid, signal.SIGSTOP)
            try:
                assert service.terminate(timeout=self.STOP_BUDGET_S) == 0
            finally:
                os.kill(broker_pid, signal.SIGCONT)
        finally:
            service.kill_group()
        assert "closing the NATS connection did not finish within" in service.log()


class TestDocumentedMutualTls:
    """The service configured as docs/security.md shows, against deploy/nats/tls.conf."""

    def test_service_with_client_certificate_and_nkey(
        self, brokers: Brokers, tmp_path: Path
    ) -> None:
        """TIMER_BROKER_TLS_* and TIMER_BROKER_NKEY_SEED_FILE get the real service healthy."""
        pki = brokers.pki
        server = start_server_from_file(
            tmp_path / "nats",
            DEPLOY_NATS / "tls.conf",
            {
                "NATS_TLS_CERT_FILE": str(pki.server_cert_file),
                "NATS_TLS_KEY_FILE": str(pki.server_key_file),
                "NATS_TLS_CA_FILE": str(pki.ca_file),
                "TIMER_SERVICE_NKEY": brokers.nkey_user.public_key,
            },
        )
        env = {
            **base_env(tmp_path),
            "TIMER_BROKER_URL": f"tls://{hostport(server)}",
            "TIMER_BROKER_TLS_CA_FILE": str(pki.ca_file),
            "TIMER_BROKER_TLS_CERT_FILE": str(pki.client_cert_file),
            "TIMER_BROKER_TLS_KEY_FILE": str(pki.client_key_file),
            "TIMER_BROKER_NKEY_SEED_FILE": str(brokers.nkey_user.seed_file),
            "TIMER_HTTP_PORT": str(free_port()),
        }
        service = ServiceProcess(env, tmp_path, tmp_path / "service.log")
        try:
            service.start()
            service.wait_healthy()
            sent = run_cli(["schedule", "tenant-a", "call-1", "--in", "1h"], env, tmp_path)
            assert sent.returncode == 0, sent.stderr
            assert service.terminate() == 0
        finally:
            service.kill_group()
            server.stop()
        assert_no_secret(service.log() + sent.stdout + sent.stderr, brokers.secrets, "output")


class TestSettingsRepr:
    """Settings objects never show a secret."""

    def test_repr(self, tmp_path: Path) -> None:
        """repr(Settings) redacts both URLs and the token."""
        settings = Settings.from_environment(
            {
                "TIMER_BROKER_URL": f"nats://alice:{NATS_PASSWORD}@h:4222",
                "TIMER_DATABASE_URL": f"postgresql://timer:{DB_PASSWORD}@db/timer",
                "TIMER_BROKER_TOKEN": NATS_TOKEN,
                "TIMER_HTTP_TOKEN": HTTP_TOKEN,
            }
        )
        text = repr(settings)
        assert_no_secret(text, SECRETS, "repr(Settings)")
        assert redact_url(settings.broker_url or "") in text

    def test_two_authentication_methods(self, tmp_path: Path) -> None:
        """A token and an NKey seed file together are refused, naming both variables."""
        seed = tmp_path / "seed.nk"
        seed.write_text("SU...\n")
        with pytest.raises(SettingsError, match="TIMER_BROKER_TOKEN") as caught:
            Settings.from_environment(
                {"TIMER_BROKER_NKEY_SEED_FILE": str(seed), "TIMER_BROKER_TOKEN": NATS_TOKEN}
            )
        assert NATS_TOKEN not in str(caught.value)

    def test_missing_file(self, tmp_path: Path) -> None:
        """A CA file that does not exist is named with its variable."""
        with pytest.raises(SettingsError, match="TIMER_BROKER_TLS_CA_FILE"):
            Settings.from_environment({"TIMER_BROKER_TLS_CA_FILE": str(tmp_path / "ca.pem")})
