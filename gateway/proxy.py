"""The gateway's HTTP API: the OpenAI routes it proxies, and /health."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from gateway.relay import forwarded
from gateway.request import Request
from gateway.server import Connection
from gateway.splice import parse_json
from gateway.streaming import Gateway, no_backend_answer, stream

Route = Callable[[Gateway, Request, Connection], Awaitable[web.Response | None]]


def api(gateway: Gateway) -> Callable[[Request, Connection], Awaitable[None]]:
    """The handler of every request (gateway.server): its route's answer, 404 for an unknown path, 405 for a
    method the path does not take."""

    async def handle(request: Request, connection: Connection) -> None:
        methods = ROUTES.get(request.path)
        if methods is None:
            response: web.Response | None = _plain(404, "Not Found")
        elif (route := methods.get("GET" if request.method == "HEAD" else request.method)) is None:
            response = _plain(405, "Method Not Allowed")
            response.headers["Allow"] = ", ".join(methods)
        else:
            response = await route(gateway, request, connection)
        if response is not None:
            connection.answer(response)

    return handle


def _plain(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=f"{status}: {text}")


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = parse_json(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def _generation(gateway: Gateway, request: Request, connection: Connection) -> web.Response | None:
    body = _json_object(request.body)
    if body is not None and body.get("stream") is True:
        chat = request.path == "/v1/chat/completions"
        return await stream(gateway, request, connection, body=body, chat=chat)
    # Not streamed, or not JSON at all (the backend answers that with its own 400).
    return await forward(gateway, request.method, request.target, request.headers, raw=request.body)


async def _passthrough(gateway: Gateway, request: Request, _: Connection) -> web.Response:
    return await forward(gateway, "GET", request.target, request.headers, raw=None)


async def _health(gateway: Gateway, _: Request, __: Connection) -> web.Response:
    ready = sum(b.ready for b in gateway.pool.backends)
    status = 200 if ready else 503
    return web.Response(status=status, text=f"{ready}/{len(gateway.pool.backends)} backends ready\n")


ROUTES: dict[str, dict[str, Route]] = {
    "/v1/completions": {"POST": _generation},
    "/v1/chat/completions": {"POST": _generation},
    "/v1/models": {"GET": _passthrough},
    "/health": {"GET": _health},
}


def refused(gateway: Gateway) -> Callable[[int], None]:
    """Count a request the server answered itself: its body never arrived in time (408), or it could not be taken
    (over the body limit, a head that is not HTTP)."""

    def count(status: int) -> None:
        gateway.metrics.counted("abandoned" if status == 408 else "rejected")

    return count


async def forward(
    gateway: Gateway, method: str, target: str, headers: Mapping[str, str], *, raw: bytes | None
) -> web.Response:
    """A whole request and answer, not streamed: re-sent to another backend when one fails before answering.

    Tries at most ``--migration-limit`` + 1 backends; a 4xx is the client's answer and is never retried.
    """
    timeouts = gateway.settings.timeouts
    timeout = aiohttp.ClientTimeout(total=timeouts.request_s, sock_connect=timeouts.connect_s)
    headers = forwarded(headers)
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
                method, backend.url + target, data=raw, headers=headers, timeout=timeout
            ) as answer:
                body = await answer.read()
                if answer.status < 500:
                    outcome = "rejected" if answer.status >= 400 else ("continued" if attempt else "completed")
                    gateway.metrics.counted(outcome)
                    return web.Response(status=answer.status, body=body, headers=forwarded(answer.headers))
                cause = "server_error"
        except TimeoutError:
            gateway.pool.failed(backend, "timeout")
            gateway.metrics.counted("cut")
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
    gateway.metrics.counted("cut")
    return no_backend_answer(f"no backend could answer ({reason})")
