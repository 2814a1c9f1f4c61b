"""``spotdrain gateway`` in the test's own loop, in front of fake engines, and the references it is compared with."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from simulate.fakes.engine import EngineConfig, serve_engine
from simulate.fakes.processes import free_port, wait_http
from simulate.fakes.sse_client import Streamed, read_stream
from tests.conftest import running_engine, serving_app


@dataclass(frozen=True)
class Running:
    port: int
    metrics_port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@asynccontextmanager
async def gateway(*backend_ports: int, flags: tuple[str, ...] = ()) -> AsyncIterator[Running]:
    """The gateway on loopback ports in front of ``backend_ports``; leaving the block stops it with SIGTERM."""
    from gateway.main import run
    from gateway.settings import from_arguments
    from spotdrain.cli import build_parser

    running = Running(free_port(), free_port())
    argv = ["gateway", "--host", "127.0.0.1", "--port", str(running.port), "--metrics-port", str(running.metrics_port)]
    for port in backend_ports:
        argv += ["--backend", f"http://127.0.0.1:{port}"]
    argv += ["--health-interval", "0.2", *flags]
    ready = asyncio.Event()
    task = asyncio.create_task(run(from_arguments(build_parser().parse_args(argv)), ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield running
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(task, 15) == 0


FAST_TOKENS_PER_S = 400.0


@asynccontextmanager
async def engines(*configs: EngineConfig) -> AsyncIterator[list[int]]:
    """Fake engines in this loop, one per config; yields their ports."""
    async with _engines(list(configs)) as ports:
        yield ports


@asynccontextmanager
async def _engines(configs: list[EngineConfig]) -> AsyncIterator[list[int]]:
    if not configs:
        yield []
        return
    async with running_engine(configs[0]) as port, _engines(configs[1:]) as rest:
        yield [port, *rest]


@asynccontextmanager
async def running_engine_on(port: int) -> AsyncIterator[None]:
    """A fake engine on a given port, as a backend restarted where it was."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve_engine(EngineConfig(tokens_per_s=2000), host="127.0.0.1", port=port, stop=stop))
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", status=200)
        yield
    finally:
        stop.set()
        await task


async def reference(path: str, body: dict[str, Any], *, merge_steps: int = 1) -> Streamed:
    """The uninterrupted stream: the same request straight to a healthy engine (tokens depend only on context)."""
    config = EngineConfig(tokens_per_s=2000, merge_steps=merge_steps)
    async with running_engine(config) as port, aiohttp.ClientSession() as session:
        return await read_stream(f"http://127.0.0.1:{port}{path}", body, session=session)


async def metric(running: Running, sample: str) -> float:
    """The value of one sample line (``name{labels}``) on the gateway's /metrics."""
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        page = await response.text()
    for line in page.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise KeyError(sample)


@asynccontextmanager
async def readiness(count: int) -> AsyncIterator[tuple[list[bool], list[str]]]:
    """Ready URLs the test turns on and off, standing for the backends' sidecars."""
    ready = [True] * count

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=200 if ready[int(request.match_info["index"])] else 503)

    app = web.Application()
    app.router.add_get("/ready/{index}", answer)
    async with serving_app(app) as port:
        yield ready, [f"http://127.0.0.1:{port}/ready/{index}" for index in range(count)]
