"""A chunked answer's body handed on from the reads of spotdrain.http1 as they come, in the read's own callback.

A read that is one whole chunk (a streaming server writes each event as one) is cut here by its size, with one copy
of its data and no search or parse of its size line, and handed on in the same call; the framing's dechunker takes
only what does not start at a chunk's start, and, from the chunk's size, it is known where the next starts.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from spotdrain.framing import BadAnswer, Framing
from spotdrain.http1_reads import Reads

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")  # a chunk size without extensions: int() would take "-5", "0x5" or "1_0"
_LINE_HELD_BYTES = 64  # a chunk size line cut by a read, kept for the next; longer is the framing's to refuse
_HEADS: dict[int, bytes] = {}  # a read's length -> the size line of the one chunk it would be (b"": none), as made
_HEADS_UP_TO = 4096  # reads longer than this have theirs made each time (its cost is small beside theirs)


def _head(end: int) -> bytes:
    """The size line of a chunk whose size line, data and CRLF are ``end`` bytes; b"" where there is none."""
    digits = len(b"%x" % max(end - 4, 0))
    head = b""
    for size in (end - 4 - digits, end - 3 - digits):  # its size has as many hex digits as end - 4, or one fewer
        if size > 0 and len(b"%x\r\n" % size) + size + 2 == end:
            head = b"%x\r\n" % size
    if end <= _HEADS_UP_TO:
        _HEADS[end] = head
    return head


class Delivery:
    """A body handed to a consumer from the read callbacks (spotdrain.http1's ``Answer.deliver``)."""

    __slots__ = ("asked", "failed", "framing", "left", "line", "protocol", "take")

    def __init__(self, protocol: Reads, take: Callable[[bytes], bool], framing: Framing) -> None:
        self.protocol = protocol
        self.take = take
        self.framing = framing
        self.asked = False  # the consumer asked to stop for now
        self.failed: Exception | None = None
        # Bytes the framing has yet to take before the next chunk starts: 0 at a chunk's start; -1 where it is not
        # known (a body not chunked, a chunk size with extensions, the last chunk), and the framing takes every byte.
        self.left = 0 if framing.dechunker is not None else -1
        self.line = b""  # the start of a chunk size line that the last read cut

    @property
    def stops(self) -> bool:
        return self.asked or self.framing.done or self.failed is not None

    def feed(self, data: bytes) -> None:
        """One read of the connection."""
        if self.asked or self.failed is not None or self.framing.done:  # read before the pause took
            self.protocol.blocks.append(data)  # kept for the next delivery
            return
        if self.left == 0 and not self.line:  # the read, if it is one whole chunk, by its size: no search, no parse
            end = len(data)
            head = _HEADS.get(end)
            if head is None:
                head = _head(end)
            if head and data.startswith(head) and data.endswith(b"\r\n"):
                self.give(data[len(head) : end - 2])
                return
        self.deliver(data)

    def deliver(self, data: bytes) -> None:
        """Hand the body's bytes in ``data`` to the consumer."""
        try:
            body = self.unframe(data)
        except Exception as error:  # raised to the reader, not into the event loop's transport
            self.failed = error
            body = b""
        self.give(body)

    def give(self, body: bytes) -> None:
        if body:
            try:
                self.asked = self.take(body)
            except Exception as error:  # raised to the reader, not into the event loop's transport
                self.failed = error
        if self.asked or self.failed is not None or self.framing.done:
            self.protocol.pause()
            self.protocol.wake()

    def unframe(self, data: bytes) -> bytes:
        """The body's bytes in ``data``, in one piece; raises BadAnswer where the framing is broken."""
        left, end = self.left, len(data)
        if left < 0:
            return self.framing.unframe(data)
        out: list[bytes | memoryview] = []
        at = 0
        if left > 0:  # the rest of a chunk the framing began
            at = min(left, end)
            out.append(self.framing.unframe(data[:at]))
            self.left = left - at
        elif self.line:
            data, self.line = self.line + data, b""
            end = len(data)
        view = memoryview(data)
        while at < end and self.left == 0:
            line_end = data.find(b"\r\n", at, end)
            if line_end < 0 and end - at < _LINE_HELD_BYTES:
                self.line = data[at:end]
                break
            size = int(data[at:line_end], 16) if line_end > at and _HEX.fullmatch(data, at, line_end) else 0
            stop = line_end + size + 4
            if size == 0 or stop > end:  # the last chunk, extensions, a broken size, or a chunk the read cut
                out.append(self.framing.unframe(data[at:end]))
                self.left = stop - end if size else -1
                break
            if not data.startswith(b"\r\n", stop - 2):
                raise BadAnswer("a chunk's data not followed by CRLF")
            out.append(view[line_end + 2 : stop - 2])
            at = stop
        if len(out) == 1:
            return bytes(out[0])
        return b"".join(out)
