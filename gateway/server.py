"""The gateway's HTTP/1.1 server, its own rather than aiohttp's: an open stream is most of what the gateway holds.

Measured with tracemalloc (one worker, 500 open streams), aiohttp's server held about 9 KB of each: the parsed
request (its headers as bytes and again as str, a URL), an HTTP parser, two empty deques (760 bytes each), a task
running the connection's loop with the handler's frames under it, a keep-alive timer, and a response with its own
headers and writer. Here an open stream holds its connection's protocol, the request's head as one bytes object
(headers are parsed from it again where they are read), its body, and the task that serves it.

It takes what the OpenAI clients and the health checks send: HTTP/1.1 and 1.0, keep-alive, a body by
``Content-Length`` or chunked, ``Expect: 100-continue``. It answers a stream chunked (HTTP/1.0: until the close), a
whole answer with its length. A request it cannot read is answered 400 (431 for a head over 32 KB, 413 for a body
over the limit, 408 for a body not whole within the read timeout, 501 for a transfer coding other than chunked), and
the connection ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol, cast

import structlog
from aiohttp import web

from gateway.request import BadRequest, Request, parse_head
from spotdrain.framing import BadAnswer, Dechunker

log = structlog.get_logger()

MAX_HEAD_BYTES = 32 * 1024  # request line and headers; more is a 431
KEEPALIVE_S = 75.0  # how long an idle connection is kept (aiohttp's server keeps one as long)
SHUTDOWN_S = 60.0  # how long requests in flight are given when the server stops (as aiohttp's runner gives them)
HELD_MAX_BYTES = 64 * 1024  # a client's next request read while one is served, before its socket is read no more
# What the kernel may hold of a client's stream that it has not sent yet. Without a bound, Linux grows a socket's
# send buffer to tcp_wmem's maximum (4 MB) for a client that stopped reading, so the write timeout starts only once
# that is full: minutes of a backend's tokens, at streaming rates. Bytes in flight are not counted, so a client far
# away still gets its full window (TCP_NOTSENT_LOWAT, Linux 3.12).
KERNEL_UNSENT_BYTES = 16 * 1024


Handler = Callable[["Request", "Connection"], Awaitable[None]]
Listen = Callable[[socket.socket], Awaitable[asyncio.AbstractServer]]


class Turns(Protocol):
    """How a worker takes connections in turn with the others, on the socket they share (gateway.spill.Turn)."""

    async def run(self, listen: Listen, server: Server) -> None: ...


class Server:
    """What every connection shares: the handler, the limits, and the open connections (to stop them)."""

    def __init__(
        self, handler: Handler, *, refused: Callable[[int], None], max_body_bytes: int, body_timeout_s: float
    ) -> None:
        self.handler = handler
        self.refused = refused  # told the status of each request answered without the handler
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.connections: set[Connection] = set()
        self.stopping = False
        self.shedding = False  # each answer ends its connection, for the client to connect again (gateway.spill)
        self._date = (0, "")

    def date(self) -> str:
        """The Date header's value, made once a second."""
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True))
        return self._date[1]

    async def stop(self, *, grace_s: float = SHUTDOWN_S) -> None:
        """Close idle connections, give requests in flight ``grace_s`` to end, then end them."""
        self.stopping = True
        tasks = [c.task for c in self.connections if c.task is not None]
        for connection in [c for c in self.connections if c.task is None]:
            connection.abort()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for connection in list(self.connections):
            connection.abort()


async def serve(
    server: Server, *, host: str, port: int, ready_flag: asyncio.Event | None, turn: Turns | None = None
) -> None:
    """Listen on ``host:port`` until cancelled; sets ``ready_flag`` once listening. A worker's ``turn``: accept on
    the socket its parent made, in turn with the other workers (gateway.spill)."""
    loop = asyncio.get_running_loop()
    listening = None
    if turn is None:
        listening = await loop.create_server(lambda: Connection(server), host, port, reuse_address=True)
        sockets: Sequence[socket.socket] = cast(Any, listening).sockets  # uvloop's are a list, asyncio's a tuple
        for sock in sockets:
            bound_unsent(sock)  # Linux gives each accepted socket its listener's bound: set once, not per connection
        port = sockets[0].getsockname()[1] if sockets else port
    try:
        log.info("server.listening", server="api", host=host, port=port)
        # What the program made to start (modules, settings, the loop) lives as long as it does: the full
        # collections that the streams' own objects set off need not walk it each time.
        gc.freeze()
        if ready_flag is not None:
            ready_flag.set()
        if turn is None:
            await asyncio.Event().wait()
        else:
            await turn.run(lambda sock: loop.create_server(lambda: Connection(server), sock=sock), server)
    finally:
        if listening is not None:
            listening.close()
        await asyncio.shield(server.stop())


class Connection(asyncio.Protocol):
    """One client's connection: reads a request (its head, then its body within the body timeout), serves it with a
    task, and keeps the connection for the next (HTTP/1.1 keep-alive, idle up to KEEPALIVE_S).

    The handler answers with ``begin``, ``send`` and ``finish`` (a stream) or ``answer`` (a whole response).
    """

    __slots__ = (
        "_body",
        "_data",
        "_dechunker",
        "_finished",
        "_length",
        "_paused",
        "_refused",
        "_timer",
        "_writable",
        "loop",
        "request",
        "server",
        "task",
        "transport",
    )

    def __init__(self, server: Server) -> None:
        self.server = server
        # Kept: asyncio.get_running_loop() makes a getpid system call each time (Python 3.11), and a request asks
        # for the loop three times or more.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.request: Request | None = None  # whose body is being read, or which is being served
        self.task: asyncio.Task[None] | None = None
        self._data = bytearray()  # read and not yet taken
        self._length: int | None = 0  # of the body being read; None: chunked
        self._dechunker: Dechunker | None = None
        self._body = bytearray()  # of a chunked body, what was decoded
        self._timer: asyncio.TimerHandle | None = None  # keep-alive while idle, the body timeout while reading one
        self._writable: asyncio.Future[None] | None = None  # while the transport's buffer is above its high water
        self._finished = False  # the answer to the request being served is complete
        self._paused = False  # reading paused: a next request arrived while one is served
        self._refused = False  # a request was refused: what the client still sends is dropped

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is one, without being asyncio's class
        self.server.connections.add(self)
        self._idle()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._data += data
        if self.task is None:
            self._advance()
        elif len(self._data) > HELD_MAX_BYTES and self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # the client is done: the transport closes, and a stream in flight ends at its next write

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._cancel_timer()
        self.transport = None
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # the handler's side

    def begin(self, headers: Mapping[str, str]) -> None:
        """Start a streamed 200 answer with ``headers``; raises ConnectionResetError once the client has gone."""
        assert self.request is not None
        transport = self._live()
        self.request.closes |= self.server.shedding
        lines = [f"Date: {self.server.date()}"]
        lines += ["Transfer-Encoding: chunked"] if self.request.chunked else []
        lines += ["Connection: close"] if self.request.closes else []
        transport.write(_head(200, headers, *lines))

    def send(self, data: bytes) -> bool:
        """One piece of the stream; True where the client's buffer is full and ``drain`` is to be awaited."""
        assert self.request is not None
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.request.chunked else data)
        return self._writable is not None

    async def drain(self) -> None:
        """Until the client's buffer is below its high-water mark; raises ConnectionResetError if the client goes."""
        while self._writable is not None:
            await self._writable
        self._live()

    def finish(self, last: bytes = b"") -> bool:
        """``last``, the stream's last piece, and its end, in one write; True where the client's buffer is full and
        ``drain`` is to be awaited."""
        assert self.request is not None
        transport = self._live()
        if self.request.chunked:
            transport.write((b"%x\r\n%b\r\n" % (len(last), last) if last else b"") + b"0\r\n\r\n")
        elif last:
            transport.write(last)
        self._finished = True
        return self._writable is not None

    def answer(self, response: web.Response) -> None:
        """A whole answer, not streamed."""
        assert self.request is not None
        body = response.body
        assert isinstance(body, bytes)
        self.request.closes |= self.server.shedding
        self._answer(response.status, response.headers, body, closes=self.request.closes)
        self._finished = True

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # reading requests

    def _advance(self) -> None:
        """Take what was read: the next request's head, then its body; serve it once whole."""
        while self.task is None and self.transport is not None and not self._refused:
            if self.request is None and not self._take_head():
                return
            if not self._take_body():
                if self._timer is None and not self._refused:  # the body is read within the body timeout
                    self._timer = self.loop.call_later(self.server.body_timeout_s, self._body_late)
                return
            self._serve()

    def _take_head(self) -> bool:
        end = self._data.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
        if end < 0:
            if len(self._data) >= MAX_HEAD_BYTES + 4:
                self._refuse(431, f"a head over {MAX_HEAD_BYTES} bytes")
            return False
        try:
            request, length, expects = parse_head(bytes(self._data[:end]))
        except BadRequest as error:
            self._refuse(error.status, str(error))
            return False
        if length is not None and length > self.server.max_body_bytes:
            self._refuse(413, f"a body over {self.server.max_body_bytes} bytes")
            return False
        self._data = self._data[end + 4 :]  # a copy: what the head took is freed
        self.request, self._length = request, length
        self._dechunker = Dechunker() if length is None else None
        if expects and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._cancel_timer()
        return True

    def _take_body(self) -> bool:
        request = self.request
        assert request is not None
        if self._dechunker is not None:
            try:
                self._body += self._dechunker.feed(bytes(self._data))
            except BadAnswer as error:
                self._refuse(400, str(error))
                return False
            self._data = bytearray()  # a chunked request is not followed by a pipelined one (trailers are not read)
            if len(self._body) > self.server.max_body_bytes:
                self._refuse(413, f"a body over {self.server.max_body_bytes} bytes")
                return False
            if not self._dechunker.done:
                return False
            request.body, self._body, self._dechunker = bytes(self._body), bytearray(), None
        else:
            assert self._length is not None
            if len(self._data) < self._length:
                return False
            request.body = bytes(memoryview(self._data)[: self._length])
            self._data = self._data[self._length :]
        self._cancel_timer()
        return True

    def _body_late(self) -> None:
        self._timer = None
        self._refuse(408, "the request body did not arrive in time")

    def _serve(self) -> None:
        assert self.request is not None
        self._finished = False
        self.task = self.loop.create_task(self._run(self.request))

    async def _run(self, request: Request) -> None:
        try:
            await self.server.handler(request, self)
        except Exception:
            log.exception("gateway.request_failed", path=request.path)
        finally:
            self._served(request)

    def _served(self, request: Request) -> None:
        """After an answer: the connection serves the next request, or ends (at once where the answer is cut)."""
        self.task = None
        self.request = None
        if self.transport is None:
            return
        if not self._finished:
            self.transport.abort()  # a stream cut short: the client must not take it for a whole one
        elif request.closes or self.server.stopping:
            self.transport.close()
        else:
            if self._paused:
                self._paused = False
                self.transport.resume_reading()
            self._idle()
            self._advance()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the handler never sees, and end the connection once the client stops sending."""
        self.server.refused(status)
        self._refused = True
        self._data = bytearray()
        self.request = None
        self._cancel_timer()
        self._answer(status, {"Content-Type": "text/plain; charset=utf-8"}, f"{message}\n".encode(), closes=True)
        if self.transport is None:
            return
        if self.transport.can_write_eof():
            # Closing with the client's bytes unread would send a reset, which can destroy this answer in the
            # client's buffer: the rest is read and dropped until the client closes, or for the body timeout.
            self.transport.write_eof()
            self._timer = self.loop.call_later(self.server.body_timeout_s, self.abort)
        else:
            self.transport.close()

    # helpers

    def _live(self) -> asyncio.Transport:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        return self.transport

    def _answer(self, status: int, headers: Mapping[str, str], body: bytes, *, closes: bool) -> None:
        lines = [f"Date: {self.server.date()}", f"Content-Length: {len(body)}"]
        if closes:
            lines.append("Connection: close")
        head = _head(status, headers, *lines)
        with contextlib.suppress(ConnectionResetError):
            self._live().write(head if self.request is not None and self.request.method == "HEAD" else head + body)

    def _idle(self) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(KEEPALIVE_S, self.abort)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_REASONS = {status.value: status.phrase for status in HTTPStatus}


def _head(status: int, headers: Mapping[str, str], *lines: str) -> bytes:
    reason = _REASONS.get(status, "")
    fields = [f"{name}: {value}" for name, value in headers.items()]
    text = "\r\n".join([f"HTTP/1.1 {status} {reason}", *fields, *lines])
    try:  # a head read by the gateway's reader is latin-1, as it came; aiohttp's client decodes UTF-8
        return text.encode("latin-1") + b"\r\n\r\n"
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape") + b"\r\n\r\n"


def bound_unsent(sock: socket.socket) -> None:
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, KERNEL_UNSENT_BYTES)
