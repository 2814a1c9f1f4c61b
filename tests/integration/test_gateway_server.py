"""The gateway's HTTP/1.1 server on 127.0.0.1, with a handler that streams or answers whole, read from raw sockets:
keep-alive, pipelining, chunked and ``Expect`` bodies, HTTP/1.0, the refusals, the idle timeout, and the stop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import server as server_module
from gateway.request import Request, parse_head
from gateway.server import Connection, Server, serve
from simulate.fakes.processes import free_port

PIECES = 3


@dataclass
class Served:
    server: Server
    port: int
    refused: list[int] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    gone: list[Request] = field(default_factory=list)  # held requests whose client had gone when released


async def handler(served: Served, request: Request, connection: Connection) -> None:
    """/stream: PIECES pieces of the body, each its own write, then ``end;`` with the end; /hold: one piece, then the
    end once released; anything else: the body back, whole."""
    served.requests.append(request)
    if request.path == "/stream":
        connection.begin({"Content-Type": "text/event-stream"})
        for index in range(PIECES):
            connection.send(b"%d:%b;" % (index, request.body))
            await asyncio.sleep(0)
        connection.finish(b"end;")
    elif request.path == "/hold":
        connection.begin({"Content-Type": "text/event-stream"})
        connection.send(b"held;")
        await served.release.wait()
        try:
            connection.send(b"released;")
        except ConnectionResetError:
            served.gone.append(request)
            return
        connection.finish()
    else:
        connection.answer(web.Response(status=200, body=request.body, headers={"Content-Type": "text/plain"}))


@asynccontextmanager
async def running(*, max_body_bytes: int = 1000, body_timeout_s: float = 5.0) -> AsyncIterator[Served]:
    refused: list[int] = []
    served: Served | None = None

    async def handle(request: Request, connection: Connection) -> None:
        assert served is not None
        await handler(served, request, connection)

    server = Server(handle, refused=refused.append, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    ready = asyncio.Event()
    port = free_port()
    task = asyncio.create_task(serve(server, host="127.0.0.1", port=port, ready_flag=ready))
    await ready.wait()
    served = Served(server, port, refused)
    try:
        yield served
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def exchange(port: int, data: bytes, *, timeout_s: float = 5.0) -> bytes:
    """Send ``data``, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


async def holding(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose stream has begun and is held until ``release``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/hold", b""))
    await asyncio.wait_for(reader.readuntil(b"held;"), 5)
    return reader, writer


async def until_closed(server: Server) -> None:
    """Until the server holds no connection (it learns of a close a moment after the client made it)."""
    async with asyncio.timeout(5):
        while server.connections:
            await asyncio.sleep(0.01)


def post(path: str, body: bytes, *, extra: str = "", version: str = "HTTP/1.1") -> bytes:
    head = f"POST {path} {version}\r\nHost: gw\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def dechunk(data: bytes) -> bytes:
    out, at = b"", 0
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end], 16)
        if size == 0:
            return out
        out += data[end + 2 : end + 2 + size]
        at = end + 4 + size


async def test_a_stream_is_sent_chunked_and_the_connection_serves_the_next_request() -> None:
    async with running() as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        for body in (b"a", b"bc"):
            writer.write(post("/stream", body))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"Transfer-Encoding: chunked\r\n" in head
            assert b"Content-Type: text/event-stream\r\n" in head
            chunks = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
            assert dechunk(chunks) == b"".join(b"%d:%b;" % (i, body) for i in range(PIECES)) + b"end;"
        writer.close()
    assert [r.body for r in served.requests] == [b"a", b"bc"]


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with running() as served:
        data = post("/echo", b"one") + post("/echo", b"two") + post("/echo", b"three", extra="Connection: close\r\n")
        got = await exchange(served.port, data)
    answers = got.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert [a.split(b"\r\n\r\n", 1)[1] for a in answers] == [b"one", b"two", b"three"]
    assert b"Connection: close" in answers[2]


async def test_a_chunked_body_and_an_expect_100_continue_are_taken() -> None:
    async with running() as served:
        chunked = b"POST /echo HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        chunked += b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n"
        assert (await exchange(served.port, chunked)).endswith(b"\r\n\r\nabcdefg")

        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hi")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"Content-Length: 2\r\n" in head
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"hi"
        writer.close()


async def test_a_stream_asked_with_connection_close_is_still_chunked_so_a_cut_is_told_from_an_end() -> None:
    async with running() as served:
        got = await exchange(served.port, post("/stream", b"x", extra="Connection: close\r\n"))
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked\r\n" in head
    assert b"Connection: close" in head
    assert dechunk(body) == b"0:x;1:x;2:x;end;"


async def test_a_shedding_server_says_connection_close_and_ends_the_connection_after_each_answer() -> None:
    """A worker past ``--spill-at`` while the next has room (gateway.spill): its keep-alive clients connect again."""
    async with running() as served:
        served.server.shedding = True
        streamed = await exchange(served.port, post("/stream", b"x"))  # read until the server closes
        whole = await exchange(served.port, post("/echo", b"y"))
        served.server.shedding = False
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        for body in (b"a", b"b"):  # kept again
            writer.write(post("/echo", body))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert b"Connection: close" not in head
            assert await asyncio.wait_for(reader.readexactly(1), 5) == body
        writer.close()
    head, _, body = streamed.partition(b"\r\n\r\n")
    assert b"\r\nConnection: close" in head
    assert dechunk(body) == b"0:x;1:x;2:x;end;"
    head, _, body = whole.partition(b"\r\n\r\n")
    assert b"\r\nConnection: close" in head
    assert body == b"y"


async def test_an_http_1_0_stream_is_sent_unframed_and_ends_with_the_connection() -> None:
    async with running() as served:
        got = await exchange(served.port, post("/stream", b"x", version="HTTP/1.0"))
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Connection: close" in head
    assert b"Transfer-Encoding" not in head
    assert body == b"0:x;1:x;2:x;end;"


class _Recorded(asyncio.Transport):
    """A client's transport that keeps each write whole, as the socket is handed it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize(("version", "last_write"), [("HTTP/1.1", b"5\r\nlast;\r\n0\r\n\r\n"), ("HTTP/1.0", b"last;")])
async def test_a_streams_last_piece_and_its_end_go_out_in_one_write(version: str, last_write: bytes) -> None:
    server = Server(handler, refused=lambda _: None, max_body_bytes=10, body_timeout_s=1.0)  # type: ignore[arg-type]
    connection, transport = Connection(server), _Recorded()
    connection.connection_made(transport)
    connection.request, _, _ = parse_head(post("/stream", b"", version=version)[:-4])
    connection.begin({"Content-Type": "text/event-stream"})
    connection.send(b"piece;")
    assert connection.finish(b"last;") is False
    connection.connection_lost(None)
    assert transport.writes[1:] == [b"6\r\npiece;\r\n" if version == "HTTP/1.1" else b"piece;", last_write]


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST /echo HTTP/2.0\r\nHost: gw\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\n bad: folded\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nhi", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: -2\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 1001\r\n\r\n", 413),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3e9\r\n" + b"x" * 1001 + b"\r\n", 413),
        (b"GET / HTTP/1.1\r\nX: " + b"x" * 33_000 + b"\r\n\r\n", 431),
    ],
)
async def test_a_request_that_cannot_be_taken_is_answered_counted_and_its_connection_ends(
    data: bytes, status: int
) -> None:
    async with running() as served:
        got = await exchange(served.port, data)
        await until_closed(served.server)
    assert got.startswith(b"HTTP/1.1 %d " % status)
    assert b"Connection: close\r\n" in got
    assert served.refused == [status]
    assert served.requests == []


async def test_a_body_that_stops_arriving_gets_408_after_the_body_timeout() -> None:
    async with running(body_timeout_s=0.2) as served:
        got = await exchange(served.port, b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert served.refused == [408]


async def test_a_body_in_pieces_within_the_body_timeout_is_served_and_the_timeout_is_over_with_it() -> None:
    async with running(body_timeout_s=1.0) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"POST /echo HTTP/1.1\r\nContent-Length: 4\r\n\r\n")
        for piece in (b"ab", b"c", b"d"):
            await asyncio.sleep(0.1)  # the body in more than one read, within the timeout
            writer.write(piece)
        first = await asyncio.wait_for(reader.readuntil(b"abcd"), 5)
        await asyncio.sleep(1.2)  # past the body timeout: it must not answer a request already served
        writer.write(post("/echo", b"next"))
        second = await asyncio.wait_for(reader.readuntil(b"next"), 5)
        writer.close()
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert second.startswith(b"HTTP/1.1 200 OK\r\n")
    assert served.refused == []


async def test_a_clients_connection_holds_at_most_16_kib_unsent_in_the_kernel() -> None:
    """The bound that lets a client that stopped reading meet the write timeout (server.KERNEL_UNSENT_BYTES), set on
    the listening socket: Linux gives it to every connection accepted there."""
    async with running() as served:
        reader, writer = await holding(served.port)
        (connection,) = served.server.connections
        assert connection.transport is not None
        unsent = connection.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
        served.release.set()
        await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        writer.close()
    assert unsent == server_module.KERNEL_UNSENT_BYTES


async def test_a_head_request_gets_the_headers_without_the_body() -> None:
    async with running() as served:
        got = await exchange(served.port, b"HEAD /echo HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"Content-Length: 0" in head
    assert body == b""


async def test_an_idle_connection_is_closed_after_the_keep_alive_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "KEEPALIVE_S", 0.2)
    async with running() as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(post("/echo", b"ok"))
        got = await asyncio.wait_for(reader.read(), 5)  # answered, then closed once idle
        writer.close()
        assert got.endswith(b"\r\n\r\nok")
        await until_closed(served.server)


async def test_a_client_gone_mid_stream_ends_the_handlers_writes_and_leaves_nothing_held() -> None:
    async with running() as served:
        _, writer = await holding(served.port)
        (connection,) = served.server.connections
        task = connection.task
        assert task is not None
        writer.transport.abort()
        await until_closed(served.server)
        served.release.set()
        await asyncio.wait_for(task, 5)
    assert served.gone == served.requests


async def test_a_stop_closes_idle_connections_at_once_and_gives_streams_their_grace() -> None:
    async with running() as served:
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", served.port)
        idle_writer.write(post("/echo", b"ok"))
        await asyncio.wait_for(idle_reader.readuntil(b"ok"), 5)
        reader, writer = await holding(served.port)
        stopping = asyncio.create_task(served.server.stop(grace_s=5.0))
        assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # the idle one ends at once
        assert not stopping.done()
        served.release.set()  # the stream ends within its grace, whole, and its connection closes
        rest = await asyncio.wait_for(reader.read(), 5)
        await asyncio.wait_for(stopping, 5)
        assert rest.endswith(b"released;\r\n0\r\n\r\n")
        idle_writer.close()
        writer.close()


async def test_a_stream_past_its_grace_is_cut_not_ended_as_whole() -> None:
    async with running() as served:
        reader, writer = await holding(served.port)
        await served.server.stop(grace_s=0.1)
        rest = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert b"0\r\n\r\n" not in rest  # no last chunk: the client sees the stream cut


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(min_size=1, max_size=200), max_size=6))
async def test_any_bytes_from_a_client_get_an_answer_or_a_wait_and_never_break_the_server(
    pieces: list[bytes],
) -> None:
    async with running(body_timeout_s=0.2) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        for piece in pieces:
            writer.write(piece)
        await writer.drain()
        writer.write_eof()
        got = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert got == b"" or got.startswith(b"HTTP/1.1 ")
        # It still serves others.
        answer = await exchange(served.port, post("/echo", b"[]", extra="Connection: close\r\n"))
        assert answer.endswith(b"\r\n\r\n[]")
        await until_closed(served.server)
