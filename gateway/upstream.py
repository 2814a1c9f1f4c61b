"""A backend's streamed answer, read without aiohttp: the one place the gateway's cost per chunk is decided.

Measured with bench/gateway_peers.py, aiohttp's client was the largest part of the gateway's work per relayed chunk
after the system calls (a request object, a response object, a stream reader with its own buffer and waiters, a
timer moved on every read) and about a third of its memory per open stream. This reads one HTTP/1.1 answer on a
connection of its own, into a buffer every connection of the process shares (``asyncio.BufferedProtocol``: the
socket is read into it, and only the bytes read are copied out), takes the head, and hands the body on decoded from
its framing (chunked, ``Content-Length`` or until the close), block by block as it arrives.

Each request asks for ``Connection: close``: an engine keeps no idle connection from the gateway, which a pod's
sidecar would count as a client still there (the health checks close theirs for the same reason).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

from multidict import CIMultiDict

_SHARED = bytearray(256 * 1024)  # every read of the process goes here first: reads are one after another
_VIEW = memoryview(_SHARED)
MAX_HEAD_BYTES = 64 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DECIMAL = re.compile(r"[0-9]{1,18}")  # str.isdigit() would take "²", which int() does not
HELD_MAX_BYTES = 128 * 1024  # read but not yet relayed, before the backend's socket is read no more
# Set by the caller on the whole request, not per read; what the framing says, when it cannot be read.
_CONNECTION_HEADERS = ("host", "content-length", "connection", "transfer-encoding")


class BadAnswer(Exception):
    """The backend's bytes are not an HTTP/1.1 answer."""


class _Protocol(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.blocks: list[bytes] = []  # a list, not a deque: an open stream holds one, and a deque is 600 bytes
        self.held = 0  # bytes in ``blocks``
        self.paused = False
        self.eof = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without being asyncio's class

    def get_buffer(self, sizehint: int) -> memoryview:
        return _VIEW

    def buffer_updated(self, nbytes: int) -> None:
        self.blocks.append(bytes(_VIEW[:nbytes]))
        self.held += nbytes
        if self.held > HELD_MAX_BYTES and self.transport is not None and not self.paused:
            self.paused = True  # the client reads slower than the backend writes: let the kernel hold the rest
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = self.error or exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_block(self) -> bytes | None:
        """Every byte read since the last call, as one block, or None once the connection has ended."""
        while not self.blocks:
            if self.eof:
                if self.error is not None:
                    raise ConnectionResetError(str(self.error) or type(self.error).__name__)
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        block = self.blocks[0] if len(self.blocks) == 1 else b"".join(self.blocks)
        self.blocks.clear()
        self.held = 0
        if self.paused and self.transport is not None:  # nothing is held now: the backend's socket is read again
            self.paused = False
            self.transport.resume_reading()
        return block


class Answer:
    """One backend answer: ``status`` and ``headers`` once ``open`` returned, then its body, block by block."""

    def __init__(self, protocol: _Protocol, url: str) -> None:
        self._protocol = protocol
        self.url = url
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._rest = b""  # body bytes read with the head
        self._chunked = False
        self._length: int | None = None

    def close(self) -> None:
        """End the answer now (the relay reads no more of it)."""
        if self._protocol.transport is not None:
            self._protocol.transport.close()

    async def send(self, path: str, body: bytes, headers: Mapping[str, str]) -> None:
        """Send the request and read the answer's head; raises OSError (the connection ended) or BadAnswer."""
        assert self._protocol.transport is not None
        self._protocol.transport.write(request_bytes(self.url, path, body, headers))
        await self._read_head()

    async def _read_head(self) -> None:
        """The status and headers of the final answer: interim ones (1xx, e.g. the ``100 Continue`` a server sends for
        a client's ``Expect``) are passed over, as aiohttp's client does."""
        data = b""
        while True:
            while (end := data.find(b"\r\n\r\n")) < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise BadAnswer(f"a head longer than {MAX_HEAD_BYTES} bytes")
                block = await self._protocol.next_block()
                if block is None:
                    raise ConnectionResetError("the connection closed before the answer's head")
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

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes, one piece per read of the connection, its framing taken off; ends where the body does.

        Raises ConnectionResetError where the connection ends first (a chunked or sized body cut short)."""
        if self._chunked:
            dechunker = Dechunker()
            data = dechunker.feed(self._rest)
            while True:
                if data:
                    yield data
                if dechunker.done:
                    return
                block = await self._protocol.next_block()
                if block is None:
                    raise ConnectionResetError("the connection closed inside a chunked body")
                data = dechunker.feed(block)
        left = self._length
        piece: bytes | None = self._rest
        while piece is not None:
            if left is not None:
                piece = piece[:left]
                left -= len(piece)
            if piece:
                yield piece
            if left == 0:
                return
            piece = await self._protocol.next_block()
        if left:
            raise ConnectionResetError(f"the connection closed {left} bytes before the body's end")

    async def read(self) -> bytes:
        return b"".join([block async for block in self.body()])


class Dechunker:
    """The chunked transfer coding (RFC 9112 section 7.1) taken off a body, as its bytes come; trailers are not read
    (the connection closes after the last chunk)."""

    def __init__(self) -> None:
        self.done = False
        self._pending = b""  # an unfinished size line
        self._left: int | None = None  # of the chunk being read, its data and CRLF; None: a size line comes next

    def feed(self, block: bytes) -> bytes:
        """The data ``block`` completes, in one piece."""
        data = self._pending + block if self._pending else block
        out: list[bytes] = []
        at, end = 0, len(data)
        while at < end and not self.done:
            if self._left is None:
                line_end = data.find(b"\r\n", at)
                if line_end < 0:
                    break
                size = _chunk_size(data[at:line_end])
                at = line_end + 2
                if size == 0:
                    self.done = True
                    break
                self._left = size + 2
            take = min(self._left, end - at)
            useful = min(take, self._left - 2)  # what is data, not the chunk's closing CRLF
            if useful > 0:
                out.append(data[at : at + useful])
            self._left -= take
            at += take
            if self._left == 0:
                self._left = None
        self._pending = b"" if self.done else data[at:]
        return out[0] if len(out) == 1 else b"".join(out)


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip()
    if not _HEX.fullmatch(digits):  # int() would take "-5", "0x5" or "1_0"
        raise BadAnswer(f"a chunk size {digits[:20]!r}")
    return int(digits, 16)


def request_bytes(url: str, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    """The request for ``path`` on the backend at ``url``: POST, the headers given, the body, ``Connection: close``."""
    parts = urlsplit(url)
    host = parts.netloc
    lines = [f"POST {parts.path}{path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items() if name.lower() not in _CONNECTION_HEADERS]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


async def connect(url: str, *, connect_s: float) -> Answer:
    """A connection to the backend at ``url``; raises OSError where there is none, TimeoutError past ``connect_s``."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    context = ssl.create_default_context() if secure else None
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(connect_s):
        _, protocol = await loop.create_connection(_Protocol, parts.hostname or "", port, ssl=context)
    return Answer(protocol, url)
