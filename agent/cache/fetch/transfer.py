"""One part of one file: a ranged GET, its body written at its offset, failures sorted for retry.

The GET is read with ``spotdrain.http1``: each read of a sized body is written with one ``pwrite`` where it belongs
in the preallocated staging file, straight from the buffer the socket was read into, so no file is held in memory
and no byte is copied in this process on its way from the socket to the page cache (a chunked body, which S3 does
not send, is written block by block). Redirects are followed, as a mirror's LFS files are sent on to a CDN, and the
environment's proxy is used, as for the listing.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from agent.cache.fetch.parts import Part
from agent.cache.fetch.verify import Crc
from spotdrain import http1
from spotdrain.retry import ApiError, retry_after

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class Limits:
    connect_s: float
    read_s: float  # without a byte, head or body
    total_s: float  # one request, redirects included


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
    url: str, part: Part, fd: int, *, limits: Limits, on_bytes: Callable[[int], None], crc: Crc | None = None
) -> int | None:
    """GET the part's range and write it at its offset; ApiError for anything short of the whole range, OSError
    for the disk. Returns the part's ``crc``, taken from its bytes as they were written, where one is given.

    ``on_bytes`` is told of every write (negative once, for what a failed attempt had written).
    """
    written = 0
    value = 0
    disk: list[OSError] = []

    def write(view: memoryview) -> None:
        nonlocal written, value
        if written + len(view) > part.size:
            raise ApiError(0, f"the body ran past the {part.size} bytes asked for", failure="malformed")
        try:
            _write_all(fd, view, part.start + written)
        except OSError as error:
            disk.append(error)  # the disk's, kept apart from the connection's own OSErrors
            raise
        if crc is not None:
            value = crc(view, value)
        written += len(view)
        on_bytes(len(view))

    headers = {"Range": f"bytes={part.start}-{part.end - 1}", "Accept-Encoding": "identity"} if part.size else {}
    answer: http1.Answer | None = None
    try:
        async with asyncio.timeout(limits.total_s):
            answer = await answer_head(url, headers, limits)
            _check_answer(answer, part)
            if answer.length is not None:
                await answer.write_body(write, idle_s=limits.read_s)
            else:
                async for block in idle_bounded(answer, limits.read_s):
                    write(memoryview(block))
        if written != part.size:
            raise ApiError(0, f"the body ended at {written} of {part.size} bytes")
        return value if crc is not None else None
    except TimeoutError:
        on_bytes(-written)
        raise ApiError(0, "no answer in time", failure="timeout") from None
    except OSError as error:
        on_bytes(-written)
        if disk:
            raise disk[0] from None
        raise ApiError(0, f"{type(error).__name__}: {error}") from None
    except http1.BadAnswer as error:
        on_bytes(-written)
        raise ApiError(0, str(error), failure="malformed") from None
    except BaseException:
        on_bytes(-written)
        raise
    finally:
        if answer is not None:
            answer.close()


async def answer_head(
    url: str, headers: Mapping[str, str], limits: Limits, *, method: str = "GET", follow: bool = True
) -> http1.Answer:
    """The answer's head, redirects followed where ``follow`` (the last one's connection left open for its body)."""
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        proxy = proxy_for(parts.scheme, parts.netloc)
        answer = await http1.connect(
            f"{parts.scheme}://{parts.netloc}", connect_s=limits.connect_s, proxy=proxy, buffered=True
        )
        try:
            async with asyncio.timeout(limits.read_s):
                target = parts.path + (f"?{parts.query}" if parts.query else "")
                await answer.send(target, b"", headers, method=method)
        except BaseException:
            answer.close()
            raise
        location = answer.headers.get("Location")
        if not follow or answer.status not in REDIRECTS or location is None:
            return answer
        answer.close()
        url = urljoin(url, location)
    raise ApiError(0, f"more than {MAX_REDIRECTS} redirects", failure="malformed")


def proxy_for(scheme: str, netloc: str) -> str | None:
    """The proxy the environment names for a URL (``HTTPS_PROXY``, ``HTTP_PROXY``, lower case too; ``NO_PROXY``
    exempts hosts), as the AWS SDKs and aiohttp take them: an ``http://`` proxy, the scheme assumed where none is
    given."""
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(scheme)
    if not proxy or urllib.request.proxy_bypass(netloc):
        return None
    proxy = proxy if "://" in proxy else f"http://{proxy}"
    if not proxy.startswith("http://"):
        raise ApiError(0, f"{scheme}_proxy {proxy}: only http:// proxies are taken", failure="malformed")
    return proxy


async def idle_bounded(answer: http1.Answer, idle_s: float) -> AsyncIterator[bytes]:
    """An answer's body without a size, block by block, TimeoutError after ``idle_s`` without one."""
    body = answer.body()
    while True:
        async with asyncio.timeout(idle_s):
            block = await anext(body, None)
        if block is None:
            return
        yield block


def _check_answer(response: http1.Answer, part: Part) -> None:
    if response.status >= 300:
        raise ApiError(response.status, response.reason, retry_after_s=retry_after(response.headers.get("Retry-After")))
    if (
        response.status == 200
        and part.start == 0
        and response.length in (part.size, None)
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
    if response.length not in (None, part.size):
        raise ApiError(0, f"a Content-Length of {response.length} for {part.size} bytes", failure="malformed")


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    """One ``pwrite``; what a short write left is written again from where it stopped."""
    while view:
        count = os.pwrite(fd, view, offset)
        view, offset = view[count:], offset + count
