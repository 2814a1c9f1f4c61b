"""The gateway-peers benchmark's client counts a stream as exact only when every byte is the engine's: a proxy that
changes one byte, drops an event or repeats ``[DONE]`` is caught, and an exact stream passes."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from bench.relay_client import Tally, one_stream
from bench.sse_source import app, chunk
from tests.conftest import serving_app

Mangle = Callable[[list[bytes]], list[bytes]]


def proxy_app(mangle: Mangle, tokens: int) -> web.Application:
    """A backend that answers the events bench/sse_source.py would, through ``mangle``."""

    async def completions(request: web.Request) -> web.StreamResponse:
        events = [chunk(i, last=i == tokens - 1, ids=False) for i in range(tokens)] + [b"data: [DONE]\n\n"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in mangle(events):
            await response.write(event)
        return response

    application = web.Application()
    application.router.add_post("/v1/completions", completions)
    return application


async def tally_of(application: web.Application, tokens: int) -> Tally:
    tally = Tally()
    async with serving_app(application) as port, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/completions"
        await one_stream(session, url, {"prompt": "x", "max_tokens": tokens, "stream": True}, tally)
    return tally


async def test_an_untouched_stream_from_the_benchmark_backend_is_exact() -> None:
    tally = await tally_of(app(0.0), 5)
    assert (tally.streams, tally.exact, tally.faults) == (1, 1, [])
    assert len(tally.latencies_ms) == 5


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda events: [events[0].replace(b'"created":1', b'"created": 1'), *events[1:]], id="one-byte"),
        pytest.param(lambda events: events[:2] + events[3:], id="dropped-event"),
        pytest.param(lambda events: [*events, b"data: [DONE]\n\n"], id="two-dones"),
        pytest.param(lambda events: events[:-1], id="no-done"),
        pytest.param(lambda events: [events[0].replace(b"null", b'"x"', 1), *events[1:]], id="changed-field"),
    ],
)
async def test_a_stream_a_proxy_changed_is_not_exact(mangle: Mangle) -> None:
    tally = await tally_of(proxy_app(mangle, 5), 5)
    assert tally.streams == 1
    assert tally.exact == 0
    assert len(tally.faults) == 1
