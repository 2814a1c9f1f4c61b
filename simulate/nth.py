"""A re-enactment of aws-node-termination-handler's default behaviour in IMDS mode, for ``simulate --compare``:
written from its documented defaults and the libraries it drains with, not its code.

- Each monitor polls IMDS every 2 s (``cmd/node-termination-handler.go``: ``time.Tick(time.Second * 2)``), Spot
  interruptions at ``spot/instance-action`` (``enableSpotInterruptionDraining`` defaults to true); the event store
  is read on a 1 s ticker, and a Spot interruption drains at once (its start time less ``nodeTerminationGracePeriod``,
  120 s, is now).
- It cordons the node and does not taint it: ``taintNode`` is false by default (``pkg/config/config.go``,
  ``TAINT_NODE``; ``config/helm/aws-node-termination-handler/values.yaml``), and ``cordonOnly`` is false, so it drains.
- It drains with kubectl's drain library: every pod on the node is evicted at once (one goroutine per pod), with
  ``podTerminationGracePeriod`` -1, the pod's own grace period; an eviction its disruption budget refuses (429) is
  retried after 5 s ("will retry after 5s", ``k8s.io/kubectl/pkg/drain``); the drain then waits for the pods to be
  deleted, and gives up after ``nodeTerminationGracePeriod``.

Every duration is scaled as the simulation's notice is (``scale``: its seconds per real second).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from simulate.timeline import Kind, Recorder

WHO = "nth-style"
MONITOR_S, TICK_S, RETRY_S, DELETE_POLL_S = 2.0, 1.0, 5.0, 1.0
NODE_GRACE_S = 120.0  # nodeTerminationGracePeriod
CALL_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


@dataclass(frozen=True)
class Target:
    imds_url: str
    kube_url: str
    token: str
    ca_path: Path
    node: str


async def nth_style(target: Target, recorder: Recorder, *, scale: float) -> None:
    """Waits for a Spot interruption at IMDS, then cordons and drains the node; returns once the drain is done or
    its time (``nodeTerminationGracePeriod``) is up."""
    async with aiohttp.ClientSession(timeout=CALL_TIMEOUT) as imds:
        await _interruption(imds, target.imds_url, scale=scale)
    recorder.record(Kind.AGENT_NOTICE, WHO, "read the Spot interruption from IMDS: cordon and drain the node")
    context = ssl.create_default_context(cafile=str(target.ca_path))
    headers = {"Authorization": f"Bearer {target.token}"}
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(
        target.kube_url, connector=connector, headers=headers, timeout=CALL_TIMEOUT
    ) as kube:
        await _call(kube, "PATCH", f"/api/v1/nodes/{target.node}", {"spec": {"unschedulable": True}})
        _, listed = await _call(kube, "GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={target.node}"})
        pods = [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in listed.get("items", [])]
        try:
            async with asyncio.timeout(NODE_GRACE_S * scale):
                await asyncio.gather(*(_evict(kube, recorder, ns, name, scale=scale) for ns, name in pods))
        except TimeoutError:
            recorder.record(Kind.EVICTION_FAILED, WHO, "drain timed out (nodeTerminationGracePeriod)")
            return
    recorder.record(Kind.NODE_DRAINED, WHO, "drain of the node returned")


async def _interruption(session: aiohttp.ClientSession, url: str, *, scale: float) -> None:
    """Returns once IMDS names a Spot interruption, on the event store's next tick after the monitor saw it: both
    tickers start with the handler and run apart, as the monitor's goroutine and the main loop's ticker do."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not await _spot_action(session, url):
        await asyncio.sleep(MONITOR_S * scale)
    tick_s = TICK_S * scale
    await asyncio.sleep(tick_s - (loop.time() - started) % tick_s)


async def _spot_action(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.put(
            f"{url}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
        ) as answer:
            token = await answer.text()
        async with session.get(
            f"{url}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
        ) as answer:
            return answer.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def _evict(kube: aiohttp.ClientSession, recorder: Recorder, namespace: str, name: str, *, scale: float) -> None:
    """Evicts one pod, retrying a budget's 429 after 5 s, then waits for it to be deleted; returns then, or when
    the eviction fails otherwise."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    while True:
        status, answer = await _call(kube, "POST", f"{path}/eviction", body)
        if status < 300:
            break
        if status != 429:
            recorder.record(Kind.EVICTION_FAILED, name, f"eviction failed ({status})", pod=name)
            return
        text = f"eviction refused (429 {answer.get('reason', '')}); retry in {RETRY_S * scale:.2f} s"
        recorder.record(Kind.EVICTION_BLOCKED, name, text, pod=name)
        await asyncio.sleep(RETRY_S * scale)
    while (await _call(kube, "GET", path))[0] != 404:
        await asyncio.sleep(DELETE_POLL_S * scale)


async def _call(
    kube: aiohttp.ClientSession,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    params: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One API call; (status, the JSON answer). A transport error counts as a 503, to be retried by the caller."""
    content = "application/strategic-merge-patch+json" if method == "PATCH" else "application/json"
    try:
        async with kube.request(
            method, path, json=body, params=params, headers={"Content-Type": content} if body is not None else None
        ) as answer:
            parsed = await answer.json(content_type=None)
            return answer.status, parsed if isinstance(parsed, dict) else {}
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return 503, {}
