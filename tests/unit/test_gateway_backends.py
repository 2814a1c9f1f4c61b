from __future__ import annotations

import asyncio

from gateway.backends import Backend, Mover, Pool
from gateway.metrics import GatewayMetrics
from spotdrain.metrics import CollectorRegistry


def url(backend: Backend | None) -> str | None:
    return None if backend is None else backend.url


def pool(*urls: str) -> Pool:
    return Pool(urls, GatewayMetrics.create(CollectorRegistry()))


def test_the_ready_backend_with_fewest_open_streams_is_picked_and_ties_take_turns() -> None:
    backends = pool("http://a", "http://b", "http://c")
    a, b, c = backends.backends
    a.open_streams, b.open_streams, c.open_streams = 2, 1, 1
    assert [url(backends.pick()) for _ in range(4)] == ["http://b", "http://c", "http://b", "http://c"]


def test_a_backend_that_failed_the_request_is_avoided_unless_it_is_the_only_one_ready() -> None:
    backends = pool("http://a", "http://b")
    assert url(backends.pick(avoid={"http://a"})) == "http://b"
    backends.failed(backends.backends[1], "reset")  # one stream broke: maybe one pod behind a Service
    assert backends.backends[1].ready
    backends.failed(backends.backends[1], "timeout")  # silent: out of rotation
    assert url(backends.pick(avoid={"http://a"})) == "http://a"
    backends.failed(backends.backends[0], "server_error")  # the request failed, the backend is still there
    assert backends.backends[0].ready
    backends.failed(backends.backends[0], "unavailable")
    assert backends.pick() is None
    assert not backends.any_ready()
    backends.set_ready(backends.backends[1], True)
    assert url(backends.pick()) == "http://b"


async def test_relaying_waits_for_a_stream_and_returns_at_once_while_one_relays() -> None:
    backends = pool("http://a")
    waiting = asyncio.create_task(backends.relaying())
    await asyncio.sleep(0.01)
    assert not waiting.done(), "no stream relays: the stall watcher sleeps"
    with backends.hold(backends.backends[0], Mover()):
        await asyncio.wait_for(waiting, timeout=1)
        await asyncio.wait_for(backends.relaying(), timeout=1)  # one still relays
    after = asyncio.create_task(backends.relaying())
    await asyncio.sleep(0.01)
    assert not after.done(), "the stream ended: nothing to look at until the next"
    after.cancel()
