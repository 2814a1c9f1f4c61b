"""The fake Kubernetes API's objects: the store, and the rules its writes follow.

The store keeps objects as plain dicts and stamps every write with the next ``resourceVersion``; it keeps the recent
changes, as the API server's watch cache does, for watches to replay (``kube_watch``); ``confine`` applies the update
strategies (status only through ``/status``, identity fields never change); disruption budgets are ``kube_budget``.
Nothing here does I/O, and the clock is passed in.
"""

from __future__ import annotations

import copy
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from simulate.fakes.kube_resources import Resource
from simulate.fakes.kube_select import (
    KubeError,
    Obj,
    fields_match,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)
from spotdrain.clock import rfc3339


def not_found(resource: Resource, name: str) -> KubeError:
    details = {"name": name, "kind": resource.plural} | ({"group": resource.group} if resource.group else {})
    return KubeError(404, "NotFound", f'{resource.qualified} "{name}" not found', details=details)


def conflict(resource: Resource, name: str) -> KubeError:
    message = (
        f'Operation cannot be fulfilled on {resource.qualified} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )
    details = {"name": name, "kind": resource.plural} | ({"group": resource.group} if resource.group else {})
    return KubeError(409, "Conflict", message, details=details)


@dataclass(frozen=True)
class Change:
    """One write, as etcd's watch reports it: ``obj`` as written (for DELETED, as it was, with the deletion's
    ``resourceVersion``) and ``previous``, the object before it (None for ADDED)."""

    revision: int
    resource: Resource
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    previous: Obj | None


class Store:
    """Objects as plain dicts, each write stamped with the next ``resourceVersion``; callers get copies.

    The last ``history`` changes are kept, oldest first, and each is handed to every ``listeners`` callable as it
    happens. A deletion takes a revision too, as in etcd. ``compact()`` forgets them, as etcd compaction and the
    watch cache's bounded window do.
    """

    def __init__(self, *, now: Callable[[], datetime], history: int = 1000) -> None:
        self._objects: dict[tuple[str, str, str, str], Obj] = {}
        self._now = now
        self.revision = 1000
        self.changes: deque[Change] = deque(maxlen=history)
        self.listeners: list[Callable[[Change], None]] = []

    def find(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        found = self._objects.get(self._key(resource, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def get(self, resource: Resource, namespace: str | None, name: str) -> Obj:
        if (found := self.find(resource, namespace, name)) is None:
            raise not_found(resource, name)
        return found

    def items(self, resource: Resource, namespace: str | None = None) -> list[Obj]:
        """Every object of ``resource`` (in ``namespace`` if given), ordered by namespace and name like etcd keys."""
        keys = sorted(
            k for k in self._objects if k[:2] == (resource.group_version, resource.plural) and namespace in (None, k[2])
        )
        return [copy.deepcopy(self._objects[k]) for k in keys]

    def create(self, resource: Resource, namespace: str | None, obj: Obj) -> Obj:
        return self._write(resource, self.created(resource, namespace, obj))

    def created(self, resource: Resource, namespace: str | None, obj: Obj) -> Obj:
        """``obj`` as ``create`` would store it (name, uid, creation time), not stored: a dry run's answer."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise KubeError(422, "Invalid", f"{resource.kind} is invalid: metadata.name: Required value")
        if resource.namespaced:
            meta["namespace"] = namespace
        if self._key(resource, namespace, meta["name"]) in self._objects:
            message = f'{resource.qualified} "{meta["name"]}" already exists'
            raise KubeError(409, "AlreadyExists", message, details={"name": meta["name"], "kind": resource.plural})
        obj["kind"], obj["apiVersion"] = resource.kind, resource.group_version
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339(self._now().replace(microsecond=0))
        meta.pop("deletionTimestamp", None)
        return _normalized(obj)

    def update(self, resource: Resource, obj: Obj, *, expected_version: str | None = None) -> Obj:
        """Replace the stored object; a stale ``expected_version`` is a 409 Conflict."""
        meta = obj["metadata"]
        stored = self.get(resource, meta.get("namespace"), meta["name"])
        if expected_version is not None and expected_version != stored["metadata"]["resourceVersion"]:
            raise conflict(resource, meta["name"])
        if {**obj, "metadata": {**meta, "resourceVersion": stored["metadata"]["resourceVersion"]}} == stored:
            return stored  # a write that changes nothing keeps the resourceVersion, as etcd updates do
        return self._write(resource, copy.deepcopy(obj))

    def remove(self, resource: Resource, namespace: str | None, name: str) -> Obj | None:
        removed = self._objects.pop(self._key(resource, namespace, name), None)
        if removed is not None:
            self.revision += 1
            gone = copy.deepcopy(removed)
            gone["metadata"]["resourceVersion"] = str(self.revision)
            self._record(Change(self.revision, resource, "DELETED", gone, removed))
        return removed

    def oldest(self) -> int:
        """The first revision a watch can still replay from history; an older one is "too old" (410)."""
        return self.changes[0].revision if self.changes else self.revision + 1

    def compact(self) -> None:
        self.changes.clear()

    def _write(self, resource: Resource, obj: Obj) -> Obj:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        key = self._key(resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        previous = self._objects.get(key)
        self._objects[key] = obj
        self._record(Change(self.revision, resource, "ADDED" if previous is None else "MODIFIED", obj, previous))
        return copy.deepcopy(obj)

    def _record(self, change: Change) -> None:
        self.changes.append(change)
        for listener in self.listeners:
            listener(change)

    @staticmethod
    def _key(resource: Resource, namespace: str | None, name: str) -> tuple[str, str, str, str]:
        return resource.group_version, resource.plural, namespace or "", name


def confine(resource: Resource, subresource: str | None, stored: Obj, new: Obj) -> Obj:
    """What an update may change: identity and deletion state never; ``status`` only through ``/status``.

    Writes to the object itself keep the stored status; writes to ``/status`` keep the stored spec (and, for pods,
    the owner references), as the API server's update strategies do.
    """
    new = copy.deepcopy(new)
    meta, old_meta = new.setdefault("metadata", {}), stored["metadata"]
    for field in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"):
        _copy_field(old_meta, meta, field)
    new["kind"], new["apiVersion"] = stored["kind"], stored["apiVersion"]
    if resource.has_status:
        _copy_field(stored, new, "spec" if subresource == "status" else "status")
    if subresource == "status" and resource.plural == "pods":
        _copy_field(old_meta, meta, "ownerReferences")
    return _normalized(new)


def _copy_field(source: Obj, target: Obj, field: str) -> None:
    if field in source:
        target[field] = copy.deepcopy(source[field])
    else:
        target.pop(field, None)


def _normalized(obj: Obj) -> Obj:
    """Drop what the server's JSON encoding omits when empty, so readers see what a real cluster returns."""
    spec, meta = obj.get("spec"), obj.get("metadata", {})
    if isinstance(spec, dict):
        for field in ("unschedulable", "taints"):
            if field in spec and not spec[field]:
                del spec[field]
    for field in ("labels", "annotations", "finalizers", "ownerReferences"):
        if field in meta and not meta[field]:
            del meta[field]
    return obj


def selected(items: Sequence[Obj], *, labels: str = "", fields: str = "", resource: Resource) -> list[Obj]:
    """Filter ``items`` by a labelSelector and a fieldSelector as given in a list request."""
    requirements = parse_label_selector(labels)
    terms = parse_field_selector(fields, resource.fields)
    return [o for o in items if labels_match(requirements, o["metadata"].get("labels")) and fields_match(terms, o)]
