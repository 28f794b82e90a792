"""Fixtures of the NATS adapter tests: settings with short timeouts and a started broker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from timer_adapters_nats import NatsBroker, NatsSettings


@pytest.fixture
def settings(nats_url: str) -> NatsSettings:
    """Settings for a test: the fixture server, and timeouts short enough to keep tests fast.

    The shared consumer's source: the tests of one consumer's promises read it directly
    (each lane of the per-tenant intake is such a source; tests/timer_adapters_nats/
    test_fair_intake.py covers the lanes)."""
    return NatsSettings(
        url=nats_url,
        per_tenant_intake=False,
        ack_timeout_s=2.0,
        fetch_timeout_s=0.2,
        ack_wait_s=5.0,
        nak_delay_s=0.05,
        max_nak_delay_s=0.2,
        connect_timeout_s=2.0,
        reconnect_wait_s=0.05,
    )


@pytest_asyncio.fixture
async def broker(settings: NatsSettings) -> AsyncIterator[NatsBroker]:
    """A started, provisioned broker, closed after the test."""
    broker = NatsBroker(settings)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.aclose()
