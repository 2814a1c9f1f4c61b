"""The load generator: a fixed number of concurrent streams through the router, each of its own length.

Each slot opens a stream, reads it to its end, and opens the next, until the router refuses one (503: no pod in
rotation, where a real Service would send the request to another node); then the slot stops. The slots' first
streams open one after another, each once the one before has its answer's head, so that the router spreads them
over the pods in slot order (which the scenarios' stream lengths count on) however the requests would otherwise
race. Every stream is recorded: completed (every token and ``[DONE]``), cut (ended early), or refused. With
``chats`` the streams are chats of a thinking model (simulate/chats.py), and one is completed only where it
assembles to the message of its uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
import structlog

from simulate.chats import Chats, assemble, differences
from simulate.router import POD_HEADER, REQUEST_HEADER
from simulate.timeline import Outcome, Recorder, StreamRecord

log = structlog.get_logger()

Length = Callable[[int], float]  # slot -> seconds the next stream of that slot lasts
Hops = Mapping[str, Sequence[tuple[float, str]]]  # the router's record: request name -> (when, pod) per routing


class Load:
    def __init__(
        self,
        url: str,
        recorder: Recorder,
        *,
        slots: int,
        length_s: Length,
        tokens_per_s: float,
        hops: Hops,
        chats: Chats | None = None,
    ) -> None:
        self.url = url
        self.chats = chats
        self.hops = hops
        self.recorder = recorder
        self.slots = slots
        self.length_s = length_s
        self.tokens_per_s = tokens_per_s
        # Streams are numbered as they are routed, refused requests apart: a refusal is no stream that failed.
        self._stream_ids = itertools.count(1)
        self._refusal_ids = itertools.count(1)
        self._names = itertools.count(1)
        self.stopping = asyncio.Event()  # set: no slot opens another stream; the open ones run to their end

    async def run(self) -> None:
        """Runs every slot; returns once each has been refused or, after ``stopping``, has seen its last stream end
        (or raises CancelledError when cancelled)."""
        # A connection per stream: after a stream is cut the router closes its connection, which the client, having
        # read a complete chunked answer, would otherwise reuse for its next request and see fail before any answer.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, asyncio.TaskGroup() as group:
            opened = [asyncio.Event() for _ in range(self.slots)]
            for slot in range(self.slots):
                after = opened[slot - 1] if slot else None
                group.create_task(self._slot(session, slot, after, opened[slot]), name=f"load-slot-{slot}")

    async def _slot(
        self, session: aiohttp.ClientSession, slot: int, after: asyncio.Event | None, opened: asyncio.Event
    ) -> None:
        """The slot's streams; its first once ``after`` is set (the slot before it has its head), setting ``opened``
        once it has its own."""
        if after is not None:
            await after.wait()
        try:
            record = await self._one(session, slot, opened)
        finally:
            opened.set()
        while True:
            self.recorder.stream(record)
            if record.outcome is Outcome.REFUSED or self.stopping.is_set():
                return
            record = await self._one(session, slot)

    async def _one(
        self, session: aiohttp.ClientSession, slot: int, opened: asyncio.Event | None = None
    ) -> StreamRecord:
        wanted = max(1, round(self.length_s(slot) * self.tokens_per_s))
        started = self.recorder.now()
        stream_id = 0
        pod: str | None = None
        received = 0
        done = False
        finish: str | None = None
        # Token ids count the tokens: chunks do not, since vLLM merges a character's bytes into one chunk.
        body: dict[str, object] = {"prompt": f"slot {slot}", "max_tokens": wanted, "stream": True}
        body["return_token_ids"] = True
        name = str(next(self._names))
        path, lines = "/v1/completions", []
        if self.chats is not None:
            wanted = self.chats.max_tokens(wanted)
            path, body = "/v1/chat/completions", self.chats.body(slot=slot, name=name, max_tokens=wanted)
        try:
            async with session.post(f"{self.url}{path}", json=body, headers={REQUEST_HEADER: name}) as response:
                if opened is not None:
                    opened.set()
                if response.status != 200:  # 503 from the router: no pod in rotation
                    refusal = next(self._refusal_ids)
                    return StreamRecord(refusal, slot, None, started, self.recorder.now(), wanted, 0, Outcome.REFUSED)
                stream_id = next(self._stream_ids)
                pod = response.headers.get(POD_HEADER)
                async for raw in response.content:
                    lines.append(raw)
                    line = parse_line(raw)
                    received += line.tokens
                    done = done or line.done
                    finish = line.finish or finish
        except (aiohttp.ClientError, ConnectionResetError) as error:
            # The stream broke off: whatever arrived is all there is.
            log.info("load.stream_broke", slot=slot, pod=pod, received=received, error=repr(error))
        if self.chats is not None:
            received, finish, differs = self._judged(lines, body, slot=slot)
            done = done and not differs
        # A stream that ends in a stop (vLLM's end-of-sequence token, or a tool call's) is whole however long it was.
        whole = done and (finish in ("stop", "tool_calls") or (finish == "length" and received == wanted))
        outcome = Outcome.COMPLETED if whole else Outcome.CUT
        stream_id = stream_id or next(self._stream_ids)  # it broke off before any answer: a stream cut, as before
        # Through the gateway a continued stream is routed again, under the same name: where it moved, and when.
        routed = list(self.hops.get(name, ()))
        moves = tuple((at, to) for (_, before), (at, to) in itertools.pairwise(routed) if to != before)
        ended = self.recorder.now()
        return StreamRecord(stream_id, slot, pod, started, ended, wanted, received, outcome, moves=moves)

    def _judged(self, lines: list[bytes], body: dict[str, object], *, slot: int) -> tuple[int, str | None, bool]:
        """A chat's tokens and finish reason, and whether its message differs from the uninterrupted one's."""
        assert self.chats is not None
        assembly = assemble(lines)
        got, want = assembly.message(), self.chats.expected(body)
        if got != want and assembly.finish_reason is not None:
            log.warning("load.chat_differs", slot=slot, parts=differences(got, want))
        return assembly.tokens, assembly.finish_reason, got != want


@dataclass(frozen=True)
class Line:
    tokens: int = 0
    done: bool = False  # the final ``[DONE]``
    finish: str | None = None


def parse_line(raw: bytes) -> Line:
    """One line of a server-sent event stream: the tokens it carries (its token ids, else one per choice), its
    finish reason, and whether it is the final ``[DONE]``."""
    line = raw.decode(errors="replace").strip()
    if not line.startswith("data: "):
        return Line()
    data = line.removeprefix("data: ")
    if data == "[DONE]":
        return Line(done=True)
    try:
        choice = json.loads(data)["choices"][0]
        ids, finish = choice.get("token_ids"), choice.get("finish_reason")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return Line()
    tokens = len(ids) if isinstance(ids, list) else 1
    return Line(tokens, finish=finish if isinstance(finish, str) else None)


PACE_TOKENS = 16


class Unpaced(Exception):
    """A pacing stream that did not end with tokens and its ``[DONE]``: its rate would say nothing."""


async def pace(urls: Sequence[str], *, streams: int, timeout_s: float = 120.0) -> float:
    """The tokens per second each of ``streams`` concurrent streams gets from engines that pace themselves (real
    vLLM), the streams spread over ``urls``: the slowest stream's rate, its first token's wait included. Raises
    Unpaced, aiohttp.ClientError or TimeoutError where a stream cannot be measured."""
    loop = asyncio.get_running_loop()
    body = {"prompt": "pace", "max_tokens": PACE_TOKENS, "stream": True, "return_token_ids": True, "ignore_eos": True}

    async def one(session: aiohttp.ClientSession, url: str) -> float:
        started = loop.time()
        received, done = 0, False
        async with session.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = parse_line(raw)
                received, done = received + line.tokens, done or line.done
        if not received or not done:
            raise Unpaced(f"{url}: {received} tokens" + ("" if done else " and no [DONE]"))
        return received / max(loop.time() - started, 1e-3)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        rates = await asyncio.gather(*(one(session, urls[i % len(urls)]) for i in range(streams)))
    return min(rates)
