"""The gateway's HTTP API: the OpenAI routes it proxies, /health, and the 413 for bodies over the limit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from gateway.relay import forwarded
from gateway.streaming import Gateway, no_backend_answer, stream

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def api_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.settings.max_body_bytes)
    app.router.add_post("/v1/completions", _generation(gateway, "/v1/completions", chat=False))
    app.router.add_post("/v1/chat/completions", _generation(gateway, "/v1/chat/completions", chat=True))
    app.router.add_get("/v1/models", _passthrough(gateway))
    app.router.add_get("/health", _health(gateway))
    return app


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _generation(gateway: Gateway, path: str, *, chat: bool) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            async with asyncio.timeout(gateway.settings.timeouts.read_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            gateway.metrics.requests.labels(outcome="rejected").inc()
            raise
        except TimeoutError:
            gateway.metrics.requests.labels(outcome="abandoned").inc()
            return web.Response(status=408, text="the request body did not arrive in time\n")
        body = _json_object(raw)
        if body is not None and body.get("stream") is True:
            return await stream(gateway, request, path=path, body=body, raw=raw, chat=chat)
        # Not streamed, or not JSON at all (the backend answers that with its own 400).
        return await forward(gateway, request, raw=raw)

    return handler


def _passthrough(gateway: Gateway) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await forward(gateway, request, raw=None)

    return handler


def _health(gateway: Gateway) -> Handler:
    async def handler(_: web.Request) -> web.Response:
        ready = sum(b.ready for b in gateway.pool.backends)
        status = 200 if ready else 503
        return web.Response(status=status, text=f"{ready}/{len(gateway.pool.backends)} backends ready\n")

    return handler


async def forward(gateway: Gateway, request: web.Request, *, raw: bytes | None) -> web.Response:
    """A whole request and answer, not streamed: re-sent to another backend when one fails before answering.

    Tries at most ``--migration-limit`` + 1 backends; a 4xx is the client's answer and is never retried.
    """
    timeouts = gateway.settings.timeouts
    timeout = aiohttp.ClientTimeout(total=timeouts.request_s, sock_connect=timeouts.connect_s)
    headers = forwarded(request.headers)
    avoid: set[str] = set()
    cause = ""
    for attempt in range(gateway.settings.migration.limit + 1):
        backend = gateway.pool.pick(avoid=avoid)
        if backend is None:
            return _cut(gateway, "no_backend")
        if attempt:
            gateway.metrics.continuations.labels(cause=cause).inc()
        try:
            async with gateway.session.request(
                request.method, backend.url + request.path_qs, data=raw, headers=headers, timeout=timeout
            ) as answer:
                body = await answer.read()
                if answer.status < 500:
                    outcome = "rejected" if answer.status >= 400 else ("continued" if attempt else "completed")
                    gateway.metrics.requests.labels(outcome=outcome).inc()
                    return web.Response(status=answer.status, body=body, headers=forwarded(answer.headers))
                cause = "server_error"
        except TimeoutError:
            gateway.pool.failed(backend, "timeout")
            gateway.metrics.requests.labels(outcome="cut").inc()
            return no_backend_answer(f"no answer within {timeouts.request_s} s", status=504)
        except aiohttp.ClientConnectorError:
            cause = "unavailable"
        except (aiohttp.ClientError, OSError):
            cause = "reset"
        gateway.pool.failed(backend, cause)
        avoid.add(backend.url)
    return _cut(gateway, "limit")


def _cut(gateway: Gateway, reason: str) -> web.Response:
    gateway.metrics.cuts.labels(reason=reason).inc()
    gateway.metrics.requests.labels(outcome="cut").inc()
    return no_backend_answer(f"no backend could answer ({reason})")
