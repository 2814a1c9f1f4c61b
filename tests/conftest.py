from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from agent.fakes.engine import EngineConfig, serve_engine
from agent.fakes.processes import free_port
from sidecar.engines import sum_samples


@asynccontextmanager
async def running_engine(config: EngineConfig) -> AsyncIterator[int]:
    """A fake vLLM on a free port, served in this loop until the block ends."""
    port = free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_engine(config, host="127.0.0.1", port=port, stop=stop))
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health"):
                        break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.01)
        yield port
    finally:
        stop.set()
        await task


async def scrape(url: str, name: str) -> float | None:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return sum_samples(await response.text(), name)


async def status_of(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()
