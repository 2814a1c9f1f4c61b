"""The fake Kubernetes API answers kubernetes-asyncio, over HTTPS and a kubeconfig, as a real API server does."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.rest import ApiException

from simulate.fakes.kube import FakeKube
from simulate.fakes.kube_resources import PODS
from spotdrain.kube_rest import InCluster, patch

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        kube.add_node("n1")
        kube.add_node("n2")
        yield kube


@pytest.fixture
async def api(kube: FakeKube, tmp_path: Path) -> AsyncIterator[client.ApiClient]:
    configuration = client.Configuration()
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    async with client.ApiClient(configuration) as api_client:
        yield api_client


def core_v1(api: client.ApiClient) -> Any:
    # Typed as Any, as the client's own methods take their options (_content_type) as untyped keywords.
    return client.CoreV1Api(api)


def status_of(error: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(error.body or "{}")
    return body


async def test_pods_are_listed_by_node_across_namespaces_with_a_field_selector(
    kube: FakeKube, api: client.ApiClient
) -> None:
    kube.add_pod("default", "a", node="n1")
    kube.add_pod("kube-system", "b", node="n1", owner_kind="DaemonSet")
    kube.add_pod("default", "c", node="n2")
    pods = await core_v1(api).list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert [(p.metadata.namespace, p.metadata.name) for p in pods.items] == [("default", "a"), ("kube-system", "b")]
    assert pods.kind == "PodList"
    assert int(pods.metadata.resource_version) >= max(int(p.metadata.resource_version) for p in pods.items)
    assert pods.items[1].metadata.owner_references[0].kind == "DaemonSet"
    (call,) = [c for c in kube.calls if c.pattern == "/api/v1/pods"]
    assert call.query["fieldSelector"] == "spec.nodeName=n1"


async def test_label_selectors_filter_a_namespaced_list(kube: FakeKube, api: client.ApiClient) -> None:
    kube.add_pod("default", "web", node="n1", labels={"app": "web", "tier": "front"})
    kube.add_pod("default", "api", node="n1", labels={"app": "api"})
    kube.add_pod("default", "cache", node="n1", labels={"app": "web", "tier": "cache"})
    kube.add_pod("other", "web2", node="n1", labels={"app": "web"})
    core = core_v1(api)
    pods = await core.list_namespaced_pod("default", label_selector="app in (web,api),tier!=cache")
    assert [p.metadata.name for p in pods.items] == ["api", "web"]
    pods = await core.list_namespaced_pod("default", label_selector="tier,app notin (api)")
    assert [p.metadata.name for p in pods.items] == ["cache", "web"]


async def test_an_unsupported_field_selector_is_a_bad_request(api: client.ApiClient) -> None:
    with pytest.raises(ApiException) as raised:
        await core_v1(api).list_pod_for_all_namespaces(field_selector="spec.hostname=n1")
    assert raised.value.status == 400
    assert status_of(raised.value)["message"] == "field label not supported: spec.hostname"


async def test_a_missing_object_is_a_not_found_status(api: client.ApiClient) -> None:
    with pytest.raises(ApiException) as raised:
        await core_v1(api).read_namespaced_pod("gone", "default")
    assert raised.value.status == 404
    status = status_of(raised.value)
    assert (status["kind"], status["reason"], status["message"]) == ("Status", "NotFound", 'pods "gone" not found')


async def test_cordon_is_a_merge_patch_of_spec_unschedulable(kube: FakeKube, api: client.ApiClient) -> None:
    before = kube.node("n1")["metadata"]["resourceVersion"]
    node = await core_v1(api).patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)
    assert node.spec.unschedulable is True
    assert int(node.metadata.resource_version) > int(before)
    assert kube.node("n1")["spec"]["unschedulable"] is True
    assert kube.count("PATCH", "/api/v1/nodes/{name}") == 1


async def test_a_strategic_patch_replaces_taints_and_merges_conditions_by_type(
    kube: FakeKube, api: client.ApiClient
) -> None:
    kube.add_node("n3", taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    core = core_v1(api)
    ours = {"key": "spotdrain.io/interruption", "value": "spot-interruption", "effect": "NoSchedule"}
    await core.patch_node("n3", {"spec": {"taints": [ours]}})
    # Node spec.taints is an atomic list in the API schema: the patch is the whole list.
    assert kube.node("n3")["spec"]["taints"] == [ours]
    condition = {"type": "SpotInterruption", "status": "True", "reason": "Notice"}
    await core.patch_node_status("n3", {"status": {"conditions": [condition]}})
    assert [c["type"] for c in kube.node("n3")["status"]["conditions"]] == ["Ready", "SpotInterruption"]


async def test_a_write_with_a_stale_resource_version_is_a_conflict(kube: FakeKube, api: client.ApiClient) -> None:
    core = core_v1(api)
    stale = await core.read_node("n1")
    await core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}, _content_type=MERGE)
    guarded = {"metadata": {"resourceVersion": stale.metadata.resource_version}, "spec": {"unschedulable": True}}
    with pytest.raises(ApiException) as raised:
        await core.patch_node("n1", guarded, _content_type=MERGE)
    assert (raised.value.status, status_of(raised.value)["reason"]) == (409, "Conflict")
    with pytest.raises(ApiException) as raised:
        await core.replace_node("n1", stale)
    assert raised.value.status == 409
    assert "unschedulable" not in kube.node("n1")["spec"]
    assert kube.node("n1")["metadata"]["labels"]["a"] == "b"


async def test_a_failing_json_patch_test_is_unprocessable_and_changes_nothing(
    kube: FakeKube, api: client.ApiClient
) -> None:
    core = core_v1(api)
    before = kube.node("n1")
    operations = [
        {"op": "test", "path": "/spec/unschedulable", "value": True},
        {"op": "add", "path": "/metadata/labels/drained", "value": "yes"},
    ]
    with pytest.raises(ApiException) as raised:
        await core.patch_node("n1", operations)
    assert (raised.value.status, status_of(raised.value)["reason"]) == (422, "Invalid")
    assert kube.node("n1") == before
    operations[0] = {"op": "test", "path": "/metadata/name", "value": "n1"}
    node = await core.patch_node("n1", operations, _content_type=JSON_PATCH)
    assert node.metadata.labels["drained"] == "yes"


async def test_pod_status_changes_only_through_the_status_subresource(kube: FakeKube, api: client.ApiClient) -> None:
    kube.add_pod("default", "web", node="n1", readiness_gates=["spotdrain.io/serving"])
    core = core_v1(api)
    gate = {"status": {"conditions": [{"type": "spotdrain.io/serving", "status": "True"}]}}
    await core.patch_namespaced_pod("web", "default", gate)
    assert "spotdrain.io/serving" not in _condition_types(kube, "web")
    await core.patch_namespaced_pod_status("web", "default", gate)
    assert _condition_types(kube, "web")[-2:] == ["Ready", "spotdrain.io/serving"]


def _condition_types(kube: FakeKube, name: str) -> list[str]:
    pod = kube.pod("default", name)
    assert pod is not None
    return [c["type"] for c in pod["status"]["conditions"]]


async def test_an_eviction_deletes_the_pod_with_the_grace_period_it_asks_for(
    kube: FakeKube, api: client.ApiClient
) -> None:
    kube.add_pod("default", "now", node="n1")
    kube.add_pod("default", "later", node="n1", grace_period_s=30)
    core = core_v1(api)
    for name, grace in (("now", 0), ("later", 20)):
        eviction = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace="default"),
            delete_options=client.V1DeleteOptions(grace_period_seconds=grace),
        )
        await core.create_namespaced_pod_eviction(name, "default", eviction)
    assert kube.pod("default", "now") is None
    later = kube.pod("default", "later")
    assert later is not None
    assert later["metadata"]["deletionGracePeriodSeconds"] == 20
    assert [(d.name, d.grace_s, d.eviction) for d in kube.deletions] == [("now", 0, True), ("later", 20, True)]


async def test_an_eviction_that_would_break_a_disruption_budget_is_429(kube: FakeKube, api: client.ApiClient) -> None:
    for name in ("web-1", "web-2", "web-3"):
        kube.add_pod("default", name, node="n1", labels={"app": "web"}, owner_kind="ReplicaSet")
    kube.add_pdb("default", "web", selector={"app": "web"}, min_available=2)
    core = core_v1(api)
    await core.create_namespaced_pod_eviction("web-1", "default", client.V1Eviction())
    with pytest.raises(ApiException) as raised:
        await core.create_namespaced_pod_eviction("web-2", "default", client.V1Eviction())
    assert raised.value.status == 429
    status = status_of(raised.value)
    assert status["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    assert status["details"]["causes"] == [
        {"reason": "DisruptionBudget", "message": "The disruption budget web needs 2 healthy pods and has 2 currently"}
    ]
    web2 = kube.pod("default", "web-2")
    assert web2 is not None
    assert "deletionTimestamp" not in web2["metadata"]
    budget = await client.PolicyV1Api(api).read_namespaced_pod_disruption_budget("web", "default")
    assert (budget.status.current_healthy, budget.status.disruptions_allowed) == (2, 0)


async def test_evicting_a_missing_pod_is_404(api: client.ApiClient) -> None:
    with pytest.raises(ApiException) as raised:
        await core_v1(api).create_namespaced_pod_eviction("gone", "default", client.V1Eviction())
    assert raised.value.status == 404


async def test_a_deleted_pod_is_removed_once_its_grace_period_ends(kube: FakeKube, api: client.ApiClient) -> None:
    kube.add_pod("default", "web", node="n1")
    kube.add_pod("default", "api", node="n1")
    seen: list[tuple[str, int]] = []

    async def stop_engine(pod: dict[str, Any], grace_s: int) -> None:
        seen.append((pod["metadata"]["name"], grace_s))

    kube.on_delete(stop_engine)
    core = core_v1(api)
    deleted = await core.delete_namespaced_pod("web", "default", grace_period_seconds=1)
    assert deleted.metadata.deletion_timestamp is not None
    await core.delete_namespaced_pod("api", "default", body=client.V1DeleteOptions(grace_period_seconds=0))
    assert kube.pod("default", "api") is None
    assert kube.pod("default", "web") is not None
    give_up = time.monotonic() + 3
    while kube.pod("default", "web") is not None and time.monotonic() < give_up:
        await asyncio.sleep(0.05)
    assert kube.pod("default", "web") is None
    assert seen == [("web", 1), ("api", 0)]


async def test_events_from_both_event_apis_are_stored_and_listed(kube: FakeKube, api: client.ApiClient) -> None:
    core_event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="n1."),
        involved_object=client.V1ObjectReference(kind="Node", name="n1"),
        reason="SpotInterruption",
        message="draining",
        type="Warning",
    )
    created = await core_v1(api).create_namespaced_event("default", core_event)
    assert created.metadata.name.startswith("n1.")
    event = client.EventsV1Event(
        metadata=client.V1ObjectMeta(name="n1.drained"),
        event_time=datetime(2026, 11, 29, 10, 22, tzinfo=UTC),
        reason="Drained",
        action="Drain",
        reporting_controller="spotdrain.io/node",
        reporting_instance="n1",
        regarding=client.V1ObjectReference(kind="Node", name="n1"),
        type="Normal",
    )
    await client.EventsV1Api(api).create_namespaced_event("default", event)
    assert [e["reason"] for e in kube.events()] == ["SpotInterruption", "Drained"]
    listed = await core_v1(api).list_namespaced_event("default", field_selector="involvedObject.name=n1")
    assert [e.reason for e in listed.items] == ["SpotInterruption"]


async def test_a_call_without_the_token_is_401(kube: FakeKube) -> None:
    context = ssl.create_default_context(cafile=str(kube.ca_path))
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with session.get(f"{kube.url}/api/v1/nodes", ssl=context, headers=headers) as response:
                assert response.status == 401
                assert (await response.json())["reason"] == "Unauthorized"


async def test_a_service_account_directory_reaches_the_server_as_in_a_pod(kube: FakeKube, tmp_path: Path) -> None:
    kube.add_pod("default", "web", node="n1")
    cluster = InCluster.from_environment(kube.serviceaccount_dir(tmp_path / "sa"), env=kube.service_env())
    condition = {"status": {"conditions": [{"type": "spotdrain.io/serving", "status": "False"}]}}
    async with aiohttp.ClientSession() as session:
        await patch(session, cluster, "/api/v1/namespaces/default/pods/web/status", condition)
    assert _condition_types(kube, "web")[-1] == "spotdrain.io/serving"
    assert (tmp_path / "sa" / "namespace").read_text() == "default"


async def test_injected_failures_answer_the_next_calls_then_stop(kube: FakeKube, api: client.ApiClient) -> None:
    kube.fail_next("GET", r"/nodes/n1$", 500, count=2)
    kube.fail_next("POST", r"/eviction$", 429, retry_after=3)
    kube.add_pod("default", "web", node="n1")
    core = core_v1(api)
    for _ in range(2):
        with pytest.raises(ApiException) as raised:
            await core.read_node("n1")
        assert raised.value.status == 500
    assert (await core.read_node("n1")).metadata.name == "n1"
    with pytest.raises(ApiException) as raised:
        await core.create_namespaced_pod_eviction("web", "default", client.V1Eviction())
    assert raised.value.status == 429
    assert raised.value.headers is not None
    assert raised.value.headers["Retry-After"] == "3"
    await core.create_namespaced_pod_eviction("web", "default", client.V1Eviction())
    assert kube.count("GET", "/api/v1/nodes/{name}") == 3


async def test_latency_is_added_to_every_call(kube: FakeKube, api: client.ApiClient) -> None:
    kube.latency_s = 0.2
    started = time.monotonic()
    await core_v1(api).read_node("n1")
    assert time.monotonic() - started >= 0.2


async def test_a_pods_proxy_sends_the_path_and_query_on_and_refuses_what_is_not_loopback(
    kube: FakeKube, tmp_path: Path
) -> None:
    from aiohttp import web

    from simulate.fakes.processes import free_port
    from spotdrain.kube_rest import call
    from spotdrain.retry import ApiError

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "query": dict(request.query)})

    app = web.Application()
    app.router.add_get("/{tail:.*}", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        for name, address in (("here", "127.0.0.1"), ("elsewhere", "10.1.2.3"), ("linklocal", "169.254.169.254")):
            pod = kube.add_pod("spotdrain", name, node="n1")
            pod["status"]["podIP"] = address
            kube.store.update(PODS, pod)
        cluster = InCluster.from_environment(kube.serviceaccount_dir(tmp_path / "sa"), kube.service_env())
        async with aiohttp.ClientSession() as session:
            answer = await call(
                session, cluster, "GET", f"/api/v1/namespaces/spotdrain/pods/here:{port}/proxy/v1/status?a=1"
            )
            assert answer == {"path": "/v1/status", "query": {"a": "1"}}
            with pytest.raises(ApiError, match="loopback addresses only") as refused:
                await call(session, cluster, "GET", f"/api/v1/namespaces/spotdrain/pods/elsewhere:{port}/proxy/")
            assert refused.value.status == 503
            with pytest.raises(ApiError, match="address not allowed") as refused:
                await call(session, cluster, "GET", f"/api/v1/namespaces/spotdrain/pods/linklocal:{port}/proxy/")
            assert refused.value.status == 400
    finally:
        await runner.cleanup()


async def test_a_node_created_through_the_api_is_not_ready_until_its_taint_is_taken_off(
    kube: FakeKube, tmp_path: Path
) -> None:
    from spotdrain.kube_rest import call

    cluster = InCluster.from_environment(kube.serviceaccount_dir(tmp_path / "sa"), kube.service_env())
    body = {"metadata": {"name": "n3"}, "spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}}
    async with aiohttp.ClientSession() as session:
        created = await call(session, cluster, "POST", "/api/v1/nodes", body)
    assert created["spec"]["taints"] == [
        {"key": "gpu", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"},
    ]
