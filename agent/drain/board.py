"""The notice endpoint: ``GET /v1/notice`` tells the sidecars on a node to start draining.

It answers 204 with no body while there is no definitive notice for the node, else 200 with the notice's id, kind,
deadline and source. On a node (IMDS mode) it speaks for that node; in queue mode a sidecar names its node with
``?node=<name>``. It is read-only: nothing here starts a drain on request.

A long poll: ``?wait=S`` holds the request up to S seconds (at most ``MAX_WAIT_S``) while the answer would be the
one the caller already has, and answers the moment the node's notice is published or withdrawn. What the caller has
is ``?after=<id>``, the id of the notice it last read, or none (it last read a 204). So without ``after`` a request
is held while there is no notice; with ``after`` it is answered at once when that notice has been replaced (200,
the new one) or withdrawn (204). Each waiting request costs a future on its node's one event and a timer, no task
of its own: thousands of them (every node's sidecars, in queue mode) wait at no CPU.
"""

from __future__ import annotations

import asyncio
import json
import math
from datetime import datetime

from aiohttp import web

from agent.notices.notice import Notice
from spotdrain.clock import utcnow

MAX_WAIT_S = 60.0  # longer holds gain nothing, and an idle connection held longer meets more middleboxes' timeouts
MAX_CALLERS = 4096  # addresses remembered for ``callers``; the oldest is forgotten first


def wait_seconds(raw: str | None) -> float:
    """The hold asked for with ``?wait=``, capped at ``MAX_WAIT_S``; 0 when absent. Raises ValueError."""
    if raw is None or raw == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"wait={raw[:40]!r} is not a number of seconds")
    return min(value, MAX_WAIT_S)


class NoticeBoard:
    def __init__(self, *, local_node: str | None) -> None:
        self.local_node = local_node
        self.by_node: dict[str, Notice] = {}
        self._bodies: dict[str, bytes] = {}  # each node's answer, rendered once: its held requests all get it at once
        self._changed: dict[str, asyncio.Event] = {}  # one per node with requests waiting, set and replaced on change
        self._waiting: dict[str, int] = {}
        self._stopping = False
        self._callers: dict[tuple[str, str], datetime] = {}  # (node, address) -> last asked, oldest first

    def publish(self, node: str, notice: Notice) -> None:
        """Show a definitive notice for ``node``; an earlier deadline wins over a later one, and of two with the
        same deadline the first stays (the sidecars see one id, as the node's annotation does)."""
        current = self.by_node.get(node)
        if notice.kind.definitive and (current is None or notice.deadline < current.deadline):
            self.by_node[node] = notice
            self._bodies[node] = json.dumps(notice.public()).encode()
            self._wake(node)

    def withdraw(self, node: str, notice: Notice) -> None:
        current = self.by_node.get(node)
        if current is not None and current.id == notice.id:
            del self.by_node[node]
            del self._bodies[node]
            self._wake(node)

    def waiting(self, node: str) -> int:
        """Requests held for ``node`` right now."""
        return self._waiting.get(node, 0)

    def callers(self, node: str) -> dict[str, datetime]:
        """The addresses that asked for ``node``'s notice, and when each last did: the sidecars that answer."""
        return {address: at for (asked_for, address), at in self._callers.items() if asked_for == node}

    def _seen(self, node: str, address: str) -> None:
        key = (node, address)
        self._callers.pop(key, None)
        self._callers[key] = utcnow()
        if len(self._callers) > MAX_CALLERS:
            del self._callers[next(iter(self._callers))]

    def _wake(self, node: str) -> None:
        event = self._changed.pop(node, None)
        if event is not None:
            event.set()

    def _current_id(self, node: str) -> str | None:
        notice = self.by_node.get(node)
        return None if notice is None else notice.id

    async def _hold(self, node: str, wait_s: float) -> None:
        """Returns once the node's notice has changed (or the server stops), or after ``wait_s`` seconds."""
        self._waiting[node] = self._waiting.get(node, 0) + 1
        try:
            event = self._changed.get(node)
            if event is None:
                event = self._changed[node] = asyncio.Event()
            async with asyncio.timeout(wait_s):
                await event.wait()
        except TimeoutError:
            pass
        finally:
            self._waiting[node] -= 1
            if not self._waiting[node]:
                del self._waiting[node]
                self._changed.pop(node, None)  # no one waits: keep no event for a name asked once

    async def answer(self, request: web.Request) -> web.Response:
        node = request.query.get("node") or self.local_node
        if node is None:
            return web.Response(status=400, text="name the node: /v1/notice?node=<node name>\n")
        try:
            wait_s = wait_seconds(request.query.get("wait"))
        except ValueError:
            return web.Response(status=400, text="wait is seconds to hold the request: /v1/notice?wait=30\n")
        after = request.query.get("after") or None
        self._seen(node, request.remote or "")
        if wait_s > 0 and not self._stopping and self._current_id(node) == after:
            await self._hold(node, wait_s)
        body = self._bodies.get(node)
        if body is None:
            return web.Response(status=204)
        return web.Response(body=body, content_type="application/json", charset="utf-8")

    async def _release(self, _: web.Application) -> None:
        # A stopping server waits for its handlers: answer the held requests with what is known now, and hold no more.
        self._stopping = True
        for node in list(self._changed):
            self._wake(node)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/notice", self.answer)
        app.on_shutdown.append(self._release)
        return app
