"""Backends from a Service's EndpointSlices: its ready endpoints, listed again every interval.

discovery.k8s.io/v1 (k8s.io/api/discovery/v1/types.go): a Service's slices carry the label
``kubernetes.io/service-name``; each slice has ``ports`` (name, port) and ``endpoints`` with ``addresses`` and
``conditions.ready``, which follows the pod's Ready condition (so a pod whose sidecar started draining leaves);
a nil ``ready`` means ready. Listing with plain aiohttp keeps the gateway on the base dependencies.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

import aiohttp
import structlog

from agent.kube_rest import InCluster
from gateway.backends import Pool

log = structlog.get_logger()

SERVICE_LABEL = "kubernetes.io/service-name"


def _port(slice_: dict[str, Any], wanted: str | None) -> int | None:
    for entry in slice_.get("ports") or ():
        if not isinstance(entry, dict) or not isinstance(entry.get("port"), int):
            continue
        if wanted is None or wanted in (entry.get("name"), str(entry["port"])):
            return int(entry["port"])
    return None


def ready_urls(slices: list[Any], *, port: str | None) -> list[str]:
    """The base URLs of every ready endpoint, in a stable order; ``port`` is a port name or number (None: the first)."""
    urls = set()
    for slice_ in slices:
        if not isinstance(slice_, dict) or (number := _port(slice_, port)) is None:
            continue
        ipv6 = slice_.get("addressType") == "IPv6"
        for endpoint in slice_.get("endpoints") or ():
            if not isinstance(endpoint, dict) or (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            addresses = [a for a in endpoint.get("addresses") or () if isinstance(a, str)]
            if addresses:
                host = f"[{addresses[0]}]" if ipv6 else addresses[0]
                urls.add(f"http://{host}:{number}")
    return sorted(urls)


async def list_slices(
    session: aiohttp.ClientSession, cluster: InCluster, *, namespace: str, service: str, timeout_s: float
) -> list[Any]:
    """One list of the Service's slices; raises aiohttp.ClientError, TimeoutError or ValueError when it fails."""
    selector = quote(f"{SERVICE_LABEL}={service}")
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector={selector}"
    async with session.get(
        cluster.base_url + path,
        headers=cluster.headers(),
        ssl=cluster.ssl_context(),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as response:
        if response.status != 200:
            raise ValueError(f"HTTP {response.status} listing EndpointSlices")
        items = json.loads(await response.read()).get("items")
        return items if isinstance(items, list) else []


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
    """Keeps the pool on the Service's ready endpoints, listed every interval; runs until cancelled.

    A failed list keeps the backends last known (a blip of the API server must not empty the gateway).
    """
    while True:
        try:
            slices = await list_slices(session, cluster, namespace=namespace, service=service, timeout_s=timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
            log.warning("endpoints.list_failed", service=f"{namespace}/{service}", error=str(error))
        else:
            pool.follow(ready_urls(slices, port=port))
        await asyncio.sleep(interval_s)
