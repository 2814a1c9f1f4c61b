"""A small router in front of the engines, sending new requests only to pods whose readiness probe says ready.

It follows readiness as a Service's endpoints do: each pod's probe (the sidecar's ``/ready``, or the pod's own) runs
every ``poll_s``, and a pod is in rotation while the last answer was ready. A request goes to the ready pod with the
fewest open streams; with none ready the router answers 503. The stream is relayed chunk by chunk, and the pod that
served it is named in the ``X-Spotdrain-Pod`` header.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from simulate.probes import Probe
from simulate.timeline import Kind, Recorder

log = structlog.get_logger()

POD_HEADER = "X-Spotdrain-Pod"
TOKENIZER_TIMEOUT_S = 5.0  # a tokenizer call is not a stream: an engine that holds one is unreachable
# The load generator names each request; the gateway passes the header on, so a continuation reaches the router
# under the same name and the pods a stream went through can be told (``Router.hops``).
REQUEST_HEADER = "X-Spotdrain-Request"


@dataclass
class Backend:
    name: str
    engine_url: str
    probe: Probe  # the pod's readiness, as its endpoint follows it
    ready: bool = False
    was_ready: bool = False
    open_streams: int = 0


class Router:
    def __init__(
        self,
        backends: list[Backend],
        recorder: Recorder,
        *,
        poll_s: float,
        on_change: Callable[[str, bool], None] = lambda name, ready: None,
    ) -> None:
        self.backends = backends
        self.recorder = recorder
        self.poll_s = poll_s
        self.on_change = on_change  # a pod's /ready changed: (name, ready)
        self.routed = 0
        self.refused = 0
        self.rerouted = 0  # routed while another pod had already left rotation
        self.all_ready = asyncio.Event()
        self.first_out = asyncio.Event()
        self.hops: dict[str, list[tuple[float, str]]] = {}  # request name -> (when, pod) for each time it was routed
        self._session: aiohttp.ClientSession | None = None

    def choose(self) -> Backend | None:
        ready = [b for b in self.backends if b.ready]
        return min(ready, key=lambda b: b.open_streams) if ready else None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        backend = self.choose()
        if backend is None:
            self.refused += 1
            return web.json_response({"error": {"message": "no pod in rotation"}}, status=503)
        self.routed += 1
        self.rerouted += any(b.was_ready and not b.ready for b in self.backends)
        if (name := request.headers.get(REQUEST_HEADER)) is not None:
            self.hops.setdefault(name, []).append((self.recorder.now(), backend.name))
        backend.open_streams += 1
        try:
            return await self._relay(request, backend, body)
        finally:
            backend.open_streams -= 1

    async def _relay(self, request: web.Request, backend: Backend, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        response = web.StreamResponse(headers={POD_HEADER: backend.name, "Content-Type": "text/event-stream"})
        try:
            async with self._session.post(
                f"{backend.engine_url}{request.path}", data=body, headers={"Content-Type": "application/json"}
            ) as upstream:
                response.set_status(upstream.status)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
        except (aiohttp.ClientError, ConnectionResetError) as error:
            # The engine went away mid-stream: the client gets what was relayed, without the final [DONE].
            log.debug("router.upstream_cut", pod=backend.name, error=repr(error))
            if not response.prepared:
                return web.json_response({"error": {"message": f"{backend.name} unreachable"}}, status=502)
            response.force_close()
        return response

    async def tokenizer(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize and /detokenize on a pod in rotation (the gateway asks them when it continues a chat the
        engines parse): not a stream, so neither counted nor recorded as one."""
        assert self._session is not None
        backend = self.choose()
        if backend is None:
            return web.json_response({"error": {"message": "no pod in rotation"}}, status=503)
        body = await request.read()
        try:
            async with self._session.post(
                f"{backend.engine_url}{request.path}",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=TOKENIZER_TIMEOUT_S),
            ) as upstream:
                return web.Response(status=upstream.status, body=await upstream.read(), content_type="application/json")
        except (aiohttp.ClientError, ConnectionResetError, TimeoutError):
            return web.json_response({"error": {"message": f"{backend.name} unreachable"}}, status=502)

    async def health(self, _: web.Request) -> web.Response:
        """The router itself is up (the gateway in front of it asks); which pods are ready is its own business."""
        return web.Response(text="ok\n")

    async def poller(self, backend: Backend) -> None:
        """Follows one pod's readiness every ``poll_s``, recording each change; runs until cancelled."""
        assert self._session is not None
        while True:
            ready, reason = await backend.probe(self._session)
            self._update(backend, ready, reason)
            await asyncio.sleep(self.poll_s)

    def _update(self, backend: Backend, ready: bool, reason: str) -> None:
        if ready == backend.ready:
            return
        backend.ready = ready
        self.on_change(backend.name, ready)
        if ready:
            backend.was_ready = True
            if all(b.ready for b in self.backends):
                self.all_ready.set()
            return
        if backend.was_ready:
            self.first_out.set()
            text = f"out of rotation: {reason}"
            self.recorder.record(Kind.OUT_OF_ROTATION, backend.name, text, pod=backend.name)

    async def serve(self, *, port: int) -> None:
        """Serves on 127.0.0.1 and follows every sidecar until cancelled; ``all_ready`` is set once every pod is in
        rotation, which is after the router accepts requests."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/tokenize", self.tokenizer)
        app.router.add_post("/detokenize", self.tokenizer)
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
        # Connections are closed after each request, so none idles on an engine's port between streams.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            self._session = session
            await runner.setup()
            try:
                await web.TCPSite(runner, "127.0.0.1", port).start()
                async with asyncio.TaskGroup() as group:
                    for backend in self.backends:
                        group.create_task(self.poller(backend), name=f"ready-{backend.name}")
            finally:
                await asyncio.shield(runner.cleanup())
