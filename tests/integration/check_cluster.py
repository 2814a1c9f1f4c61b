"""A spotdrain install built through the Kubernetes API, as ``kubectl apply`` and the controllers would leave it, for
``spotdrain check`` to judge: one clean install, and the ways to break it one at a time.

Everything goes over HTTP with an admin kubeconfig (objects POSTed, then their status written through ``/status``,
as a kubelet and the controllers do), so the same builder works on the fake API server and on a real kube-apiserver.
Objects are written to pass the real server's validation: every container has an image, every selector matches its
template, owner references name the real owner's uid (a garbage collector deletes pods whose owner is gone).
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import aiohttp

from spotdrain.kube_rest import Access, call
from spotdrain.retry import ApiError

Obj = dict[str, Any]
MERGE = "application/merge-patch+json"
AGENT_IMAGE = "ghcr.io/spotdrain/spotdrain-agent:0.1.0"
SIDECAR_IMAGE = "ghcr.io/spotdrain/spotdrain-sidecar:0.1.0"
AGENT_LABELS = {"app.kubernetes.io/name": "spotdrain-node"}
_PATHS = {
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Pod": ("/api/v1", "pods", True),
    "Service": ("/api/v1", "services", True),
    "DaemonSet": ("/apis/apps/v1", "daemonsets", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
        False,
    ),
}
# The namespaces an API server makes itself, which ``Builder.empty`` leaves.
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
COLLECTIONS = ("DaemonSet", "Deployment", "PodDisruptionBudget", "EndpointSlice")
_API_VERSIONS = {prefix: prefix.removeprefix("/apis/").removeprefix("/api/") for prefix, _, _ in _PATHS.values()}


def path_of(kind: str, namespace: str | None, name: str | None = None) -> str:
    prefix, plural, namespaced = _PATHS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


@dataclass
class Builder:
    """Writes objects through the API; ``access`` must be allowed to do anything (an admin). ``pod_network`` is
    the first three octets of the inference pods' addresses: loopback where a test connects to them (on the fake),
    10.x elsewhere, since a real API server's EndpointSlice controller refuses loopback endpoints for the pods a
    Service selects (and records a FailedToUpdateEndpointSlices event each time it retries)."""

    session: aiohttp.ClientSession
    access: Access
    pod_network: str = "127.0.0"

    async def create(self, kind: str, name: str, *, namespace: str | None = None, **fields: Any) -> Obj:
        prefix = _PATHS[kind][0]
        meta: Obj = {"name": name, **({"namespace": namespace} if namespace else {})}
        meta |= fields.pop("metadata", {})
        status = fields.pop("status", None)
        body = {"apiVersion": _API_VERSIONS[prefix], "kind": kind, "metadata": meta, **fields}
        created = await call(self.session, self.access, "POST", path_of(kind, namespace), body)
        if status is not None:  # the server drops status on create: the kubelet or a controller writes it after
            created = await self.patch(kind, name, {"status": status}, namespace=namespace, subresource="status")
        return created

    async def patch(
        self, kind: str, name: str, body: Obj, *, namespace: str | None = None, subresource: str = ""
    ) -> Obj:
        path = path_of(kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await call(self.session, self.access, "PATCH", path, body, content_type=MERGE)

    async def empty(self) -> None:
        """Delete every node, webhook configuration and namespace but the server's own, with what is in them: the
        cluster ``spotdrain check`` reads is then the one the next test builds, on a server other tests share."""
        namespaces = await self._items("GET", path_of("Namespace", None))
        await asyncio.gather(
            *(self._items("DELETE", path_of(kind, None)) for kind in ("Node", "MutatingWebhookConfiguration")),
            *(self._delete_namespace(n["metadata"]["name"]) for n in namespaces),
        )
        left = [
            f"{kind}/{name}"
            for kind in ("Node", "MutatingWebhookConfiguration", "Namespace")
            for found in await self._items("GET", path_of(kind, None))
            if (name := found["metadata"]["name"]) not in SYSTEM_NAMESPACES or kind != "Namespace"
        ]
        if left:
            raise RuntimeError(f"still in the cluster after emptying it: {', '.join(left)}")

    async def _delete_namespace(self, name: str) -> None:
        # What the namespace controller does (pkg/controller/namespace/deletion/namespaced_resources_deleter.go):
        # delete each kind in it, then PUT /finalize without the "kubernetes" finalizer, and the API server removes
        # the namespace. No namespace controller runs in the tests' control plane, so this plays it for the kinds
        # the builder makes (pods at once: no kubelet would end them), and for the events the controllers write.
        if name in SYSTEM_NAMESPACES:
            return
        # Services first, one by one (they have no DELETE of a collection): while a Service with a selector is
        # there, the EndpointSlice controller remakes the slices deleted next.
        services = await self._items("GET", path_of("Service", name))
        await asyncio.gather(
            *(self._items("DELETE", path_of("Service", name, s["metadata"]["name"])) for s in services)
        )
        await asyncio.gather(
            self._items("DELETE", path_of("Pod", name) + "?gracePeriodSeconds=0"),
            *(self._items("DELETE", path_of(kind, name)) for kind in COLLECTIONS),
        )
        await self._items("DELETE", f"/api/v1/namespaces/{name}/events")
        terminating = await call(self.session, self.access, "DELETE", path_of("Namespace", None, name))
        terminating["spec"]["finalizers"] = []
        await call(self.session, self.access, "PUT", path_of("Namespace", None, name) + "/finalize", terminating)

    async def _items(self, method: str, path: str) -> list[Obj]:
        """A GET or DELETE of a collection: its items (none when the kind or namespace is already gone)."""
        try:
            found = await call(self.session, self.access, method, path)
        except ApiError as error:
            if error.status == 404:
                return []
            raise
        items: list[Obj] = found.get("items") or []
        return items

    async def namespace(self, name: str, *, inject: bool = False) -> Obj:
        labels = {"spotdrain.io/inject": "true"} if inject else {}
        return await self.create("Namespace", name, metadata={"labels": labels})

    async def node(
        self, name: str, *, gpu: bool = True, cache: str | None = "ready", taints: list[Obj] | None = None
    ) -> Obj:
        labels = {"kubernetes.io/hostname": name}
        if gpu:
            labels["karpenter.k8s.aws/instance-gpu-count"] = "1"
        if cache:
            labels["spotdrain.io/model-cache"] = cache
        node_taints = list(taints or ([{"key": "nvidia.com/gpu", "effect": "NoSchedule"}] if gpu else []))
        await self.create("Node", name, metadata={"labels": labels}, spec={"taints": node_taints})
        # The API server adds node.kubernetes.io/not-ready:NoSchedule to a new Node; the node lifecycle controller
        # takes it off once the kubelet reports Ready. No kubelet runs here: the builder takes it off.
        return await self.patch("Node", name, {"spec": {"taints": node_taints or None}})

    async def pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str,
        containers: list[Obj],
        labels: dict[str, str] | None = None,
        ready: bool = True,
        grace_s: int | None = None,
        owner: Obj | None = None,
        pod_ip: str | None = None,
    ) -> Obj:
        meta: Obj = {"labels": labels or {}}
        if owner is not None:
            reference = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"]}
            meta["ownerReferences"] = [reference | {"uid": owner["metadata"]["uid"], "controller": True}]
        spec: Obj = {"nodeName": node, "containers": containers}
        if grace_s is not None:
            spec["terminationGracePeriodSeconds"] = grace_s
        # As the kubelet writes them: Ready follows ContainersReady (pkg/kubelet/status/generate.go).
        flag = "True" if ready else "False"
        status: Obj = {
            "phase": "Running",
            "conditions": [{"type": t, "status": flag} for t in ("ContainersReady", "Ready")],
        }
        if pod_ip is not None:
            status |= {"podIP": pod_ip, "podIPs": [{"ip": pod_ip}]}
        return await self.create("Pod", name, namespace=namespace, metadata=meta, spec=spec, status=status)

    async def endpoints(self, namespace: str, service: str, *, ready: list[bool]) -> Obj:
        endpoints = [{"addresses": [f"10.0.0.{i + 10}"], "conditions": {"ready": flag}} for i, flag in enumerate(ready)]
        return await self.create(
            "EndpointSlice",
            f"{service}-slice",
            namespace=namespace,
            metadata={"labels": {"kubernetes.io/service-name": service}},
            addressType="IPv4",
            endpoints=endpoints,
            ports=[{"name": "http", "port": 8000, "protocol": "TCP"}],
        )

    async def set_ready(self, namespace: str, service: str, *, ready: list[bool]) -> Obj:
        """Rewrite the Service's endpoints, as the EndpointSlice controller does when pods turn (un)ready."""
        endpoints = [{"addresses": [f"10.0.0.{i + 10}"], "conditions": {"ready": flag}} for i, flag in enumerate(ready)]
        return await self.patch("EndpointSlice", f"{service}-slice", {"endpoints": endpoints}, namespace=namespace)


def container(name: str, image: str, *args: str, gpu: bool = False, env: dict[str, str] | None = None) -> Obj:
    found: Obj = {"name": name, "image": image}
    if args:
        found["command"], found["args"] = list(args[:2]), list(args[2:])
    if gpu:
        found["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    if env:
        found["env"] = [{"name": key, "value": value} for key, value in env.items()]
    return found


def engine() -> Obj:
    return container("vllm", "vllm/vllm-openai:v0.11.0", gpu=True)


def sidecar(*, image: str = SIDECAR_IMAGE, drain_timeout_s: int = 110) -> Obj:
    return container("spotdrain", image, "spotdrain", "sidecar", "--drain-timeout", str(drain_timeout_s))


def template(labels: dict[str, str], containers: list[Obj], **spec: Any) -> Obj:
    return {
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": {"containers": containers, **spec}},
    }


def ca_bundle() -> str:
    return base64.b64encode(b"-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n").decode()


@dataclass(frozen=True)
class Install:
    agents: Obj  # the DaemonSet
    gpu_nodes: tuple[str, ...]


async def clean_install(
    build: Builder,
    *,
    agent_tolerations: list[Obj] | None = None,
    agent_args: tuple[str, ...] = (),
    agent_port: int = 8089,
) -> Install:
    """IMDS mode (the DaemonSet evicts), the webhook, vLLM with the sidecar and its budget, the gateway: every
    check passes. Two GPU nodes with their cache ready and one CPU node."""
    await build.namespace("spotdrain")
    await build.namespace("inference", inject=True)
    gpu_nodes = ("gpu-1", "gpu-2")
    for name in gpu_nodes:
        await build.node(name)
    await build.node("cpu-1", gpu=False, cache=None)
    agent = container("agent", AGENT_IMAGE, "spotdrain", "node", "--metrics-port", str(agent_port), *agent_args)
    agent["ports"] = [{"name": "metrics", "containerPort": agent_port, "protocol": "TCP"}]
    tolerations = [{"operator": "Exists"}] if agent_tolerations is None else agent_tolerations
    agents = await build.create(
        "DaemonSet",
        "spotdrain-node",
        namespace="spotdrain",
        metadata={"labels": AGENT_LABELS},
        spec=template(AGENT_LABELS, [agent], tolerations=tolerations),
    )
    for name in gpu_nodes:
        await build.pod(
            "spotdrain",
            f"spotdrain-node-{name}",
            node=name,
            containers=[agent],
            labels=AGENT_LABELS,
            owner=agents,
            pod_ip="127.0.0.1",  # the host network: the node's address, where the agent listens
        )
    await _webhook(build)
    await _vllm(build)
    await _gateway(build)
    return Install(agents, gpu_nodes)


async def _webhook(build: Builder) -> None:
    labels = {"app.kubernetes.io/name": "spotdrain-webhook"}
    server = container("webhook", "ghcr.io/spotdrain/spotdrain-webhook:0.1.0", "spotdrain", "webhook")
    await build.create("Deployment", "spotdrain-webhook", namespace="spotdrain", spec=template(labels, [server]))
    ports = [{"name": "https", "port": 443, "targetPort": 8443, "protocol": "TCP"}]
    await build.create("Service", "spotdrain-webhook", namespace="spotdrain", spec={"selector": labels, "ports": ports})
    await build.endpoints("spotdrain", "spotdrain-webhook", ready=[True, True])
    hook = {
        "name": "namespace.inject.spotdrain.io",
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Ignore",
        # A real API server calls the webhook for every pod created in a labelled namespace. Its caBundle is no
        # PEM certificate, so it fails before dialling anything ("could not get REST client: unable to load root
        # certificates") and creates the pod without it (failurePolicy: Ignore); were it to dial, it waits this long.
        "timeoutSeconds": 1,
        "clientConfig": {
            "service": {"name": "spotdrain-webhook", "namespace": "spotdrain", "path": "/mutate", "port": 443},
            "caBundle": ca_bundle(),
        },
        "rules": [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ],
        "namespaceSelector": {"matchLabels": {"spotdrain.io/inject": "true"}},
    }
    await build.create("MutatingWebhookConfiguration", "spotdrain-webhook", webhooks=[hook])


async def _vllm(build: Builder) -> None:
    labels = {"app": "vllm"}
    await build.create(
        "Deployment",
        "vllm",
        namespace="inference",
        spec=template(labels, [engine(), sidecar()], terminationGracePeriodSeconds=130),
    )
    for index, node in enumerate(("gpu-1", "gpu-2")):
        await build.pod(
            "inference",
            f"vllm-{index}",
            node=node,
            containers=[engine(), sidecar()],
            labels=labels,
            grace_s=130,
            pod_ip=f"{build.pod_network}.{index + 2}",
        )
    ports = [{"name": "http", "port": 8000, "protocol": "TCP"}]
    await build.create("Service", "vllm", namespace="inference", spec={"selector": labels, "ports": ports})
    await build.endpoints("inference", "vllm", ready=[True, True])
    await build.create(
        "PodDisruptionBudget",
        "vllm",
        namespace="inference",
        spec={"maxUnavailable": 1, "selector": {"matchLabels": labels}, "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    )


async def _gateway(build: Builder) -> None:
    labels = {"app.kubernetes.io/name": "spotdrain-gateway"}
    server = container(
        "gateway", "ghcr.io/spotdrain/spotdrain-gateway:0.1.0", "spotdrain", "gateway", "--service=inference/vllm"
    )
    await build.create("Deployment", "spotdrain-gateway", namespace="inference", spec=template(labels, [server]))
    ports = [{"name": "http", "port": 8000, "protocol": "TCP"}]
    await build.create("Service", "spotdrain-gateway", namespace="inference", spec={"selector": labels, "ports": ports})
    await build.endpoints("inference", "spotdrain-gateway", ready=[True, True])
