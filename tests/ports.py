"""Addresses of 127.0.0.1 that refuse connections, for tests of an unreachable server.

A port bound and closed again ("free") is free for anyone: a server of another test run on
the same machine may take it before the test connects, and the test then meets that server.
A port held bound without ``listen()`` cannot be bound by anyone else (nor handed out as an
ephemeral port) while it is held, and every connection to it is refused (RST), from this
process or a child.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

__all__ = ["refused_port", "refused_ports"]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port of 127.0.0.1 that refuses every connection while the block runs."""
    with refused_ports(1) as (port,):
        yield port


@contextlib.contextmanager
def refused_ports(count: int) -> Iterator[tuple[int, ...]]:
    """``count`` distinct ports of 127.0.0.1 that refuse every connection while the block
    runs (bound, never listening, held until it ends)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        yield tuple(ports)
