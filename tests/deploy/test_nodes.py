"""GPU nodes and what runs on them: the NodePool's taints and labels against the pods that must (or must not)
land there, the node class against the model cache, and GPUs counted alike by Kubernetes, Ray and Ray Serve."""

from __future__ import annotations

import math
import re

import pytest
import yaml

from agent.cache.plan import PENDING_TAINT, READY_LABEL
from tests.deploy.manifests import CRDS, Obj, PodTemplate, one, pod_templates, render

GPU = "nvidia.com/gpu"


def _node_pool() -> Obj:
    return one(render("deploy/components/karpenter"), "NodePool", "gpu-inference")


# Nodes: taints, labels, instance types -----------------------------------------------------------------------------


def _tolerates(tolerations: list[Obj], taint: Obj) -> bool:
    for toleration in tolerations:
        key_matches = "key" not in toleration or toleration["key"] == taint["key"]
        value_matches = toleration.get("operator") == "Exists" or toleration.get("value") == taint.get("value")
        effect_matches = "effect" not in toleration or toleration["effect"] == taint["effect"]
        if key_matches and value_matches and effect_matches:
            return True
    return False


def _gpu_pods() -> list[PodTemplate]:
    templates = pod_templates(render("deploy/vllm")) + pod_templates(render("deploy/kuberay"))
    return [t for t in templates if any(GPU in (c.get("resources") or {}).get("limits", {}) for c in t.containers)]


def test_gpu_pods_tolerate_the_node_pools_taints_but_wait_out_its_startup_taint() -> None:
    template = _node_pool()["spec"]["template"]["spec"]
    assert {"key": PENDING_TAINT, "effect": "NoSchedule"} in template["startupTaints"]
    assert _gpu_pods()
    for pod in _gpu_pods():
        tolerations = pod.spec.get("tolerations", [])
        assert all(_tolerates(tolerations, taint) for taint in template["taints"]), pod.name
        assert not any(_tolerates(tolerations, taint) for taint in template["startupTaints"]), pod.name


def test_gpu_pods_require_only_node_labels_the_node_pool_can_give() -> None:
    pool = _node_pool()["spec"]["template"]
    labels = pool["metadata"]["labels"]
    assert labels[READY_LABEL] == "ready"
    offered = {r["key"]: set(r.get("values", [])) for r in pool["spec"]["requirements"]}
    for pod in _gpu_pods():
        terms = pod.spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        for term in terms["nodeSelectorTerms"]:
            assert any(e["key"] == READY_LABEL for e in term["matchExpressions"]), pod.name
            for expression in term["matchExpressions"]:
                values = set(expression.get("values", []))
                if expression["key"] in labels:
                    assert labels[expression["key"]] in values, pod.name
                else:
                    assert values & offered.get(expression["key"], set()), f"{pod.name}: {expression}"


def test_node_pool_requirements_use_karpenters_well_known_labels() -> None:
    crd = CRDS / "karpenter.sh_nodepools.yaml"
    if not crd.exists():
        pytest.skip(f"no Karpenter CRD in {CRDS} to read the well-known labels from")
    # The CRD's validation rule lists every label Karpenter's AWS provider defines.
    well_known = set(re.findall(r'"(karpenter\.k8s\.aws/[a-z0-9-]+)', crd.read_text()))
    requirements = _node_pool()["spec"]["template"]["spec"]["requirements"]
    keys = {r["key"] for r in requirements}
    assert "karpenter.k8s.aws/instance-family" in keys
    assert {k for k in keys if k.startswith("karpenter.k8s.aws/")} <= well_known
    capacity = next(r for r in requirements if r["key"] == "karpenter.sh/capacity-type")
    assert capacity["values"] == ["spot", "on-demand"]


def test_the_node_class_leaves_the_instance_store_to_the_model_cache() -> None:
    spec = one(render("deploy/components/karpenter"), "EC2NodeClass", "gpu-inference")["spec"]
    assert "instanceStorePolicy" not in spec
    assert spec["amiSelectorTerms"][0]["alias"].startswith("al2023@")


# KubeRay: GPUs counted the same way by Kubernetes, Ray and the Serve application ------------------------------------


def _serve_config() -> Obj:
    config_map = one(render("deploy/kuberay"), "ConfigMap", "ray-serve-llm")
    config: Obj = yaml.safe_load(config_map["data"]["llm.yaml"])
    return config


def test_ray_groups_give_ray_exactly_the_gpus_kubernetes_gives_the_pod() -> None:
    for template in pod_templates(render("deploy/kuberay")):
        assert template.ray_params is not None
        limits = (template.containers[0].get("resources") or {}).get("limits", {})
        assert float(limits.get(GPU, 0)) == float(template.ray_params.get("num-gpus", 0)), template.name


def _replica_gpus(llm: Obj) -> float:
    """The GPUs of one replica's placement group as Ray 2.49.0 builds it (LLMConfig._set_deployment_placement_options
    and VLLMEngineConfig.placement_bundles): the replica actor's own bundle (ray_actor_options, no GPU unless asked),
    then resources_per_bundle ({GPU: 1} unless set) once per vLLM worker, tensor x pipeline parallel."""
    actor = llm.get("deployment_config", {}).get("ray_actor_options", {}).get("num_gpus", 0)
    engine = llm.get("engine_kwargs", {})
    workers = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
    return float(actor + (llm.get("resources_per_bundle") or {"GPU": 1}).get("GPU", 0) * workers)


def test_fractional_replicas_fit_the_worker_gpus() -> None:
    cluster = one(render("deploy/kuberay"), "RayCluster", "llm")
    workers = cluster["spec"]["workerGroupSpecs"]
    gpus = sum(float(g["rayStartParams"]["num-gpus"]) * g["minReplicas"] for g in workers)
    for llm in _serve_config()["applications"][0]["args"]["llm_configs"]:
        fraction = _replica_gpus(llm)
        per_gpu = math.floor(1 / fraction)
        assert per_gpu * llm["engine_kwargs"]["gpu_memory_utilization"] <= 0.95  # room for CUDA's own memory
        assert llm["deployment_config"]["autoscaling_config"]["min_replicas"] * fraction <= gpus
