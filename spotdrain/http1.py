"""One HTTP/1.1 answer read without aiohttp, for the two paths where the cost per byte is the point: the gateway's
relay of a backend's streamed answer, and the model fetch's ranged GETs.

Measured with bench/gateway_peers.py, aiohttp's client was the largest part of the gateway's work per relayed chunk
after the system calls (a request object, a response object, a stream reader with its own buffer and waiters, a
timer moved on every read) and about a third of its memory per open stream; in the fetch (bench/cache_fetch.py) it
was a third of its CPU. This reads one answer on a connection of its own, takes the head, and hands the body on decoded
from its framing (chunked, ``Content-Length`` or until the close), block by block as it arrives: to a coroutine, or
to a callback run in the read itself (the relay's way: no task switch per read); or, for a sized body, hands each
read to a writer straight from a buffer every connection of the process shares (``asyncio.BufferedProtocol``: the
socket is read into it), with no copy made in this process. A relayed stream's reads are small and many: each comes
as the bytes the transport makes of it (``data_received``), one call into Python per read where a buffered read
makes two.

A request asks for ``Connection: close`` unless its caller keeps connections (``keep_alive``: the gateway's streams,
whose connection goes back to it with ``Answer.release`` once the answer has ended).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from functools import cache
from urllib.parse import unquote, urlsplit

from multidict import CIMultiDict

from spotdrain.framing import BadAnswer as BadAnswer  # raised to the callers of this module's readers
from spotdrain.framing import Framing
from spotdrain.http1_delivery import Delivery
from spotdrain.http1_reads import BufferedReads, Reads

MAX_HEAD_BYTES = 64 * 1024
_DECIMAL = re.compile(r"[0-9]{1,18}")  # str.isdigit() would take "²", which int() does not
# Set by the caller on the whole request, not per read; what the framing says, when it cannot be read.
_CONNECTION_HEADERS = ("host", "content-length", "connection", "transfer-encoding")
# A request's headers: a mapping, or header lines ready to send (CRLF after each, none of the four above).
Headers = Mapping[str, str] | bytes


class Unanswered(ConnectionResetError):
    """The connection ended before a byte of the answer: a kept one the server closed as the request went."""


class Answer:
    """One answer: ``status`` and ``headers`` once ``send`` returned, then its body, block by block."""

    __slots__ = (
        "_chunked",
        "_delivery",
        "_length",
        "_protocol",
        "_proxy_headers",
        "_rest",
        "absolute",
        "headers",
        "persistent",
        "reason",
        "status",
        "url",
    )

    def __init__(self, protocol: Reads, url: str, *, proxy_headers: Mapping[str, str] | None = None) -> None:
        self._protocol = protocol
        self.url = url
        self.absolute = False  # each request's target a whole URL: an http server's, asked through a proxy
        self._proxy_headers = proxy_headers  # None without a proxy: nothing more for every gateway stream to hold
        self.status = 0
        self.reason = ""
        self.persistent = False  # the answer lets the connection carry another request (RFC 9112 section 9.3)
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._rest = b""  # body bytes read with the head
        self._chunked = False
        self._length: int | None = None
        self._delivery: Delivery | None = None

    @property
    def length(self) -> int | None:
        """The body's size, where the head gave it (``Content-Length``, not chunked)."""
        return self._length

    def close(self) -> None:
        """End the answer now (the relay reads no more of it)."""
        self._protocol.close()

    async def send(
        self, path: str, body: bytes, headers: Headers, *, method: str = "POST", keep_alive: bool = False
    ) -> None:
        """Send the request and read the answer's head; raises OSError (the connection ended: Unanswered where it
        ended before a byte of the answer) or BadAnswer."""
        assert self._protocol.transport is not None
        if self.absolute and self._proxy_headers:
            proxy = self._proxy_headers
            headers = headers + _lines(proxy) if isinstance(headers, bytes) else {**headers, **proxy}
        request = request_bytes(
            self.url, path, body, headers, method=method, absolute=self.absolute, keep_alive=keep_alive
        )
        self._protocol.transport.write(request)
        await self._read_head()

    async def tunnel(self, host: str, port: int) -> None:
        """Through the proxy this is connected to, a tunnel to ``host``, then TLS with it; raises OSError where the
        proxy refuses (the server's answers are read after)."""
        protocol = self._protocol
        assert protocol.transport is not None
        start = f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n".encode("latin-1")
        protocol.transport.write(start + _lines(self._proxy_headers or {}) + b"\r\n")
        await self._read_head()
        if not 200 <= self.status < 300 or self._rest:
            raise ConnectionRefusedError(f"the proxy answered CONNECT {host}:{port} with HTTP {self.status}")
        self.status, self.reason, self.headers, self._length, self._chunked = 0, "", CIMultiDict(), None, False
        loop = asyncio.get_running_loop()
        tls = await loop.start_tls(protocol.transport, protocol, _tls(), server_hostname=host)
        assert tls is not None
        protocol.transport = tls

    async def _read_head(self) -> None:
        """The status and headers of the final answer: interim ones (1xx, e.g. the ``100 Continue`` a server sends for
        a client's ``Expect``) are passed over, as aiohttp's client does."""
        data = b""
        heard = False
        while True:
            while (end := data.find(b"\r\n\r\n")) < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise BadAnswer(f"a head longer than {MAX_HEAD_BYTES} bytes")
                try:
                    block = await self._protocol.next_block()
                except ConnectionResetError as error:
                    raise (error if heard else Unanswered(str(error))) from None
                if block is None:
                    if not heard:
                        raise Unanswered("the connection closed before a byte of the answer")
                    raise ConnectionResetError("the connection closed before the answer's head")
                heard = True
                data += block
            lines = data[:end].decode("latin-1").split("\r\n")
            data = data[end + 4 :]
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not _DECIMAL.fullmatch(code):
                raise BadAnswer(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
            if not 100 <= int(code) < 200:
                break
        self._rest = data
        self.status = int(code)
        self.reason = rest[4:].strip()
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise BadAnswer(f"not a header line: {line[:80]!r}")
            self.headers.add(name, value.strip())
        self._chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        length = self.headers.get("Content-Length")
        if not self._chunked and length is not None:
            if not _DECIMAL.fullmatch(length.strip()):
                raise BadAnswer(f"Content-Length {length!r}")
            self._length = int(length)
        closes = "close" in self.headers.get("Connection", "").lower()
        self.persistent = version == "HTTP/1.1" and not closes and (self._chunked or self._length is not None)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes, one piece per read of the connection, its framing taken off; ends where the body does.

        Raises ConnectionResetError where the connection ends first (a chunked or sized body cut short)."""
        framing = Framing(chunked=self._chunked, length=self._length)
        block: bytes | None = self._rest
        while not framing.done:
            if block is None:
                if (cut := framing.cut()) is not None:
                    raise cut
                return
            if data := framing.unframe(block):
                yield data
            if not framing.done:
                block = await self._protocol.next_block()

    async def deliver(self, take: Callable[[bytes], bool]) -> bool:
        """The body handed to ``take`` piece by piece as it is read, its framing taken off, from the read's own
        callback: no task switch per read. Where ``take`` returns True, reading pauses and this returns True; call
        again to go on. False once the body has ended.

        Raises ConnectionResetError where the connection ends first (a chunked or sized body cut short), BadAnswer
        where its framing is broken, and what ``take`` raised. No time bound: the caller closes the answer to end it.
        """
        protocol = self._protocol
        if self._delivery is None:
            self._delivery = Delivery(protocol, take, Framing(chunked=self._chunked, length=self._length))
        delivery = self._delivery
        delivery.take = take
        delivery.asked = False
        pending = [self._rest, *protocol.blocks] if self._rest else [*protocol.blocks]
        self._rest = b""
        protocol.blocks.clear()
        protocol.held = 0
        for at, block in enumerate(pending):
            delivery.feed(block)
            if delivery.stops:
                protocol.blocks += pending[at + 1 :]  # for the next call
                break
        else:
            protocol.sink = delivery.feed
            protocol.resume()
            try:
                while not delivery.stops and not protocol.eof:
                    await protocol.wait()
            finally:
                protocol.sink = None
        if delivery.failed is not None:
            raise delivery.failed
        if delivery.asked:
            return True
        if delivery.framing.done:
            return False
        if protocol.error is not None:
            raise ConnectionResetError(str(protocol.error) or type(protocol.error).__name__)
        if (cut := delivery.framing.cut()) is not None:
            raise cut
        return False

    def release(self, keep: Callable[[Reads], None]) -> None:
        """The connection, once ``deliver``'s caller has had all it wants of the answer (its stream's end): to
        ``keep`` for another request where the answer lets it carry one, else closed. What is left of the body (its
        chunked end) is read in the connection's own callback as it comes; body bytes after the caller's end, or a
        broken framing, close the connection, and any read after the body's end leaves it unfit (``Reads.idle``)."""
        protocol, delivery = self._protocol, self._delivery
        if not self.persistent or delivery is None or delivery.failed is not None or not protocol.open:
            self.close()
            return

        def more(data: bytes) -> bool:
            raise BadAnswer(f"{len(data)} bytes of the body after its end")

        def finish(data: bytes) -> None:
            if data:
                delivery.feed(data)
            if delivery.failed is not None:
                self.close()
            elif delivery.framing.done:
                protocol.sink = None  # idle: a read from here on is kept, and leaves the connection unfit
                protocol.resume()  # to hear the server close it

        delivery.take, delivery.asked = more, False
        pending = list(protocol.blocks)
        protocol.blocks.clear()
        protocol.held = 0
        protocol.sink = finish
        finish(b"")  # the body may have ended already
        for block in pending:
            protocol.data_received(block)
        if protocol.sink is finish:
            protocol.resume()
        keep(protocol)

    async def read(self) -> bytes:
        return b"".join([block async for block in self.body()])

    async def write_body(self, write: Callable[[memoryview], None], *, idle_s: float) -> None:
        """A sized body (``length``) handed to ``write`` as it is read, each piece straight from the shared buffer
        where the connection reads into it (``connect(buffered=True)``; ``write`` must be done with it when it
        returns). Raises ConnectionResetError where the connection ends first, TimeoutError after ``idle_s`` without
        a byte, and whatever ``write`` raised."""
        assert self._length is not None
        protocol = self._protocol
        left = self._length
        failed: BaseException | None = None

        def take(view: memoryview) -> None:
            nonlocal left, failed
            if failed is None and left > 0:
                piece = view[:left]
                try:
                    write(piece)
                except Exception as error:  # raised to the reader, not into the event loop's transport
                    failed = error
                    protocol.wake()
                    return
                left -= len(piece)
                if left == 0:
                    protocol.wake()

        for block in (self._rest, *protocol.blocks):
            take(memoryview(block))
        self._rest = b""
        protocol.blocks.clear()
        protocol.held = 0
        if isinstance(protocol, BufferedReads):
            protocol.view_sink = take
        else:
            protocol.sink = lambda data: take(memoryview(data))
        protocol.resume()
        try:
            while left > 0 and failed is None:
                if protocol.eof:
                    raise ConnectionResetError(f"the connection closed {left} bytes before the body's end")
                before = left
                with contextlib.suppress(TimeoutError):
                    await protocol.wait(idle_s)
                if left == before and not protocol.eof and failed is None:
                    raise TimeoutError(f"no byte of the body in {idle_s} s")
        finally:
            protocol.sink = None
            if isinstance(protocol, BufferedReads):
                protocol.view_sink = None
        if failed is not None:
            raise failed


def request_bytes(
    url: str,
    path: str,
    body: bytes,
    headers: Headers,
    *,
    method: str = "POST",
    absolute: bool = False,
    keep_alive: bool = False,
) -> bytes:
    """The request for ``path`` on the server at ``url``: the method, the headers given, the body (a GET has none),
    ``Connection: close`` unless ``keep_alive``; ``absolute``: the target as a whole URL, as a proxy is asked (RFC
    9112 section 3.2.2)."""
    parts = urlsplit(url)
    target = f"{parts.scheme}://{parts.netloc}{parts.path}{path}" if absolute else f"{parts.path}{path}"
    length = "" if method == "GET" else f"Content-Length: {len(body)}\r\n"
    close = "" if keep_alive else "Connection: close\r\n"
    head = f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n{length}{close}"
    return head.encode("latin-1") + _lines(headers) + b"\r\n" + body


def _lines(headers: Headers) -> bytes:
    """``headers`` as header lines, each ending in CRLF, without those ``request_bytes`` sets itself; lines given as
    bytes are taken as they are."""
    if isinstance(headers, bytes):
        return headers
    return "".join(
        f"{name}: {value}\r\n" for name, value in headers.items() if name.lower() not in _CONNECTION_HEADERS
    ).encode("latin-1")


async def connect(url: str, *, connect_s: float, proxy: str | None = None, buffered: bool = False) -> Answer:
    """A connection to the server at ``url``; raises OSError where there is none, TimeoutError past ``connect_s``.
    ``buffered``: read into the process's one buffer, for ``write_body`` to take each read with no copy (a model
    fetch's large reads); else each read is the bytes the transport makes of it (a relayed stream's small ones).

    Through ``proxy`` (an ``http://`` proxy's URL, with its credentials if it needs them) where one is given: to an
    https server through a tunnel (``CONNECT``, then TLS with the server), to an http one with each request's target
    as a whole URL."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if secure else 80)
    loop = asyncio.get_running_loop()
    made = BufferedReads if buffered else Reads
    async with asyncio.timeout(connect_s):
        if proxy is None:
            _, protocol = await loop.create_connection(made, host, port, ssl=_tls() if secure else None)
            return Answer(protocol, url)
        via = urlsplit(proxy)
        _, protocol = await loop.create_connection(made, via.hostname or "", via.port or 80)
        answer = Answer(protocol, url, proxy_headers=_proxy_headers(via.username, via.password))
        if secure:
            await answer.tunnel(host, port)
        else:
            answer.absolute = True
        return answer


def _proxy_headers(user: str | None, password: str | None) -> dict[str, str]:
    if user is None:
        return {}
    token = base64.b64encode(f"{unquote(user)}:{unquote(password or '')}".encode()).decode()
    return {"Proxy-Authorization": f"Basic {token}"}


@cache
def _tls() -> ssl.SSLContext:
    """One context for every connection: making one reads the system's certificates again."""
    return ssl.create_default_context()
