"""Every kustomization under deploy/ and daemonset/ renders, and the overlays compose what their comments promise."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from tests.deploy.manifests import DEPLOY, ROOT, SHIPPED, Obj, kustomization_dirs, kustomizations, named, one, render

OVERLAYS = ("daemonset/imds-mode", "daemonset/karpenter-interruption", "daemonset/queue-mode")


def _env(objects: list[Obj], kind: str, name: str, container: str) -> dict[str, Any]:
    spec = one(objects, kind, name)["spec"]["template"]["spec"]
    found = next(c for c in spec["containers"] if c["name"] == container)
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in found.get("env", [])}


def test_every_directory_with_kubernetes_objects_has_a_kustomization() -> None:
    yaml_dirs = {
        str(path.parent.relative_to(ROOT))
        for top in SHIPPED
        for path in top.rglob("*.yaml")
        if path.parent.name not in ("aws",)
    }
    assert yaml_dirs <= set(kustomization_dirs())
    shipped = {f"deploy/{name}" for name in ("karpenter", "vllm", "keda", "kuberay", "grafana")}
    shipped |= {"deploy/webhook/self-managed", "deploy/webhook/cert-manager"}
    assert {*shipped, "daemonset/base", "daemonset/queue", *OVERLAYS} <= set(kustomizations())


@pytest.mark.parametrize("directory", kustomizations())
def test_the_kustomization_renders_objects_with_unique_names(directory: str) -> None:
    objects = render(directory)
    assert objects, f"{directory} renders nothing"
    ids = Counter((o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects)
    assert [key for key, count in ids.items() if count > 1] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_brings_the_node_pool_the_agent_and_the_inference_service(overlay: str) -> None:
    objects = render(overlay)
    for kind, name in [
        ("NodePool", "gpu-inference"),
        ("EC2NodeClass", "gpu-inference"),
        ("DaemonSet", "spotdrain-node"),
        ("Deployment", "vllm"),
        ("ScaledObject", "vllm"),
        ("ConfigMap", "spotdrain-dashboard"),
    ]:
        one(objects, kind, name)


def test_keda_owns_the_replica_count_in_the_overlays() -> None:
    assert "replicas" in one(render("deploy/vllm"), "Deployment", "vllm")["spec"]
    assert "replicas" not in one(render("daemonset/imds-mode"), "Deployment", "vllm")["spec"]


def test_only_imds_mode_lets_the_node_agents_evict() -> None:
    assert "SPOTDRAIN_EVICT" not in _env(render("daemonset/imds-mode"), "DaemonSet", "spotdrain-node", "agent")
    for overlay in ("daemonset/karpenter-interruption", "daemonset/queue-mode"):
        assert _env(render(overlay), "DaemonSet", "spotdrain-node", "agent")["SPOTDRAIN_EVICT"] == "false"


def test_the_queue_consumer_runs_only_in_queue_mode_and_reads_the_overlays_queue() -> None:
    assert named(render("daemonset/imds-mode"), "Deployment", "spotdrain-queue") == []
    assert named(render("daemonset/karpenter-interruption"), "Deployment", "spotdrain-queue") == []
    objects = render("daemonset/queue-mode")
    queue = one(objects, "Deployment", "spotdrain-queue")
    assert queue["spec"]["replicas"] == 2
    config_maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("spotdrain-q")]
    assert len(config_maps) == 1
    assert config_maps[0]["data"]["queue-url"].endswith("/spotdrain-interruptions")
    assert "eks.amazonaws.com/role-arn" in one(objects, "ServiceAccount", "spotdrain-queue")["metadata"]["annotations"]


def test_the_dashboard_is_json_that_grafana_imports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "spotdrain.json").read_text())
    assert dashboard["uid"] == "spotdrain"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    config_map = one(render("deploy/grafana"), "ConfigMap", "spotdrain-dashboard")
    assert json.loads(config_map["data"]["spotdrain.json"]) == dashboard
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_the_agent_image_installs_the_node_extra_and_the_cache_steps_disk_tools() -> None:
    dockerfile = (ROOT / "Dockerfile.agent").read_text()
    assert "pip install --no-cache-dir --prefix=/install '.[node]'" in dockerfile
    for package in ("xfsprogs", "e2fsprogs", "mdadm", "util-linux"):
        assert f" {package}" in dockerfile
    assert 'ENTRYPOINT ["spotdrain"]' in dockerfile
    # Root only for the privileged cache step; the manifests run the agent itself as 65532.
    assert "\nUSER " not in dockerfile
