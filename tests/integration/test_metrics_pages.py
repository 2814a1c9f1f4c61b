"""Every /metrics page the programs serve passes ``promtool check metrics`` (Prometheus' own linter), and each mode
serves exactly its own series: the SQS series in queue mode only, IMDS's in IMDS mode only, the model cache's only
where the agent prepares the cache itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from simulate.fakes.aws import REGION, MotoServer
from simulate.fakes.engine import EngineConfig
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, status_of
from tests.conftest import every_series, metric_sets, node_agent, running_engine
from tests.integration.test_sidecar import sidecar

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package; .ci/run installs it)"
)
FAMILY = re.compile(r"^# TYPE (\S+) ", re.M)


def promtool_problems(page: str) -> str:
    """What ``promtool check metrics`` says of the page: empty when it is clean."""
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True, timeout=30)
    return f"exit {done.returncode}: {done.stdout}{done.stderr}" if done.returncode or done.stdout else ""


def test_every_registry_the_code_builds_passes_promtool() -> None:
    known = {"AgentMetrics", "ImdsMetrics", "SqsMetrics", "CacheMetrics", "SidecarMetrics", "WebhookMetrics"}
    assert known <= {name.rpartition(".")[2] for name in metric_sets()}
    assert promtool_problems(generate_latest(every_series()).decode()) == ""


def test_promtool_finds_what_it_is_asked_to_find() -> None:
    assert "_total" in promtool_problems("# HELP x_seconds A.\n# TYPE x_seconds counter\nx_seconds 1\n")


async def test_the_sidecars_page_passes_promtool(tmp_path: Path) -> None:
    async with running_engine(EngineConfig()) as engine, sidecar(tmp_path, engine) as car:
        _, page = await status_of(car.url + "/metrics")
    assert families(page) >= {"spotdrain_sidecar_state", "spotdrain_sidecar_streams_cut"}
    assert promtool_problems(page) == ""


async def agent_page(kube: FakeKube, tmp_path: Path, *flags: str) -> str:
    metrics_port = free_port()
    async with node_agent(kube, tmp_path / "kubeconfig", *flags, "--metrics-port", str(metrics_port)):
        _, page = await status_of(f"http://127.0.0.1:{metrics_port}/metrics")
    return page


def families(page: str, prefix: str = "spotdrain_") -> set[str]:
    """The metric families on a page (the text format names a counter's family with its ``_total``, and adds a
    ``_created`` gauge beside it)."""
    names = {re.sub(r"_(total|created)$", "", name) for name in FAMILY.findall(page)}
    return {name for name in names if name.startswith(prefix)}


async def test_the_agents_page_in_imds_mode_has_imds_series_and_no_sqs_ones(tmp_path: Path) -> None:
    async with FakeKube() as kube, serving(FakeImds()) as url:
        kube.add_node("gpu-1")
        imds = ("--node-name", "gpu-1", "--imds-url", url)
        daemonset = await agent_page(kube, tmp_path, *imds, "--no-model-cache")
        own_cache = await agent_page(kube, tmp_path, *imds, "--model-cache-devices", str(tmp_path / "none"))
    for page in (daemonset, own_cache):
        assert promtool_problems(page) == ""
        assert families(page, "spotdrain_imds_") == {"spotdrain_imds_errors", "spotdrain_imds_polls"}
        assert families(page, "spotdrain_sqs_") == set()
    # The DaemonSet's agent leaves the cache to its init container: no gauge of it pretends to know.
    assert families(daemonset, "spotdrain_model_cache_") == set()
    assert families(own_cache, "spotdrain_model_cache_") == {
        "spotdrain_model_cache_ready",
        "spotdrain_model_cache_size_bytes",
        "spotdrain_model_cache_free_bytes",
    }


async def test_the_agents_page_in_queue_mode_has_sqs_series_and_no_imds_or_cache_ones(
    tmp_path: Path, moto: MotoServer, queue: str
) -> None:
    flags = ("--queue-url", queue, "--aws-region", REGION, "--aws-endpoint-url", moto.endpoint_url)
    async with FakeKube() as kube:
        page = await agent_page(kube, tmp_path, *flags, "--sqs-wait-time", "1")
    assert promtool_problems(page) == ""
    assert families(page, "spotdrain_sqs_") == {"spotdrain_sqs_messages", "spotdrain_sqs_errors"}
    assert families(page, "spotdrain_imds_") | families(page, "spotdrain_model_cache_") == set()
