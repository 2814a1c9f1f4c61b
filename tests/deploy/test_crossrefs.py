"""What a schema cannot check: that the objects point at each other, and at what the programs really listen on."""

from __future__ import annotations

import math
from typing import Any

import pytest

from agent.cache.settings import CacheSettings
from agent.node_settings import NodeSettings
from sidecar.gate import CONDITION
from sidecar.settings import SidecarSettings
from tests.deploy.manifests import (
    Obj,
    PodTemplate,
    http_port,
    invocation,
    named,
    namespace_of,
    one,
    parse,
    pod_templates,
    render,
    selects,
)

COMPOSED = (
    "daemonset/imds-mode",
    "daemonset/karpenter-interruption",
    "daemonset/queue-mode",
    "deploy/examples/full",
    "deploy/gateway+deploy/components/podmonitors/gateway",
    "deploy/kuberay+deploy/components/podmonitors/kuberay",
    "deploy/webhook/self-managed",
    "deploy/webhook/cert-manager",
)
ENGINE_EXIT_MARGIN_S = 10  # the grace period must outlast the drain by at least this much
MODEL_CACHE = "/mnt/model-cache"
GPU = "nvidia.com/gpu"


def _templates_in(objects: list[Obj], namespace: str | None) -> list[PodTemplate]:
    return [t for t in pod_templates(objects) if t.namespace == namespace]


def _sidecar_pods(objects: list[Obj]) -> list[tuple[PodTemplate, Obj]]:
    found = []
    for template in pod_templates(objects):
        for container in template.containers:
            if container.get("command", [])[:2] == ["spotdrain", "sidecar"]:
                found.append((template, container))
    return found


def _sidecar_settings(
    template: PodTemplate, sidecar: Obj, objects: list[Obj], mp: pytest.MonkeyPatch, capsys: Any
) -> SidecarSettings:
    call = invocation(template.name, sidecar, objects)
    assert call is not None
    settings: SidecarSettings = parse(call, mp, capsys)
    return settings


def _engine(template: PodTemplate) -> Obj:
    engines = [c for c in template.containers if (c.get("lifecycle") or {}).get("preStop")]
    assert len(engines) == 1, f"{template.name}: expected one engine container with a preStop"
    return engines[0]


# Selectors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", COMPOSED)
def test_workload_selectors_match_their_own_pod_labels(directory: str) -> None:
    for obj in render(directory):
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            assert selects(obj["spec"]["selector"], obj["spec"]["template"]["metadata"]["labels"]), obj["metadata"]


@pytest.mark.parametrize("directory", COMPOSED)
def test_services_select_pods_that_have_their_target_ports(directory: str) -> None:
    objects = render(directory)
    for service in named(objects, "Service"):
        selector = {"matchLabels": service["spec"]["selector"]}  # a Service's selector is a plain label map
        assert selector["matchLabels"], f"Service {service['metadata']['name']} selects every pod"
        pods = [t for t in _templates_in(objects, namespace_of(service)) if selects(selector, t.labels)]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in pods:
                http_port(pod, {"name": "service"}, port["targetPort"])


@pytest.mark.parametrize("directory", COMPOSED)
def test_disruption_budgets_select_pods(directory: str) -> None:
    objects = render(directory)
    for budget in named(objects, "PodDisruptionBudget"):
        pods = _templates_in(objects, namespace_of(budget))
        assert any(selects(budget["spec"]["selector"], t.labels) for t in pods), budget["metadata"]["name"]


@pytest.mark.parametrize("directory", COMPOSED)
def test_disruption_budgets_let_pods_the_sidecar_took_out_of_rotation_be_evicted(directory: str) -> None:
    # A draining pod is not Ready before its eviction; only AlwaysAllow evicts it whatever the other replicas do.
    for budget in named(render(directory), "PodDisruptionBudget"):
        assert budget["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow", budget["metadata"]["name"]


@pytest.mark.parametrize("directory", COMPOSED)
def test_pod_monitors_select_pods_that_expose_their_ports(directory: str) -> None:
    objects = render(directory)
    for monitor in named(objects, "PodMonitor"):
        pods = [
            t for t in _templates_in(objects, namespace_of(monitor)) if selects(monitor["spec"]["selector"], t.labels)
        ]
        assert pods, f"PodMonitor {monitor['metadata']['name']} selects no pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert all(http_port(t, {"name": "monitor"}, endpoint["port"]) for t in pods)


def test_the_scaled_object_targets_the_vllm_deployment_and_its_metrics() -> None:
    objects = render("deploy/examples/full")
    scaled = one(objects, "ScaledObject", "vllm")
    target = one(objects, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert namespace_of(target) == namespace_of(scaled)
    queries = " ".join(t["metadata"]["query"] for t in scaled["spec"]["triggers"])
    assert "vllm:num_requests_waiting" in queries
    assert "vllm:kv_cache_usage_perc" in queries
    engine = _engine(next(t for t in pod_templates(objects) if t.owner is target))
    for trigger in scaled["spec"]["triggers"]:
        assert f'container="{engine["name"]}"' in trigger["metadata"]["query"]
        assert f'namespace="{namespace_of(target)}"' in trigger["metadata"]["query"]


def _projected_path(source: Obj) -> str:
    if "serviceAccountToken" in source:
        path: str = source["serviceAccountToken"]["path"]
        return path
    return str(next(iter(source.values()))["items"][0]["path"])


# The sidecar in each inference pod ---------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_the_pod_leaves_rotation_and_the_engine_stops_through_the_sidecar(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    pods = _sidecar_pods(objects)
    assert pods
    for template, sidecar in pods:
        settings = _sidecar_settings(template, sidecar, objects, monkeypatch, capsys)
        engine = _engine(template)
        # The pod is Ready only when every container is: the sidecar's own /ready takes it out of rotation, and the
        # engine's probe (if any) is the user's, never the sidecar's.
        probe = sidecar["readinessProbe"]
        assert (probe["httpGet"]["path"], http_port(template, sidecar, probe["httpGet"]["port"])) == (
            "/ready",
            settings.port,
        )
        assert probe["failureThreshold"] == 1
        assert engine.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/ready"
        assert sidecar["livenessProbe"]["httpGet"]["path"] == "/live"
        assert http_port(template, sidecar, sidecar["livenessProbe"]["httpGet"]["port"]) == settings.port
        assert engine["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", f"{settings.drain.dir}/prestop"]


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_the_drain_directory_is_one_empty_dir_shared_by_engine_and_sidecar(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    for template, sidecar in _sidecar_pods(objects):
        drain_dir = str(_sidecar_settings(template, sidecar, objects, monkeypatch, capsys).drain.dir)
        volumes = {
            m["name"] for c in (sidecar, _engine(template)) for m in c["volumeMounts"] if m["mountPath"] == drain_dir
        }
        assert len(volumes) == 1, f"{template.name}: engine and sidecar mount different volumes at {drain_dir}"
        assert "emptyDir" in template.volume(volumes.pop())


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_the_grace_period_outlasts_the_sidecars_drain(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    for template, sidecar in _sidecar_pods(objects):
        timeout_s = _sidecar_settings(template, sidecar, objects, monkeypatch, capsys).drain.timeout_s
        assert template.spec["terminationGracePeriodSeconds"] >= math.ceil(timeout_s) + ENGINE_EXIT_MARGIN_S


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_the_readiness_gate_is_declared_where_the_sidecar_patches_it(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    for template, sidecar in _sidecar_pods(objects):
        settings = _sidecar_settings(template, sidecar, objects, monkeypatch, capsys)
        gates = [g["conditionType"] for g in template.spec.get("readinessGates", [])]
        assert gates == ([CONDITION] if settings.gate.enabled else [])
        if not settings.gate.enabled:
            continue
        # The sidecar needs the account's token: mounted for it alone, or for the whole pod by default.
        token = [m for m in sidecar["volumeMounts"] if m["mountPath"] == str(settings.gate.serviceaccount_dir)]
        if token:
            sources = template.volume(token[0]["name"])["projected"]["sources"]
            assert {"token", "ca.crt", "namespace"} <= {_projected_path(source) for source in sources}
        else:
            assert template.spec.get("automountServiceAccountToken", True), template.name


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_the_sidecar_runs_unprivileged_with_a_read_only_root(directory: str) -> None:
    for _, sidecar in _sidecar_pods(render(directory)):
        context = sidecar["securityContext"]
        assert context["runAsNonRoot"]
        assert context["readOnlyRootFilesystem"]
        assert context["capabilities"]["drop"] == ["ALL"]
        assert not context["allowPrivilegeEscalation"]


@pytest.mark.parametrize("directory", ["deploy/examples/full", "deploy/kuberay"])
def test_the_sidecars_notice_url_is_the_agent_endpoint_on_its_node(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    agent = render("daemonset/base")
    node: NodeSettings = parse(_agent_call(agent, "agent"), monkeypatch, capsys)
    notice = next(p for p in _agent_container(agent, "agent")["ports"] if p["containerPort"] == node.notice_port)
    assert notice["hostPort"] == node.notice_port
    assert _sidecar_pods(objects)
    for template, sidecar in _sidecar_pods(objects):
        url = _sidecar_settings(template, sidecar, objects, monkeypatch, capsys).drain.notice_url
        assert url == f"http://10.0.0.1:{node.notice_port}/v1/notice"  # $(HOST_IP), from status.hostIP


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_the_sidecar_reads_the_engine_on_a_port_the_engine_exposes(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    for template, sidecar in _sidecar_pods(objects):
        settings = _sidecar_settings(template, sidecar, objects, monkeypatch, capsys)
        assert settings.engine.port in {p["containerPort"] for p in _engine(template).get("ports", [])}


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_inference_pods_see_the_model_cache_the_agent_mounts(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    cache: CacheSettings = parse(_agent_call(render("daemonset/base"), "model-cache"), monkeypatch, capsys)
    path = str(cache.path)
    for template, _ in _sidecar_pods(render(directory)):
        mount = next(m for m in _engine(template)["volumeMounts"] if m["mountPath"] == path)
        assert mount["mountPropagation"] == "HostToContainer"
        assert template.volume(mount["name"])["hostPath"]["path"] == path


# The node agent ----------------------------------------------------------------------------------------------------


def _agent_container(objects: list[Obj], name: str) -> Obj:
    spec = one(objects, "DaemonSet", "spotdrain-node")["spec"]["template"]["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def _agent_call(objects: list[Obj], name: str) -> Any:
    return invocation("DaemonSet spotdrain-node", _agent_container(objects, name), objects)


def test_the_agents_probes_and_ports_are_the_ones_it_listens_on(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    objects = render("daemonset/base")
    node: NodeSettings = parse(_agent_call(objects, "agent"), monkeypatch, capsys)
    template = next(t for t in pod_templates(objects) if t.owner["kind"] == "DaemonSet")
    agent = _agent_container(objects, "agent")
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        assert agent[probe]["httpGet"]["path"] == path
        assert http_port(template, agent, agent[probe]["httpGet"]["port"]) == node.metrics_port
    assert {p["containerPort"] for p in agent["ports"]} == {node.metrics_port, node.notice_port}
    assert node.node_name == "ip-10-0-0-1.ec2.internal"
    assert not node.queue_mode


def test_the_agent_reaches_imds_from_the_host_network_and_runs_everywhere_it_must() -> None:
    spec = one(render("daemonset/base"), "DaemonSet", "spotdrain-node")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    hop_limit = one(render("deploy/components/karpenter"), "EC2NodeClass", "gpu-inference")["spec"]["metadataOptions"]
    assert hop_limit["httpTokens"] == "required"
    assert hop_limit["httpPutResponseHopLimit"] == 1


def test_only_the_cache_step_is_privileged(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    objects = render("daemonset/base")
    init, agent = _agent_container(objects, "model-cache"), _agent_container(objects, "agent")
    assert init["command"] == ["spotdrain", "cache"]
    assert init["securityContext"]["privileged"] is True
    bidirectional = {m["mountPath"] for m in init["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"}
    assert bidirectional == {MODEL_CACHE}
    assert "/dev" in {m["mountPath"] for m in init["volumeMounts"]}
    context = agent["securityContext"]
    assert context["runAsNonRoot"]
    assert context["runAsUser"] == 65532
    assert context["readOnlyRootFilesystem"]
    assert context["capabilities"]["drop"] == ["ALL"]
    assert not context.get("privileged")
    # Unprivileged and without the cache mounts, the agent must leave the cache to the init container.
    node: NodeSettings = parse(_agent_call(objects, "agent"), monkeypatch, capsys)
    assert node.cache.enabled is False
    cache: CacheSettings = parse(_agent_call(objects, "model-cache"), monkeypatch, capsys)
    assert cache.enabled is True
