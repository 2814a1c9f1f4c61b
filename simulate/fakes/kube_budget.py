"""Disruption budgets as the fake Kubernetes API computes them: the disruption controller's arithmetic, the status
it writes, and why the eviction subresource refuses a pod. Pure functions of plain dicts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from simulate.fakes.kube_select import KubeError, Obj, labels_match, selector_requirements


@dataclass(frozen=True)
class Budget:
    expected: int
    desired_healthy: int
    current_healthy: int
    allowed: int


def pod_ready(pod: Obj) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pdb_selects(pdb: Obj, pod: Obj) -> bool:
    requirements = selector_requirements(pdb.get("spec", {}).get("selector"))
    same_namespace = pdb["metadata"].get("namespace") == pod["metadata"].get("namespace")
    return requirements is not None and same_namespace and labels_match(requirements, pod["metadata"].get("labels"))


def disruption_budget(pdb: Obj, pods: Iterable[Obj]) -> Budget:
    """The disruption controller's status for ``pdb``; the scale of a percentage is the number of selected pods."""
    chosen = [p for p in pods if pdb_selects(pdb, p)]
    spec = pdb.get("spec", {})
    expected = desired = 0
    if spec.get("maxUnavailable") is not None:
        expected = len(chosen)
        desired = max(0, expected - _scaled(spec["maxUnavailable"], expected))
    elif spec.get("minAvailable") is not None:
        expected = len(chosen)
        desired = _scaled(spec["minAvailable"], expected)
    healthy = sum(1 for p in chosen if not p["metadata"].get("deletionTimestamp") and pod_ready(p))
    allowed = healthy - desired if expected > 0 and healthy > desired else 0
    return Budget(expected, desired, healthy, allowed)


def pdb_status(pdb: Obj, budget: Budget) -> Obj:
    condition = "True" if budget.allowed > 0 else "False"
    return {
        "observedGeneration": pdb["metadata"].get("generation", 1),
        "disruptionsAllowed": budget.allowed,
        "currentHealthy": budget.current_healthy,
        "desiredHealthy": budget.desired_healthy,
        "expectedPods": budget.expected,
        "conditions": [
            {
                "type": "DisruptionAllowed",
                "status": condition,
                "reason": "SufficientPods" if budget.allowed > 0 else "InsufficientPods",
                "message": "",
                "observedGeneration": pdb["metadata"].get("generation", 1),
                "lastTransitionTime": pdb["metadata"].get("creationTimestamp", ""),
            }
        ],
    }


def eviction_refusal(pod: Obj, *, pdbs: Iterable[Obj], pods: Iterable[Obj]) -> KubeError | None:
    """Why the eviction API would refuse to evict ``pod`` now, or None; ``pods`` are those of its namespace.

    The API server's rule (pkg/registry/core/pod/storage/eviction.go, ``Create`` and ``checkAndDecrement``):
    terminal, pending and terminating pods are never held (``canIgnorePDB``). A pod that is not Ready goes when its
    budget says ``unhealthyPodEvictionPolicy: AlwaysAllow``, or, under the default ``IfHealthyBudget``, when
    ``currentHealthy >= desiredHealthy && desiredHealthy > 0``. Any other pod needs ``disruptionsAllowed > 0`` (the
    eviction uses one up: here the evicted pod's ``deletionTimestamp`` takes it out of ``currentHealthy``). Else 429
    with the server's message and cause, and no Retry-After (``NewTooManyRequests(..., 0)``). The budget's status is
    computed afresh here, where the real one is the disruption controller's and can lag behind the pods.
    """
    phase = pod.get("status", {}).get("phase")
    if phase in ("Succeeded", "Failed", "Pending") or pod["metadata"].get("deletionTimestamp"):
        return None
    matching = [p for p in pdbs if pdb_selects(p, pod)]
    if len(matching) > 1:
        message = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
        return KubeError(500, "InternalError", message)
    if not matching:
        return None
    pdb, budget = matching[0], disruption_budget(matching[0], pods)
    always = pdb["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow"
    if not pod_ready(pod) and (always or budget.current_healthy >= budget.desired_healthy > 0):
        return None
    if budget.allowed > 0:
        return None
    cause = (
        f"The disruption budget {pdb['metadata']['name']} needs {budget.desired_healthy} healthy pods "
        f"and has {budget.current_healthy} currently"
    )
    return KubeError(
        429,
        "TooManyRequests",
        "Cannot evict pod as it would violate the pod's disruption budget.",
        details={"causes": [{"reason": "DisruptionBudget", "message": cause}]},
    )


def _scaled(value: int | str, total: int) -> int:
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"(\d+)%", str(value))
    if match is None:
        raise KubeError(422, "Invalid", "invalid value for IntOrString: invalid type: string is not a percentage")
    return math.ceil(int(match.group(1)) * total / 100)
