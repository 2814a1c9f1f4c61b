"""What the fake file servers share: reading a ``Range`` header, and writing a body in chunks at a pace.

A ``Range`` is read as RFC 9110 section 14.1.2 writes it (``bytes=first-last``, ``bytes=first-``, ``bytes=-suffix``);
a header that names several ranges, or is not a byte range, is ignored and the whole body sent with a 200, which
section 14.2 allows. S3 does the same with several ranges ("Amazon S3 doesn't support retrieving multiple ranges of
data per GET request": https://docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

from aiohttp import web

CHUNK = 65536
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class Unsatisfiable(ValueError):
    """The range starts at or past the end of the body: 416, with ``Content-Range: bytes */size``."""


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last), both inclusive and inside ``size``, of a single byte range; None when there is none to honour.

    Raises Unsatisfiable for a range that starts at or past the end (or a suffix of zero bytes)."""
    match = _RANGE.fullmatch((header or "").strip())
    if match is None or not (match[1] or match[2]):
        return None
    if not match[1]:  # bytes=-N: the last N bytes
        suffix = int(match[2])
        if suffix == 0 or size == 0:
            raise Unsatisfiable(header)
        return max(0, size - suffix), size - 1
    first = int(match[1])
    last = min(int(match[2]) if match[2] else size - 1, size - 1)
    if first >= size or last < first:
        raise Unsatisfiable(header)
    return first, last


def content_range(first: int, last: int, size: int) -> str:
    return f"bytes {first}-{last}/{size}"


async def write_chunks(
    response: web.StreamResponse, body: bytes, *, after_chunk: Callable[[int], Awaitable[None]] | None = None
) -> None:
    """Write ``body`` in 64 KiB chunks, awaiting ``after_chunk(bytes_written)`` after each, then end it."""
    for offset in range(0, len(body), CHUNK):
        chunk = body[offset : offset + CHUNK]
        await response.write(chunk)
        if after_chunk is not None:
            await after_chunk(len(chunk))
    await response.write_eof()


class Pace:
    """A rate shared by every body a server sends: ``bytes_per_s`` in all, however many connections are open (as a
    node's network link, or a bucket's throughput, is shared). ``None``: as fast as the loop goes."""

    def __init__(self, bytes_per_s: float | None = None) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0  # when the link has sent everything handed to it so far, on the loop's clock

    async def __call__(self, sent: int) -> None:
        if not self.bytes_per_s:
            return
        now = asyncio.get_running_loop().time()
        self._free_at = max(now, self._free_at) + sent / self.bytes_per_s
        await asyncio.sleep(self._free_at - now)
