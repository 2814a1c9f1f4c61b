"""One part of one file: a ranged GET, its body written at its offset in 1 MiB writes, failures sorted for retry.

Nothing here holds more than one write's worth of a body: each request reads into a buffer of at most ``CHUNK``
bytes and ``os.pwrite``s it where it belongs in the preallocated staging file.
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
            buffer = bytearray()
            while written + len(buffer) < part.size:
                data = await response.content.read(min(CHUNK - len(buffer), part.size - written - len(buffer)))
                if not data:
                    raise ApiError(0, f"the body ended at {written + len(buffer)} of {part.size} bytes")
                buffer += data
                if len(buffer) >= CHUNK or written + len(buffer) == part.size:
                    _write_all(fd, buffer, part.start + written)
                    written += len(buffer)
                    on_bytes(len(buffer))
                    buffer.clear()
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


def _write_all(fd: int, data: bytearray, offset: int) -> None:
    view = memoryview(data)
    while view:
        count = os.pwrite(fd, view, offset)
        view, offset = view[count:], offset + count
