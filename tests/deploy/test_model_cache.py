"""The model cache wired end to end: each inference pod's init container fetches, with the real command line, the
directory its engine loads, into the cache the agent mounts; nodes that prefetched it are preferred; the NodePool
prefetches the same model from the same source; the AWS role reaches the init container alone, and is the role the
model-cache stack trusts those service accounts with."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cache.fetch.settings import FetchSettings
from agent.cache.fetch.sources import S3Source, parse_source
from agent.cache.plan import READY_LABEL
from agent.cache.prefetch_settings import PrefetchSettings
from agent.cache.settings import CacheSettings
from tests.deploy.manifests import (
    Obj,
    PodTemplate,
    invocation,
    named,
    one,
    parse,
    pod_templates,
    render,
    renderings,
)
from tests.deploy.test_cfn import Stack
from tests.deploy.test_layers import listed_placeholders

INFERENCE = ("deploy/vllm", "deploy/kuberay", "deploy/examples/full")
MODELS_ANNOTATION = "spotdrain.io/models"  # the NodePool's NAME=SOURCE list the agent prefetches
MODEL_LABEL = "spotdrain.io/model."  # + NAME: fetching, ready or failed, set by the agent's prefetch
ROLE = "eks.amazonaws.com/role-arn"
SKIP = "eks.amazonaws.com/skip-containers"  # containers EKS's pod identity webhook gives no credentials to
KUBERAY_INIT = "wait-gcs-ready"  # the init container KubeRay adds to every worker pod, a copy of its Ray container
LABEL_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMG]i)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * _UNITS.get(unit or "", 1)


def _fetching(objects: list[Obj]) -> list[tuple[PodTemplate, Obj]]:
    """Every pod template with a `spotdrain cache fetch` init container, and that container."""
    found = []
    for template in pod_templates(objects):
        for container in template.spec.get("initContainers", []):
            if container.get("command", [])[:3] == ["spotdrain", "cache", "fetch"]:
                found.append((template, container))
    return found


def _fetch(template: PodTemplate, container: Obj, objects: list[Obj], mp: pytest.MonkeyPatch, capsys: Any) -> Any:
    call = invocation(template.name, container, objects)
    assert call is not None
    settings: FetchSettings = parse(call, mp, capsys)
    return settings


def _engine(template: PodTemplate) -> Obj:
    [engine] = [c for c in template.containers if (c.get("lifecycle") or {}).get("preStop")]
    return engine


def _agents_cache(mp: pytest.MonkeyPatch, capsys: Any) -> CacheSettings:
    objects = render("daemonset/base")
    spec = one(objects, "DaemonSet", "spotdrain-node")["spec"]["template"]["spec"]
    step = next(c for c in spec["initContainers"] if c["name"] == "model-cache")
    call = invocation("DaemonSet spotdrain-node", step, objects)
    assert call is not None
    cache: CacheSettings = parse(call, mp, capsys)
    return cache


def _loads(template: PodTemplate, objects: list[Obj]) -> set[str]:
    """What the pod's engine loads: vLLM's --model, or the model_source of each of Ray Serve's LLM configs."""
    if template.owner["kind"] != "RayCluster":
        args = _engine(template)["args"]
        return {args[args.index("--model") + 1]}
    config = yaml.safe_load(one(objects, "ConfigMap", "ray-serve-llm")["data"]["llm.yaml"])
    return {
        llm["model_loading_config"]["model_source"]
        for application in config["applications"]
        for llm in application["args"]["llm_configs"]
    }


def _entries(annotation: str) -> dict[str, str]:
    """NAME=SOURCE entries separated by commas or whitespace."""
    entries = {}
    for entry in re.split(r"[\s,]+", annotation.strip()):
        name, equals, source = entry.partition("=")
        assert equals, f"not NAME=SOURCE: {entry!r}"
        assert name, f"no NAME: {entry!r}"
        assert source, f"no SOURCE: {entry!r}"
        entries[name] = source
    return entries


# The init container and the engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", INFERENCE)
def test_each_engine_loads_the_directory_its_init_container_fetches_into_the_agents_cache(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    cache = _agents_cache(monkeypatch, capsys)
    assert _fetching(objects)
    for template, container in _fetching(objects):
        settings = _fetch(template, container, objects, monkeypatch, capsys)
        assert settings.wait, f"{template.name}: an init container must wait for another fetch of the model"
        assert settings.cache_path == cache.path
        assert _loads(template, objects) == {str(settings.target)}, template.name
        assert isinstance(settings.source, S3Source)


@pytest.mark.parametrize("directory", INFERENCE)
def test_the_init_container_and_the_engine_mount_the_same_host_cache(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    path = str(_agents_cache(monkeypatch, capsys).path)
    for template, container in _fetching(objects):
        volumes = set()
        for mounting in (container, _engine(template)):
            mount = next(m for m in mounting["volumeMounts"] if m["mountPath"] == path)
            # Sees the agent's mount of the host's cache, even one made after the pod started.
            assert mount["mountPropagation"] == "HostToContainer", f"{template.name} {mounting['name']}"
            volumes.add(mount["name"])
        assert not next(m for m in container["volumeMounts"] if m["mountPath"] == path).get("readOnly")
        assert len(volumes) == 1, template.name
        assert template.volume(volumes.pop())["hostPath"]["path"] == path


@pytest.mark.parametrize("directory", INFERENCE)
def test_the_init_container_writes_as_the_caches_owner_with_nothing_more(directory: str) -> None:
    spec = one(render("daemonset/base"), "DaemonSet", "spotdrain-node")["spec"]["template"]["spec"]
    cache_step = next(c for c in spec["initContainers"] if c["name"] == "model-cache")
    for template, container in _fetching(render(directory)):
        context = container["securityContext"]
        # The uid that makes the cache (and owns what it holds), so no capability is needed to write in it.
        assert context["runAsUser"] == cache_step["securityContext"]["runAsUser"], template.name
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert not context.get("privileged")
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        resources = container["resources"]
        assert _bytes(resources["requests"]["memory"]) <= _bytes(resources["limits"]["memory"]) <= 256 * 2**20
        assert _bytes(resources["requests"]["memory"]) >= 150 * 10**6  # the fetch's measured resident size


@pytest.mark.parametrize("directory", INFERENCE)
def test_nodes_that_prefetched_the_model_are_preferred_among_ready_caches(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    for template, container in _fetching(objects):
        name = _fetch(template, container, objects, monkeypatch, capsys).name
        affinity = template.spec["affinity"]["nodeAffinity"]
        required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all(any(e["key"] == READY_LABEL for e in term["matchExpressions"]) for term in required)
        preferred = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
        wanted = [{"key": MODEL_LABEL + name, "operator": "In", "values": ["ready"]}]
        assert wanted in [p["preference"]["matchExpressions"] for p in preferred], template.name
        assert LABEL_NAME.fullmatch((MODEL_LABEL + name).partition("/")[2]), f"not a label name: {name}"


# What the NodePool prefetches --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rendering", ["deploy/examples/full", "deploy/components/karpenter"])
def test_the_node_pool_prefetches_the_vllm_model_from_the_same_source(
    rendering: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(rendering)
    pool = one(objects, "NodePool", "gpu-inference")
    entries = _entries(pool["spec"]["template"]["metadata"]["annotations"][MODELS_ANNOTATION])
    for name, source in entries.items():
        parse_source(source)  # as `spotdrain cache fetch SOURCE --name NAME` takes it
        assert LABEL_NAME.fullmatch((MODEL_LABEL + name).partition("/")[2]), f"not a label name: {name}"
    with_vllm = render("deploy/examples/full") if rendering != "deploy/examples/full" else objects
    vllm = [(t, c) for t, c in _fetching(with_vllm) if t.owner["kind"] == "Deployment"]
    assert vllm
    for template, container in vllm:
        settings = _fetch(template, container, with_vllm, monkeypatch, capsys)
        # The same source, or the init container would find the agent's copy from another and fetch it again.
        assert str(parse_source(entries[settings.name])) == str(settings.source)


def test_an_annotation_entry_is_name_equals_source() -> None:
    assert _entries(" a=s3://b/a/, b=hf+https://m/hub/org/b@v1\n c=s3://b/c/ ") == {
        "a": "s3://b/a/",
        "b": "hf+https://m/hub/org/b@v1",
        "c": "s3://b/c/",
    }


# AWS credentials ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", INFERENCE)
def test_only_the_init_container_gets_the_aws_role(directory: str) -> None:
    objects = render(directory)
    assert _fetching(objects)
    for template, container in _fetching(objects):
        [account] = named(objects, "ServiceAccount", template.spec["serviceAccountName"])
        assert ROLE in account["metadata"]["annotations"]
        others = {c["name"] for c in template.containers + template.spec.get("initContainers", [])}
        others.discard(container["name"])
        if template.owner["kind"] == "RayCluster":
            others.add(KUBERAY_INIT)
        assert set(template.annotations[SKIP].split(",")) == others, template.name


def test_every_role_is_a_listed_placeholder_and_the_model_stack_trusts_its_accounts() -> None:
    accounts: dict[str, set[str]] = {}  # a role's name: NAMESPACE:NAME of every account annotated with it
    for rendering in renderings():
        for account in named(render(rendering), "ServiceAccount"):
            metadata = account["metadata"]
            role = (metadata.get("annotations") or {}).get(ROLE)
            if role is not None:
                assert role in listed_placeholders(), f"{rendering}: {metadata['name']}"
                subject = f"{metadata.get('namespace')}:{metadata['name']}"
                accounts.setdefault(role.rpartition("/")[2], set()).add(subject)
    stack = Stack.of(ModelBucket="my-bucket")
    assert accounts["spotdrain-model-agent"] == {stack.parameters["AgentServiceAccount"]}
    assert accounts["spotdrain-model-inference"] == set(stack.parameters["InferenceServiceAccounts"])


def test_every_model_the_manifests_fetch_is_under_the_prefix_the_policy_grants() -> None:
    sources = set()
    for rendering in renderings():
        objects = render(rendering)
        sources |= {container["args"][0] for _, container in _fetching(objects)}
        for pool in named(objects, "NodePool"):
            annotations = pool["spec"]["template"]["metadata"].get("annotations") or {}
            if MODELS_ANNOTATION in annotations:
                sources |= set(_entries(annotations[MODELS_ANNOTATION]).values())
    assert sources
    for text in sources:
        source = parse_source(text)
        assert isinstance(source, S3Source), text
        stack = Stack.of(ModelBucket=source.bucket)
        assert source.prefix.startswith(stack.parameters["ModelPrefix"]), text


# The prefetch beside the agent -------------------------------------------------------------------------------------


def test_the_prefetch_container_fills_the_agents_cache_and_alone_in_its_pod_gets_the_aws_role(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render("deploy/examples/full")
    template = next(t for t in pod_templates(objects) if t.name.startswith("DaemonSet spotdrain-node"))
    prefetch = next(c for c in template.containers if c["name"] == "model-prefetch")
    call = invocation(template.name, prefetch, objects)
    assert call is not None
    settings: PrefetchSettings = parse(call, monkeypatch, capsys)
    # Its node from the downward API, and the cache the init container mounted, seen through the same host path.
    [node_name] = [e for e in prefetch["env"] if e["name"] == "NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert settings.node_name
    assert settings.cache_path == _agents_cache(monkeypatch, capsys).path
    volumes = {v["name"]: v for v in template.spec["volumes"]}
    [mount] = [m for m in prefetch["volumeMounts"] if Path(m["mountPath"]) == settings.cache_path]
    assert volumes[mount["name"]]["hostPath"]["path"] == str(settings.cache_path)
    assert mount["mountPropagation"] == "HostToContainer"
    ports = {p["containerPort"] for c in template.containers for p in c.get("ports", [])}
    assert settings.metrics_port in ports
    assert prefetch["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert prefetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert _bytes(prefetch["resources"]["limits"]["memory"]) >= 256 * 2**20
    [account] = named(objects, "ServiceAccount", template.spec["serviceAccountName"])
    assert ROLE in account["metadata"]["annotations"]
    others = {c["name"] for c in template.containers + template.spec.get("initContainers", [])} - {"model-prefetch"}
    skipped = set(template.annotations[SKIP].split(","))
    assert "agent" in skipped
    assert skipped <= others
