"""Asking the node agent's notice endpoint (a long poll, or polling an agent without it): a definitive notice
starts the drain."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import datetime

import aiohttp
import structlog
from yarl import URL

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


@dataclass(frozen=True)
class Answer:
    """What one answer of the endpoint says: the notice it shows (``seen``, for the next request's ``after``) and,
    if it is one to drain for, that notice."""

    seen: str | None
    notice: NodeNotice | None


def parse_answer(status: int, body: bytes | str) -> Answer:
    """The endpoint's answer; raises NoticeError for an answer it cannot be.

    Whatever the body holds, NoticeError is the only exception: deep nesting (RecursionError) and dates beyond
    what a datetime holds (OverflowError, e.g. year 1 with a positive offset) included.
    """
    if status == 204:
        return Answer(seen=None, notice=None)
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
    seen = _text(data.get("id")) or None
    if kind not in DEFINITIVE:
        return Answer(seen=seen, notice=None)
    try:
        moment = parse_rfc3339(deadline)
    except (ValueError, OverflowError) as error:
        raise NoticeError(f"notice deadline {deadline[:40]!r} is not a time: {type(error).__name__}") from None
    return Answer(
        seen=seen, notice=NodeNotice(id=seen or "", kind=kind, deadline=moment, source=_text(data.get("source")))
    )


def parse_notice(status: int, body: bytes | str) -> NodeNotice | None:
    """The endpoint's answer as a notice to drain for, or None; raises NoticeError for an answer it cannot be."""
    return parse_answer(status, body).notice


def next_pause(*, after: str | None, seen: str | None, held_s: float, wait_s: float, interval_s: float) -> float:
    """Seconds before asking again, after an answer that was no notice to drain for.

    Asked with ``after`` and answered ``seen`` (notice ids, None for none) after ``held_s`` seconds: a changed answer
    is followed at once by a request that waits on the new one. An endpoint that long-polls answers an unchanged one
    only once the wait has passed (or at most its own cap, well above half of ours); one that answers at once ignores
    ``wait`` (an agent from before it, or one stopping), and is asked every ``interval_s`` rather than hammered.
    """
    if wait_s <= 0 or (seen == after and held_s < wait_s / 2):
        return interval_s
    return 0.0


def request_url(url: str, *, wait_s: float, after: str | None) -> URL:
    """``url`` with the long poll's ``wait`` and ``after``, keeping what it asks already (``?node=``)."""
    query = {"wait": f"{wait_s:g}"} if wait_s > 0 else {}
    if after is not None:
        query["after"] = after
    return URL(url).update_query(query)


async def notice_watcher(
    session: aiohttp.ClientSession,
    url: str,
    lifecycle: Lifecycle,
    metrics: SidecarMetrics,
    *,
    interval_s: float,
    wait_s: float,
) -> None:
    """Asks ``url`` for a notice until a definitive one arrives (and asks for a drain) or a drain starts another
    way; returns then (in the second case once the request in flight is answered, within ``wait_s``).

    Each request asks the endpoint to hold it up to ``wait_s`` seconds while its answer would not change (a long
    poll), so a notice arrives the moment the agent publishes it; an endpoint that answers at once anyway is asked
    every ``interval_s``. An answer that is no notice (unreachable, a hang past the wait, a dropped connection, an
    error status, a body of any bytes) is counted, logged once per run of failures, and asked again after
    ``interval_s``: nothing the endpoint answers ends the sidecar.
    """
    timeout = aiohttp.ClientTimeout(total=wait_s + max(1.0, interval_s), sock_connect=max(1.0, interval_s))
    loop = asyncio.get_running_loop()
    after: str | None = None
    failing = polling = False
    while not lifecycle.drain_asked.is_set():
        asked = loop.time()
        try:
            async with session.get(request_url(url, wait_s=wait_s, after=after), timeout=timeout) as response:
                answer = parse_answer(response.status, await response.read())
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            metrics.notice_errors.inc()
            if not failing:
                log.warning("notice.poll_failed", url=url, error=f"{type(error).__name__}: {error}")
            failing, pause = True, interval_s
        else:
            if answer.notice is not None:
                _drain_for(answer.notice, lifecycle)
                return
            held_s = loop.time() - asked
            pause = next_pause(after=after, seen=answer.seen, held_s=held_s, wait_s=wait_s, interval_s=interval_s)
            if wait_s > 0 and answer.seen == after and polling != (pause > 0):
                polling = pause > 0
                log.info("notice.polling" if polling else "notice.long_polling", url=url, interval_s=interval_s)
            failing, after = False, answer.seen
        await asyncio.sleep(pause)


def _drain_for(notice: NodeNotice, lifecycle: Lifecycle) -> None:
    # Out of rotation first: the log line can wait, every other sidecar on the node is flipping now too.
    lifecycle.ask_drain(f"notice:{notice.kind}", deadline=notice.deadline)
    log.info("notice.received", notice=notice.id, kind=notice.kind, deadline=notice.deadline.isoformat())
