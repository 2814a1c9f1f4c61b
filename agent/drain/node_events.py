"""The node Events that say what was done for a notice, written beside the work rather than before it.

An Event is for people reading ``kubectl describe node``: failing to write one must not stop a drain, and a hung POST
must not hold up the evictions that follow the mark.
"""

from __future__ import annotations

import asyncio

import structlog

from agent.drain.nodes import NodeActions
from agent.drain.planning import Node
from agent.notices.notice import Notice
from spotdrain.clock import rfc3339

log = structlog.get_logger()


def event_text(notice: Notice, *, withdrawn: bool) -> tuple[str, str]:
    """The reason and message of the Event for ``notice``."""
    if withdrawn:
        return "InterruptionWithdrawn", f"{notice.kind.value} notice withdrawn ({notice.source.value})"
    action = "tainted and cordoned" if notice.kind.definitive else "tainted PreferNoSchedule"
    deadline = rfc3339(notice.deadline)
    return "InterruptionNotice", f"{notice.kind.value} from {notice.source.value}, deadline {deadline}: {action}"


class NodeEvents:
    def __init__(self, actions: NodeActions) -> None:
        self.actions = actions
        # By notice id and withdrawal: a mark and its withdrawal may be acted on at once, each waiting for its own.
        self._writing: dict[tuple[str, bool], set[asyncio.Task[None]]] = {}

    def write(self, node: Node, notice: Notice, *, withdrawn: bool) -> None:
        """Start writing the Event for what was just done to ``node``."""
        key = (notice.id, withdrawn)
        task = asyncio.create_task(self._write(node, notice, withdrawn=withdrawn))
        self._writing.setdefault(key, set()).add(task)
        task.add_done_callback(lambda done: self._forget(key, done))

    async def written(self, notice: Notice) -> None:
        """Return once the Events started for ``notice`` have been written (or failed)."""
        await asyncio.gather(*self._writing.get((notice.id, notice.withdrawn), ()))

    def cancel(self) -> list[asyncio.Task[None]]:
        """Stop writing every Event (the agent is stopping); returns the tasks to wait for."""
        tasks = [task for writing in self._writing.values() for task in writing]
        for task in tasks:
            task.cancel()
        return tasks

    def _forget(self, key: tuple[str, bool], task: asyncio.Task[None]) -> None:
        # A notice given up at its deadline never asks for its Events: their entries go as they end.
        tasks = self._writing.get(key, set())
        tasks.discard(task)
        if not tasks:
            self._writing.pop(key, None)

    async def _write(self, node: Node, notice: Notice, *, withdrawn: bool) -> None:
        reason, message = event_text(notice, withdrawn=withdrawn)
        try:
            await self.actions.event(node, reason=reason, message=message, warning=not withdrawn)
        except Exception as error:
            log.warning("node.event_failed", node=node["metadata"]["name"], error=f"{type(error).__name__}: {error}")
