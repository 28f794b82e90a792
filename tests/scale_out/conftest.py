"""Fixtures of the scale-out tests (several service instances on one PostgreSQL and a
JetStream cluster): killable service processes, and the figures each scenario reported,
printed again at the end of the run. Their database is the root conftest's
``fresh_postgres_url``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.figures import Figures
from tests.timer_service import process
from tests.timer_service.process import ServiceProcess, isolated_env

FIGURES = Figures("scale-out")
report = FIGURES.report

ServiceFactory = process.ServiceFactory[ServiceProcess]


@pytest.fixture
def make_service(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``make_service(**TIMER_settings)``: an unstarted ``timer-service run`` process with its
    own HTTP port and log file; every one is killed by its process group at teardown."""
    factory = ServiceFactory(ServiceProcess, tmp_path, isolated_env)
    try:
        yield factory
    finally:
        factory.close()
