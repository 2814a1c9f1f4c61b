"""The real ``spotdrain sidecar`` process beside a real vLLM: its gauges as the sidecar reads them, a drain held
through the preStop while real streams run, and real pooled connections that do not hold it."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest

from sidecar.engines import ENGINES, read_engine
from sidecar.sockdiag import dump
from simulate.fakes.processes import free_port, sidecar_args, start, status_of, wait_http
from simulate.vllm.server import MODEL_NAME, VllmServer
from tests.conftest import until


async def page(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        return await response.text()


async def in_flight(url: str) -> int:
    return read_engine(await page(url), ENGINES["vllm"]).in_flight


async def test_the_in_flight_gauges_are_on_vllms_page_with_the_names_and_labels_the_sidecar_reads(
    vllm_servers: list[VllmServer],
) -> None:
    text = await page(vllm_servers[0].url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert f'{name}{{engine="0",model_name="{MODEL_NAME}"}} ' in text
    reading = read_engine(text, ENGINES["vllm"])
    assert reading.in_flight == 0
    assert reading.tokens is not None


@dataclass
class Sidecar:
    port: int
    drain_dir: Path
    log: Path
    process: asyncio.subprocess.Process

    def events(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]


@asynccontextmanager
async def running_sidecar(engine_port: int, directory: Path, extra: list[str]) -> AsyncIterator[Sidecar]:
    """The real sidecar process beside an engine on ``engine_port``, once it says ready; killed at the end."""
    port = free_port()
    args = sidecar_args(port=port, engine_port=engine_port, drain_dir=directory / "drain", extra=extra)
    process = await start(args, log_path=directory / "sidecar.log")
    try:
        await wait_http(f"http://127.0.0.1:{port}/ready", status=200, timeout_s=20)
        yield Sidecar(port, directory / "drain", directory / "sidecar.log", process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.fixture
async def sidecar(vllm_servers: list[VllmServer], tmp_path: Path) -> AsyncIterator[Sidecar]:
    """A sidecar with its defaults for vLLM (poll interval, confirmation window) but a short endpoint delay."""
    async with running_sidecar(
        vllm_servers[0].port, tmp_path, ["--endpoint-delay", "0.3", "--drain-timeout", "60"]
    ) as car:
        yield car


async def aiohttp_stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> float:
    """One streamed completion to its end on the session's pool; returns when its [DONE] arrived."""
    body = {"model": MODEL_NAME, "prompt": "the stream", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert (await response.read()).rstrip().endswith(b"data: [DONE]")
    return time.monotonic()


async def httpx_stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    body = {"model": MODEL_NAME, "prompt": "a chunk", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert (await response.aread()).rstrip().endswith(b"data: [DONE]")
    return time.monotonic()


def ended(streams: list[asyncio.Task[float]]) -> list[str]:
    """How each stream that has ended did: an error, or its [DONE]."""
    done = [s for s in streams if s.done() and not s.cancelled()]
    return [repr(s.exception()) if s.exception() is not None else "[DONE]" for s in done]


def in_flight_now(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
        return read_engine(response.read().decode(), ENGINES["vllm"]).in_flight


async def test_the_preStop_holds_while_real_streams_run_and_returns_soon_after_the_last_despite_pooled_connections(
    vllm_servers: list[VllmServer], sidecar: Sidecar
) -> None:
    url = vllm_servers[0].url
    async with aiohttp.ClientSession() as pooled, httpx.AsyncClient(timeout=120) as other:
        # Leaves a connection in each pool, both warmed just before the streams (no idle gap for the server's
        # keep-alive timeout to close one under its pool).
        await asyncio.gather(aiohttp_stream(pooled, url, 4), httpx_stream(other, url, 4))
        streams = [
            # Long enough to outlast the look below at the tiny model's fastest (about 350 tokens/s alone here).
            asyncio.create_task(aiohttp_stream(pooled, url, 1500)),
            asyncio.create_task(aiohttp_stream(pooled, url, 1900)),
            asyncio.create_task(httpx_stream(other, url, 1700)),
        ]
        await until(lambda: bool(ended(streams)) or in_flight_now(url) == len(streams), timeout_s=30)
        assert not ended(streams), ended(streams)
        hook = await asyncio.create_subprocess_exec("/bin/sh", str(sidecar.drain_dir / "prestop"))
        asked = time.monotonic()
        while (await status_of(f"http://127.0.0.1:{sidecar.port}/ready"))[0] != 503:
            await asyncio.sleep(0.005)
        out_of_rotation_s = time.monotonic() - asked
        await asyncio.sleep(0.5)
        assert not ended(streams), f"the streams outlast this look: {ended(streams)}"
        assert hook.returncode is None, "the preStop holds the engine's SIGTERM while streams run"
        ends = await asyncio.gather(*streams)
        await asyncio.wait_for(hook.wait(), 10)
        returned = time.monotonic()
        assert await in_flight(url) == 0, "nothing is in flight when the engine would get its SIGTERM"
        assert len(dump(vllm_servers[0].port, timeout_s=1)) >= 2, "the pools kept their connections"
    print(f"out of rotation {out_of_rotation_s:.3f} s; preStop returned {returned - max(ends):.3f} s after [DONE]")
    assert out_of_rotation_s < 0.5
    assert returned - max(ends) < 1.5, f"the preStop returned {returned - max(ends):.2f} s after the last [DONE]"
    finished = [e for e in sidecar.events() if e["event"] == "drain.finished"]
    assert [e["outcome"] for e in finished] == ["drained"]
