"""An S3 bucket server on 127.0.0.1 with just what ``spotdrain cache fetch`` asks of S3, so that ``spotdrain
simulate`` can hydrate a node without moto (a test-only dependency).

Path-style requests only (``http://127.0.0.1:PORT/bucket/key``, boto3's ``addressing_style: path``), answered as
the S3 API reference writes them (https://docs.aws.amazon.com/AmazonS3/latest/API/):

- ListObjectsV2, ``GET /bucket?list-type=2``: ``prefix``, ``start-after``, ``max-keys`` (at most ``max_keys``, 1000
  as on S3), ``continuation-token`` (opaque, here the last key listed) and ``encoding-type=url`` (keys URL-encoded,
  as boto3 asks by default and decodes); ``delimiter`` is answered 501 NotImplemented rather than wrongly.
- HeadBucket, ``HEAD /bucket``: 200 with ``x-amz-bucket-region``.
- HeadObject and GetObject: ``Content-Length``, ``ETag``, ``Last-Modified``, ``Accept-Ranges``; one ``Range`` per GET
  (206 with ``Content-Range``, 416 InvalidRange past the end). With ``x-amz-checksum-mode: ENABLED``, what S3 keeps
  for the object's content, and ``x-amz-checksum-type``
  (https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity.html), never to a ranged GET:

  - an object put in one part (``put``): the quoted MD5 as its ETag and a FULL_OBJECT checksum, the uploader's
    algorithm or the CRC64NVME S3 gives every new object without one since December 2024. ``partNumber=1`` is the
    whole object with a 206 and ``Content-Range``, any other part 416 InvalidPartNumber.
  - a multipart upload (``put_in_parts``): the ETag is the MD5 of the parts' MD5s, ``-N``. A COMPOSITE checksum
    (the default for CRC32, CRC32C, SHA-1 and SHA-256) is answered as the checksum of the parts' checksums, ``-N``;
    a FULL_OBJECT one (CRC64NVME's only kind, and the default of an upload without a checksum, API_ObjectPart.html)
    as the whole content's. ``partNumber=N`` answers the part (206, its ``Content-Range`` and ``Content-Length``) with
    ``x-amz-mp-parts-count`` (API_HeadObject.html) and, for a COMPOSITE checksum, the part's own checksum; for a
    FULL_OBJECT one, none (moto 5.2's ``_set_multipart_part_headers``: "AWS returns the part checksum for COMPOSITE
    checksums, and nothing for FULL_OBJECT checksums"). Where moto differs from S3 (moto answers a composite's plain
    HEAD without its ``-N`` and type, and keeps no CRC64NVME for a multipart upload without a checksum), this follows
    S3's documentation; tests/integration/test_fake_s3.py holds the rest against moto.
- Errors as XML (``<Error><Code>...``; https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html):
  NoSuchKey and NoSuchBucket (404, no body to a HEAD), AccessDenied (403).

Authentication is checked for presence and shape, not for its signature: a request carries either an
``Authorization: AWS4-HMAC-SHA256 Credential=KEY/DATE/REGION/s3/aws4_request, SignedHeaders=..., Signature=...``
header (sigv4-auth-using-authorization-header.html) or the query parameters of a presigned URL, ``X-Amz-Algorithm``,
``X-Amz-Credential``, ``X-Amz-Date``, ``X-Amz-Expires``, ``X-Amz-SignedHeaders`` and ``X-Amz-Signature``
(sigv4-query-string-auth.html), else 403. A presigned URL past ``X-Amz-Date + X-Amz-Expires`` is 403 "Request has
expired". The region in the credential scope must be the bucket's: a request signed for another answers 400
AuthorizationHeaderMalformed (AuthorizationQueryParametersError for a presigned URL) with the bucket's region in
the body and in ``x-amz-bucket-region``, which is what botocore's ``S3RegionRedirectorv2`` follows (a HEAD gets the
400 and the header without a body). Every answer carries ``x-amz-bucket-region``, which the fetch reads from its
listing to sign its URLs for the bucket's own region.

Bodies are sent at ``bytes_per_s`` in all, shared by every open transfer (``Pace``), so a fetch takes the time a
link of that speed would.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import urllib.parse
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from xml.sax.saxutils import escape

from aiohttp import web

from simulate.fakes.mirror import Seen
from simulate.fakes.ranges import Pace, Unsatisfiable, byte_range, content_range, write_chunks

REGION = "us-east-1"
XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
PRESIGNED = (
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
)


CHECKSUMS = ("CRC64NVME", "CRC32C", "CRC32", "SHA1", "SHA256")  # ChecksumAlgorithm's values (API_PutObject.html)


def checksum(data: bytes, algorithm: str) -> bytes:
    """The ``algorithm`` of ``data``, as S3 keeps it (base64 of these bytes)."""
    if algorithm in ("SHA1", "SHA256"):
        return hashlib.new(algorithm.lower(), data).digest()
    if algorithm == "CRC32":
        return zlib.crc32(data).to_bytes(4, "big")
    from awscrt import checksums as crt  # imported where used: `spotdrain simulate` runs without the node extra

    if algorithm == "CRC32C":
        return int(crt.crc32c(data)).to_bytes(4, "big")
    if algorithm == "CRC64NVME":
        return int(crt.crc64nvme(data)).to_bytes(8, "big")
    raise ValueError(f"S3 takes no checksum algorithm {algorithm!r}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True)
class S3Object:
    data: bytes
    etag: str  # quoted, as S3 writes it
    last_modified: datetime
    algorithm: str  # one of CHECKSUMS
    checksum_type: str  # FULL_OBJECT or COMPOSITE
    checksum: str  # base64: the whole content's, or a COMPOSITE's of the parts' checksums (without its -N)
    part_sizes: tuple[int, ...] = ()  # a multipart upload's; () for an object put in one part
    part_checksums: tuple[str, ...] = ()  # base64, each part's own (COMPOSITE)

    @classmethod
    def of(cls, data: bytes, *, now: datetime, algorithm: str = "CRC64NVME") -> S3Object:
        """An object put in one part (PutObject)."""
        md5 = hashlib.md5(data).hexdigest()
        whole = _b64(checksum(data, algorithm))
        return cls(data, f'"{md5}"', now.replace(microsecond=0), algorithm, "FULL_OBJECT", whole)

    @classmethod
    def in_parts(
        cls, data: bytes, *, part_size: int, now: datetime, algorithm: str = "CRC64NVME", checksum_type: str = ""
    ) -> S3Object:
        """A multipart upload in parts of ``part_size`` bytes (the last one shorter), as S3 keeps it once complete
        (https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity-upload.html)."""
        kind = checksum_type or ("FULL_OBJECT" if algorithm == "CRC64NVME" else "COMPOSITE")
        if kind == "COMPOSITE" and algorithm == "CRC64NVME":
            raise ValueError("S3 keeps a CRC64NVME as a FULL_OBJECT checksum only")
        parts = [data[i : i + part_size] for i in range(0, max(len(data), 1), part_size)]
        etag = hashlib.md5(b"".join(hashlib.md5(part).digest() for part in parts)).hexdigest()
        digests = [checksum(part, algorithm) for part in parts] if kind == "COMPOSITE" else []
        whole = checksum(b"".join(digests), algorithm) if digests else checksum(data, algorithm)
        return cls(
            data,
            f'"{etag}-{len(parts)}"',
            now.replace(microsecond=0),
            algorithm,
            kind,
            _b64(whole),
            tuple(map(len, parts)),
            tuple(map(_b64, digests)),
        )

    def checksum_headers(self, part: int | None) -> dict[str, str]:
        """The checksum S3 answers with ``x-amz-checksum-mode: ENABLED``, of the object or of its part ``part``."""
        name = f"x-amz-checksum-{self.algorithm.lower()}"
        if part is not None and self.part_sizes:
            if self.checksum_type != "COMPOSITE":
                return {}
            return {name: self.part_checksums[part - 1], "x-amz-checksum-type": "COMPOSITE"}
        value = f"{self.checksum}-{len(self.part_sizes)}" if self.checksum_type == "COMPOSITE" else self.checksum
        return {name: value, "x-amz-checksum-type": self.checksum_type}

    def part_range(self, part: int) -> tuple[int, int]:
        """The first and last byte of part ``part``; Refused(416) for a part the object does not have."""
        sizes = self.part_sizes or (len(self.data),)
        if not 1 <= part <= len(sizes):
            raise Refused(416, "InvalidPartNumber", "The requested partnumber is not satisfiable")
        first = sum(sizes[: part - 1])
        return first, first + sizes[part - 1] - 1


class Refused(Exception):
    """An S3 error answer: status, code, message, and any further elements of its ``<Error>``."""

    def __init__(self, status: int, code: str, message: str, **extra: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


@dataclass
class FakeS3:
    region: str = REGION
    max_keys: int = 1000  # S3's most keys per ListObjectsV2 page
    bytes_per_s: float | None = None  # every body's bytes, in all; None: no limit
    buckets: dict[str, dict[str, S3Object]] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pace = Pace(self.bytes_per_s)

    def put(self, bucket: str, key: str, data: bytes, *, algorithm: str = "CRC64NVME") -> S3Object:
        """Store an object (creating the bucket), as a single-part PutObject would."""
        return self._store(bucket, key, S3Object.of(data, now=datetime.now(UTC), algorithm=algorithm))

    def put_in_parts(
        self,
        bucket: str,
        key: str,
        data: bytes,
        *,
        part_size: int,
        algorithm: str = "CRC64NVME",
        checksum_type: str = "",
    ) -> S3Object:
        """Store an object as a completed multipart upload in parts of ``part_size`` bytes would leave it."""
        stored = S3Object.in_parts(
            data, part_size=part_size, now=datetime.now(UTC), algorithm=algorithm, checksum_type=checksum_type
        )
        return self._store(bucket, key, stored)

    def _store(self, bucket: str, key: str, stored: S3Object) -> S3Object:
        self.buckets.setdefault(bucket, {})[key] = stored
        return stored

    def set_rate(self, bytes_per_s: float | None) -> None:
        self.pace.bytes_per_s = bytes_per_s

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{bucket}", self._bucket)
        app.router.add_route("*", "/{bucket}/{key:.+}", self._object)
        return app

    async def _bucket(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, key=None)

    async def _object(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, key=request.match_info["key"])

    async def _answer(self, request: web.Request, *, key: str | None) -> web.StreamResponse:
        self.requests.append(Seen(request.method, request.path, request.headers.get("Range")))
        try:
            objects = self._authorized(request)
            if key is None:
                return self._list_or_head_bucket(request, objects)
            return await self._get_or_head(request, objects, key)
        except Refused as refusal:
            return self._error(request, refusal)

    def _authorized(self, request: web.Request) -> dict[str, S3Object]:
        bucket = request.match_info["bucket"]
        objects = self.buckets.get(bucket)
        if objects is None:
            raise Refused(404, "NoSuchBucket", "The specified bucket does not exist", BucketName=bucket)
        region, presigned = _signing_region(request)
        if region != self.region:
            code = "AuthorizationQueryParametersError" if presigned else "AuthorizationHeaderMalformed"
            said = f"the region '{region}' is wrong; expecting '{self.region}'"
            raise Refused(400, code, f"The authorization header is malformed; {said}", Region=self.region)
        return objects

    def _list_or_head_bucket(self, request: web.Request, objects: dict[str, S3Object]) -> web.Response:
        if request.method == "HEAD":
            return web.Response(headers=self._headers())
        if request.method != "GET" or request.query.get("list-type") != "2":
            raise Refused(501, "NotImplemented", "Only ListObjectsV2 and HeadBucket are implemented here")
        if "delimiter" in request.query:
            raise Refused(501, "NotImplemented", "ListObjectsV2 with a delimiter is not implemented here")
        body = list_objects_v2(request.match_info["bucket"], objects, request.query, server_max_keys=self.max_keys)
        return web.Response(body=body, content_type="application/xml", headers=self._headers())

    async def _get_or_head(self, request: web.Request, objects: dict[str, S3Object], key: str) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise Refused(501, "NotImplemented", f"{request.method} of an object is not implemented here")
        found = objects.get(key)
        if found is None:
            raise Refused(404, "NoSuchKey", "The specified key does not exist.", Key=key)
        size = len(found.data)
        status, first, last = 200, 0, size - 1
        if (part := request.query.get("partNumber")) is not None:
            if not (part.isascii() and part.isdigit()):
                raise Refused(400, "InvalidArgument", "Part number must be an integer between 1 and 10000")
            status, (first, last) = 206, found.part_range(int(part))
        else:
            try:
                wanted = byte_range(request.headers.get("Range"), size)
            except Unsatisfiable:
                raise Refused(
                    416, "InvalidRange", "The requested range is not satisfiable", ActualObjectSize=str(size)
                ) from None
            if wanted is not None:
                status, (first, last) = 206, wanted
        headers = {
            **self._headers(),
            "ETag": found.etag,
            "Last-Modified": format_datetime(found.last_modified, usegmt=True),
            "Accept-Ranges": "bytes",
            "Content-Type": "binary/octet-stream",
            "Content-Length": str(last - first + 1),
        }
        if status == 206:
            headers["Content-Range"] = content_range(first, last, size)
        if part is not None and found.part_sizes:
            headers["x-amz-mp-parts-count"] = str(len(found.part_sizes))
        # Not to a ranged GET: its body is not what the checksum is of, and boto3 checks a GET's body against any
        # checksum the answer carries (its response_checksum_validation, "when_supported" by default).
        ranged = request.method == "GET" and status == 206 and part is None
        if request.headers.get("x-amz-checksum-mode", "").upper() == "ENABLED" and not ranged:
            headers |= found.checksum_headers(int(part) if part is not None else None)
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        if request.method == "GET":
            await write_chunks(response, found.data[first : last + 1], after_chunk=self.pace)
        return response

    def _headers(self) -> dict[str, str]:
        return {"x-amz-bucket-region": self.region, "x-amz-request-id": secrets.token_hex(8).upper()}

    def _error(self, request: web.Request, refusal: Refused) -> web.Response:
        headers = self._headers()
        if request.method == "HEAD":  # S3 answers a HEAD's error with the status alone
            return web.Response(status=refusal.status, headers=headers)
        extra = "".join(f"<{name}>{escape(value)}</{name}>" for name, value in refusal.extra.items())
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{refusal.code}</Code>'
            f"<Message>{escape(refusal.message)}</Message>{extra}<RequestId>{headers['x-amz-request-id']}</RequestId>"
            "</Error>"
        )
        return web.Response(status=refusal.status, text=body, content_type="application/xml", headers=headers)


def _signing_region(request: web.Request) -> tuple[str, bool]:
    """The region the request was signed for, and whether by a presigned URL; Refused(403) when it is not signed."""
    header = request.headers.get("Authorization", "")
    if header.startswith("AWS4-HMAC-SHA256 "):
        fields = dict(part.strip().partition("=")[::2] for part in header.removeprefix("AWS4-HMAC-SHA256 ").split(","))
        if fields.get("Credential") and fields.get("SignedHeaders") and fields.get("Signature"):
            return _scope_region(fields["Credential"]), False
    query = request.query
    if all(query.get(name) for name in PRESIGNED):
        if query["X-Amz-Algorithm"] != "AWS4-HMAC-SHA256":
            raise Refused(400, "AuthorizationQueryParametersError", "X-Amz-Algorithm only supports AWS4-HMAC-SHA256")
        _check_expiry(query["X-Amz-Date"], query["X-Amz-Expires"])
        return _scope_region(query["X-Amz-Credential"]), True
    raise Refused(403, "AccessDenied", "Access Denied")


def _scope_region(credential: str) -> str:
    """KEY/DATE/REGION/s3/aws4_request: its region."""
    parts = credential.split("/")
    if len(parts) != 5 or parts[3:] != ["s3", "aws4_request"]:
        raise Refused(400, "AuthorizationHeaderMalformed", f"The credential {credential!r} is malformed")
    return parts[2]


def _check_expiry(date: str, expires: str) -> None:
    try:
        signed = datetime.strptime(date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        seconds = int(expires)
    except ValueError:
        raise Refused(400, "AuthorizationQueryParametersError", "X-Amz-Date or X-Amz-Expires is malformed") from None
    if datetime.now(UTC) > signed + timedelta(seconds=seconds):
        raise Refused(403, "AccessDenied", "Request has expired")


def list_objects_v2(
    bucket: str, objects: Mapping[str, S3Object], query: Mapping[str, str], *, server_max_keys: int
) -> str:
    """One ListObjectsV2 page, as API_ListObjectsV2.html writes its ``ListBucketResult``."""
    prefix = query.get("prefix", "")
    token = query.get("continuation-token")
    after = _token_key(token) if token else query.get("start-after", "")
    max_keys = min(int(query.get("max-keys", server_max_keys)), server_max_keys)
    keys = sorted(k for k in objects if k.startswith(prefix) and k > after)
    page, truncated = keys[:max_keys], len(keys) > max_keys
    url = query.get("encoding-type") == "url"

    def shown(text: str) -> str:
        return escape(urllib.parse.quote(text, safe="/") if url else text)

    contents = "".join(
        f"<Contents><Key>{shown(key)}</Key>"
        f"<LastModified>{objects[key].last_modified.strftime('%Y-%m-%dT%H:%M:%S.000Z')}</LastModified>"
        f"<ETag>{escape(objects[key].etag)}</ETag><Size>{len(objects[key].data)}</Size>"
        "<StorageClass>STANDARD</StorageClass></Contents>"
        for key in page
    )
    elements = [
        f"<Name>{escape(bucket)}</Name>",
        f"<Prefix>{shown(prefix)}</Prefix>",
        f"<KeyCount>{len(page)}</KeyCount>",
        f"<MaxKeys>{max_keys}</MaxKeys>",
        *(["<EncodingType>url</EncodingType>"] if url else []),
        f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>",
        *([f"<ContinuationToken>{escape(token)}</ContinuationToken>"] if token else []),
        *([f"<NextContinuationToken>{_token(page[-1])}</NextContinuationToken>"] if truncated else []),
        *([f"<StartAfter>{shown(query['start-after'])}</StartAfter>"] if "start-after" in query else []),
        contents,
    ]
    body = "".join(elements)
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="{XMLNS}">{body}</ListBucketResult>'


def _token(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode()


def _token_key(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except ValueError:
        raise Refused(400, "InvalidArgument", "The continuation token provided is incorrect") from None
