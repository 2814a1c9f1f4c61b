"""Where the node agent finds the Kubernetes API: the order controller-runtime's ``config.GetConfig`` uses.

1. ``--kubeconfig`` (or ``$KUBECONFIG``, the flag's alias variable), 2. the pod's service account when running in a
cluster, 3. ``~/.kube/config`` when it exists. So the same command works in a pod and on a laptop, as Karpenter and
every controller-runtime program does (sigs.k8s.io/controller-runtime, pkg/client/config/config.go).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spotdrain.settings import SettingsError

# What kubernetes-asyncio's load_incluster_config reads (kubernetes_asyncio/config/incluster_config.py).
SERVICE_HOST = "KUBERNETES_SERVICE_HOST"
SERVICE_PORT = "KUBERNETES_SERVICE_PORT"
TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


@dataclass(frozen=True)
class ApiSource:
    """How to reach the API: ``kubeconfig`` (given), ``in-cluster`` or ``home`` (``~/.kube/config``)."""

    kind: str
    path: str | None = None

    def describe(self) -> str:
        if self.kind == "in-cluster":
            return "the in-cluster service account"
        return f"kubeconfig {self.path}"


def api_source(kubeconfig: str | None, *, env: Mapping[str, str], home: Path, token: Path = TOKEN) -> ApiSource:
    """The first of the three ways that applies here; SettingsError when none does, naming all three."""
    if kubeconfig:
        return ApiSource("kubeconfig", kubeconfig)
    if env.get(SERVICE_HOST) or token.exists():
        # In a pod, whatever the home directory holds: an error here is the pod's, and is reported as such.
        return ApiSource("in-cluster")
    default = home / ".kube" / "config"
    if default.is_file():
        return ApiSource("home", str(default))
    raise SettingsError(
        f"no Kubernetes API to reach: no --kubeconfig (or KUBECONFIG), not in a cluster ({SERVICE_HOST} unset, "
        f"no {TOKEN}) and no {default}"
    )
