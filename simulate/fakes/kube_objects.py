"""Nodes, pods and disruption budgets as a cluster holds them, for seeding the fake Kubernetes API.

Each builder returns the object a real cluster would show after the kubelet and controllers have done their part (an
EC2 provider id, Ready conditions, an owner reference, a mirror pod's annotations); the store adds ``uid``,
``resourceVersion`` and ``creationTimestamp``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime

from simulate.fakes.kube_select import Obj
from spotdrain.clock import rfc3339

_OWNER_API_VERSIONS = {"DaemonSet": "apps/v1", "ReplicaSet": "apps/v1", "StatefulSet": "apps/v1", "Job": "batch/v1"}


def provider_id(name: str) -> str:
    """A stable AWS provider id for a node name: ``aws:///us-east-1a/i-<17 hex digits>``."""
    return f"aws:///us-east-1a/i-{_digest(name)[:17]}"


def node(
    name: str,
    *,
    provider: str | None,
    labels: Mapping[str, str] | None,
    taints: Sequence[Mapping[str, str]],
    unschedulable: bool,
    now: datetime,
    annotations: Mapping[str, str] | None = None,
) -> Obj:
    spec: Obj = {"providerID": provider or provider_id(name)}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    if unschedulable:
        spec["unschedulable"] = True
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}
    metadata: Obj = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "metadata": metadata,
        "spec": spec,
        "status": {
            "conditions": [ready | {"lastHeartbeatTime": _time(now), "lastTransitionTime": _time(now)}],
            "addresses": [{"type": "InternalIP", "address": _address(name)}, {"type": "Hostname", "address": name}],
        },
    }


def pod(
    namespace: str,
    name: str,
    *,
    node_name: str,
    node_uid: str | None,
    labels: Mapping[str, str] | None,
    annotations: Mapping[str, str] | None,
    owner_kind: str | None,
    mirror: bool,
    phase: str,
    ready: bool,
    grace_period_s: int,
    readiness_gates: Sequence[str],
    now: datetime,
) -> Obj:
    """A scheduled pod; a mirror pod (a static pod's copy) carries the kubelet's annotations and the node as owner.

    ``ready`` is what its containers' readiness probes say; with ``readiness_gates`` the pod is Ready only once
    something sets those conditions True through ``pods/status``.
    """
    meta: Obj = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    meta["annotations"] = dict(annotations or {})
    if mirror:
        config_hash = _digest(f"{namespace}/{name}")[:32]
        meta["annotations"] |= {
            "kubernetes.io/config.mirror": config_hash,
            "kubernetes.io/config.hash": config_hash,
            "kubernetes.io/config.source": "file",
        }
    if owner_kind is not None or mirror:
        meta["ownerReferences"] = [_owner(owner_kind or "Node", name=name, node_name=node_name, node_uid=node_uid)]
    spec: Obj = {
        "nodeName": node_name,
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
        "terminationGracePeriodSeconds": grace_period_s,
        "restartPolicy": "Always",
        "schedulerName": "default-scheduler",
        "serviceAccountName": "default",
    }
    if readiness_gates:
        spec["readinessGates"] = [{"conditionType": gate} for gate in readiness_gates]
    return with_ready_condition(
        {"metadata": meta, "spec": spec, "status": _pod_status(phase=phase, ready=ready, now=now)}, now=now
    )


def endpoint_slices(
    namespace: str, service: str, endpoints: Sequence[tuple[str, int, bool]], *, nodes: Sequence[str] = ()
) -> list[Obj]:
    """A Service's EndpointSlices as its controller writes them, one per (IP, port, ready) endpoint."""
    slices = []
    for index, (ip, port, ready) in enumerate(endpoints):
        endpoint: Obj = {"addresses": [ip], "conditions": {"ready": ready}}
        if index < len(nodes):
            endpoint["nodeName"] = nodes[index]
        slices.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{service}-{index}",
                    "namespace": namespace,
                    "labels": {"kubernetes.io/service-name": service},
                },
                "addressType": "IPv4",
                "endpoints": [endpoint],
                "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            }
        )
    return slices


def pdb(
    namespace: str,
    name: str,
    *,
    selector: Mapping[str, str],
    min_available: int | str | None,
    max_unavailable: int | str | None,
    unhealthy_pod_eviction_policy: str | None = None,
) -> Obj:
    """A budget; ``unhealthy_pod_eviction_policy``: ``IfHealthyBudget`` (what unset means) or ``AlwaysAllow``."""
    spec: Obj = {"selector": {"matchLabels": dict(selector)}}
    if min_available is not None:
        spec["minAvailable"] = min_available
    if max_unavailable is not None:
        spec["maxUnavailable"] = max_unavailable
    if unhealthy_pod_eviction_policy is not None:
        spec["unhealthyPodEvictionPolicy"] = unhealthy_pod_eviction_policy
    return {"metadata": {"name": name, "namespace": namespace, "generation": 1}, "spec": spec}


# Pod readiness, as the kubelet computes it -------------------------------------------------------------------------
#
# The fake has no kubelet of its own: tests and the simulation report the containers' readiness probes through
# ``with_containers_ready`` (FakeKube.set_containers_ready), and every write to a pod's status recomputes Ready from
# ContainersReady and the readiness gates' conditions, as the kubelet's status manager does when it next syncs the pod.


def with_containers_ready(pod: Obj, ready: bool, *, now: datetime) -> Obj:
    """``pod`` with ContainersReady set as its readiness probes answered, and Ready recomputed."""
    names = [str(c.get("name")) for c in pod.get("spec", {}).get("containers") or []]
    condition: Obj = {"type": "ContainersReady", "status": "True" if ready else "False"}
    if not ready:
        condition |= {"reason": "ContainersNotReady", "message": f"containers with unready status: [{' '.join(names)}]"}
    return with_ready_condition(_set_condition(pod, condition, now=now), now=now)


def ready_condition(pod: Obj) -> Obj:
    """The Ready condition the kubelet derives (pkg/kubelet/status/generate.go, GeneratePodReadyCondition).

    While ContainersReady is not True, Ready has its status, reason and message. Otherwise Ready is False while the
    condition of any ``spec.readinessGates`` entry is missing or not True, with the kubelet's own messages (the first
    is what ``kubectl describe`` shows a pod whose sidecar never patched its gate), and True once all are.
    """
    conditions = {c.get("type"): c for c in pod.get("status", {}).get("conditions") or []}
    containers = conditions.get("ContainersReady") or {"status": "False", "reason": "ContainersNotReady"}
    if containers.get("status") != "True":
        return {"type": "Ready"} | {k: containers[k] for k in ("status", "reason", "message") if k in containers}
    unready = []
    for gate in pod.get("spec", {}).get("readinessGates") or []:
        kind = gate.get("conditionType")
        if (found := conditions.get(kind)) is None:
            unready.append(f'corresponding condition of pod readiness gate "{kind}" does not exist.')
        elif found.get("status") != "True":
            unready.append(f'the status of pod readiness gate "{kind}" is not "True", but {found.get("status")}')
    if unready:
        return {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady", "message": ", ".join(unready)}
    return {"type": "Ready", "status": "True"}


def with_ready_condition(pod: Obj, *, now: datetime) -> Obj:
    """``pod`` with its Ready condition recomputed (``lastTransitionTime`` moves only when the status changes)."""
    return _set_condition(pod, ready_condition(pod), now=now)


def _set_condition(pod: Obj, condition: Obj, *, now: datetime) -> Obj:
    conditions = pod.setdefault("status", {}).setdefault("conditions", [])
    old = next((c for c in conditions if c.get("type") == condition["type"]), None)
    if old is not None and old.get("status") == condition["status"]:
        since = old.get("lastTransitionTime")
    else:
        since = _time(now)
    new = {"type": condition["type"], "status": condition["status"], "lastProbeTime": None, "lastTransitionTime": since}
    new |= {k: condition[k] for k in ("reason", "message") if k in condition}
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new
    return pod


def effective_grace(pod: Obj, requested: int | None) -> int:
    """The grace period the API server grants a pod deletion: the pod's own unless one is asked for.

    A pod that is not on a node, or has finished, goes at once; a negative request becomes 1 second.
    """
    grace = requested if requested is not None else pod["spec"].get("terminationGracePeriodSeconds", 30)
    if not pod["spec"].get("nodeName") or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
        return 0
    return 1 if grace < 0 else int(grace)


def _pod_status(*, phase: str, ready: bool, now: datetime) -> Obj:
    running = phase == "Running"
    states = {
        "PodScheduled": True,
        "Initialized": phase != "Pending",
        "ContainersReady": running and ready,
        "Ready": running and ready,
    }
    conditions = [
        {"type": kind, "status": str(value), "lastProbeTime": None, "lastTransitionTime": _time(now)}
        for kind, value in states.items()
    ]
    status: Obj = {"phase": phase, "conditions": conditions, "qosClass": "BestEffort"}
    if phase != "Pending":
        status["startTime"] = _time(now)
    return status


def _owner(kind: str, *, name: str, node_name: str, node_uid: str | None) -> Obj:
    if kind == "Node":
        owner_name, api_version, uid = node_name, "v1", node_uid or str(uuid.uuid5(uuid.NAMESPACE_DNS, node_name))
    else:
        # A ReplicaSet's pods are named <replicaset>-<suffix>; other controllers' pods follow the same shape.
        owner_name = name.rpartition("-")[0] or name
        api_version = _OWNER_API_VERSIONS.get(kind, "apps/v1")
        uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{kind}/{owner_name}"))
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": owner_name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _address(name: str) -> str:
    digest = bytes.fromhex(_digest(name)[:4])
    return f"10.0.{digest[0]}.{max(1, digest[1])}"


def _time(now: datetime) -> str:
    return rfc3339(now.replace(microsecond=0))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
