"""Prometheus helpers: one registry per program, every series present from start."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = [
    "CONTENT_TYPE_LATEST",
    "CollectorRegistry",
    "Counter",
    "Gauge",
    "Histogram",
    "exposition",
    "zeroed",
]

Labelled = TypeVar("Labelled", Counter, Gauge, Histogram)


def zeroed(metric: Labelled, label: str, values: Iterable[str]) -> dict[str, Labelled]:
    """Create every child of a one-label metric now, so each series exists (at zero) before its first event; each
    value's child, to be counted without the lookup of ``labels``."""
    return {value: metric.labels(**{label: value}) for value in values}


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
