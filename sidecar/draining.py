"""The drainer: holds the pod until its streams have ended, then releases the engine's preStop."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import structlog

from sidecar.engine_client import EngineClient
from sidecar.handshake import DrainDir
from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from sidecar.record import DrainRecord, write_record
from sidecar.settings import DrainSettings
from sidecar.state import Drain, Outcome, next_poll_delay, observe, streams_cut
from spotdrain.clock import utcnow

log = structlog.get_logger()

# Left before a notice's deadline for the engine to get its SIGTERM and exit (120 s notice - 110 s default drain).
ENGINE_EXIT_MARGIN = timedelta(seconds=10)


def drain_deadline(lifecycle: Lifecycle, settings: DrainSettings, started_at: float) -> float:
    """The loop time by which the drain ends: the drain timeout, or sooner if a notice's deadline demands it."""
    deadline = started_at + settings.timeout_s
    if lifecycle.notice_deadline is not None:
        # A difference of two datetimes cannot overflow, as a deadline minus the margin can (year 1).
        left_s = (lifecycle.notice_deadline - utcnow()).total_seconds() - ENGINE_EXIT_MARGIN.total_seconds()
        deadline = min(deadline, started_at + max(0.0, left_s))
    return deadline


async def drainer(
    lifecycle: Lifecycle,
    engine: EngineClient,
    drain_dir: DrainDir,
    settings: DrainSettings,
    metrics: SidecarMetrics,
) -> None:
    """Waits for a drain to be asked, follows the engine until it ends, writes ``drained``; returns then."""
    await lifecycle.drain_asked.wait()
    started = lifecycle.started or utcnow()
    _record_start(drain_dir, DrainRecord(lifecycle.reason or "", started, lifecycle.notice_deadline))
    loop = asyncio.get_running_loop()
    # A resumed drain keeps the timeout and endpoint delay of the one it continues.
    started_at = loop.time() - max(0.0, (utcnow() - started).total_seconds())
    deadline = drain_deadline(lifecycle, settings, started_at)
    settled_at = min(started_at + settings.endpoint_delay_s, deadline)
    drain = Drain(started_at=started_at, deadline=deadline, settled_at=settled_at)
    # Until endpoints have caught up, requests may still arrive: a zero now would prove nothing.
    await asyncio.sleep(max(0.0, settled_at - loop.time()))
    confirm_s = settings.zero_confirm_s
    while True:
        # Connections are looked at on every reading, so that each look has the one before to tell a kept-alive
        # client's whole exchange since (a Prometheus scrape, a health check) from a request that followed an answer.
        reading = await engine.read(connections=True)
        drain, outcome = observe(drain, reading, stall_after_s=settings.stall_after_s, zero_confirm_s=confirm_s)
        if outcome is not None:
            break
        delay = next_poll_delay(drain, loop.time(), poll_interval_s=settings.poll_interval_s, zero_confirm_s=confirm_s)
        await asyncio.sleep(delay)
    _record(drain, outcome, loop.time() - started_at, metrics)
    drain_dir.mark_drained()
    lifecycle.finish()


def _record_start(drain_dir: DrainDir, record: DrainRecord) -> None:
    """Write the drain down where a restarted sidecar looks; without it, a restart would serve again."""
    try:
        write_record(drain_dir.draining, record)
    except OSError as error:
        log.warning("drain.record_failed", path=str(drain_dir.draining), error=f"{type(error).__name__}: {error}")


def _record(drain: Drain, outcome: Outcome, duration_s: float, metrics: SidecarMetrics) -> None:
    cut = streams_cut(drain, outcome)
    metrics.drains.labels(outcome=outcome.value).inc()
    metrics.drain_duration.observe(duration_s)
    metrics.streams_cut.inc(cut)
    event = "drain.timeout" if outcome is Outcome.TIMEOUT else "drain.finished"
    log.info(event, outcome=outcome.value, duration_s=round(duration_s, 3), streams_cut=cut)
