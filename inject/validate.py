"""Is an object of a kind ``spotdrain inject`` reads a valid one: the fields the API server requires of it, checked
by hand so that the command needs no schema library.

The fields are the ``required`` lists of the kinds' schemas (Kubernetes' OpenAPI for the built-in kinds, KubeRay's
CRD for Ray's; tests/deploy/test_inject.py checks them against those), plus what the API server's
validation adds: a pod template needs its containers (``ValidatePodTemplateSpec``), which the schema, where a
template's ``spec`` is optional, cannot say. Fields with a default in the schema (a Ray group's ``minReplicas``)
are filled in before validation, so they are not required here. Only absence is checked: a field of the wrong type
is an error of ``inject.pods`` when it is read.
"""

from __future__ import annotations

from typing import Any

from inject.spec import Obj

WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"}


def _missing(obj: Obj, fields: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}.{field}" if where else field for field in fields if obj.get(field) is None]


def _at(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


def _pod_spec(spec: Any, where: str) -> list[str]:
    if not isinstance(spec, dict):
        return [f"{where}.containers"]
    problems = _missing(spec, ("containers",), where)
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        for i, container in enumerate(containers if isinstance(containers, list) else []):
            if isinstance(container, dict):
                problems += _missing(container, ("name",), f"{where}.{key}[{i}]")
    return problems


def _template(holder: Obj, where: str) -> list[str]:
    """A pod template under ``holder``: the template, and its pod spec's containers."""
    template = holder.get("template")
    if template is None:
        return [f"{where}.template" if where else "template"]
    return _pod_spec(_at(template, "spec"), f"{where}.template.spec")


def _ray(spec: Obj, where: str) -> list[str]:
    head = spec.get("headGroupSpec")
    problems = [f"{where}.headGroupSpec"] if head is None else []
    if isinstance(head, dict):
        problems += _template(head, f"{where}.headGroupSpec")
    workers = spec.get("workerGroupSpecs")
    for i, group in enumerate(workers if isinstance(workers, list) else []):
        if isinstance(group, dict):
            problems += _missing(group, ("groupName",), f"{where}.workerGroupSpecs[{i}]")
            problems += _template(group, f"{where}.workerGroupSpecs[{i}]")
    return problems


def missing_fields(obj: Obj) -> list[str]:
    """The required fields ``obj`` lacks, as dotted paths (``spec.selector``); empty for a valid object, and for a
    kind inject does not read."""
    kind, spec = obj.get("kind"), obj.get("spec")
    if kind not in WORKLOADS | {"Pod", "RayCluster", "RayService"}:
        return []
    if not isinstance(spec, dict):
        return ["spec"]
    if kind == "Pod":
        return _pod_spec(spec, "spec")
    if kind in WORKLOADS:
        # A ReplicaSet's schema lets its template go, but validation then finds no containers in it.
        return _missing(spec, ("selector",), "spec") + _template(spec, "spec")
    if kind == "RayService":
        config = spec.get("rayClusterConfig")
        return _ray(config, "spec.rayClusterConfig") if isinstance(config, dict) else ["spec.rayClusterConfig"]
    return _ray(spec, "spec")
