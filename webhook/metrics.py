"""The webhook's own series, all ``spotdrain_webhook_*``, present from start, no per-Pod or per-namespace labels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spotdrain.metrics import CollectorRegistry, Counter, Histogram, zeroed

# mutated: answered with a patch; unchanged: nothing to do (not asked, not a Pod's creation, the sidecar there
# already); skipped: admitted as it came with a warning saying why; bad_request: answered 4xx, not a review.
OUTCOMES = ("mutated", "unchanged", "skipped", "bad_request")
# The API server waits timeoutSeconds (5 s in deploy/webhook) and the target is a p99 of 20 ms.
DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class WebhookMetrics:
    admissions: Counter
    duration: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> WebhookMetrics:
        metrics = cls(
            admissions=Counter(
                "spotdrain_webhook_admissions",
                "Admission requests answered, by outcome",
                ["outcome"],
                registry=registry,
            ),
            duration=Histogram(
                "spotdrain_webhook_admission_duration_seconds",
                "Time from a request's arrival to its answer, body read included",
                buckets=DURATION_BUCKETS_S,
                registry=registry,
            ),
        )
        zeroed(metrics.admissions, "outcome", OUTCOMES)
        return metrics


def outcome_of(patch: Sequence[object], warnings: Sequence[str]) -> str:
    """What an answer counts under: a patch is a mutation even when warnings come with it."""
    return "mutated" if patch else "skipped" if warnings else "unchanged"
