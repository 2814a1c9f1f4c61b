"""What one node's agent token can do, on the real API server: the DaemonSet's rendered RBAC and admission policy
(daemonset/imds-mode), the eviction guard (deploy/webhook/base's ValidatingWebhookConfiguration, answered by the
webhook's app on 127.0.0.1 with its rendered RBAC), and a token the API server binds to the agent's pod on gpu-a,
as the kubelet's projected volume holds it. With them, the agent's whole run on gpu-a passes and every reach beyond
it is refused with the policy's or the guard's message; without them, the same reaches succeed (so these tests can
fail)."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from agent.cache.plan import PENDING_TAINT
from agent.drain.planning import ADDED, TAINT_KEY
from simulate.fakes.imds import FakeImds, serving
from spotdrain.clock import utcnow
from tests.conftest import RBAC_KINDS, node_agent, until
from tests.control_plane import ControlPlane
from tests.deploy.manifests import render
from tests.real_kube import RealKube
from tests.real_webhook import serving_webhook

Obj = dict[str, Any]
GPU_TAINT = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}
INSTANCE = "i-0a0a0a0a0a0a0a0a0"
POLICY_KINDS = frozenset({"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"})
MERGE = "application/merge-patch+json"


def shipped(*, policy: bool) -> list[Obj]:
    """The DaemonSet's RBAC, and its admission policy unless ``policy`` is false."""
    kinds = RBAC_KINDS | (POLICY_KINDS if policy else frozenset())
    return [o for o in render("daemonset/imds-mode") if o["kind"] in kinds]


class Agent:
    """The agent's pod on gpu-a and its pod-bound token (or, for ``queue``, the queue Deployment's account and a
    token bound to no pod: it runs off the GPU nodes)."""

    def __init__(self, kube: RealKube, *, policy: bool, queue: bool = False) -> None:
        kube.add_node("gpu-a", provider_id=f"aws:///us-east-1a/{INSTANCE}", taints=[GPU_TAINT])
        kube.add_node("gpu-b", taints=[GPU_TAINT])
        self.kube = kube
        if queue:
            objects = [o for o in render("daemonset/queue-mode") if o["kind"] in RBAC_KINDS | POLICY_KINDS]
            self.token = kube.apply_and_token(objects, "spotdrain", "spotdrain-queue")
            return
        pod = kube.add_pod("spotdrain", "spotdrain-node-a", node="gpu-a", owner_kind="DaemonSet",
                           service_account="spotdrain-node")  # fmt: skip
        self.token = kube.apply_and_token(shipped(policy=policy), "spotdrain", "spotdrain-node", pod=pod)

    async def ask(
        self, method: str, path: str, body: Obj | None = None, *, content_type: str = MERGE
    ) -> httpx.Response:
        context = ssl.create_default_context(cafile=str(self.kube.plane.ca_path))
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": content_type}
        async with httpx.AsyncClient(base_url=self.kube.plane.url, verify=context, timeout=10) as client:
            return await client.request(method, path, content=json.dumps(body) if body else None, headers=headers)


async def policy_in_force(agent: Agent, *, wanted: bool = True) -> None:
    """Until the API server applies the policy, or no longer does (it takes a new or deleted one into account
    within a second or so): until a dry run of a patch to gpu-b is refused, or not."""
    cordon = {"spec": {"unschedulable": True}}
    async with asyncio.timeout(15):
        while (await agent.ask("PATCH", "/api/v1/nodes/gpu-b?dryRun=All", cordon)).is_success == wanted:
            await asyncio.sleep(0.1)


@pytest.fixture
async def real(control_plane: ControlPlane) -> AsyncIterator[RealKube]:
    async with RealKube(control_plane) as kube:
        yield kube


def eviction_guard(kube: RealKube, tmp_path: Path) -> AbstractAsyncContextManager[None]:
    return serving_webhook(kube, tmp_path, {"ValidatingWebhookConfiguration"})


def reaches(kube: RealKube) -> list[tuple[str, str, str, Obj]]:
    """(what, method, path, body): each beyond the agent's own node and fields."""
    a_taints = kube.node("gpu-a")["spec"]["taints"]
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "spotdrain-", "namespace": "default"},
             "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": "gpu-b", "uid": "gpu-b"},
             "reason": "InterruptionNotice", "message": "forged", "type": "Warning",
             "source": {"component": "spotdrain"}}  # fmt: skip
    ours = {"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"}
    return [
        ("cordon gpu-b", "PATCH", "/api/v1/nodes/gpu-b", {"spec": {"unschedulable": True}}),
        ("taint gpu-b", "PATCH", "/api/v1/nodes/gpu-b", {"spec": {"taints": [GPU_TAINT, ours]}}),
        ("remove gpu-a's GPU taint", "PATCH", "/api/v1/nodes/gpu-a",
         {"spec": {"taints": [t for t in a_taints if t["key"] != GPU_TAINT["key"]] + [ours]}}),
        ("label gpu-a", "PATCH", "/api/v1/nodes/gpu-a", {"metadata": {"labels": {"node-role.kubernetes.io/x": ""}}}),
        ("annotate gpu-a", "PATCH", "/api/v1/nodes/gpu-a", {"metadata": {"annotations": {"other.io/x": "y"}}}),
        ("event about gpu-b", "POST", "/api/v1/namespaces/default/events", event),
    ]  # fmt: skip


POLICY_MESSAGES = {
    "cordon gpu-b": "spotdrain-node may change only the Node its own pod runs on",
    "taint gpu-b": "spotdrain-node may change only the Node its own pod runs on",
    "remove gpu-a's GPU taint": "spotdrain may add and remove only the spotdrain.io/ taints of a Node",
    "label gpu-a": "spotdrain may change only the spotdrain.io/ labels of a Node",
    "annotate gpu-a": "spotdrain may change only the spotdrain.io/ annotations of a Node",
    "event about gpu-b": "spotdrain may record Events only about a Node, and spotdrain-node only about its own",
}


async def test_the_pod_bound_token_names_its_node(real: RealKube) -> None:
    agent = Agent(real, policy=True)
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    answer = await agent.ask("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", review,
                             content_type="application/json")  # fmt: skip
    info = answer.json()["status"]["userInfo"]
    assert info["username"] == "system:serviceaccount:spotdrain:spotdrain-node"
    assert info["extra"]["authentication.kubernetes.io/node-name"] == ["gpu-a"]


async def test_with_the_policy_every_reach_beyond_its_own_node_is_refused(real: RealKube) -> None:
    agent = Agent(real, policy=True)
    await policy_in_force(agent)
    before = real.node("gpu-b"), real.node("gpu-a")
    for what, method, path, body in reaches(real):
        answer = await agent.ask(method, path, body, content_type=MERGE if method == "PATCH" else "application/json")
        assert answer.status_code == 403, what
        assert answer.json()["reason"] == "Forbidden", what
        assert POLICY_MESSAGES[what] in answer.json()["message"], what
        assert "ValidatingAdmissionPolicy 'spotdrain-node-scope'" in answer.json()["message"], what
    assert (real.node("gpu-b"), real.node("gpu-a")) == before


async def test_the_queue_deployment_marks_any_node_but_changes_only_spotdrains_fields(real: RealKube) -> None:
    queue = Agent(real, policy=True, queue=True)
    ours = {"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"}
    label = {"metadata": {"labels": {"node-role.kubernetes.io/x": ""}}}
    async with asyncio.timeout(15):  # until the policy applies
        while (await queue.ask("PATCH", "/api/v1/nodes/gpu-b?dryRun=All", label)).is_success:
            await asyncio.sleep(0.1)
    marked = await queue.ask(
        "PATCH", "/api/v1/nodes/gpu-b", {"spec": {"unschedulable": True, "taints": [GPU_TAINT, ours]}}
    )
    assert marked.status_code == 200, marked.text
    refused = await queue.ask("PATCH", "/api/v1/nodes/gpu-b", label)
    assert refused.status_code == 403
    assert POLICY_MESSAGES["label gpu-a"] in refused.json()["message"]
    assert real.node("gpu-b")["spec"]["taints"] == [GPU_TAINT, ours]


async def test_without_the_policy_the_same_reaches_succeed(real: RealKube) -> None:
    agent = Agent(real, policy=False)
    await policy_in_force(agent, wanted=False)  # another test's, deleted, may still be applied for a moment
    for what, method, path, body in reaches(real):
        answer = await agent.ask(method, path, body, content_type=MERGE if method == "PATCH" else "application/json")
        assert answer.is_success, (what, answer.text)
    assert real.node("gpu-b")["spec"]["unschedulable"] is True
    assert GPU_TAINT not in real.node("gpu-a")["spec"]["taints"]


async def evict(agent: Agent, pod: str, *, dry: bool = False) -> httpx.Response:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": "ml"}}
    path = f"/api/v1/namespaces/ml/pods/{pod}/eviction" + ("?dryRun=All" if dry else "")
    return await agent.ask("POST", path, body, content_type="application/json")


async def test_with_the_guard_only_pods_on_its_own_node_are_evicted(real: RealKube, tmp_path: Path) -> None:
    agent = Agent(real, policy=True)
    for pod, node in (("vllm-a", "gpu-a"), ("vllm-b", "gpu-b")):
        real.add_pod("ml", pod, node=node, owner_kind="ReplicaSet", grace_period_s=1)
    async with eviction_guard(real, tmp_path):
        refused = await evict(agent, "vllm-b")
        assert refused.status_code == 403, refused.text
        assert (
            "spotdrain-node on gpu-a may evict only pods bound to gpu-a; ml/vllm-b is on gpu-b"
            in refused.json()["message"]
        )
        assert 'admission webhook "eviction.guard.spotdrain.io" denied the request' in refused.json()["message"]
        assert (await evict(agent, "vllm-a")).status_code == 201
        # An administrator's eviction (kubectl drain, Karpenter) never reaches the guard.
        real.admin.create("/api/v1/namespaces/ml/pods/vllm-b/eviction", {"metadata": {"name": "vllm-b"}})
    assert real.pod("ml", "vllm-b")["metadata"].get("deletionTimestamp")  # type: ignore[index]


async def test_without_the_guard_a_pod_on_another_node_is_evicted(real: RealKube) -> None:
    agent = Agent(real, policy=True)
    real.add_pod("ml", "vllm-b", node="gpu-b", owner_kind="ReplicaSet", grace_period_s=1)
    async with asyncio.timeout(15):  # another test's guard, deleted, may still be called for a moment
        while not (await evict(agent, "vllm-b", dry=True)).is_success:
            await asyncio.sleep(0.1)
    answer = await evict(agent, "vllm-b")
    assert answer.status_code == 201, answer.text


async def test_with_the_policy_the_agents_whole_run_on_its_node_passes(real: RealKube, tmp_path: Path) -> None:
    """Mark (taint, cordon, annotate, Event), drain (evict, through the guard), withdraw (a canceled maintenance
    event unmarks), and the model cache's startup taint lifted, all with the token bound to the pod on gpu-a."""
    agent = Agent(real, policy=True)
    real.admin.patch("/api/v1/nodes/gpu-a", {"spec": {"taints": [GPU_TAINT, {"key": PENDING_TAINT,
                                                                              "effect": "NoSchedule"}]}})  # fmt: skip
    real.add_pod("ml", "vllm-a", node="gpu-a", owner_kind="ReplicaSet", grace_period_s=1)
    real.add_pod("ml", "vllm-b", node="gpu-b", owner_kind="ReplicaSet", grace_period_s=1)
    await policy_in_force(agent)
    imds = FakeImds(instance_id=INSTANCE)
    event_id = imds.add_maintenance(not_before=utcnow() + timedelta(hours=1))
    with capture_logs() as logs:
        async with serving(imds) as url, eviction_guard(real, tmp_path):
            flags = ("--node-name", "gpu-a", "--imds-url", url, "--imds-interval", "0.1")
            async with node_agent(real, tmp_path / "kubeconfig", *flags, token=agent.token, stop_within_s=10):
                await until(lambda: any(e["event"] == "node.drained" for e in logs), timeout_s=20)
                marked = real.node("gpu-a")
                imds.set_maintenance_state(event_id, "canceled")
                await until(lambda: not real.node("gpu-a")["spec"].get("unschedulable") and len(real.events()) == 2)
    assert marked["metadata"]["annotations"][ADDED] == "cordon,taint"
    assert any(t["key"] == TAINT_KEY for t in marked["spec"]["taints"])
    assert real.node("gpu-a")["spec"]["taints"] == [GPU_TAINT], "only its own taints went"
    assert real.pod("ml", "vllm-b") is not None
    await until(lambda: real.pod("ml", "vllm-a") is None)
    assert [e["event"] for e in logs if "forbidden" in json.dumps(e, default=str).lower()] == []
    assert real.node("gpu-b")["spec"].get("unschedulable") is None
