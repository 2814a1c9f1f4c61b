"""The fake Kubernetes API's resource table: the kinds it serves, and how an API path names one.

Each ``Resource`` says where its paths start, whether it has a status subresource and which field labels a
fieldSelector may use; ``route`` reads an API path into the ``Target`` it names. Pure data and parsing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resource:
    group_version: str  # "v1" or "<group>/<version>"
    plural: str
    kind: str
    namespaced: bool
    has_status: bool  # a status subresource: writes to the object keep status, writes to /status keep spec
    fields: frozenset[str]  # field labels the server accepts in a fieldSelector
    # Served through the API server's watch cache (True) or straight from etcd: events are not cached
    # (pkg/registry/cachesize/cachesize.go sets their watch cache size to 0), which changes a too-old watch's answer.
    watch_cache: bool = True

    @property
    def group(self) -> str:
        return self.group_version.rpartition("/")[0]

    @property
    def prefix(self) -> str:
        return "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"

    @property
    def qualified(self) -> str:
        """The name errors use: ``pods``, ``poddisruptionbudgets.policy``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


_META = frozenset({"metadata.name", "metadata.namespace"})
_POD_FIELDS = {
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
}
_EVENT_FIELDS = {f"involvedObject.{f}" for f in ("kind", "namespace", "name", "uid", "apiVersion", "fieldPath")}
NODES = Resource(
    group_version="v1",
    plural="nodes",
    kind="Node",
    namespaced=False,
    has_status=True,
    fields=frozenset({"metadata.name", "spec.unschedulable"}),
)
PODS = Resource(
    group_version="v1",
    plural="pods",
    kind="Pod",
    namespaced=True,
    has_status=True,
    fields=_META | _POD_FIELDS | {"status.phase", "status.podIP", "status.nominatedNodeName"},
)
EVENTS = Resource(
    group_version="v1",
    plural="events",
    kind="Event",
    namespaced=True,
    has_status=False,
    fields=_META | _EVENT_FIELDS | {"reason", "reportingComponent", "source", "type"},
    watch_cache=False,
)
EVENTS_V1 = Resource(
    group_version="events.k8s.io/v1",
    plural="events",
    kind="Event",
    namespaced=True,
    has_status=False,
    fields=_META | {f"regarding.{f}" for f in ("kind", "namespace", "name", "uid")} | {"reason", "type"},
    watch_cache=False,
)
PDBS = Resource(
    group_version="policy/v1",
    plural="poddisruptionbudgets",
    kind="PodDisruptionBudget",
    namespaced=True,
    has_status=True,
    fields=_META,
)
# The EndpointSlice controller writes these from a Service's pods: an endpoint per pod, ``conditions.ready`` from
# the pod's Ready condition (k8s.io/api/discovery/v1 types.go; nil ready means ready).
ENDPOINT_SLICES = Resource(
    group_version="discovery.k8s.io/v1",
    plural="endpointslices",
    kind="EndpointSlice",
    namespaced=True,
    has_status=False,
    fields=_META,
)
SECRETS = Resource(
    group_version="v1", plural="secrets", kind="Secret", namespaced=True, has_status=False, fields=_META | {"type"}
)
# Cluster-scoped, no status (k8s.io/api/admissionregistration/v1): what the self-managed webhook reads and patches.
MUTATING_WEBHOOKS = Resource(
    group_version="admissionregistration.k8s.io/v1",
    plural="mutatingwebhookconfigurations",
    kind="MutatingWebhookConfiguration",
    namespaced=False,
    has_status=False,
    fields=frozenset({"metadata.name"}),
)
# What `spotdrain check` reads besides: the workloads that run spotdrain (and Karpenter), the Services in front of
# them, and the namespaces' labels (k8s.io/api apps/v1 and core/v1). A namespace's status holds its phase only.
NAMESPACES = Resource(
    group_version="v1",
    plural="namespaces",
    kind="Namespace",
    namespaced=False,
    has_status=True,
    fields=frozenset({"metadata.name", "status.phase"}),
)
SERVICES = Resource(
    group_version="v1", plural="services", kind="Service", namespaced=True, has_status=True, fields=_META
)
DAEMONSETS = Resource(
    group_version="apps/v1", plural="daemonsets", kind="DaemonSet", namespaced=True, has_status=True, fields=_META
)
DEPLOYMENTS = Resource(
    group_version="apps/v1", plural="deployments", kind="Deployment", namespaced=True, has_status=True, fields=_META
)
VALIDATING_WEBHOOKS = Resource(
    group_version="admissionregistration.k8s.io/v1",
    plural="validatingwebhookconfigurations",
    kind="ValidatingWebhookConfiguration",
    namespaced=False,
    has_status=False,
    fields=frozenset({"metadata.name"}),
)
# Create-only and never stored (k8s.io/api/authentication/v1): the answer says who a token is.
TOKEN_REVIEWS = Resource(
    group_version="authentication.k8s.io/v1",
    plural="tokenreviews",
    kind="TokenReview",
    namespaced=False,
    has_status=False,
    fields=frozenset(),
)
SELF_SUBJECT_REVIEWS = Resource(
    group_version="authentication.k8s.io/v1",
    plural="selfsubjectreviews",
    kind="SelfSubjectReview",
    namespaced=False,
    has_status=False,
    fields=frozenset(),
)
REVIEWS = frozenset({TOKEN_REVIEWS, SELF_SUBJECT_REVIEWS})
RESOURCES = {
    (r.group_version, r.plural): r
    for r in (
        NODES,
        PODS,
        EVENTS,
        EVENTS_V1,
        PDBS,
        ENDPOINT_SLICES,
        SECRETS,
        MUTATING_WEBHOOKS,
        NAMESPACES,
        SERVICES,
        DAEMONSETS,
        DEPLOYMENTS,
        VALIDATING_WEBHOOKS,
        *REVIEWS,
    )
}
SUBRESOURCES = {
    "pods": {"status", "eviction", "proxy"},
    "nodes": {"status"},
    "poddisruptionbudgets": {"status"},
    "namespaces": {"status"},
    "services": {"status"},
    "daemonsets": {"status"},
    "deployments": {"status"},
}


@dataclass(frozen=True)
class Target:
    resource: Resource
    namespace: str | None  # None: cluster-scoped, or every namespace
    name: str | None  # None: the collection
    subresource: str | None = None
    rest: str = ""  # what follows ``/proxy``: the path asked of the pod

    @property
    def pattern(self) -> str:
        """The path with names replaced by placeholders, for counting calls."""
        path = self.resource.prefix
        if self.namespace is not None:
            path += "/namespaces/{namespace}"
        path += f"/{self.resource.plural}"
        if self.name is not None:
            path += "/{name}"
        return path + (f"/{self.subresource}" if self.subresource else "")


def route(path: str) -> Target | None:
    """Parse an API path (``/api/v1/namespaces/ns/pods/name/status``); None when no such resource exists."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group_version, rest = "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    # A pod's proxy takes a path of its own: /pods/{name}[:{port}]/proxy/{path...} (pkg/registry/core/pod/rest).
    proxied = "/" + "/".join(rest[3:]) if len(rest) >= 3 and rest[:1] == ["pods"] and rest[2] == "proxy" else ""
    if len(rest) > 3 and not proxied:
        return None
    if not rest or (resource := RESOURCES.get((group_version, rest[0]))) is None:
        return None
    if namespace is None and resource.namespaced and len(rest) > 1:
        return None  # a namespaced object needs its namespace; only its collection is listed across namespaces
    if namespace is not None and not resource.namespaced:
        return None
    if len(rest) == 3 and rest[2] not in SUBRESOURCES.get(resource.plural, set()):
        return None
    name, subresource = rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    return Target(resource, namespace, name, subresource, proxied or ("/" if subresource == "proxy" else ""))
