"""The stall probe's verdict on real sockets: a backend that takes the connection is not refusing, even where the
gateway's loop was held up past the probe's timeout; one that refuses, drops the SYN or has no name is."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress

import pytest

from gateway.main import loop_factory
from gateway.stalls import refuses_connections
from tests.integration.test_gateway_relay_connect import fill_queue, full_listener


async def test_a_listener_that_takes_the_connection_is_not_refusing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        assert not await refuses_connections(url, timeout_s=1.0)


@pytest.mark.parametrize("factory", [asyncio.new_event_loop, loop_factory()], ids=["asyncio", "gateway's loop"])
def test_a_loop_held_up_past_the_timeout_does_not_make_a_listener_refusing(
    factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> None:
    if factory is None:
        pytest.skip("uvloop is not installed: the gateway's loop is asyncio's, tested beside")
    with asyncio.Runner(loop_factory=factory) as runner:
        assert not runner.run(_held_up_probe())


async def _held_up_probe() -> bool:
    """The probe's verdict on a listener that takes its connection while the loop is held up past its timeout."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server, ExitStack() as fillers:
        port = server.getsockname()[1]
        fill_queue(server, fillers)  # the probe's first SYN is dropped
        waiting = _syns_sent(port)
        probe = asyncio.create_task(refuses_connections(f"http://127.0.0.1:{port}", timeout_s=1.5))
        deadline = time.monotonic() + 10.0
        while _syns_sent(port) == waiting:  # until its SYN is out
            assert time.monotonic() < deadline
            assert not probe.done()
            await asyncio.sleep(0.005)
        accepting = threading.Thread(target=_accept_for, args=(server, 3.0))
        accepting.start()
        # The worker busy while the queue empties and the SYN's retransmission (1 s after the first) connects: the
        # loop sees the finished connect and the timeout's timer in one turn, and runs the timer last.
        time.sleep(3.0)  # noqa: ASYNC251 (the point: the loop held up)
        try:
            return await probe
        finally:
            accepting.join()


def _syns_sent(port: int) -> int:
    """How many connections to ``port`` on 127.0.0.1 wait for the listener's SYN-ACK."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(row[2] == f"0100007F:{port:04X}" and row[3] == "02" for row in rows)  # 02: SYN_SENT


def _accept_for(server: socket.socket, seconds: float) -> None:
    server.settimeout(0.05)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with suppress(TimeoutError):
            server.accept()[0].close()


async def test_a_closed_port_is_refusing_at_once() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, not listening: the kernel answers RST
        started = time.monotonic()
        assert await refuses_connections(f"http://127.0.0.1:{port}", timeout_s=5.0)
    assert time.monotonic() - started < 1.0


async def test_a_listener_whose_queue_is_full_is_refusing_after_the_timeout() -> None:
    with full_listener() as port:
        started = time.monotonic()
        assert await refuses_connections(f"http://127.0.0.1:{port}", timeout_s=0.3)
        waited = time.monotonic() - started
    assert 0.3 <= waited < 2.0


async def test_a_loop_held_up_past_the_timeout_still_finds_a_full_queue_refusing() -> None:
    with full_listener() as port:
        probe = asyncio.create_task(refuses_connections(f"http://127.0.0.1:{port}", timeout_s=0.2))
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # noqa: ASYNC251 (the loop held up)
        assert await probe


async def test_a_name_that_does_not_resolve_is_refusing() -> None:
    assert await refuses_connections("http://backend.invalid:8000", timeout_s=5.0)


async def test_a_loop_held_up_while_a_name_resolves_does_not_make_a_listener_refusing() -> None:
    """The name resolves in a thread, whose answer waits for the loop: the timeout comes first, and says nothing."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        probe = asyncio.create_task(refuses_connections(f"http://localhost:{port}", timeout_s=0.3))
        await asyncio.sleep(0)  # the probe has asked the resolver
        time.sleep(1.0)  # noqa: ASYNC251 (the point: the loop held up)
        assert not await probe


async def test_an_ip_address_is_probed_without_the_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    async def hung(*_: object, **__: object) -> object:
        await asyncio.sleep(60)
        raise AssertionError("resolved")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", hung)
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert not await refuses_connections(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=1.0)
