"""Patches as the Kubernetes API server applies them: RFC 7386 merge, strategic merge, RFC 6902 JSON patch.

Strategic merge patches merge the lists the OpenAPI schema marks with a patch merge key (``status.conditions`` by
``type``, containers by ``name``...) and replace every other list whole: node ``spec.taints`` is atomic, so a patch
of it carries the complete list. Pure functions; errors are ``KubeError`` (400 for a malformed body, 422 when a JSON
patch does not apply, as the server answers).
"""

from __future__ import annotations

import copy
from typing import Any

from simulate.fakes.kube_select import KubeError, Obj, bad_request

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

# Lists that strategic merge patches merge (by key, or as sets of primitives); every other list is replaced whole.
# From the x-kubernetes-patch-merge-key / patch-strategy of the OpenAPI schema. Node spec.taints is atomic.
_SET = ""
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("metadata", "finalizers"): _SET,
    ("metadata", "ownerReferences"): "uid",
    ("spec", "podCIDRs"): _SET,
    ("spec", "volumes"): "name",
    ("spec", "imagePullSecrets"): "name",
    ("spec", "schedulingGates"): "name",
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("status", "podIPs"): "ip",
    **{("spec", c): "name" for c in ("containers", "initContainers", "ephemeralContainers")},
    **{("spec", c, "*", "env"): "name" for c in ("containers", "initContainers")},
    **{("spec", c, "*", "volumeMounts"): "mountPath" for c in ("containers", "initContainers")},
    **{("spec", c, "*", "ports"): "containerPort" for c in ("containers", "initContainers")},
}


def apply_patch(content_type: str, document: Obj, patch: Any) -> Obj:
    """Apply a PATCH body of the given media type; 415 for a type the server does not take."""
    if content_type == JSON_PATCH:
        result = json_patch(document, patch)
    elif content_type not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        accepted = ", ".join((JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH))
        message = f"the body of the request was in an unknown format - accepted media types include: {accepted}"
        raise KubeError(415, "UnsupportedMediaType", message)
    elif not isinstance(patch, dict):
        raise bad_request(
            f"json: cannot unmarshal {type(patch).__name__} into Go value of type map[string]interface {{}}"
        )
    else:
        result = merge_patch(document, patch) if content_type == MERGE_PATCH else strategic_merge(document, patch)
    if not isinstance(result, dict):
        raise _unprocessable("the patch does not leave an object")
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null removes a member, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge(target: Obj, patch: Obj, path: tuple[str, ...] = ()) -> Obj:
    """A strategic merge patch: maps merge, null deletes, lists in ``MERGE_KEYS`` merge, other lists are replaced.

    Supports ``$patch: delete`` in merged list items and ``$deleteFromPrimitiveList/<list>``; other directives
    (``$setElementOrder``, ``$retainKeys``) are accepted and ignored. New list items go at the end.
    """
    result = dict(target)
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        here = (*path, key)
        current = result.get(key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = strategic_merge(current if isinstance(current, dict) else {}, value, here)
        elif isinstance(value, list) and here in MERGE_KEYS:
            result[key] = _merge_list(current if isinstance(current, list) else [], value, MERGE_KEYS[here], here)
        else:
            result[key] = copy.deepcopy(value)
    for key, value in patch.items():
        name = key.removeprefix("$deleteFromPrimitiveList/")
        if name != key and isinstance(result.get(name), list):
            result[name] = [item for item in result[name] if item not in (value or [])]
    return result


def _merge_list(current: list[Any], patch: list[Any], merge_key: str, path: tuple[str, ...]) -> list[Any]:
    if merge_key == _SET:
        return current + [item for i, item in enumerate(patch) if item not in current and item not in patch[:i]]
    result = list(current)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise bad_request(f"map: {item!r} does not contain declared merge key: {merge_key}")
        index = next((i for i, old in enumerate(result) if old.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(strategic_merge({}, item, (*path, "*")))
        else:
            result[index] = strategic_merge(result[index], item, (*path, "*"))
    return result


def json_patch(document: Any, operations: Any) -> Any:
    """RFC 6902 (add, remove, replace, move, copy, test); a failing operation is 422 as the real server answers."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    result = copy.deepcopy(document)
    for operation in operations:
        if not isinstance(operation, dict) or not isinstance(operation.get("path"), str):
            raise _unprocessable(f"invalid JSON patch operation {operation!r}")
        result = _apply_operation(result, operation)
    return result


def _apply_operation(document: Any, operation: Obj) -> Any:
    op, path = operation.get("op"), operation["path"]
    if op == "test":
        if not _json_equal(_get(document, path), operation.get("value")):
            raise _unprocessable(f"testing value {path} failed: test failed")
        return document
    if op in ("move", "copy"):
        source = operation.get("from")
        if not isinstance(source, str):
            raise _unprocessable(f"{op} operation without a 'from' path")
        value = copy.deepcopy(_get(document, source))
        if op == "move":
            document = _put(document, source, None, mode="remove")
        return _put(document, path, value, mode="add")
    if op in ("add", "replace", "remove"):
        if op != "remove" and "value" not in operation:
            raise _unprocessable(f"{op} operation does not apply: missing value")
        return _put(document, path, copy.deepcopy(operation.get("value")), mode=op)
    raise _unprocessable(f"Unexpected kind: {op}")


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise _unprocessable(f"JSON pointer {path!r} does not start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _get(document: Any, path: str) -> Any:
    for part in _pointer(path):
        document = _child(document, part, path)
    return document


def _child(node: Any, part: str, path: str) -> Any:
    if isinstance(node, dict) and part in node:
        return node[part]
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    raise _unprocessable(f"doc is missing path: {path!r}")


def _put(document: Any, path: str, value: Any, *, mode: str) -> Any:
    parts = _pointer(path)
    if not parts:
        if mode == "remove":
            raise _unprocessable("cannot remove the whole document")
        return value
    parent = _get(document, "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts[:-1]))
    last = parts[-1]
    if isinstance(parent, dict):
        if mode != "add" and last not in parent:
            raise _unprocessable(f"{mode} operation does not apply: doc is missing key: {path}")
        if mode == "remove":
            del parent[last]
        else:
            parent[last] = value
    elif isinstance(parent, list):
        _put_in_list(parent, last, value, mode=mode, path=path)
    else:
        raise _unprocessable(f"doc is missing path: {path!r}")
    return document


def _put_in_list(parent: list[Any], last: str, value: Any, *, mode: str, path: str) -> None:
    limit = len(parent) + (1 if mode == "add" else 0)
    if last == "-" and mode == "add":
        parent.append(value)
    elif not last.isdigit() or int(last) >= limit:
        raise _unprocessable(f"{mode} operation does not apply: index out of range: {path}")
    elif mode == "add":
        parent.insert(int(last), value)
    elif mode == "remove":
        del parent[int(last)]
    else:
        parent[int(last)] = value


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return (type(a) is type(b) and a == b) or (isinstance(a, int | float) and isinstance(b, int | float) and a == b)


def _unprocessable(message: str) -> KubeError:
    return KubeError(422, "Invalid", message)
