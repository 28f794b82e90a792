"""A real PostgreSQL server for the tests: one throwaway cluster per session, one database per test.

The cluster is made with ``initdb`` in a temporary directory and runs ``postgres`` on
127.0.0.1 with a free port (as the ``postgres`` OS user when the tests run as root, since the
server refuses root), tuned for speed, not durability. It is stopped by its pid at teardown.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import pytest_asyncio
import sqlalchemy as sa

from timer_adapters_postgres import PostgresTimerStore

_SEARCH_DIRS = ("/usr/lib/postgresql", "/usr/local/pgsql", "/opt/postgresql")
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 15.0
# Durability is worthless in a throwaway cluster; these make commits and DDL cheap.
_SPEED_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "wal_level": "minimal",
    "max_wal_senders": "0",
    "max_connections": "200",
    "shared_buffers": "128MB",
    "log_min_messages": "warning",
    "log_min_duration_statement": "-1",
}


def postgres_bin_dir() -> Path:
    """The directory holding ``initdb`` and ``postgres`` (newest version installed)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    candidates = sorted(
        (path for root in _SEARCH_DIRS for path in Path(root).glob("*/bin/initdb")),
        key=lambda path: [int(p) if p.isdigit() else 0 for p in path.parent.parent.name.split(".")],
    )
    candidates += [path for root in _SEARCH_DIRS for path in Path(root).glob("bin/initdb")]
    if not candidates:
        raise RuntimeError(
            "PostgreSQL is not installed (no initdb under /usr/lib/postgresql/*/bin); "
            "install it with: apt-get install -y postgresql"
        )
    return candidates[-1].parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.define
class PostgresCluster:
    """A running throwaway PostgreSQL cluster on 127.0.0.1; ``url(db)`` for SQLAlchemy."""

    root: Path
    port: int
    process: subprocess.Popen[bytes]
    user: str = "postgres"

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, database: str = "postgres") -> str:
        """A SQLAlchemy URL (psycopg 3 driver) for ``database`` on this cluster."""
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"

    def conninfo(self, database: str = "postgres") -> str:
        """A libpq connection string for ``database`` on this cluster."""
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={database}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        """An autocommit connection to the maintenance database (for CREATE DATABASE)."""
        return psycopg.connect(self.conninfo(), autocommit=True, connect_timeout=5)

    def create_database(self, name: str) -> str:
        """Create an empty database and return its SQLAlchemy URL."""
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, disconnecting whoever is still on it."""
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def log_tail(self, lines: int = 40) -> str:
        log = self.root / "postgres.log"
        if not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Fast shutdown by pid (SIGINT), SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(_STOP_TIMEOUT_S)


def _server_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(
            "running as root, PostgreSQL must run as the 'postgres' user, which does not exist "
            "(the postgresql package creates it)"
        ) from None


def _as_server_user() -> dict[str, object]:
    """Popen arguments that drop root to the ``postgres`` user (a no-op for other users)."""
    if os.geteuid() != 0:
        return {}
    entry = _server_user()
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _chown_to_server_user(path: Path) -> None:
    if os.geteuid() == 0:
        entry = _server_user()
        os.chown(path, entry.pw_uid, entry.pw_gid)


def start_cluster(root: Path, settings: dict[str, str] | None = None) -> PostgresCluster:
    """``initdb`` into ``root/data`` and start ``postgres`` on a free loopback port."""
    bin_dir = postgres_bin_dir()
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    for path in (root, sockets):
        _chown_to_server_user(path)
    drop = _as_server_user()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}
    subprocess.run(
        [
            str(bin_dir / "initdb"),
            "--pgdata",
            str(data),
            "--username",
            "postgres",
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--locale",
            "C",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        env=env,
        cwd=root,
        **drop,  # type: ignore[arg-type]
    )
    options = {**_SPEED_SETTINGS, **(settings or {})}
    last_error = ""
    for _attempt in range(3):  # the free port may be taken between probing and binding
        port = _free_port()
        log = (root / "postgres.log").open("ab")
        command = [
            str(bin_dir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"unix_socket_directories={sockets}",
        ]
        for name, value in options.items():
            command += ["-c", f"{name}={value}"]
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
            **drop,  # type: ignore[call-overload]
        )
        log.close()
        cluster = PostgresCluster(root=root, port=port, process=process)
        if _wait_ready(cluster):
            return cluster
        last_error = cluster.log_tail()
        cluster.stop()
    raise RuntimeError(f"PostgreSQL did not start:\n{last_error}")


def _wait_ready(cluster: PostgresCluster) -> bool:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if cluster.process.poll() is not None:
            return False
        try:
            with psycopg.connect(cluster.conninfo(), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            time.sleep(0.05)  # polling a starting server: nothing to wait on but the port
    return False


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """One PostgreSQL server for the whole session, stopped by pid even if tests fail."""
    root = Path(tempfile.mkdtemp(prefix="timer-pg-"))
    cluster: PostgresCluster | None = None
    try:
        cluster = start_cluster(root)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


_database_numbers = itertools.count()


@pytest.fixture
def fresh_postgres_url(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """The SQLAlchemy URL of a new, empty database of its own (never migrated)."""
    name = f"timer_test_{os.getpid()}_{next(_database_numbers)}"
    url = postgres_cluster.create_database(name)
    try:
        yield url
    finally:
        postgres_cluster.drop_database(name)


@pytest.fixture(scope="session")
def _shared_database(postgres_cluster: PostgresCluster) -> str:
    # Creating a database costs 0.1-0.3 s; emptying the table of a shared one, milliseconds.
    name = f"timer_shared_{os.getpid()}"
    postgres_cluster.create_database(name)
    return name


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster, _shared_database: str) -> str:
    """The SQLAlchemy URL of a database whose timer table (if any) is empty for this test."""
    with psycopg.connect(postgres_cluster.conninfo(_shared_database), autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('timer_schedules')").fetchone() != (None,):
            conn.execute("TRUNCATE timer_schedules")
    return postgres_cluster.url(_shared_database)


@pytest.fixture
def postgres_sql(postgres_url: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    """An autocommit psycopg connection to the test's database, to look behind the store."""
    conninfo = sa.make_url(postgres_url).set(drivername="postgresql")
    with psycopg.connect(conninfo.render_as_string(hide_password=False), autocommit=True) as conn:
        yield conn


@pytest_asyncio.fixture
async def make_started_store(postgres_url: str) -> AsyncIterator[Callable[..., Any]]:
    """``await make_started_store(**options)``: a started store on the test's database.

    Every store made is closed at teardown.
    """
    stores: list[PostgresTimerStore] = []

    async def make(**options: Any) -> PostgresTimerStore:
        options.setdefault("pool_size", 3)
        store = PostgresTimerStore(postgres_url, **options)
        stores.append(store)
        await store.start()
        return store

    try:
        yield make
    finally:
        for store in stores:
            await store.aclose()
