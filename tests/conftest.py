"""Fixtures shared by every test folder: real ``nats-server`` processes and a real PostgreSQL
server on 127.0.0.1.

Each server gets a free port and a fresh store directory, and is stopped by its pid at
teardown even when the test failed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pg import PostgresCluster, start_cluster
from timer_adapters_nats.embedded import NatsServerProcess

NatsServerFactory = Callable[..., NatsServerProcess]


@pytest.fixture
def nats_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServerFactory]:
    """Makes (unstarted) ``NatsServerProcess`` objects; every one is stopped at teardown.

    Keyword arguments go to :class:`NatsServerProcess`; ``store_dir`` defaults to a fresh
    temporary directory and ``host`` to 127.0.0.1.
    """
    servers: list[NatsServerProcess] = []

    def make(**options: Any) -> NatsServerProcess:
        store_dir: Path = options.pop("store_dir", None) or tmp_path_factory.mktemp("nats")
        options.setdefault("host", "127.0.0.1")
        server = NatsServerProcess(store_dir, **options)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        errors: list[BaseException] = []
        for server in servers:
            try:
                server.stop()
            except BaseException as exc:  # stop the others anyway
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def nats_server(nats_server_factory: NatsServerFactory) -> NatsServerProcess:
    """A running single ``nats-server`` with JetStream, on a free port of 127.0.0.1."""
    server = nats_server_factory()
    server.start()
    return server


@pytest.fixture
def nats_url(nats_server: NatsServerProcess) -> str:
    """The client URL of :func:`nats_server`."""
    return nats_server.url


@pytest.fixture
def nats_cluster(
    nats_server_factory: NatsServerFactory, tmp_path_factory: pytest.TempPathFactory
) -> list[NatsServerProcess]:
    """Three running ``nats-server`` processes forming one JetStream cluster on 127.0.0.1.

    The cluster elects its JetStream meta leader a moment after start: retry the first
    stream creation until it succeeds.
    """
    servers: list[NatsServerProcess] = []
    for member in NatsServerProcess.cluster(tmp_path_factory.mktemp("nats-cluster"), 3):
        # Made by the factory (stopped by it), seeded with those started before it: each
        # server picks its own ports, so none can be taken by another process meanwhile.
        server = nats_server_factory(
            store_dir=member.store_dir,
            server_name=member.server_name,
            cluster_name=member.cluster_name,
            seeds=list(servers),
        )
        server.start()
        servers.append(server)
    return servers


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """One PostgreSQL server for the whole session (see :mod:`tests.pg`), stopped by pid even
    if tests fail; started only when a test asks for it."""
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
