"""Node Events are written beside the work: each notice waits for its own, and none is remembered once written."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from agent.drain.node_events import NodeEvents
from agent.notices.notice import Kind, Notice, Source

NOTICE = Notice(Kind.SCHEDULED_MAINTENANCE, "i-0abc", datetime(2026, 11, 29, 12, tzinfo=UTC), Source.IMDS, "event-1")
WITHDRAWN = Notice(**{**NOTICE.__dict__, "withdrawn": True})
NODE = {"metadata": {"name": "gpu-1"}}


class SlowEvents:
    """Holds the InterruptionNotice Event until released; the others are written at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.written: list[str] = []

    async def event(self, node: dict[str, Any], *, reason: str, message: str, warning: bool) -> None:
        if reason == "InterruptionNotice":
            await self.release.wait()
        self.written.append(reason)


async def test_a_withdrawal_waits_for_its_own_event_not_for_its_marks() -> None:
    actions = SlowEvents()
    events = NodeEvents(actions)  # type: ignore[arg-type]
    events.write(NODE, NOTICE, withdrawn=False)
    events.write(NODE, WITHDRAWN, withdrawn=True)
    await asyncio.wait_for(events.written(WITHDRAWN), 1)
    assert actions.written == ["InterruptionWithdrawn"]
    marking = asyncio.create_task(events.written(NOTICE))
    await asyncio.sleep(0.01)
    assert not marking.done(), "the mark's wait is for the mark's Event"
    actions.release.set()
    await asyncio.wait_for(marking, 1)
    assert actions.written == ["InterruptionWithdrawn", "InterruptionNotice"]


async def test_an_event_written_is_forgotten_whether_or_not_anyone_waited_for_it() -> None:
    actions = SlowEvents()
    actions.release.set()
    events = NodeEvents(actions)  # type: ignore[arg-type]
    events.write(NODE, NOTICE, withdrawn=False)  # a notice given up at its deadline never calls written()
    await asyncio.sleep(0.01)
    assert actions.written == ["InterruptionNotice"]
    assert events._writing == {}, "nothing remembered: a long-running queue agent does not grow"
