"""The sidecar's phase and the events its roles wait on. Only this object changes the phase."""

from __future__ import annotations

import asyncio
from datetime import datetime

import structlog

from sidecar.metrics import SidecarMetrics
from sidecar.state import Phase, advance
from spotdrain.clock import utcnow

log = structlog.get_logger()


class Lifecycle:
    def __init__(self, metrics: SidecarMetrics) -> None:
        self.metrics = metrics
        self.phase = Phase.SERVING
        self.reason: str | None = None
        self.notice_deadline: datetime | None = None
        self.started: datetime | None = None  # when the drain started, by this process or one before it
        self.drain_asked = asyncio.Event()
        self.drained = asyncio.Event()
        self.terminated = asyncio.Event()

    def ask_drain(self, reason: str, *, deadline: datetime | None = None, started: datetime | None = None) -> None:
        """Start draining (once; later asks are only logged). ``deadline`` is a notice's, and may shorten it;
        ``started`` is when a sidecar before this one started the drain this one resumes."""
        if deadline is not None and (self.notice_deadline is None or deadline < self.notice_deadline):
            self.notice_deadline = deadline
        if self.phase is not Phase.SERVING:
            log.debug("drain.already_started", reason=reason, started_by=self.reason)
            return
        self.phase = advance(self.phase, Phase.DRAINING)
        self.reason = reason
        self.started = started or utcnow()
        self.metrics.show(self.phase)
        log.info("drain.started", reason=reason)
        self.drain_asked.set()

    def finish(self) -> None:
        self.phase = advance(self.phase, Phase.DRAINED)
        self.metrics.show(self.phase)
        self.drained.set()
