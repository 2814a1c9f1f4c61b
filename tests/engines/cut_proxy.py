"""An HTTP proxy in front of one real vLLM that drops a stream's connection right after a chosen token.

Restarting a server to place each cut would take a minute; this places hundreds of cuts per second, exactly where a
test wants them (right after an empty-text token, say), on a server that stays up. Everything else passes through:
health checks, ``/v1/models``, whole answers, and every stream it is not told to cut.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from gateway.sse import SseParser
from tests.conftest import serving_app


def key_of(body: Any) -> str | None:
    """What names a client's request here: its prompt, or its chat's last message (a continuation has neither)."""
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        return str(messages[-1].get("content"))
    return None


def tokens_in(data: bytes) -> tuple[int, bool]:
    """The event's token count, and whether it carries the stream's finish_reason."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return 0, False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return 0, False
    return len(choices[0].get("token_ids") or ()), choices[0].get("finish_reason") is not None


@dataclass
class CutProxy:
    upstream: str
    cuts: dict[str, int] = field(default_factory=dict)  # request key -> tokens after which its stream is dropped
    done: list[str] = field(default_factory=list)  # the keys whose stream was dropped, in order
    # Of those, the ones dropped right after the chunk with their finish_reason: vLLM merges tokens into one chunk as
    # it pleases, so a cut placed before the last tokens of a reference can fall on the last chunk of the live stream,
    # and nothing is left to continue.
    whole: list[str] = field(default_factory=list)
    heads: list[list[tuple[bytes, bytes]]] = field(default_factory=list)  # each POST's header lines as they came

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            self.heads.append(list(request.raw_headers))
        raw = await request.read()
        try:
            key = key_of(json.loads(raw)) if raw else None
        except ValueError:
            key = None
        cut = self.cuts.pop(key, None) if key is not None else None
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        timeout = aiohttp.ClientTimeout(total=300)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(request.method, self.upstream + request.path_qs, data=raw or None, headers=headers) as up,
        ):
            kind = up.headers.get("Content-Type", "")
            if not kind.startswith("text/event-stream"):
                return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": kind})
            response = web.StreamResponse(status=up.status, headers={"Content-Type": kind})
            await response.prepare(request)
            await self._relay(up, response, request, key=key, cut=cut)
            return response

    async def _relay(
        self,
        up: aiohttp.ClientResponse,
        response: web.StreamResponse,
        request: web.Request,
        *,
        key: str | None,
        cut: int | None,
    ) -> None:
        parser, tokens = SseParser(), 0
        async for block in up.content.iter_any():
            for data in parser.feed(block):
                await response.write(b"data: " + data + b"\n\n")
                count, finished = tokens_in(data)
                tokens += count
                if cut is not None and tokens >= cut and key is not None:
                    self.done.append(key)
                    if finished:
                        self.whole.append(key)
                    if request.transport is not None:
                        request.transport.abort()  # as a dead pod's connection goes: no [DONE], no last chunk
                    return

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


@asynccontextmanager
async def cut_proxy(upstream: str) -> AsyncIterator[tuple[CutProxy, int]]:
    proxy = CutProxy(upstream)
    async with serving_app(proxy.app()) as port:
        yield proxy, port
