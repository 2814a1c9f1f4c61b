"""The vocabulary ``inject`` speaks: what the sidecar and the node agent are called and where they listen, the
options a pod is injected with, and readers of pod specs as plain dicts that name the field they cannot read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_IMAGE = "ghcr.io/spotdrain/spotdrain-sidecar:0.1.0"
DEFAULT_NOTICE_URL = "http://$(HOST_IP):8090/v1/notice"
SIDECAR = "spotdrain"
SIDECAR_PORT = 8081  # sidecar.settings: --port
DRAIN_DIR = "/run/spotdrain"  # sidecar.settings: --drain-dir
GATE = "spotdrain.io/serving"  # sidecar.gate: the condition --readiness-gate patches
TOKEN_VOLUME = "spotdrain-token"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # sidecar.settings: --serviceaccount-dir
# A drained pod is not Ready before its eviction: only this policy lets the API server evict it whatever its
# budget's other pods do (pkg/registry/core/pod/storage/eviction.go).
POLICY, ALWAYS_ALLOW = "unhealthyPodEvictionPolicy", "AlwaysAllow"
WITHOUT_POLICY = (
    "without it the API server refuses to evict the pods the sidecar has taken out of rotation, and they go down "
    "with the instance"
)
ENGINE_PORTS = {"vllm": 8000, "tgi": 80, "sglang": 30000}
# Ray's metrics agent serves every local process's series (Serve's count of its requests, which the sidecar's
# --engine ray reads) on each node's export port.
RAY_METRICS_PORT = 8080
# The export interval a Ray container may set (Ray takes no less than 1000 ms), and how late Ray's page then shows a
# stream's end, in intervals: 1.5 s at 1000 ms, 15 s at the default 10 s (sidecar.engines, measured on Ray 2.49).
RAY_EXPORT_INTERVAL = "RAY_metrics_report_interval_ms"
RAY_LAG_INTERVALS = 1.5
Obj = dict[str, Any]


class InjectError(ValueError):
    """A document cannot be injected; the message names the document and the reason."""


@dataclass(frozen=True)
class Options:
    image: str = DEFAULT_IMAGE
    engine: str = "auto"
    container: str | None = None
    drain_timeout_s: float = 110.0
    notice_url: str | None = DEFAULT_NOTICE_URL
    readiness_gate: bool = False


@dataclass(frozen=True)
class PodTarget:
    """A pod spec inside an object (edited in place), where it is, and its Ray start parameters if a Ray group."""

    spec: Obj
    where: str
    ray_params: Obj | None = None


def _words(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(part) for part in value] if isinstance(value, list) else [str(value)]


def command_line(container: Obj) -> list[str]:
    return _words(container.get("command")) + _words(container.get("args"))


def section(obj: Obj, key: str, where: str) -> Obj:
    """``obj[key]`` as a mapping, empty when absent or null."""
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InjectError(f"{where}.{key} is not a mapping")
    return value


def containers_of(spec: Obj, key: str, where: str) -> list[Obj]:
    value = spec.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise InjectError(f"{where}.{key} is not a list of containers")
    return value


def list_of(obj: Obj, key: str, where: str) -> list[Any]:
    """``obj[key]`` as a list to read, empty when absent or null."""
    items = obj.get(key)
    if items is None:
        return []
    if not isinstance(items, list):
        raise InjectError(f"{where}.{key} is not a list")
    return items
