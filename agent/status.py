"""``GET /v1/status`` on the agent's metrics port: what the agent sees, for ``spotdrain check --node``, which reads
it through the API server's pod proxy. Read-only, like every endpoint of the agent: it says, it never acts.

It answers the agent's mode and whether it evicts, its notice source (the last IMDS poll and what fails), whether
the Kubernetes API answered, the notice it holds for its node, the model cache, and the addresses that asked for
its node's notice (the sidecars that answer), each with when it last asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from agent.drain.board import NoticeBoard
from agent.node_settings import NodeSettings
from spotdrain.clock import rfc3339, utcnow


class Source(Protocol):
    def status(self) -> dict[str, str | None]: ...


class AgentStatus:
    def __init__(
        self,
        settings: NodeSettings,
        *,
        board: NoticeBoard,
        api_ready: asyncio.Event,
        source: Source | None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.settings, self.board, self.api_ready, self.source, self.clock = settings, board, api_ready, source, clock

    def snapshot(self) -> dict[str, Any]:
        settings, node = self.settings, self.settings.node_name
        notice = self.board.by_node.get(node) if node else None
        cache: Path = settings.cache.path
        return {
            "node": node,
            "mode": "queue" if settings.queue_mode else "imds",
            "evict": settings.drain.evict and not settings.drain.dry_run,
            "time": rfc3339(self.clock()),
            "api_ready": self.api_ready.is_set(),
            "source": None if self.source is None else self.source.status(),
            "notice": None if notice is None else notice.public(),
            "cache": {"path": str(cache), "prepared_here": settings.cache.enabled, "mounted": cache.is_mount()},
            "waiting": self.board.waiting(node) if node else 0,
            "callers": {address: rfc3339(at) for address, at in self.board.callers(node).items()} if node else {},
        }

    async def answer(self, _: web.Request) -> web.Response:
        return web.json_response(self.snapshot())
