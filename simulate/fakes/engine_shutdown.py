"""What the fake vLLM does from SIGTERM on, as vLLM 0.32.0 does it (CPU build, measured: SIGTERM to the API server
with four streams open, two chat and two completions, the frames compared byte for byte).

With the default ``--shutdown-timeout 0`` the listener closes at once (new connections are refused within 0.3 s)
and every open stream of the server ends the same way, one of three (in 7 runs: abort 1, error 1, hang 5):

- ``abort``: a last chunk with ``finish_reason: "abort"`` (the text decoded since the last chunk, often empty),
  then ``data: [DONE]``;
- ``error``: ``data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root
  cause.", "type": "InternalServerError", "param": null, "code": 500}}`` (spaced, unlike the chunks), then
  ``data: [DONE]``;
- ``hang``: no more bytes, no ``[DONE]``, the connection open; the process exits only once the client has gone
  (0.5-1 s later).

With ``--shutdown-timeout N`` the engine goes on: ``/health`` answers 200, a new request gets HTTP 500
``{"error":{"message":"cannot schedule new futures after shutdown","type":"InternalServerError","param":null,
"code":500}}``, a stream that ends within N seconds ends normally, and one that does not hangs at N as above (N = 4:
400-token streams finished at 3.05 s; 1900-token streams sent their last bytes at 4.02 s and hung). A new
completions request whose prompt is token ids (what a gateway's continuation sends) is not refused but answered 200
with nothing generated: streamed, only ``data: [DONE]`` (after a usage chunk of 0 completion tokens when it asked for
usage); whole, one choice with empty text and ``finish_reason: "abort"`` (measured 0.3 s after SIGTERM, N = 6).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import structlog
from aiohttp import web

from simulate.fakes.openai_format import DONE, Job, Output, Stream

log = structlog.get_logger()

ENDINGS = ("abort", "error", "hang")
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# vLLM writes this event with json.dumps' default separators, where its chunks are compact.
_DEAD = {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}}
ERROR_EVENT = b"data: " + json.dumps(_DEAD).encode() + b"\n\n"
REFUSED = {
    "error": {
        "message": "cannot schedule new futures after shutdown",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def refused() -> web.Response:
    """vLLM's answer to a request that arrives while it drains under --shutdown-timeout."""
    return web.json_response(REFUSED, status=500, dumps=lambda body: json.dumps(body, separators=(",", ":")))


async def aborted_at_once(request: web.Request, job: Job, out: Stream) -> web.StreamResponse:
    """vLLM's answer, while it drains under --shutdown-timeout, to a completions request with a token-id prompt."""
    if not job.stream:
        return web.json_response(out.whole([Output("", "abort", None, [])], prompt_ids=job.prompt_ids))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    if job.include_usage:
        await response.write(out.usage(len(job.prompt_ids), 0))
    await response.write(DONE)
    await response.write_eof()
    return response


class Shutdown:
    """The engine's streams and how they end once it is told to stop."""

    def __init__(self, *, ending: str, timeout_s: float) -> None:
        if ending not in ENDINGS:
            raise ValueError(f"no SIGTERM ending {ending!r}: choose from {', '.join(ENDINGS)}")
        self.configured = ending
        self.timeout_s = timeout_s
        self.draining = False  # SIGTERM received: no new request is served
        self.ending: str | None = None  # set: every open stream ends this way at its next token
        self.streams = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def opened(self) -> None:
        self.streams += 1
        self.idle.clear()

    def closed(self) -> None:
        self.streams -= 1
        if self.streams == 0:
            self.idle.set()

    async def run(self, sites: Sequence[web.BaseSite]) -> None:
        """From SIGTERM to the moment the process may exit: returns once no stream is left."""
        self.draining = True
        if self.timeout_s <= 0:
            for site in sites:
                await site.stop()
            self.ending = self.configured
        else:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self.idle.wait()
            except TimeoutError:
                self.ending = "hang"
        await self.idle.wait()


async def client_gone(request: web.Request, *, poll_s: float = 0.05) -> None:
    """Returns once the client has closed the connection: a stream that hangs notices nothing else."""
    while request.transport is not None and not request.transport.is_closing():
        await asyncio.sleep(poll_s)


async def end_stream(
    fault: str, request: web.Request, response: web.StreamResponse, job: Job, out: Stream, *, generated: int
) -> bool:
    """End this stream with ``fault`` after ``generated`` tokens; True when the stream is over. ``abort``,
    ``error`` and ``hang`` are also how vLLM ends its open streams on SIGTERM (see above)."""
    log.info("engine.fault", request=out.id, fault=fault, generated=generated)
    if fault == "drop":  # the TCP connection goes, as when the node or the process vanishes
        if request.transport is not None:
            request.transport.abort()
        return True
    if fault == "abort":  # what vLLM streams for a request it aborted (finish_reason "abort"), then usage, [DONE]
        for index in range(job.n):
            await response.write(out.token("", [], finish="abort", stop=None, prompt_ids=None, index=index))
        if job.include_usage:
            await response.write(out.usage(len(job.prompt_ids), generated))
    elif fault == "error":  # vLLM's streaming error event when its engine core died, then [DONE]
        await response.write(ERROR_EVENT)
    elif fault == "garbage":
        await response.write(b"<html>502 Bad Gateway</html>\r\n\x00\xff\n\n")
    elif fault == "hang":  # no more bytes, the connection open, until the client goes away
        await client_gone(request)
        return True
    else:
        return False
    if fault != "garbage":
        await response.write(DONE)
    await response.write_eof()
    return True
