"""The pure parts of ``spotdrain check``: readers of objects, the names it shares with inject and the sidecar, and
how a report is printed and turned into an exit status."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

import pytest

from check import objects as o
from check.findings import Finding, Report, Snapshot, Unread
from check.report import as_json, as_text
from check.rules import evaluate
from simulate.fakes.kube_select import labels_match, parse_label_selector


def test_the_names_it_checks_for_are_the_ones_inject_and_the_sidecar_use() -> None:
    from inject import pods, spec
    from sidecar.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert o.SIDECAR == spec.SIDECAR
    assert (o.POLICY, o.ALWAYS_ALLOW) == (spec.POLICY, spec.ALWAYS_ALLOW)
    assert o.GRACE_MARGIN_S == pods.GRACE_MARGIN_S
    assert parser.parse_args([]).drain_timeout == o.DEFAULT_DRAIN_TIMEOUT_S
    assert o.grace_needed(110) == 130  # what deploy/vllm sets


@pytest.mark.parametrize(
    ("toleration", "taint", "tolerated"),
    [
        ({"operator": "Exists"}, {"key": "a", "value": "b", "effect": "NoSchedule"}, True),
        ({"key": "a", "operator": "Exists"}, {"key": "a", "value": "b", "effect": "NoExecute"}, True),
        ({"key": "a", "operator": "Exists", "effect": "NoExecute"}, {"key": "a", "effect": "NoSchedule"}, False),
        ({"key": "a", "value": "b"}, {"key": "a", "value": "b", "effect": "NoSchedule"}, True),
        ({"key": "a", "operator": "Equal", "value": "c"}, {"key": "a", "value": "b", "effect": "NoSchedule"}, False),
        ({"key": "b", "operator": "Exists"}, {"key": "a", "effect": "NoSchedule"}, False),
        ({"operator": "Equal"}, {"key": "a", "effect": "NoSchedule"}, False),  # Equal needs a key
    ],
)
def test_a_toleration_tolerates_as_the_scheduler_reads_it(
    toleration: dict[str, str], taint: dict[str, str], tolerated: bool
) -> None:
    assert o.tolerates(toleration, taint) is tolerated


def test_only_taints_that_keep_pods_off_block_the_agent() -> None:
    node = {"spec": {"taints": [{"key": "a", "effect": "PreferNoSchedule"}, {"key": "b", "effect": "NoExecute"}]}}
    assert o.blocking_taints(node, []) == [{"key": "b", "effect": "NoExecute"}]
    assert o.blocking_taints(node, [{"key": "b", "operator": "Exists"}]) == []


SELECTORS = [
    {"matchLabels": {"app": "vllm"}},
    {
        "matchLabels": {"app": "vllm", "tier": "gpu"},
        "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}],
    },
    {
        "matchExpressions": [
            {"key": "zone", "operator": "NotIn", "values": ["c"]},
            {"key": "canary", "operator": "DoesNotExist"},
        ]
    },
    {"matchExpressions": [{"key": "canary", "operator": "Exists"}]},
]
LABELS = [{}, {"app": "vllm"}, {"app": "vllm", "tier": "gpu", "zone": "a"}, {"zone": "c"}, {"canary": "1", "zone": "b"}]


@pytest.mark.parametrize("selector", SELECTORS)
def test_a_selector_matches_as_the_api_servers_query_of_it_does(selector: dict[str, object]) -> None:
    # The fake API server's selector parser follows apimachinery's labels.Parse: the query the reader sends must
    # select the same pods the checks match in memory.
    requirements = parse_label_selector(o.selector_query(selector))
    for labels in LABELS:
        assert o.selector_matches(selector, labels) is labels_match(requirements, labels), labels


def test_a_missing_selector_selects_nothing_and_an_empty_one_everything() -> None:
    assert o.selector_matches(None, {"a": "b"}) is False
    assert o.selector_matches({}, {"a": "b"}) is True


@pytest.mark.parametrize(
    ("words", "env", "evicts"),
    [
        (["spotdrain", "node"], {}, True),
        (["spotdrain", "node", "--no-evict"], {}, False),
        (["spotdrain", "node", "--dry-run"], {}, False),
        (["spotdrain", "node"], {"SPOTDRAIN_EVICT": "false"}, False),
        (["spotdrain", "node"], {"SPOTDRAIN_EVICT": "True"}, True),
        (["spotdrain", "node", "--evict"], {"SPOTDRAIN_EVICT": "false"}, True),  # the flag wins over the variable
    ],
)
def test_whether_an_agent_evicts_is_read_from_its_flags_then_its_variables(
    words: list[str], env: dict[str, str], evicts: bool
) -> None:
    container = {"command": words[:2], "args": words[2:], "env": [{"name": k, "value": v} for k, v in env.items()]}
    assert o.evicts(container) is evicts


@pytest.mark.parametrize(
    ("image", "tag"),
    [
        ("ghcr.io/spotdrain/spotdrain-sidecar:0.1.0", "0.1.0"),
        ("registry:5000/spotdrain-sidecar", "latest"),
        ("registry:5000/spotdrain-sidecar:0.2", "0.2"),
        ("spotdrain-sidecar@sha256:abc", "sha256:abc"),
    ],
)
def test_an_images_tag_ignores_a_registry_port(image: str, tag: str) -> None:
    assert o.image_tag(image) == tag


def test_a_replica_sets_pod_is_restarted_through_its_deployment() -> None:
    pod = {
        "metadata": {
            "labels": {"pod-template-hash": "5d9f8"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "vllm-5d9f8", "controller": True}],
        }
    }
    assert o.owner(pod) == ("Deployment", "vllm")


NOW = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)


def test_the_text_report_groups_findings_with_their_marks_objects_and_fixes() -> None:
    report = Report(
        (
            Finding(
                "ok", "agent", "the node agent is ready on 2 of 2 GPU nodes", ("DaemonSet/spotdrain/spotdrain-node",)
            ),
            Finding(
                "error", "budgets", "a budget blocks", ("PodDisruptionBudget/inference/vllm",), "kubectl patch ..."
            ),
            Finding("warning", "model-cache", "gpu-3 is preparing", ("Node/gpu-3",), "wait"),
        ),
        skipped=frozenset({"webhook"}),
    )
    assert as_text(report).splitlines() == [
        "node agent",
        "  ✓ the node agent is ready on 2 of 2 GPU nodes",
        "disruption budgets",
        "  ✗ a budget blocks",
        "      objects: PodDisruptionBudget/inference/vllm",
        "      fix: kubectl patch ...",
        "webhook",
        "  - not checked: a read it needs failed (see access)",
        "model cache",
        "  ⚠ gpu-3 is preparing",
        "      objects: Node/gpu-3",
        "      fix: wait",
        "",
        "1 errors, 1 warnings",
    ]
    assert report.exit_code == 1
    assert '"objects": [\n      "Node/gpu-3"\n    ]' in as_json(report)


def test_an_empty_cluster_says_the_agent_is_missing_and_that_nothing_evicts() -> None:
    report = evaluate(Snapshot(now=NOW))
    errors = {f.check: f for f in report.findings if f.severity == "error"}
    assert sorted(errors) == ["agent", "interruption-sources"]
    assert errors["agent"].fix.startswith("kubectl apply -k daemonset/imds-mode")
    assert report.exit_code == 1


def test_a_refused_read_skips_only_the_checks_that_need_it_and_exits_2() -> None:
    refused = Unread("list", "nodes", "the cluster scope", 403, "forbidden", ("agent", "model-cache"))
    report = evaluate(Snapshot(now=NOW, unread=(refused,)))
    assert {f.check for f in report.findings} == {
        "access",
        "sidecar-injection",
        "budgets",
        "grace-periods",
        "interruption-sources",
        "gateway",
        "webhook",
    }
    assert report.skipped == {"agent", "model-cache"}
    assert report.exit_code == 2


def test_an_unreachable_cluster_exits_2_and_says_why() -> None:
    report = Report((), unreachable="HTTP 0: refused")
    assert report.exit_code == 2
    assert as_text(report) == "✗ could not read the cluster: HTTP 0: refused\n"
