"""A client that stops reading mid-stream: the gateway ends that request within its write timeout, lets the backend
go, closes the client's connection and counts it, rather than holding either end or buffering without bound. A client
that reads slower than the backend writes, but reads, gets its whole stream."""

from __future__ import annotations

import asyncio
import json
import socket

from gateway.sse import SseParser
from simulate.fakes.engine import EngineConfig
from spotdrain.framing import Dechunker
from tests.conftest import scrape
from tests.gateway_harness import engines, gateway, metric, reference

MAX_TOKENS = 32_000  # about 6 MB of chunks: more than a send buffer that grows unbounded (4 MB) takes in


async def stalled_client(port: int, body: dict[str, object]) -> tuple[socket.socket, bytes]:
    """Send a streamed request and read the response's first bytes; the socket, which reads nothing more until told,
    and those bytes."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, so the stall shows soon
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    await loop.sock_sendall(sock, head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    first = await asyncio.wait_for(loop.sock_recv(sock, 1024), 10)
    assert first.startswith(b"HTTP/1.1 200"), first
    return sock, first


async def until_eof(sock: socket.socket) -> int:
    """Read what is left until the peer closes; the number of bytes."""
    loop = asyncio.get_running_loop()
    total = 0
    while chunk := await loop.sock_recv(sock, 1 << 16):
        total += len(chunk)
    return total


async def test_a_client_that_stops_reading_is_ended_counted_and_lets_its_backend_go() -> None:
    body = {"prompt": "once upon a time", "max_tokens": MAX_TOKENS, "stream": True}
    async with (
        engines(EngineConfig(tokens_per_s=20_000)) as [port],
        gateway(port, flags=("--read-timeout", "0.5")) as gw,
    ):
        sock, _ = await stalled_client(gw.port, body)
        try:
            async with asyncio.timeout(20):
                while await metric(gw, 'spotdrain_gateway_requests_total{outcome="abandoned"}') < 1:
                    await asyncio.sleep(0.05)
                # The gateway closes the client's connection: nothing of that stream is held for it any more.
                await until_eof(sock)
                engine = f"http://127.0.0.1:{port}/metrics"
                while await scrape(engine, "vllm:num_requests_running") != 0:
                    await asyncio.sleep(0.05)  # the engine sees its client (the gateway) gone
        finally:
            sock.close()
        assert await metric(gw, "spotdrain_gateway_open_streams") == 0
        assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="completed"}') == 0
        generated = await scrape(f"http://127.0.0.1:{port}/metrics", "vllm:generation_tokens_total")
    # What the backend made before the gateway let it go: what the buffers took in (the client's window, 16 KB
    # unsent in the kernel, 64 KB in the transport: a few hundred chunks), then the write timeout's worth (about
    # 900 in all here). A kernel send buffer left to grow to 4 MB takes some 11,000 chunks first.
    assert generated is not None
    assert generated < 5_000


async def test_a_client_that_reads_slower_than_its_backend_writes_gets_its_whole_stream() -> None:
    """The relay stops reading the backend each time the client's buffer is full and goes on once it has drained:
    many times over in one stream here, and the client gets every chunk once, in order."""
    body = {"prompt": "once upon a time", "max_tokens": 3_000, "stream": True}
    async with engines(EngineConfig(tokens_per_s=20_000)) as [port], gateway(port) as gw:
        sock, received = await stalled_client(gw.port, body)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(60):
                while not received.endswith(b"\r\n0\r\n\r\n"):  # the last chunk: the connection stays open
                    received += await loop.sock_recv(sock, 2048)
                    await asyncio.sleep(0.002)
        finally:
            sock.close()
        assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="completed"}') == 1
    _, _, framed = received.partition(b"\r\n\r\n")
    events = SseParser().feed(Dechunker().feed(framed))
    assert events.count(b"[DONE]") == 1
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    assert text == (await reference("/v1/completions", body)).text
