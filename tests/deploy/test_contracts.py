"""deploy/ and daemonset/ against the code: RBAC grants exactly the calls the programs make, and every metric name,
label and flag the manifests and the dashboard use exists, so renaming one in the code fails here."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.drain.metrics import AgentMetrics
from agent.node_settings import API_LIMITS
from sidecar.engines import RAY_LAG_AT_1000_MS_S
from sidecar.metrics import SidecarMetrics
from spotdrain.settings import env_name
from tests.conftest import every_series
from tests.deploy.manifests import (
    DASHBOARD,
    ROOT,
    SHIPPED,
    Invocation,
    grants,
    have_kubectl,
    invocations,
    kustomizations,
    named,
    one,
    option_strings,
    parse,
    pod_templates,
    render,
)

# The node agent's Kubernetes calls: CoreV1Api method -> (resource, verb).
CORE_CALLS = {
    "read_node": ("nodes", "get"),
    "list_node": ("nodes", "list"),
    "patch_node": ("nodes", "patch"),
    "list_pod_for_all_namespaces": ("pods", "list"),
    "create_namespaced_pod_eviction": ("pods/eviction", "create"),
    "create_namespaced_event": ("events", "create"),
}
# What each account may do, (API group, resource, verb, namespace; None = cluster-wide), by what the agent calls:
# its own node read and patched, Events written (every mode); pods listed and evicted (unless --no-evict); nodes
# listed to map instances to nodes (queue mode only). The integration tests check these against the calls made.
MARK = {("", "nodes", "get", None), ("", "nodes", "patch", None), ("", "events", "create", "default")}
DRAIN = {("", "pods", "list", None), ("", "pods/eviction", "create", None)}
LOOKUP = {("", "nodes", "list", None)}
# spotdrain check's reads (deploy/check), which the queue Deployment runs every --check-interval.
CHECK = {
    (group, resource, "list", None)
    for group, resources in {
        "": ("nodes", "namespaces", "pods", "services"),
        "apps": ("daemonsets", "deployments"),
        "policy": ("poddisruptionbudgets",),
        "discovery.k8s.io": ("endpointslices",),
        "admissionregistration.k8s.io": ("mutatingwebhookconfigurations",),
    }.items()
    for resource in resources
}
AGENT_RBAC = {
    ("daemonset/base", "spotdrain-node"): MARK | DRAIN,  # IMDS mode
    ("daemonset/imds-mode", "spotdrain-node"): MARK | DRAIN,
    ("daemonset/karpenter-interruption", "spotdrain-node"): MARK,  # --no-evict: Karpenter evicts
    ("daemonset/queue-mode", "spotdrain-node"): MARK,  # --no-evict: the queue Deployment evicts
    ("daemonset/queue-mode", "spotdrain-queue"): MARK | DRAIN | LOOKUP | CHECK,
}
METRIC = re.compile(r"\bspotdrain_[a-z0-9_]*[a-z0-9]\b")  # not a wildcard such as spotdrain_sidecar_*
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


# RBAC --------------------------------------------------------------------------------------------------------------


def _core_calls_in(paths: list[Path]) -> dict[str, set[str]]:
    calls: dict[str, set[str]] = {}
    for path in paths:
        for method in re.findall(r"\bcore\.(\w+)\(", path.read_text()):
            calls.setdefault(method, set()).add(path.name)
    return calls


def test_every_kubernetes_call_of_the_agent_is_known_and_granted() -> None:
    calls = _core_calls_in(sorted((ROOT / "agent").rglob("*.py")))
    unknown = {method: files for method, files in calls.items() if method not in CORE_CALLS}
    assert unknown == {}, "a new Kubernetes call: add it to CORE_CALLS, AGENT_RBAC and the agents' RBAC"
    # The installation checks (CHECK) list through spotdrain.kube_rest, not CoreV1Api: tests/integration/test_check.py.
    assert {CORE_CALLS[method] for method in calls} == {(r, v) for _, r, v, _ in MARK | DRAIN | LOOKUP}


def test_events_are_created_in_the_namespace_the_role_grants() -> None:
    source = (ROOT / "agent" / "drain" / "nodes.py").read_text()
    namespaces = set(re.findall(r'create_namespaced_event\(\s*"([\w-]+)"', source))
    assert namespaces == {ns for _, resource, _, ns in MARK if resource == "events"}


@pytest.mark.parametrize(("directory", "account"), list(AGENT_RBAC))
def test_each_agents_account_gets_exactly_what_its_mode_calls(directory: str, account: str) -> None:
    assert grants(render(directory), "spotdrain", account) == AGENT_RBAC[(directory, account)]


def test_the_daemonset_may_not_list_nodes_in_any_kustomization() -> None:
    for directory in kustomizations():
        assert ("", "nodes", "list", None) not in grants(render(directory), "spotdrain", "spotdrain-node"), directory


@pytest.mark.parametrize("directory", ["deploy/vllm", "deploy/kuberay"])
def test_inference_pods_may_patch_their_status_and_nothing_else(directory: str) -> None:
    gate = (ROOT / "sidecar" / "gate.py").read_text()
    assert re.search(r"/pods/\{pod\}/status", gate)
    assert "patch(" in gate
    objects = render(directory)
    for template in pod_templates(objects):
        if not template.spec.get("readinessGates"):
            continue
        granted = grants(objects, str(template.namespace), template.spec["serviceAccountName"])
        assert granted == {("", "pods/status", "patch", template.namespace)}, template.name


def test_the_gateway_may_watch_its_services_endpointslices_and_nodes_and_nothing_else() -> None:
    source = (ROOT / "gateway" / "endpoints.py").read_text()
    assert '"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"' in source
    assert '"/api/v1/nodes"' in source
    assert '"watch": "true"' in (ROOT / "gateway" / "watch.py").read_text()  # after a list of the same collection
    objects = render("deploy/gateway")
    [template] = pod_templates(objects)
    granted = grants(objects, str(template.namespace), template.spec["serviceAccountName"])
    assert granted == {
        ("discovery.k8s.io", "endpointslices", "list", "inference"),
        ("discovery.k8s.io", "endpointslices", "watch", "inference"),
        ("", "nodes", "list", None),
        ("", "nodes", "watch", None),
    }
    args = template.containers[0]["args"]
    assert "--service=inference/vllm" in args  # the Service of deploy/vllm, in the namespace the Role covers


def test_the_gateway_runs_on_on_demand_nodes_unprivileged_with_a_read_only_root() -> None:
    [template] = pod_templates(render("deploy/gateway"))
    terms = template.spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    [expression] = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert (expression["key"], expression["values"]) == ("karpenter.sh/capacity-type", ["on-demand"])
    context = template.containers[0]["securityContext"]
    assert context["runAsNonRoot"]
    assert context["readOnlyRootFilesystem"]
    assert context["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize("directory", kustomizations())
def test_no_role_grants_a_wildcard(directory: str) -> None:
    for role in named(render(directory), "ClusterRole") + named(render(directory), "Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], role["metadata"]["name"]


# Metrics -----------------------------------------------------------------------------------------------------------


def _families() -> dict[str, dict[str, set[str]]]:
    """Every spotdrain_* family the programs export, with each label's values, as created at start."""
    families: dict[str, dict[str, set[str]]] = {}
    for family in every_series().collect():
        labels = families.setdefault(family.name, {})
        for sample in family.samples:
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
    return families


def _family_of(name: str, families: dict[str, dict[str, set[str]]]) -> str | None:
    for candidate in [name, *(name.removesuffix(s) for s in SUFFIXES if name.endswith(s))]:
        if candidate in families:
            return candidate
    return None


def _deploy_texts() -> Iterator[tuple[str, str]]:
    for path in sorted(path for top in SHIPPED for path in top.rglob("*")):
        if path.is_file() and path.suffix in (".yaml", ".json"):
            yield str(path.relative_to(ROOT)), path.read_text()


def test_every_spotdrain_metric_deploy_uses_exists() -> None:
    families = _families()
    used = {(where, name) for where, text in _deploy_texts() for name in METRIC.findall(text)}
    assert used, "the dashboard uses no spotdrain_* series"
    assert {(where, name) for where, name in used if _family_of(name, families) is None} == set()


def test_every_label_matcher_on_a_spotdrain_metric_names_a_real_label_and_value() -> None:
    families = _families()
    wrong = []
    for where, text in _deploy_texts():
        for name, matchers in re.findall(r"(spotdrain_[a-z0-9_]+)\{([^}]*)\}", text.replace('\\"', '"')):
            labels = families[str(_family_of(name, families))]
            for label, operator, value in MATCHER.findall(matchers):
                if label not in labels or (operator in ("=", "!=") and value not in labels[label]):
                    wrong.append(f"{where}: {name}{{{label}{operator}{value!r}}}")
    assert wrong == []


def test_the_dashboard_shows_every_series_of_the_agent_and_the_sidecar() -> None:
    dashboard = DASHBOARD.read_text()
    registry = CollectorRegistry()
    AgentMetrics.create(registry)
    SidecarMetrics.create(registry)
    shown = {_family_of(name, _families()) for name in METRIC.findall(dashboard)}
    assert {family.name for family in registry.collect()} <= shown


def test_ray_workers_read_serves_count_at_the_export_interval_their_sidecar_waits_for() -> None:
    cluster = render("deploy/kuberay")
    for call in invocations(cluster):
        if call.subcommand == "sidecar":
            assert call.argv[call.argv.index("--engine") + 1] == "ray"
            assert float(call.argv[call.argv.index("--zero-confirm") + 1]) == RAY_LAG_AT_1000_MS_S
    worker = one(cluster, "RayCluster", "llm")["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    ray = next(c for c in worker["containers"] if c["name"] == "ray-worker")
    assert {"name": "RAY_metrics_report_interval_ms", "value": "1000"} in ray["env"]


# Flags -------------------------------------------------------------------------------------------------------------


def _calls() -> list[Invocation]:
    """Every spotdrain command line in deploy/, found at collection (none without kubectl: those tests skip)."""
    seen: dict[tuple[str, str], Invocation] = {}
    if not have_kubectl():
        return []
    for directory in kustomizations():
        for call in invocations(render(directory)):
            seen.setdefault((call.where, " ".join(call.argv)), call)
    return list(seen.values())


def test_every_spotdrain_container_is_found() -> None:
    render("daemonset/base")  # skips without kubectl
    assert {call.subcommand for call in _calls()} == {"sidecar", "node", "cache", "webhook", "gateway"}


@pytest.mark.parametrize("call", _calls(), ids=lambda call: call.where)
def test_every_command_line_in_deploy_parses_with_the_real_parser(
    call: Invocation, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parse(call, monkeypatch, capsys)


@pytest.mark.parametrize("call", _calls(), ids=lambda call: call.where)
def test_every_spotdrain_variable_in_deploy_is_a_flag(call: Invocation) -> None:
    known = {env_name(option) for option in option_strings(call.subcommand) if option.startswith("--")}
    assert {name for name in call.env if name.startswith("SPOTDRAIN_")} <= known


def test_each_agent_runs_its_modes_api_limits_or_more_in_queue_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    agents = [call for call in _calls() if call.subcommand == "node"]
    if not agents:
        pytest.skip("kubectl is not installed: the kustomizations cannot be rendered")
    for call in agents:
        kube = parse(call, monkeypatch, capsys).kube
        if "--queue-url" not in call.argv and "SPOTDRAIN_QUEUE_URL" not in call.env:
            # A thousand of these share one API server: the node's low default, never raised.
            assert (kube.qps, kube.burst) == API_LIMITS["imds"], call.where
            continue
        # bench/burst.py reads the queue Deployment's own flags: its figure is for these.
        assert kube.qps >= API_LIMITS["queue"][0], call.where
        assert kube.burst >= API_LIMITS["queue"][1], call.where
