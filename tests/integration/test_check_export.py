"""The node agent runs the installation checks on a timer (``--check-interval``) and exports what they find, so an
alert fires on an install that drifts: a budget written without AlwaysAllow shows up on the agent's page, and goes
again once fixed."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import structlog

from check.access import load
from check.export import CheckMetrics, counts, record, run_result
from check.findings import Finding, Report
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, status_of
from spotdrain.metrics import CollectorRegistry, exposition
from tests.conftest import node_agent
from tests.integration.check_cluster import Builder, clean_install

STRICT = {"minAvailable": 1, "selector": {"matchLabels": {"app": "vllm"}}}


def value(page: str, series: str) -> float | None:
    found = re.search(rf"^{re.escape(series)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else None


async def _wait_for(page: Callable[[], Awaitable[str]], series: str, wanted: Callable[[float], bool]) -> None:
    """Scrape until the series has a wanted value; TimeoutError after 10 s."""
    async with asyncio.timeout(10):
        while (found := value(await page(), series)) is None or not wanted(found):
            await asyncio.sleep(0.1)


async def test_the_agent_exports_a_budget_that_blocks_evictions_and_its_fix(tmp_path: Path) -> None:
    budgets = 'spotdrain_check_findings{check="budgets",severity="error"}'
    async with FakeKube() as kube, aiohttp.ClientSession() as session, serving(FakeImds()) as imds:
        build = Builder(session, await load(str(kube.write_kubeconfig(tmp_path / "admin"))))
        await clean_install(build)
        metrics_port = free_port()
        pages: list[str] = []

        async def page() -> str:
            _, text = await status_of(f"http://127.0.0.1:{metrics_port}/metrics")
            pages.append(text)
            return text

        flags = ("--node-name", "gpu-1", "--imds-url", imds, "--no-model-cache", "--check-interval", "0.2")
        with structlog.testing.capture_logs() as logs:
            async with node_agent(kube, tmp_path / "kubeconfig", *flags, "--metrics-port", str(metrics_port)):
                await _wait_for(page, 'spotdrain_check_runs_total{result="clean"}', lambda v: v >= 1)
                assert value(pages[-1], budgets) == 0
                await build.create("PodDisruptionBudget", "vllm-strict", namespace="inference", spec=STRICT)
                await _wait_for(page, budgets, lambda v: v == 1)
                await build.patch(
                    "PodDisruptionBudget",
                    "vllm-strict",
                    {"spec": {"unhealthyPodEvictionPolicy": "AlwaysAllow"}},
                    namespace="inference",
                )
                await _wait_for(page, budgets, lambda v: v == 0)
    found = [e for e in logs if e["event"] == "check.finding"]
    assert [(e["check"], e["severity"], e["objects"]) for e in found] == [
        ("budgets", "error", ["PodDisruptionBudget/inference/vllm-strict"])
    ]
    assert [e["check"] for e in logs if e["event"] == "check.resolved"] == ["budgets"]


def test_an_unreadable_cluster_is_one_access_error_and_every_series_is_there_from_start() -> None:
    registry = CollectorRegistry()
    metrics = CheckMetrics.create(registry)
    page = exposition(registry).decode()
    assert value(page, 'spotdrain_check_findings{check="webhook",severity="warning"}') == 0
    assert value(page, 'spotdrain_check_runs_total{result="unreadable"}') == 0
    unreadable = Report((), unreachable="HTTP 0: refused")
    assert counts(unreadable) == {("access", "error"): 1}
    assert run_result(unreadable) == "unreadable"
    record(metrics, unreadable)
    warned = Report((Finding("warning", "model-cache", "preparing"), Finding("ok", "agent", "fine")))
    record(metrics, warned)
    page = exposition(registry).decode()
    assert value(page, 'spotdrain_check_findings{check="access",severity="error"}') == 0  # the last run's only
    assert value(page, 'spotdrain_check_findings{check="model-cache",severity="warning"}') == 1
    assert value(page, 'spotdrain_check_runs_total{result="findings"}') == 1
