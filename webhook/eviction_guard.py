"""The eviction guard: a node's agent may evict only pods bound to its own node.

An admission policy sees only the Eviction, not the pod it names, so the API server asks the webhook
(``POST /validate-eviction``, a ValidatingWebhookConfiguration on ``pods/eviction`` whose matchConditions send only
the agent's own account here). The agent's node is the one the API server read from its pod-bound token
(``request.userInfo.extra["authentication.kubernetes.io/node-name"]``), never anything the agent sent; the pod's is
looked up with the webhook's own token. ``verdict`` is pure; the handler does the one lookup.

A lookup that fails denies: the configuration fails closed too (see deploy/webhook/base), since a guard that lets
evictions through whenever it cannot see would be no guard. A pod that is not there is allowed: the API server
answers the eviction 404 itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from spotdrain.kube_rest import InCluster, call
from spotdrain.retry import ApiError
from spotdrain.settings import SettingsError

log = structlog.get_logger()

NODE_NAME = "authentication.kubernetes.io/node-name"
AGENT_ACCOUNT = "spotdrain-node"  # the DaemonSet's service account, in whatever namespace it is installed
LOOKUP_TIMEOUT_S = 2.0  # well inside the configuration's timeoutSeconds (5)
Obj = dict[str, Any]
PodLookup = Callable[[str, str], Awaitable[Obj | None]]


def token_node(request: Obj) -> str | None:
    """The node the requester's token is bound to (through its pod), or None for a token bound to none."""
    extra = (request.get("userInfo") or {}).get("extra") or {}
    names = extra.get(NODE_NAME) if isinstance(extra, dict) else None
    return str(names[0]) if isinstance(names, list) and len(names) == 1 and names[0] else None


def from_agent(request: Obj) -> bool:
    """Whether the requester is the node agent's account. The configuration's matchConditions send only its
    requests; this holds too where they are not honoured (an API server older than 1.28 drops the field), so that
    kubectl drain's or Karpenter's evictions are never judged."""
    user = str((request.get("userInfo") or {}).get("username", ""))
    return user.startswith("system:serviceaccount:") and user.rpartition(":")[2] == AGENT_ACCOUNT


def verdict(request: Obj, pod: Obj | None) -> tuple[bool, str]:
    """Whether the eviction in ``request`` may go ahead, given the pod it names (None: there is no such pod), and
    the message a refusal carries."""
    if not from_agent(request):
        return True, ""
    node = token_node(request)
    target = f"{request.get('namespace')}/{request.get('name')}"
    if node is None:
        return False, f"spotdrain-node may evict only with a token bound to its pod on a node; {target} refused"
    if pod is None:
        return True, ""
    bound = (pod.get("spec") or {}).get("nodeName")
    if bound != node:
        return False, f"spotdrain-node on {node} may evict only pods bound to {node}; {target} is on {bound or 'none'}"
    return True, ""


def decision(uid: str, allowed: bool, message: str) -> Obj:
    response: Obj = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": message}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


async def judge(request: Obj, lookup: PodLookup | None) -> Obj:
    """The AdmissionReview answering one eviction request."""
    uid, namespace, name = str(request["uid"]), str(request.get("namespace")), str(request.get("name"))
    if not from_agent(request) or token_node(request) is None:
        allowed, message = verdict(request, None)  # decided without the pod
    elif lookup is None:
        allowed, message = False, "the guard has no API access"
    else:
        try:
            allowed, message = verdict(request, await lookup(namespace, name))
        except (ApiError, TimeoutError, aiohttp.ClientError) as error:
            allowed, message = False, f"the guard could not read pod {namespace}/{name}: {error}"
    log.info("webhook.eviction_judged", uid=uid, namespace=namespace, pod=name, allowed=allowed, message=message)
    return decision(uid, allowed, message)


def pod_lookup(session: aiohttp.ClientSession, cluster: InCluster) -> PodLookup:
    """Read a pod with the webhook's own token (``get pods``); None when it is not there."""

    async def lookup(namespace: str, name: str) -> Obj | None:
        try:
            return await call(
                session, cluster, "GET", f"/api/v1/namespaces/{namespace}/pods/{name}", timeout_s=LOOKUP_TIMEOUT_S
            )
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    return lookup


def in_cluster(serviceaccount_dir: Path) -> InCluster | None:
    """The API server as the webhook's pod sees it, or None outside a cluster (the guard then denies)."""
    try:
        cluster = InCluster.from_environment(serviceaccount_dir)
    except SettingsError:  # no KUBERNETES_SERVICE_HOST
        return None
    return None if cluster.missing() else cluster
