"""What ``--engine ray`` relies on, measured on real Ray Serve at deploy/kuberay's export interval, and the fake Ray
(``simulate.fakes.ray``) held to the same: the series the sidecar reads and their labels as Ray's metrics agent
serves them, vLLM's absent until the first request, how late the page shows a stream's end (the confirmation window
must cover it), a stream whose client went away leaving Serve's count at once, and what SIGTERM to the Ray
container's process does to open streams.

Each test runs on real Ray, then on the fake; on real Ray they share the module's node, in this order: the first
needs a node that never served, the last stops it."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from sidecar.engines import ENGINES, RAY_LAG_AT_1000_MS_S, read_engine, sum_samples
from simulate.fakes.processes import free_port, stream
from simulate.ray.server import STEP_S, RayNode
from tests.engines.test_sidecar_vllm import page

SERVE = ("ray_serve_replica_processing_queries", "ray_serve_num_ongoing_http_requests")
VLLM = ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_generation_tokens_total")
SERIES = ("ray_node_mem_total", *SERVE, *VLLM, "ray_vllm_generation_tokens")
# The page is read every 20 ms, and a read of Ray's 300 KB page takes about as long.
READ_S = 0.05


@dataclass(frozen=True)
class Node:
    kind: str
    http_port: int
    metrics_url: str
    url: str
    sigterm: Callable[
        [], Coroutine[Any, Any, int]
    ]  # the kubelet's SIGTERM to the Ray container; returns the exit status


@dataclass(frozen=True)
class FakeRayProcess:
    process: subprocess.Popen[bytes]
    http_port: int
    metrics_port: int

    @property
    def node(self) -> Node:
        url = f"http://127.0.0.1:{self.http_port}"
        return Node("fake", self.http_port, f"http://127.0.0.1:{self.metrics_port}", url, self._sigterm)

    async def _sigterm(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.process.wait, 30)


@pytest.fixture(scope="module")
def fake_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeRayProcess]:
    """``python -m simulate.fakes.ray`` with deploy/kuberay's export interval, as a process of its own."""
    http_port, metrics_port = free_port(), free_port()
    log = (tmp_path_factory.mktemp("fake-ray") / "ray.log").open("wb")
    args = ["-m", "simulate.fakes.ray", "--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    process = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        give_up = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, "the fake Ray exited"
                assert time.monotonic() < give_up, "the fake Ray did not serve its page within 20 s"
                time.sleep(0.05)
        yield FakeRayProcess(process, http_port, metrics_port)
    finally:
        process.kill()
        process.wait()
        log.close()


@pytest.fixture(params=["real", "fake"])
def node(request: pytest.FixtureRequest) -> Node:
    if request.param == "fake":
        fake: FakeRayProcess = request.getfixturevalue("fake_ray")
        return fake.node
    ray: RayNode = request.getfixturevalue("ray_node")
    return Node("real", ray.http_port, ray.metrics_url, ray.url, lambda: asyncio.to_thread(ray.terminate))


def shapes(text: str) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Each series of ``SERIES`` on the page: its HELP, its TYPE and its label names."""
    found = {}
    for name in SERIES:
        sample = re.search(rf"^{name}\{{(.*)\}} ", text, re.MULTILINE)
        if sample is None:
            continue
        help_line = re.search(rf"^# HELP {name} (.*)$", text, re.MULTILINE)
        type_line = re.search(rf"^# TYPE {name} (.*)$", text, re.MULTILINE)
        labels = tuple(sorted(re.findall(r'(\w+)="', sample.group(1))))
        found[name] = (help_line.group(1) if help_line else "", type_line.group(1) if type_line else "", labels)
    return found


async def test_the_fakes_page_has_reals_series_with_their_help_types_and_labels_before_and_after_a_request(
    ray_node: RayNode, fake_ray: FakeRayProcess
) -> None:
    urls = (ray_node.metrics_url, fake_ray.node.metrics_url)
    before = [shapes(await page(url)) for url in urls]
    # Before any request: the node's and the replica's series, neither the proxy's nor vLLM's.
    assert set(before[0]) == {"ray_node_mem_total", "ray_serve_replica_processing_queries"}
    await asyncio.gather(*(stream(port, max_tokens=4) for port in (ray_node.http_port, fake_ray.http_port)))
    await asyncio.sleep(RAY_LAG_AT_1000_MS_S + READ_S)
    after = [shapes(await page(url)) for url in urls]
    assert set(after[0]) == set(SERIES)
    # The node's own labels say head or worker: the fake is a worker, as Ray's worker pods are.
    for shown in (*before, *after):
        shown.pop("ray_node_mem_total")
    assert before[1] == before[0]
    assert after[1] == after[0]


async def test_serves_and_vllms_series_carry_the_names_and_labels_the_sidecar_and_dashboards_read(node: Node) -> None:
    await stream(node.http_port, max_tokens=4)
    await asyncio.sleep(RAY_LAG_AT_1000_MS_S + READ_S)
    text = await page(node.metrics_url)
    replica = sample_line(text, SERVE[0])
    for label in ('application="llm"', 'deployment="Llm"', "replica=", 'Component="core_worker"'):
        assert label in replica, replica
    for name in VLLM:
        line = sample_line(text, name)
        for label in ('model_name="tiny"', 'engine="0"', "ReplicaId="):
            assert label in line, line
    assert sum_samples(text, "ray_vllm_generation_tokens_total") == sum_samples(text, "ray_vllm_generation_tokens")
    assert read_engine(text, ENGINES["ray"]).in_flight == 0


def sample_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name + "{"))


async def readings(node: Node, done: asyncio.Event) -> list[tuple[float, int]]:
    """The in-flight count as the sidecar reads it, and when it was read (the read's end), until ``done``."""
    seen: list[tuple[float, int]] = []
    async with aiohttp.ClientSession() as session:
        while not done.is_set():
            async with session.get(f"{node.metrics_url}/metrics") as response:
                text = await response.text()
            seen.append((time.monotonic(), read_engine(text, ENGINES["ray"]).in_flight))
            await asyncio.sleep(0.02)
    return seen


async def test_the_page_shows_a_streams_end_within_the_confirmation_window(node: Node) -> None:
    # Twelve streams ending 0.37 s apart fall on every phase of Ray's 1 s export.
    seconds = [1.0 + 0.37 * i for i in range(12)]
    ends: dict[int, float] = {}
    done = asyncio.Event()

    async def one(index: int) -> None:
        await stream(node.http_port, max_tokens=round(seconds[index] / STEP_S))
        ends[index] = time.monotonic()

    watch = asyncio.create_task(readings(node, done))
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
    print(f"{node.kind}: the page showed each stream's end {min(lags)}-{max(lags)} s after it: {sorted(lags)}")
    assert max(lags) <= RAY_LAG_AT_1000_MS_S + READ_S, sorted(lags)
    # The export's period shows: some ends wait most of a second for the next export.
    assert max(lags) >= 0.6, sorted(lags)


async def test_a_stream_whose_client_left_leaves_serves_count(node: Node) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"max_tokens": round(30 / STEP_S), "stream": True}
        response = await session.post(f"{node.url}/v1/completions", json=body)
        await response.content.readline()
        await asyncio.sleep(RAY_LAG_AT_1000_MS_S + READ_S)
        assert read_engine(await page(node.metrics_url), ENGINES["ray"]).in_flight == 2
        response.close()
    left = time.monotonic()
    while read_engine(await page(node.metrics_url), ENGINES["ray"]).in_flight != 0:
        assert time.monotonic() - left < RAY_LAG_AT_1000_MS_S + READ_S, "Serve still counts the stream"
        await asyncio.sleep(0.02)


async def test_sigterm_to_the_ray_container_ends_its_open_streams_at_once(node: Node) -> None:
    # What the kubelet does after the preStop: the sidecar must have held it until no stream was left.
    streams = [asyncio.create_task(stream(node.http_port, max_tokens=round(s / STEP_S))) for s in (20, 30)]
    await asyncio.sleep(2)
    sent = time.monotonic()
    status: asyncio.Task[int] = asyncio.create_task(node.sigterm())
    ended = await asyncio.gather(*streams)
    cut_s = time.monotonic() - sent
    print(f"{node.kind}: SIGTERM ended {len(ended)} open streams {cut_s:.3f} s after it; exit {await status}")
    assert all(0 < len(pieces) < 2 / STEP_S + 10 and pieces[-1] != "[DONE]" for pieces in ended)
    assert cut_s < 0.5
    assert await status == 1
