"""Every kustomization under deploy/ and daemonset/ renders, alone and with each component it takes, and the
overlays compose what their comments promise."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from tests.deploy.manifests import (
    DASHBOARD,
    MODES,
    ROOT,
    SHIPPED,
    Obj,
    components,
    compositions,
    kustomization_dirs,
    kustomizations,
    named,
    one,
    pod_templates,
    render,
    renderings,
)


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
    shipped = {f"deploy/{name}" for name in ("vllm", "kuberay", "gateway", "examples/full")}
    shipped |= {"deploy/webhook/self-managed", "deploy/webhook/cert-manager"}
    assert {*shipped, "daemonset/base", "daemonset/queue", *MODES} <= set(kustomizations())
    layers = {f"deploy/components/{name}" for name in ("karpenter", "vllm", "keda", "alerts", "grafana")}
    layers |= {f"deploy/components/podmonitors/{name}" for name in ("agent", "vllm", "gateway", "kuberay")}
    assert layers <= set(components())


def test_each_component_is_composed_with_each_mode_overlay() -> None:
    for component in components():
        if component.startswith("deploy/components/"):
            assert {c.split("+")[0] for c in compositions() if c.endswith(f"+{component}")} == set(MODES), component


@pytest.mark.parametrize("rendering", renderings())
def test_the_kustomization_renders_objects_with_unique_names(rendering: str) -> None:
    objects = render(rendering)
    assert objects, f"{rendering} renders nothing"
    ids = Counter((o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects)
    assert [key for key, count in ids.items() if count > 1] == []


def test_keda_owns_the_replica_count_where_it_is_added() -> None:
    assert "replicas" in one(render("deploy/vllm"), "Deployment", "vllm")["spec"]
    assert "replicas" in one(render("daemonset/imds-mode+deploy/components/vllm"), "Deployment", "vllm")["spec"]
    for rendering in [c for c in compositions() if c.endswith("/keda")] + ["deploy/examples/full"]:
        assert "replicas" not in one(render(rendering), "Deployment", "vllm")["spec"], rendering


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
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "spotdrain"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    config_map = one(render("daemonset/imds-mode+deploy/components/grafana"), "ConfigMap", "spotdrain-dashboard")
    assert json.loads(config_map["data"]["spotdrain.json"]) == dashboard
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_the_agent_image_installs_the_node_extra_and_the_cache_steps_disk_tools() -> None:
    dockerfile = (ROOT / "Dockerfile.agent").read_text()
    assert "pip install --no-cache-dir --prefix=/install '.[node]'" in dockerfile
    for package in ("xfsprogs", "e2fsprogs", "mdadm", "util-linux"):
        assert f" {package}" in dockerfile
    assert 'ENTRYPOINT ["spotdrain"]' in dockerfile
    # Not root by default: the containers that need it ask for uid 0 themselves (the next test).
    assert "\nUSER 65532:65532\n" in dockerfile


@pytest.mark.parametrize("rendering", renderings())
def test_every_container_of_a_spotdrain_image_says_which_user_it_runs_as(rendering: str) -> None:
    # The images' USER is 65532: a container that needs root (the privileged cache step, those writing the model
    # cache as its owner) runs as 65532 unless it asks for uid 0.
    for template in pod_templates(render(rendering)):
        pod_user = (template.spec.get("securityContext") or {}).get("runAsUser")
        for container in template.spec.get("initContainers", []) + template.containers:
            if not container["image"].startswith("ghcr.io/spotdrain/"):
                continue
            context = container.get("securityContext") or {}
            user = context.get("runAsUser", pod_user)
            assert user is not None, f"{template.name} container {container['name']}"
            assert not context.get("privileged") or user == 0, f"{template.name} container {container['name']}"
