"""Fixtures of the end-to-end tests: a fresh PostgreSQL database, killable service processes,
and the figures each scenario reported, printed again at the end of the run."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.pg import PostgresCluster
from tests.timer_service.process import ServiceProcess, free_port

#: Figures the scenarios reported, in order, for the terminal summary.
REPORTED: list[tuple[str, dict[str, object]]] = []

ServiceFactory = Callable[..., ServiceProcess]

_databases = itertools.count()


def report(scenario: str, **figures: object) -> None:
    """Print a scenario's figures now (seen with ``-s``) and keep them for the summary."""
    line = " ".join(f"{key}={value}" for key, value in figures.items())
    print(f"\n[e2e] {scenario}: {line}", flush=True)
    REPORTED.append((scenario, figures))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every end-to-end figure again at the end of the run, where CI logs show it."""
    if not REPORTED:
        return
    terminalreporter.section("end-to-end figures")
    for scenario, figures in REPORTED:
        line = " ".join(f"{key}={value}" for key, value in figures.items())
        terminalreporter.write_line(f"{scenario}: {line}")


@pytest.fixture
def database_url(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """The URL of a new, empty database on the session's PostgreSQL, dropped afterwards."""
    name = f"timer_e2e_{os.getpid()}_{next(_databases)}"
    url = postgres_cluster.create_database(name)
    try:
        yield url
    finally:
        postgres_cluster.drop_database(name)


@pytest.fixture
def make_service(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``make_service(**TIMER_settings)``: an unstarted ``timer-service run`` process with its
    own HTTP port and log file; every one is killed by its process group at teardown."""
    made: list[ServiceProcess] = []

    def make(**settings: str) -> ServiceProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        env["TIMER_HTTP_PORT"] = str(free_port())
        env.update(settings)
        service = ServiceProcess(env, tmp_path, tmp_path / f"service-{len(made)}.log")
        made.append(service)
        return service

    try:
        yield make
    finally:
        for service in made:
            service.kill_group()
