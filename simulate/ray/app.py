"""A Ray Serve app that streams tokens through Serve's HTTP proxy and records in-flight as vLLM does under Ray.

Run with the Ray venv's Python, never spotdrain's: ``python -m simulate.ray.app --address ADDR --http-port P``
deploys it on a running Ray node and returns (Serve's applications outlive the driver that deployed them).

What it models, and where that is written down:
- vLLM's Ray stat logger (``vllm/v1/metrics/ray_wrappers.py``, ``RayPrometheusStatLogger``): the Prometheus
  logger's metrics made with ``ray.util.metrics`` instead, each name sanitized (``vllm:num_requests_running``
  becomes ``vllm_num_requests_running``; Ray's agent adds ``ray_`` in front), the labels ``model_name`` and
  ``engine`` plus ``ReplicaId`` (the Serve replica's unique id). The stat logger records once per engine step that
  has outputs (``vllm/v1/metrics/loggers.py``, ``record``: gauges set to the scheduler's counts after the step, the
  generation-token counter increased by the step's tokens), and nothing while the engine is idle, so before the
  first request no ``vllm_*`` series exists at all.
- vLLM's scheduler: a request waits until the next step schedules it, then gets one token per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator

from ray import serve  # type: ignore[import-not-found]
from ray.util import metrics  # type: ignore[import-not-found]
from starlette.requests import Request  # type: ignore[import-not-found]
from starlette.responses import StreamingResponse  # type: ignore[import-not-found]

from simulate.ray import scheduler
from simulate.ray.server import APP_NAME, MODEL_NAME


class _Engine:
    """The scheduler loop and vLLM's Ray stat logger, in the replica's event loop."""

    def __init__(self, replica_id: str) -> None:
        tag_keys = ("model_name", "engine", "ReplicaId")
        self.tags = {"model_name": MODEL_NAME, "engine": "0", "ReplicaId": replica_id}
        self.running_gauge = metrics.Gauge(
            "vllm_num_requests_running", "Number of requests in model execution batches.", tag_keys=tag_keys
        )
        self.waiting_gauge = metrics.Gauge(
            "vllm_num_requests_waiting", "Number of requests waiting to be processed.", tag_keys=tag_keys
        )
        self.tokens_counter = metrics.Counter(
            "vllm_generation_tokens", "Number of generation tokens processed.", tag_keys=tag_keys
        )
        self.scheduler = scheduler.Scheduler(self._record)
        self.loop_task: asyncio.Task[None] | None = None

    def add(self, tokens: int) -> scheduler.Request:
        if self.loop_task is None:
            self.loop_task = asyncio.get_running_loop().create_task(self.scheduler.run())
        return self.scheduler.add(tokens)

    def _record(self, generated: int, running: int, waiting: int) -> None:
        self.running_gauge.set(running, tags=self.tags)
        self.waiting_gauge.set(waiting, tags=self.tags)
        if generated:
            self.tokens_counter.inc(generated, tags=self.tags)


class Llm:
    """``POST /v1/completions`` with ``max_tokens`` N streams N tokens, one a step, as OpenAI's server-sent events
    (the chunks of Ray Serve LLM's OpenAI app, text only), then ``[DONE]``."""

    def __init__(self) -> None:
        self.engine = _Engine(serve.get_replica_context().replica_id.unique_id)

    async def __call__(self, request: Request) -> StreamingResponse:
        body = await request.json()
        handle = self.engine.add(max(1, int(body.get("max_tokens", 16))))
        return StreamingResponse(self._events(handle), media_type="text/event-stream")

    async def _events(self, handle: scheduler.Request) -> AsyncIterator[str]:
        try:
            while (left := await handle.out.get()) is not None:
                chunk = {
                    "object": "text_completion",
                    "model": MODEL_NAME,
                    "choices": [{"index": 0, "text": f" {left}"}],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.engine.scheduler.abort(handle)


def deploy(address: str, http_port: int) -> None:
    import ray

    ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    # Ray's default of 5 ongoing requests a replica would queue streams in the proxy: vLLM takes them all at once.
    app = serve.deployment(Llm, max_ongoing_requests=1000).bind()
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulate.ray.app")
    parser.add_argument("--address", required=True)
    parser.add_argument("--http-port", type=int, required=True)
    args = parser.parse_args(argv)
    deploy(args.address, args.http_port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
