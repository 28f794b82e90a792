"""Fixtures shared by every test folder: real ``nats-server`` processes and a real PostgreSQL
server on 127.0.0.1.

Each server gets a free port and a fresh store directory, and is stopped by its pid at
teardown even when the test failed.

``TESTS_NO_SKIP=all`` makes a run with a skipped (or xfailed) test fail;
``TESTS_NO_SKIP=except-os-tool`` lets only ``os_tool`` tests skip (their tool is missing).
``.ci/run`` sets them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests import figures
from tests.pg import PostgresCluster, start_cluster
from timer_adapters_nats.embedded import NatsServerProcess

NatsServerFactory = Callable[..., NatsServerProcess]

NO_SKIP_SETTING = "TESTS_NO_SKIP"

# No per-example deadline: a property test asserts what the code does, not how fast a shared,
# busy machine runs it (the codec's round trip failed its 200 ms deadline at 372 ms under a
# full suite, and took 8 ms when Hypothesis ran the same example again).
settings.register_profile("timer", deadline=None)
settings.load_profile("timer")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse an unknown ``TESTS_NO_SKIP`` before running anything."""
    mode = os.environ.get(NO_SKIP_SETTING, "")
    if mode not in ("", "all", "except-os-tool"):
        raise pytest.UsageError(f"{NO_SKIP_SETTING}={mode!r}: expected 'all' or 'except-os-tool'")


def _forbidden_skips(config: pytest.Config) -> list[pytest.TestReport]:
    mode = os.environ.get(NO_SKIP_SETTING, "")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not mode or reporter is None:
        return []
    reports = [*reporter.stats.get("skipped", []), *reporter.stats.get("xfailed", [])]
    return [r for r in reports if mode == "all" or "os_tool" not in r.keywords]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``TESTS_NO_SKIP``, a forbidden skip fails the run."""
    if exitstatus == pytest.ExitCode.OK and _forbidden_skips(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Scenario figures reported by the test go with its report (to the xdist controller)."""
    report = yield
    figures.attach(report)
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    figures.receive(report)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The scenario suites' figures; the skips that failed the run."""
    figures.summarize(terminalreporter)
    skips = _forbidden_skips(config)
    if skips:
        terminalreporter.section(f"{NO_SKIP_SETTING}: skips fail this run", red=True)
        for report in skips:
            terminalreporter.write_line(f"SKIPPED {report.nodeid}")


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


#: Folders of the heavy scenario suites (many processes, seconds of load each).
_SCENARIO_FOLDERS = ("chaos", "scale_out", "bench")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it runs the suite
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (pyproject's addopts), except that the scenario suites form one
    chain on one worker: never two of them at once on a 2-core machine, and the longest
    piece of work starts first (they come first in the collection)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ScenarioChain(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = str(super()._split_scope(nodeid))
            parts = scope.split("/")
            scenario = len(parts) > 2 and parts[0] == "tests" and parts[1] in _SCENARIO_FOLDERS
            return "tests/(scenario suites)" if scenario else scope

    return ScenarioChain(config, log)
