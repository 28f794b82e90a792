"""A per-tenant account recipe on a real ``nats-server`` with the real service logged in to it,
as the tenant isolation tests (permissions, limits) start it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from tests.secure_nats import start_server_from_file
from tests.timer_service.process import ServiceProcess, free_port
from timer_adapters_nats import NatsBroker, NatsSettings
from timer_adapters_nats.embedded import NatsServerProcess
from timer_service.tenancy import secret_variable

#: A refused request gets no reply: how long each of those waits.
REFUSED_WAIT_S = 1.0


class TenantDeployment:
    """The server from ``recipe`` (its passwords from ``passwords``, by user) and the service
    logged in as ``timer-service``, serving ``tenants`` with the extra ``env``."""

    def __init__(
        self,
        root: Path,
        recipe: Path,
        tenants: Sequence[str],
        passwords: Mapping[str, str],
        env: Mapping[str, str],
    ) -> None:
        self.passwords = dict(passwords)
        secrets = {
            secret_variable(None, "password"): passwords["timer-service"],
            **{secret_variable(t, "password"): passwords[t] for t in tenants},
        }
        self.server: NatsServerProcess = start_server_from_file(root / "nats", recipe, secrets)
        environment = {k: v for k, v in os.environ.items() if not k.startswith("TIMER_")}
        environment.update(
            TIMER_DB_PATH=str(root / "timer.db"),
            TIMER_BROKER_URL=self.url("timer-service"),
            TIMER_TENANTS=",".join(tenants),
            TIMER_HTTP_PORT=str(free_port()),
            TIMER_POLLING_INTERVAL="200",
            **env,
        )
        self.service = ServiceProcess(environment, root, root / "service.log")
        try:
            self.service.start()
            self.service.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def url(self, user: str) -> str:
        return f"nats://{user}:{self.passwords[user]}@127.0.0.1:{self.server.port}"

    def settings(self, user: str) -> NatsSettings:
        """A user's settings: no provisioning, refusals noticed quickly."""
        return NatsSettings(
            url=self.url(user), provision=False, ack_timeout_s=REFUSED_WAIT_S, client_name=user
        )

    def stop(self) -> None:
        try:
            self.service.kill_group()
        finally:
            self.server.stop()


def running(deployment: TenantDeployment) -> Iterator[TenantDeployment]:
    """Yield ``deployment``, then stop it (the body of a module-scoped fixture)."""
    try:
        yield deployment
    finally:
        deployment.stop()


@asynccontextmanager
async def connected(deployment: TenantDeployment, user: str) -> AsyncIterator[NatsBroker]:
    """A broker logged in to ``deployment``'s server as ``user``, closed on the way out."""
    broker = NatsBroker(deployment.settings(user))
    await broker.start()
    try:
        yield broker
    finally:
        await broker.aclose()
