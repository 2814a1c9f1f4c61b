"""One client stream from start to end: backends in turn, continuations between them, one outcome counted.

The loop ends when the splicer says the stream is whole, when the client leaves, or when a broken stream cannot
continue (a rule in ``continuation.refusal``, the migration limit, no ready backend): then the client gets an
OpenAI-style error event and ``[DONE]`` at once. Each turn is bounded by the relay's timeouts, and there are at most
``limit + 1`` turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from gateway.backends import Backend, Mover, Pool, context_length
from gateway.continuation import by_ids, continuation, refusal, refusal_at_start, remaining_tokens
from gateway.ends import Broken, End, Finished, error_event
from gateway.metrics import GatewayMetrics
from gateway.parsed import Replayed, chat_parsers, supported
from gateway.relay import ClientGone, ClientStream, Rejected, forwarded_lines, relay
from gateway.request import Request
from gateway.server import Connection
from gateway.settings import GatewaySettings
from gateway.splice import Splicer
from gateway.token_ids import FIELD, asked, refuses_ids, with_ids
from gateway.vocabulary import generated, markers

log = structlog.get_logger()

# Before re-sending to a backend that already failed the request (the only one ready, e.g. one Service URL whose
# endpoints still hold a dead pod for a moment), by continuation; the last pause repeats. A backend that turns ready
# meanwhile ends the pause.
RETRY_PAUSES_S = (0.1, 0.3, 0.6, 1.0)
# How long a broken stream waits for a ready backend when none is, before it is cut.
NO_BACKEND_WAIT_S = 2.0


@dataclass(frozen=True)
class Gateway:
    """What every handler shares."""

    settings: GatewaySettings
    pool: Pool
    session: aiohttp.ClientSession
    metrics: GatewayMetrics


def no_backend_answer(message: str, *, status: int = 503) -> web.Response:
    kind = "ServiceUnavailableError" if status == 503 else "GatewayTimeoutError"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


async def stream(
    gateway: Gateway, request: Request, connection: Connection, *, body: dict[str, Any], chat: bool
) -> web.Response | None:
    """Serve one streamed request: a whole answer to send where the stream did not start, else None (the stream
    was sent, or the client has gone). The outcome is counted once, whatever ends it."""
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    splicer = Splicer(chat=chat, include_usage=include_usage)
    run = _Run(gateway, request, connection, body=body, chat=chat, splicer=splicer)
    gateway.metrics.open_streams.inc()
    try:
        response, outcome = await run.serve(request.body)
    except ClientGone:
        response, outcome = None, "abandoned"
    finally:
        gateway.metrics.open_streams.dec()
    gateway.metrics.counted(outcome)
    return response


@dataclass(frozen=True)
class _Request:
    path: str
    raw: bytes
    headers: bytes  # header lines (relay.forwarded_lines)
    method: str  # a continuation's (one of METHODS), or "" for the client's own request
    asks_ids: bool  # return_token_ids is in it


class _Run:
    def __init__(
        self,
        gateway: Gateway,
        request: Request,
        connection: Connection,
        *,
        body: dict[str, Any],
        chat: bool,
        splicer: Splicer,
    ) -> None:
        self.gateway = gateway
        self.request = request  # its header lines are passed on to each backend
        self.path = request.path
        self.body = body
        self.chat = chat
        self.splicer = splicer
        self.client = ClientStream(
            connection, write_timeout_s=gateway.settings.timeouts.read_s, on_gap=gateway.metrics.splice_gap.observe
        )
        self.continuations = 0
        self.asked = asked(body)  # the client wants token ids; else the gateway asks for them and hides them
        self.wants_ids = refusal_at_start(body, chat=chat) is None  # only a stream that may continue needs them
        splicer.hide_ids = not self.asked
        top = body.get("top_logprobs")
        splicer.top_logprobs = top if isinstance(top, int) and not isinstance(top, bool) else 0
        self.broken: tuple[str, Broken] | None = None  # the backend that failed last, and how
        self.restart = False  # the break came before any generated token: the request starts over

    async def serve(self, original: bytes) -> tuple[web.Response | None, str]:
        avoid: set[str] = set()
        comment = b""
        pool = self.gateway.pool
        while True:
            backend = pool.pick(avoid=avoid)
            if self.broken is not None and (backend is None or backend.url in avoid):
                # None ready, or only those that failed this request: wait for another, or give one time to recover
                pause = RETRY_PAUSES_S[min(self.continuations, len(RETRY_PAUSES_S) - 1)]
                if await pool.fresh(avoid, within_s=NO_BACKEND_WAIT_S if backend is None else pause) or not backend:
                    backend = pool.pick(avoid=avoid)
            if backend is None:
                return await self._cut("no_backend", self.broken)
            request = await self._request(backend, original)
            if request is None:
                return await self._cut("reasoning" if self.splicer.reasoning else "tool_call", self.broken)
            if self.broken is not None:
                self._continued(*self.broken, to=backend.url, method=request.method)
            end = await self._send(backend, request, comment)
            if isinstance(end, Rejected) and request.asks_ids and refuses_ids(end.status, end.body):
                backend.token_ids = False  # it does not take the field: ask it without, now and from now on
                log.info("backend.no_token_ids", backend=backend.url, status=end.status)
                again = await self._request(backend, original)
                if again is None:
                    return await self._cut("reasoning" if self.splicer.reasoning else "tool_call", self.broken)
                end = await self._send(backend, again, comment)
            if isinstance(end, Rejected):
                if not self.client.started:
                    return web.Response(status=end.status, body=end.body, headers=end.headers), "rejected"
                end = Broken("server_error", f"HTTP {end.status} for a continuation")
            if isinstance(end, Finished) or self.splicer.finished:
                return await self._finish()
            self.gateway.pool.failed(backend, end.cause)
            avoid.add(backend.url)
            self.broken = (backend.url, end)
            if (ended := await self._end_after_break(self.broken)) is not None:
                return ended
            self.splicer.next_segment()
            self.restart = not self.splicer.continuing
            comment = b""
            if self.gateway.settings.migration.mark_splices and self.client.started:
                comment = b": spotdrain: continued after " + end.cause.encode() + b"\n\n"

    async def _send(self, backend: Backend, request: _Request, comment: bytes) -> End | Rejected:
        read_s = self.gateway.settings.timeouts.read_s
        mover = Mover(silence_s=read_s, loop=self.client.connection.loop)
        with self.gateway.pool.hold(backend, mover):
            end = await relay(
                backend,
                path=request.path,
                body=request.raw,
                headers=request.headers,
                splicer=self.splicer,
                client=self.client,
                timeouts=self.gateway.settings.timeouts,
                mover=mover,
                comment=comment,
            )
        if mover.moved and isinstance(end, Broken):
            details = {"proactive": "its node's termination time is near", "timeout": f"no byte for {read_s} s"}
            end = Broken(mover.cause, details.get(mover.cause, "silent, going away"))
        return end

    async def _request(self, backend: Backend, original: bytes) -> _Request | None:
        """What to send ``backend``: the client's request (asking for token ids where it did not and the backend
        takes them), or the continuation of what the client has; None where a parsed chat cannot go on there."""
        if self.broken is None or self.restart:
            self.splicer.source_chat = None
            method = "restart" if self.broken is not None else ""
            headers = forwarded_lines(self.request.head)
            if self.asked or not self.wants_ids or not backend.token_ids:
                return _Request(self.path, original, headers, method, asks_ids=False)
            return _Request(self.path, with_ids(self.body, original), headers, method, asks_ids=True)
        context_len = None
        if self.chat and remaining_tokens(self.body, self.splicer, chat=True) is None:
            timeout_s = self.gateway.settings.timeouts.connect_s
            context_len = await context_length(
                self.gateway.session, backend, model=self.body.get("model"), timeout_s=timeout_s
            )
        parsers = self.gateway.settings.parsers
        if self.chat and supported(parsers) and by_ids(self.body, self.splicer, chat=True):
            self.splicer.replayed = await self._replayed(backend)
            if self.splicer.replayed is None:
                return None
        plan = continuation(
            self.body, self.splicer, chat=self.chat, path=self.path, context_len=context_len, parsers=parsers
        )
        if self.splicer.replayed is not None and plan.method != "token_ids":
            return None  # a parsed chat continues by its ids or not at all
        if plan.method == "token_ids":
            self.splicer.rewind()
        self.splicer.source_chat = plan.chat
        body = plan.body
        body.pop(FIELD, None)
        if backend.token_ids and (self.asked or plan.method == "token_ids"):
            body[FIELD] = True
        headers = forwarded_lines(self.request.head, content_type=b"application/json")
        return _Request(plan.path, json.dumps(body).encode(), headers, plan.method, asks_ids=FIELD in body)

    async def _replayed(self, backend: Backend) -> Replayed | None:
        """The parsers' replay of a chat, fed what it generated up to the last whole character (vLLM's /detokenize on
        ``backend``), where its continuation then starts; None where ``backend`` cannot say."""
        splicer, parsers = self.splicer, self.gateway.settings.parsers
        assert splicer.token_ids is not None
        assert splicer.prompt_token_ids is not None
        session, model, timeout_s = (
            self.gateway.session,
            self.body.get("model"),
            self.gateway.settings.timeouts.connect_s,
        )
        ids = splicer.token_ids[: splicer.tokens]
        piece = await generated(session, backend.url, ids, model=model, timeout_s=timeout_s)
        marks = None
        if parsers.reasoning is not None:
            qwen3 = parsers.reasoning == "qwen3"
            marks = await markers(session, backend.url, model=model, timeout_s=timeout_s, turns=qwen3)
        if piece is None or (parsers.reasoning is not None and marks is None):
            log.warning("gateway.no_replay", backend=backend.url, reasoning_parser=parsers.reasoning)
            return None
        splicer.resume_ids, splicer.resume_text = len(piece.ids), len(splicer.text)
        return Replayed.after(chat_parsers(self.body, parsers, marks), splicer.prompt_token_ids, piece)

    async def _end_after_break(self, broken: tuple[str, Broken]) -> tuple[web.Response | None, str] | None:
        """How the stream ends now that its backend broke, or None when it may continue."""
        self.client.broke()
        left = remaining_tokens(self.body, self.splicer, chat=self.chat)
        if left is not None and left <= 0 and self.client.started:
            await self.client.write(self.splicer.finish_chunk("length"))  # every token was sent already
            return await self._finish()
        reason = self._refusal()
        return None if reason is None else await self._cut(reason, broken)

    def _refusal(self) -> str | None:
        if self.continuations >= self.gateway.settings.migration.limit:
            return "limit"
        if self.splicer.shown == 0 and not self.splicer.multiple_choices:
            return None  # nothing generated reached the client: any request may start over
        max_tokens = self.gateway.settings.migration.max_tokens
        parsers = self.gateway.settings.parsers
        return refusal(self.body, self.splicer, chat=self.chat, max_tokens=max_tokens, parsers=parsers)

    def _continued(self, backend: str, end: Broken, *, to: str, method: str) -> None:
        """Count and log one continuation: one line each, with where the stream was and where it goes."""
        self.continuations += 1
        self.gateway.metrics.continuations.labels(cause=end.cause).inc()
        self.gateway.metrics.continuation_methods.labels(method=method).inc()
        log.info(
            "gateway.continued",
            request=(self.splicer.identity or {}).get("id"),
            backend=backend,
            to=to,
            cause=end.cause,
            detail=end.detail,
            method=method,
            tokens_sent=self.splicer.shown,
            continuation=self.continuations,
        )

    async def _finish(self) -> tuple[None, str]:
        await self.client.end(self.splicer.tail())
        return None, "continued" if self.continuations else "completed"

    async def _cut(self, reason: str, broken: tuple[str, Broken] | None) -> tuple[web.Response | None, str]:
        self.gateway.metrics.cuts.labels(reason=reason).inc()
        backend, end = broken if broken is not None else (None, None)
        log.warning(
            "gateway.cut",
            request=(self.splicer.identity or {}).get("id"),
            backend=backend,
            cause=end.cause if end else None,
            reason=reason,
            tokens_sent=self.splicer.tokens,
        )
        message = f"the stream's backend failed and it cannot continue elsewhere ({reason})"
        if not self.client.started:
            return no_backend_answer(message), "cut"
        await self.client.end(error_event(message) + b"data: [DONE]\n\n")
        return None, "cut"
