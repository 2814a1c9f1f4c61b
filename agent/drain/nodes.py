"""What the node handler does to the cluster, behind one small interface: the real calls, or a dry run.

The real implementation talks to the API server through kubernetes-asyncio; every call waits for the shared rate
limiter and API errors come out as ``ApiError`` (see spotdrain.retry), so the handler sorts them in one place.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import structlog
from kubernetes_asyncio import client

from agent.drain.kube_config import api_source
from agent.drain.kube_transport import DEFAULT_TIMEOUT_S, Transport
from agent.drain.planning import Node, Pod, instance_id_of
from spotdrain.clock import rfc3339, utcnow
from spotdrain.ratelimit import RateLimiter
from spotdrain.retry import ApiError, api_message
from spotdrain.settings import SettingsError

log = structlog.get_logger()
MERGE_PATCH = "application/merge-patch+json"


class NodeActions(Protocol):
    async def get_node(self, name: str) -> Node | None: ...

    async def list_nodes(self) -> list[Node]: ...

    async def patch_node(self, name: str, patch: dict[str, Any]) -> Node: ...

    async def pods_on(self, node: str) -> list[Pod]: ...

    async def evict(self, namespace: str, name: str, *, grace_s: int) -> None: ...

    async def event(self, node: Node, *, reason: str, message: str, warning: bool) -> None: ...


class KubeActions:
    """The real calls. Reads go through the same limiter as writes; each call has ``timeout_s`` for its whole answer."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        limiter: RateLimiter,
        on_error: Callable[[ApiError], None],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        # Typed as Any: every call passes plain dicts and reads raw JSON (_preload_content=False), not models.
        self.core: Any = client.CoreV1Api(api)
        self.transport = Transport(api, timeout_s=timeout_s)
        self.limiter = limiter
        self.on_error = on_error

    async def close(self) -> None:
        await self.transport.close()

    async def get_node(self, name: str) -> Node | None:
        try:
            node: Node = await self._raw(lambda: self.core.read_node(name, _preload_content=False))
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        return node

    async def list_nodes(self) -> list[Node]:
        items: list[Node] = await self._raw(lambda: self.core.list_node(_preload_content=False), items=True)
        return items

    async def patch_node(self, name: str, patch: dict[str, Any]) -> Node:
        node: Node = await self._raw(
            lambda: self.core.patch_node(name, patch, _content_type=MERGE_PATCH, _preload_content=False)
        )
        return node

    async def pods_on(self, node: str) -> list[Pod]:
        selector = f"spec.nodeName={node}"
        items: list[Pod] = await self._raw(
            lambda: self.core.list_pod_for_all_namespaces(field_selector=selector, _preload_content=False), items=True
        )
        return items

    async def evict(self, namespace: str, name: str, *, grace_s: int) -> None:
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"gracePeriodSeconds": grace_s},
        }
        await self._raw(
            lambda: self.core.create_namespaced_pod_eviction(name, namespace, eviction, _preload_content=False)
        )

    async def event(self, node: Node, *, reason: str, message: str, warning: bool) -> None:
        name = node["metadata"]["name"]
        now = rfc3339(utcnow())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.spotdrain-", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": name},
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": "spotdrain", "host": name},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": "spotdrain",
            "reportingInstance": name,
        }
        await self._raw(lambda: self.core.create_namespaced_event("default", body, _preload_content=False))

    async def _raw(self, make: Callable[[], Awaitable[Any]], *, items: bool = False) -> Any:
        """Call with ``_preload_content=False`` and decode the JSON ourselves: plain dicts, no model classes.

        Without preloading, kubernetes-asyncio hands back error answers as they are: their status is checked here. A
        2xx whose body is not the JSON object asked for (a proxy's HTML page, a cut-off answer) is a ``malformed``
        ApiError, as transient as no answer at all. With ``items`` the object's ``items`` list is returned.
        """
        await self.limiter.acquire()
        try:
            answer = await self.transport.send(make)
            if not 200 <= answer.status < 300:
                text = answer.body.decode(errors="replace")
                raise ApiError(answer.status, api_message(text), retry_after_s=answer.retry_after_s)
            return _decoded(answer.status, answer.body, items=items)
        except ApiError as error:
            self.on_error(error)
            raise


def _decoded(status: int, body: bytes, *, items: bool) -> Any:
    try:
        decoded = json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        decoded = None
    if isinstance(decoded, dict) and not items:
        return decoded
    if isinstance(decoded, dict) and isinstance(decoded.get("items"), list):
        return decoded["items"]
    wanted = "a list object" if items else "a JSON object"
    raise ApiError(status, f"answered with something other than {wanted}: {body[:80]!r}", failure="malformed")


class DryRunActions:
    """Reads for real, logs every change it would make and makes none."""

    def __init__(self, real: NodeActions) -> None:
        self.real = real
        self.evicted: set[tuple[str, str]] = set()  # pods the dry run "evicted" are left out of later listings

    async def get_node(self, name: str) -> Node | None:
        return await self.real.get_node(name)

    async def list_nodes(self) -> list[Node]:
        return await self.real.list_nodes()

    async def patch_node(self, name: str, patch: dict[str, Any]) -> Node:
        log.info("dry_run.patch_node", node=name, patch=patch)
        node = await self.real.get_node(name)
        return node or {"metadata": {"name": name}}

    async def pods_on(self, node: str) -> list[Pod]:
        pods = await self.real.pods_on(node)
        return [p for p in pods if (p["metadata"]["namespace"], p["metadata"]["name"]) not in self.evicted]

    async def evict(self, namespace: str, name: str, *, grace_s: int) -> None:
        log.info("dry_run.evict", namespace=namespace, pod=name, grace_s=grace_s)
        self.evicted.add((namespace, name))

    async def event(self, node: Node, *, reason: str, message: str, warning: bool) -> None:
        log.info("dry_run.event", node=node["metadata"]["name"], reason=reason, message=message)


class NodeIndex:
    """Instance id to node name, from ``spec.providerID``; refreshed from a LIST when an id is not known, or when the
    handler found the named node gone or another instance's (``forget``).

    Lookups that arrive while a LIST is under way wait for it rather than start their own, and a miss right after
    a LIST does not list again (a burst of notices for instances that are not nodes must not flood the API).
    """

    def __init__(self, actions: NodeActions, *, min_refresh_s: float = 5.0) -> None:
        self.actions = actions
        self.by_instance: dict[str, str] = {}
        self.listed: dict[str, Node] = {}  # nodes as the last LIST showed them, each handed out once
        self.min_refresh_s = min_refresh_s
        self._refreshed_at: float | None = None
        self._refreshing: asyncio.Task[None] | None = None

    async def node_for(self, instance_id: str, *, now: float) -> str | None:
        if instance_id not in self.by_instance:
            if self._refreshing is None and (
                self._refreshed_at is None or now - self._refreshed_at >= self.min_refresh_s
            ):
                self._refreshing = asyncio.create_task(self._refresh(now))
            if self._refreshing is not None:
                await asyncio.shield(self._refreshing)
        return self.by_instance.get(instance_id)

    def forget(self, instance_id: str) -> None:
        """The node found for ``instance_id`` is gone or another instance's: the next lookup lists the nodes again,
        however recent the last list was."""
        name = self.by_instance.pop(instance_id, None)
        if name is not None:
            self.listed.pop(name, None)
        self._refreshed_at = None

    def take(self, name: str) -> Node | None:
        """The node as last listed, once: a second use could only be staler."""
        return self.listed.pop(name, None)

    async def _refresh(self, now: float) -> None:
        try:
            nodes = await self.actions.list_nodes()
            self._refreshed_at = now
            self.by_instance = {iid: n["metadata"]["name"] for n in nodes if (iid := instance_id_of(n)) is not None}
            self.listed = {n["metadata"]["name"]: n for n in nodes}
            log.debug("nodes.indexed", nodes=len(self.by_instance))
        finally:
            self._refreshing = None


@asynccontextmanager
async def api_client(kubeconfig: str | None) -> AsyncIterator[client.ApiClient]:
    """An ApiClient from a kubeconfig file, the pod's service account, or ``~/.kube/config`` (see kube_config)."""
    from kubernetes_asyncio import config

    source = api_source(kubeconfig, env=os.environ, home=Path.home())
    configuration = client.Configuration()
    try:
        if source.path is not None:
            await config.load_kube_config(config_file=source.path, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError, ValueError) as error:
        raise SettingsError(f"cannot reach the Kubernetes API through {source.describe()}: {error}") from None
    log.info("api.configured", source=source.kind, kubeconfig=source.path, server=configuration.host)
    async with client.ApiClient(configuration) as api:
        yield api
