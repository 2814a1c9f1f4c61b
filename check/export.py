"""The checks run from inside the cluster, on a timer, so that alerts fire on a drifting install and not only when
someone runs ``spotdrain check``: ``spotdrain node --check-interval S`` (the queue Deployment runs it every 300 s).

Each run sets ``spotdrain_check_findings{check, severity}`` to the number of errors and warnings of each check
(a read that failed counts under ``check="access"``), and logs each problem once, when it appears
(``check.finding``), and once more when it is gone (``check.resolved``).
"""

from __future__ import annotations

import asyncio
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from check.findings import GROUPS, Finding, Report
from spotdrain.metrics import CollectorRegistry, Counter, Gauge

log = structlog.get_logger()

COUNTED = ("error", "warning")
RUN_RESULTS = ("clean", "findings", "unreadable")


@dataclass(frozen=True)
class CheckMetrics:
    findings: Gauge
    runs: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> CheckMetrics:
        metrics = cls(
            findings=Gauge(
                "spotdrain_check_findings",
                "Errors and warnings of the last installation check, by check",
                ["check", "severity"],
                registry=registry,
            ),
            runs=Counter("spotdrain_check_runs", "Installation checks run, by result", ["result"], registry=registry),
        )
        for group in GROUPS:
            for severity in COUNTED:
                metrics.findings.labels(check=group, severity=severity)
        for result in RUN_RESULTS:
            metrics.runs.labels(result=result)
        return metrics


def counts(report: Report) -> Tally[tuple[str, str]]:
    """(check, severity) -> how many; an unreadable cluster is one access error."""
    tally: Tally[tuple[str, str]] = Tally((f.check, f.severity) for f in report.findings if f.severity in COUNTED)
    if report.unreachable is not None:
        tally[("access", "error")] += 1
    return tally


def run_result(report: Report) -> str:
    if report.exit_code == 2:
        return "unreadable"
    return "findings" if any(f.severity in COUNTED for f in report.findings) else "clean"


def record(metrics: CheckMetrics, report: Report) -> None:
    tally = counts(report)
    for group in GROUPS:
        for severity in COUNTED:
            metrics.findings.labels(check=group, severity=severity).set(tally[(group, severity)])
    metrics.runs.labels(result=run_result(report)).inc()


def _problems(report: Report) -> dict[tuple[str, str], Finding]:
    return {(f.check, f.message): f for f in report.findings if f.severity in COUNTED}


async def installation_checker(
    inspect: Callable[[], Awaitable[Report]], metrics: CheckMetrics, *, interval_s: float
) -> None:
    """Runs the checks now and then every ``interval_s`` seconds, for ever; a failed read is a finding, never an end.
    Cancelled, it stops between or during a run (each run's calls have their own timeouts)."""
    known: dict[tuple[str, str], Finding] = {}
    while True:
        report = await inspect()
        record(metrics, report)
        if report.unreachable is not None:
            log.warning("check.unreadable", error=report.unreachable)
        current = _problems(report)
        for key in current.keys() - known.keys():
            finding = current[key]
            log.warning("check.finding", **finding.public())
        for key in known.keys() - current.keys():
            log.info("check.resolved", check=key[0], message=key[1])
        known = current
        await asyncio.sleep(interval_s)
