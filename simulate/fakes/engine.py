"""A fake vLLM: streams tokens over an OpenAI-style API and serves vLLM's metrics, driven by real streams.

The metrics use vLLM's own names, HELP texts, labels (``model_name``, ``engine``) and histogram buckets, rendered by
prometheus_client as vLLM does. ``python -m simulate.fakes.engine --port 8000`` runs it on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import time
from dataclasses import dataclass

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = structlog.get_logger()

LABELS = ["model_name", "engine"]
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# fmt: on


@dataclass(frozen=True)
class EngineConfig:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    engines: int = 1  # data-parallel engines, one series each
    tokens_per_s: float = 50.0
    max_running: int = 256  # per engine; beyond it requests wait
    kv_blocks: int = 1000  # per engine; a running stream holds one block per 16 tokens
    leak_disconnected: bool = False  # keep counting a stream whose client went away, as vLLM's gauges can
    # The page shows the gauges as they were this long ago: Ray's metrics agent exports every
    # metrics_report_interval_ms (10 s by default), TGI sets its batch size only once a prefill returns.
    report_delay_s: float = 0.0
    # A stream leaves the gauges this long before its last bytes and the end of its response, as a client still
    # receiving buffered bytes does after vLLM has counted the request finished.
    linger_s: float = 0.0
    metrics_port: int | None = None  # also serve on this port, as Ray's metrics agent does beside Serve's


class VllmMetrics:
    def __init__(self, config: EngineConfig) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            LABELS,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            LABELS,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            LABELS,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        for engine in range(config.engines):
            for metric in (
                self.running,
                self.waiting,
                self.kv_usage,
                self.prompt_tokens,
                self.generation_tokens,
                self.ttft,
                self.itl,
                self.e2e,
            ):
                metric.labels(model_name=config.model, engine=str(engine))


class FakeEngine:
    """The engine's state: streams per data-parallel engine, each holding a slot while it runs."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.metrics = VllmMetrics(config)
        self.slots = [asyncio.Semaphore(config.max_running) for _ in range(config.engines)]
        self.waiting = [0] * config.engines
        self.running = [0] * config.engines
        self.kv_tokens = [0] * config.engines
        self._next_engine = itertools.cycle(range(config.engines))
        self._ids = itertools.count(1)
        self.completed = 0
        self.cut = 0  # streams still open when the engine stopped

    def labels(self, engine: int) -> dict[str, str]:
        return {"model_name": self.config.model, "engine": str(engine)}

    def _publish(self, engine: int) -> None:
        running, waiting, blocks = self.running[engine], self.waiting[engine], self.kv_tokens[engine] / 16
        if self.config.report_delay_s > 0:
            loop = asyncio.get_running_loop()
            loop.call_later(self.config.report_delay_s, self._show, engine, running, waiting, blocks)
        else:
            self._show(engine, running, waiting, blocks)

    def _show(self, engine: int, running: int, waiting: int, blocks: float) -> None:
        labels = self.labels(engine)
        self.metrics.running.labels(**labels).set(running)
        self.metrics.waiting.labels(**labels).set(waiting)
        self.metrics.kv_usage.labels(**labels).set(min(1.0, blocks / self.config.kv_blocks))

    def in_flight(self) -> int:
        return sum(self.running) + sum(self.waiting)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            max_tokens = int(body.get("max_tokens", 16))
            prompt = str(body.get("prompt", ""))
        except (ValueError, AttributeError, TypeError):
            return web.json_response({"error": {"message": "invalid request body"}}, status=400)
        if max_tokens < 1:
            return web.json_response({"error": {"message": "max_tokens must be at least 1"}}, status=400)
        engine = next(self._next_engine)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await self._stream(response, engine=engine, prompt=prompt, max_tokens=max_tokens)
        return response

    async def _stream(self, response: web.StreamResponse, *, engine: int, prompt: str, max_tokens: int) -> None:
        labels = self.labels(engine)
        request_id = f"cmpl-{next(self._ids):016x}"
        created = int(time.time())
        started = time.monotonic()
        self.metrics.prompt_tokens.labels(**labels).inc(max(1, len(prompt.split())))
        self.waiting[engine] += 1
        self._publish(engine)
        async with self.slots[engine]:
            self.waiting[engine] -= 1
            self.running[engine] += 1
            self._publish(engine)
            generated = 0
            leaked = released = False
            try:
                last = time.monotonic()
                while generated < max_tokens:
                    await asyncio.sleep(1 / self.config.tokens_per_s)
                    await response.write(self._chunk(request_id, created, generated, max_tokens))
                    now = time.monotonic()
                    (self.metrics.ttft if generated == 0 else self.metrics.itl).labels(**labels).observe(now - last)
                    last = now
                    generated += 1
                    self.kv_tokens[engine] += 1
                    self.metrics.generation_tokens.labels(**labels).inc()
                    self._publish(engine)
                if self.config.linger_s > 0:
                    self.running[engine] -= 1
                    released = True
                    self._publish(engine)
                    await asyncio.sleep(self.config.linger_s)
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                self.completed += 1
                self.metrics.e2e.labels(**labels).observe(time.monotonic() - started)
            except ConnectionResetError:
                leaked = self.config.leak_disconnected
                log.info("engine.client_gone", request=request_id, generated=generated, leaked=leaked)
            except asyncio.CancelledError:
                self.cut += 1
                raise
            finally:
                self.kv_tokens[engine] -= generated
                if not leaked and not released:
                    self.running[engine] -= 1
                self._publish(engine)

    def _chunk(self, request_id: str, created: int, index: int, max_tokens: int) -> bytes:
        choice = {
            "index": 0,
            "text": f" t{index}",
            "logprobs": None,
            "finish_reason": "length" if index == max_tokens - 1 else None,
            "stop_reason": None,
        }
        chunk = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.config.model,
            "choices": [choice],
            "usage": None,
        }
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()

    async def metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/health", self.health)
        return app


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, EngineConfig]:
    parser = argparse.ArgumentParser(prog="python -m simulate.fakes.engine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--engines", type=int, default=1, help="data-parallel engines (one series each)")
    parser.add_argument("--tokens-per-second", type=float, default=EngineConfig.tokens_per_s)
    parser.add_argument("--max-running", type=int, default=EngineConfig.max_running)
    parser.add_argument("--leak-disconnected", action="store_true", help="keep counting streams whose client left")
    parser.add_argument("--report-delay", type=float, default=0.0, help="seconds the metrics page lags the engine")
    parser.add_argument("--linger", type=float, default=0.0, help="seconds a stream stays open after its gauge drops")
    args = parser.parse_args(argv)
    config = EngineConfig(
        model=args.model,
        engines=args.engines,
        tokens_per_s=args.tokens_per_second,
        max_running=args.max_running,
        leak_disconnected=args.leak_disconnected,
        report_delay_s=args.report_delay,
        linger_s=args.linger,
    )
    return args, config


async def serve_engine(config: EngineConfig, *, host: str, port: int, stop: asyncio.Event) -> FakeEngine:
    """Serve until ``stop`` is set, then close at once, cutting open streams as an engine on SIGTERM does."""
    engine = FakeEngine(config)
    runner = web.AppRunner(engine.app(), access_log=None, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        if config.metrics_port is not None:
            await web.TCPSite(runner, host, config.metrics_port, reuse_address=True).start()
        log.info("engine.listening", host=host, port=port, model=config.model)
        await stop.wait()
    finally:
        await asyncio.shield(runner.cleanup())
    log.info("engine.stopped", completed=engine.completed, cut=engine.cut)
    return engine


def main(argv: list[str] | None = None) -> None:
    from spotdrain.logs import configure_logging

    args, config = _parse(argv)
    configure_logging()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_engine(config, host=args.host, port=args.port, stop=stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
