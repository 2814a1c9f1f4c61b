"""A JSON Patch (RFC 6902) that turns one JSON document into another: what an admission webhook answers with.

Only ``add``, ``remove`` and ``replace`` are emitted. Mappings are compared key by key, lists index by index (the
injected sidecar is appended, so a pod's patch adds it at the end and edits the engine container in place). Values
are compared as JSON compares them: ``1``, ``1.0`` and ``true`` differ, although Python holds them equal.
"""

from __future__ import annotations

from typing import Any

Operation = dict[str, Any]


def pointer(path: list[str]) -> str:
    """An RFC 6901 JSON Pointer: ``~`` and ``/`` in a key are escaped as ``~0`` and ``~1``, in that order."""
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in path)


def same(a: Any, b: Any) -> bool:
    """Whether two JSON values are equal as JSON (types included: ``True`` is not ``1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def diff(before: Any, after: Any) -> list[Operation]:
    """The operations that, applied to ``before`` in order, give ``after``."""
    operations: list[Operation] = []
    _diff(before, after, [], operations)
    return operations


def _diff(before: Any, after: Any, path: list[str], out: list[Operation]) -> None:
    if same(before, after):
        return
    if isinstance(before, dict) and isinstance(after, dict):
        _diff_mapping(before, after, path, out)
    elif isinstance(before, list) and isinstance(after, list):
        _diff_list(before, after, path, out)
    else:
        out.append({"op": "replace", "path": pointer(path), "value": after})


def _diff_mapping(before: dict[str, Any], after: dict[str, Any], path: list[str], out: list[Operation]) -> None:
    for key in before:
        if key not in after:
            out.append({"op": "remove", "path": pointer([*path, key])})
    for key, value in after.items():
        if key in before:
            _diff(before[key], value, [*path, key], out)
        else:
            out.append({"op": "add", "path": pointer([*path, key]), "value": value})


def _diff_list(before: list[Any], after: list[Any], path: list[str], out: list[Operation]) -> None:
    """Item by item where both have one; then the surplus removed from the end, or the new items appended."""
    for index, (old, new) in enumerate(zip(before, after, strict=False)):
        _diff(old, new, [*path, str(index)], out)
    for index in reversed(range(len(after), len(before))):
        out.append({"op": "remove", "path": pointer([*path, str(index)])})
    for index in range(len(before), len(after)):
        out.append({"op": "add", "path": pointer([*path, str(index)]), "value": after[index]})
