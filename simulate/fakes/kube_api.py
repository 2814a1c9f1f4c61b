"""What each request to the fake Kubernetes API does to its store, as the API server does it, without the HTTP.

Reads show a budget's status as the disruption controller keeps it; writes go through the update strategies and the
``resourceVersion`` precondition; pod deletion is graceful (``deletionTimestamp`` now, removal once the grace period
ends, as the kubelet finishes it); evictions honour PodDisruptionBudgets.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import structlog

from simulate.fakes.kube_budget import disruption_budget, eviction_refusal, pdb_status
from simulate.fakes.kube_objects import effective_grace, with_ready_condition
from simulate.fakes.kube_patch import apply_patch
from simulate.fakes.kube_resources import NAMESPACES, NODES, PDBS, PODS, Target
from simulate.fakes.kube_select import KubeError, Obj, bad_request
from simulate.fakes.kube_store import Store, confine, conflict, selected
from spotdrain.clock import rfc3339

log = structlog.get_logger()

DeleteHook = Callable[[Obj, int], Awaitable[None] | None]
_NOT_ALLOWED = "the server does not allow this method on the requested resource"


@dataclass(frozen=True)
class Deletion:
    namespace: str
    name: str
    grace_s: int
    eviction: bool


class Api:
    """The API server's behaviour over a ``Store``; owns the timers that finish graceful pod deletions."""

    def __init__(self, store: Store, *, now: Callable[[], datetime]) -> None:
        self.store = store
        self.deletions: list[Deletion] = []
        self.hooks: list[DeleteHook] = []
        self._now = now
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._hook_tasks: set[asyncio.Task[None]] = set()

    def serve(
        self, method: str, target: Target, *, query: Mapping[str, str], content_type: str, body: Any
    ) -> tuple[int, Obj]:
        """Answer one request: (HTTP status, JSON body); errors are raised as ``KubeError``."""
        dry = dry_run(method, query)
        if target.name is None:
            if method == "GET":
                return 200, self._list(target, query)
            if method == "POST":
                return 201, self._create(target, body, dry=dry)
        elif target.subresource == "eviction":
            if method == "POST":
                return 201, self._evict(target, body, dry=dry)
        elif method == "GET":
            return 200, self.shown(self._stored(target))
        elif method == "PUT":
            return 200, self._replace(target, body, dry=dry)
        elif method == "PATCH":
            return 200, self._update(target, apply_patch(content_type, self._stored(target), body), dry=dry)
        elif method == "DELETE" and target.subresource is None:
            return 200, self._delete(target, query, body if isinstance(body, dict) else {})
        raise KubeError(405, "MethodNotAllowed", _NOT_ALLOWED)

    def shown(self, obj: Obj) -> Obj:
        """The object as a reader sees it: a budget's status is computed, as the disruption controller keeps it."""
        if obj.get("kind") == PDBS.kind:
            pods = self.store.items(PODS, obj["metadata"]["namespace"])
            obj["status"] = pdb_status(obj, disruption_budget(obj, pods))
        return obj

    def remove_pod(self, namespace: str, name: str) -> None:
        """Remove a pod at once, as the kubelet does when its containers exit before the grace period ends."""
        if (timer := self._timers.pop((namespace, name), None)) is not None:
            timer.cancel()
        if self.store.remove(PODS, namespace, name) is not None:
            log.info("kube.pod_removed", namespace=namespace, pod=name)

    async def close(self) -> None:
        """Cancel pending pod removals and running deletion hooks; returns once the hooks have stopped."""
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._hook_tasks):
            task.cancel()
        await asyncio.gather(*self._hook_tasks, return_exceptions=True)

    def _stored(self, target: Target) -> Obj:
        return self.store.get(target.resource, target.namespace, target.name or "")

    def _list(self, target: Target, query: Mapping[str, str]) -> Obj:
        resource = target.resource
        items = selected(
            self.store.items(resource, target.namespace),
            labels=query.get("labelSelector", ""),
            fields=query.get("fieldSelector", ""),
            resource=resource,
        )
        shown = [self.shown(item) for item in items]
        for item in shown:  # items of a list carry no kind of their own, as the server encodes them
            item.pop("kind", None)
            item.pop("apiVersion", None)
        meta = {"resourceVersion": str(self.store.revision)}
        return {"kind": f"{resource.kind}List", "apiVersion": resource.group_version, "metadata": meta, "items": shown}

    def _create(self, target: Target, body: Any, *, dry: bool = False) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request is not an object")
        if target.resource.namespaced and target.namespace is None:
            raise KubeError(405, "MethodNotAllowed", _NOT_ALLOWED)
        namespace = body.get("metadata", {}).get("namespace")
        if namespace and namespace != target.namespace:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        if target.resource is NODES:
            body = with_not_ready_taint(body)
        if target.resource is NAMESPACES:
            body = with_name_label(body)
        if dry:
            return self.shown(self.store.created(target.resource, target.namespace, body))
        return self.shown(self.store.create(target.resource, target.namespace, body))

    def _replace(self, target: Target, body: Any, *, dry: bool = False) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request is not an object")
        name = body.get("metadata", {}).get("name")
        if name != target.name:
            raise bad_request(f"the name of the object ({name}) does not match the name on the URL ({target.name})")
        return self._update(target, body, dry=dry)

    def _update(self, target: Target, new: Obj, *, dry: bool = False) -> Obj:
        """Store ``new`` if its resourceVersion (when it has one) is the stored one; 409 Conflict otherwise. A dry
        run answers what would be stored, with the stored resourceVersion, and stores nothing."""
        expected = new.get("metadata", {}).get("resourceVersion") or None
        stored = self._stored(target)
        confined = confine(target.resource, target.subresource, stored, new)
        if target.resource is PODS and target.subresource == "status":  # a readiness gate's condition moves Ready
            confined = with_ready_condition(confined, now=self._now())
        if target.resource is NAMESPACES:
            confined = with_name_label(confined)
        if dry:
            if expected is not None and expected != stored["metadata"]["resourceVersion"]:
                raise conflict(target.resource, stored["metadata"]["name"])
            version = stored["metadata"]["resourceVersion"]
            return self.shown({**confined, "metadata": {**confined["metadata"], "resourceVersion": version}})
        return self.shown(self.store.update(target.resource, confined, expected_version=expected))

    def _delete(self, target: Target, query: Mapping[str, str], options: Obj) -> Obj:
        stored = self._stored(target)
        meta = stored["metadata"]
        for field, wanted in (options.get("preconditions") or {}).items():
            if wanted is not None and wanted != meta.get(field):
                raise conflict(target.resource, meta["name"])
        if target.resource is PODS:
            grace = options.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
            return self._delete_pod(stored, _seconds(grace), eviction=False)
        self.store.remove(target.resource, target.namespace, meta["name"])
        details = {"name": meta["name"], "kind": target.resource.plural, "uid": meta["uid"]}
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}

    def _evict(self, target: Target, body: Any, *, dry: bool = False) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request is not an Eviction")
        pod = self._stored(target)
        if body.get("metadata", {}).get("name") not in (None, target.name):
            raise bad_request("name in URL does not match name in Eviction object")
        namespace = pod["metadata"]["namespace"]
        pdbs, pods = self.store.items(PDBS, namespace), self.store.items(PODS, namespace)
        if (refusal := eviction_refusal(pod, pdbs=pdbs, pods=pods)) is not None:
            log.info("kube.eviction_refused", namespace=namespace, pod=target.name, reason=refusal.reason)
            raise refusal
        grace = (body.get("deleteOptions") or {}).get("gracePeriodSeconds")
        if not dry:
            self._delete_pod(pod, _seconds(grace), eviction=True)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _delete_pod(self, pod: Obj, requested: int | None, *, eviction: bool) -> Obj:
        """Start a graceful deletion (or shorten one); the pod goes once the grace period ends, at once for 0."""
        meta = pod["metadata"]
        grace = effective_grace(pod, requested)
        running = meta.get("deletionGracePeriodSeconds")
        if running is not None and grace >= running:
            return pod  # a deletion already under way is only ever shortened
        if grace == 0:
            self.remove_pod(meta["namespace"], meta["name"])
        else:
            meta["deletionTimestamp"] = rfc3339(self._now().replace(microsecond=0) + timedelta(seconds=grace))
            meta["deletionGracePeriodSeconds"] = grace
            pod = self.store.update(PODS, pod)
            self._schedule_removal(pod, grace)
        self.deletions.append(Deletion(meta["namespace"], meta["name"], grace, eviction))
        log.info("kube.pod_deleting", namespace=meta["namespace"], pod=meta["name"], grace_s=grace, eviction=eviction)
        self._run_hooks(pod, grace)
        return pod

    def _schedule_removal(self, pod: Obj, grace: int) -> None:
        namespace, name, uid = pod["metadata"]["namespace"], pod["metadata"]["name"], pod["metadata"]["uid"]

        def expire() -> None:
            current = self.store.find(PODS, namespace, name)
            if current is not None and current["metadata"]["uid"] == uid:  # not a new pod of the same name
                self.remove_pod(namespace, name)

        if (timer := self._timers.pop((namespace, name), None)) is not None:
            timer.cancel()
        self._timers[(namespace, name)] = asyncio.get_running_loop().call_later(grace, expire)

    def _run_hooks(self, pod: Obj, grace: int) -> None:
        for hook in self.hooks:
            result = hook(copy.deepcopy(pod), grace)
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._hook_tasks.add(task)
                task.add_done_callback(self._hook_done)

    def _hook_done(self, task: asyncio.Task[None]) -> None:
        self._hook_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kube.delete_hook_failed", error=repr(task.exception()))


_OPTIONS = {"POST": "CreateOptions", "PUT": "UpdateOptions", "PATCH": "PatchOptions", "DELETE": "DeleteOptions"}


def dry_run(method: str, query: Mapping[str, str]) -> bool:
    """``?dryRun=All``: the request is checked as usual (conflicts, budgets) and answered, nothing is stored
    (https://kubernetes.io/docs/reference/using-api/api-concepts/#dry-run). Any other value is the options'
    validation error (apimachinery's ValidateDryRun: 422, FieldValueNotSupported)."""
    value = query.get("dryRun")
    if value is None or method not in _OPTIONS:
        return False
    if value != "All":
        why = f'Unsupported value: ["{value}"]: supported values: "All"'
        message = f'{_OPTIONS[method]}.meta.k8s.io "" is invalid: dryRun: {why}'
        causes = [{"reason": "FieldValueNotSupported", "message": why, "field": "dryRun"}]
        details = {"group": "meta.k8s.io", "kind": _OPTIONS[method], "causes": causes}
        raise KubeError(422, "Invalid", message, details=details)
    return True


NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


def with_not_ready_taint(node: Obj) -> Obj:
    """A Node created through the API gets the not-ready taint until its node lifecycle controller sees it Ready:
    the TaintNodesByCondition admission plugin adds it (plugin/pkg/admission/nodetaint/admission.go), so a new
    node is never scheduled to before its kubelet reports."""
    spec = dict(node.get("spec") or {})
    taints = list(spec.get("taints") or [])
    if not any(t.get("key") == NOT_READY_TAINT["key"] for t in taints):
        taints.append(dict(NOT_READY_TAINT))
    return {**node, "spec": {**spec, "taints": taints}}


NAME_LABEL = "kubernetes.io/metadata.name"


def with_name_label(namespace: Obj) -> Obj:
    """The API server labels every namespace with its name, on create and on each update (a writer cannot take the
    label off or change it), so that selectors can pick namespaces by name: NamespaceDefaultLabelName, GA in 1.22,
    in pkg/registry/core/namespace/strategy.go."""
    meta = dict(namespace.get("metadata") or {})
    meta["labels"] = {**(meta.get("labels") or {}), NAME_LABEL: meta.get("name")}
    return {**namespace, "metadata": meta}


def _seconds(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError) as error:
        raise bad_request(f"gracePeriodSeconds: invalid value {value!r}") from error
