"""The peers of ``bench.fleet``'s sidecars, each a process of its own so that only the sidecars' CPU is counted:

- ``python -m bench.fleet_peers pages 200``: every engine port, answered from prebuilt pages of a real fake-vLLM
  metrics page by a bare asyncio protocol, so that it takes a small part of the machine;
- ``python -m bench.fleet_peers board``: the agent's own notice board (its app), plus ``POST /_publish``, which only
  the benchmark has.

Each prints the ports it bound as one JSON line first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

from aiohttp import web

from agent.drain.board import NoticeBoard
from agent.notices.notice import Kind, Notice, Source
from simulate.fakes.processes import free_port
from spotdrain.clock import utcnow
from spotdrain.logs import configure_logging
from spotdrain.probes import serve

NODE = "gpu-fleet"
DRAINING_IN_FLIGHT = 3
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SENTINEL = b"1.23456789e+08"


def vllm_page(in_flight: int) -> list[bytes]:
    """A real fake-vLLM metrics page, split where the generated-tokens count goes (it moves on every reading, as
    it does while streams run, so no sidecar sees a stall)."""
    from prometheus_client.exposition import generate_latest

    from simulate.fakes.engine import EngineConfig
    from simulate.fakes.engine_metrics import VllmMetrics

    metrics = VllmMetrics(EngineConfig(model=MODEL))
    metrics.running.labels(model_name=MODEL, engine="0").set(in_flight)
    metrics.generation_tokens.labels(model_name=MODEL, engine="0").inc(123456789)
    return generate_latest(metrics.registry).split(SENTINEL)


def _answer(status: str, body: bytes, content_type: str = "text/plain; version=0.0.4; charset=utf-8") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    return head.encode() + b"\r\n" + body


class Pages:
    """What every engine port answers, switched from serving to draining at once."""

    def __init__(self) -> None:
        self.page = vllm_page(0)
        self.tokens = 0

    def answer(self, method: bytes, path: bytes) -> bytes:
        if path.startswith(b"/metrics"):
            self.tokens += 1
            return _answer("200 OK", str(self.tokens).encode().join(self.page))
        if method == b"POST" and path == b"/_drain":
            self.page = vllm_page(DRAINING_IN_FLIGHT)
        return _answer("200 OK", b"ok\n")


class PageProtocol(asyncio.Protocol):
    """One connection: read a request's head, answer it, and reset the connection once the client has closed its end.

    The reset keeps the closed connection out of TIME_WAIT at both ends. In a cluster each pod reads only its own
    namespace's sockets; here all 200 sidecars share one, and without it the table every draining sidecar reads
    through grows to some 10,000 rows, which measures the kernel's /proc/net/tcp rather than the sidecars.
    """

    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if b"\r\n\r\n" not in self.buffer or self.transport is None:
            return
        method, path, *_ = self.buffer.split(b" ", 2)
        self.buffer = b""
        self.transport.write(self.pages.answer(method, path))

    def eof_received(self) -> bool:
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
        return False


async def serve_pages(engines: int) -> None:
    """Serves ``engines`` engine pages, each on a port of its own, until killed.

    Prints the ports first, as one JSON line: ``{"engines": [port, ...]}``.
    """
    pages = Pages()
    loop = asyncio.get_running_loop()
    ports = []
    for _ in range(engines):
        server = await loop.create_server(lambda: PageProtocol(pages), "127.0.0.1", 0)
        ports.append(server.sockets[0].getsockname()[1])
    print(json.dumps({"engines": ports}), flush=True)
    await asyncio.Event().wait()


async def serve_board() -> None:
    """Serves the agent's notice board for ``NODE`` until killed, as the agent serves it, plus ``POST /_publish``:
    it publishes a Spot notice and answers the wall-clock time it did (``{"published": <epoch seconds>}``).

    Prints its port first, as one JSON line: ``{"notice": port}``.
    """
    configure_logging(json=True, level="warning")  # nothing on stdout after the port: no one reads it
    board = NoticeBoard(local_node=NODE)
    app = board.app()

    async def publish(_: web.Request) -> web.Response:
        deadline = utcnow().replace(microsecond=0) + timedelta(seconds=120)
        board.publish(NODE, Notice(Kind.SPOT_INTERRUPTION, "i-0f1ee7f1ee7f1ee70", deadline, Source.IMDS))
        return web.json_response({"published": time.time()})

    app.router.add_post("/_publish", publish)
    port = free_port()
    print(json.dumps({"notice": port}), flush=True)
    await serve(app, host="127.0.0.1", port=port, name="notices")


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["board"]:
        asyncio.run(serve_board())
        return
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_peers pages")
    parser.add_argument("what", choices=["pages"])
    parser.add_argument("engines", type=int)
    asyncio.run(serve_pages(parser.parse_args(argv).engines))


if __name__ == "__main__":
    main(sys.argv[1:])
