"""Every rendered object fits the schema of its kind: the upstream CRD's for Karpenter, KEDA, the Prometheus
Operator and KubeRay (structural schema, unknown fields refused), Kubernetes' own (strict) for the rest."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.manifests import (
    CRDS,
    WITHOUT_SHARED_CRD,
    crd_validators,
    is_custom,
    one,
    render,
    renderings,
    schema_errors,
    structural,
    without_crd,
)


@pytest.mark.parametrize("directory", renderings())
def test_every_rendered_object_fits_the_schema_of_its_kind(directory: str) -> None:
    # Without the shared CRDs only the core kinds are checked here; the custom ones are skipped, not passed.
    checkable = [obj for obj in render(directory) if (crd_validators() or not is_custom(obj)) and not without_crd(obj)]
    problems = {
        f"{obj['kind']} {obj['metadata']['name']}": errors for obj in checkable if (errors := schema_errors(obj))
    }
    assert problems == {}
    if len(checkable) < len(render(directory)):
        pytest.skip(f"no CRDs in {CRDS} for some custom kinds of {directory}: they were not validated")


def test_the_shared_crds_cover_every_custom_kind_deploy_uses() -> None:
    if not CRDS.is_dir():
        pytest.skip(f"no CRDs in {CRDS}")
    used = {(o["apiVersion"], o["kind"]) for d in renderings() for o in render(d) if "." in o["apiVersion"]}
    custom = {key for key in used if not key[0].partition("/")[0].endswith("k8s.io")}
    custom = {key for key in custom if key[0].partition("/")[0] not in WITHOUT_SHARED_CRD}
    assert custom <= set(crd_validators())


def test_a_misspelt_node_pool_field_is_refused() -> None:
    if not CRDS.is_dir():
        pytest.skip(f"no CRDs in {CRDS}")
    pool = copy.deepcopy(one(render("deploy/components/karpenter"), "NodePool", "gpu-inference"))
    pool["spec"]["template"]["spec"]["startupTaint"] = pool["spec"]["template"]["spec"].pop("startupTaints")
    assert any("startupTaint" in error for error in schema_errors(pool))


def test_a_wrong_value_type_in_a_ray_pod_template_is_refused() -> None:
    if not CRDS.is_dir():
        pytest.skip(f"no CRDs in {CRDS}")
    cluster = copy.deepcopy(one(render("deploy/kuberay"), "RayCluster", "llm"))
    cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["terminationGracePeriodSeconds"] = "130"
    assert schema_errors(cluster) != []


def test_an_unknown_field_in_a_core_object_is_refused() -> None:
    deployment = copy.deepcopy(one(render("deploy/vllm"), "Deployment", "vllm"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 130
    assert schema_errors(deployment) != []


def test_int_or_string_and_nullable_become_json_schema() -> None:
    converted = structural(
        {
            "type": "object",
            "properties": {
                "port": {"x-kubernetes-int-or-string": True},
                "note": {"type": "string", "nullable": True},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        }
    )
    assert converted["properties"]["port"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert converted["properties"]["note"]["type"] == ["string", "null"]
    assert "additionalProperties" not in converted["properties"]["free"]
    assert converted["additionalProperties"] is False
