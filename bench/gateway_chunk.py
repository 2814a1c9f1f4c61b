"""The gateway's Python per relayed chunk, in one process: the relay's read callback (gateway.relay._Events.take),
from a backend's read to the client's write, for a read that is one vLLM token chunk, as it runs now (the chunk read
by its stream's shape, gateway/chunk_shape.py) and with every chunk parsed (``Splicer(shapes=False)``, the path
before the shape). Completions and chat, the gateway hiding the token ids it asked for itself.

CPU time (``time.process_time``) over many reads, the two paths interleaved in rounds, the median kept; the write is
a recorded call (what gateway.server.Connection.send is handed), so system calls are not counted: bench/gateway_peers
measures the whole. Target: the shape's path at most 0.6 times the parse's.

And the backend's reader before it (spotdrain/http1.py, ``Answer.deliver``), fed as asyncio's transport feeds it (the
read's bytes to ``data_received``): a read that is one whole chunk, cut by its size, against the same chunk with a
size extension, which the framing's dechunker takes. Target: at most 0.8 times.

And both together as a worker runs them: 100 streams' reads in turn, each through the reader and the relay, with
4 MiB written between reads (what the backend, the clients and the kernel do to the caches while the worker sleeps
between its wakeups), each read timed alone (``time.perf_counter_ns``), by shape against parsed. A read costs three
to four times as much there as in the loops above: what the path touches (code, objects) counts more than the
operations it runs, and the first figures understate what a worker pays. Target: at most 0.6 times.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

from bench.common import Result, report
from bench.sse_source import chunk
from gateway.backends import Mover
from gateway.relay import ClientStream, _Events
from gateway.splice import Splicer
from spotdrain import http1
from spotdrain.framing import Framing
from spotdrain.http1_delivery import Delivery
from spotdrain.http1_reads import Reads

RATIO_TARGET = 0.6
READER_RATIO_TARGET = 0.8
READS = 20_000
ROUNDS = 5
STREAMS = 100  # in turn, for the reads with the caches cold
COLD_READS = 3_000
CACHE_BYTES = 4 << 20  # written between two such reads
_CHAT_HEAD = b'"object":"chat.completion.chunk"'


class _Written:
    """The client's connection, taking each write (gateway.server.Connection.send's part): a client that reads as
    fast as it is written."""

    def send(self, data: bytes) -> bool:
        return False


def _read(index: int, *, chat: bool) -> bytes:
    """The backend's read for token ``index``: one event, as vLLM writes it (a chat's as its chat chunk)."""
    event = chunk(index, last=False, ids=True, written_ns=10**15 + index)
    if not chat:
        return event
    event = event.replace(b'"object":"text_completion"', _CHAT_HEAD).replace(b',"stop_reason":null', b"")
    return event.replace(b'"text":"', b'"delta":{"content":"').replace(b'","logprobs"', b'"},"logprobs"')


def _relay(*, chat: bool, shapes: bool) -> _Events:
    """One stream's relay, hiding the token ids it asked for, writing to a client that reads as fast as it is
    written."""
    splicer = Splicer(chat=chat, include_usage=False, hide_ids=True, shapes=shapes)
    client = ClientStream(_Written(), write_timeout_s=1.0, on_gap=lambda _: None)  # type: ignore[arg-type]
    return _Events(splicer, client, Mover())


def per_read_us(*, chat: bool, shapes: bool) -> float:
    """CPU microseconds per read, over ``READS`` reads of one stream."""
    events = _relay(chat=chat, shapes=shapes)
    reads = [_read(index, chat=chat) for index in range(READS)]
    started = time.process_time()
    for data in reads:
        events.take(data)
    return (time.process_time() - started) / READS * 1e6


async def reader_us(read: bytes) -> float:
    """CPU microseconds per read of the backend's reader for ``read``, a chunked body's read, over ``READS`` reads."""
    protocol = Reads()
    protocol.blocks.append(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    answer = http1.Answer(protocol, "http://127.0.0.1:1")
    await answer._read_head()
    delivery = asyncio.ensure_future(answer.deliver(lambda data: False))
    await asyncio.sleep(0)
    started = time.process_time()
    for _ in range(READS):
        protocol.data_received(read)
    spent = time.process_time() - started
    delivery.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await delivery
    return spent / READS * 1e6


def cold_per_read_us(*, shapes: bool) -> float:
    """Microseconds per read through the reader and the relay, ``STREAMS`` streams in turn, ``CACHE_BYTES`` written
    between reads."""
    deliveries = []
    for _ in range(STREAMS):
        take = _relay(chat=False, shapes=shapes).take
        delivery = Delivery(Reads(), take, Framing(chunked=True, length=None))
        for index in (0, 1):  # the first chunks, parsed: a shape is learned from them
            delivery.feed(_framed(_read(index, chat=False)))
        deliveries.append(delivery)
    reads = [_framed(_read(index, chat=False)) for index in range(2, COLD_READS // STREAMS + 2)]
    cache = bytearray(CACHE_BYTES)
    zeros = bytes(len(cache[::64]))
    spent = 0
    for read in reads:
        for delivery in deliveries:
            cache[::64] = zeros  # a byte of every cache line
            started = time.perf_counter_ns()
            delivery.feed(read)
            spent += time.perf_counter_ns() - started
    return spent / (len(reads) * STREAMS) / 1000


def _framed(event: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(event), event)


def cold() -> Result:
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(ROUNDS):
        for shapes in (True, False):
            runs[shapes].append(cold_per_read_us(shapes=shapes))
    shape, parse = statistics.median(runs[True]), statistics.median(runs[False])
    detail = (
        f"{shape:.2f} µs a read by shape, {parse:.2f} µs parsed, through the reader and the relay, {STREAMS} streams"
        f" in turn, {CACHE_BYTES >> 20} MiB written between reads; median of {ROUNDS} rounds of {COLD_READS} reads"
    )
    return Result.below("gateway_chunk_cold_ratio", shape / parse, "x", RATIO_TARGET, detail)


async def reader() -> Result:
    event = _read(1, chat=False)
    reads = {"whole": _framed(event), "framing": b"%x;e=1\r\n%b\r\n" % (len(event), event)}
    runs: dict[str, list[float]] = {kind: [] for kind in reads}
    for _ in range(ROUNDS):
        for kind, read in reads.items():
            runs[kind].append(await reader_us(read))
    whole, framing = statistics.median(runs["whole"]), statistics.median(runs["framing"])
    detail = f"{whole:.2f} µs a whole chunk's read, {framing:.2f} through the framing; median of {ROUNDS} rounds"
    return Result.below("gateway_chunk_reader_ratio", whole / framing, "x", READER_RATIO_TARGET, detail)


async def measure() -> list[Result]:
    out = [await reader(), cold()]
    for chat in (False, True):
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ROUNDS):
            for shapes in (True, False):
                runs[shapes].append(per_read_us(chat=chat, shapes=shapes))
        shape, parse = statistics.median(runs[True]), statistics.median(runs[False])
        kind = "chat" if chat else "completions"
        detail = f"{shape:.2f} µs a read by shape, {parse:.2f} µs parsed; median of {ROUNDS} rounds of {READS} reads"
        out.append(Result.below(f"gateway_chunk_{kind}_ratio", shape / parse, "x", RATIO_TARGET, detail))
    return out


if __name__ == "__main__":
    report(asyncio.run(measure()))
