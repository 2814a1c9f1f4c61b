"""The gateway and two fake engines as real processes: one engine is killed, or drops its connections, mid-stream."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from simulate.fakes.processes import engine_args, free_port, start, status_of, wait_http
from simulate.fakes.sse_client import Streamed, read_stream

pytestmark = pytest.mark.e2e

STREAMS = 50
TOKENS = 150
TOKENS_PER_S = "100"


@dataclass
class Setup:
    engines: list[asyncio.subprocess.Process]
    engine_ports: list[int]
    gateway: asyncio.subprocess.Process
    port: int
    metrics_port: int


def gateway_args(port: int, metrics_port: int, backends: list[int]) -> list[str]:
    args = ["-m", "spotdrain.cli", "--log-format", "json", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--metrics-port", str(metrics_port), "--health-interval", "0.2", "--read-timeout", "5"]
    for backend in backends:
        args += ["--backend", f"http://127.0.0.1:{backend}"]
    return args


@pytest.fixture
async def processes(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    first_flags: tuple[str, ...] = getattr(request, "param", ())
    ports = [free_port(), free_port()]
    engines = [
        await start(
            engine_args(port, "--tokens-per-second", TOKENS_PER_S, *(first_flags if index == 0 else ())),
            log_path=tmp_path / f"engine-{index}.log",
        )
        for index, port in enumerate(ports)
    ]
    port, metrics_port = free_port(), free_port()
    gateway = await start(gateway_args(port, metrics_port, ports), log_path=tmp_path / "gateway.log")
    try:
        for engine_port in ports:
            await wait_http(f"http://127.0.0.1:{engine_port}/health", status=200)
        # A parent and a worker per CPU start here: on a loaded machine that takes more than a few seconds.
        await wait_http(f"http://127.0.0.1:{port}/health", status=200, timeout_s=30)
        yield Setup(engines, ports, gateway, port, metrics_port)
    finally:
        for process in (gateway, *engines):
            if process.returncode is None:
                process.kill()
                await process.wait()


def requests() -> list[tuple[str, dict[str, Any]]]:
    """Different prompts, half completions and half chat, some asking for usage."""
    out: list[tuple[str, dict[str, Any]]] = []
    for index in range(STREAMS):
        usage = {"stream_options": {"include_usage": True}} if index % 3 == 0 else {}
        if index % 2:
            body = {"messages": [{"role": "user", "content": f"question {index}"}], "max_tokens": TOKENS}
            out.append(("/v1/chat/completions", {**body, **usage}))
        else:
            out.append(("/v1/completions", {"prompt": f"prompt {index}", "max_tokens": TOKENS, **usage}))
    return out


async def run_all(base: str, calls: list[tuple[str, dict[str, Any]]]) -> list[Streamed]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(read_stream(base + path, body, session=session) for path, body in calls))


async def metric(setup: Setup, sample: str) -> float:
    _, page = await status_of(f"http://127.0.0.1:{setup.metrics_port}/metrics")
    return next(float(line.split()[-1]) for line in page.splitlines() if line.startswith(sample + " "))


async def open_streams_reach(setup: Setup, count: int) -> None:
    async with asyncio.timeout(20):
        while await metric(setup, "spotdrain_gateway_open_streams") < count:
            await asyncio.sleep(0.05)


def assert_same_streams(got: list[Streamed], want: list[Streamed]) -> None:
    for index, (mine, reference) in enumerate(zip(got, want, strict=True)):
        assert mine.text == reference.text, index
        assert (mine.done, mine.cut, mine.errors) == (1, False, []), index
        assert mine.finish_reasons == ["length"], index
        assert mine.usage == reference.usage, index
        assert len({c["id"] for c in mine.chunks}) == 1, index


# SIGKILL: the process vanishes; SIGTERM: the engine aborts its in-flight requests and closes, as vLLM does without
# --shutdown-timeout.
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_fifty_streams_survive_one_engine_killed_mid_stream(processes: Setup, sig: signal.Signals) -> None:
    calls = requests()
    survivor = f"http://127.0.0.1:{processes.engine_ports[1]}"
    want = await run_all(survivor, calls)  # uninterrupted, straight from an engine
    running = asyncio.create_task(run_all(f"http://127.0.0.1:{processes.port}", calls))
    await open_streams_reach(processes, STREAMS)
    await asyncio.sleep(0.3)  # tokens are flowing on both engines
    processes.engines[0].send_signal(sig)
    got = await running
    assert_same_streams(got, want)
    continued = await metric(processes, 'spotdrain_gateway_requests_total{outcome="continued"}')
    completed = await metric(processes, 'spotdrain_gateway_requests_total{outcome="completed"}')
    assert continued >= 10  # about half the streams were on the killed engine
    assert continued + completed == STREAMS

    processes.gateway.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(processes.gateway.wait(), 10) == 0


@pytest.mark.parametrize("processes", [("--fault", "drop", "--fault-after", "40")], indirect=True)
async def test_fifty_streams_survive_an_engine_dropping_their_tcp_connections(processes: Setup) -> None:
    calls = requests()
    want = await run_all(f"http://127.0.0.1:{processes.engine_ports[1]}", calls)
    got = await run_all(f"http://127.0.0.1:{processes.port}", calls)
    assert_same_streams(got, want)
    assert await metric(processes, 'spotdrain_gateway_continuations_total{cause="reset"}') >= 10
    assert await metric(processes, 'spotdrain_gateway_requests_total{outcome="cut"}') == 0
