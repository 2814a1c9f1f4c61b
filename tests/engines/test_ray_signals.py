"""What ``--engine ray`` relies on, measured on real Ray Serve at deploy/kuberay's export interval: the series it reads
and their labels as Ray's metrics agent serves them, how late the page shows a stream's end (the confirmation
window must cover it), and a stream whose client went away leaving Serve's count at once."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from sidecar.engines import ENGINES, RAY_LAG_AT_1000_MS_S, read_engine, sum_samples
from simulate.fakes.processes import stream
from simulate.ray.server import STEP_S, RayNode
from tests.engines.test_sidecar_vllm import page

SERVE = ("ray_serve_replica_processing_queries", "ray_serve_num_ongoing_http_requests")
VLLM = ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_generation_tokens_total")
# The page is read every 20 ms, and a read of Ray's 300 KB page takes about as long.
READ_S = 0.05


def sample_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name + "{"))


async def test_serves_and_vllms_series_carry_the_names_and_labels_the_sidecar_and_dashboards_read(
    ray_node: RayNode,
) -> None:
    await stream(ray_node.http_port, max_tokens=4)
    await asyncio.sleep(RAY_LAG_AT_1000_MS_S + READ_S)
    text = await page(ray_node.metrics_url)
    replica = sample_line(text, SERVE[0])
    for label in ('application="llm"', 'deployment="Llm"', "replica=", 'Component="core_worker"'):
        assert label in replica, replica
    for name in VLLM:
        line = sample_line(text, name)
        for label in ('model_name="tiny"', 'engine="0"', "ReplicaId="):
            assert label in line, line
    assert sum_samples(text, "ray_vllm_generation_tokens_total") == sum_samples(text, "ray_vllm_generation_tokens")
    assert read_engine(text, ENGINES["ray"]).in_flight == 0


async def readings(node: RayNode, done: asyncio.Event) -> list[tuple[float, int]]:
    """The in-flight count as the sidecar reads it, and when it was read (the read's end), until ``done``."""
    seen: list[tuple[float, int]] = []
    async with aiohttp.ClientSession() as session:
        while not done.is_set():
            async with session.get(f"{node.metrics_url}/metrics") as response:
                text = await response.text()
            seen.append((time.monotonic(), read_engine(text, ENGINES["ray"]).in_flight))
            await asyncio.sleep(0.02)
    return seen


async def test_the_page_shows_a_streams_end_within_the_confirmation_window(ray_node: RayNode) -> None:
    # Twelve streams ending 0.37 s apart fall on every phase of Ray's 1 s export.
    seconds = [1.0 + 0.37 * i for i in range(12)]
    ends: dict[int, float] = {}
    done = asyncio.Event()

    async def one(index: int) -> None:
        await stream(ray_node.http_port, max_tokens=round(seconds[index] / STEP_S))
        ends[index] = time.monotonic()

    watch = asyncio.create_task(readings(ray_node, done))
    await asyncio.gather(*(one(i) for i in range(len(seconds))))
    await asyncio.sleep(RAY_LAG_AT_1000_MS_S + 0.5)
    done.set()
    seen = await watch
    # Each stream counts twice: in the proxy and in the replica. A stream's end shows once the count falls to what
    # the streams still running make.
    lags = []
    for left, end in enumerate(sorted(ends.values(), reverse=True)):
        shown = next(at for at, count in seen if at >= end and count <= 2 * left)
        lags.append(round(shown - end, 2))
    print(f"the page showed each stream's end {min(lags)}-{max(lags)} s after it: {sorted(lags)}")
    assert max(lags) <= RAY_LAG_AT_1000_MS_S + READ_S


async def test_a_stream_whose_client_left_leaves_serves_count(ray_node: RayNode) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"max_tokens": round(30 / STEP_S), "stream": True}
        response = await session.post(f"{ray_node.url}/v1/completions", json=body)
        await response.content.readline()
        await asyncio.sleep(RAY_LAG_AT_1000_MS_S + READ_S)
        assert read_engine(await page(ray_node.metrics_url), ENGINES["ray"]).in_flight == 2
        response.close()
    left = time.monotonic()
    while read_engine(await page(ray_node.metrics_url), ENGINES["ray"]).in_flight != 0:
        assert time.monotonic() - left < RAY_LAG_AT_1000_MS_S + READ_S, "Serve still counts the stream"
        await asyncio.sleep(0.02)
