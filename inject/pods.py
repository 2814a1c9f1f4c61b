"""``spotdrain inject``: add the sidecar (with its own readiness probe), the preStop handshake, the shared drain
volume and a grace period that fits, to every inference workload of a manifest.

What a pod spec gets is decided here, in pure functions of plain dicts (``inject_pod``): whether the sidecar is
there already, which container runs an engine (``inject.engines``), and what is added. The user's own fields stay
as they were, but for the grace period, which can only be raised, and the outcome names each such change. It has
two front ends: ``spotdrain inject`` (``inject.manifest`` finds the pod specs in a manifest and reads and writes its
YAML; ``inject.cli`` is the command line) and ``spotdrain webhook`` (the Pods the API server is asked to create).
Nothing here needs a YAML library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inject.engines import engine_args, engine_container, has_sidecar, no_engine
from inject.spec import (
    DRAIN_DIR,
    GATE,
    SIDECAR,
    SIDECAR_PORT,
    TOKEN_DIR,
    TOKEN_VOLUME,
    InjectError,
    Obj,
    Options,
    PodTarget,
    containers_of,
    list_of,
    section,
)

GRACE_MARGIN_S = 20  # after the drain: the engine's own SIGTERM handling and exit


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


def sidecar_container(engine_flags: list[str], options: Options) -> Obj:
    """The sidecar container, as deploy/vllm runs it: non-root, read-only root filesystem, no capabilities."""
    args = [*engine_flags, "--port", str(SIDECAR_PORT), "--drain-dir", DRAIN_DIR]
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
    pre_stop = section(engine, "lifecycle", f"{where}.containers[{name}]").get("preStop")
    if pre_stop is not None and pre_stop != prestop():
        raise InjectError(f"{where}: container {name!r} already has a preStop hook; remove it first")
    for mount in list_of(engine, "volumeMounts", f"{where} container {name!r}"):
        if isinstance(mount, dict) and mount.get("mountPath") == DRAIN_DIR and mount != _drain_mount():
            raise InjectError(f"{where}: container {name!r} already mounts {mount.get('name')!r} at {DRAIN_DIR}")
    for container in containers_of(spec, "containers", where):
        ports = container.get("ports")
        if isinstance(ports, list) and any(
            isinstance(p, dict) and p.get("containerPort") == SIDECAR_PORT for p in ports
        ):
            raise InjectError(f"{where}: container {container.get('name')!r} uses port {SIDECAR_PORT}, the sidecar's")
    for volume in list_of(spec, "volumes", where):
        if isinstance(volume, dict) and volume.get("name") == SIDECAR and "emptyDir" not in volume:
            raise InjectError(f"{where}: a volume named {SIDECAR!r} exists and is not an emptyDir")
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and (not isinstance(grace, int) or isinstance(grace, bool)):
        raise InjectError(f"{where}.terminationGracePeriodSeconds is not a whole number of seconds")


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
    engine["lifecycle"] = {
        **section(engine, "lifecycle", f"{where}.containers[{engine.get('name')}]"),
        "preStop": prestop(),
    }
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
    volumes = list_of(spec, "volumes", target.where)
    theirs = [v for v in volumes if isinstance(v, dict) and v.get("name") == TOKEN_VOLUME]
    if options.readiness_gate and theirs and theirs[0] != token_volume():
        raise InjectError(f"{target.where}: a volume named {TOKEN_VOLUME!r} exists and is not the account's token")
    sidecar = sidecar_container(engine_args(engine, kind, target.ray_params), options)
    _wire_engine(engine, target.where)
    spec["containers"].append(sidecar)
    _add_once(_list(spec, "volumes", target.where), {"name": SIDECAR, "emptyDir": {}}, key="name")
    changed = _grace(spec, options)
    if options.readiness_gate:
        _add_once(_list(spec, "readinessGates", target.where), {"conditionType": GATE}, key="conditionType")
        _add_once(spec["volumes"], token_volume(), key="name")
    return changed


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
    picked = engine_container(target, options)
    if picked is None:
        return Outcome(injected=False, skipped=no_engine(target, options))
    return Outcome(injected=True, changed=tuple(add_sidecar(target, picked[0], picked[1], options)))
