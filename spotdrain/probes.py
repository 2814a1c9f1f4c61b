"""The HTTP server both programs run: /metrics, liveness and readiness, plus routes a program adds."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from spotdrain.metrics import CONTENT_TYPE_LATEST, CollectorRegistry, exposition

log = structlog.get_logger()

Check = Callable[[], Awaitable[tuple[bool, str]]]


async def _always_live() -> tuple[bool, str]:
    return True, "ok"


def probe_app(registry: CollectorRegistry, *, ready: Check, live: Check = _always_live) -> web.Application:
    """An app answering ``/metrics``, ``/live[z]`` and ``/ready[z]``: 200 or 503 with a one-line reason."""

    def answer(check: Check) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(_: web.Request) -> web.Response:
            ok, reason = await check()
            return web.Response(status=200 if ok else 503, text=reason + "\n")

        return handler

    async def metrics(_: web.Request) -> web.Response:
        body = exposition(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    for path, check in (("/live", live), ("/livez", live), ("/ready", ready), ("/readyz", ready)):
        app.router.add_get(path, answer(check))
    return app


async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    ready_flag: asyncio.Event | None = None,
    name: str = "probes",
    ssl_context: ssl.SSLContext | None = None,
    reuse_port: bool = False,
) -> None:
    """Serve ``app`` (over TLS with ``ssl_context``) until cancelled; sets ``ready_flag`` once the socket listens
    (tests wait on it). ``reuse_port``: processes that each bind the port share its connections (SO_REUSEPORT)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        reuse = reuse_port or None  # None: aiohttp's default
        site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse, ssl_context=ssl_context)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        log.info("server.listening", server=name, host=host, port=bound)
        if ready_flag is not None:
            ready_flag.set()
        await asyncio.Event().wait()
    finally:
        await asyncio.shield(runner.cleanup())
