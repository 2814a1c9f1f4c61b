"""What the tests of deploy/ and daemonset/ share: rendering the kustomizations, the schemas to validate against, the
pod templates inside workloads, and the real command line to parse containers' arguments with."""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs installed
import kubernetes_validate
import pytest
import yaml

from simulate.fakes.kube import Call
from simulate.fakes.kube_resources import route
from spotdrain.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DAEMONSET = ROOT / "daemonset"  # the node agent's base and mode overlays
SHIPPED = (DEPLOY, DAEMONSET)
CRDS = ROOT.parent / "shared" / "crds"
DASHBOARD = DEPLOY / "components" / "grafana" / "spotdrain.json"  # Grafana's JSON model
KUBERNETES_VERSION = "1.33"  # a version EKS runs; kubernetes-validate ships its schemas
CUSTOM_GROUPS = frozenset({"karpenter.sh", "karpenter.k8s.aws", "keda.sh", "monitoring.coreos.com", "ray.io"})
# Custom kinds deploy/ uses whose CRDs the shared folder does not hold yet: not schema-checked (reported as
# skipped); tests/deploy/test_webhook.py checks the fields they use against cert-manager's documented API.
WITHOUT_SHARED_CRD = frozenset({"cert-manager.io"})
# What a pod's downward API would give, for parsing command lines that refer to it.
FIELD_VALUES = {
    "spec.nodeName": "ip-10-0-0-1.ec2.internal",
    "status.hostIP": "10.0.0.1",
    "metadata.name": "pod-0",
    "metadata.namespace": "inference",
}
ALIASES = ("NODE_NAME", "POD_NAME", "POD_NAMESPACE", "AWS_REGION", "KUBECONFIG")

Obj = dict[str, Any]


def load_all(text: str) -> list[Obj]:
    return [doc for doc in yaml.load_all(text, Loader=yaml.CSafeLoader) if doc is not None]


# Rendering ---------------------------------------------------------------------------------------------------------


def kustomization_dirs() -> list[str]:
    """Every directory under deploy/ and daemonset/ with a kustomization.yaml, relative to the repository."""
    return sorted(str(path.parent.relative_to(ROOT)) for top in SHIPPED for path in top.rglob("kustomization.yaml"))


def is_component(directory: str) -> bool:
    return "kind: Component" in (ROOT / directory / "kustomization.yaml").read_text()


def kustomizations() -> list[str]:
    """The directories that are installed on their own: components (``kind: Component``) are added to an overlay,
    and rendered in the compositions of ``LAYERS``."""
    return [d for d in kustomization_dirs() if not is_component(d)]


def components() -> list[str]:
    return [d for d in kustomization_dirs() if is_component(d)]


MODES = ("daemonset/imds-mode", "daemonset/karpenter-interruption", "daemonset/queue-mode")


@dataclass(frozen=True)
class Layer:
    """A component, what it is added to besides a mode overlay (``under``), and the components it needs listed
    before it (``after``); ``with_mode`` is false for one that does not go with the node agent's overlays."""

    component: str
    under: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    with_mode: bool = True


LAYERS = (
    Layer("deploy/components/karpenter"),
    Layer("deploy/components/model-prefetch"),
    Layer("deploy/components/vllm"),
    Layer("deploy/components/keda", after=("deploy/components/vllm",)),
    Layer("deploy/components/podmonitors/agent"),
    Layer("deploy/components/podmonitors/model-prefetch", after=("deploy/components/model-prefetch",)),
    Layer("deploy/components/podmonitors/vllm", after=("deploy/components/vllm",)),
    Layer("deploy/components/podmonitors/gateway", under=("deploy/gateway",)),
    Layer("deploy/components/podmonitors/kuberay", under=("deploy/kuberay",)),
    Layer("deploy/components/alerts"),
    Layer("deploy/components/grafana"),
    # The webhook's base creates the spotdrain namespace too, so it is not composed with a mode overlay.
    Layer("deploy/webhook/components/cert-manager", under=("deploy/webhook/base",), with_mode=False),
    Layer("deploy/webhook/components/monitoring", under=("deploy/webhook/base",), with_mode=False),
)


def compositions() -> list[str]:
    """Each component composed with each mode overlay (and what it needs), as ``render`` takes them."""
    found = []
    for layer in LAYERS:
        for mode in MODES if layer.with_mode else ("",):
            found.append("+".join(part for part in (mode, *layer.under, *layer.after, layer.component) if part))
    return found


def renderings() -> list[str]:
    """Everything a user may install: each kustomization, and each component in its compositions."""
    return kustomizations() + compositions()


def have_kubectl() -> bool:
    return shutil.which("kubectl") is not None


def _kustomize(directory: Path, what: str) -> tuple[Obj, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomizations cannot be rendered")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {what} failed:\n{done.stderr}")
    return tuple(load_all(done.stdout))


@functools.cache
def _render(what: str) -> tuple[Obj, ...]:
    parts = what.split("+")
    if len(parts) == 1:
        return _kustomize(ROOT / what, what)
    # A composition: an overlay of the kustomizations with the components, written where kustomize accepts
    # it (paths relative to the overlay: it refuses absolute ones).
    with tempfile.TemporaryDirectory() as overlay:
        relative = {part: os.path.relpath(ROOT / part, overlay) for part in parts}
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [relative[part] for part in parts if not is_component(part)],
            "components": [relative[part] for part in parts if is_component(part)],
        }
        (Path(overlay) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return _kustomize(Path(overlay), what)


def render(what: str) -> list[Obj]:
    """The objects ``kubectl kustomize <directory>`` prints, or for ``a+b+c`` those of an overlay of the
    kustomizations among them with the components among them, in that order (rendered once per test run)."""
    return list(_render(what))


def named(objects: Iterable[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


# RBAC ----------------------------------------------------------------------------------------------------------------

Grant = tuple[str, str, str, str | None]  # (API group, resource[/subresource], verb, namespace; None = cluster-wide)
_VERBS = {"PATCH": "patch", "POST": "create", "PUT": "update", "DELETE": "delete"}


def grants(objects: list[Obj], namespace: str, account: str) -> set[Grant]:
    """Every (group, resource, verb, namespace) the service account is granted by the bindings in ``objects``."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects}
    granted: set[Grant] = set()
    for binding in named(objects, "ClusterRoleBinding") + named(objects, "RoleBinding"):
        subjects = binding.get("subjects", [])
        if not any(
            s["kind"] == "ServiceAccount" and (s.get("namespace"), s["name"]) == (namespace, account) for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace")
        role = roles.get((ref["kind"], None if ref["kind"] == "ClusterRole" else scope, ref["name"]))
        for rule in role["rules"] if role else []:  # a binding to a role that is not there grants nothing
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted |= {(group, resource, verb, scope) for verb in rule["verbs"]}
    return granted


def needed(calls: Iterable[Call], granted: set[Grant]) -> set[Grant]:
    """The grants the API calls a fake API server recorded needed: a call in a namespace is counted as needing the
    cluster-wide grant unless that namespace's grant is there (then the role may stay namespaced)."""
    result: set[Grant] = set()
    for call in calls:
        target = route(call.path)
        assert target is not None, f"not an API path: {call.path}"
        verb = ("get" if target.name else "list") if call.method == "GET" else _VERBS[call.method]
        resource = target.resource.plural + (f"/{target.subresource}" if target.subresource else "")
        grant = (target.resource.group, resource, verb, target.namespace)
        result.add(grant if grant in granted else (*grant[:3], None))
    return result


def one(objects: Iterable[Obj], kind: str, name: str) -> Obj:
    found = named(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def namespace_of(obj: Obj) -> str | None:
    namespace: str | None = obj["metadata"].get("namespace")
    return namespace


# Schemas -----------------------------------------------------------------------------------------------------------


def structural(schema: Obj) -> Obj:
    """A CRD's OpenAPI v3 schema as JSON Schema: Kubernetes' extensions translated, and unknown fields refused
    where Kubernetes would prune them (a misspelt field is silently dropped by the API server)."""
    out: Obj = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: structural(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = structural(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [structural(sub) for sub in value]
        elif not key.startswith("x-kubernetes-") and key not in ("nullable", "description"):
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if out.get("type") == "object" and "properties" in out and not preserve:
        out.setdefault("additionalProperties", False)
    return out


_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
# The shared folder has no CRD for the Prometheus Operator's PrometheusRule: this is its structure as the operator's
# documentation gives it (monitoring.coreos.com/v1: spec.groups[] of name, interval, limit, rules[] of alert or
# record, expr, for, keep_firing_for, labels, annotations), unknown fields refused. The real CRD, where the shared
# folder has it, comes first.
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "limit": {"type": "integer"},
                            "labels": _STRINGS,
                            "partial_response_strategy": {"type": "string"},
                            "query_offset": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                                        "for": _DURATION,
                                        "keep_firing_for": _DURATION,
                                        "labels": _STRINGS,
                                        "annotations": _STRINGS,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}
OWN_SCHEMAS = {("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE}


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) to a validator, for every CRD in the shared folder (and the kinds it lacks that
    OWN_SCHEMAS describes); empty when the folder is absent."""
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")) if CRDS.is_dir() else []:
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        for version in crd["spec"]["versions"]:
            schema = structural(version["schema"]["openAPIV3Schema"])
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            validators[key] = jsonschema.Draft7Validator(schema)
    if validators:
        for key, schema in OWN_SCHEMAS.items():
            validators.setdefault(key, jsonschema.Draft7Validator(schema))
    return validators


def without_crd(obj: Obj) -> bool:
    return str(obj["apiVersion"]).partition("/")[0] in WITHOUT_SHARED_CRD


def is_custom(obj: Obj) -> bool:
    """Whether ``obj`` is of a kind a CRD defines (validated against the shared CRDs, not kubernetes-validate)."""
    return str(obj["apiVersion"]).partition("/")[0] in CUSTOM_GROUPS


def schema_errors(obj: Obj) -> list[str]:
    """Why ``obj`` does not fit the schema of its kind (its CRD's, or Kubernetes' own, strict); empty if it does."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    if is_custom(obj):
        validators = crd_validators()
        if not validators:
            pytest.skip(f"no CRDs in {CRDS}: {kind} cannot be validated against its schema")
        validator = validators.get((api_version, kind))
        if validator is None:
            return [f"no CRD in {CRDS} defines {api_version} {kind}"]
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(map(str, error.path))}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [error.message]
    return []


# Pods --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodTemplate:
    owner: Obj
    where: str
    labels: Mapping[str, str]
    spec: Obj
    ray_params: Obj | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.owner['kind']} {self.owner['metadata']['name']} {self.where}"

    @property
    def namespace(self) -> str | None:
        return namespace_of(self.owner)

    @property
    def containers(self) -> list[Obj]:
        containers: list[Obj] = self.spec["containers"]
        return containers

    def container(self, name: str) -> Obj:
        return next(c for c in self.containers if c["name"] == name)

    def volume(self, name: str) -> Obj:
        return next(v for v in self.spec.get("volumes", []) if v["name"] == name)


def _template(owner: Obj, where: str, template: Obj, ray_params: Obj | None = None) -> PodTemplate:
    metadata = template.get("metadata") or {}
    return PodTemplate(
        owner, where, metadata.get("labels") or {}, template["spec"], ray_params, metadata.get("annotations") or {}
    )


def pod_templates(objects: Iterable[Obj]) -> list[PodTemplate]:
    templates = []
    for obj in objects:
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            templates.append(_template(obj, "spec.template", obj["spec"]["template"]))
        elif obj["kind"] == "RayCluster":
            head = obj["spec"]["headGroupSpec"]
            templates.append(_template(obj, "headGroupSpec", head["template"], head.get("rayStartParams", {})))
            for group in obj["spec"].get("workerGroupSpecs", []):
                where = f"workerGroupSpecs[{group['groupName']}]"
                templates.append(_template(obj, where, group["template"], group.get("rayStartParams", {})))
    return templates


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against a set of labels."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True


def http_port(template: PodTemplate, container: Obj, port: int | str) -> int:
    """A probe's or endpoint's port as a number: a name is looked up in the pod's containers' ports."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for c in template.containers for p in c.get("ports", []) if p.get("name") == port]
    assert numbers, f"{template.name}: no container port named {port!r} (used by {container['name']})"
    number: int = numbers[0]
    return number


# Command lines -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Invocation:
    """A container that runs ``spotdrain <subcommand>``: its arguments with $(VAR) expanded, and its environment."""

    where: str
    subcommand: str
    argv: list[str]
    env: dict[str, str]


def environment(container: Obj, objects: Iterable[Obj]) -> dict[str, str]:
    env: dict[str, str] = {}
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    for variable in container.get("env", []):
        source = variable.get("valueFrom") or {}
        if "fieldRef" in source:
            env[variable["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[variable["name"]] = config_maps[ref["name"]][ref["key"]]
        else:
            env[variable["name"]] = str(variable.get("value", ""))
    return env


def invocation(where: str, container: Obj, objects: Iterable[Obj]) -> Invocation | None:
    command = list(container.get("command") or [])
    if command[:1] != ["spotdrain"]:
        return None
    env = environment(container, objects)
    words = [*command[1:], *container.get("args", [])]
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), word) for word in words]
    return Invocation(f"{where} container {container['name']}", argv[0], argv, env)


def invocations(objects: list[Obj]) -> list[Invocation]:
    found = []
    for template in pod_templates(objects):
        for container in template.spec.get("initContainers", []) + template.containers:
            if (call := invocation(template.name, container, objects)) is not None:
                found.append(call)
    return found


def parse(call: Invocation, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """Parse with the real command line under the container's environment, then build the program's settings."""
    if call.subcommand not in COMMANDS:
        pytest.skip(f"`spotdrain {call.subcommand}` is not a command of this checkout")
    for name in [*ALIASES, *(n for n in os.environ if n.startswith("SPOTDRAIN_"))]:
        monkeypatch.delenv(name, raising=False)
    for name, value in call.env.items():
        monkeypatch.setenv(name, value)
    try:
        args = build_parser().parse_args(call.argv)
    except SystemExit:
        pytest.fail(f"{call.where}: spotdrain {' '.join(call.argv)}\n{capsys.readouterr().err}")
    module = importlib.import_module(COMMANDS[call.subcommand][1])
    # `spotdrain cache fetch` and `spotdrain cache prefetch` have settings of their own (agent/cache/main.py).
    own = {"fetch": "agent.cache.fetch.settings", "prefetch": "agent.cache.prefetch_settings"}
    if getattr(args, "cache_command", None) in own:
        module = importlib.import_module(own[args.cache_command])
    return module.from_arguments(args) if hasattr(module, "from_arguments") else args


def option_strings(subcommand: str) -> set[str]:
    parser = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[subcommand][1]).add_arguments(parser)
    return {option for action in parser._actions for option in action.option_strings}
