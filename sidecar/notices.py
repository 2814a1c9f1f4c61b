"""Polling the node agent's node-local notice endpoint: a definitive notice starts the drain."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import datetime

import aiohttp
import structlog

from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from spotdrain.clock import parse_rfc3339

log = structlog.get_logger()

# Kinds after which the instance goes away; a rebalance recommendation only says it might.
DEFINITIVE = frozenset(
    {
        "spot-interruption",
        "scheduled-maintenance",
        "asg-termination",
        "instance-stopping",
        "instance-terminating",
        "health-scheduled-change",
    }
)


@dataclass(frozen=True)
class NodeNotice:
    id: str
    kind: str
    deadline: datetime
    source: str


def parse_notice(status: int, body: str) -> NodeNotice | None:
    """The endpoint's answer as a notice to drain for, or None; raises ValueError for an answer it cannot be."""
    if status == 204:
        return None
    if status != 200:
        raise ValueError(f"notice endpoint answered HTTP {status}")
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("notice is not a JSON object")
    kind, deadline = data.get("kind"), data.get("deadline")
    if not isinstance(kind, str) or not isinstance(deadline, str):
        raise ValueError("notice lacks kind or deadline")
    if kind not in DEFINITIVE:
        return None
    return NodeNotice(
        id=str(data.get("id", "")),
        kind=kind,
        deadline=parse_rfc3339(deadline),
        source=str(data.get("source", "")),
    )


async def notice_watcher(
    session: aiohttp.ClientSession,
    url: str,
    lifecycle: Lifecycle,
    metrics: SidecarMetrics,
    *,
    interval_s: float,
) -> None:
    """Polls ``url`` until a definitive notice arrives or a drain starts another way; returns then."""
    timeout = aiohttp.ClientTimeout(total=max(1.0, interval_s))
    failing = False
    while not lifecycle.drain_asked.is_set():
        try:
            async with session.get(url, timeout=timeout) as response:
                notice = parse_notice(response.status, await response.text())
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            metrics.notice_errors.inc()
            if not failing:
                log.warning("notice.poll_failed", url=url, error=f"{type(error).__name__}: {error}")
            failing = True
        else:
            failing = False
            if notice is not None:
                log.info(
                    "notice.received",
                    notice=notice.id,
                    kind=notice.kind,
                    deadline=notice.deadline.isoformat(),
                )
                lifecycle.ask_drain(f"notice:{notice.kind}", deadline=notice.deadline)
                return
        await asyncio.sleep(interval_s)
