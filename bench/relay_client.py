"""A load generator in a process of its own: streams to one URL, every event checked byte for byte, latencies out.

``python -m bench.relay_client SPEC``, SPEC being JSON ``{"url": ..., "count": N, "body": {...}, "spread_s": S}``:
``count`` streams, their starts spread evenly over ``spread_s``, each on a connection of its own (``read_timeout_s``, 60
unless given: the silence after which a stream is a fault). Each event must be
exactly the bytes bench/sse_source.py wrote for that token (the proxy's client asked for no token ids, so it gets them
as ``null``), ``max_tokens`` of them, then one ``data: [DONE]`` and nothing else but comment lines (the gateway marks
where it continued a stream with one; an SSE client skips them, as this one does). Prints one JSON object:
``latencies_ms`` (from the time written in each event to the read that brought it here), ``streams``, ``exact``
(streams that were) and ``faults`` (the first few that were not, said how).

The client must take each event as it comes: one process reads 250 streams, one event after another, so an event
that costs it 100 µs (aiohttp's client: a coroutine and a ``readline`` an event) keeps the ones that came with it
waiting, and its latencies are its own queue more than the proxy's. It shares two cores with the backend and the
proxy, too. So each stream is a protocol on the gateway's loop (uvloop where installed), its answer read in the
read's own callback with no coroutine per event: the head, the chunked framing (RFC 9112 section 7.1), a body of a
stated length or one that ends with its connection, and the events' lines compared as bytes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from bench.sse_source import chunk
from gateway.main import loop_factory
from spotdrain.framing import BadAnswer, Framing

_TEXT = b'"text":" '
_DONE = b"data: [DONE]"
FAULTS_KEPT = 5
READ_TIMEOUT_S = 60.0  # silence before a stream counts as hung
CONNECT_TIMEOUT_S = 30.0
TOTAL_TIMEOUT_S = 300.0


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    streams: int = 0
    exact: int = 0
    faults: list[str] = field(default_factory=list)

    def fault(self, what: str) -> None:
        if len(self.faults) < FAULTS_KEPT:
            self.faults.append(what)


def _written_ns(line: bytes) -> int | None:
    start = line.find(_TEXT)
    end = line.find(b'"', start + len(_TEXT)) if start >= 0 else -1
    try:
        return int(line[start + len(_TEXT) : end]) if end > 0 else None
    except ValueError:
        return None


class _Stream(asyncio.Protocol):
    """One request and its answer, checked as it is read; ``ended`` is set with a fault ("" where exact)."""

    def __init__(self, request: bytes, tokens: int, tally: Tally) -> None:
        self.request = request
        self.tokens = tokens
        self.tally = tally
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.head: bytes | None = None  # the answer's head, once read
        self.framing = Framing(chunked=False, length=None)  # the body's, once the head is read
        self.raw = b""  # bytes of the head, until it is whole
        self.text = b""  # unframed bytes not yet a whole line
        self.index = self.dones = 0
        self.fault = ""
        self.heard = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now_ns = time.monotonic_ns()
        self.heard = now_ns / 1e9
        if self.head is None:
            self.raw += data
            if not self._read_head():
                return
            data, self.raw = self.raw, b""
        try:
            body = self.framing.unframe(data)
        except BadAnswer as error:
            self.abort(str(error))
            return
        self._lines(body, now_ns)
        if self.framing.done:  # its last chunk, or a body of a stated length whole: the stream has ended
            self._lines(b"\n", now_ns)  # the last line, where it had no line break
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head is None or self.framing.cut() is not None:  # a body the connection's close does not end
            self._end(f"connection ended: {exc or 'closed'}")
        else:
            self._lines(b"\n", time.monotonic_ns())  # the last line, where it had no line break
            self._end(self._verdict())

    def abort(self, why: str) -> None:
        self._end(why)
        if self.transport is not None:
            self.transport.abort()

    def _read_head(self) -> bool:
        end = self.raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        self.head, self.raw = self.raw[:end], self.raw[end + 4 :]
        status_line, *fields = self.head.split(b"\r\n")
        if status_line.split(b" ")[1:2] != [b"200"]:
            self.abort(f"{status_line.decode('latin-1')}: {self.raw[:120]!r}")
            return False
        values = {name.strip().lower(): value.strip() for name, _, value in (f.partition(b":") for f in fields)}
        length = values.get(b"content-length", b"")
        chunked = values.get(b"transfer-encoding", b"").lower() == b"chunked"
        self.framing = Framing(chunked=chunked, length=int(length) if length.isdigit() else None)
        return True

    def _lines(self, data: bytes, now_ns: int) -> None:
        lines = (self.text + data).split(b"\n")
        self.text = lines.pop()
        for line in lines:
            if not line or line == b"\r" or line.startswith(b":"):
                continue
            if line == _DONE:
                self.dones += 1
                continue
            index = self.index
            written = _written_ns(line)
            expected = chunk(index, last=index == self.tokens - 1, ids=False, written_ns=written or 0)
            if written is None or self.dones or line + b"\n\n" != expected:
                self.fault = self.fault or f"event {index}: {line[:160]!r}"
            else:
                self.tally.latencies_ms.append((now_ns - written) / 1e6)
            self.index += 1

    def _verdict(self) -> str:
        if self.index != self.tokens or self.dones != 1:
            return self.fault or f"{self.index} events of {self.tokens}, {self.dones} [DONE]"
        return self.fault

    def _finish(self) -> None:
        """The answer has ended before its connection: say how it went, and close the connection."""
        self._end(self._verdict())
        if self.transport is not None:
            self.transport.close()

    def _end(self, fault: str) -> None:
        if not self.ended.done():
            self.ended.set_result(fault)


async def one_stream(url: str, body: dict[str, Any], tally: Tally, open_streams: set[_Stream]) -> None:
    """Read one stream to its end; its latencies go into ``tally``, and whether it was exact."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    request = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        (parts.path or "/").encode(),
        parts.netloc.encode(),
        len(payload),
        payload,
    )
    stream = _Stream(request, int(body["max_tokens"]), tally)
    loop = asyncio.get_running_loop()
    tally.streams += 1
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await loop.create_connection(lambda: stream, parts.hostname or "127.0.0.1", parts.port or 80)
    except (OSError, TimeoutError) as error:
        tally.fault(f"{type(error).__name__}: {error}")
        return
    open_streams.add(stream)
    try:
        fault = await stream.ended
    finally:
        open_streams.discard(stream)
    if fault:
        tally.fault(fault)
    else:
        tally.exact += 1


async def _watch(open_streams: set[_Stream], read_timeout_s: float) -> None:
    """End the streams silent for ``read_timeout_s`` (one timer for all, not one re-armed at every read)."""
    while True:
        await asyncio.sleep(min(1.0, read_timeout_s / 4))
        for stream in [s for s in open_streams if time.monotonic() - s.heard > read_timeout_s]:
            stream.abort(f"no byte for {read_timeout_s:g} s after event {stream.index}")


async def run(
    url: str, count: int, body: dict[str, Any], *, spread_s: float, read_timeout_s: float = READ_TIMEOUT_S
) -> Tally:
    tally = Tally()
    open_streams: set[_Stream] = set()

    async def started(index: int) -> None:
        await asyncio.sleep(spread_s * index / count)
        await one_stream(url, {**body, "stream": True}, tally, open_streams)

    watch = asyncio.ensure_future(_watch(open_streams, read_timeout_s))
    try:
        async with asyncio.timeout(TOTAL_TIMEOUT_S):
            await asyncio.gather(*(started(index) for index in range(count)))
    except TimeoutError:
        for stream in list(open_streams):
            stream.abort(f"not ended within {TOTAL_TIMEOUT_S:.0f} s")
        tally.fault(f"the run did not end within {TOTAL_TIMEOUT_S:.0f} s")
    finally:
        watch.cancel()
    return tally


def main() -> None:
    spec = json.loads(sys.argv[1])
    url, count, body, spread_s = spec["url"], int(spec["count"]), spec["body"], float(spec["spread_s"])
    timeout = float(spec.get("read_timeout_s", READ_TIMEOUT_S))
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        tally = runner.run(run(url, count, body, spread_s=spread_s, read_timeout_s=timeout))
    json.dump(tally.__dict__, sys.stdout)


if __name__ == "__main__":
    main()
