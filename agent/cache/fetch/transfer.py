"""One part of one file: a ranged GET, its body written at its offset, failures sorted for retry.

Nothing here holds more than one write's worth of a body: the chunks the connection delivers are gathered, as they
are, up to ``CHUNK`` bytes and written with one ``os.pwritev`` where they belong in the preallocated staging file,
so no byte is copied in this process on its way from the socket to the page cache.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable

import aiohttp

from agent.cache.fetch.parts import Part
from spotdrain.retry import ApiError, retry_after

CHUNK = 1024 * 1024
MAX_CHUNKS = 256  # buffers per pwritev, well under IOV_MAX (1024 on Linux)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class FetchError(Exception):
    """A fetch that cannot complete. ``transient``: it may if tried again later (the source failed for longer
    than the retries); otherwise the message names the file and what is wrong with it."""

    def __init__(self, message: str, *, reason: str, transient: bool = False) -> None:
        super().__init__(message)
        self.reason = reason  # a bounded label: not_found, denied, checksum, disk_full, source, listing
        self.transient = transient


def disk_error(error: OSError, path: str) -> FetchError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return FetchError(f"{path}: the model cache is full ({error.strerror})", reason="disk_full")
    return FetchError(f"{path}: {error}", reason="disk")


async def get_part(
    session: aiohttp.ClientSession,
    url: str,
    part: Part,
    fd: int,
    *,
    limits: aiohttp.ClientTimeout,
    on_bytes: Callable[[int], None],
) -> None:
    """GET the part's range and write it at its offset; ApiError for anything short of the whole range.

    ``on_bytes`` is told of every write (negative once, for what a failed attempt had written).
    """
    written = 0
    headers = {"Range": f"bytes={part.start}-{part.end - 1}", "Accept-Encoding": "identity"} if part.size else {}
    try:
        async with session.get(url, headers=headers, timeout=limits) as response:
            _check_answer(response, part)
            chunks: list[bytes] = []
            gathered = 0
            while written + gathered < part.size:
                data = await response.content.readany()
                if not data:
                    raise ApiError(0, f"the body ended at {written + gathered} of {part.size} bytes")
                if written + gathered + len(data) > part.size:
                    raise ApiError(0, f"the body ran past the {part.size} bytes asked for", failure="malformed")
                chunks.append(data)
                gathered += len(data)
                if gathered >= CHUNK or len(chunks) == MAX_CHUNKS or written + gathered == part.size:
                    _write_all(fd, chunks, part.start + written)
                    written += gathered
                    on_bytes(gathered)
                    chunks.clear()
                    gathered = 0
    except TimeoutError:
        on_bytes(-written)
        raise ApiError(0, "no answer in time", failure="timeout") from None
    except aiohttp.ClientError as error:
        on_bytes(-written)
        raise ApiError(0, f"{type(error).__name__}: {error}") from None
    except BaseException:
        on_bytes(-written)
        raise


def _check_answer(response: aiohttp.ClientResponse, part: Part) -> None:
    if response.status >= 300:
        raise ApiError(
            response.status, response.reason or "", retry_after_s=retry_after(response.headers.get("Retry-After"))
        )
    if (
        response.status == 200
        and part.start == 0
        and response.content_length in (part.size, None)
        and (part.size == part.file.size)
    ):
        return  # the whole file, as asked (or a server that ignores Range on a one-part file)
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
    # A range can come with a 200 that names it in Content-Range (rclone serve s3, measured with rclone 1.7x): the
    # bytes are the range's, checked below like a 206's.
    if response.status not in (200, 206) or match is None:
        raise ApiError(
            0, f"asked for bytes {part.start}-{part.end - 1}, got HTTP {response.status}", failure="malformed"
        )
    start, end, total = int(match[1]), int(match[2]), match[3]
    if (start, end + 1) != (part.start, part.end) or total not in ("*", str(part.file.size)):
        raise ApiError(
            0, f"asked for bytes {part.start}-{part.end - 1} of {part.file.size}, got {match[0]}", failure="malformed"
        )


def _write_all(fd: int, chunks: list[bytes], offset: int) -> None:
    """One ``pwritev`` of the chunks; what a short write left is written again from where it stopped."""
    count = os.pwritev(fd, chunks, offset)
    total = sum(len(chunk) for chunk in chunks)
    if count < total:
        rest = memoryview(b"".join(chunks))[count:]
        offset += count
        while rest:
            count = os.pwrite(fd, rest, offset)
            rest, offset = rest[count:], offset + count
