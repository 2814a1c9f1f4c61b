"""What the tests and the simulation put in the fake Kubernetes API and read back, without a request: nodes, pods,
budgets and EndpointSlices as their controllers would write them, and the objects as they are now.

``FakeKube`` (``simulate.fakes.kube``) serves the same store over HTTPS; this is its side for the code that drives it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from simulate.fakes import kube_objects
from simulate.fakes.kube_api import Api
from simulate.fakes.kube_resources import ENDPOINT_SLICES, EVENTS, EVENTS_V1, NODES, PDBS, PODS
from simulate.fakes.kube_select import Obj
from simulate.fakes.kube_store import Store


class Cluster:
    """The store's objects, seeded and read directly; ``FakeKube`` sets ``store``, ``api`` and ``_now``."""

    store: Store
    api: Api
    _now: Callable[[], datetime]

    def add_node(
        self,
        name: str,
        *,
        provider_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        unschedulable: bool = False,
        annotations: Mapping[str, str] | None = None,
    ) -> Obj:
        node = kube_objects.node(
            name,
            provider=provider_id,
            labels=labels,
            taints=taints,
            unschedulable=unschedulable,
            now=self._now(),
            annotations=annotations,
        )
        return self.store.create(NODES, None, node)

    def replace_node(self, name: str, *, provider_id: str) -> Obj:
        """A new instance joins under the name of one that went: EKS names nodes after the private IP, which a new
        instance can be given again. The old Node object and its pods are gone; the new one has a new uid and
        ``providerID`` and none of the old one's taints, labels or annotations."""
        self.store.remove(NODES, None, name)
        for pod in self.pods(node=name):
            self.store.remove(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"])
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
    ) -> Obj:
        """A pod on ``node``; ``owner_kind`` adds a controller reference, ``mirror`` makes it a static pod's mirror."""
        found = self.store.find(NODES, None, node)
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
            now=self._now(),
        )
        return self.store.create(PODS, namespace, pod)

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
        """A PodDisruptionBudget whose ``selector`` is its matchLabels."""
        pdb = kube_objects.pdb(
            namespace,
            name,
            selector=selector,
            min_available=min_available,
            max_unavailable=max_unavailable,
            unhealthy_pod_eviction_policy=unhealthy_pod_eviction_policy,
        )
        return self.store.create(PDBS, namespace, pdb)

    def set_containers_ready(self, namespace: str, name: str, ready: bool) -> Obj | None:
        """Report the pod's readiness probes, as its kubelet would: ContainersReady, and Ready with the gates.

        Returns the pod, or None when it is gone.
        """
        if (pod := self.store.find(PODS, namespace, name)) is None:
            return None
        return self.store.update(PODS, kube_objects.with_containers_ready(pod, ready, now=self._now()))

    def set_endpoints(
        self, namespace: str, service: str, endpoints: Sequence[tuple[str, int, bool]], *, nodes: Sequence[str] = ()
    ) -> None:
        """The Service's EndpointSlices as its controller writes them, from (IP, port, ready) per pod.

        One slice per endpoint: the controller splits slices by port when pods serve a named target port on
        different numbers, which is what lets several endpoints share 127.0.0.1 here.
        """
        for slice_ in kube_objects.endpoint_slices(namespace, service, endpoints, nodes=nodes):
            found = self.store.find(ENDPOINT_SLICES, namespace, slice_["metadata"]["name"])
            if found is None:
                self.store.create(ENDPOINT_SLICES, namespace, slice_)
            else:
                self.store.update(
                    ENDPOINT_SLICES, {**found, "endpoints": slice_["endpoints"], "ports": slice_["ports"]}
                )

    def annotate_node(self, name: str, annotations: Mapping[str, str]) -> Obj:
        """Add annotations to the node, as the node agent's patch does."""
        node = self.node(name)
        meta = node["metadata"]
        return self.store.update(
            NODES, {**node, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), **annotations}}}
        )

    def relabel_node(self, name: str, *, labels: Mapping[str, str], without_taint: str | None = None) -> Obj:
        """Add labels to the node and remove one taint by key, as ``spotdrain cache`` does once a node's cache is
        mounted (``plan_node_update`` in agent/cache/plan.py)."""
        node = self.node(name)
        meta, spec = node["metadata"], node.get("spec", {})
        taints = [t for t in spec.get("taints") or [] if t.get("key") != without_taint]
        spec = {k: v for k, v in spec.items() if k != "taints"} | ({"taints": taints} if taints else {})
        labelled = {**meta, "labels": {**meta.get("labels", {}), **labels}}
        return self.store.update(NODES, {**node, "metadata": labelled, "spec": spec})

    def node(self, name: str) -> Obj:
        """The node; KeyError if there is none."""
        if (found := self.store.find(NODES, None, name)) is None:
            raise KeyError(name)
        return found

    def pod(self, namespace: str, name: str) -> Obj | None:
        return self.store.find(PODS, namespace, name)

    def pods(self, *, node: str | None = None) -> list[Obj]:
        return [p for p in self.store.items(PODS) if node in (None, p["spec"].get("nodeName"))]

    def pdb(self, namespace: str, name: str) -> Obj | None:
        found = self.store.find(PDBS, namespace, name)
        return self.api.shown(found) if found else None

    def events(self) -> list[Obj]:
        """Core and events.k8s.io events, oldest first."""
        every = self.store.items(EVENTS) + self.store.items(EVENTS_V1)
        return sorted(every, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def remove_pod(self, namespace: str, name: str) -> None:
        """Remove a pod at once, as the kubelet does when its containers exit before the grace period ends."""
        self.api.remove_pod(namespace, name)
