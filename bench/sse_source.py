"""A benchmark backend: vLLM-shaped completion chunks whose text is the monotonic time they were written.

``CLOCK_MONOTONIC`` is one clock for every process on the machine, so a client in another process can tell how long
each chunk took to reach it, directly or through the gateway. ``python -m bench.sse_source --port P --interval S``:
``max_tokens`` chunks per request, ``S`` seconds apart (0: as fast as the socket takes them). Like vLLM 0.32.0, each
chunk carries ``prompt_token_ids`` and ``token_ids``, lists with ``return_token_ids`` (which the gateway asks for)
and null without; ``--ignore-token-ids`` answers as an engine without the field.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiohttp import web


def chunk(index: int, *, last: bool, ids: bool, written_ns: int | None = None) -> bytes:
    """The event for token ``index``, its text the time it is written (or ``written_ns``): the bytes json.dumps
    gives the payload with compact separators, built from parts (the benchmark's clients rebuild every event they
    get to check it byte for byte, and the backend writes thousands a second on the same cores as the proxies)."""
    written = time.monotonic_ns() if written_ns is None else written_ns
    prompt = b"[564,489,503,17,2048]" if ids and index == 0 else b"null"
    token = b"[%d]" % (100 + index % 2900) if ids else b"null"
    finish = b'"length"' if last else b"null"
    return b"".join((_HEAD, b"%d" % written, _MIDDLE, finish, _STOP, prompt, _TOKENS, token, _TAIL))


_HEAD = (
    b'data: {"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench","choices":[{"index":0,"text":" '
)
_MIDDLE = b'","logprobs":null,"finish_reason":'
_STOP = b',"stop_reason":null,"prompt_token_ids":'
_TOKENS = b',"token_ids":'
_TAIL = b"}]}\n\n"


def app(interval_s: float, *, token_ids: bool = True) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        count = int(body.get("max_tokens", 16))
        ids = token_ids and body.get("return_token_ids") is True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(count):
            if interval_s:
                await asyncio.sleep(interval_s)
            await response.write(chunk(index, last=index == count - 1, ids=ids))
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
    parser.add_argument("--ignore-token-ids", action="store_true", help="answer as an engine without the field")
    args = parser.parse_args()
    application = app(args.interval, token_ids=not args.ignore_token_ids)
    web.run_app(application, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
