"""What spotdrain's install pulls in, read from the installed metadata: the requirements of the base install or of an
extra, and every distribution those need in turn."""

from __future__ import annotations

import importlib.metadata as metadata
import re
from collections.abc import Iterable

from packaging.requirements import Requirement


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extra: str) -> list[Requirement]:
    """The base install's requirements (``extra`` empty), or those ``extra`` adds."""
    found = [Requirement(text) for text in metadata.requires("spotdrain") or []]
    if not extra:
        return [r for r in found if r.marker is None]
    return [r for r in found if r.marker is not None and r.marker.evaluate({"extra": extra})]


def closure(names: Iterable[str]) -> set[str]:
    """The distributions ``names`` need, with theirs (as installed here, without extras of their own)."""
    seen: set[str] = set()
    todo = [normalized(n) for n in names if normalized(n) != "spotdrain"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [
            normalized(r.name) for r in map(Requirement, needs) if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    return seen
