"""The notice endpoint: ``GET /v1/notice`` tells the sidecars on a node to start draining.

It answers 204 with no body while there is no definitive notice for the node, else 200 with the notice's id, kind,
deadline and source. On a node (IMDS mode) it speaks for that node; in queue mode a sidecar names its node with
``?node=<name>``. It is read-only: nothing here starts a drain on request.
"""

from __future__ import annotations

import json

from aiohttp import web

from agent.notices.notice import Notice


class NoticeBoard:
    def __init__(self, *, local_node: str | None) -> None:
        self.local_node = local_node
        self.by_node: dict[str, Notice] = {}

    def publish(self, node: str, notice: Notice) -> None:
        """Show a definitive notice for ``node``; an earlier deadline wins over a later one, and of two with the
        same deadline the first stays (the sidecars see one id, as the node's annotation does)."""
        current = self.by_node.get(node)
        if notice.kind.definitive and (current is None or notice.deadline < current.deadline):
            self.by_node[node] = notice

    def withdraw(self, node: str, notice: Notice) -> None:
        current = self.by_node.get(node)
        if current is not None and current.id == notice.id:
            del self.by_node[node]

    async def answer(self, request: web.Request) -> web.Response:
        node = request.query.get("node") or self.local_node
        if node is None:
            return web.Response(status=400, text="name the node: /v1/notice?node=<node name>\n")
        notice = self.by_node.get(node)
        if notice is None:
            return web.Response(status=204)
        return web.Response(text=json.dumps(notice.public()), content_type="application/json")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/notice", self.answer)
        return app
