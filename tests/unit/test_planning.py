from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from agent.drain.planning import (
    ADDED,
    NOTICE_ID,
    TAINT_KEY,
    TERMINATION_TIME,
    grace_for,
    instance_id_of,
    plan_drain,
    plan_mark,
    plan_unmark,
    resumed,
    skip_reason,
)
from agent.notices.notice import Kind, Notice, Source
from simulate.fakes.kube_patch import merge_patch as merge

NOW = datetime(2026, 11, 29, 10, 20, tzinfo=UTC)
SPOT = Notice(Kind.SPOT_INTERRUPTION, "i-0abc", NOW + timedelta(seconds=120), Source.IMDS, detail="terminate")
REBALANCE = Notice(Kind.REBALANCE_RECOMMENDATION, "i-0abc", NOW + timedelta(seconds=120), Source.IMDS)


def node(*, unschedulable: bool = False, taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "gpu-1", "resourceVersion": "7", "annotations": {"other": "x"}},
        "spec": {"providerID": "aws:///us-east-1a/i-0abc", "unschedulable": unschedulable, "taints": taints or []},
    }


def test_a_definitive_notice_taints_cordons_and_annotates_in_one_guarded_patch() -> None:
    patch = plan_mark(node(taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]), SPOT)
    assert patch is not None
    assert patch["metadata"]["resourceVersion"] == "7"
    assert patch["spec"]["unschedulable"] is True
    assert patch["spec"]["taints"] == [
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
        {"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"},
    ]
    annotations = patch["metadata"]["annotations"]
    assert annotations[TERMINATION_TIME] == "2026-11-29T10:22:00Z"
    assert annotations[ADDED] == "cordon,taint"
    assert annotations[NOTICE_ID] == SPOT.id


def test_a_rebalance_recommendation_only_prefers_no_schedule() -> None:
    patch = plan_mark(node(), REBALANCE)
    assert patch is not None
    assert patch["spec"] == {
        "taints": [{"key": TAINT_KEY, "value": "rebalance-recommendation", "effect": "PreferNoSchedule"}]
    }
    assert TERMINATION_TIME not in patch["metadata"]["annotations"]


def test_marking_again_for_the_same_notice_plans_nothing() -> None:
    marked = merge(node(), plan_mark(node(), SPOT))
    assert plan_mark(marked, SPOT) is None


def test_a_spot_warning_after_a_rebalance_replaces_the_soft_taint_and_cordons() -> None:
    soft = merge(node(), plan_mark(node(), REBALANCE))
    hard = merge(soft, plan_mark(soft, SPOT))
    assert [t["effect"] for t in hard["spec"]["taints"] if t["key"] == TAINT_KEY] == ["NoSchedule"]
    assert hard["spec"]["unschedulable"] is True


def test_a_recommendation_after_a_spot_warning_adds_nothing() -> None:
    hard = merge(node(), plan_mark(node(), SPOT))
    assert plan_mark(hard, REBALANCE) is None, "NoSchedule must not become PreferNoSchedule"
    assert plan_mark(merge(node(), plan_mark(node(), REBALANCE)), replace(REBALANCE, detail="another")) is None


def test_of_two_definitive_notices_the_earlier_deadline_wins_and_a_tie_keeps_the_first() -> None:
    far = Notice(Kind.HEALTH_SCHEDULED_CHANGE, "i-0abc", NOW + timedelta(days=3), Source.SQS, detail="arn:1")
    marked = merge(node(), plan_mark(node(), far))
    sooner = merge(marked, plan_mark(marked, SPOT))
    assert sooner["metadata"]["annotations"][NOTICE_ID] == SPOT.id
    assert sooner["metadata"]["annotations"][TERMINATION_TIME] == "2026-11-29T10:22:00Z"
    assert [t["value"] for t in sooner["spec"]["taints"]] == ["spot-interruption"]
    assert plan_mark(sooner, far) is None, "a later deadline adds nothing"
    same_time = Notice(Kind.INSTANCE_TERMINATING, "i-0abc", SPOT.deadline, Source.SQS, detail="event-1")
    assert plan_mark(sooner, same_time) is None


def test_a_reckoned_deadline_is_the_one_the_node_was_first_marked_with() -> None:
    first = Notice(Kind.ASG_TERMINATION, "i-0abc", NOW + timedelta(seconds=120), Source.IMDS, detail="Terminated")
    marked = merge(node(), plan_mark(node(), first))
    restarted = replace(first, deadline=first.deadline + timedelta(seconds=47.5))
    assert resumed(marked, restarted) == first
    assert resumed(marked, restarted).id == first.id
    assert plan_mark(marked, resumed(marked, restarted)) is None
    assert resumed(node(), restarted) == restarted, "nothing recorded: the notice's own deadline"
    stated = replace(restarted, source=Source.SQS)
    assert resumed(marked, stated) == stated, "a deadline AWS stated is never replaced"
    spot_marked = merge(node(), plan_mark(node(), SPOT))
    assert resumed(spot_marked, restarted) == restarted, "another notice's deadline is not this one's"


def test_withdrawing_removes_only_what_was_added() -> None:
    already_cordoned = node(unschedulable=True, taints=[{"key": "keep", "effect": "NoExecute"}])
    marked = merge(already_cordoned, plan_mark(already_cordoned, SPOT))
    assert marked["metadata"]["annotations"][ADDED] == "taint"
    restored = merge(marked, plan_unmark(marked))
    assert restored["spec"]["unschedulable"] is True, "cordoned before the notice: stays cordoned"
    assert restored["spec"]["taints"] == [{"key": "keep", "effect": "NoExecute"}]
    assert restored["metadata"]["annotations"] == {"other": "x"}


def test_withdrawing_an_uncordoned_node_uncordons_it() -> None:
    marked = merge(node(), plan_mark(node(), SPOT))
    restored = merge(marked, plan_unmark(marked))
    assert "unschedulable" not in restored["spec"]
    assert "taints" not in restored["spec"]
    assert plan_unmark(restored) is None


@given(
    unschedulable=st.booleans(),
    foreign=st.lists(st.sampled_from(["a", "b", "c"]), unique=True),
    kinds=st.lists(st.sampled_from(list(Kind)), min_size=1, max_size=4),
)
def test_mark_then_unmark_gives_back_the_node_as_it_was(
    unschedulable: bool, foreign: list[str], kinds: list[Kind]
) -> None:
    original = node(unschedulable=unschedulable, taints=[{"key": k, "effect": "NoSchedule"} for k in foreign])
    current = original
    for kind in kinds:
        patch = plan_mark(current, Notice(kind, "i-0abc", NOW, Source.SQS))
        current = merge(current, patch) if patch else current
    current = merge(current, plan_unmark(current))
    assert bool(current["spec"].get("unschedulable")) == unschedulable
    assert (current["spec"].get("taints") or []) == original["spec"]["taints"]
    assert current["metadata"]["annotations"] == {"other": "x"}


def pod(name: str, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "ml", "name": name, **extra.pop("meta", {})}
    return {
        "metadata": meta,
        "spec": {"nodeName": "gpu-1", **extra.pop("spec", {})},
        "status": extra.pop("status", {"phase": "Running"}),
    }


def test_daemonset_mirror_terminating_finished_and_own_pods_are_not_evicted() -> None:
    pods = [
        pod("vllm-0", spec={"terminationGracePeriodSeconds": 130}),
        pod("logs", meta={"ownerReferences": [{"kind": "DaemonSet", "name": "fluent-bit"}]}),
        pod("static", meta={"annotations": {"kubernetes.io/config.mirror": "abc"}}),
        pod("going", meta={"deletionTimestamp": "2026-11-29T10:19:00Z"}),
        pod("job", status={"phase": "Succeeded"}),
        pod("spotdrain-agent"),
    ]
    plan = plan_drain(pods, deadline=SPOT.deadline, now=NOW, margin_s=5, agent_pod=("ml", "spotdrain-agent"))
    assert [(e.name, e.grace_s) for e in plan] == [("vllm-0", 115)]
    assert [skip_reason(p, agent_pod=("ml", "spotdrain-agent")) for p in pods[1:]] == [
        "daemonset",
        "mirror",
        "terminating",
        "finished",
        "self",
    ]


def test_grace_is_the_pods_own_when_the_deadline_is_far_and_never_under_one_second() -> None:
    later = NOW + timedelta(hours=1)
    assert grace_for(pod("a", spec={"terminationGracePeriodSeconds": 130}), deadline=later, now=NOW, margin_s=5) == 130
    assert grace_for(pod("a"), deadline=later, now=NOW, margin_s=5) == 30
    # 0 would be an immediate deletion, without the preStop that holds the pod until its streams end.
    assert grace_for(pod("a"), deadline=NOW, now=NOW + timedelta(seconds=3), margin_s=5) == 1
    assert grace_for(pod("a"), deadline=NOW + timedelta(seconds=5), now=NOW, margin_s=5) == 1
    assert grace_for(pod("a", spec={"terminationGracePeriodSeconds": 0}), deadline=later, now=NOW, margin_s=5) == 1


@given(
    own=st.one_of(st.none(), st.integers(min_value=-5, max_value=10**6)),
    left_s=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    margin_s=st.floats(min_value=0, max_value=600, allow_nan=False),
)
def test_no_planned_eviction_is_an_immediate_deletion(own: int | None, left_s: float, margin_s: float) -> None:
    spec = {} if own is None else {"terminationGracePeriodSeconds": own}
    plan = plan_drain(
        [pod("a", spec=spec)], deadline=NOW + timedelta(seconds=left_s), now=NOW, margin_s=margin_s, agent_pod=None
    )
    assert [eviction.grace_s >= 1 for eviction in plan] == [True]


def test_instance_ids_come_from_the_provider_id_only() -> None:
    assert instance_id_of(node()) == "i-0abc"
    assert instance_id_of({"spec": {"providerID": "gce://p/z/i-0abc"}}) is None
    assert instance_id_of({"spec": {}}) is None
