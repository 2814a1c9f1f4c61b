"""The same requests to the fake Kubernetes API and to the real API server, answered alike: status codes, reasons,
messages and the fields spotdrain reads. Where they differed, the fake was changed (each change cites the real
behaviour beside it in simulate/fakes)."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from simulate.fakes.kube import FakeKube
from tests.conftest import Kube
from tests.control_plane import ControlPlane
from tests.real_kube import RealKube

Obj = dict[str, Any]
MERGE = "application/merge-patch+json"
STATUS_FIELDS = ("kind", "status", "reason", "message", "code")


@pytest.fixture
async def both(control_plane: ControlPlane) -> AsyncIterator[tuple[Kube, Kube]]:
    async with FakeKube() as fake, RealKube(control_plane) as real:
        yield fake, real


async def ask(
    kube: Kube, method: str, path: str, body: Obj | None = None, *, content_type: str = "application/json",
    token: str | None = None,
) -> tuple[int, Obj]:  # fmt: skip
    """One request as a client sends it: (HTTP status, JSON answer)."""
    headers = {"Authorization": f"Bearer {token or kube.token}", "Content-Type": content_type}
    context = ssl.create_default_context(cafile=str(kube.ca_path))
    async with httpx.AsyncClient(base_url=kube.url, verify=context, timeout=10) as client:
        answer = await client.request(method, path, content=json.dumps(body) if body else None, headers=headers)
        parsed: Obj = answer.json()
        return answer.status_code, parsed


async def watch(kube: Kube, path: str) -> list[Obj]:
    """The events of a watch that ends on its own (``timeoutSeconds`` in ``path``)."""
    context = ssl.create_default_context(cafile=str(kube.ca_path))
    headers = {"Authorization": f"Bearer {kube.token}"}
    async with (
        httpx.AsyncClient(base_url=kube.url, verify=context, timeout=15, headers=headers) as client,
        client.stream("GET", path) as stream,
    ):
        return [json.loads(line) async for line in stream.aiter_lines() if line.strip()]


def status(answer: tuple[int, Obj]) -> tuple[int, Obj]:
    """What a client reads from a Status answer: code, kind, reason, message, the details' name, kind and causes."""
    code, body = answer
    details = body.get("details") or {}
    read = {k: body.get(k) for k in STATUS_FIELDS} | {k: details.get(k) for k in ("name", "kind", "causes")}
    return code, read


async def on_both(both: tuple[Kube, Kube], method: str, path: str, body: Obj | None = None, **kw: Any) -> list[
    tuple[int, Obj]
]:  # fmt: skip
    return [await ask(kube, method, path, body, **kw) for kube in both]


# Node patches ---------------------------------------------------------------------------------------------------


async def test_a_node_patch_with_a_stale_resource_version_is_the_same_conflict(both: tuple[Kube, Kube]) -> None:
    for kube in both:
        kube.add_node("gpu-1")
    stale = {"metadata": {"resourceVersion": "1"}, "spec": {"unschedulable": True}}
    fake, real = [status(a) for a in await on_both(both, "PATCH", "/api/v1/nodes/gpu-1", stale, content_type=MERGE)]
    assert fake == real
    assert fake[0] == 409
    assert fake[1]["message"] == (
        'Operation cannot be fulfilled on nodes "gpu-1": the object has been modified; please apply your changes to '
        "the latest version and try again"
    )
    for kube in both:
        current = {"metadata": {"resourceVersion": kube.node("gpu-1")["metadata"]["resourceVersion"]}}
        code, node = await ask(kube, "PATCH", "/api/v1/nodes/gpu-1", current | {"spec": {"unschedulable": True}},
                               content_type=MERGE)  # fmt: skip
        assert (code, node["spec"]["unschedulable"]) == (200, True)


async def test_a_node_created_through_the_api_gets_the_not_ready_taint(both: tuple[Kube, Kube]) -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-9"},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}  # fmt: skip
    answers = await on_both(both, "POST", "/api/v1/nodes", node)
    assert [code for code, _ in answers] == [201, 201]
    fake, real = [body["spec"]["taints"] for _, body in answers]
    assert (
        fake
        == real
        == [
            {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"},
        ]
    )


async def test_a_namespace_is_labelled_with_its_name_for_good(both: tuple[Kube, Kube]) -> None:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "named", "labels": {"team": "llm"}}}
    created = await on_both(both, "POST", "/api/v1/namespaces", namespace)
    unlabel = {"metadata": {"labels": {"kubernetes.io/metadata.name": None, "team": None}}}
    patched = await on_both(both, "PATCH", "/api/v1/namespaces/named", unlabel, content_type=MERGE)
    fake, real = both
    await ask(fake, "DELETE", "/api/v1/namespaces/named")
    # No namespace controller runs to finalize the real one: take its finalizer off as that controller does.
    code, terminating = await ask(real, "DELETE", "/api/v1/namespaces/named")
    assert code == 200
    terminating["spec"]["finalizers"] = []
    assert (await ask(real, "PUT", "/api/v1/namespaces/named/finalize", terminating))[0] == 200
    labels = {"team": "llm", "kubernetes.io/metadata.name": "named"}
    assert [(code, body["metadata"]["labels"]) for code, body in created] == [(201, labels)] * 2
    assert [(code, body["metadata"]["labels"]) for code, body in patched] == [
        (200, {"kubernetes.io/metadata.name": "named"})
    ] * 2


async def test_a_dry_run_patch_answers_the_change_and_stores_nothing(both: tuple[Kube, Kube]) -> None:
    versions = []
    for kube in both:
        kube.add_node("gpu-1")
        versions.append(kube.node("gpu-1")["metadata"]["resourceVersion"])
    change = {"spec": {"unschedulable": True}}
    answers = await on_both(both, "PATCH", "/api/v1/nodes/gpu-1?dryRun=All", change, content_type=MERGE)
    assert [(code, body["spec"].get("unschedulable")) for code, body in answers] == [(200, True), (200, True)]
    assert [body["metadata"]["resourceVersion"] for _, body in answers] == versions
    assert [kube.node("gpu-1")["spec"].get("unschedulable") for kube in both] == [None, None]
    refused = await on_both(both, "PATCH", "/api/v1/nodes/gpu-1?dryRun=Some", change, content_type=MERGE)
    assert status(refused[0]) == status(refused[1])
    assert refused[0][0] == 422
    assert status(refused[0])[1]["causes"] == [
        {"reason": "FieldValueNotSupported", "message": 'Unsupported value: ["Some"]: supported values: "All"',
         "field": "dryRun"}
    ]  # fmt: skip


# Evictions under budgets ----------------------------------------------------------------------------------------

BUDGETS = {  # name: (pods as (name, ready), minAvailable, unhealthyPodEvictionPolicy)
    "full": ((("full-0", True), ("full-1", True)), 2, None),
    "spare": ((("spare-0", True), ("spare-1", True)), 1, None),
    "sick": ((("sick-0", False),), 1, None),
    "sick-allowed": ((("sick-allowed-0", False), ("sick-allowed-1", True)), 1, "AlwaysAllow"),
}
BUDGET_STATUS = ("disruptionsAllowed", "currentHealthy", "desiredHealthy", "expectedPods")


def eviction(name: str) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": "ml"}}


def budget_status(kube: Kube, name: str) -> Obj:
    found = kube.pdb("ml", name) or {}
    return {k: found.get("status", {}).get(k) for k in BUDGET_STATUS}


async def test_evictions_under_budgets_are_answered_alike(both: tuple[Kube, Kube]) -> None:
    for kube in both:
        kube.add_node("gpu-1")
        for budget, (pods, min_available, policy) in BUDGETS.items():
            for pod, ready in pods:
                kube.add_pod("ml", pod, node="gpu-1", labels={"budget": budget}, ready=ready)
            kube.add_pdb("ml", budget, selector={"budget": budget}, min_available=min_available,
                         unhealthy_pod_eviction_policy=policy)  # fmt: skip
    fake, real = both
    for budget in BUDGETS:  # the disruption controller's figures, which the fake computes as it does
        assert budget_status(fake, budget) == budget_status(real, budget), budget
    for pod in ("full-0", "sick-0", "sick-allowed-0", "spare-0", "gone"):
        path = f"/api/v1/namespaces/ml/pods/{pod}/eviction"
        dry = await on_both(both, "POST", f"{path}?dryRun=All", eviction(pod))
        answers = await on_both(both, "POST", path, eviction(pod))
        assert status(answers[0]) == status(answers[1]), pod
        assert status(dry[0]) == status(dry[1]) == (status(answers[0]) if pod != "spare-0" else status(dry[0])), pod
    assert status(answers[0])[1]["message"] == 'pods "gone" not found'
    for kube in both:
        assert (kube.pod("ml", "full-0") or {}).get("metadata", {}).get("deletionTimestamp") is None
        assert (kube.pod("ml", "spare-0") or {})["metadata"]["deletionTimestamp"]
    assert budget_status(fake, "spare")["disruptionsAllowed"] == budget_status(real, "spare")["disruptionsAllowed"] == 0


async def test_a_refused_eviction_names_the_budget_and_its_figures(both: tuple[Kube, Kube]) -> None:
    for kube in both:
        kube.add_node("gpu-1")
        for index in range(2):
            kube.add_pod("ml", f"vllm-{index}", node="gpu-1", labels={"app": "vllm"})
        kube.add_pdb("ml", "vllm", selector={"app": "vllm"}, min_available=2)
    answers = await on_both(both, "POST", "/api/v1/namespaces/ml/pods/vllm-0/eviction", eviction("vllm-0"))
    assert status(answers[0]) == status(answers[1])
    code, read = status(answers[0])
    assert (code, read["reason"], read["message"]) == (
        429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget."
    )  # fmt: skip
    assert read["causes"] == [
        {"reason": "DisruptionBudget", "message": "The disruption budget vllm needs 2 healthy pods and has 2 currently"}
    ]


# Watches --------------------------------------------------------------------------------------------------------


async def test_a_watch_resumed_from_a_version_gets_every_change_since(both: tuple[Kube, Kube]) -> None:
    seen = []
    for kube in both:
        kube.add_node("gpu-1")
        since = kube.node("gpu-1")["metadata"]["resourceVersion"]
        kube.annotate_node("gpu-1", {"spotdrain.io/step": "1"})
        kube.annotate_node("gpu-1", {"spotdrain.io/step": "2"})
        events = await watch(kube, f"/api/v1/nodes?watch=true&resourceVersion={since}&timeoutSeconds=1")
        seen.append([(e["type"], e["object"]["metadata"]["annotations"]["spotdrain.io/step"]) for e in events])
    assert seen[0] == seen[1] == [("MODIFIED", "1"), ("MODIFIED", "2")]


async def test_a_watch_sends_a_bookmark_for_changes_its_selector_leaves_out(both: tuple[Kube, Kube]) -> None:
    """The real server sends a bookmark shortly before a watch's timeout, at the newest version it knows of; the
    change to gpu-2 is that version, though the watch of gpu-1 does not see it."""

    async def bookmarks(kube: Kube) -> tuple[list[Obj], str]:
        kube.add_node("gpu-1")
        kube.add_node("gpu-2")
        since = kube.node("gpu-2")["metadata"]["resourceVersion"]
        path = "/api/v1/nodes?watch=true&allowWatchBookmarks=true&timeoutSeconds=4&fieldSelector=metadata.name%3Dgpu-1"
        watching = asyncio.create_task(watch(kube, f"{path}&resourceVersion={since}"))
        await asyncio.sleep(0.3)
        kube.annotate_node("gpu-2", {"spotdrain.io/termination-time": "2026-12-01T10:00:00Z"})
        return await watching, kube.node("gpu-2")["metadata"]["resourceVersion"]

    for events, version in await asyncio.gather(*(bookmarks(kube) for kube in both)):
        assert {e["type"] for e in events} == {"BOOKMARK"}
        # At least the change to gpu-2: on the real control plane other writes (the controller-manager's leases) may
        # land before the bookmark and move the newest version on. Both servers count versions up as etcd does.
        assert int(events[-1]["object"]["metadata"]["resourceVersion"]) >= int(version)
        assert {e["object"]["kind"] for e in events} == {"Node"}


async def test_a_watch_of_a_quiet_store_gets_no_bookmark(both: tuple[Kube, Kube]) -> None:
    async def events(kube: Kube) -> list[Obj]:
        kube.add_node("gpu-1")
        since = kube.node("gpu-1")["metadata"]["resourceVersion"]
        path = "/api/v1/nodes?watch=true&allowWatchBookmarks=true&timeoutSeconds=3&fieldSelector=metadata.name%3Dgpu-1"
        return await watch(kube, f"{path}&resourceVersion={since}")

    assert await asyncio.gather(*(events(kube) for kube in both)) == [[], []]


GONE = {
    "type": "ERROR",
    "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": "The resourceVersion for the provided watch is too old.", "reason": "Expired", "code": 410},
}  # fmt: skip


async def test_a_watch_from_before_a_compaction_gets_a_410_error_event_and_a_new_list_resumes(
    both: tuple[Kube, Kube],
) -> None:
    """Events have no watch cache, so their watches are served from etcd, whose history a compaction ends (the API
    server compacts every 5 minutes; the test does it at once). Other resources' watch caches cannot be made to
    forget cheaply: each grows its window, up to 102400 changes, while they are under 75 s old
    (watch_cache_history.go ``resizeCacheLocked``), and here holds every change since the server started, so even a
    watch from resourceVersion 1 is served. A watch from before the compaction: 200, one ERROR event with a 410
    Expired Status, and the end of the stream; a list then gives a version a watch resumes from."""
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "reclaim"}, "reason": "SpotInterruption",
             "involvedObject": {"kind": "Node", "name": "gpu-1"}, "message": "1"}  # fmt: skip
    path = "/api/v1/namespaces/default/events"  # where a node's events go, as the agent writes them
    expired, resumed = [], []
    for kube in both:
        code, made = await ask(kube, "POST", path, event)
        assert code == 201
        for step in ("2", "3"):  # a watch from the creation starts at its next revision: compact past that one
            await ask(kube, "PATCH", f"{path}/reclaim", {"message": step}, content_type=MERGE)
        kube.compact()
        since = made["metadata"]["resourceVersion"]
        for watched in (path, "/apis/events.k8s.io/v1/namespaces/default/events"):
            async with asyncio.timeout(5):  # the stream ends after the error, not at timeoutSeconds
                expired.append(await watch(kube, f"{watched}?watch=true&resourceVersion={since}&timeoutSeconds=60"))
        code, listed = await ask(kube, "GET", path)
        await ask(kube, "PATCH", f"{path}/reclaim", {"message": "4"}, content_type=MERGE)
        events = await watch(kube, f"{path}?watch=true&resourceVersion={listed['metadata']['resourceVersion']}"
                                   "&timeoutSeconds=1")  # fmt: skip
        resumed.append([(code, e["type"], e["object"]["message"]) for e in events])
    assert expired == [[GONE]] * 4
    assert resumed == [[(200, "MODIFIED", "4")]] * 2


# Who a token is --------------------------------------------------------------------------------------------------


async def test_reviews_name_a_service_account_token_alike(both: tuple[Kube, Kube]) -> None:
    user = "system:serviceaccount:ml:reviewer"
    tokens = [kube.issue_token(user) for kube in both]
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    selves = [await ask(k, "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", review, token=t)
              for k, t in zip(both, tokens, strict=True)]  # fmt: skip
    read = [
        (code, body["status"]["userInfo"]["username"], body["status"]["userInfo"]["groups"]) for code, body in selves
    ]
    assert read[0] == read[1] == (
        201, user, ["system:serviceaccounts", "system:serviceaccounts:ml", "system:authenticated"]
    )  # fmt: skip
    path = "/apis/authentication.k8s.io/v1/tokenreviews"
    reviewed = []
    for kube, token in zip(both, tokens, strict=True):  # each server knows its own token only
        for asked in (token, "not-a-token"):
            body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": asked}}
            code, answer = await ask(kube, "POST", path, body)
            found = answer["status"]
            reviewed.append((code, found.get("authenticated"), found["user"].get("username"), found.get("error")))
    assert reviewed[:2] == reviewed[2:] == [(201, True, user, None), (201, None, None, "invalid bearer token")]
