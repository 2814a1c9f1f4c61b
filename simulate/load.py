"""The load generator: a fixed number of concurrent streams through the router, each of its own length.

Each slot opens a stream, reads it to its end, and opens the next, until the router refuses one (503: no pod in
rotation, where a real Service would send the request to another node); then the slot stops. Every stream is
recorded: completed (every token and ``[DONE]``), cut (ended early), or refused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Mapping, Sequence

import aiohttp
import structlog

from simulate.router import POD_HEADER, REQUEST_HEADER
from simulate.timeline import Outcome, Recorder, StreamRecord

log = structlog.get_logger()

Length = Callable[[int], float]  # slot -> seconds the next stream of that slot lasts
Hops = Mapping[str, Sequence[tuple[float, str]]]  # the router's record: request name -> (when, pod) per routing


class Load:
    def __init__(
        self, url: str, recorder: Recorder, *, slots: int, length_s: Length, tokens_per_s: float, hops: Hops
    ) -> None:
        self.url = url
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
            for slot in range(self.slots):
                group.create_task(self._slot(session, slot), name=f"load-slot-{slot}")

    async def _slot(self, session: aiohttp.ClientSession, slot: int) -> None:
        while not self.stopping.is_set():
            record = await self._one(session, slot)
            self.recorder.stream(record)
            if record.outcome is Outcome.REFUSED:
                return

    async def _one(self, session: aiohttp.ClientSession, slot: int) -> StreamRecord:
        wanted = max(1, round(self.length_s(slot) * self.tokens_per_s))
        started = self.recorder.now()
        stream_id = 0
        pod: str | None = None
        received = 0
        done = False
        body = {"prompt": f"slot {slot}", "max_tokens": wanted, "stream": True}
        name = str(next(self._names))
        try:
            async with session.post(
                f"{self.url}/v1/completions", json=body, headers={REQUEST_HEADER: name}
            ) as response:
                if response.status != 200:  # 503 from the router: no pod in rotation
                    refusal = next(self._refusal_ids)
                    return StreamRecord(refusal, slot, None, started, self.recorder.now(), wanted, 0, Outcome.REFUSED)
                stream_id = next(self._stream_ids)
                pod = response.headers.get(POD_HEADER)
                async for raw in response.content:
                    token, finished = parse_line(raw)
                    received += token
                    done = done or finished
        except (aiohttp.ClientError, ConnectionResetError) as error:
            # The stream broke off: whatever arrived is all there is.
            log.info("load.stream_broke", slot=slot, pod=pod, received=received, error=repr(error))
        outcome = Outcome.COMPLETED if done and received == wanted else Outcome.CUT
        stream_id = stream_id or next(self._stream_ids)  # it broke off before any answer: a stream cut, as before
        # Through the gateway a continued stream is routed again, under the same name: where it moved, and when.
        routed = list(self.hops.get(name, ()))
        moves = tuple((at, to) for (_, before), (at, to) in itertools.pairwise(routed) if to != before)
        ended = self.recorder.now()
        return StreamRecord(stream_id, slot, pod, started, ended, wanted, received, outcome, moves=moves)


def parse_line(raw: bytes) -> tuple[int, bool]:
    """One line of a server-sent event stream: (tokens it carries, whether it is the final ``[DONE]``)."""
    line = raw.decode(errors="replace").strip()
    if not line.startswith("data: "):
        return 0, False
    data = line.removeprefix("data: ")
    if data == "[DONE]":
        return 0, True
    try:
        choices = json.loads(data)["choices"]
    except (ValueError, KeyError, TypeError):
        return 0, False
    return (1, False) if choices else (0, False)
