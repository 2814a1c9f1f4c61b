"""The API server's pod proxy, as the fake serves it: ``GET /api/v1/namespaces/{ns}/pods/{name}[:{port}]/proxy/{path}``
is sent on to ``http://{status.podIP}:{port}/{path}`` and its answer handed back as it came (status, body, type).

As the real one (pkg/registry/core/pod/strategy.go ``ResourceLocation``, k8s.io/apimachinery util/proxy
``upgradeaware.go``): the port defaults to the pod's first container port; a pod without an IP is a 503; a pod that
does not answer is a 503 ``error trying to reach service: <the dial error>``; a link-local or multicast pod IP is a
400 ``address not allowed`` (pkg/proxy/util ``IsProxyableIP``).

Where it must differ: the real server refuses loopback pod IPs too (400 ``address not allowed``, seen on
kube-apiserver 1.36), and loopback is the only address a test may reach. So the fake proxies to loopback pod IPs
only, and refuses every other address it would accept (503): a test against the real server needs its pods'
servers on an address of a network namespace of its own.
"""

from __future__ import annotations

import ipaddress

import aiohttp
from aiohttp import web

from simulate.fakes.kube_resources import PODS, Target
from simulate.fakes.kube_select import KubeError, Obj
from simulate.fakes.kube_store import Store

TIMEOUT_S = 5.0


def _unavailable(message: str) -> KubeError:
    return KubeError(503, "ServiceUnavailable", message)


def _port(pod: Obj, asked: str) -> str:
    if asked:
        return asked
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            return str(port.get("containerPort"))
    raise _unavailable(f"pod {pod['metadata']['name']} has no port to proxy to")


async def proxy(request: web.Request, target: Target, store: Store) -> web.StreamResponse:
    """Send the request on to the pod; raises KubeError as the API server answers when it cannot."""
    if request.method != "GET":
        raise KubeError(405, "MethodNotAllowed", "the fake pod proxy sends GET only")
    name, _, asked = (target.name or "").partition(":")
    pod = store.get(PODS, target.namespace, name)
    address = str((pod.get("status") or {}).get("podIP") or "")
    if not address:
        raise _unavailable(f"address not allowed: pod {name} has no IP")
    ip = ipaddress.ip_address(address)
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        raise KubeError(400, "BadRequest", "address not allowed")
    if not ip.is_loopback:
        raise _unavailable(f"the fake proxies to loopback addresses only, not {address}")
    url = f"http://{address}:{_port(pod, asked)}{target.rest}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session,
            session.get(url, params=request.query) as answer,
        ):
            body = await answer.read()
            return web.Response(status=answer.status, body=body, content_type=answer.content_type)
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise _unavailable(f"error trying to reach service: {type(error).__name__}: {error}") from None
