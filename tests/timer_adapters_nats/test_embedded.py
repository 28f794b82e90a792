"""NatsServerProcess: a real nats-server child process, alone or in a cluster."""

from __future__ import annotations

import os
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from tests.conftest import NatsServerFactory
from tests.timer_adapters_nats.jetstream import wait_until
from timer_adapters_nats import NatsServerError, NatsServerProcess, find_nats_server


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie we reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class TestSingleServer:
    """Start, stop, restart and kill one server."""

    def test_binary_is_found(self) -> None:
        """The nats-server binary installed with the environment is found."""
        assert find_nats_server().name == "nats-server"

    async def test_start_picks_a_free_port_and_serves(
        self, nats_server_factory: NatsServerFactory
    ) -> None:
        """port=0 starts on a free port of 127.0.0.1 that clients can use."""
        server = nats_server_factory()
        server.start()
        assert server.url.startswith("nats://127.0.0.1:") and server.port > 0
        nc = await nats.connect(server.url)
        try:
            assert nc.is_connected
        finally:
            await nc.close()

    async def test_restart_keeps_port_and_data(
        self, nats_server_factory: NatsServerFactory
    ) -> None:
        """After stop() and start() the server is back on the same URL with its streams."""
        server = nats_server_factory()
        server.start()
        url, first_pid = server.url, server.pid
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="S", subjects=["s"], storage=StorageType.FILE))
        await js.publish("s", b"kept")
        await nc.close()
        server.stop()
        assert server.pid is None
        assert first_pid is not None and not alive(first_pid)
        server.start()
        assert server.url == url and server.pid != first_pid
        nc = await nats.connect(url)
        try:
            assert (await nc.jetstream().stream_info("S")).state.messages == 1
        finally:
            await nc.close()

    def test_kill_is_immediate(self, nats_server_factory: NatsServerFactory) -> None:
        """kill() ends the process with SIGKILL."""
        server = nats_server_factory()
        server.start()
        pid = server.pid
        assert pid is not None
        server.kill()
        assert not server.running and not alive(pid)

    def test_context_manager_stops(self, tmp_path: Path) -> None:
        """Leaving the with block stops the server."""
        with NatsServerProcess(tmp_path / "store") as server:
            pid = server.pid
            assert pid is not None and alive(pid)
        assert not alive(pid)

    def test_failed_start_shows_the_log(self, nats_server_factory: NatsServerFactory) -> None:
        """A server that cannot start raises NatsServerError with the end of its log."""
        first = nats_server_factory()
        first.start()
        clash = nats_server_factory(port=first.port)
        with pytest.raises(NatsServerError, match="address already in use"):
            clash.start()
        assert not clash.running

    def test_own_session(self, nats_server_factory: NatsServerFactory) -> None:
        """The server runs in its own session, so a terminal's Ctrl-C does not reach it."""
        server = nats_server_factory()
        server.start()
        assert server.pid is not None
        assert os.getsid(server.pid) == server.pid != os.getsid(0)
        assert os.getpgid(server.pid) != os.getpgid(0)


async def create_r3_stream(js: JetStreamContext, name: str) -> None:
    """Create a stream with three replicas, retried while the cluster cannot place it yet
    (no meta leader, or a member not (re)joined)."""

    async def created() -> bool:
        try:
            await js.add_stream(
                StreamConfig(
                    name=name, subjects=[name.lower()], storage=StorageType.FILE, num_replicas=3
                )
            )
        except nats.errors.Error:
            return False
        return True

    await wait_until(created, within=30, interval=0.25, what=f"the R3 stream {name}")


class TestCluster:
    """Three servers on loopback form a JetStream cluster."""

    async def test_three_nodes_hold_an_r3_stream(
        self, nats_cluster: list[NatsServerProcess]
    ) -> None:
        """A 3-node cluster forms and accepts a stream with 3 replicas."""
        nc = await nats.connect(servers=[server.url for server in nats_cluster])
        js = nc.jetstream(timeout=2)
        try:
            await create_r3_stream(js, "R3")

            async def published() -> bool:
                try:
                    await js.publish("r3", b"replicated")
                except nats.errors.Error:
                    return False  # the new stream's leader is still being elected
                return True

            await wait_until(published, within=30, interval=0.25, what="an acked publish")
            info = await js.stream_info("R3")
            assert info.config.num_replicas == 3
            assert info.cluster is not None and info.cluster.leader is not None
            assert len(info.cluster.replicas or []) == 2
        finally:
            await nc.close()

    def test_members_pick_their_own_ports(self, tmp_path: Path) -> None:
        """cluster() fixes no port in advance (nothing to be taken by another process before
        the start): each member routes to the members before it, on the ports they chose
        (the first one to itself, on a port picked as it starts)."""
        members = NatsServerProcess.cluster(tmp_path, 3)
        assert [m.port for m in members] == [0, 0, 0]
        assert [m.cluster_port for m in members] == [None, None, None]
        assert [m.seeds for m in members] == [(), (members[0],), (members[0], members[1])]

    def test_a_member_started_before_its_seed_says_so(self, tmp_path: Path) -> None:
        """Starting n2 before n1 is refused, naming both, and no process is left behind."""
        _, second = NatsServerProcess.cluster(tmp_path, 2)
        with pytest.raises(NatsServerError, match="start n1 before n2"):
            second.start()
        assert not second.running

    async def test_a_restarted_seed_rejoins(self, nats_cluster: list[NatsServerProcess]) -> None:
        """n1 (which dials only itself: the others dial it) stopped and started again comes back
        on its cluster port: a stream with three replicas needs it."""
        first = nats_cluster[0]
        route = first.route_url
        first.stop()
        first.start()
        assert first.route_url == route
        nc = await nats.connect(servers=[server.url for server in nats_cluster])
        js = nc.jetstream(timeout=2)
        try:
            await create_r3_stream(js, "BACK")
            info = await js.stream_info("BACK")
            assert info.cluster is not None
            names = {info.cluster.leader, *(r.name for r in info.cluster.replicas or [])}
            assert names == {"n1", "n2", "n3"}
        finally:
            await nc.close()
