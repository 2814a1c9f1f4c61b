"""A real Prometheus on 127.0.0.1 scrapes a sidecar, its fake vLLM and the node agent in both modes: every query of
the dashboard and of the KEDA triggers returns data from start, as the README promises."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from agent.main import run
from agent.node_settings import from_arguments
from simulate.fakes.aws import REGION, MotoServer
from simulate.fakes.engine import EngineConfig
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, stop
from spotdrain.cli import build_parser
from tests.conftest import running_engine
from tests.deploy.test_prometheus import dashboard_queries, keda_queries
from tests.integration.test_sidecar import sidecar

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (Debian's prometheus package; .ci/run installs it)"
)


@asynccontextmanager
async def agent(kube: FakeKube, tmp_path: Path, name: str, *flags: str) -> AsyncIterator[int]:
    """The node agent in this loop, stopped by its own event (the sidecar here owns SIGTERM); yields its metrics
    port once it is ready."""
    port = free_port()
    argv = ["node", "--kubeconfig", str(kube.write_kubeconfig(tmp_path / f"{name}.kubeconfig")), "--host", "127.0.0.1"]
    argv += ["--metrics-port", str(port), "--notice-port", str(free_port()), *flags]
    stop = asyncio.Event()
    task = asyncio.create_task(run(from_arguments(build_parser().parse_args(argv)), stop=stop))
    try:
        yield port
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


@asynccontextmanager
async def prometheus(tmp_path: Path, targets: dict[int, dict[str, str]]) -> AsyncIterator[str]:
    """Prometheus scraping each port every second with its labels (as a PodMonitor adds namespace and pod)."""
    assert PROMETHEUS is not None
    statics = [{"targets": [f"127.0.0.1:{port}"], "labels": labels} for port, labels in targets.items()]
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [{"job_name": "t", "static_configs": statics}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    argv.append(f"--web.listen-address=127.0.0.1:{port}")
    with (tmp_path / "prometheus.log").open("w") as log:
        process = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=asyncio.subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await stop(process)


async def query(session: aiohttp.ClientSession, url: str, promql: str) -> list[Any]:
    try:
        async with session.get(f"{url}/api/v1/query", params={"query": promql}) as response:
            body = await response.json()
    except aiohttp.ClientError:
        return []
    assert body["status"] == "success", (promql, body)
    result: list[Any] = body["data"]["result"]
    return result


async def test_every_dashboard_and_keda_query_returns_data_from_start(
    tmp_path: Path, moto: MotoServer, queue: str, aws_credentials: None
) -> None:
    queue_flags = ("--queue-url", queue, "--aws-region", REGION, "--aws-endpoint-url", moto.endpoint_url)
    async with (
        FakeKube() as kube,
        serving(FakeImds()) as imds_url,
        running_engine(EngineConfig()) as engine,
        sidecar(tmp_path / "pod", engine) as car,
        agent(kube, tmp_path, "node", "--node-name", "gpu-1", "--imds-url", imds_url, "--no-model-cache") as node,
        agent(kube, tmp_path, "queue", *queue_flags, "--sqs-wait-time", "1") as queue_agent,
    ):
        kube.add_node("gpu-1")
        targets = {
            car.port: {"namespace": "inference", "pod": "vllm-0", "container": "spotdrain"},
            engine: {"namespace": "inference", "pod": "vllm-0", "container": "vllm"},
            node: {"namespace": "spotdrain", "pod": "spotdrain-node-a", "container": "agent"},
            queue_agent: {"namespace": "spotdrain", "pod": "spotdrain-queue-a", "container": "agent"},
        }
        async with prometheus(tmp_path, targets) as url, aiohttp.ClientSession() as session:
            scraped: list[Any] = []

            async def three_scrapes_each() -> bool:
                scraped[:] = await query(session, url, "count_over_time(up[1m]) >= 3 and up == 1")
                return len(scraped) == len(targets)

            async with asyncio.timeout(30):
                while not await three_scrapes_each():
                    await asyncio.sleep(0.5)
            empty = [q for q in [*dashboard_queries(), *keda_queries()] if not await query(session, url, q)]
    assert empty == []
