"""An HTTP/1.1 body's framing taken off its bytes as they come (RFC 9112 sections 6 and 7.1): chunked, sized by
``Content-Length``, or ended by the connection's close. Pure: the reader in ``spotdrain.http1`` feeds it, and the
gateway's server takes a client's chunked request body off with it."""

from __future__ import annotations

import re

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


class BadAnswer(Exception):
    """The backend's bytes are not an HTTP/1.1 answer."""


class Framing:
    """A body's framing taken off its bytes as they come: chunked, sized by ``Content-Length``, or ended by the
    connection's close."""

    __slots__ = ("dechunker", "done", "left")

    def __init__(self, *, chunked: bool, length: int | None) -> None:
        self.dechunker = Dechunker() if chunked else None
        self.left = None if chunked else length  # of a sized body; None: chunked, or until the close
        self.done = self.left == 0

    def unframe(self, block: bytes) -> bytes:
        """The body's bytes in ``block``, in one piece."""
        if self.dechunker is not None:
            data = self.dechunker.feed(block)
            self.done = self.dechunker.done
            return data
        if self.left is None:
            return block
        data = block[: self.left]
        self.left -= len(data)
        self.done = self.left == 0
        return data

    def cut(self) -> ConnectionResetError | None:
        """What the connection's end is before the body's; None where its close ends the body."""
        if self.dechunker is not None:
            return ConnectionResetError("the connection closed inside a chunked body")
        if self.left:
            return ConnectionResetError(f"the connection closed {self.left} bytes before the body's end")
        return None


class Dechunker:
    """The chunked transfer coding (RFC 9112 section 7.1) taken off a body, as its bytes come; trailers are not read
    (the connection closes after the last chunk)."""

    __slots__ = ("_left", "_pending", "done")

    def __init__(self) -> None:
        self.done = False
        self._pending = b""  # an unfinished size line
        self._left: int | None = None  # of the chunk being read, its data and CRLF; None: a size line comes next

    def feed(self, block: bytes) -> bytes:
        """The data ``block`` completes, in one piece."""
        if not self._pending and self._left is None:  # what a streaming server writes: one whole chunk a read
            line_end = block.find(b"\r\n")
            if (
                line_end > 0
                and (size := _chunk_size(block[:line_end]))
                and len(block) == line_end + size + 4
                and block.endswith(b"\r\n")
            ):
                return block[line_end + 2 : -2]
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
            left = self._left
            take = min(left, end - at)
            useful = min(take, left - 2)  # what is data, not the chunk's closing CRLF
            if useful > 0:
                out.append(data[at : at + useful])
            if take > left - 2:  # some of the CRLF, which may have begun in the last block
                crlf = max(useful, 0)
                if data[at + crlf : at + take] != b"\r\n"[2 - left + crlf : 2 - left + take]:
                    raise BadAnswer("a chunk's data not followed by CRLF")
            self._left -= take
            at += take
            if self._left == 0:
                self._left = None
        self._pending = b"" if self.done else data[at:]
        return out[0] if len(out) == 1 else b"".join(out)


def _chunk_size(line: bytes) -> int:
    if not _HEX.fullmatch(line):  # int() would take "-5", "0x5" or "1_0"
        line = line.split(b";", 1)[0].strip()  # without its extensions
        if not _HEX.fullmatch(line):
            raise BadAnswer(f"a chunk size {line[:20]!r}")
    return int(line, 16)
