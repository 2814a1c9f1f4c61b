"""Whether the node agent's work on its notices is moving: what ``/livez`` reports.

Every Kubernetes API call has a timeout and every wait a bound, so work on a notice moves every few seconds: a call
ends (answered or not) or a pause runs out. A notice in hand with nothing moving for ``stall_s`` means the agent is
wedged in a way no timeout caught; ``/livez`` then fails and the kubelet restarts the agent, which is safe mid-drain
(what the agent did is recorded on the node, and the notice comes again from its source).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from agent.drain.nodes import NodeActions
from agent.drain.planning import Node, Pod


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


class Progress:
    """Which notices are in hand, and when their work last moved."""

    def __init__(self, *, stall_s: float, now: Callable[[], float] = _loop_time) -> None:
        self.stall_s = stall_s
        self._now = now
        self._held: Counter[str] = Counter()
        self._moved_at: float | None = None

    @contextlib.contextmanager
    def holding(self, notice_id: str) -> Iterator[None]:
        """The notice is in hand while the block runs."""
        if not self._held:
            self._moved_at = self._now()
        self._held[notice_id] += 1
        try:
            yield
        finally:
            self._held[notice_id] -= 1
            if not self._held[notice_id]:
                del self._held[notice_id]

    def moved(self) -> None:
        self._moved_at = self._now()

    def stalled(self) -> str | None:
        """Why the agent looks wedged, or None."""
        if not self._held or self._moved_at is None:
            return None
        idle_s = self._now() - self._moved_at
        if idle_s <= self.stall_s:
            return None
        return f"{len(self._held)} notice(s) in hand and no progress for {idle_s:.1f} s"

    async def live(self) -> tuple[bool, str]:
        """The liveness check of the probe server."""
        reason = self.stalled()
        return reason is None, reason or "ok"


class Watched:
    """Node actions that tell ``progress`` whenever a call ends, however it ends."""

    def __init__(self, real: NodeActions, progress: Progress) -> None:
        self.real = real
        self.progress = progress

    async def get_node(self, name: str) -> Node | None:
        with self._ends():
            return await self.real.get_node(name)

    async def list_nodes(self) -> list[Node]:
        with self._ends():
            return await self.real.list_nodes()

    async def patch_node(self, name: str, patch: dict[str, Any]) -> Node:
        with self._ends():
            return await self.real.patch_node(name, patch)

    async def pods_on(self, node: str) -> list[Pod]:
        with self._ends():
            return await self.real.pods_on(node)

    async def evict(self, namespace: str, name: str, *, grace_s: int) -> None:
        with self._ends():
            await self.real.evict(namespace, name, grace_s=grace_s)

    async def event(self, node: Node, *, reason: str, message: str, warning: bool) -> None:
        with self._ends():
            await self.real.event(node, reason=reason, message=message, warning=warning)

    @contextlib.contextmanager
    def _ends(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.progress.moved()
