"""Backends from a Service's EndpointSlices: its ready endpoints, and its nodes' termination times, watched.

discovery.k8s.io/v1 (k8s.io/api/discovery/v1/types.go): a Service's slices carry the label
``kubernetes.io/service-name``; each slice has ``ports`` (name, port) and ``endpoints`` with ``addresses`` and
``conditions.ready``, which follows the pod's Ready condition (so a pod whose sidecar started draining leaves);
a nil ``ready`` means ready. The watches are ``gateway.watch``'s (plain aiohttp, the base dependencies).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import aiohttp
import structlog

from gateway.backends import Pool
from gateway.watch import Obj, WatchTimeouts, follow
from spotdrain.clock import parse_rfc3339, utcnow
from spotdrain.kube_rest import InCluster

log = structlog.get_logger()

SERVICE_LABEL = "kubernetes.io/service-name"
TERMINATION_TIME = "spotdrain.io/termination-time"  # agent.drain.planning's, not imported: the gateway is not the agent
SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
NODES_PATH = "/api/v1/nodes"
NodeWatch = Callable[[str, Callable[[list[Obj]], None]], "asyncio.Task[None]"]


def _port(slice_: dict[str, Any], wanted: str | None) -> int | None:
    for entry in slice_.get("ports") or ():
        if not isinstance(entry, dict) or not isinstance(entry.get("port"), int):
            continue
        if wanted is None or wanted in (entry.get("name"), str(entry["port"])):
            return int(entry["port"])
    return None


def _endpoints(slices: list[Any], port: str | None) -> Iterator[tuple[str, bool, str | None]]:
    """(base URL, ready, node name) of every endpoint that has an address and the port."""
    for slice_ in slices:
        if not isinstance(slice_, dict) or (number := _port(slice_, port)) is None:
            continue
        ipv6 = slice_.get("addressType") == "IPv6"
        for endpoint in slice_.get("endpoints") or ():
            if not isinstance(endpoint, dict):
                continue
            addresses = [a for a in endpoint.get("addresses") or () if isinstance(a, str)]
            if addresses:
                host = f"[{addresses[0]}]" if ipv6 else addresses[0]
                conditions = endpoint.get("conditions") or {}
                # A terminating endpoint is not ready (its pod is going away), whatever an older API server says.
                ready = conditions.get("ready") is not False and conditions.get("terminating") is not True
                node = endpoint.get("nodeName")
                yield f"http://{host}:{number}", ready, node if isinstance(node, str) else None


def ready_urls(slices: list[Any], *, port: str | None) -> list[str]:
    """The base URLs of every ready endpoint, in a stable order; ``port`` is a port name or number (None: the first)."""
    return sorted({url for url, ready, _ in _endpoints(slices, port) if ready})


def nodes_of(slices: list[Any], *, port: str | None) -> dict[str, str]:
    """Each endpoint's node, ready or not: a draining pod is out of rotation but still holds streams."""
    return {url: node for url, _, node in _endpoints(slices, port) if node is not None}


def termination_time(node: Any) -> datetime | None:
    """The node's ``spotdrain.io/termination-time`` (the node agent writes it), if it has a valid one."""
    annotations = (node.get("metadata") or {}).get("annotations") if isinstance(node, dict) else None
    text = annotations.get(TERMINATION_TIME) if isinstance(annotations, dict) else None
    if not isinstance(text, str):
        return None
    try:
        return parse_rfc3339(text)
    except ValueError:
        return None


class Follower:
    """The pool kept on the Service's ready endpoints and on their nodes' termination times, as watches report them.

    ``watch_node(name, on_change)`` starts a watch of one node; the follower stops it once no endpoint sits there.
    """

    def __init__(self, pool: Pool, *, port: str | None, watch_node: NodeWatch) -> None:
        self.pool = pool
        self.port = port
        self._watch_node = watch_node
        self.nodes: dict[str, str] = {}  # backend URL -> its node
        self.times: dict[str, datetime] = {}  # node -> its termination time
        self.watching: dict[str, asyncio.Task[None]] = {}

    def slices(self, items: list[Obj]) -> None:
        self.pool.follow(ready_urls(items, port=self.port))
        self.nodes = nodes_of(items, port=self.port)
        wanted = set(self.nodes.values())
        for name in sorted(set(self.watching) - wanted):
            self.watching.pop(name).cancel()
            self.times.pop(name, None)
        for name in sorted(wanted - set(self.watching)):
            self.watching[name] = self._watch_node(name, functools.partial(self.node, name))
        self._publish()

    def node(self, name: str, items: list[Obj]) -> None:
        at = next((at for item in items if (at := termination_time(item)) is not None), None)
        if at is None:
            self.times.pop(name, None)
        else:
            self.times[name] = at
        self._publish()

    def _publish(self) -> None:
        self.pool.set_leaving({url: at for url, node in self.nodes.items() if (at := self.times.get(node)) is not None})


async def endpoint_follower(
    session: aiohttp.ClientSession,
    cluster: InCluster,
    pool: Pool,
    *,
    namespace: str,
    service: str,
    port: str | None,
    timeouts: WatchTimeouts,
) -> None:
    """Keeps the pool on the Service's ready endpoints, from a watch of its EndpointSlices, and on the termination
    times of their nodes, from a watch of each node (``fieldSelector=metadata.name=...``); runs until cancelled. A
    failed watch keeps what was last known (a blip of the API server must not empty the pool)."""
    async with asyncio.TaskGroup() as group:

        def watch_node(name: str, on_change: Callable[[list[Obj]], None]) -> asyncio.Task[None]:
            query = {"fieldSelector": f"metadata.name={name}"}
            return group.create_task(
                follow(session, cluster, NODES_PATH, query=query, on_change=on_change, timeouts=timeouts)
            )

        follower = Follower(pool, port=port, watch_node=watch_node)
        await follow(
            session,
            cluster,
            SLICES_PATH.format(namespace=namespace),
            query={"labelSelector": f"{SERVICE_LABEL}={service}"},
            on_change=follower.slices,
            timeouts=timeouts,
        )


async def migrator(pool: Pool, *, margin_s: float, interval_s: float) -> None:
    """Moves each stream off a backend whose node's termination time is within ``margin_s``, before the node goes
    and cuts it; runs until cancelled. It looks again when a termination time arrives, and every ``interval_s``
    as the clock nears one. The moved stream continues elsewhere at once (cause ``proactive``)."""
    while True:
        pool.leaving_changed.clear()
        due = pool.due(utcnow(), margin_s=margin_s)
        for url in sorted({url for url, _ in due}):
            log.info("gateway.moving", backend=url, streams=sum(u == url for u, _ in due))
        for _, mover in due:
            mover.move()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await pool.leaving_changed.wait()
