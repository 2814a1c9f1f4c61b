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


def error_kind(error: ApiError) -> str:
    """The ``kind`` a failed patch is counted under: a refused token and a missing permission by name."""
    return {401: "unauthorized", 403: "forbidden"}.get(error.status, error.kind)


def remedy(kind: str, serviceaccount_dir: str) -> str:
    """What the pod needs for the gate to work, for the error log."""
    token = f"a service account token mounted in the sidecar at {serviceaccount_dir}"
    needs = {
        "no_token": f"{token} (spotdrain inject --readiness-gate adds a projected one, as deploy/vllm has)",
        "unauthorized": f"{token} that the API server accepts",
        "forbidden": "patch on pods/status in the pod's namespace for its service account (deploy/vllm/rbac.yaml)",
    }
    return needs.get(kind, "--pod-name and --pod-namespace naming this pod (POD_NAME, POD_NAMESPACE)")


async def gate_keeper(
    session: aiohttp.ClientSession,
    cluster: InCluster,
    *,
    namespace: str,
    pod: str,
    lifecycle: Lifecycle,
    metrics: SidecarMetrics,
) -> None:
    """Sets the condition True, then False once a drain starts; retries each until it lands. Returns after False,
    or as soon as the gate cannot work (no token, a token refused, no permission, no such pod): that is logged as
    an error once and counted, and the pod stays un-Ready, since no retry would help."""
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}/status"
    where = str(cluster.token_path.parent)

    def report(kind: str, error: str, **fields: object) -> None:
        needs = remedy(kind, where)
        log.error(
            "pod.readiness_gate_failed", condition=CONDITION, pod=pod, kind=kind, error=error, needs=needs, **fields
        )

    async def apply(serving: bool) -> bool:
        try:
            await retrying(
                lambda: patch(session, cluster, path, condition_patch(serving, utcnow())),
                what="pod.readiness_gate",
                forever=True,
                on_error=lambda error: metrics.gate_errors.labels(kind=error_kind(error)).inc(),
            )
        except ApiError as error:  # permanent, and already counted
            report(error_kind(error), str(error), status=serving)
            return False
        log.info("pod.readiness_gate_set", condition=CONDITION, status=serving, pod=pod)
        return True

    if missing := cluster.missing():
        metrics.gate_errors.labels(kind="no_token").inc()
        report("no_token", f"no service account credentials: {', '.join(missing)} missing")
        return
    if not lifecycle.drain_asked.is_set() and not await apply(True):
        return
    await lifecycle.drain_asked.wait()
    await apply(False)
