"""A fake Ray worker node: Serve's HTTP proxy streaming the app of ``simulate.ray.app``, and the node's metrics agent
page, as Ray 2.49.0 serves them. ``tests/engines/test_ray_conformance.py`` holds it against real Ray.

What it models, each measured on real Ray 2.49.0 (``ray start --head --block``, the app deployed, one node):
- The page shows what each process last exported: every process of the node sends its series to the agent each
  ``RAY_metrics_report_interval_ms`` (10 s by default, 1 s as deploy/kuberay sets it), and the agent serves them
  a moment later (0.2-0.4 s). A count that changed shows up to an interval plus that moment late.
- Before any request the page has the node's ``ray_node_mem_total`` and the replica's
  ``ray_serve_replica_processing_queries`` at 0, but neither the proxy's ``ray_serve_num_ongoing_http_requests``
  nor vLLM's ``ray_vllm_*`` (Ray shows a series once it is recorded: the proxy records it for its first request,
  vLLM's Ray stat logger after its first engine step with outputs, ``vllm/v1/metrics/loggers.py``).
- A stream counts once in the proxy and once in the replica, from its request to its response's end, and leaves
  both counts at once when its client goes away (Serve cancels the replica's call).
- The labels: every process's ``Component``, ``NodeAddress``, ``SessionName``, ``Version`` and ``WorkerId``; the
  proxy's ``node_id`` and ``node_ip_address``; the replica's ``application``, ``deployment`` and ``replica``;
  vLLM's ``ReplicaId``, ``engine`` and ``model_name``. The generation-token counter is shown twice, as
  ``ray_vllm_generation_tokens_total`` and the deprecated gauge ``ray_vllm_generation_tokens``.
- SIGTERM to ``ray start --block`` (the Ray container's process, which the kubelet signals) kills the node's
  processes: each open stream ends within 0.05 s with its chunked body unterminated (no ``[DONE]``), and the
  command exits 1.
Not modelled: the other 250 KB of a real page (the agent's and the raylet's own series), other nodes.

``python -m simulate.fakes.ray --http-port P --metrics-port M [--report-interval-ms 1000]`` runs one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from simulate.ray.scheduler import Scheduler
from simulate.ray.server import APP_NAME, MODEL_NAME, REPORT_INTERVAL_MS, VERSION

AGENT_LAG_S = 0.3  # from a process's export to the agent's page (0.2-0.4 s on real Ray)
NODE_IP = "127.0.0.1"
SESSION = "session_2026-01-01_00-00-00_000000_1"
REPLICA = "fk7ray01"
_COMMON = f'Component="core_worker",NodeAddress="{NODE_IP}",SessionName="{SESSION}",Version="{VERSION}"'
PROXY_LABELS = f'{_COMMON},WorkerId="{"a" * 56}",node_id="{"b" * 56}",node_ip_address="{NODE_IP}"'
REPLICA_LABELS = f'{_COMMON},WorkerId="{"c" * 56}",application="{APP_NAME}",deployment="Llm",replica="{REPLICA}"'
VLLM_LABELS = f'{_COMMON},ReplicaId="{REPLICA}",WorkerId="{"c" * 56}",engine="0",model_name="{MODEL_NAME}"'
NODE_SERIES = f"""\
# HELP ray_node_mem_total Total memory on a ray node
# TYPE ray_node_mem_total gauge
ray_node_mem_total{{IsHeadNode="false",RayNodeType="worker",SessionName="{SESSION}",Version="{VERSION}",\
ip="{NODE_IP}"}} 2.5e+10
"""


@dataclass
class _Counts:
    """What the node's processes hold now; ``None`` where a series was never recorded."""

    proxy: int | None = None
    replica: int = 0
    running: int | None = None
    waiting: int | None = None
    tokens: int | None = None

    def page(self) -> str:
        def series(name: str, kind: str, text: str, labels: str, value: int | None) -> str:
            if value is None:
                return ""
            return f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name}{{{labels}}} {float(value)}\n"

        return "".join(
            (
                NODE_SERIES,
                series(
                    "ray_serve_num_ongoing_http_requests",
                    "gauge",
                    "The number of ongoing requests in this RequestProtocol.HTTP proxy.",
                    PROXY_LABELS,
                    self.proxy,
                ),
                series(
                    "ray_serve_replica_processing_queries",
                    "gauge",
                    "The current number of queries being processed.",
                    REPLICA_LABELS,
                    self.replica,
                ),
                series(
                    "ray_vllm_num_requests_running",
                    "gauge",
                    "Number of requests in model execution batches.",
                    VLLM_LABELS,
                    self.running,
                ),
                series(
                    "ray_vllm_num_requests_waiting",
                    "gauge",
                    "Number of requests waiting to be processed.",
                    VLLM_LABELS,
                    self.waiting,
                ),
                series(
                    "ray_vllm_generation_tokens_total",
                    "counter",
                    "Number of generation tokens processed.",
                    VLLM_LABELS,
                    self.tokens,
                ),
                series(
                    "ray_vllm_generation_tokens",
                    "gauge",
                    "(DEPRECATED, use ray_vllm_generation_tokens_total metric instead) Number of generation tokens "
                    "processed.",
                    VLLM_LABELS,
                    self.tokens,
                ),
            )
        )


class FakeRay:
    """The node: ``POST /v1/completions`` with ``max_tokens`` N streams N tokens, one an engine step of ``STEP_S``,
    as the app does; ``/metrics`` on the agent's port shows the counts as last exported."""

    def __init__(self, *, report_interval_s: float = REPORT_INTERVAL_MS / 1000) -> None:
        self.report_interval_s = report_interval_s
        self.counts = _Counts()
        self.shown = _Counts().page()
        self.scheduler = Scheduler(self._record)
        self.open: set[asyncio.BaseTransport] = set()  # the streams' connections, which a kill closes
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.scheduler.run()), asyncio.create_task(self._exports())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def kill(self) -> int:
        """What SIGTERM to ``ray start --block`` does to the open streams: their connections close mid-body."""
        cut = len(self.open)
        for transport in list(self.open):
            if isinstance(transport, asyncio.WriteTransport):
                transport.abort()
        return cut

    async def _exports(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.report_interval_s)
            loop.call_later(AGENT_LAG_S, self._show, self.counts.page())

    def _show(self, page: str) -> None:
        self.shown = page

    def _record(self, generated: int, running: int, waiting: int) -> None:
        self.counts.tokens = (self.counts.tokens or 0) + generated
        self.counts.running, self.counts.waiting = running, waiting

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.counts.proxy = (self.counts.proxy or 0) + 1
        self.counts.replica += 1
        connection = request.transport
        if connection is not None:
            self.open.add(connection)
        handle = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        try:
            body = await request.json()
            handle = self.scheduler.add(max(1, int(body.get("max_tokens", 16))))
            await response.prepare(request)
            while (left := await handle.out.get()) is not None:
                chunk = {
                    "object": "text_completion",
                    "model": MODEL_NAME,
                    "choices": [{"index": 0, "text": f" {left}"}],
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away, or the node was killed: the stream ends here, uncounted at once
        finally:
            if connection is not None:
                self.open.discard(connection)
            if handle is not None:
                self.scheduler.abort(handle)
            self.counts.proxy = (self.counts.proxy or 1) - 1
            self.counts.replica -= 1
        return response

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.shown, content_type="text/plain", charset="utf-8")


@dataclass(frozen=True)
class RunningRay:
    node: FakeRay
    http_port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"


@asynccontextmanager
async def running_ray(
    http_port: int, metrics_port: int, *, report_interval_s: float = REPORT_INTERVAL_MS / 1000
) -> AsyncIterator[RunningRay]:
    """The fake node serving on 127.0.0.1 until the block ends."""
    node = FakeRay(report_interval_s=report_interval_s)
    serve, agent = web.Application(), web.Application()
    serve.router.add_post("/v1/completions", node.completions)
    agent.router.add_get("/metrics", node.metrics)
    runners = [
        web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1) for app in (serve, agent)
    ]
    node.start()
    try:
        for runner, port in zip(runners, (http_port, metrics_port), strict=True):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
        yield RunningRay(node, http_port, metrics_port)
    finally:
        node.kill()
        for runner in runners:
            await runner.cleanup()
        await node.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m simulate.fakes.ray", description=__doc__)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--report-interval-ms", type=int, default=REPORT_INTERVAL_MS)
    args = parser.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with running_ray(args.http_port, args.metrics_port, report_interval_s=args.report_interval_ms / 1000):
            await stop.wait()

    asyncio.run(run())
    raise SystemExit(1)  # as ray start --block exits once its node's processes are gone


if __name__ == "__main__":
    main()
