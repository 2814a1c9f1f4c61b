"""``spotdrain check`` against an API server: a clean install reported clean, and each way an install goes wrong
found, named, and given its fix.

Every test builds its cluster through the API (``tests/integration/check_cluster.py``) and reads it back with the
real kubeconfig loader and client, so the ``api`` fixture is the one place that says which server runs: each test
runs on the fake, then on the real kube-apiserver of ``tests/control_plane.py`` (skipped where ../shared/kube is
absent). The check reads the whole cluster, so the real server, shared by the session, is emptied of nodes, webhook
configurations and namespaces before and after each test (``Builder.empty``: about 0.2 s, against 3 s for a fresh
server). Those that steer the fake itself (a token without a permission, faults, recorded calls) say so with
``fake_only``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest

from check.access import load
from check.findings import Finding, Report
from check.main import inspect
from check.reading import Reader, Scope, Unreachable, read_cluster
from check.rules import evaluate
from simulate.fakes.kube import FakeKube
from spotdrain.clock import utcnow
from spotdrain.kube_rest import Access
from tests.control_plane import ControlPlane, write_kubeconfig
from tests.deploy.manifests import grants, have_kubectl, needed, render
from tests.integration.check_cluster import (
    AGENT_IMAGE,
    Builder,
    clean_install,
    container,
    engine,
    sidecar,
    template,
)


@dataclass
class Api:
    kubeconfig: Path
    access: Access
    build: Builder
    fake: FakeKube | None  # None on a real API server


POD_NETWORK = "10.1.0"  # data only: nothing here connects to a pod


@pytest.fixture(params=["fake", "real"])
async def api(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Api]:
    """An empty cluster: a fresh fake, then the session's real API server emptied before and after the test."""
    async with aiohttp.ClientSession() as session:
        if request.param == "fake":
            async with FakeKube() as kube:
                kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
                access = await load(str(kubeconfig))
                yield Api(kubeconfig, access, Builder(session, access, POD_NETWORK), kube)
            return
        plane: ControlPlane = request.getfixturevalue("control_plane")
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", plane.url, plane.ca_path, plane.admin_token)
        access = await load(str(kubeconfig))
        build = Builder(session, access, POD_NETWORK)
        await build.empty()  # what tests of other files left on the shared server
        try:
            yield Api(kubeconfig, access, build, None)
        finally:
            await build.empty()


def fake_only(api: Api) -> FakeKube:
    if api.fake is None:
        pytest.skip("steers the fake API server itself")
    return api.fake


EVERYWHERE = Scope()


async def report(api: Api, scope: Scope = EVERYWHERE, *, later: timedelta = timedelta(0)) -> Report:
    async with aiohttp.ClientSession() as session:
        snapshot = await read_cluster(Reader(session, api.access, timeout_s=5), scope, now=utcnow() + later)
    return evaluate(snapshot)


def problems(found: Report) -> list[Finding]:
    return [f for f in found.findings if f.severity != "ok"]


def only(found: Report, check: str) -> Finding:
    wrong = problems(found)
    assert [f.check for f in wrong] == [check], [f.message for f in wrong]
    return wrong[0]


async def test_a_clean_install_is_reported_clean(api: Api) -> None:
    await clean_install(api.build)
    found = await report(api)
    assert problems(found) == []
    assert {f.check for f in found.findings} == {
        "agent",
        "sidecar-injection",
        "budgets",
        "grace-periods",
        "interruption-sources",
        "gateway",
        "webhook",
        "model-cache",
    }
    assert found.exit_code == 0
    messages = " | ".join(f.message for f in found.findings)
    assert "ready on 2 of 2 GPU nodes" in messages
    assert "one component evicts: the spotdrain DaemonSet" in messages
    assert "1 budgets over pods with the sidecar" in messages


async def test_a_budget_without_always_allow_is_an_error_with_its_patch(api: Api) -> None:
    await clean_install(api.build)
    await api.build.create(
        "PodDisruptionBudget",
        "vllm-strict",
        namespace="inference",
        spec={"minAvailable": 1, "selector": {"matchLabels": {"app": "vllm"}}},
    )
    finding = only(await report(api), "budgets")
    assert finding.severity == "error"
    assert finding.objects == ("PodDisruptionBudget/inference/vllm-strict",)
    assert "covers 2 pods with the sidecar" in finding.message
    assert finding.fix == (
        "kubectl -n inference patch pdb vllm-strict --type merge -p "
        """'{"spec":{"unhealthyPodEvictionPolicy":"AlwaysAllow"}}'"""
    )


async def test_a_gpu_pod_in_an_unlabelled_namespace_is_named_with_the_label_it_needs(api: Api) -> None:
    await clean_install(api.build)
    await api.build.namespace("research")
    await api.build.pod("research", "llama-0", node="gpu-1", containers=[engine()])
    finding = only(await report(api), "sidecar-injection")
    assert finding.severity == "error"
    assert finding.objects == ("Namespace/research", "Pod/research/llama-0")
    assert "research is not labelled spotdrain.io/inject=true" in finding.message
    assert finding.fix.startswith("kubectl label namespace research spotdrain.io/inject=true && ")


async def test_pods_created_while_the_webhook_was_down_are_found_with_the_webhook(api: Api) -> None:
    await clean_install(api.build)
    await api.build.set_ready("spotdrain", "spotdrain-webhook", ready=[False, False])
    await api.build.pod("inference", "vllm-2", node="gpu-2", containers=[engine()], labels={"app": "vllm"})
    found = await report(api)
    by_check = {f.check: f for f in problems(found)}
    assert sorted(by_check) == ["sidecar-injection", "webhook"]
    assert "failurePolicy: Ignore" in by_check["sidecar-injection"].message
    assert by_check["sidecar-injection"].objects == ("Namespace/inference", "Pod/inference/vllm-2")
    assert by_check["webhook"].message == (
        "the webhook's Service spotdrain/spotdrain-webhook has no ready endpoint: "
        "pods are created without the sidecar (failurePolicy: Ignore)"
    )
    assert found.exit_code == 1


async def test_a_grace_period_shorter_than_the_drain_is_an_error(api: Api) -> None:
    await clean_install(api.build)
    await api.build.pod(
        "inference", "vllm-short", node="gpu-1", containers=[engine(), sidecar(drain_timeout_s=60)], grace_s=45
    )
    finding = only(await report(api), "grace-periods")
    assert finding.objects == ("Pod/inference/vllm-short",)
    assert "terminationGracePeriodSeconds 45 is shorter than the sidecar's drain (60 s) plus 20 s" in finding.message
    assert finding.fix == "set terminationGracePeriodSeconds: 80 in the pod's manifest"


async def test_the_api_servers_default_grace_period_is_too_short_for_the_default_drain(api: Api) -> None:
    await clean_install(api.build)
    await api.build.pod("inference", "vllm-default", node="gpu-1", containers=[engine(), sidecar()])
    finding = only(await report(api), "grace-periods")
    assert "terminationGracePeriodSeconds 30 is shorter than the sidecar's drain (110 s)" in finding.message


async def test_karpenters_interruption_queue_beside_an_evicting_daemonset_is_two_evictors(api: Api) -> None:
    await clean_install(api.build)
    await api.build.namespace("karpenter")
    controller = container(
        "controller", "public.ecr.aws/karpenter/controller:1.14.0", env={"INTERRUPTION_QUEUE": "prod-interruptions"}
    )
    labels = {"app.kubernetes.io/name": "karpenter"}
    await api.build.create("Deployment", "karpenter", namespace="karpenter", spec=template(labels, [controller]))
    finding = only(await report(api), "interruption-sources")
    assert finding.objects == ("Deployment/karpenter/karpenter", "DaemonSet/spotdrain/spotdrain-node")
    assert "2 components evict" in finding.message
    assert "Karpenter with the interruption queue prod-interruptions" in finding.message
    assert finding.fix.startswith("kubectl apply -k daemonset/karpenter-interruption")


async def test_a_queue_deployment_beside_an_evicting_daemonset_is_two_evictors(api: Api) -> None:
    await clean_install(api.build)
    labels = {"app.kubernetes.io/name": "spotdrain-queue"}
    queue = container("agent", AGENT_IMAGE, "spotdrain", "node", "--queue-url", "https://sqs.example/q")
    await api.build.create("Deployment", "spotdrain-queue", namespace="spotdrain", spec=template(labels, [queue]))
    finding = only(await report(api), "interruption-sources")
    assert finding.objects == ("Deployment/spotdrain/spotdrain-queue", "DaemonSet/spotdrain/spotdrain-node")
    assert finding.fix == "kubectl apply -k daemonset/queue-mode (its DaemonSet runs --no-evict)"


async def test_agents_that_do_not_evict_without_karpenters_queue_leave_nothing_evicting(api: Api) -> None:
    await clean_install(api.build, agent_args=("--no-evict",))
    finding = only(await report(api), "interruption-sources")
    assert finding.severity == "error"
    assert "nothing evicts" in finding.message


async def test_an_agent_kept_off_a_gpu_node_by_a_taint_names_the_taint_and_the_toleration(api: Api) -> None:
    await clean_install(api.build, agent_tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    await api.build.node(
        "gpu-3",
        taints=[
            {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
            {"key": "team", "value": "llm", "effect": "NoSchedule"},
        ],
    )
    finding = only(await report(api), "agent")
    assert finding.objects == ("Node/gpu-3", "DaemonSet/spotdrain/spotdrain-node")
    assert finding.message == (
        "no node agent on gpu-3: its taint team=llm:NoSchedule is not tolerated by DaemonSet/spotdrain/spotdrain-node"
    )
    assert "{key: team, operator: Exists, effect: NoSchedule}" in finding.fix


async def test_an_agent_that_is_not_ready_is_named(api: Api) -> None:
    install = await clean_install(api.build)
    await api.build.node("gpu-3")
    agent = container("agent", AGENT_IMAGE, "spotdrain", "node")
    await api.build.pod(
        "spotdrain",
        "spotdrain-node-gpu-3",
        node="gpu-3",
        containers=[agent],
        labels={"app.kubernetes.io/name": "spotdrain-node"},
        ready=False,
        owner=install.agents,
    )
    finding = only(await report(api), "agent")
    assert finding.message == "the node agent on gpu-3 is not ready"
    assert finding.objects == ("Node/gpu-3", "Pod/spotdrain/spotdrain-node-gpu-3")


async def test_a_sidecar_at_another_version_than_the_agent_is_a_warning(api: Api) -> None:
    await clean_install(api.build)
    old = sidecar(image="ghcr.io/spotdrain/spotdrain-sidecar:0.0.9")
    await api.build.pod("inference", "vllm-old", node="gpu-1", containers=[engine(), old], grace_s=130)
    found = await report(api)
    finding = only(found, "sidecar-injection")
    assert finding.severity == "warning"
    assert finding.message == "sidecar image 0.0.9 in Pod/inference/vllm-old, while the node agent runs 0.1.0"
    assert found.exit_code == 0


async def test_a_gateway_service_without_ready_endpoints_is_an_error(api: Api) -> None:
    await clean_install(api.build)
    await api.build.set_ready("inference", "spotdrain-gateway", ready=[False, False])
    finding = only(await report(api), "gateway")
    assert finding.objects == ("Service/inference/spotdrain-gateway", "Deployment/inference/spotdrain-gateway")
    assert "selects no ready endpoint" in finding.message


async def test_a_node_still_tainted_for_its_cache_is_a_warning_then_an_error(api: Api) -> None:
    install = await clean_install(api.build)
    pending = {"key": "spotdrain.io/model-cache-pending", "effect": "NoSchedule"}
    await api.build.node("gpu-3", cache=None, taints=[pending])
    agent = container("agent", AGENT_IMAGE, "spotdrain", "node")
    labels = {"app.kubernetes.io/name": "spotdrain-node"}
    await api.build.pod(
        "spotdrain", "spotdrain-node-gpu-3", node="gpu-3", containers=[agent], labels=labels, owner=install.agents
    )
    now = only(await report(api), "model-cache")
    assert (now.severity, now.objects) == ("warning", ("Node/gpu-3",))
    later = only(await report(api, later=timedelta(minutes=15)), "model-cache")
    assert later.severity == "error"
    assert "still carry the startup taint spotdrain.io/model-cache-pending after 10 minutes" in later.message


async def test_namespace_and_selector_narrow_the_workload_checks(api: Api) -> None:
    await clean_install(api.build)
    await api.build.namespace("research")
    await api.build.pod("research", "llama-0", node="gpu-1", containers=[engine()], labels={"app": "llama"})
    await api.build.pod("inference", "vllm-9", node="gpu-1", containers=[engine()], labels={"app": "other"})
    assert len([f for f in problems(await report(api)) if f.check == "sidecar-injection"]) == 2
    assert problems(await report(api, Scope(namespace="research", selector="app=nothing"))) == []
    finding = only(await report(api, Scope(namespace="research")), "sidecar-injection")
    assert finding.objects == ("Namespace/research", "Pod/research/llama-0")
    finding = only(await report(api, Scope(selector="app=other")), "sidecar-injection")
    assert finding.objects == ("Namespace/inference", "Pod/inference/vllm-9")


async def test_a_missing_permission_is_named_and_only_the_checks_that_need_it_are_skipped(
    api: Api, tmp_path: Path
) -> None:
    kube = fake_only(api)
    await clean_install(api.build)
    token = kube.issue_token("system:serviceaccount:ops:checker", denied=[("list", "daemonsets")])
    config = kube.write_kubeconfig(tmp_path / "limited")
    config.write_text(config.read_text().replace(kube.token, token))
    found = await inspect(await load(str(config)), Scope(), timeout_s=5)
    access = [f for f in found.findings if f.check == "access"]
    assert [f.message for f in access] == [
        "cannot list daemonsets.apps at the cluster scope: not checked: agent, interruption-sources, sidecar-injection"
    ]
    assert access[0].fix.startswith('grant {apiGroups: ["apps"], resources: ["daemonsets"], verbs: ["list"]}')
    assert {f.check for f in found.findings} == {
        "access",
        "budgets",
        "grace-periods",
        "gateway",
        "webhook",
        "model-cache",
    }
    assert found.exit_code == 2


@pytest.mark.parametrize("fault", ["garbage", "status"])
async def test_an_api_answering_garbage_or_5xx_is_reported_not_crashed_on(api: Api, fault: str) -> None:
    kube = fake_only(api)
    await clean_install(api.build)
    kube.faults.inject(fault, "GET", "/apis/policy/v1/poddisruptionbudgets")
    found = await report(api)
    assert [f.check for f in problems(found)] == ["access"]
    assert "could not list poddisruptionbudgets.policy" in problems(found)[0].message
    assert found.exit_code == 2


async def test_an_api_server_that_hangs_is_unreachable_within_the_timeout(api: Api) -> None:
    kube = fake_only(api)
    kube.faults.inject("hang", "GET", "/api/v1/nodes")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(Unreachable, match=r"no answer|TimeoutError"):
            await asyncio.wait_for(read_cluster(Reader(session, api.access, timeout_s=0.3), Scope(), now=utcnow()), 5)


async def _command(*words: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "spotdrain.cli",
        "check",
        *words,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_command_prints_json_for_ci_and_exits_by_what_it_found(api: Api) -> None:
    await clean_install(api.build)
    await api.build.create(
        "PodDisruptionBudget",
        "vllm-strict",
        namespace="inference",
        spec={"minAvailable": 1, "selector": {"matchLabels": {"app": "vllm"}}},
    )
    code, out, _ = await _command("--kubeconfig", str(api.kubeconfig), "--output", "json")
    assert code == 1
    findings = json.loads(out)
    assert all(set(f) == {"severity", "check", "objects", "message", "fix"} for f in findings)
    errors = [f for f in findings if f["severity"] == "error"]
    assert [(f["check"], f["objects"]) for f in errors] == [("budgets", ["PodDisruptionBudget/inference/vllm-strict"])]
    code, out, _ = await _command("--kubeconfig", str(api.kubeconfig), "--namespace", "spotdrain")
    assert code == 0
    assert "✓ the node agent is ready on 2 of 2 GPU nodes" in out
    assert out.rstrip().endswith("0 errors, 0 warnings")


async def test_the_command_exits_2_when_no_api_server_answers(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    async with FakeKube(tls_dir=tmp_path / "tls") as kube:  # its CA stays: only the server is gone
        config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    code, out, _ = await _command("--kubeconfig", str(config), "--timeout", "2")
    assert code == 2
    assert out.startswith("✗ could not read the cluster: ")


async def test_the_checks_make_exactly_the_calls_deploy_check_grants(api: Api) -> None:
    kube = fake_only(api)
    if not have_kubectl():
        pytest.skip("kubectl renders the kustomization")
    await clean_install(api.build)
    kube.calls.clear()
    assert (await report(api)).exit_code == 0
    assert {(call.method, call.query.get("watch")) for call in kube.calls} == {("GET", None)}
    granted = grants(render("deploy/check"), "spotdrain", "spotdrain-check")
    # The pod proxy is for --node alone: tests/integration/test_check_node.py.
    assert needed(kube.calls, granted) == granted - {("", "pods/proxy", "get", "spotdrain")}
    # The queue Deployment runs the same checks (--check-interval) with a role of its own that grants them too.
    queue = grants(render("daemonset/queue-mode"), "spotdrain", "spotdrain-queue")
    assert needed(kube.calls, queue) <= queue
