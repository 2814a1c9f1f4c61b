"""Reading the cluster for ``spotdrain check``: every object the checks judge, with ``list`` calls only (and
``get`` on nothing), each bounded by a timeout. A refused read is recorded, not raised: the checks that do not need
it still run, and the report names the permission that is missing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

import aiohttp

from check import objects as o
from check.findings import Obj, Snapshot, Unread
from check.installation import agent_daemonsets
from spotdrain.kube_rest import Access, call
from spotdrain.retry import ApiError

PAGE = 500  # items per list call; a large cluster's pods come in pages (the API server's ``limit``/``continue``)


class Unreachable(Exception):
    """The API server did not answer, or refused who we are (401): nothing can be checked."""


@dataclass(frozen=True)
class Scope:
    namespace: str | None = None  # --namespace: the workload reads (pods, budgets, services)
    selector: str = ""  # --selector: which pods


@dataclass(frozen=True)
class Read:
    """One list call: the API path of a collection, the resource as RBAC names it, and the checks that need it."""

    field: str
    path: str
    resource: str
    needed_by: tuple[str, ...]
    query: tuple[tuple[str, str], ...] = ()


def _collection(prefix: str, plural: str, namespace: str | None) -> str:
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def cluster_reads() -> list[Read]:
    """What is read cluster-wide whatever the scope: nodes, namespaces, the agents, Karpenter, the webhook."""
    return [
        Read("nodes", "/api/v1/nodes", "nodes", ("agent", "model-cache")),
        Read("namespaces", "/api/v1/namespaces", "namespaces", ("sidecar-injection", "webhook")),
        Read(
            "daemonsets",
            "/apis/apps/v1/daemonsets",
            "daemonsets.apps",
            ("agent", "interruption-sources", "sidecar-injection"),
        ),
        Read("deployments", "/apis/apps/v1/deployments", "deployments.apps", ("interruption-sources", "gateway")),
        Read(
            "webhooks",
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
            "mutatingwebhookconfigurations.admissionregistration.k8s.io",
            ("webhook",),
        ),
    ]


def workload_reads(scope: Scope) -> list[Read]:
    """What ``--namespace`` narrows: the pods (also by ``--selector``), budgets, Services and their endpoints."""
    ns = scope.namespace
    selector = (("labelSelector", scope.selector),) if scope.selector else ()
    pods = ("sidecar-injection", "budgets", "grace-periods")
    return [
        Read("pods", _collection("/api/v1", "pods", ns), "pods", pods, selector),
        Read(
            "budgets",
            _collection("/apis/policy/v1", "poddisruptionbudgets", ns),
            "poddisruptionbudgets.policy",
            ("budgets",),
        ),
        Read("services", _collection("/api/v1", "services", ns), "services", ("gateway",)),
        Read(
            "slices",
            _collection("/apis/discovery.k8s.io/v1", "endpointslices", ns),
            "endpointslices.discovery.k8s.io",
            ("gateway", "webhook"),
        ),
    ]


def agent_pod_reads(snapshot: Snapshot) -> list[Read]:
    """The pods of each node agent DaemonSet, by its selector, in its namespace."""
    return [
        Read(
            "agent_pods",
            _collection("/api/v1", "pods", o.namespace(ds)),
            "pods",
            ("agent",),
            (("labelSelector", o.selector_query(o.spec(ds).get("selector"))),),
        )
        for ds in agent_daemonsets(snapshot)
    ]


def webhook_slice_reads(snapshot: Snapshot, scope: Scope) -> list[Read]:
    """The EndpointSlices of the webhook's Services, when ``--namespace`` left their namespace out."""
    wanted = {
        str(service.get("namespace", ""))
        for config in snapshot.webhooks
        for hook in config.get("webhooks") or []
        if isinstance(service := (hook.get("clientConfig") or {}).get("service"), dict)
    }
    return [
        Read(
            "slices",
            _collection("/apis/discovery.k8s.io/v1", "endpointslices", ns),
            "endpointslices.discovery.k8s.io",
            ("webhook",),
        )
        for ns in sorted(wanted)
        if scope.namespace is not None and ns != scope.namespace
    ]


class Reader:
    """Lists collections page by page; each call has ``timeout_s`` for its whole answer."""

    def __init__(self, session: aiohttp.ClientSession, access: Access, *, timeout_s: float = 10.0) -> None:
        self.session, self.access, self.timeout_s = session, access, timeout_s

    async def items(self, read: Read) -> list[Obj]:
        found: list[Obj] = []
        token = ""
        while True:
            query = dict(read.query) | {"limit": str(PAGE)} | ({"continue": token} if token else {})
            answer = await call(
                self.session, self.access, "GET", f"{read.path}?{urlencode(query)}", timeout_s=self.timeout_s
            )
            items = answer.get("items")
            if not isinstance(items, list):
                raise ApiError(200, f"{read.path}: the answer has no list of items", failure="malformed")
            found += [item for item in items if isinstance(item, dict)]
            token = str((answer.get("metadata") or {}).get("continue") or "")
            if not token:
                return found


async def read_cluster(reader: Reader, scope: Scope, *, now: datetime) -> Snapshot:
    """Everything the checks judge. Raises Unreachable when the API server cannot be read at all."""
    snapshot = await _read_all(
        reader, cluster_reads() + workload_reads(scope), Snapshot(now=now, namespace=scope.namespace)
    )
    return await _read_all(reader, agent_pod_reads(snapshot) + webhook_slice_reads(snapshot, scope), snapshot)


async def _read_all(reader: Reader, reads: list[Read], snapshot: Snapshot) -> Snapshot:
    """The reads at once; the first Unreachable cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(attempt(reader.items, read)) for read in reads]
    except* Unreachable as failed:
        raise failed.exceptions[0] from None
    results = [task.result() for task in tasks]
    changes: dict[str, Any] = {}
    unread = list(snapshot.unread)
    for read, result in zip(reads, results, strict=True):
        if isinstance(result, Unread):
            unread.append(result)
        else:
            changes[read.field] = changes.get(read.field, getattr(snapshot, read.field)) + tuple(result)
    return replace(snapshot, **changes, unread=tuple(unread))


async def attempt(items: Callable[[Read], Awaitable[list[Obj]]], read: Read) -> list[Obj] | Unread:
    try:
        return await items(read)
    except ApiError as error:
        if error.status in (0, 401) and error.failure != "malformed":
            raise Unreachable(f"{read.path}: {error}") from None
        namespace = read.path.partition("/namespaces/")[2].partition("/")[0]
        scope = f"namespace {namespace}" if namespace else "the cluster scope"
        return Unread("list", read.resource, scope, error.status, str(error), read.needed_by)
