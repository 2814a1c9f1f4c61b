"""The webhook's answers to AdmissionReview documents: a labelled Pod gets the sidecar exactly as ``spotdrain
inject`` gives it to a pod template; anything it cannot or need not inject is admitted unchanged, never denied."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from inject.manifest import inject_text
from inject.spec import Options
from webhook.admission import LABEL, BadReview, review

Obj = dict[str, Any]
OPTIONS = Options()
PICK = "name the engine's with --container NAME"


def vllm_pod(labels: dict[str, str] | None = None) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "vllm-7d9f-", "namespace": "inference", "labels": labels or {}},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.11.0",
                    "args": ["--model", "Qwen/Qwen2.5-7B-Instruct"],
                    "ports": [{"containerPort": 8000}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def admission_review(
    pod: Any, *, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002", operation: str = "CREATE"
) -> bytes:
    """A request as the API server sends it (fields from admission.k8s.io/v1 AdmissionRequest)."""
    request = {
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "inference",
        "operation": operation,
        "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
        "object": pod,
        "oldObject": None,
        "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
    }
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def patched(pod: Obj, answer: Obj) -> Obj:
    response = answer["response"]
    if "patch" not in response:
        return pod
    assert response["patchType"] == "JSONPatch"
    operations = json.loads(base64.b64decode(response["patch"]))
    result: Obj = jsonpatch.apply_patch(pod, operations)
    return result


def test_a_labelled_pod_gets_the_sidecar_as_inject_gives_it_to_a_template() -> None:
    pod = vllm_pod({LABEL: "true"})
    answer = review(admission_review(pod), OPTIONS)
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert answer["response"]["allowed"] is True
    assert "warnings" not in answer["response"]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm"},
        "spec": {"selector": {}, "template": {"metadata": {}, "spec": pod["spec"]}},
    }
    injected = yaml.safe_load(inject_text(yaml.safe_dump(deployment), OPTIONS).text)
    after = patched(pod, answer)
    assert after["spec"] == injected["spec"]["template"]["spec"]
    assert [c["name"] for c in after["spec"]["containers"]] == ["vllm", "spotdrain"]
    assert after["metadata"] == pod["metadata"]


def test_the_webhooks_inject_options_shape_the_sidecar() -> None:
    options = Options(image="registry.local/sidecar:1", drain_timeout_s=300, readiness_gate=True)
    after = patched(vllm_pod({LABEL: "true"}), review(admission_review(vllm_pod({LABEL: "true"})), options))
    sidecar = after["spec"]["containers"][1]
    assert sidecar["image"] == "registry.local/sidecar:1"
    assert sidecar["args"][sidecar["args"].index("--drain-timeout") + 1] == "300"
    assert after["spec"]["readinessGates"] == [{"conditionType": "spotdrain.io/serving"}]
    assert after["spec"]["terminationGracePeriodSeconds"] == 320


def test_an_unlabelled_pod_is_injected_because_only_its_namespaces_selector_can_have_sent_it() -> None:
    # The review holds no namespace labels: a Pod without its own label came through the namespaceSelector.
    answer = review(admission_review(vllm_pod()), OPTIONS)
    assert len(patched(vllm_pod(), answer)["spec"]["containers"]) == 2


@pytest.mark.parametrize("value", ["false", "no", ""])
def test_a_pod_whose_own_label_says_other_than_true_is_left_alone(value: str) -> None:
    answer = review(admission_review(vllm_pod({LABEL: value})), OPTIONS)
    assert answer["response"] == {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": True}


def test_a_pod_that_already_has_the_sidecar_comes_back_unchanged() -> None:
    pod = patched(vllm_pod({LABEL: "true"}), review(admission_review(vllm_pod({LABEL: "true"})), OPTIONS))
    answer = review(admission_review(pod), OPTIONS)
    assert answer["response"] == {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": True}


def test_a_pod_with_no_engine_is_admitted_unchanged_with_a_warning_naming_its_containers() -> None:
    pod = vllm_pod({LABEL: "true"})
    pod["spec"]["containers"] = [{"name": "web", "image": "nginx:1.27"}, {"name": "cache", "image": "redis:7"}]
    response = review(admission_review(pod), OPTIONS)["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    reason = "no vLLM, TGI or SGLang container found among web (nginx:1.27), cache (redis:7)"
    assert response["warnings"] == [f"spotdrain: the sidecar was not added: {reason}; {PICK}"]


def test_the_webhook_and_inject_give_the_same_reason_for_a_pod_without_an_engine() -> None:
    pod = vllm_pod({LABEL: "true"})
    pod["spec"]["containers"] = [{"name": "web", "image": "nginx:1.27"}]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {"selector": {}, "template": {"metadata": {}, "spec": pod["spec"]}},
    }
    for options in (OPTIONS, Options(container="engine")):
        [warning] = review(admission_review(pod), options)["response"]["warnings"]
        [skipped] = [p.outcome.skipped for p in inject_text(yaml.safe_dump(deployment), options).pods]
        assert warning == f"spotdrain: the sidecar was not added: {skipped}"


def test_a_pod_with_its_own_prestop_is_admitted_unchanged_with_a_warning() -> None:
    pod = vllm_pod({LABEL: "true"})
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "30"]}}}
    response = review(admission_review(pod), OPTIONS)["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    assert "already has a preStop hook" in response["warnings"][0]


def test_a_pod_using_the_sidecars_port_is_admitted_unchanged_with_a_warning() -> None:
    pod = vllm_pod({LABEL: "true"})
    pod["spec"]["containers"][0]["ports"].append({"containerPort": 8081})
    response = review(admission_review(pod), OPTIONS)["response"]
    assert "patch" not in response
    assert "uses port 8081" in response["warnings"][0]


def test_a_missing_container_named_by_the_webhook_is_a_warning_not_a_denial() -> None:
    response = review(admission_review(vllm_pod({LABEL: "true"})), Options(container="engine"))["response"]
    assert response["allowed"] is True
    assert "no container named 'engine' (--container) among vllm (vllm/vllm-openai:v0.11.0)" in response["warnings"][0]


def test_a_grace_period_of_the_pods_that_is_raised_is_named_in_a_warning() -> None:
    pod = vllm_pod({LABEL: "true"})
    pod["spec"]["terminationGracePeriodSeconds"] = 60
    response = review(admission_review(pod), OPTIONS)["response"]
    assert patched(pod, {"response": response})["spec"]["terminationGracePeriodSeconds"] == 130
    [warning] = response["warnings"]
    assert warning.startswith("spotdrain: terminationGracePeriodSeconds raised from 60 to 130: ")


def test_the_engines_own_readiness_probe_is_not_patched() -> None:
    pod = vllm_pod({LABEL: "true"})
    probe = {"httpGet": {"path": "/health", "port": 8000}, "initialDelaySeconds": 60}
    pod["spec"]["containers"][0]["readinessProbe"] = probe
    operations = json.loads(base64.b64decode(review(admission_review(pod), OPTIONS)["response"]["patch"]))
    assert [o for o in operations if "/spec/containers/0/readinessProbe" in o["path"]] == []
    after = patched(pod, review(admission_review(pod), OPTIONS))
    assert after["spec"]["containers"][0]["readinessProbe"] == probe
    assert after["spec"]["containers"][1]["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8081}


def test_a_long_warning_is_cut_to_what_the_api_server_keeps() -> None:
    pod = vllm_pod({LABEL: "true"})
    pod["spec"]["containers"] = [{"name": f"c{i:03}", "image": "busybox"} for i in range(100)]
    assert len(review(admission_review(pod), OPTIONS)["response"]["warnings"][0]) == 256


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT"])
def test_only_a_creation_is_mutated(operation: str) -> None:
    answer = review(admission_review(vllm_pod({LABEL: "true"}), operation=operation), OPTIONS)
    assert "patch" not in answer["response"]


def test_an_object_that_is_not_a_pod_is_admitted_unchanged() -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {}, "spec": {}}
    assert "patch" not in review(admission_review(deployment), OPTIONS)["response"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[]",
        b'{"kind": "AdmissionReview"}',
        b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}}',
        b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": ""}}',
        b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": []}',
        b"[" * 100_000,
    ],
)
def test_garbage_is_a_bad_review(body: bytes) -> None:
    with pytest.raises(BadReview):
        review(body, OPTIONS)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


CONTAINER_KEYS = ("name", "args", "command", "ports", "lifecycle", "volumeMounts", "resources", "readinessProbe")
SPEC_KEYS = ("initContainers", "volumes", "terminationGracePeriodSeconds", "readinessGates")
CONTAINER = st.dictionaries(st.sampled_from(CONTAINER_KEYS), JSON, max_size=4).map(lambda c: {"image": "vllm", **c})
SPEC = st.fixed_dictionaries(
    {"containers": st.lists(CONTAINER, max_size=2) | JSON}, optional={k: JSON for k in SPEC_KEYS}
)


@given(spec=SPEC | JSON, labels=JSON)
def test_any_pod_shape_is_admitted_and_patched_only_when_it_changes(spec: Any, labels: Any) -> None:
    # Fields of the right names with values of any shape: the webhook never raises, and never denies.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": labels}, "spec": spec}
    answer = review(admission_review(copy.deepcopy(pod)), OPTIONS)
    assert answer["response"]["allowed"] is True
    after = patched(copy.deepcopy(pod), answer)
    assert ("patch" in answer["response"]) == (after != pod)
    if "patch" in answer["response"]:
        assert after["spec"]["containers"][-1]["name"] == "spotdrain"
