"""The node agent's own series, all ``spotdrain_*``, present from start, no per-pod or per-event label."""

from __future__ import annotations

from dataclasses import dataclass

from agent.notices.notice import Kind, Source
from spotdrain.metrics import CollectorRegistry, Counter, Histogram, zeroed

EVICTION_RESULTS = ("evicted", "gone", "gave_up", "failed")
API_ERRORS = ("timeout", "unreachable", "malformed", "conflict", "throttled", "server", "client")
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30)
DRAIN_BUCKETS_S = (1, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600)


@dataclass(frozen=True)
class AgentMetrics:
    notices: Counter
    notice_to_taint: Histogram
    evictions: Counter
    drain_duration: Histogram
    api_errors: Counter
    unknown_instances: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AgentMetrics:
        metrics = cls(
            notices=Counter("spotdrain_notices", "Notices received", ["source", "kind"], registry=registry),
            notice_to_taint=Histogram(
                "spotdrain_notice_to_taint_seconds",
                "From receiving a notice to the node being tainted and cordoned",
                buckets=LATENCY_BUCKETS_S,
                registry=registry,
            ),
            evictions=Counter("spotdrain_evictions", "Pod evictions by result", ["result"], registry=registry),
            drain_duration=Histogram(
                "spotdrain_drain_duration_seconds",
                "From a definitive notice to the last evicted pod gone",
                buckets=DRAIN_BUCKETS_S,
                registry=registry,
            ),
            api_errors=Counter("spotdrain_api_errors", "Kubernetes API errors by kind", ["kind"], registry=registry),
            unknown_instances=Counter(
                "spotdrain_unknown_instance_notices",
                "Notices for an instance that is not (yet) a node of this cluster",
                registry=registry,
            ),
        )
        for source in Source:
            for kind in Kind:
                metrics.notices.labels(source=source.value, kind=kind.value)
        zeroed(metrics.evictions, "result", EVICTION_RESULTS)
        zeroed(metrics.api_errors, "kind", API_ERRORS)
        return metrics
