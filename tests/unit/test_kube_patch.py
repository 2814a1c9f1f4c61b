"""The fake Kubernetes API's pure rules: selectors, the three patch types, routes, budgets and update strategies."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulate.fakes import kube_objects
from simulate.fakes.kube_budget import disruption_budget, eviction_refusal
from simulate.fakes.kube_patch import apply_patch, json_patch, merge_patch, strategic_merge
from simulate.fakes.kube_resources import NODES, PODS, route
from simulate.fakes.kube_select import KubeError, labels_match, parse_field_selector, parse_label_selector
from simulate.fakes.kube_store import confine

NOW = datetime(2026, 11, 29, 10, 22, tzinfo=UTC)
LABELS = {"app": "web", "tier": "front", "version": "3", "example.com/team": "ml"}


@pytest.mark.parametrize(
    ("selector", "selected"),
    [
        ("", True),
        ("app=web", True),
        ("app==web,tier=front", True),
        ("app!=web", False),
        ("missing!=x", True),
        ("app", True),
        ("!app", False),
        ("!missing", True),
        ("app in (api, web)", True),
        ("app notin (web)", False),
        ("missing notin (web)", True),
        ("example.com/team=ml", True),
        ("version>2,version<4", True),
        ("version>3", False),
        ("tier=", False),
        ("  app = web ,  tier in (front)  ", True),
    ],
)
def test_label_selectors_select_as_the_api_server_does(selector: str, selected: bool) -> None:
    assert labels_match(parse_label_selector(selector), LABELS) is selected


@pytest.mark.parametrize("selector", ["a=b,", "app in web", "app in (web", "=web", "a b", "app=we b", "x>y", "-a=b"])
def test_malformed_label_selectors_are_bad_requests(selector: str) -> None:
    with pytest.raises(KubeError) as raised:
        parse_label_selector(selector)
    assert raised.value.code == 400


SELECTOR_TEXT = st.text(alphabet=st.sampled_from("ab/.-_=!,() <>01 innotx"), max_size=30) | st.text(max_size=30)


@given(SELECTOR_TEXT)
def test_no_label_selector_crashes_the_parser(text: str) -> None:
    codes = set()
    try:
        parse_label_selector(text)
    except KubeError as error:
        codes.add(error.code)
    assert codes <= {400}


@given(SELECTOR_TEXT)
def test_no_field_selector_crashes_the_parser(text: str) -> None:
    codes = set()
    try:
        parse_field_selector(text, PODS.fields)
    except KubeError as error:
        codes.add(error.code)
    assert codes <= {400}


def test_field_selectors_accept_only_the_fields_of_the_resource() -> None:
    assert parse_field_selector("spec.nodeName=n1,status.phase!=Succeeded", PODS.fields) == [
        ("spec.nodeName", "=", "n1"),
        ("status.phase", "!=", "Succeeded"),
    ]
    with pytest.raises(KubeError, match=r"field label not supported: spec\.nodeName"):
        parse_field_selector("spec.nodeName=n1", NODES.fields)


def test_merge_patch_follows_rfc_7386() -> None:
    target = {"a": "b", "c": {"d": "e", "f": "g"}, "list": [1, 2]}
    patch = {"a": "z", "c": {"f": None}, "list": [3], "new": {"x": None, "y": 1}}
    assert merge_patch(target, patch) == {"a": "z", "c": {"d": "e"}, "list": [3], "new": {"y": 1}}


def test_strategic_merge_merges_keyed_lists_and_replaces_atomic_ones() -> None:
    node = {
        "metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
        "spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Disk", "status": "False"}]},
    }
    patch: dict[str, Any] = {
        "metadata": {"labels": {"a": None, "c": "3"}, "finalizers": ["y", "x"]},
        "spec": {"taints": [{"key": "spot", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Disk", "$patch": "delete"}, {"type": "Ready", "status": "False"}]},
    }
    assert strategic_merge(node, patch) == {
        "metadata": {"labels": {"b": "2", "c": "3"}, "finalizers": ["x", "y"]},
        "spec": {"taints": [{"key": "spot", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }


def test_strategic_merge_appends_new_items_and_deletes_from_primitive_lists() -> None:
    pod = {"metadata": {"finalizers": ["a", "b"]}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    patch = {
        "metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]},
        "status": {"conditions": [{"type": "spotdrain.io/serving", "status": "True"}]},
    }
    merged = strategic_merge(pod, patch)
    assert merged["metadata"]["finalizers"] == ["b"]
    assert [c["type"] for c in merged["status"]["conditions"]] == ["Ready", "spotdrain.io/serving"]


def test_a_delete_directive_for_a_list_the_object_lacks_adds_nothing() -> None:
    patch = {"status": {"conditions": [{"type": "Disk", "$patch": "delete"}, {"type": "Ready", "status": "True"}]}}
    assert strategic_merge({}, patch) == {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_keyed_list_item_without_its_key_is_a_bad_request() -> None:
    with pytest.raises(KubeError) as raised:
        strategic_merge({"status": {"conditions": []}}, {"status": {"conditions": [{"status": "True"}]}})
    assert raised.value.code == 400


def test_json_patch_applies_rfc_6902_operations_in_order() -> None:
    document: dict[str, Any] = {"spec": {"taints": [{"key": "a"}]}, "metadata": {"labels": {"x/y": "1"}}}
    operations = [
        {"op": "add", "path": "/spec/taints/-", "value": {"key": "b"}},
        {"op": "add", "path": "/spec/taints/0", "value": {"key": "first"}},
        {"op": "replace", "path": "/metadata/labels/x~1y", "value": "2"},
        {"op": "copy", "from": "/metadata/labels", "path": "/metadata/annotations"},
        {"op": "move", "from": "/spec/taints/1", "path": "/spec/moved"},
        {"op": "remove", "path": "/metadata/labels"},
        {"op": "test", "path": "/spec/moved/key", "value": "a"},
    ]
    assert json_patch(document, operations) == {
        "spec": {"taints": [{"key": "first"}, {"key": "b"}], "moved": {"key": "a"}},
        "metadata": {"annotations": {"x/y": "2"}},
    }
    assert document["spec"]["taints"] == [{"key": "a"}]  # the input is left alone


@pytest.mark.parametrize(
    "operation",
    [
        {"op": "test", "path": "/spec/unschedulable", "value": 1},  # true is not 1
        {"op": "remove", "path": "/spec/missing"},
        {"op": "replace", "path": "/spec/taints/5", "value": {}},
        {"op": "add", "path": "/nothing/here", "value": 1},
        {"op": "frobnicate", "path": "/spec"},
    ],
)
def test_a_json_patch_operation_that_does_not_apply_is_unprocessable(operation: dict[str, Any]) -> None:
    with pytest.raises(KubeError) as raised:
        json_patch({"spec": {"unschedulable": True, "taints": []}}, [operation])
    assert (raised.value.code, raised.value.reason) == (422, "Invalid")


def test_an_unknown_patch_type_is_unsupported_media() -> None:
    with pytest.raises(KubeError) as raised:
        apply_patch("application/apply-patch+yaml", {}, {})
    assert raised.value.code == 415
    with pytest.raises(KubeError) as raised:
        apply_patch("application/merge-patch+json", {}, [])
    assert raised.value.code == 400


@pytest.mark.parametrize(
    ("path", "pattern"),
    [
        ("/api/v1/pods", "/api/v1/pods"),
        ("/api/v1/nodes/n1/status", "/api/v1/nodes/{name}/status"),
        ("/api/v1/namespaces/ns/pods/p/eviction", "/api/v1/namespaces/{namespace}/pods/{name}/eviction"),
        ("/apis/events.k8s.io/v1/namespaces/ns/events", "/apis/events.k8s.io/v1/namespaces/{namespace}/events"),
        (
            "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/b",
            "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
        ),
    ],
)
def test_api_paths_route_to_their_resource(path: str, pattern: str) -> None:
    target = route(path)
    assert target is not None
    assert target.pattern == pattern


@pytest.mark.parametrize(
    "path", ["/api/v1/pods/p", "/api/v1/namespaces/ns/nodes", "/api/v1/nodes/n/eviction", "/api/v1/configmaps", "/x"]
)
def test_paths_the_server_does_not_serve_route_nowhere(path: str) -> None:
    assert route(path) is None


def _pod(name: str, *, ready: bool = True, phase: str = "Running", terminating: bool = False) -> dict[str, Any]:
    pod = kube_objects.pod(
        "default",
        name,
        node_name="n1",
        node_uid=None,
        labels={"app": "web"},
        annotations=None,
        owner_kind="ReplicaSet",
        mirror=False,
        phase=phase,
        ready=ready,
        grace_period_s=30,
        readiness_gates=(),
        now=NOW,
    )
    if terminating:
        pod["metadata"]["deletionTimestamp"] = "2026-11-29T10:23:00Z"
    return pod


def _pdb(**spec: int | str) -> dict[str, Any]:
    return kube_objects.pdb(
        "default",
        "web",
        selector={"app": "web"},
        min_available=spec.get("min_available"),
        max_unavailable=spec.get("max_unavailable"),
    )


@pytest.mark.parametrize(
    ("spec", "desired", "allowed"),
    [
        ({"min_available": 1}, 1, 2),
        ({"min_available": 3}, 3, 0),
        ({"min_available": "50%"}, 3, 0),  # percentages round up
        ({"max_unavailable": 1}, 4, 0),
        ({"max_unavailable": "50%"}, 2, 1),
        ({}, 0, 0),
    ],
)
def test_the_budget_counts_ready_pods_that_are_not_terminating(
    spec: dict[str, int | str], desired: int, allowed: int
) -> None:
    pods = [_pod("a"), _pod("b"), _pod("c", terminating=True), _pod("d", ready=False), _pod("e")]
    budget = disruption_budget(_pdb(**spec), pods)
    assert (budget.expected, budget.current_healthy) == (len(pods) if spec else 0, 3)
    assert (budget.desired_healthy, budget.allowed) == (desired, allowed)


def test_an_eviction_is_refused_only_when_the_budget_has_no_room() -> None:
    pods = [_pod("a"), _pod("b"), _pod("unready", ready=False), _pod("pending", phase="Pending", ready=False)]
    pdb = _pdb(min_available=2)
    refusal = eviction_refusal(pods[0], pdbs=[pdb], pods=pods)
    assert refusal is not None
    assert refusal.code == 429
    assert eviction_refusal(pods[2], pdbs=[pdb], pods=pods) is None  # unready, and the budget is met
    assert eviction_refusal(pods[3], pdbs=[pdb], pods=pods) is None  # pending pods are never held
    assert eviction_refusal(pods[0], pdbs=[], pods=pods) is None
    twice = eviction_refusal(pods[0], pdbs=[pdb, _pdb(min_available=0)], pods=pods)
    assert twice is not None
    assert twice.code == 500


def test_writes_to_a_pod_keep_status_and_writes_to_its_status_keep_spec() -> None:
    stored = _pod("a") | {"kind": "Pod", "apiVersion": "v1"}
    stored["metadata"] |= {"uid": "u1", "resourceVersion": "7"}
    changed = {**stored, "spec": {"nodeName": "elsewhere"}, "status": {"phase": "Failed"}}
    changed["metadata"] = {**stored["metadata"], "uid": "forged", "labels": {}}
    main = confine(PODS, None, stored, changed)
    assert (main["spec"]["nodeName"], main["status"]["phase"], main["metadata"]["uid"]) == (
        "elsewhere",
        "Running",
        "u1",
    )
    assert "labels" not in main["metadata"]  # empty maps are omitted, as the server encodes them
    status = confine(PODS, "status", stored, changed)
    assert (status["spec"]["nodeName"], status["status"]["phase"]) == ("n1", "Failed")


def test_a_mirror_pod_carries_the_kubelet_annotation_and_its_node_as_owner() -> None:
    pod = kube_objects.pod(
        "kube-system",
        "etcd-n1",
        node_name="n1",
        node_uid="node-uid",
        labels=None,
        annotations=None,
        owner_kind=None,
        mirror=True,
        phase="Running",
        ready=True,
        grace_period_s=30,
        readiness_gates=(),
        now=NOW,
    )
    assert "kubernetes.io/config.mirror" in pod["metadata"]["annotations"]
    (owner,) = pod["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", "n1", "node-uid")
