"""Faults the fake Kubernetes API injects on chosen requests, as networks and API servers misbehave.

Each rule matches requests by method (``*`` for any) and a regex searched in the path, lets its first ``skip``
matches through, then strikes the next ``count``:

- ``hang``: the request is read and never answered: an API server that accepted it and went quiet, or a dead NAT
  entry, which looks the same to the client.
- ``drop``: the connection is closed with no answer, as when an API server or a load balancer in front of it
  restarts. aiohttp does not retry a POST or PATCH on a dropped connection (``ServerDisconnectedError``).
- ``garbage``: 200 with a body that is not the JSON asked for: a proxy's HTML page, or an object cut off.
- ``status``: a Kubernetes ``Status`` answer, 5xx, 409 or 429 (with ``Retry-After`` when given).
- ``kill``: the request is served, and ``on_strike`` runs (the fault campaign kills the agent there).

With ``applied`` the API acts on the request before the fault strikes, so the client cannot know whether its write
happened. ``silence()`` makes every connection open at that moment go quiet for good, requests on them hanging, while
new connections are served: what a client sees when its pooled connections died behind a NAT.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from simulate.fakes.kube_select import KubeError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
KINDS = ("hang", "drop", "garbage", "status", "kill")
REASONS = {
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "Timeout",
}
GARBAGE = (
    ("text/html", b"<html><body><h1>502 Bad Gateway</h1></body></html>\n"),
    ("application/json", b'{"kind": "Node", "apiVersion": "v1", "metadata": {"name": '),
)


@dataclass
class Rule:
    kind: str
    method: str
    path: re.Pattern[str]
    skip: int
    count: int
    applied: bool
    status: int
    retry_after_s: float | None
    on_strike: Callable[[], None] | None
    garbage: int = 0  # which of GARBAGE

    def strikes(self, method: str, path: str) -> bool:
        if self.count <= 0 or self.method not in ("*", method) or not self.path.search(path):
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        self.count -= 1
        return True


@dataclass(frozen=True)
class Struck:
    kind: str
    method: str
    path: str


class Faults:
    """The rules of one fake API server, and what they did (``struck``)."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []
        self.struck: list[Struck] = []
        self._open: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()
        self._silent: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()
        self._stopping = asyncio.Event()  # what hung requests wait on: set only when the server stops

    def inject(
        self,
        kind: str,
        method: str = "*",
        path: str = "",
        *,
        count: int = 1,
        skip: int = 0,
        applied: bool = False,
        status: int = 503,
        retry_after_s: float | None = None,
        on_strike: Callable[[], None] | None = None,
        garbage: int = 0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"no fault {kind!r}: choose from {', '.join(KINDS)}")
        rule = Rule(
            kind, method.upper(), re.compile(path), skip, count, applied, status, retry_after_s, on_strike, garbage
        )
        self.rules.append(rule)

    def silence(self) -> None:
        """Every connection open now answers nothing more; connections opened later are served."""
        self._silent.update(self._open)

    def clear(self) -> None:
        self.rules.clear()

    def release(self) -> None:
        """The server is stopping: hung requests end, their connections closed with no answer."""
        self._stopping.set()

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        await self._stopping.wait()
        return self._drop(request)

    @staticmethod
    def _drop(request: web.Request) -> web.StreamResponse:
        if request.transport is not None:
            request.transport.close()
        raise web.HTTPInternalServerError()  # never written: the connection is gone

    def wrap(self, handler: Handler) -> Handler:
        """``handler`` with the faults in front of it."""

        async def faulty(request: web.Request) -> web.StreamResponse:
            transport = request.transport
            if transport is not None:
                self._open.add(transport)
                if transport in self._silent:
                    self.struck.append(Struck("silent", request.method, request.path))
                    return await self._hang(request)
            rule = next((r for r in self.rules if r.strikes(request.method, request.path)), None)
            if rule is None:
                return await handler(request)
            self.struck.append(Struck(rule.kind, request.method, request.path))
            if rule.kind == "status":
                return _status(rule)
            answer = await handler(request) if rule.applied or rule.kind == "kill" else None
            if rule.kind == "kill":
                assert rule.on_strike is not None, "a kill fault needs on_strike"
                rule.on_strike()
                assert answer is not None
                return answer
            return await self._strike(rule, request)

        return faulty

    async def _strike(self, rule: Rule, request: web.Request) -> web.StreamResponse:
        if rule.kind == "hang":
            return await self._hang(request)
        if rule.kind == "garbage":
            content_type, body = GARBAGE[rule.garbage % len(GARBAGE)]
            return web.Response(status=200, body=body, content_type=content_type)
        return self._drop(request)


def _status(rule: Rule) -> web.Response:
    details: dict[str, Any] = {}
    headers = {}
    if rule.retry_after_s is not None:
        details["retryAfterSeconds"] = round(rule.retry_after_s)
        headers["Retry-After"] = str(round(rule.retry_after_s))
    reason = REASONS.get(rule.status, "InternalError")
    error = KubeError(rule.status, reason, f"injected fault: {reason}", details=details)
    return web.json_response(error.status(), status=rule.status, headers=headers)
