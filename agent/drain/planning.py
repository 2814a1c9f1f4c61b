"""Pure decisions of the node handler: how to mark a node for a notice, how to undo it, which pods to evict.

What the agent adds to a node is recorded on the node itself (``spotdrain.io/added``), so a restarted agent resumes
without doing anything twice and a withdrawn notice removes exactly what was added: a node cordoned by someone else
before the notice stays cordoned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from agent.notices.notice import Notice
from spotdrain.clock import parse_rfc3339, rfc3339

TAINT_KEY = "spotdrain.io/interruption"
TERMINATION_TIME = "spotdrain.io/termination-time"
NOTICE_ID = "spotdrain.io/notice"
ADDED = "spotdrain.io/added"
MIRROR = "kubernetes.io/config.mirror"
DEFAULT_GRACE_S = 30
# The API server takes a grace period of 0 as an immediate deletion: no preStop, and a StatefulSet may start the
# replacement while the old pod still runs. One second still runs the preStop and lets the kubelet stop it in order.
MIN_GRACE_S = 1

Node = dict[str, Any]
Pod = dict[str, Any]


def _annotations(obj: dict[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def _taints(node: Node) -> list[dict[str, Any]]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, dict)]


def added_by_us(node: Node) -> set[str]:
    return {part for part in _annotations(node).get(ADDED, "").split(",") if part}


def marked_for(node: Node) -> str | None:
    """The id of the notice the node is marked for, if any."""
    return _annotations(node).get(NOTICE_ID)


@dataclass(frozen=True)
class Mark:
    """What the node says it is marked for: a notice id, and the deadline of a definitive notice."""

    notice_id: str
    definitive: bool
    deadline: datetime | None  # None for a recommendation, or a termination time that does not parse


def mark_of(node: Node) -> Mark | None:
    annotations = _annotations(node)
    notice_id = annotations.get(NOTICE_ID)
    if notice_id is None:
        return None
    recorded = annotations.get(TERMINATION_TIME)
    try:
        deadline = parse_rfc3339(recorded) if recorded is not None else None
    except ValueError:
        deadline = None
    return Mark(notice_id=notice_id, definitive=recorded is not None, deadline=deadline)


def outranks(notice: Notice, mark: Mark) -> bool:
    """Whether ``notice`` replaces the mark on a node: a definitive notice outranks a recommendation, and an
    earlier deadline a later one. A tie keeps the mark, and a recommendation never replaces anything."""
    if not notice.kind.definitive:
        return False
    if not mark.definitive or mark.deadline is None:
        return True
    return notice.deadline < mark.deadline


def resumed(node: Node, notice: Notice) -> Notice:
    """``notice`` with the deadline the node was first marked with, where that deadline was the agent's own
    reckoning (see ``Notice.reckoned``): an agent restarted later reckons a later one, which must not count."""
    mark = mark_of(node)
    if not notice.reckoned or mark is None or mark.deadline is None or mark.deadline >= notice.deadline:
        return notice
    first = replace(notice, deadline=mark.deadline)
    return first if first.id == mark.notice_id else notice


def plan_mark(node: Node, notice: Notice) -> dict[str, Any] | None:
    """A JSON merge patch (guarded by resourceVersion) that marks ``node`` for ``notice``; None if the node is
    already marked for it or for a notice that outranks it (a weaker notice adds nothing).

    A definitive notice taints ``NoSchedule`` and cordons; a rebalance recommendation only taints
    ``PreferNoSchedule``. A stronger notice replaces the taint and the annotations of a weaker one.
    """
    mark = mark_of(node)
    if mark is not None and not outranks(notice, mark):
        return None
    definitive = notice.kind.definitive
    taint = {"key": TAINT_KEY, "value": notice.kind.value, "effect": "NoSchedule" if definitive else "PreferNoSchedule"}
    taints = [t for t in _taints(node) if t.get("key") != TAINT_KEY] + [taint]
    added = added_by_us(node) | {"taint"}
    spec: dict[str, Any] = {"taints": taints}
    if definitive and not (node.get("spec") or {}).get("unschedulable"):
        spec["unschedulable"] = True
        added.add("cordon")
    annotations = {NOTICE_ID: notice.id, ADDED: ",".join(sorted(added))}
    if definitive:
        annotations[TERMINATION_TIME] = rfc3339(notice.deadline)
    return {"metadata": _guard(node, annotations), "spec": spec}


def plan_unmark(node: Node) -> dict[str, Any] | None:
    """The merge patch that removes what the agent added, and only that; None if it added nothing."""
    added = added_by_us(node)
    if not added and marked_for(node) is None:
        return None
    spec: dict[str, Any] = {}
    if "taint" in added:
        spec["taints"] = [t for t in _taints(node) if t.get("key") != TAINT_KEY] or None
    if "cordon" in added:
        spec["unschedulable"] = None
    annotations: dict[str, str | None] = {NOTICE_ID: None, ADDED: None, TERMINATION_TIME: None}
    patch: dict[str, Any] = {"metadata": _guard(node, annotations)}
    if spec:
        patch["spec"] = spec
    return patch


def _guard(node: Node, annotations: dict[str, Any]) -> dict[str, Any]:
    # The resourceVersion makes the server refuse the patch (409) if the node changed since it was read.
    return {"resourceVersion": node["metadata"]["resourceVersion"], "annotations": annotations}


@dataclass(frozen=True)
class Eviction:
    namespace: str
    name: str
    grace_s: int


def skip_reason(pod: Pod, *, agent_pod: tuple[str, str] | None) -> str | None:
    """Why a pod on the node is left alone, or None if it is to be evicted."""
    meta = pod.get("metadata") or {}
    if agent_pod is not None and (meta.get("namespace"), meta.get("name")) == agent_pod:
        return "self"
    if MIRROR in (meta.get("annotations") or {}):
        return "mirror"
    if any(ref.get("kind") == "DaemonSet" for ref in meta.get("ownerReferences") or []):
        return "daemonset"
    if meta.get("deletionTimestamp"):
        return "terminating"
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return "finished"
    return None


def grace_for(pod: Pod, *, deadline: datetime, now: datetime, margin_s: float) -> int:
    """The pod's own grace period, shortened so that it ends ``margin_s`` before the deadline; never under
    ``MIN_GRACE_S``, however close the deadline (or if it has passed)."""
    own = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    own_s = own if isinstance(own, int) and own >= 0 else DEFAULT_GRACE_S
    left_s = (deadline - now).total_seconds() - margin_s
    return max(MIN_GRACE_S, min(own_s, math.floor(left_s)))


def plan_drain(
    pods: list[Pod], *, deadline: datetime, now: datetime, margin_s: float, agent_pod: tuple[str, str] | None
) -> list[Eviction]:
    """The evictions that empty the node in time; pods that need not or must not be evicted are left out."""
    return [
        Eviction(
            namespace=pod["metadata"]["namespace"],
            name=pod["metadata"]["name"],
            grace_s=grace_for(pod, deadline=deadline, now=now, margin_s=margin_s),
        )
        for pod in pods
        if skip_reason(pod, agent_pod=agent_pod) is None
    ]


def instance_id_of(node: Node) -> str | None:
    """The EC2 instance id from ``spec.providerID`` (``aws:///<zone>/<instance-id>``)."""
    provider = (node.get("spec") or {}).get("providerID") or ""
    if not provider.startswith("aws://"):
        return None
    last = provider.rstrip("/").rsplit("/", 1)[-1]
    return last if last.startswith("i-") else None
