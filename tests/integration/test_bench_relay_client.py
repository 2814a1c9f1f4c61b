"""The gateway-peers benchmark's client counts a stream as exact only when every byte is the engine's: a proxy that
changes one byte, drops an event or repeats ``[DONE]`` is caught, and an exact stream passes.

The client and the benchmark backend run as processes of their own, as in the benchmark (importing ``bench`` here
would also configure logging for the whole test session)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from simulate.fakes.processes import free_port, start, wait_http
from tests.conftest import serving_app

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 5
Mangle = Callable[[list[bytes]], list[bytes]]


def engine_events() -> list[bytes]:
    """The events bench/sse_source.py writes for ``TOKENS`` tokens (their times fixed), and its ``[DONE]``."""
    code = (
        "import sys; from bench.sse_source import chunk; "
        f"sys.stdout.buffer.write(b''.join(chunk(i, last=i == {TOKENS - 1}, ids=False, written_ns=10**9 + i) "
        f"for i in range({TOKENS})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    return [event + b"\n\n" for event in out.split(b"\n\n") if event] + [b"data: [DONE]\n\n"]


def proxy_app(mangle: Mangle) -> web.Application:
    """A proxy that answers the engine's events through ``mangle``."""
    events = mangle(engine_events())

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        return response

    return answering(completions)


def answering(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    application = web.Application()
    application.router.add_post("/v1/completions", handler)
    return application


async def tally_of(port: int, **options: float) -> dict[str, Any]:
    spec = {
        "url": f"http://127.0.0.1:{port}/v1/completions",
        "count": 1,
        "body": {"max_tokens": TOKENS},
        "spread_s": 0,
        **options,
    }
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.relay_client", json.dumps(spec), cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(child.communicate(), 30)
    assert child.returncode == 0
    tally: dict[str, Any] = json.loads(out)
    return tally


async def test_an_untouched_stream_from_the_benchmark_backend_is_exact(tmp_path: Path) -> None:
    port = free_port()
    backend = await start(["-m", "bench.sse_source", "--port", str(port), "--interval", "0"], log_path=tmp_path / "b")
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", status=200)
        tally = await tally_of(port)
    finally:
        backend.kill()
        await backend.wait()
    assert (tally["streams"], tally["exact"], tally["faults"]) == (1, 1, [])
    assert len(tally["latencies_ms"]) == TOKENS


async def test_the_python_floor_relays_the_benchmark_backends_stream_exactly(tmp_path: Path) -> None:
    """bench/python_relay.py, the floor set beside the gateway: it must pass every byte as it came, or its CPU figure
    is not one of a relay."""
    port, relay_port = free_port(), free_port()
    backend = await start(["-m", "bench.sse_source", "--port", str(port), "--interval", "0"], log_path=tmp_path / "b")
    argv = ["-m", "bench.python_relay", "--port", str(relay_port), "--backend", f"http://127.0.0.1:{port}"]
    relay = await start([*argv, "--workers", "2"], log_path=tmp_path / "r")
    try:
        await wait_http(f"http://127.0.0.1:{relay_port}/health", status=200)
        tallies = [await tally_of(relay_port) for _ in range(3)]
    finally:
        for process in (relay, backend):
            process.kill()
            await process.wait()
    assert [(t["streams"], t["exact"], t["faults"]) for t in tallies] == [(1, 1, [])] * 3


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
    async with serving_app(proxy_app(mangle)) as port:
        tally = await tally_of(port)
    assert (tally["streams"], tally["exact"], len(tally["faults"])) == (1, 0, 1)


@pytest.mark.parametrize("status", [503, 200])
async def test_an_answer_that_is_not_a_stream_is_a_fault(status: int) -> None:
    """A refusal, or a whole body of a stated length (the client does not wait for the connection's end)."""

    async def whole(request: web.Request) -> web.Response:
        return web.Response(status=status, text="no backend" if status != 200 else '{"choices": []}')

    async with serving_app(answering(whole)) as port:
        tally = await asyncio.wait_for(tally_of(port), 20)
    assert (tally["streams"], tally["exact"]) == (1, 0)
    assert tally["faults"][0].startswith("HTTP/1.1 503" if status != 200 else 'event 0: b\'{"choices"')


@pytest.mark.parametrize("hang", [False, True], ids=["cut", "hung"])
async def test_a_stream_that_stops_mid_way_is_a_fault(hang: bool) -> None:
    """The connection closed after two events, or left open and silent (the read timeout, 1 s here, ends it)."""
    events = engine_events()

    async def stops(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events[:2]:
            await response.write(event)
        if hang:
            await asyncio.sleep(30)
        assert request.transport is not None
        request.transport.close()
        return response

    async with serving_app(answering(stops)) as port:
        tally = await asyncio.wait_for(tally_of(port, read_timeout_s=1), 20)
    assert (tally["streams"], tally["exact"], len(tally["latencies_ms"])) == (1, 0, 2)
    assert tally["faults"][0].startswith("no byte for 1 s" if hang else "connection ended")


@pytest.mark.parametrize("exact", [True, False])
async def test_an_answer_that_ends_with_its_connection_is_read_to_its_end(exact: bool) -> None:
    """No chunked framing: the events until the server closes (HTTP/1.0's way), the last without its blank line."""
    events = engine_events()
    if not exact:
        events = events[:-2] + events[-1:]
    body = b"".join(events)[:-1]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        for at in range(0, len(body), 7):  # reads cut anywhere
            writer.write(body[at : at + 7])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        tally = await tally_of(server.sockets[0].getsockname()[1])
    finally:
        server.close()
    assert (tally["streams"], tally["exact"]) == (1, int(exact))
