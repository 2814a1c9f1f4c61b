"""A benchmark backend: vLLM-shaped completion chunks whose text is the monotonic time they were written.

``CLOCK_MONOTONIC`` is one clock for every process on the machine, so a client in another process can tell how long
each chunk took to reach it, directly or through the gateway. ``python -m bench.sse_source --port P --interval S``:
``max_tokens`` chunks per request, ``S`` seconds apart (0: as fast as the socket takes them). Like vLLM 0.32.0, each
chunk carries ``prompt_token_ids`` and ``token_ids``, lists with ``return_token_ids`` (which the gateway asks for)
and null without; ``--ignore-token-ids`` answers as an engine without the field.

``--break-every N`` drops the connection of one stream in N halfway (those that asked for token ids: what a gateway
can continue), as a replica whose node is reclaimed does. A request whose prompt is token ids (the prompt's own and
the tokens generated so far: a continuation, gateway/continuation.py) is answered from the token after them, so the
stream a client gets through the gateway is the one it would have got unbroken.

An idle keep-alive connection is closed after ``--keepalive`` seconds, 5 by default as vLLM's: its uvicorn is started
with ``timeout_keep_alive=VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s unless set (vllm/envs.py). A proxy's connections kept
from one round to the next (more than 5 s apart) are closed before it, as they would be by vLLM.
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
PROMPT_IDS = 5  # the prompt's own ids, in the first chunk


class _Breaks:
    """Which streams to drop: every ``every``-th that asked for token ids (0: none)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.seen = 0

    def after(self, count: int) -> int | None:
        """After how many of its ``count`` chunks the next such stream is dropped; None: not dropped."""
        self.seen += 1
        return count // 2 if self.every and self.seen % self.every == 0 else None


def app(interval_s: float, *, token_ids: bool = True, break_every: int = 0) -> web.Application:
    breaks = _Breaks(break_every)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("prompt")
        start = len(prompt) - PROMPT_IDS if isinstance(prompt, list) else 0  # a continuation's: after its ids
        end = start + int(body.get("max_tokens", 16))
        ids = token_ids and body.get("return_token_ids") is True
        cut = breaks.after(end) if ids and not start else None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(start, end):
            if interval_s:
                await asyncio.sleep(interval_s)
            if index == cut and request.transport is not None:
                request.transport.close()  # the chunked answer ends without its last chunk: a reset
                return response
            await response.write(chunk(index, last=index == end - 1, ids=ids))
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
    parser.add_argument("--break-every", type=int, default=0, help="drop one stream in N that asked for token ids")
    parser.add_argument("--keepalive", type=float, default=5.0, help="seconds an idle connection is kept (vLLM's 5)")
    args = parser.parse_args()
    application = app(args.interval, token_ids=not args.ignore_token_ids, break_every=args.break_every)
    web.run_app(
        application,
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
        keepalive_timeout=args.keepalive,
    )


if __name__ == "__main__":
    main()
