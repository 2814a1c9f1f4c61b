"""Readers of Kubernetes objects as the API returns them (plain dicts): what a check needs to know of a node, a pod,
a workload's pod template, a selector or a toleration. Pure functions; a field that is absent reads as its API
default."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

Obj = dict[str, Any]

# The names spotdrain gives things (inject/spec.py, inject/pods.py, agent/cache, the NodePool), repeated here so that
# the agent image, which carries no inject/, can run the checks; tests/unit/test_check_rules.py ties them together.
SIDECAR = "spotdrain"
INJECT_LABEL = "spotdrain.io/inject"
POLICY, ALWAYS_ALLOW = "unhealthyPodEvictionPolicy", "AlwaysAllow"
DEFAULT_DRAIN_TIMEOUT_S = 110.0  # sidecar.settings: --drain-timeout
GRACE_MARGIN_S = 20  # inject.pods: after the drain, for the engine's own SIGTERM handling and exit
DEFAULT_GRACE_S = 30  # the API server's default terminationGracePeriodSeconds
CACHE_LABEL = "spotdrain.io/model-cache"
CACHE_PENDING_TAINT = "spotdrain.io/model-cache-pending"
GPU = "nvidia.com/gpu"
_FALSE = {"0", "false", "no", "off", ""}  # spotdrain.settings: what SPOTDRAIN_EVICT=... turns off


def meta(obj: Obj) -> Obj:
    value = obj.get("metadata")
    return value if isinstance(value, dict) else {}


def name(obj: Obj) -> str:
    return str(meta(obj).get("name", ""))


def namespace(obj: Obj) -> str:
    return str(meta(obj).get("namespace", ""))


def labels(obj: Obj) -> dict[str, str]:
    value = meta(obj).get("labels")
    return value if isinstance(value, dict) else {}


def ref(kind: str, obj: Obj) -> str:
    """``Kind/namespace/name``, or ``Kind/name`` for a cluster-scoped object."""
    return "/".join(part for part in (kind, namespace(obj), name(obj)) if part)


def spec(obj: Obj) -> Obj:
    value = obj.get("spec")
    return value if isinstance(value, dict) else {}


def template_spec(workload: Obj) -> Obj:
    """The pod spec of a Deployment's or DaemonSet's template."""
    template = spec(workload).get("template")
    return spec(template) if isinstance(template, dict) else {}


def template_labels(workload: Obj) -> dict[str, str]:
    template = spec(workload).get("template")
    return labels(template) if isinstance(template, dict) else {}


def containers(pod_spec: Obj) -> list[Obj]:
    value = pod_spec.get("containers")
    return [c for c in value if isinstance(c, dict)] if isinstance(value, list) else []


def words(container: Obj) -> list[str]:
    """The container's command line: ``command`` then ``args``."""
    return [str(w) for key in ("command", "args") for w in (container.get(key) or []) if isinstance(w, (str, int))]


def runs(container: Obj, program: str) -> bool:
    """The container runs ``spotdrain <program>``."""
    line = words(container)
    return any(w.endswith("spotdrain") and line[i + 1 : i + 2] == [program] for i, w in enumerate(line))


def running(pod_spec: Obj, program: str) -> Obj | None:
    return next((c for c in containers(pod_spec) if runs(c, program)), None)


def env_value(container: Obj, variable: str) -> str | None:
    for item in container.get("env") or []:
        if isinstance(item, dict) and item.get("name") == variable:
            return str(item.get("value", "")) if "valueFrom" not in item else "(from a reference)"
    return None


def flag_value(container: Obj, flag: str) -> str | None:
    """``--flag VALUE`` or ``--flag=VALUE`` on the command line, else the ``SPOTDRAIN_FLAG`` variable."""
    line = words(container)
    for i, word in enumerate(line):
        if word == flag and i + 1 < len(line):
            return line[i + 1]
        if word.startswith(flag + "="):
            return word.partition("=")[2]
    return env_value(container, "SPOTDRAIN_" + flag.lstrip("-").replace("-", "_").upper())


def evicts(agent: Obj) -> bool:
    """The node agent container evicts: neither ``--no-evict`` nor ``SPOTDRAIN_EVICT=false``."""
    line = words(agent)
    if "--no-evict" in line or "--dry-run" in line:
        return False
    if "--evict" in line:
        return True
    return (env_value(agent, "SPOTDRAIN_EVICT") or "true").strip().lower() not in _FALSE


def queue_mode(agent: Obj) -> bool:
    return flag_value(agent, "--queue-url") is not None


def image_tag(image: str) -> str:
    """The tag of an image reference (``latest`` when it has none); a digest stands for itself."""
    if "@" in image:
        return image.partition("@")[2]
    last = image.rpartition("/")[2]
    return last.partition(":")[2] or "latest"


def is_ready(pod: Obj) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


def owner(obj: Obj) -> tuple[str, str] | None:
    """The controller's (kind, name); a ReplicaSet of a Deployment stands for its Deployment."""
    for reference in meta(obj).get("ownerReferences") or []:
        if isinstance(reference, dict) and reference.get("controller"):
            kind, owner_name = str(reference.get("kind", "")), str(reference.get("name", ""))
            hash_ = labels(obj).get("pod-template-hash")
            if kind == "ReplicaSet" and hash_ and owner_name.endswith("-" + hash_):
                return "Deployment", owner_name[: -len(hash_) - 1]
            return kind, owner_name
    return None


def quantity(value: Any) -> float:
    """A whole-number resource quantity (``nvidia.com/gpu: 1``); 0 for what is not one."""
    try:
        return float(str(value))
    except ValueError:
        return 0.0


def is_gpu_node(node: Obj) -> bool:
    """A GPU node as the agent's DaemonSet selects them, or one that offers NVIDIA GPUs."""
    node_labels = labels(node)
    if node_labels.get("karpenter.k8s.aws/instance-gpu-count", "0") not in ("", "0"):
        return True
    if node_labels.get("nvidia.com/gpu.present") == "true":
        return True
    return quantity(((node.get("status") or {}).get("allocatable") or {}).get(GPU, 0)) > 0


def asks_for_gpu(pod: Obj) -> bool:
    for container in containers(spec(pod)):
        resources = container.get("resources") or {}
        if any(quantity((resources.get(part) or {}).get(GPU, 0)) > 0 for part in ("limits", "requests")):
            return True
    return False


def taints(node: Obj) -> list[Obj]:
    return [t for t in spec(node).get("taints") or [] if isinstance(t, dict)]


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """k8s.io/api/core/v1 toleration.go ``ToleratesTaint``: an empty effect matches every effect, an empty key with
    ``Exists`` every key; ``Equal`` (the default operator) needs the same value."""
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    if toleration.get("key") and toleration.get("key") != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return bool(toleration.get("key")) and str(toleration.get("value", "")) == str(taint.get("value", ""))


def blocking_taints(node: Obj, tolerations: Iterable[Obj]) -> list[Obj]:
    """The node's taints that keep a pod with ``tolerations`` off it (``PreferNoSchedule`` keeps nothing off)."""
    kept = [t for t in taints(node) if t.get("effect") in ("NoSchedule", "NoExecute")]
    return [t for t in kept if not any(tolerates(tol, t) for tol in tolerations)]


def taint_text(taint: Obj) -> str:
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint.get('key', '')}{value}:{taint.get('effect', '')}"


def selector_matches(selector: Obj | None, pod_labels: Mapping[str, str]) -> bool:
    """A LabelSelector (``matchLabels`` and ``matchExpressions``, ANDed); an empty one selects everything, a missing
    one nothing (apimachinery's LabelSelectorAsSelector)."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if pod_labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        present = key in pod_labels
        if operator == "In" and pod_labels.get(key) not in values:
            return False
        if operator == "NotIn" and present and pod_labels.get(key) in values:
            return False
        if (operator == "Exists") != present and operator in ("Exists", "DoesNotExist"):
            return False
    return True


def selector_query(selector: Obj | None) -> str:
    """A LabelSelector as a ``labelSelector`` query (``a=b,c in (d,e),!f``)."""
    parts = [f"{key}={value}" for key, value in sorted(((selector or {}).get("matchLabels") or {}).items())]
    for expression in (selector or {}).get("matchExpressions") or []:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        listed = ",".join(values)
        parts.append(
            {"In": f"{key} in ({listed})", "NotIn": f"{key} notin ({listed})", "Exists": str(key)}.get(
                str(operator), f"!{key}"
            )
        )
    return ",".join(parts)


def grace_needed(drain_timeout_s: float) -> int:
    return math.ceil(drain_timeout_s) + GRACE_MARGIN_S


def seconds(text: str | None, default: float) -> float:
    if text is None or not re.fullmatch(r"\d+(\.\d+)?", text.strip()):
        return default
    return float(text)
