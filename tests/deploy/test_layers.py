"""The optional layers stay optional: the default overlays install core Kubernetes objects only, every namespace an
installation uses is created in it or documented, and every placeholder a user must set is listed in one place."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import (
    CUSTOM_GROUPS,
    DEPLOY,
    LAYERS,
    MODES,
    ROOT,
    Obj,
    components,
    kustomization_dirs,
    kustomizations,
    named,
    one,
    render,
    renderings,
)
from tests.deploy.test_cfn import _template as cloudformation_template

PLACEHOLDERS = DEPLOY / "PLACEHOLDERS.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the landing page and the pages it links
FULL = "deploy/examples/full"
# Parts of another kustomization, not installed on their own: checked inside the one that includes them.
PARTS = {"daemonset/queue": "daemonset/queue-mode"}
# What a value a user must replace looks like: an AWS account id, a region, an ARN, an SQS queue URL, an S3 bucket
# (s3://BUCKET/, whatever follows it), a name in capitals (CLUSTER_NAME, YOUR_ACCOUNT_ID), a REPLACE_ME. Matched in
# every string value but objects' own names and $(VAR) references (the environment variables' names are capitals too).
PLACEHOLDER_LIKE = re.compile(
    r"https://sqs\.[^\s\"',]+"
    r"|\bs3://[^/\s\"',]+/?"
    r"|\barn:aws[a-z-]*:[^\s\"',]+"
    r"|(?<!\d)\d{12}(?!\d)"
    r"|\b[a-z]{2}(?:-gov)?-(?:north|south|east|west|central)(?:east|west)?-\d\b"
    r"|\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*_(?:NAME|ID|ARN|URL|REGION|ACCOUNT)\b"
    r"|\b(?:REPLACE|CHANGE)_?ME\b|\b(?:YOUR|MY)_[A-Z0-9_]+"
)
REFERENCE = re.compile(r"\$\(\w+\)")


def _table(section: str) -> dict[str, list[str]]:
    """The rows of the table under ``## <section>`` in deploy/PLACEHOLDERS.md: first cell to the paths in the last."""
    text = PLACEHOLDERS.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| `")]
    return {row[0].strip("|` "): re.findall(r"`([\w./-]+/[\w./-]+)`", row[-1]) for row in rows}


def listed_placeholders() -> dict[str, list[str]]:
    return _table("Placeholders")


def provided_namespaces() -> set[str]:
    return set(_table("Namespaces you provide"))


def _strings(value: Any, key: str | None = None) -> Iterator[tuple[str | None, str]]:
    if isinstance(value, dict):
        for child_key, child in value.items():
            yield from _strings(child, child_key)
    elif isinstance(value, list):
        for child in value:
            yield from _strings(child, key)
    elif isinstance(value, str):
        yield key, value


def placeholders_in(objects: list[Obj]) -> set[str]:
    found: set[str] = set()
    for obj in objects:
        for key, value in _strings(obj):
            if key != "name":
                found |= set(PLACEHOLDER_LIKE.findall(REFERENCE.sub("", value)))
    return found


def _is_core(api_version: str) -> bool:
    # Kubernetes' own groups have no dot (apps, policy) or end in .k8s.io; a CRD's group is a domain of its own.
    group = api_version.rpartition("/")[0]
    return group not in CUSTOM_GROUPS and ("." not in group or group.endswith(".k8s.io"))


# The default overlays and the example ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", MODES)
def test_the_default_overlays_install_only_core_kubernetes_objects(overlay: str) -> None:
    objects = render(overlay)
    assert [f"{o['apiVersion']} {o['kind']}" for o in objects if not _is_core(o["apiVersion"])] == []
    one(objects, "DaemonSet", "spotdrain-node")
    assert {o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]} <= {"spotdrain", "default"}


def test_a_custom_group_is_not_core() -> None:
    for core in ("v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"):
        assert _is_core(core)
    assert not _is_core("monitoring.coreos.com/v1")
    assert not _is_core("cert-manager.io/v1")
    assert not _is_core("keda.sh/v1alpha1")


def test_every_component_is_composed_in_the_tests() -> None:
    assert sorted(layer.component for layer in LAYERS) == components()


def test_no_component_sets_a_namespace_for_everything() -> None:
    # A component's namespace: would move every object of the overlay that adds it, the agent's included.
    for component in components():
        assert "namespace" not in yaml.safe_load((ROOT / component / "kustomization.yaml").read_text()), component


def test_the_full_example_adds_every_layer_of_the_node_agents_overlays() -> None:
    kustomization = yaml.safe_load((ROOT / FULL / "kustomization.yaml").read_text())
    added = {str((ROOT / FULL / path).resolve().relative_to(ROOT)) for path in kustomization["components"]}
    assert added == {layer.component for layer in LAYERS if layer.with_mode and not layer.under}
    objects = render(FULL)
    for kind, name in [
        ("NodePool", "gpu-inference"),
        ("EC2NodeClass", "gpu-inference"),
        ("DaemonSet", "spotdrain-node"),
        ("Deployment", "spotdrain-queue"),
        ("Deployment", "vllm"),
        ("ScaledObject", "vllm"),
        ("PodMonitor", "spotdrain-node"),
        ("PodMonitor", "vllm"),
        ("PrometheusRule", "spotdrain"),
        ("ConfigMap", "spotdrain-dashboard"),
    ]:
        one(objects, kind, name)


# Namespaces --------------------------------------------------------------------------------------------------------


def _namespaces_used(obj: Obj) -> set[str]:
    used = {obj["metadata"]["namespace"]} if "namespace" in obj["metadata"] else set()
    used |= {s["namespace"] for s in obj.get("subjects", []) if "namespace" in s}
    used |= {hook["clientConfig"]["service"]["namespace"] for hook in obj.get("webhooks", [])}
    return used


@pytest.mark.parametrize("rendering", [r for r in renderings() if r not in PARTS])
def test_every_namespace_is_created_alongside_or_provided_by_the_user(rendering: str) -> None:
    objects = render(rendering)
    created = {o["metadata"]["name"] for o in named(objects, "Namespace")}
    missing = {
        f"{o['kind']} {o['metadata']['name']}": sorted(used)
        for o in objects
        if (used := _namespaces_used(o) - created - provided_namespaces())
    }
    assert missing == {}


def test_the_parts_are_installed_by_the_overlay_that_includes_them() -> None:
    for part, whole in PARTS.items():
        assert f"../{Path(part).name}" in yaml.safe_load((ROOT / whole / "kustomization.yaml").read_text())["resources"]


# Placeholders ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rendering", renderings())
def test_every_placeholder_is_one_the_list_names(rendering: str) -> None:
    assert placeholders_in(render(rendering)) - set(listed_placeholders()) == set()


def test_every_listed_placeholder_is_still_in_the_manifests_and_in_the_files_it_names() -> None:
    rendered = set().union(*(placeholders_in(render(r)) for r in renderings()))
    for placeholder, files in listed_placeholders().items():
        assert placeholder in rendered or any(placeholder in p for p in rendered), placeholder
        assert files, f"{placeholder}: no file named"
        for path in files:
            assert placeholder in (ROOT / path).read_text(), f"{placeholder} is not in {path}"


def test_a_placeholder_looking_value_is_found() -> None:
    objects: list[Obj] = [
        {"metadata": {"name": "SOME_ID"}, "data": {"a": "arn:aws:iam::123456789012:role/x", "b": "eu-west-3"}},
        {"spec": {"args": ["--node=$(NODE_NAME)", "REPLACE_ME", "--cluster=YOUR_CLUSTER", "MY_ACCOUNT_ID"]}},
        {"metadata": {"annotations": {"models": "a=s3://bucket-a/x/ b=s3://bucket-b"}}},
    ]
    assert placeholders_in(objects) == {
        "arn:aws:iam::123456789012:role/x",
        "eu-west-3",
        "s3://bucket-a/",
        "s3://bucket-b",
        "REPLACE_ME",
        "YOUR_CLUSTER",
        "MY_ACCOUNT_ID",
    }


def test_the_queue_url_is_the_same_everywhere_and_names_the_stacks_queue() -> None:
    queue_name = cloudformation_template()["Parameters"]["QueueName"]["Default"]
    settings = []
    for rendering in ("daemonset/queue", "daemonset/queue-mode", FULL):
        [config_map] = [
            o for o in named(render(rendering), "ConfigMap") if o["metadata"]["name"].startswith("spotdrain-q")
        ]
        settings.append(config_map["data"])
    assert all(data == settings[0] for data in settings), settings
    url = settings[0]["queue-url"]
    assert url.rsplit("/", 1)[1] == queue_name
    assert url.startswith(f"https://sqs.{settings[0]['aws-region']}.amazonaws.com/")
    assert url in listed_placeholders()


# The documentation against the files -------------------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w/.-])((?:deploy|daemonset)/[\w./-]*)")
_APPLY = re.compile(r"kubectl apply -k ((?:[\w.-]+/)*[\w.-]+)/?(?=[\s`]|$)")


def test_every_path_the_docs_name_exists_and_every_optional_layer_is_in_them() -> None:
    text = "\n".join(page.read_text() for page in DOCS)
    named_paths = {path.rstrip(".,:;") for path in _PATH.findall(text)}
    assert sorted(path for path in named_paths if not (ROOT / path).exists()) == []
    layers = [c for c in components() if c.startswith("deploy/components/")]
    assert [component for component in layers if component not in named_paths] == []


def test_what_the_docs_say_to_apply_is_a_kustomization() -> None:
    texts = [*(page.read_text() for page in DOCS), PLACEHOLDERS.read_text()]
    texts += [(ROOT / d / "kustomization.yaml").read_text() for d in kustomization_dirs()]
    applied = {path for text in texts for path in _APPLY.findall(text)}
    assert applied
    assert applied - set(kustomizations()) == set()
