"""The least a Python proxy can do per chunk, measured beside the gateway in bench/gateway_peers.py as its floor.

``python -m bench.python_relay --port P --backend URL [--workers N]``: on the gateway's event loop, each client's
request is sent on to the backend on a connection of its own, and every read of the backend's answer is handed to
the client's transport as it came (its chunked framing included) from the protocol's callback: no coroutine per
chunk, nothing parsed, no flow control. What the gateway does beyond this (each chunk's SSE lines and JSON, for a
continuation) is what it costs above this floor. It takes ``POST`` with a ``Content-Length`` body, and
``GET /health``; ``--workers`` processes share the port (``SO_REUSEPORT``: the kernel spreads connections over them).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
from urllib.parse import urlsplit

from gateway.main import loop_factory

_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
_HOP = (b"connection", b"keep-alive", b"host")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _Backend(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport, request: bytes) -> None:
        self.client = client
        self.request = request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()  # the answer asked for Connection: close, so its end is the close


class _Client(asyncio.Protocol):
    def __init__(self, backend: tuple[str, int]) -> None:
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.data = b""
        self.connecting: asyncio.Task[object] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.data += data
        end = self.data.find(b"\r\n\r\n")
        if end < 0 or self.transport is None:
            return
        line, *fields = self.data[:end].split(b"\r\n")
        names = [f.split(b":", 1)[0].strip().lower() for f in fields]
        sizes = [int(f.split(b":", 1)[1]) for f, n in zip(fields, names, strict=True) if n == b"content-length"]
        length = sizes[0] if sizes else 0
        if len(self.data) < end + 4 + length:
            return
        if line.startswith(b"GET /health "):
            self.transport.write(_HEALTH)
            self.data = b""
            return
        kept = [f for f, n in zip(fields, names, strict=True) if n not in _HOP]
        host = f"{self.backend[0]}:{self.backend[1]}".encode()
        head = b"\r\n".join([line, b"Host: " + host, b"Connection: close", *kept])
        request = head + b"\r\n\r\n" + self.data[end + 4 : end + 4 + length]
        self.data = b""
        transport = self.transport
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(loop.create_connection(lambda: _Backend(transport, request), *self.backend))


async def _serve(port: int, backend: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(backend), "127.0.0.1", port, reuse_port=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    url = urlsplit(args.backend)
    backend = (url.hostname or "127.0.0.1", url.port or 80)
    for _ in range(args.workers - 1):
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no worker outlives the first
            break
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # the gateway's loop: uvloop where it is installed
        runner.run(_serve(args.port, backend))


if __name__ == "__main__":
    main()
