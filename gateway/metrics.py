"""The gateway's own series, all ``spotdrain_gateway_*``, present from start, no per-request or per-backend labels."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.continuation import METHODS, REASONS
from gateway.ends import CAUSES
from spotdrain.metrics import CollectorRegistry, Counter, Gauge, Histogram, zeroed

# completed: whole from one backend; continued: whole, spliced from more than one; cut: ended with an error event
# or a 5xx; rejected: the backend refused the request (4xx) or it was too large; abandoned: the client left first.
OUTCOMES = ("completed", "continued", "cut", "rejected", "abandoned")
GAP_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class GatewayMetrics:
    requests: Counter
    continuations: Counter
    continuation_methods: Counter
    cuts: Counter
    splice_gap: Histogram
    open_streams: Gauge
    backend_errors: Counter
    backends_ready: Gauge
    by_outcome: dict[str, Counter] = field(default_factory=dict)  # each outcome's child: one lookup per request

    def counted(self, outcome: str) -> None:
        """One request more with ``outcome`` (one of OUTCOMES)."""
        self.by_outcome[outcome].inc()

    @classmethod
    def create(cls, registry: CollectorRegistry) -> GatewayMetrics:
        metrics = cls(
            requests=Counter("spotdrain_gateway_requests", "Requests by outcome", ["outcome"], registry=registry),
            continuations=Counter(
                "spotdrain_gateway_continuations",
                "Requests re-issued to another backend, by what ended the previous backend's answer",
                ["cause"],
                registry=registry,
            ),
            continuation_methods=Counter(
                "spotdrain_gateway_continuation_methods",
                "Continuations by how they went on: token_ids (exact), text (a backend without token ids), restart",
                ["method"],
                registry=registry,
            ),
            cuts=Counter(
                "spotdrain_gateway_cuts",
                "Broken streams that could not continue, by reason",
                ["reason"],
                registry=registry,
            ),
            splice_gap=Histogram(
                "spotdrain_gateway_splice_gap_seconds",
                "Time between the last chunk a client got from a broken backend and the first from its continuation",
                buckets=GAP_BUCKETS_S,
                registry=registry,
            ),
            # With --workers, each worker's gauge is one sample: streams add up over the live workers, and the
            # backends ready are the most any live worker sees (each checks them itself).
            open_streams=Gauge(
                "spotdrain_gateway_open_streams",
                "Client streams open now",
                registry=registry,
                multiprocess_mode="livesum",
            ),
            backend_errors=Counter(
                "spotdrain_gateway_backend_errors",
                "Backend answers that ended abnormally, by kind",
                ["kind"],
                registry=registry,
            ),
            backends_ready=Gauge(
                "spotdrain_gateway_backends_ready",
                "Backends taking new requests",
                registry=registry,
                multiprocess_mode="livemax",
            ),
        )
        metrics.by_outcome.update(zeroed(metrics.requests, "outcome", OUTCOMES))
        zeroed(metrics.continuations, "cause", CAUSES)
        zeroed(metrics.continuation_methods, "method", METHODS)
        zeroed(metrics.cuts, "reason", REASONS)
        zeroed(metrics.backend_errors, "kind", CAUSES)
        return metrics
