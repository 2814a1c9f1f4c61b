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


class NoticeError(ValueError):
    """The endpoint's answer cannot be a notice (whatever the reason: status, JSON, a field, a date)."""


@dataclass(frozen=True)
class NodeNotice:
    id: str
    kind: str
    deadline: datetime
    source: str


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def parse_notice(status: int, body: bytes | str) -> NodeNotice | None:
    """The endpoint's answer as a notice to drain for, or None; raises NoticeError for an answer it cannot be.

    Whatever the body holds, NoticeError is the only exception: deep nesting (RecursionError) and dates beyond
    what a datetime holds (OverflowError, e.g. year 1 with a positive offset) included.
    """
    if status == 204:
        return None
    if status != 200:
        raise NoticeError(f"notice endpoint answered HTTP {status}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise NoticeError(f"notice is not JSON: {type(error).__name__}") from None
    if not isinstance(data, dict):
        raise NoticeError("notice is not a JSON object")
    kind, deadline = data.get("kind"), data.get("deadline")
    if not isinstance(kind, str) or not isinstance(deadline, str):
        raise NoticeError("notice lacks kind or deadline")
    if kind not in DEFINITIVE:
        return None
    try:
        moment = parse_rfc3339(deadline)
    except (ValueError, OverflowError) as error:
        raise NoticeError(f"notice deadline {deadline[:40]!r} is not a time: {type(error).__name__}") from None
    return NodeNotice(id=_text(data.get("id")), kind=kind, deadline=moment, source=_text(data.get("source")))


async def notice_watcher(
    session: aiohttp.ClientSession,
    url: str,
    lifecycle: Lifecycle,
    metrics: SidecarMetrics,
    *,
    interval_s: float,
) -> None:
    """Polls ``url`` until a definitive notice arrives or a drain starts another way; returns then.

    An answer that is no notice (unreachable, an error status, a body of any bytes) is counted, logged once per
    run of failures, and polled again: nothing the endpoint answers ends the sidecar.
    """
    timeout = aiohttp.ClientTimeout(total=max(1.0, interval_s))
    failing = False
    while not lifecycle.drain_asked.is_set():
        try:
            async with session.get(url, timeout=timeout) as response:
                notice = parse_notice(response.status, await response.read())
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
