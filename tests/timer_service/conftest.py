"""Fixtures for the service tests: a real nats-server and the service as a real subprocess."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.timer_service.process import ServiceProcess, free_port
from timer_adapters_nats.embedded import NatsServerProcess


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    server = NatsServerProcess(tmp_path / "nats", host="127.0.0.1", port=0)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def service_env(tmp_path: Path, nats_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
    env.update(
        TIMER_DB_PATH=str(tmp_path / "timer.db"),
        TIMER_BROKER_URL=nats_url,
        TIMER_HTTP_PORT=str(free_port()),
        TIMER_POLLING_INTERVAL="1000",
    )
    return env


@pytest.fixture
def service(tmp_path: Path, service_env: dict[str, str]) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(service_env, tmp_path, tmp_path / "service.log")
    try:
        yield proc
    finally:
        proc.kill_group()
