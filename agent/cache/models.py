"""Pure decisions of prefetching: which models a node should hold, and how the node shows each one's state.

A node names its models in the annotation ``spotdrain.io/models`` (its Karpenter NodePool's template sets it):
``NAME=SOURCE`` entries separated by commas or whitespace. Each model's state is the node label
``spotdrain.io/model.NAME`` (``fetching``, ``ready`` or ``failed``), which inference pods can prefer with node affinity.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from agent.cache.fetch.sources import Source, parse_source

MODELS_ANNOTATION = "spotdrain.io/models"
LABEL_PREFIX = "spotdrain.io/model."
# A label name (the part after the prefix's "/") is at most 63 characters, alphanumeric at both ends, with '-', '_'
# and '.' between (Kubernetes, apimachinery/pkg/util/validation: IsQualifiedName); "model." leaves 57 for NAME. The
# name is also the model's directory under <cache>/models, so it cannot start with a dot.
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,55}[A-Za-z0-9])?")


class ModelState(Enum):
    FETCHING = "fetching"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class Wanted:
    """A model the node should hold."""

    name: str
    source: Source

    @property
    def label(self) -> str:
        return LABEL_PREFIX + self.name


def wanted_models(annotations: Mapping[str, Any]) -> tuple[list[Wanted], list[str]]:
    """The models the annotation names, in its order, and a problem for each entry that cannot be one.

    A name given twice keeps its first source: two sources for one directory cannot both be right, and the first is
    the one a reader of the annotation sees first.
    """
    text = annotations.get(MODELS_ANNOTATION)
    if not isinstance(text, str):
        return [], []
    models: dict[str, Wanted] = {}
    problems: list[str] = []
    for entry in text.replace(",", " ").split():
        name, equals, raw_source = entry.partition("=")
        if not equals or _NAME.fullmatch(name) is None:
            problems.append(f"{entry!r}: expected NAME=SOURCE, NAME 1 to 57 letters, digits, '.', '-' or '_'")
            continue
        try:
            source = parse_source(raw_source)
        except ValueError as error:
            problems.append(f"{entry!r}: {error}")
            continue
        if name in models:
            problems.append(f"{entry!r}: {name} is named twice; the first source is kept")
            continue
        models[name] = Wanted(name, source)
    return list(models.values()), problems


def names_models(node: Mapping[str, Any]) -> bool:
    """Whether the node's annotation names at least one model it can fetch."""
    return bool(wanted_models((node.get("metadata") or {}).get("annotations") or {})[0])


def plan_model_label(node: Mapping[str, Any], model: Wanted, state: ModelState) -> dict[str, Any] | None:
    """A merge patch setting the model's label; None if it has that value already. Labels merge key by key, so the
    patch needs no resourceVersion: it cannot undo a change another writer made meanwhile."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if labels.get(model.label) == state.value:
        return None
    return {"metadata": {"labels": {model.label: state.value}}}
