"""Pod readiness and disruption budgets in the fake Kubernetes API, as a kubelet and the API server keep them.

The sidecar takes its pod out of rotation before the node agent evicts it: the pod is then not Ready, its budget
counts it unhealthy, and the eviction API applies its rule for unhealthy pods.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.rest import ApiException

from simulate.fakes.kube import FakeKube

GATE = "spotdrain.io/serving"
LABELS = {"app": "vllm"}
REFUSED = "Cannot evict pod as it would violate the pod's disruption budget."


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        kube.add_node("gpu-1")
        yield kube


@pytest.fixture
async def core(kube: FakeKube, tmp_path: Path) -> AsyncIterator[Any]:
    configuration = client.Configuration()
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    async with client.ApiClient(configuration) as api:
        yield client.CoreV1Api(api)


def gate(serving: bool) -> dict[str, Any]:
    """The patch the sidecar sends (sidecar.gate.condition_patch)."""
    return {"status": {"conditions": [{"type": GATE, "status": "True" if serving else "False"}]}}


def ready(kube: FakeKube, name: str) -> dict[str, Any]:
    pod = kube.pod("ml", name)
    assert pod is not None
    return next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")


async def budget_status(kube: FakeKube, tmp_path: Path) -> dict[str, int]:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(kube.write_kubeconfig(tmp_path / "k")), client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api:
        pdb = await client.PolicyV1Api(api).read_namespaced_pod_disruption_budget("vllm", "ml")
    status = pdb.status
    return {
        "expectedPods": status.expected_pods,
        "desiredHealthy": status.desired_healthy,
        "currentHealthy": status.current_healthy,
        "disruptionsAllowed": status.disruptions_allowed,
    }


async def test_a_pod_with_a_readiness_gate_is_ready_only_while_its_condition_is_true(
    kube: FakeKube, core: Any, tmp_path: Path
) -> None:
    for name in ("vllm-0", "vllm-1"):
        kube.add_pod("ml", name, node="gpu-1", labels=LABELS, readiness_gates=[GATE])
    kube.add_pdb("ml", "vllm", selector=LABELS, max_unavailable=1)
    assert ready(kube, "vllm-0") | {"lastTransitionTime": None} == {
        "type": "Ready",
        "status": "False",
        "reason": "ReadinessGatesNotReady",
        "message": f'corresponding condition of pod readiness gate "{GATE}" does not exist.',
        "lastProbeTime": None,
        "lastTransitionTime": None,
    }
    assert await budget_status(kube, tmp_path) == {
        "expectedPods": 2,
        "desiredHealthy": 1,
        "currentHealthy": 0,
        "disruptionsAllowed": 0,
    }
    for name in ("vllm-0", "vllm-1"):
        await core.patch_namespaced_pod_status(name, "ml", gate(True))
    assert ready(kube, "vllm-0")["status"] == "True"
    assert (await budget_status(kube, tmp_path))["disruptionsAllowed"] == 1
    await core.patch_namespaced_pod_status("vllm-0", "ml", gate(False))
    assert ready(kube, "vllm-0")["message"] == f'the status of pod readiness gate "{GATE}" is not "True", but False'
    assert await budget_status(kube, tmp_path) == {
        "expectedPods": 2,
        "desiredHealthy": 1,
        "currentHealthy": 1,
        "disruptionsAllowed": 0,
    }


async def test_a_failing_readiness_probe_makes_the_pod_unready_whatever_its_gate_says(kube: FakeKube) -> None:
    kube.add_pod("ml", "vllm-0", node="gpu-1", labels=LABELS)
    assert ready(kube, "vllm-0")["status"] == "True"
    kube.set_containers_ready("ml", "vllm-0", False)
    assert (ready(kube, "vllm-0")["status"], ready(kube, "vllm-0")["reason"]) == ("False", "ContainersNotReady")
    kube.set_containers_ready("ml", "vllm-0", True)
    assert ready(kube, "vllm-0")["status"] == "True"
    assert kube.set_containers_ready("ml", "gone", True) is None


async def evict(core: Any, name: str) -> tuple[int, dict[str, Any], str | None]:
    """(HTTP status, Status body, Retry-After) of evicting ``name``."""
    try:
        await core.create_namespaced_pod_eviction(name, "ml", client.V1Eviction())
    except ApiException as error:
        headers: Any = error.headers or {}
        return error.status, json.loads(error.body or "{}"), headers.get("Retry-After")
    return 201, {}, None


async def two_pods_out_of_rotation(kube: FakeKube, core: Any, *, policy: str | None) -> None:
    """deploy/vllm's shape: two replicas of one budget (maxUnavailable: 1) on one node, both drained by their
    sidecars (gate False) before the node agent evicts them."""
    for name in ("vllm-0", "vllm-1"):
        kube.add_pod("ml", name, node="gpu-1", labels=LABELS, readiness_gates=[GATE])
        await core.patch_namespaced_pod_status(name, "ml", gate(True))
    kube.add_pdb("ml", "vllm", selector=LABELS, max_unavailable=1, unhealthy_pod_eviction_policy=policy)
    for name in ("vllm-0", "vllm-1"):
        await core.patch_namespaced_pod_status(name, "ml", gate(False))


@pytest.mark.parametrize("policy", [None, "IfHealthyBudget"])
async def test_unready_pods_of_an_unhealthy_budget_are_refused_as_the_api_server_refuses_them(
    kube: FakeKube, core: Any, policy: str | None
) -> None:
    await two_pods_out_of_rotation(kube, core, policy=policy)
    for name in ("vllm-0", "vllm-1"):
        status, body, retry_after = await evict(core, name)
        assert (status, body["reason"], body["message"], retry_after) == (429, "TooManyRequests", REFUSED, None)
        cause = "The disruption budget vllm needs 1 healthy pods and has 0 currently"
        assert body["details"]["causes"] == [{"reason": "DisruptionBudget", "message": cause}]
    assert kube.deletions == []


async def test_always_allow_lets_every_unready_pod_of_the_budget_go(kube: FakeKube, core: Any) -> None:
    await two_pods_out_of_rotation(kube, core, policy="AlwaysAllow")
    assert [(await evict(core, name))[0] for name in ("vllm-0", "vllm-1")] == [201, 201]
    assert [(d.name, d.eviction) for d in kube.deletions] == [("vllm-0", True), ("vllm-1", True)]


async def test_a_ready_pod_still_needs_a_disruption_allowed_under_always_allow(kube: FakeKube, core: Any) -> None:
    for name in ("vllm-0", "vllm-1"):
        kube.add_pod("ml", name, node="gpu-1", labels=LABELS)
    kube.add_pdb("ml", "vllm", selector=LABELS, max_unavailable=1, unhealthy_pod_eviction_policy="AlwaysAllow")
    assert (await evict(core, "vllm-0"))[0] == 201
    status, body, _ = await evict(core, "vllm-1")
    assert (status, body["message"]) == (429, REFUSED)


async def test_an_unready_pod_goes_under_the_default_policy_while_the_budget_is_met(kube: FakeKube, core: Any) -> None:
    for name in ("vllm-0", "vllm-1", "vllm-2"):
        kube.add_pod("ml", name, node="gpu-1", labels=LABELS)
    kube.add_pdb("ml", "vllm", selector=LABELS, max_unavailable=1)
    kube.set_containers_ready("ml", "vllm-2", False)  # 2 healthy, 2 desired: met, but no disruption allowed
    assert (await evict(core, "vllm-0"))[0] == 429
    assert (await evict(core, "vllm-2"))[0] == 201


async def test_a_single_unready_replica_is_refused_because_its_budget_desires_no_pod(kube: FakeKube, core: Any) -> None:
    kube.add_pod("ml", "vllm-0", node="gpu-1", labels=LABELS)
    kube.add_pdb("ml", "vllm", selector=LABELS, max_unavailable=1)  # desiredHealthy 0: "> 0" fails
    kube.set_containers_ready("ml", "vllm-0", False)
    status, body, _ = await evict(core, "vllm-0")
    assert (status, body["message"]) == (429, REFUSED)
