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
) -> Obj:
    spec: Obj = {"providerID": provider or provider_id(name)}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    if unschedulable:
        spec["unschedulable"] = True
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
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
    """A scheduled pod; a mirror pod (a static pod's copy) carries the kubelet's annotations and the node as owner."""
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
    return {"metadata": meta, "spec": spec, "status": _pod_status(phase=phase, ready=ready, now=now)}


def pdb(
    namespace: str,
    name: str,
    *,
    selector: Mapping[str, str],
    min_available: int | str | None,
    max_unavailable: int | str | None,
) -> Obj:
    spec: Obj = {"selector": {"matchLabels": dict(selector)}}
    if min_available is not None:
        spec["minAvailable"] = min_available
    if max_unavailable is not None:
        spec["maxUnavailable"] = max_unavailable
    return {"metadata": {"name": name, "namespace": namespace, "generation": 1}, "spec": spec}


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
