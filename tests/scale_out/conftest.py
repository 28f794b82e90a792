"""Fixtures of the scale-out tests (several service instances on one PostgreSQL and a
JetStream cluster): a fresh database, killable service processes, and the figures each
scenario reported, printed again at the end of the run."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.figures import Figures
from tests.pg import PostgresCluster
from tests.timer_service import process
from tests.timer_service.process import ServiceProcess, isolated_env

FIGURES = Figures("scale-out")
report = FIGURES.report

ServiceFactory = process.ServiceFactory[ServiceProcess]

_databases = itertools.count()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every scale-out figure again at the end of the run, where CI logs show it."""
    FIGURES.summarize(terminalreporter)


@pytest.fixture
def database_url(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """The URL of a new, empty database on the session's PostgreSQL, dropped afterwards."""
    name = f"timer_scale_out_{os.getpid()}_{next(_databases)}"
    url = postgres_cluster.create_database(name)
    try:
        yield url
    finally:
        postgres_cluster.drop_database(name)


@pytest.fixture
def make_service(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``make_service(**TIMER_settings)``: an unstarted ``timer-service run`` process with its
    own HTTP port and log file; every one is killed by its process group at teardown."""
    factory = ServiceFactory(ServiceProcess, tmp_path, isolated_env)
    try:
        yield factory
    finally:
        factory.close()
