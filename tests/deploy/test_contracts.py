"""deploy/ against the code: RBAC grants exactly the calls the programs make, and every metric name, label and flag
the manifests and the dashboard use exists, so renaming one in the code fails here."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.settings import env_name
from daemonset.metrics import AgentMetrics
from sidecar.engines import ENGINES
from sidecar.metrics import SidecarMetrics
from tests.conftest import every_series
from tests.deploy.manifests import (
    DEPLOY,
    ROOT,
    Invocation,
    Obj,
    have_kubectl,
    invocations,
    kustomizations,
    named,
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
# What the node agent's account may do: (API group, resource, verb, namespace; None = cluster-wide).
AGENT_RBAC = {
    ("", "nodes", "get", None),
    ("", "nodes", "list", None),
    ("", "nodes", "patch", None),
    ("", "pods", "list", None),
    ("", "pods/eviction", "create", None),
    ("", "events", "create", "default"),
}
AGENT_ACCOUNTS = (("agent", "spotdrain-node"), ("overlays/queue-mode", "spotdrain-queue"))
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


def _grants(objects: list[Obj], namespace: str, account: str) -> set[tuple[str, str, str, str | None]]:
    """Every (group, resource, verb, namespace) the service account is granted by the bindings in ``objects``."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects}
    grants = set()
    for binding in named(objects, "ClusterRoleBinding") + named(objects, "RoleBinding"):
        subjects = binding.get("subjects", [])
        if not any(
            s["kind"] == "ServiceAccount" and (s.get("namespace"), s["name"]) == (namespace, account) for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace")
        role = roles[(ref["kind"], None if ref["kind"] == "ClusterRole" else scope, ref["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants |= {(group, resource, verb, scope) for verb in rule["verbs"]}
    return grants


def test_every_kubernetes_call_of_the_agent_is_known_and_granted() -> None:
    calls = _core_calls_in(sorted((ROOT / "daemonset").glob("*.py")))
    unknown = {method: files for method, files in calls.items() if method not in CORE_CALLS}
    assert unknown == {}, "a new Kubernetes call: add it to CORE_CALLS, AGENT_RBAC and deploy/agent/rbac.yaml"
    assert {CORE_CALLS[method] for method in calls} == {(r, v) for _, r, v, _ in AGENT_RBAC}


def test_events_are_created_in_the_namespace_the_role_grants() -> None:
    source = (ROOT / "daemonset" / "nodes.py").read_text()
    namespaces = set(re.findall(r'create_namespaced_event\(\s*"([\w-]+)"', source))
    assert namespaces == {ns for _, resource, _, ns in AGENT_RBAC if resource == "events"}


@pytest.mark.parametrize(("directory", "account"), AGENT_ACCOUNTS)
def test_the_agents_account_gets_exactly_what_it_calls(directory: str, account: str) -> None:
    assert _grants(render(directory), "spotdrain", account) == AGENT_RBAC


@pytest.mark.parametrize("directory", ["vllm", "kuberay"])
def test_inference_pods_may_patch_their_status_and_nothing_else(directory: str) -> None:
    gate = (ROOT / "sidecar" / "gate.py").read_text()
    assert re.search(r"/pods/\{pod\}/status", gate)
    assert "patch(" in gate
    objects = render(directory)
    for template in pod_templates(objects):
        if not template.spec.get("readinessGates"):
            continue
        grants = _grants(objects, str(template.namespace), template.spec["serviceAccountName"])
        assert grants == {("", "pods/status", "patch", template.namespace)}, template.name


def test_the_gateway_may_list_its_services_endpointslices_and_read_nodes_and_nothing_else() -> None:
    source = (ROOT / "gateway" / "endpoints.py").read_text()
    assert "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?" in source
    assert "/api/v1/nodes/{name}" in source
    objects = render("gateway")
    [template] = pod_templates(objects)
    grants = _grants(objects, str(template.namespace), template.spec["serviceAccountName"])
    assert grants == {("discovery.k8s.io", "endpointslices", "list", "inference"), ("", "nodes", "get", None)}
    args = template.containers[0]["args"]
    assert "--service=inference/vllm" in args  # the Service of deploy/vllm, in the namespace the Role covers


def test_the_gateway_runs_on_on_demand_nodes_unprivileged_with_a_read_only_root() -> None:
    [template] = pod_templates(render("gateway"))
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
    for path in sorted(DEPLOY.rglob("*")):
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
    dashboard = (DEPLOY / "grafana" / "spotdrain.json").read_text()
    registry = CollectorRegistry()
    AgentMetrics.create(registry)
    SidecarMetrics.create(registry)
    shown = {_family_of(name, _families()) for name in METRIC.findall(dashboard)}
    assert {family.name for family in registry.collect()} <= shown


def test_ray_workers_read_vllms_gauges_under_the_names_ray_gives_them() -> None:
    vllm = ENGINES["vllm"]
    renamed = ",".join("ray_" + name.replace(":", "_") for name in (*vllm.required, *vllm.optional))
    cluster = render("kuberay")
    for call in invocations(cluster):
        if call.subcommand == "sidecar":
            assert call.argv[call.argv.index("--in-flight-metric") + 1] == renamed


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
    render("agent")  # skips without kubectl
    assert {call.subcommand for call in _calls()} == {"sidecar", "node", "cache", "gateway"}


@pytest.mark.parametrize("call", _calls(), ids=lambda call: call.where)
def test_every_command_line_in_deploy_parses_with_the_real_parser(
    call: Invocation, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parse(call, monkeypatch, capsys)


@pytest.mark.parametrize("call", _calls(), ids=lambda call: call.where)
def test_every_spotdrain_variable_in_deploy_is_a_flag(call: Invocation) -> None:
    known = {env_name(option) for option in option_strings(call.subcommand) if option.startswith("--")}
    assert {name for name in call.env if name.startswith("SPOTDRAIN_")} <= known
