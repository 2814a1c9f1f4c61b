"""A benchmark backend: vLLM-shaped completion chunks whose text is the monotonic time they were written.

``CLOCK_MONOTONIC`` is one clock for every process on the machine, so a client in another process can tell how long
each chunk took to reach it, directly or through the gateway. ``python -m bench.sse_source --port P --interval S``:
``max_tokens`` chunks per request, ``S`` seconds apart (0: as fast as the socket takes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web


def chunk(index: int, *, last: bool) -> bytes:
    choice = {
        "index": 0,
        "text": f" {time.monotonic_ns()}",
        "logprobs": None,
        "finish_reason": "length" if last else None,
        "stop_reason": None,
    }
    payload = {"id": "cmpl-bench", "object": "text_completion", "created": 1, "model": "bench", "choices": [choice]}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def app(interval_s: float) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        count = int((await request.json()).get("max_tokens", 16))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(count):
            if interval_s:
                await asyncio.sleep(interval_s)
            await response.write(chunk(index, last=index == count - 1))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    application = web.Application()
    application.router.add_post("/v1/completions", completions)
    application.router.add_get("/health", health)
    return application


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.02)
    args = parser.parse_args()
    web.run_app(app(args.interval), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
