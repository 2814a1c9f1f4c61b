"""The pod readiness gate ``spotdrain.io/serving``: True once serving, False as soon as a drain starts."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import aiohttp
import structlog

from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from spotdrain.clock import rfc3339, utcnow
from spotdrain.kube_rest import InCluster, patch
from spotdrain.retry import ApiError, retrying

log = structlog.get_logger()

CONDITION = "spotdrain.io/serving"


def condition_patch(serving: bool, now: datetime) -> dict[str, Any]:
    """A strategic merge patch of ``status.conditions`` (merged by ``type``) for the readiness gate."""
    return {
        "status": {
            "conditions": [
                {
                    "type": CONDITION,
                    "status": "True" if serving else "False",
                    "reason": "Serving" if serving else "Draining",
                    "message": "spotdrain sidecar: " + ("serving" if serving else "draining, out of rotation"),
                    "lastTransitionTime": rfc3339(now.replace(microsecond=0)),
                }
            ]
        }
    }


async def gate_keeper(
    session: aiohttp.ClientSession,
    cluster: InCluster,
    *,
    namespace: str,
    pod: str,
    lifecycle: Lifecycle,
    metrics: SidecarMetrics,
) -> None:
    """Sets the condition True, then False once a drain starts; retries each until it lands. Returns after False."""
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}/status"

    async def apply(serving: bool) -> None:
        try:
            await retrying(
                lambda: patch(session, cluster, path, condition_patch(serving, utcnow())),
                what="pod.readiness_gate",
                forever=True,
                on_error=lambda _: metrics.gate_errors.inc(),
            )
        except ApiError as error:
            # Permanent (RBAC, no such pod): restarting would not help; the pod stays un-Ready, which shows it.
            log.error("pod.readiness_gate_failed", condition=CONDITION, status=serving, pod=pod, error=str(error))
        else:
            log.info("pod.readiness_gate_set", condition=CONDITION, status=serving, pod=pod)

    if not lifecycle.drain_asked.is_set():
        await apply(True)
    await lifecycle.drain_asked.wait()
    await apply(False)
