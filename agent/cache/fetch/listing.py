"""The files of a source, and how to GET each: S3 through boto3 (listing, one HEAD per object, presigned URLs),
a Hugging Face-style mirror through its model-info answer.

boto3 finds credentials by its default chain (IRSA, the environment, IMDSv2); its calls run on worker threads and
are made once each (the retries are ours). Objects are then read with presigned URLs, so the transfers need no
signing per request: a URL is signed once per file and used for every part until it is near its expiry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from agent.cache.fetch.sources import MirrorSource, RemoteFile, S3Source, http_checksums, mirror_files, relative_path
from agent.cache.fetch.transfer import FetchError, Limits
from spotdrain.retry import ApiError, retry_after, retrying

if TYPE_CHECKING:  # imported where a mirror is listed: an S3 fetch, an init container's, starts without it
    import aiohttp

URL_EXPIRY_S = 3600
RESIGN_AFTER_S = 1800  # a URL older than this is signed again before a part uses it
HEADS_AT_ONCE = 8

Resolver = Callable[[RemoteFile], str]


class S3Listing:
    """Lists ``s3://bucket/prefix/`` and signs GETs for its objects."""

    def __init__(self, source: S3Source, *, region: str | None, endpoint_url: str | None, timeout_s: float) -> None:
        self.source = source
        self.endpoint_url = endpoint_url
        self.timeout_s = timeout_s
        self.client = self._client(region)
        self.signed: dict[str, tuple[float, str]] = {}
        self.commit: str | None = None  # S3 has no revisions

    def _client(self, region: str | None) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=self.timeout_s,
            read_timeout=self.timeout_s,
            signature_version="s3v4",
            s3={"addressing_style": "path" if self.endpoint_url else "auto"},
        )
        return boto3.session.Session().client(
            "s3", region_name=region or None, endpoint_url=self.endpoint_url, config=config
        )

    async def files(self) -> list[RemoteFile]:
        objects, region = await _aws("s3.list_objects_v2", self._list)
        if region and region != self.client.meta.region_name:
            self.client = self._client(region)  # presigned URLs must name the bucket's own region
        limit = asyncio.Semaphore(HEADS_AT_ONCE)

        async def described(item: dict[str, Any]) -> RemoteFile:
            async with limit:
                head = await _aws("s3.head_object", lambda: self._head(item["Key"]))
            return self._file(item, head)

        return list(await asyncio.gather(*(described(item) for item in objects)))

    def _list(self) -> tuple[list[dict[str, Any]], str | None]:
        objects: list[dict[str, Any]] = []
        region = None
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.source.bucket, Prefix=self.source.prefix
        ):
            headers = page.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            region = region or headers.get("x-amz-bucket-region")
            objects += [o for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        return objects, region

    def _head(self, key: str) -> dict[str, Any]:
        """HEAD of part 1: its length is the part size a multipart ETag was computed over (a one-part object answers
        whole). A server that does not take ``partNumber`` is asked plainly; its multipart ETags then go unchecked."""
        from botocore.exceptions import ClientError

        try:
            answer: dict[str, Any] = self.client.head_object(
                Bucket=self.source.bucket, Key=key, PartNumber=1, ChecksumMode="ENABLED"
            )
        except ClientError as error:
            if error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (400, 416, 501):
                raise
            answer = self.client.head_object(Bucket=self.source.bucket, Key=key, ChecksumMode="ENABLED")
            answer["ContentLength"] = 0
        return answer

    def _file(self, item: dict[str, Any], head: dict[str, Any]) -> RemoteFile:
        from agent.cache.fetch.sources import S3_WHOLE_CHECKSUMS, s3_checksums

        key = item["Key"]
        try:
            path = relative_path(key[len(self.source.prefix) :])
        except ValueError as error:
            raise FetchError(f"s3://{self.source.bucket}/{key}: {error}", reason="listing") from None
        encrypted = head.get("ServerSideEncryption") == "aws:kms" or bool(head.get("SSECustomerAlgorithm"))
        checksums = s3_checksums(
            etag=str(item.get("ETag", "")),
            part_size=int(head.get("ContentLength", 0)),
            whole_b64={kind: head.get(f"Checksum{kind.upper()}") or "" for kind in S3_WHOLE_CHECKSUMS},
            encrypted=encrypted,
        )
        return RemoteFile(path=path, size=int(item["Size"]), checksums=checksums, key=key)

    def url(self, file: RemoteFile) -> str:
        now = time.monotonic()
        signed = self.signed.get(file.key)
        if signed is None or now - signed[0] > RESIGN_AFTER_S:
            url = self.client.generate_presigned_url(
                "get_object", Params={"Bucket": self.source.bucket, "Key": file.key}, ExpiresIn=URL_EXPIRY_S
            )
            signed = self.signed[file.key] = (now, str(url))
        return signed[1]


async def _aws(what: str, call: Callable[[], Any]) -> Any:
    from botocore.exceptions import BotoCoreError, ClientError

    async def attempt() -> Any:
        try:
            return await asyncio.to_thread(call)
        except ClientError as error:
            # S3 throttles with 503 SlowDown, which the status alone already makes transient.
            raise ApiError(
                int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500)), str(error)
            ) from error
        except BotoCoreError as error:  # no connection, no answer in time, no credentials
            raise ApiError(0, f"{type(error).__name__}: {error}") from error

    try:
        return await retrying(attempt, what=what)
    except ApiError as error:
        raise FetchError(f"{what}: {error}", reason="listing", transient=error.transient) from None


class MirrorListing:
    """Lists a mirror's model by its model-info answer; a file it gives no size for is asked for it (HEAD)."""

    def __init__(self, source: MirrorSource, *, limits: Limits):
        self.source = source
        self.limits = limits
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
        answer = await _http(lambda: self._json(self.source.manifest_url), what="mirror.model_info")
        sha = answer.get("sha") if isinstance(answer, dict) else None
        self.commit = sha if isinstance(sha, str) else None
        try:
            listed = mirror_files(answer)
        except ValueError as error:
            raise FetchError(f"{self.source.manifest_url}: {error}", reason="listing") from None
        files = []
        for path, size, checksums in listed:
            if size is None or not checksums:
                size, found = await _http(lambda p=path: self._head(p), what=f"mirror.head {path}")  # type: ignore[misc]
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

    def url(self, file: RemoteFile) -> str:
        return self.source.file_url(file.path)


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


async def _http(call: Callable[[], Awaitable[Any]], *, what: str) -> Any:
    import aiohttp

    async def attempt() -> Any:
        try:
            return await call()
        except TimeoutError:
            raise ApiError(0, "no answer in time", failure="timeout") from None
        except aiohttp.ClientError as error:
            raise ApiError(0, f"{type(error).__name__}: {error}") from None

    try:
        return await retrying(attempt, what=what)
    except ApiError as error:
        reason = "not_found" if error.status == 404 else "listing"
        raise FetchError(f"{what}: {error}", reason=reason, transient=error.transient) from None
