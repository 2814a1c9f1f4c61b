"""The real API server (``tests.control_plane``) behind the same surface as ``FakeKube``, so one test runs against
either: seeding and reading objects (``add_node``, ``add_pod``, ``node``, ``events``...), what clients asked
(``calls``, ``count``), injected failures (``fail_next``) and deletions (``deletions``, ``on_delete``).

Clients reach it through a recording proxy on 127.0.0.1 that forwards every request, watches included, to the API
server unchanged; only ``fail_next`` answers in its place. Seeding and reading go straight to the API server as its
administrator and are not recorded, as the fake's are not. With no kubelet here, ``Kubelet`` plays the two parts of
one the tests rely on: it finishes a graceful pod deletion after its grace period, and recomputes a pod's Ready
condition from its readiness gates whenever the pod's status changes (pkg/kubelet/status/generate.go).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from simulate.fakes import kube_objects
from simulate.fakes.kube import Call
from simulate.fakes.kube_api import DeleteHook, Deletion
from spotdrain.clock import utcnow
from tests.control_plane import ControlPlane, write_kubeconfig
from tests.real_kube_http import Admin, ApiError, RecordingProxy
from tests.real_kubelet import Kubelet

Obj = dict[str, Any]
# The namespaces tests put pods in; made once, emptied after each test.
NAMESPACES = ("ml", "kube-system", "spotdrain", "inference", "default")
# Events the control plane records (the API server's own, the controllers', by the component they name: the
# EndpointSlice controller's is endpoint-slice-controller), which the fake has no part playing.
CONTROL_PLANE = frozenset({"apiserver", "controllermanager", "disruption-controller", "endpoint-slice-controller"})
POD_DROPPED_FIELDS = ("uid", "resourceVersion", "creationTimestamp", "generation")


class RealKube:
    """One test's view of the real API server; ``async with RealKube(plane) as kube:``. Leaving the block deletes
    the nodes, pods, budgets, events and EndpointSlices the test made."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.admin = Admin(plane.url, plane.ca_path, plane.admin_token)
        self.proxy = RecordingProxy(plane)
        self.kubelet = Kubelet(plane, self.proxy)
        self.token = plane.admin_token

    async def __aenter__(self) -> RealKube:
        for namespace in NAMESPACES:
            self.admin.ensure_namespace(namespace)
        await self.proxy.start()
        await self.kubelet.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.kubelet.stop()
        await self.proxy.stop()
        await asyncio.to_thread(self.admin.wipe, NAMESPACES)
        self.admin.close()

    # Client configuration, as FakeKube's -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def ca_path(self) -> Path:
        return self.proxy.ca_path

    @property
    def calls(self) -> list[Call]:
        return self.proxy.calls

    def write_kubeconfig(self, path: Path, *, namespace: str = "default", token: str | None = None) -> Path:
        return write_kubeconfig(path, self.url, self.ca_path, token or self.token, namespace=namespace)

    def serviceaccount_dir(self, path: Path, *, namespace: str = "default", token: str | None = None) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        (path / "token").write_text(token or self.token)
        (path / "ca.crt").write_bytes(self.ca_path.read_bytes())
        (path / "namespace").write_text(namespace)
        return path

    def service_env(self) -> dict[str, str]:
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": self.url.rpartition(":")[2]}

    def issue_token(self, user: str, *, denied: Iterable[tuple[str, str]] = ()) -> str:
        """A token of the service account ``user`` names, bound to a ClusterRole of every verb on the resources the
        agent and sidecar use, less each (verb, resource) of ``denied``."""
        return self.admin.service_account_token(user, denied=frozenset(denied))

    def apply_and_token(self, objects: Iterable[Obj], namespace: str, name: str, *, pod: Obj | None = None) -> str:
        """Create ``objects`` (the RBAC of a rendered manifest) and the service account ``namespace/name``; a token
        of that account (bound to ``pod`` when given), which may do exactly what they grant."""
        return self.admin.apply_and_token(objects, namespace, name, pod=pod)

    # Steering --------------------------------------------------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int,
        count: int = 1,
        *,
        retry_after: float | None = None,
        message: str | None = None,
    ) -> None:
        self.proxy.fail_next(method, re.compile(path_regex), status, count, retry_after, message)

    def on_delete(self, hook: DeleteHook) -> None:
        self.kubelet.hooks.append(hook)

    def compact(self) -> None:
        """Compact etcd at its current revision (``ControlPlane.compact``)."""
        self.plane.compact()

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for c in self.calls if c.method == method and c.pattern == pattern)

    @property
    def deletions(self) -> list[Deletion]:
        return self.kubelet.deletions

    # Seeding ---------------------------------------------------------------------------------------------------------

    def add_node(
        self,
        name: str,
        *,
        provider_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        unschedulable: bool = False,
    ) -> Obj:
        """Create the node and report it Ready as its kubelet would; with no node lifecycle controller here, the
        ``node.kubernetes.io/not-ready`` taint the TaintNodesByCondition admission plugin adds at creation is
        removed as that controller does once the node is Ready."""
        node = kube_objects.node(
            name, provider=provider_id, labels=labels, taints=taints, unschedulable=unschedulable, now=utcnow()
        )
        made = self.admin.create("/api/v1/nodes", node)
        self.admin.replace(f"/api/v1/nodes/{name}/status", {**made, "status": node["status"]})
        kept = [t for t in self.node(name)["spec"].get("taints") or [] if t in node["spec"].get("taints", [])]
        return self.admin.patch(f"/api/v1/nodes/{name}", {"spec": {"taints": kept or None}})

    def replace_node(self, name: str, *, provider_id: str) -> Obj:
        """A new instance joins under the name of one that went (``Cluster.replace_node``)."""
        self.admin.delete(f"/api/v1/nodes/{name}")
        for pod in self.pods(node=name):
            self.remove_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
        return self.add_node(name, provider_id=provider_id)

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str,
        labels: Mapping[str, str] | None = None,
        owner_kind: str | None = None,
        mirror: bool = False,
        phase: str = "Running",
        ready: bool = True,
        grace_period_s: int = 30,
        annotations: Mapping[str, str] | None = None,
        readiness_gates: Sequence[str] = (),
        service_account: str = "default",
    ) -> Obj:
        """Create the pod bound to ``node`` (running as ``service_account``) and write the status its kubelet would
        report."""
        found = self.admin.find(f"/api/v1/nodes/{node}")
        pod = kube_objects.pod(
            namespace,
            name,
            node_name=node,
            node_uid=found["metadata"]["uid"] if found else None,
            labels=labels,
            owner_kind=owner_kind,
            mirror=mirror,
            phase=phase,
            ready=ready,
            grace_period_s=grace_period_s,
            annotations=annotations,
            readiness_gates=readiness_gates,
            now=utcnow(),
        )
        pod["spec"]["serviceAccountName"] = service_account
        status = pod.pop("status")
        status["podIP"] = status["hostIP"] = "127.0.0.1"
        made = self.admin.create(f"/api/v1/namespaces/{namespace}/pods", _creatable(pod))
        if readiness_gates:
            status = kube_objects.with_ready_condition({**made, "status": status}, now=utcnow())["status"]
        return self.admin.replace(f"/api/v1/namespaces/{namespace}/pods/{name}/status", {**made, "status": status})

    def add_pdb(
        self,
        namespace: str,
        name: str,
        *,
        selector: Mapping[str, str],
        min_available: int | str | None = None,
        max_unavailable: int | str | None = None,
        unhealthy_pod_eviction_policy: str | None = None,
    ) -> Obj:
        """Create the budget; the disruption controller computes its status, which this waits for."""
        pdb = kube_objects.pdb(
            namespace,
            name,
            selector=selector,
            min_available=min_available,
            max_unavailable=max_unavailable,
            unhealthy_pod_eviction_policy=unhealthy_pod_eviction_policy,
        )
        pdb["metadata"].pop("generation")
        self.admin.create(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", pdb)
        return self.admin.wait_for(
            f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
            lambda b: b.get("status", {}).get("observedGeneration") == b["metadata"]["generation"],
        )

    def set_containers_ready(self, namespace: str, name: str, ready: bool) -> Obj | None:
        if (pod := self.pod(namespace, name)) is None:
            return None
        changed = kube_objects.with_containers_ready(pod, ready, now=utcnow())
        return self.admin.replace(f"/api/v1/namespaces/{namespace}/pods/{name}/status", changed)

    def set_endpoints(
        self, namespace: str, service: str, endpoints: Sequence[tuple[str, int, bool]], *, nodes: Sequence[str] = ()
    ) -> None:
        """Write the Service's EndpointSlices as ``FakeKube.set_endpoints`` does (unlabelled by a managing
        controller, so the EndpointSlice controller leaves them alone)."""
        path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        for slice_ in kube_objects.endpoint_slices(namespace, service, endpoints, nodes=nodes):
            name = slice_["metadata"]["name"]
            if (found := self.admin.find(f"{path}/{name}")) is None:
                self.admin.create(path, slice_)
            else:
                self.admin.replace(f"{path}/{name}", {**found, "endpoints": slice_["endpoints"]})

    def annotate_node(self, name: str, annotations: Mapping[str, str]) -> Obj:
        return self.admin.patch(f"/api/v1/nodes/{name}", {"metadata": {"annotations": dict(annotations)}})

    def remove_pod(self, namespace: str, name: str) -> None:
        """Remove a pod at once, as the kubelet does when its containers exit before the grace period ends."""
        self.kubelet.removing.add((namespace, name))
        with contextlib.suppress(ApiError):
            self.admin.delete(f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0")

    # Reading ---------------------------------------------------------------------------------------------------------

    def node(self, name: str) -> Obj:
        if (found := self.admin.find(f"/api/v1/nodes/{name}")) is None:
            raise KeyError(name)
        return found

    def pod(self, namespace: str, name: str) -> Obj | None:
        return self.admin.find(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def pods(self, *, node: str | None = None) -> list[Obj]:
        query = f"?fieldSelector=spec.nodeName={node}" if node else ""
        return self.admin.items(f"/api/v1/pods{query}")

    def pdb(self, namespace: str, name: str) -> Obj | None:
        return self.admin.find(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}")

    def events(self) -> list[Obj]:
        """Core and events.k8s.io events (one store: each is listed through both), oldest first."""
        events = [e for e in self.admin.items("/api/v1/events") if _component(e) not in CONTROL_PLANE]
        return sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"]))


def _component(event: Obj) -> str:
    return str(event.get("reportingComponent") or event.get("source", {}).get("component", ""))


def _creatable(obj: Obj) -> Obj:
    meta = {k: v for k, v in obj["metadata"].items() if k not in POD_DROPPED_FIELDS}
    return {**obj, "metadata": meta}
