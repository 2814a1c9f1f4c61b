"""``spotdrain inject``: add the sidecar (with its own readiness probe), the preStop handshake, the shared drain
volume and a grace period that fits, to every inference workload of a manifest.

What a pod spec gets is decided here, in pure functions of plain dicts (``inject_pod``): which container runs an
engine, whether the sidecar is there already, and what is added. The user's own fields stay as they were, but for
the grace period, which can only be raised, and the outcome names each such change. It has two front ends:
``spotdrain inject`` (``inject.manifest`` finds the pod specs in a manifest and reads and writes its YAML;
``inject.cli`` is the command line) and ``spotdrain webhook`` (the Pods the API server is asked to create).
Nothing here needs a YAML library.
"""

from __future__ import annotations

import math
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
GRACE_MARGIN_S = 20  # after the drain: the engine's own SIGTERM handling and exit
# A drained pod is not Ready before its eviction: only this policy lets the API server evict it whatever its
# budget's other pods do (pkg/registry/core/pod/storage/eviction.go).
POLICY, ALWAYS_ALLOW = "unhealthyPodEvictionPolicy", "AlwaysAllow"
WITHOUT_POLICY = (
    "without it the API server refuses to evict the pods the sidecar has taken out of rotation, and they go down "
    "with the instance"
)
ENGINE_PORTS = {"vllm": 8000, "tgi": 80, "sglang": 30000}
# Ray's metrics agent serves vLLM's gauges renamed (":" becomes "_", "ray_" in front) on each node's export port.
RAY_METRICS_PORT = 8080
RAY_VLLM_IN_FLIGHT = "ray_vllm_num_requests_running,ray_vllm_num_requests_waiting"
# Substrings of an image or of the start of a command line that tell the engine (Ray's LLM image runs vLLM).
ENGINE_MARKERS = (
    ("sglang", "sglang"),
    ("text-generation-inference", "tgi"),
    ("text-generation-launcher", "tgi"),
    ("vllm", "vllm"),
    ("ray-llm", "vllm"),
)
COMMAND_WORDS = 3  # `vllm serve`, `python -m vllm.entrypoints...`, `sh -c "vllm serve ..."`; later words are data
GPU = "nvidia.com/gpu"

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


def _engine_port(container: Obj, engine: str) -> int:
    line = command_line(container)
    for i, part in enumerate(line):
        value = line[i + 1] if part == "--port" and i + 1 < len(line) else part.partition("=")[2]
        if (part == "--port" or part.startswith("--port=")) and value.isdigit():
            return int(value)
    where = f"container {container.get('name')!r}"
    ports = [p.get("containerPort") for p in _list_of(container, "ports", where) if isinstance(p, dict)]
    return int(ports[0]) if ports and isinstance(ports[0], int) else ENGINE_PORTS[engine]


def _engine_args(container: Obj, engine: str, ray_params: Obj | None) -> list[str]:
    if ray_params is None:
        return ["--engine", engine, "--engine-url", f"http://127.0.0.1:{_engine_port(container, engine)}"]
    if engine != "vllm":
        raise InjectError(f"on Ray the sidecar reads vLLM's metrics through Ray's metrics agent, not {engine}'s")
    port = str(ray_params.get("metrics-export-port", RAY_METRICS_PORT))
    if not port.isdigit():
        raise InjectError(f"rayStartParams metrics-export-port {port!r} is not a port")
    return [
        "--engine",
        "custom",
        "--in-flight-metric",
        RAY_VLLM_IN_FLIGHT,
        "--engine-url",
        f"http://127.0.0.1:{port}",
        "--engine-health-path",
        "/metrics",
    ]


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def ready_probe() -> Obj:
    """The sidecar container's own readiness probe. Its /ready answers 200 while serving and the engine's health URL
    answers 200, 503 from the moment a drain starts. A pod is Ready only when every container is, so this alone
    takes the pod out of rotation at the drain's start, whatever readiness probe the engine has (or has not): the
    engine's stays as the user wrote it."""
    return {
        "httpGet": {"path": "/ready", "port": SIDECAR_PORT},
        "periodSeconds": 5,
        "failureThreshold": 1,  # out of rotation at the first 503
    }


def _drain_mount() -> Obj:
    return {"name": SIDECAR, "mountPath": DRAIN_DIR}


def sidecar_container(engine_args: list[str], options: Options) -> Obj:
    """The sidecar container, as deploy/vllm runs it: non-root, read-only root filesystem, no capabilities."""
    args = [*engine_args, "--port", str(SIDECAR_PORT), "--drain-dir", DRAIN_DIR]
    args += ["--drain-timeout", _number(options.drain_timeout_s)]
    env: list[Obj] = []
    if options.notice_url:
        args += ["--notice-url", options.notice_url]
        if "$(HOST_IP)" in options.notice_url:
            env.append(_field_env("HOST_IP", "status.hostIP"))
    mounts: list[Obj] = [_drain_mount()]
    if options.readiness_gate:
        args.append("--readiness-gate")
        env += [_field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace")]
        # A mount at the standard path also stops the API server's automount from adding its own to this container
        # (plugin/pkg/admission/serviceaccount/admission.go), so the two never clash.
        mounts.append({"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True})
    return {
        "name": SIDECAR,
        "image": options.image,
        "command": ["spotdrain", "sidecar"],
        "args": args,
        **({"env": env} if env else {}),
        "ports": [{"name": SIDECAR, "containerPort": SIDECAR_PORT, "protocol": "TCP"}],
        "readinessProbe": ready_probe(),
        "livenessProbe": {"httpGet": {"path": "/live", "port": SIDECAR_PORT}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "10m", "memory": "48Mi"}, "limits": {"memory": "96Mi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }


def token_volume() -> Obj:
    """The account's token, CA and namespace, as the API server's own automount projects them (the kube-api-access
    volume: https://kubernetes.io/docs/reference/access-authn-authz/service-accounts-admin/#bound-service-account-token-volume),
    for the sidecar alone: the pod may (and deploy/vllm does) set automountServiceAccountToken: false, so that the
    engine, which runs model code, holds no token."""
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]
        },
    }


def prestop() -> Obj:
    return {"exec": {"command": ["/bin/sh", f"{DRAIN_DIR}/prestop"]}}


def _check_free(spec: Obj, engine: Obj, where: str) -> None:
    """Refuse what injecting would silently break: a preStop of the user's, port 8081 taken, a volume named ours,
    something else mounted where the handshake's directory goes."""
    name = engine.get("name")
    pre_stop = section(engine, "lifecycle", where).get("preStop")
    if pre_stop is not None and pre_stop != prestop():
        raise InjectError(f"{where}: container {name!r} already has a preStop hook; remove it first")
    for mount in _list_of(engine, "volumeMounts", f"{where} container {name!r}"):
        if isinstance(mount, dict) and mount.get("mountPath") == DRAIN_DIR and mount != _drain_mount():
            raise InjectError(f"{where}: container {name!r} already mounts {mount.get('name')!r} at {DRAIN_DIR}")
    for container in containers_of(spec, "containers", where):
        ports = container.get("ports")
        if isinstance(ports, list) and any(
            isinstance(p, dict) and p.get("containerPort") == SIDECAR_PORT for p in ports
        ):
            raise InjectError(f"{where}: container {container.get('name')!r} uses port {SIDECAR_PORT}, the sidecar's")
    for volume in _list_of(spec, "volumes", where):
        if isinstance(volume, dict) and volume.get("name") == SIDECAR and "emptyDir" not in volume:
            raise InjectError(f"{where}: a volume named {SIDECAR!r} exists and is not an emptyDir")
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and (not isinstance(grace, int) or isinstance(grace, bool)):
        raise InjectError(f"{where}.terminationGracePeriodSeconds is not a whole number of seconds")


def _list_of(obj: Obj, key: str, where: str) -> list[Any]:
    """``obj[key]`` as a list to read, empty when absent or null."""
    items = obj.get(key)
    if items is None:
        return []
    if not isinstance(items, list):
        raise InjectError(f"{where}.{key} is not a list")
    return items


def _list(obj: Obj, key: str, where: str) -> list[Any]:
    """``obj[key]`` as a list to append to, created when absent or null."""
    if obj.get(key) is None:
        obj[key] = []
    items = obj[key]
    if not isinstance(items, list):
        raise InjectError(f"{where}.{key} is not a list")
    return items


def _add_once(items: list[Any], item: Obj, *, key: str) -> None:
    if not any(isinstance(each, dict) and each.get(key) == item[key] for each in items):
        items.append(item)


def _wire_engine(engine: Obj, where: str) -> None:
    """The preStop handshake and the drain directory mounted; the engine's probes are left as they are."""
    engine["lifecycle"] = {**section(engine, "lifecycle", where), "preStop": prestop()}
    mounts = _list(engine, "volumeMounts", f"{where} container {engine.get('name')!r}")
    _add_once(mounts, _drain_mount(), key="mountPath")


def _grace(spec: Obj, options: Options) -> list[str]:
    """Raise the grace period to what the drain needs; says so when that changes a value the user set."""
    needed = math.ceil(options.drain_timeout_s) + GRACE_MARGIN_S
    theirs = spec.get("terminationGracePeriodSeconds")
    if theirs is not None and theirs >= needed:
        return []
    spec["terminationGracePeriodSeconds"] = needed
    if theirs is None:  # the API server's default, 30 s, was never the user's choice
        return []
    why = f"the sidecar's drain timeout ({_number(options.drain_timeout_s)} s) plus {GRACE_MARGIN_S} s for the engine"
    return [f"terminationGracePeriodSeconds raised from {theirs} to {needed}: {why} to exit"]


def add_sidecar(target: PodTarget, engine: Obj, kind: str, options: Options) -> list[str]:
    """Give one pod spec the sidecar for its ``engine`` container (running ``kind``), in place; returns each value
    of the user's it changed, naming the field and its old and new value."""
    spec = target.spec
    _check_free(spec, engine, target.where)
    volumes = _list_of(spec, "volumes", target.where)
    theirs = [v for v in volumes if isinstance(v, dict) and v.get("name") == TOKEN_VOLUME]
    if options.readiness_gate and theirs and theirs[0] != token_volume():
        raise InjectError(f"{target.where}: a volume named {TOKEN_VOLUME!r} exists and is not the account's token")
    sidecar = sidecar_container(_engine_args(engine, kind, target.ray_params), options)
    _wire_engine(engine, target.where)
    spec["containers"].append(sidecar)
    _add_once(_list(spec, "volumes", target.where), {"name": SIDECAR, "emptyDir": {}}, key="name")
    changed = _grace(spec, options)
    if options.readiness_gate:
        _add_once(_list(spec, "readinessGates", target.where), {"conditionType": GATE}, key="conditionType")
        _add_once(spec["volumes"], token_volume(), key="name")
    return changed


def engine_of(container: Obj) -> str | None:
    """The engine a container runs, told by its image or command; None if it runs none we know.

    Only the first words of the command line count, URLs aside: a client that calls a vLLM runs no engine.
    """
    words = [word for word in command_line(container)[:COMMAND_WORDS] if "://" not in word]
    text = " ".join([str(container.get("image", "")), *words]).lower()
    return next((engine for marker, engine in ENGINE_MARKERS if marker in text), None)


def has_sidecar(target: PodTarget) -> bool:
    for key in ("containers", "initContainers"):
        for container in containers_of(target.spec, key, target.where):
            if container.get("name") == SIDECAR or command_line(container)[:2] == ["spotdrain", "sidecar"]:
                return True
    return False


def _gpus(container: Obj, ray_params: Obj, where: str) -> float:
    resources = section(container, "resources", where)
    counts = [section(resources, part, where).get(GPU, 0) for part in ("limits", "requests")]
    counts.append(ray_params.get("num-gpus", 0))
    try:
        return max(float(count) for count in counts)
    except (TypeError, ValueError):
        raise InjectError(f"{where}: a GPU count is not a number") from None


def _ray_gpus(target: PodTarget) -> bool:
    """A Ray pod's Ray container is its first; it runs an engine only where Ray has GPUs to give it."""
    containers = containers_of(target.spec, "containers", target.where)
    params = target.ray_params or {}
    return bool(containers) and _gpus(containers[0], params, target.where) > 0


def _engine_container(target: PodTarget, options: Options) -> tuple[Obj, str] | None:
    """The container to put behind the sidecar and its engine; None when the pod runs no engine."""
    containers = containers_of(target.spec, "containers", target.where)
    if options.container is not None:
        named = [c for c in containers if c.get("name") == options.container]
        if not named:
            return None
        engine = options.engine if options.engine != "auto" else engine_of(named[0])
        if engine is None:
            raise InjectError(f"cannot tell the engine of container {options.container!r}; name it with --engine")
        return named[0], engine
    if target.ray_params is not None:
        containers = containers[:1] if _ray_gpus(target) else []
    found = [(c, engine) for c in containers if (engine := engine_of(c)) is not None]
    if len(found) > 1:
        names = ", ".join(str(c.get("name")) for c, _ in found)
        raise InjectError(f"{target.where}: containers {names} all look like engines; choose one with --container")
    if not found:
        return None
    container, engine = found[0]
    return container, engine if options.engine == "auto" else options.engine


def no_engine(target: PodTarget, options: Options) -> str:
    """Why a pod without the sidecar did not get it: the containers it has (name and image) and the flag to use.
    Both front ends say it: ``spotdrain inject`` on standard error, the webhook as an AdmissionReview warning."""
    containers = containers_of(target.spec, "containers", target.where)
    seen = [f"{c.get('name')} ({c.get('image') or 'no image'})" for c in containers]
    among = f"among {', '.join(seen)}" if seen else "(the pod has no containers)"
    if options.container is not None:
        return f"no container named {options.container!r} (--container) {among}"
    if target.ray_params is not None and not _ray_gpus(target):
        return "a Ray group without GPUs (num-gpus, nvidia.com/gpu) runs no engine"
    return f"no vLLM, TGI or SGLang container found {among}; name the engine's with --container NAME"


@dataclass(frozen=True)
class Outcome:
    """What became of one pod spec."""

    injected: bool
    changed: tuple[str, ...] = ()  # values of the user's that injecting changed, each with its old and new value
    skipped: str | None = None  # why a pod without the sidecar did not get it (None: it has it already)


def inject_pod(target: PodTarget, options: Options) -> Outcome:
    """Give the pod spec the sidecar, in place, unless it runs no engine or has the sidecar already."""
    if has_sidecar(target):
        return Outcome(injected=False)
    picked = _engine_container(target, options)
    if picked is None:
        return Outcome(injected=False, skipped=no_engine(target, options))
    return Outcome(injected=True, changed=tuple(add_sidecar(target, picked[0], picked[1], options)))
