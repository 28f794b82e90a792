"""Fixtures of the chaos suite: a real nats-server and the service as a killable subprocess,
both stopped by pid at teardown; the figures every scenario reported end the test run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from tests.chaos.rig import ChaosService, service_env
from tests.conftest import NatsServerFactory
from tests.timer_service import process
from timer_adapters_nats.embedded import NatsServerProcess

ServiceFactory = process.ServiceFactory[ChaosService]


@pytest.fixture
def broker(nats_server_factory: NatsServerFactory) -> NatsServerProcess:
    """A running nats-server with JetStream on 127.0.0.1 and a free port (stopped at teardown)."""
    server = nats_server_factory()
    server.start()
    return server


@pytest.fixture
def make_service(tmp_path: Path, broker: NatsServerProcess) -> Iterator[ServiceFactory]:
    """Makes (unstarted) services on ``tmp_path/timer.db`` and :func:`broker`; keyword
    arguments are extra ``TIMER_*`` settings. Every one is killed by its group at teardown."""
    factory = ServiceFactory(
        ChaosService, tmp_path, lambda **settings: service_env(tmp_path, broker.url, **settings)
    )
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
async def nc(broker: NatsServerProcess) -> AsyncIterator[Client]:
    """The test's own connection to :func:`broker` (reconnecting for as long as it takes)."""
    client = await nats.connect(
        broker.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, connect_timeout=5
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    return nc.jetstream(timeout=10)
