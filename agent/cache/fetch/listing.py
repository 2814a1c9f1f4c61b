"""The files of a source, and how to GET each: S3 through ``agent.cache.fetch.s3`` (listing, a HEAD per object and
one per part of an object whose checksum is composite, presigned URLs), a Hugging Face-style mirror through its
model-info answer.

Objects are read with presigned URLs, so the transfers need no signing per request: a URL is signed once per file
and used for every part until it is near its expiry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from agent.cache.fetch.s3 import S3, Listed
from agent.cache.fetch.sources import (
    S3_CHECKSUMS,
    MirrorSource,
    RemoteFile,
    S3Source,
    http_checksums,
    mirror_files,
    relative_path,
    s3_checksums,
)
from agent.cache.fetch.transfer import FetchError, Limits
from spotdrain.retry import BACKOFF_S, ApiError, retry_after, retrying

if TYPE_CHECKING:  # imported where a mirror is listed: an S3 fetch, an init container's, starts without it
    from collections.abc import Mapping

    import aiohttp

T = TypeVar("T")
URL_EXPIRY_S = 3600
RESIGN_AFTER_S = 1800  # a URL older than this is signed again before a part uses it
HEADS_AT_ONCE = 16  # a 5 GB file in boto3's 8 MiB parts takes 597 HEADs when its checksum is composite
MAX_PARTS = 10_000  # S3's most parts in one upload


class S3Listing:
    """Lists ``s3://bucket/prefix/`` and signs GETs for its objects."""

    def __init__(
        self,
        source: S3Source,
        *,
        region: str | None,
        endpoint_url: str | None,
        limits: Limits,
        backoff_s: Sequence[float] = BACKOFF_S,
    ) -> None:
        self.source = source
        self.backoff_s = backoff_s
        self.s3 = S3(source.bucket, region=region, endpoint_url=endpoint_url, limits=limits)
        self.signed: dict[str, tuple[float, str]] = {}
        self.commit: str | None = None  # S3 has no revisions

    async def files(self) -> list[RemoteFile]:
        objects = await self._list()
        self.heads = asyncio.Semaphore(HEADS_AT_ONCE)  # every HEAD of the listing, of objects and of their parts
        return await _every(self._described(item) for item in objects)

    async def _described(self, item: Listed) -> RemoteFile:
        """The object and what S3 keeps to check it by. HEAD of part 1 first: one HEAD for an object uploaded in one
        part (part 1 is the whole object), and for a multipart upload the count of its parts, its part size (which
        its ETag's MD5s are over) and whether its checksum is COMPOSITE (``x-amz-checksum-type``; the part's own
        checksum is then the one answered). A composite checksum takes a HEAD per part, at most HEADS_AT_ONCE of the
        listing's at once; a full-object one of a multipart upload is read from a HEAD of the whole object."""
        first = await self._head(item.key, 1)
        count = _parts_count(first)
        if _is_composite(first):
            rest = await _every(self._head(item.key, n) for n in range(2, count + 1))
            parts = [first, *rest]
            if sum(_length(part) for part in parts) != item.size:
                raise FetchError(
                    f"s3://{self.source.bucket}/{item.key}: its parts do not add up to its listed size (replaced "
                    "while listed?)",
                    reason="listing",
                    transient=True,
                )
            return self._file(item, first, parts=parts)
        if count == 1:
            return self._file(item, first, whole=first)
        return self._file(item, first, whole=await self._head(item.key, None))

    async def _head(self, key: str, part: int | None) -> Mapping[str, str]:
        async with self.heads:
            head: Mapping[str, str] = await self._aws("s3.head_object", partial(self._head_once, key, part))
            return head

    async def _list(self) -> list[Listed]:
        objects: list[Listed] = []
        token: str | None = None
        while True:
            page, region = await self._aws("s3.list_objects_v2", partial(self.s3.list_page, self.source.prefix, token))
            if region:
                self.s3.region = region  # presigned URLs must name the bucket's own region
            objects += page.objects
            if page.next_token is None:
                return objects
            token = page.next_token

    async def _head_once(self, key: str, part: int | None) -> Mapping[str, str]:
        """HEAD of the object, or of its part ``part``. A server that does not take ``partNumber`` is asked plainly;
        its multipart ETags then go unchecked."""
        if part is None:
            return await self.s3.head(key)
        try:
            return await self.s3.head(key, part_number=part)
        except ApiError as error:
            if error.status not in (400, 416, 501) or part != 1:
                raise
        return {**(await self.s3.head(key)), "content-length": "0"}

    def _file(
        self,
        item: Listed,
        first: Mapping[str, str],
        *,
        whole: Mapping[str, str] | None = None,
        parts: Sequence[Mapping[str, str]] = (),
    ) -> RemoteFile:
        key = item.key
        try:
            if not key.startswith(self.source.prefix):
                raise ValueError("is not under the prefix asked for")
            path = relative_path(key[len(self.source.prefix) :])
        except ValueError as error:
            raise FetchError(f"s3://{self.source.bucket}/{key}: {error}", reason="listing") from None
        encrypted = first.get("x-amz-server-side-encryption") == "aws:kms" or bool(
            first.get("x-amz-server-side-encryption-customer-algorithm")
        )
        whole_b64 = {} if whole is None or _is_composite(whole) else _checksums_in(whole)
        checksums = s3_checksums(
            etag=item.etag,
            part_size=_length(first),
            whole_b64=whole_b64,
            parts_b64=[(_length(part), _checksums_in(part)) for part in parts],
            encrypted=encrypted,
        )
        return RemoteFile(path=path, size=item.size, checksums=checksums, key=key)

    async def url(self, file: RemoteFile) -> str:
        now = time.monotonic()
        signed = self.signed.get(file.key)
        if signed is None or now - signed[0] > RESIGN_AFTER_S:
            url = await self._aws("s3.presign", partial(self.s3.presign, file.key, URL_EXPIRY_S))
            signed = self.signed[file.key] = (now, url)
        return signed[1]

    async def _aws(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await retrying(call, what=what, backoff_s=self.backoff_s)
        except ApiError as error:
            raise FetchError(f"{what}: {error}", reason="listing", transient=error.transient) from None


class MirrorListing:
    """Lists a mirror's model by its model-info answer; a file it gives no size for is asked for it (HEAD)."""

    def __init__(self, source: MirrorSource, *, limits: Limits, backoff_s: Sequence[float] = BACKOFF_S):
        self.source = source
        self.limits = limits
        self.backoff_s = backoff_s
        self.commit: str | None = None

    async def files(self) -> list[RemoteFile]:
        import aiohttp

        limits = self.limits
        self.timeout = aiohttp.ClientTimeout(
            total=limits.total_s, sock_connect=limits.connect_s, sock_read=limits.read_s
        )
        async with aiohttp.ClientSession(trust_env=True) as self.session:
            return await self._files()

    async def _files(self) -> list[RemoteFile]:
        answer = await self._http(partial(self._json, self.source.manifest_url), what="mirror.model_info")
        sha = answer.get("sha") if isinstance(answer, dict) else None
        self.commit = sha if isinstance(sha, str) else None
        try:
            listed = mirror_files(answer)
        except ValueError as error:
            raise FetchError(f"{self.source.manifest_url}: {error}", reason="listing") from None
        files = []
        for path, size, checksums in listed:
            if size is None or not checksums:
                size, found = await self._http(partial(self._head, path), what=f"mirror.head {path}")
                checksums = checksums or found
            files.append(RemoteFile(path=path, size=size, checksums=checksums))
        return files

    async def _json(self, url: str) -> Any:
        async with self.session.get(url, timeout=self.timeout) as response:
            _raise_for(response)
            try:
                return await response.json(content_type=None)
            except ValueError as error:
                raise ApiError(response.status, f"not JSON: {error}", failure="malformed") from None

    async def _head(self, path: str) -> tuple[int, tuple[Any, ...]]:
        # The Hub answers a resolve of an LFS file with a redirect that carries X-Linked-Size and X-Linked-Etag.
        url = self.source.file_url(path)
        async with self.session.head(url, allow_redirects=False, timeout=self.timeout) as response:
            if response.status in (301, 302, 303, 307, 308) and "X-Linked-Size" not in response.headers:
                async with self.session.head(url, timeout=self.timeout) as followed:
                    return _size_and_checksums(followed)
            return _size_and_checksums(response)

    async def url(self, file: RemoteFile) -> str:
        return self.source.file_url(file.path)

    async def _http(self, call: Callable[[], Awaitable[Any]], *, what: str) -> Any:
        import aiohttp

        async def attempt() -> Any:
            try:
                return await call()
            except TimeoutError:
                raise ApiError(0, "no answer in time", failure="timeout") from None
            except aiohttp.ClientError as error:
                raise ApiError(0, f"{type(error).__name__}: {error}") from None

        try:
            return await retrying(attempt, what=what, backoff_s=self.backoff_s)
        except ApiError as error:
            reason = "not_found" if error.status == 404 else "listing"
            raise FetchError(f"{what}: {error}", reason=reason, transient=error.transient) from None


async def _every(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Each call's result, in order, the calls run at once; the first FetchError ends the others."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except* FetchError as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


def _parts_count(head: Mapping[str, str]) -> int:
    """How many parts the object was uploaded in: ``x-amz-mp-parts-count``, which S3 answers to a HEAD with
    ``partNumber`` of a multipart upload only (API_HeadObject.html); 1 where it does not."""
    count = head.get("x-amz-mp-parts-count", "")
    return int(count) if count.isascii() and count.isdigit() and 1 <= int(count) <= MAX_PARTS else 1


def _is_composite(head: Mapping[str, str]) -> bool:
    return head.get("x-amz-checksum-type", "").upper() == "COMPOSITE"


def _length(head: Mapping[str, str]) -> int:
    length = head.get("content-length", "0")
    return int(length) if length.isascii() and length.isdigit() else 0


def _checksums_in(head: Mapping[str, str]) -> dict[str, str]:
    return {kind: head.get(f"x-amz-checksum-{kind}", "") for kind in S3_CHECKSUMS}


def _size_and_checksums(response: aiohttp.ClientResponse) -> tuple[int, tuple[Any, ...]]:
    _raise_for(response)
    size = response.headers.get("X-Linked-Size") or response.headers.get("Content-Length")
    if size is None or not size.isdigit():
        raise ApiError(0, f"{response.url}: no size in the answer", failure="malformed")
    return int(size), http_checksums({k.lower(): v for k, v in response.headers.items()})


def _raise_for(response: aiohttp.ClientResponse) -> None:
    if response.status >= 400:
        raise ApiError(
            response.status,
            f"{response.url}: {response.reason}",
            retry_after_s=retry_after(response.headers.get("Retry-After")),
        )
