"""The sidecar's own series, all ``spotdrain_sidecar_*``, present from start, no per-request labels."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.state import Outcome, Phase
from spotdrain.metrics import CollectorRegistry, Counter, Gauge, Histogram, zeroed

DRAIN_BUCKETS_S = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 110, 120, 180, 300, 600)
READ_ERRORS = ("unreachable", "http", "missing", "malformed")
GATE_ERRORS = ("no_token", "unauthorized", "forbidden", "unreachable", "conflict", "throttled", "server", "client")


@dataclass(frozen=True)
class SidecarMetrics:
    state: Gauge
    in_flight: Gauge
    drains: Counter
    drain_duration: Histogram
    streams_cut: Counter
    read_errors: Counter
    gate_errors: Counter
    notice_errors: Counter
    record_errors: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> SidecarMetrics:
        state = Gauge("spotdrain_sidecar_state", "1 for the phase the sidecar is in", ["state"], registry=registry)
        metrics = cls(
            state=state,
            in_flight=Gauge("spotdrain_sidecar_in_flight", "Engine in-flight requests as last read", registry=registry),
            drains=Counter("spotdrain_sidecar_drains", "Drains by outcome", ["outcome"], registry=registry),
            drain_duration=Histogram(
                "spotdrain_sidecar_drain_duration_seconds",
                "Time from drain start to its end",
                buckets=DRAIN_BUCKETS_S,
                registry=registry,
            ),
            streams_cut=Counter(
                "spotdrain_sidecar_streams_cut",
                "Streams still running when a drain timed out",
                registry=registry,
            ),
            read_errors=Counter(
                "spotdrain_sidecar_read_errors",
                "Failed readings of the engine's metrics",
                ["kind"],
                registry=registry,
            ),
            gate_errors=Counter(
                "spotdrain_sidecar_readiness_gate_errors",
                "Failed patches of the pod's readiness gate condition, and a missing token",
                ["kind"],
                registry=registry,
            ),
            notice_errors=Counter(
                "spotdrain_sidecar_notice_errors",
                "Failed polls of the node agent's notice endpoint",
                registry=registry,
            ),
            record_errors=Counter(
                "spotdrain_sidecar_drain_record_errors",
                "Unusable drain records found in the drain directory at start",
                registry=registry,
            ),
        )
        zeroed(metrics.state, "state", [phase.value for phase in Phase])
        zeroed(metrics.drains, "outcome", [outcome.value for outcome in Outcome])
        zeroed(metrics.read_errors, "kind", READ_ERRORS)
        zeroed(metrics.gate_errors, "kind", GATE_ERRORS)
        metrics.show(Phase.SERVING)
        return metrics

    def show(self, phase: Phase) -> None:
        for each in Phase:
            self.state.labels(state=each.value).set(1 if each is phase else 0)
