"""``spotdrain check --node NAME`` against a running node agent, reached through the (fake) API server's pod proxy:
what the agent sees (its IMDS polls, its notice, the sidecars that ask it), the pods a notice would evict, and what
it says when the agent, the proxy or a permission is missing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from check.access import load
from check.findings import Finding
from check.node import NodeReport, as_json, as_text, read_node
from check.reading import Reader
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port
from spotdrain.clock import utcnow
from spotdrain.kube_rest import Access
from tests.conftest import node_agent
from tests.deploy.manifests import grants, have_kubectl, needed, render
from tests.integration.check_cluster import Builder, clean_install, engine, sidecar


async def node_report(access: Access, name: str = "gpu-1") -> NodeReport:
    async with aiohttp.ClientSession() as session:
        return await read_node(Reader(session, access, timeout_s=5), name, agent_namespace="spotdrain", now=utcnow())


async def ask_for_notices(notice_port: int, *, source: str) -> None:
    """What a sidecar does at start: ask its node's agent for the notice, from its pod's address."""
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"http://127.0.0.1:{notice_port}/v1/notice") as answer,
    ):
        assert answer.status == 204


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, Access, Builder]]:
    async with FakeKube() as kube, aiohttp.ClientSession() as session:
        access = await load(str(kube.write_kubeconfig(tmp_path / "admin")))
        yield kube, access, Builder(session, access)


async def test_the_node_report_shows_what_the_agent_sees_and_the_sidecar_that_does_not_ask(
    cluster: tuple[FakeKube, Access, Builder], tmp_path: Path
) -> None:
    kube, access, build = cluster
    metrics_port = free_port()
    await clean_install(build, agent_port=metrics_port)
    await build.pod(
        "inference", "vllm-silent", node="gpu-1", containers=[engine(), sidecar()], grace_s=130, pod_ip="127.0.0.9"
    )
    async with serving(FakeImds()) as imds:
        flags = ("--node-name", "gpu-1", "--imds-url", imds, "--no-model-cache", "--metrics-port", str(metrics_port))
        async with node_agent(kube, tmp_path / "kubeconfig", *flags) as notice_port:
            await ask_for_notices(notice_port, source="127.0.0.2")  # vllm-0's sidecar
            await asyncio.sleep(1.2)  # an IMDS poll
            report = await node_report(access)
    by_check: dict[str, list[Finding]] = {}
    for finding in report.findings:
        by_check.setdefault(finding.check, []).append(finding)
    assert [f.severity for f in report.findings if f.severity != "ok"] == ["error"]
    assert by_check["agent"][0].message == "the node agent is ready, in imds mode, and evicts the node's pods"
    assert by_check["notice-sources"][0].message.startswith("IMDS answers for i-")
    assert by_check["notice"][0].message == "no interruption notice for gpu-1"
    answering, silent = by_check["sidecars"]
    assert answering.message == "1 sidecars ask the agent for notices: Pod/inference/vllm-0"
    assert silent.objects == ("Pod/inference/vllm-silent",)
    assert "has not asked the agent for a notice in 120 s" in silent.message
    drain = by_check["drain"][0].message
    assert drain.startswith("on a Spot notice now, the agent would evict 2 pods: ")
    assert "inference/vllm-0 (115 s)" in drain
    assert "inference/vllm-silent (115 s)" in drain
    assert "spotdrain-node" not in drain  # the agent's own pod is never evicted
    assert report.exit_code == 1
    assert as_text(report).startswith("node gpu-1\n  ✓ the node agent is ready")
    assert '"last_poll": "' in as_json(report)


async def test_an_agent_that_does_not_answer_is_named_with_its_logs(cluster: tuple[FakeKube, Access, Builder]) -> None:
    _, access, build = cluster
    await clean_install(build, agent_port=free_port())  # nothing listens there
    report = await node_report(access)
    [finding] = report.findings
    assert finding.message.startswith("the node agent on gpu-1 does not answer through the API server: HTTP 503")
    assert "error trying to reach service" in finding.message
    assert finding.fix == "kubectl -n spotdrain logs spotdrain-node-gpu-1 -c agent"
    assert report.exit_code == 1


async def test_a_node_without_an_agent_and_a_node_that_does_not_exist(
    cluster: tuple[FakeKube, Access, Builder],
) -> None:
    _, access, build = cluster
    await clean_install(build)
    assert [f.message for f in (await node_report(access, "cpu-1")).findings] == ["no node agent pod on cpu-1"]
    assert [f.message for f in (await node_report(access, "gpu-9")).findings] == ["no node gpu-9 in the cluster"]


async def test_without_the_proxy_permission_the_report_names_it_and_exits_2(
    cluster: tuple[FakeKube, Access, Builder], tmp_path: Path
) -> None:
    kube, _, build = cluster
    await clean_install(build)
    token = kube.issue_token("system:serviceaccount:spotdrain:spotdrain-check", denied=[("get", "pods/proxy")])
    config = kube.write_kubeconfig(tmp_path / "limited")
    config.write_text(config.read_text().replace(kube.token, token))
    report = await node_report(await load(str(config)))
    [finding] = report.findings
    assert finding.message.startswith("cannot get pods/proxy at namespace spotdrain")
    assert report.exit_code == 2


async def test_the_node_check_makes_only_the_calls_deploy_check_grants(
    cluster: tuple[FakeKube, Access, Builder], tmp_path: Path
) -> None:
    kube, access, build = cluster
    if not have_kubectl():
        pytest.skip("kubectl renders the kustomization")
    metrics_port = free_port()
    await clean_install(build, agent_port=metrics_port)
    async with serving(FakeImds()) as imds:
        flags = ("--node-name", "gpu-1", "--imds-url", imds, "--no-model-cache", "--metrics-port", str(metrics_port))
        async with node_agent(kube, tmp_path / "kubeconfig", *flags):
            kube.calls.clear()
            await node_report(access)
    # The agent itself only reads its own node in this window (GET /nodes/{name}): the rest are the check's.
    calls = [c for c in kube.calls if c.pattern != "/api/v1/nodes/{name}"]
    granted = grants(render("deploy/check"), "spotdrain", "spotdrain-check")
    assert needed(calls, granted) == {
        ("", "nodes", "list", None),
        ("", "pods", "list", None),
        ("", "pods/proxy", "get", "spotdrain"),
    }
