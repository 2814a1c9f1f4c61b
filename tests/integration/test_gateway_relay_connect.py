"""A backend whose listen queue is full takes no connection: the SYN is dropped and the connect hangs, as a node
under load or one going away does. The relay gives up after the connect timeout and says so."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from unittest.mock import Mock

from gateway.backends import Backend, Mover
from gateway.ends import Broken
from gateway.relay import ClientStream, relay
from gateway.server import Connection
from gateway.settings import TimeoutSettings
from gateway.splice import Splicer


def fill_queue(server: socket.socket, stack: ExitStack) -> None:
    """Connect to ``server`` (listening with a backlog of 0) until its accept queue is full: a further connect hangs,
    its SYN dropped. The connections last as long as ``stack``."""
    for _ in range(8):  # Linux queues backlog + 1 connections; a few more cover kernels that queue more
        client = stack.enter_context(socket.socket())
        client.setblocking(False)
        with suppress(BlockingIOError):
            client.connect(server.getsockname())


@contextmanager
def full_listener() -> Iterator[int]:
    """A port that listens and never accepts, its queue already full: a further connect hangs."""
    with ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=0))
        fill_queue(server, stack)
        yield server.getsockname()[1]


async def test_a_backend_that_takes_no_connection_is_a_timeout_named_by_the_connect_timeout() -> None:
    timeouts = TimeoutSettings(connect_s=0.3, read_s=60.0, request_s=600.0, health_interval_s=1.0)
    connection = Mock(spec=Connection)
    with full_listener() as port:
        started = time.monotonic()
        end = await relay(
            Backend(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/health"),
            path="/v1/completions",
            body=b"{}",
            headers=b"",
            splicer=Splicer(chat=False, include_usage=False),
            client=ClientStream(connection, write_timeout_s=1.0, on_gap=lambda _: None),
            timeouts=timeouts,
            mover=Mover(silence_s=timeouts.read_s),
        )
        waited = time.monotonic() - started
    assert end == Broken("timeout", "no connection within 0.3 s")
    assert 0.3 <= waited < 2.0
    assert connection.method_calls == []  # nothing reached the client: the caller tries another backend
