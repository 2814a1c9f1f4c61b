"""Backends from a Service's EndpointSlices: its ready endpoints, listed again every interval.

discovery.k8s.io/v1 (k8s.io/api/discovery/v1/types.go): a Service's slices carry the label
``kubernetes.io/service-name``; each slice has ``ports`` (name, port) and ``endpoints`` with ``addresses`` and
``conditions.ready``, which follows the pod's Ready condition (so a pod whose sidecar started draining leaves);
a nil ``ready`` means ready. Listing with plain aiohttp keeps the gateway on the base dependencies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any
from urllib.parse import quote

import aiohttp
import structlog

from gateway.backends import Pool
from spotdrain.clock import parse_rfc3339, utcnow
from spotdrain.kube_rest import InCluster

log = structlog.get_logger()

SERVICE_LABEL = "kubernetes.io/service-name"
TERMINATION_TIME = "spotdrain.io/termination-time"  # agent.drain.planning's, not imported: the gateway is not the agent


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
                ready = (endpoint.get("conditions") or {}).get("ready") is not False
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


async def _get(session: aiohttp.ClientSession, cluster: InCluster, path: str, *, timeout_s: float) -> Any:
    """One GET of the API; raises aiohttp.ClientError, TimeoutError or ValueError when it fails."""
    async with session.get(
        cluster.base_url + path,
        headers=cluster.headers(),
        ssl=cluster.ssl_context(),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as response:
        if response.status != 200:
            raise ValueError(f"HTTP {response.status} for {path}")
        return json.loads(await response.read())


async def list_slices(
    session: aiohttp.ClientSession, cluster: InCluster, *, namespace: str, service: str, timeout_s: float
) -> list[Any]:
    selector = quote(f"{SERVICE_LABEL}={service}")
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector={selector}"
    items = (await _get(session, cluster, path, timeout_s=timeout_s)).get("items")
    return items if isinstance(items, list) else []


async def deadlines(
    session: aiohttp.ClientSession, cluster: InCluster, nodes: dict[str, str], *, timeout_s: float
) -> dict[str, datetime]:
    """Backend URL -> its node's termination time, for the nodes that have one (needs ``get`` on nodes)."""
    times: dict[str, datetime | None] = {}
    for name in set(nodes.values()):
        times[name] = termination_time(await _get(session, cluster, f"/api/v1/nodes/{name}", timeout_s=timeout_s))
    return {url: at for url, node in nodes.items() if (at := times.get(node)) is not None}


async def endpoint_follower(
    session: aiohttp.ClientSession,
    cluster: InCluster,
    pool: Pool,
    *,
    namespace: str,
    service: str,
    port: str | None,
    interval_s: float,
    timeout_s: float,
) -> None:
    """Keeps the pool on the Service's ready endpoints, and on their nodes' termination times, read every interval;
    runs until cancelled. A failed read keeps what was last known (a blip of the API server must not empty it)."""
    while True:
        try:
            slices = await list_slices(session, cluster, namespace=namespace, service=service, timeout_s=timeout_s)
            pool.follow(ready_urls(slices, port=port))
            pool.leaving = await deadlines(session, cluster, nodes_of(slices, port=port), timeout_s=timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
            log.warning("endpoints.read_failed", service=f"{namespace}/{service}", error=str(error))
        await asyncio.sleep(interval_s)


async def migrator(pool: Pool, *, margin_s: float, interval_s: float) -> None:
    """Moves each stream off a backend whose node's termination time is within ``margin_s``, before the node goes
    and cuts it; runs until cancelled. The moved stream continues elsewhere at once (cause ``proactive``)."""
    while True:
        due = pool.due(utcnow(), margin_s=margin_s)
        for url in sorted({url for url, _ in due}):
            log.info("gateway.moving", backend=url, streams=sum(u == url for u, _ in due))
        for _, mover in due:
            mover.move()
        await asyncio.sleep(interval_s)
