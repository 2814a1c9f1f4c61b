"""The three S3 calls a fetch makes (ListObjectsV2, HeadObject, a presigned GetObject), without an SDK.

Requests are signed with SigV4 by awscrt, whose default credentials chain is the SDKs': the environment, the shared
config and credentials files (``AWS_PROFILE``), a web identity (IRSA's ``AWS_WEB_IDENTITY_TOKEN_FILE`` and
``AWS_ROLE_ARN``), the container provider (EKS Pod Identity's ``AWS_CONTAINER_CREDENTIALS_FULL_URI`` and token file),
then the instance's role, which is asked for here, through IMDSv2 only. The requests are sent with
``spotdrain.http1``, as the transfers are, through the same proxy and TLS store. awscrt is here already for the
checksums; boto3's import and client took a fetch about 0.3 s of its start (more on a node whose page cache is
cold), where this takes 0.03 s.

Where the bucket lives elsewhere than the region asked for, S3 names its region (the ``x-amz-bucket-region`` header
of a 301, or the ``Region`` of a 400's error), and the call is made again there, as the SDKs do.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import re
import ssl
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from http.client import HTTPException
from typing import Any
from urllib.parse import quote, unquote_plus, urlencode, urlsplit
from xml.etree import ElementTree

from awscrt import auth
from awscrt.exceptions import AwsCrtError
from awscrt.http import HttpHeaders, HttpRequest

from agent.cache.fetch.transfer import FetchError, Limits, answer_head, idle_bounded
from spotdrain import http1
from spotdrain.retry import ApiError, retry_after

DEFAULT_REGION = "us-east-1"
MAX_BODY_BYTES = 16 * 1024 * 1024  # a page of 1,000 keys is about 0.3 MB
_DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")  # a bucket name that can be a host name's label

IMDS = "http://169.254.169.254"
IMDS_TIMEOUT_S = 1.0  # a local service: the SDKs wait 1 s too
ROLE_PATH = "/latest/meta-data/iam/security-credentials/"
ROLE_REFRESH_S = 300
TOKEN_TTL = "X-aws-ec2-metadata-token-ttl-seconds"
# What instance_role raises: no IMDS or an error status (OSError), an answer cut short (HTTPException: a chunked one
# raises IncompleteRead), or an answer that is not the role's credentials.
ROLE_ERRORS = (OSError, HTTPException, ValueError, KeyError, TypeError, AttributeError, RecursionError)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # IMDS is never reached through a proxy
_instance_roles: dict[str, tuple[float, auth.AwsCredentials]] = {}  # by IMDS endpoint: (expiry, credentials)


@dataclass(frozen=True)
class Listed:
    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class Page:
    objects: list[Listed]
    next_token: str | None  # where the next page starts; None on the last


class S3:
    """One bucket's objects, for ``region`` (followed where S3 names the bucket's own) at ``endpoint_url`` (else
    ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, else AWS's own, virtual-hosted where the name allows)."""

    def __init__(self, bucket: str, *, region: str | None, endpoint_url: str | None, limits: Limits) -> None:
        self.bucket = bucket
        self.region = region or profile_region() or DEFAULT_REGION
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.limits = limits
        self.sdk = sdk_chain()
        self.role = False  # the SDK chain had no credentials: the instance role's are taken (and renewed) from IMDS

    def object_url(self, key: str, query: Mapping[str, str] | None = None) -> str:
        """The object's URL (the bucket's, for ``key`` ""), with ``query`` in the order given."""
        path = quote(key, safe="/~")
        domain = "amazonaws.com.cn" if self.region.startswith("cn-") else "amazonaws.com"
        if self.endpoint_url is None and _DNS_BUCKET.fullmatch(self.bucket):
            base = f"https://{self.bucket}.s3.{self.region}.{domain}/{path}"
        else:  # an endpoint of one's own, or a name with dots (a TLS wildcard covers one label): path-style
            root = self.endpoint_url.rstrip("/") if self.endpoint_url else f"https://s3.{self.region}.{domain}"
            base = f"{root}/{self.bucket}" + (f"/{path}" if path else "")
        return f"{base}?{urlencode(query, quote_via=quote, safe='~')}" if query else base  # as SigV4 encodes

    async def list_page(self, prefix: str, token: str | None) -> tuple[Page, str | None]:
        """One page of ListObjectsV2 under ``prefix`` and the region S3 says the bucket is in, if it says."""
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        if token is not None:
            query["continuation-token"] = token
        headers, body = await self.call("GET", "", query)
        return parse_list(body), headers.get("x-amz-bucket-region")

    async def head(self, key: str, part_number: int | None = None) -> Mapping[str, str]:
        """HeadObject's headers, with the checksums S3 keeps for the object (``x-amz-checksum-mode``)."""
        query = {"partNumber": str(part_number)} if part_number is not None else None
        headers, _ = await self.call("HEAD", key, query, {"x-amz-checksum-mode": "ENABLED"})
        return headers

    async def presign(self, key: str, expires_s: int) -> str:
        """A GET of the object that needs no signing of its own for ``expires_s``."""
        url, _ = await self._signed("GET", self.object_url(key), {}, expires_s=expires_s)
        return url

    async def call(
        self, method: str, key: str, query: Mapping[str, str] | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[Mapping[str, str], bytes]:
        """The headers (names in lower case) and body of the answer to a signed request; ApiError for an error
        status (S3's code and message), for no answer in time or none at all, and for one that cannot be read."""
        followed = False
        while True:
            url, signed = await self._signed(method, self.object_url(key, query), headers or {})
            status, reason, answer, body = await _request(method, url, signed, self.limits)
            if status < 300:
                return answer, body
            code, message, region = parse_error(body)
            region = answer.get("x-amz-bucket-region") or region
            if status in (301, 307, 400) and region and region != self.region and not followed:
                self.region, followed = region, True  # the bucket's own: asked again there, once
                continue
            detail = f"{code}: {message}" if code else reason
            raise ApiError(status, detail, retry_after_s=retry_after(answer.get("Retry-After")))

    async def _credentials(self) -> auth.AwsCredentialsProvider:
        """What to sign with: the SDK chain's credentials, else the instance role's through IMDSv2 (unless
        ``AWS_EC2_METADATA_DISABLED=true``); ApiError where there are none."""
        if not self.role:
            try:
                await asyncio.wrap_future(self.sdk.get_credentials())
                return self.sdk
            except AwsCrtError as error:
                if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
                    raise ApiError(0, f"no credentials to sign with: {error.name}: {error.message}") from None
        try:
            found = await asyncio.to_thread(instance_role)
        except ROLE_ERRORS as error:
            why = f"none in the environment, profiles, web identity or container, nor from IMDSv2: {error}"
            raise ApiError(0, f"no credentials to sign with: {why}") from None
        self.role = True
        return auth.AwsCredentialsProvider.new_static(found.access_key_id, found.secret_access_key, found.session_token)

    async def _signed(
        self, method: str, url: str, headers: Mapping[str, str], *, expires_s: int | None = None
    ) -> tuple[str, dict[str, str]]:
        """The URL and headers of the request, signed: in the query where ``expires_s`` is given, else in headers."""
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        request = HttpRequest(method, target, HttpHeaders([("Host", parts.netloc), *headers.items()]))
        how: dict[str, Any] = (
            {  # presigned: the signature in the query, the body unsigned
                "signature_type": auth.AwsSignatureType.HTTP_REQUEST_QUERY_PARAMS,
                "signed_body_value": auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD,
                "expiration_in_seconds": expires_s,
            }
            if expires_s is not None
            else {
                "signature_type": auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
                "signed_body_value": auth.AwsSignedBodyValue.EMPTY_SHA256,
                "signed_body_header_type": auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
            }
        )
        try:
            async with asyncio.timeout(self.limits.total_s):
                config = auth.AwsSigningConfig(
                    credentials_provider=await self._credentials(),
                    region=self.region,
                    service="s3",
                    use_double_uri_encode=False,  # S3's paths are encoded once (unlike every other service's)
                    should_normalize_uri_path=False,
                    **how,
                )
                await asyncio.wrap_future(auth.aws_sign_request(request, config))
        except AwsCrtError as error:  # the credentials' source failed
            raise ApiError(0, f"no credentials to sign with: {error.name}: {error.message}") from None
        except TimeoutError:
            raise ApiError(0, "no credentials to sign with in time", failure="timeout") from None
        signed = {name: value for name, value in request.headers if name.lower() != "host"}
        return f"{parts.scheme}://{parts.netloc}{request.path}", signed


async def _request(
    method: str, url: str, headers: Mapping[str, str], limits: Limits
) -> tuple[int, str, Mapping[str, str], bytes]:
    """Status, reason, headers (names in lower case) and body of one request, its redirects not followed (S3 names a
    region rather than a place); ApiError where there is no whole answer. A certificate the system's store does not
    trust is not worth a retry: FetchError at once."""
    answer: http1.Answer | None = None
    try:
        async with asyncio.timeout(limits.total_s):
            answer = await answer_head(url, headers, limits, method=method, follow=False)
            body = bytearray()
            if method != "HEAD":
                async for block in idle_bounded(answer, limits.read_s):
                    body += block
                    if len(body) > MAX_BODY_BYTES:
                        raise http1.BadAnswer(f"a body longer than {MAX_BODY_BYTES} bytes")
        return answer.status, answer.reason, {k.lower(): v for k, v in answer.headers.items()}, bytes(body)
    except TimeoutError:
        raise ApiError(0, "no answer in time", failure="timeout") from None
    except ssl.SSLCertVerificationError as error:
        raise FetchError(f"{urlsplit(url).netloc}: {error}", reason="listing") from None
    except OSError as error:
        raise ApiError(0, f"{type(error).__name__}: {error}") from None
    except http1.BadAnswer as error:
        raise ApiError(0, str(error), failure="malformed") from None
    finally:
        if answer is not None:
            answer.close()


def parse_list(body: bytes) -> Page:
    """A ListObjectsV2 answer's objects (folder markers, keys ending in "/", left out) and where the next page
    starts; ApiError(malformed) for anything else, whatever the bytes."""
    root = _xml(body)
    ns = _namespace(root)
    if root.tag != f"{ns}ListBucketResult":
        raise ApiError(200, f"not a ListBucketResult but {root.tag[len(ns) :][:40]!r}", failure="malformed")
    decode = root.findtext(f"{ns}EncodingType") == "url"
    objects = []
    for item in root.iterfind(f"{ns}Contents"):
        key, size = item.findtext(f"{ns}Key"), item.findtext(f"{ns}Size") or ""
        if key is None or not size.isascii() or not size.isdigit():
            raise ApiError(200, "a listed object without a key or a size", failure="malformed")
        key = unquote_plus(key) if decode else key
        if not key.endswith("/"):
            objects.append(Listed(key, int(size), item.findtext(f"{ns}ETag") or ""))
    token = root.findtext(f"{ns}NextContinuationToken")
    if root.findtext(f"{ns}IsTruncated") != "true":
        return Page(objects, None)
    if not token:
        raise ApiError(200, "a truncated listing without a continuation token", failure="malformed")
    return Page(objects, token)


def parse_error(body: bytes) -> tuple[str, str, str]:
    """The ``Code``, ``Message`` and ``Region`` of S3's error document; empty where there is none."""
    try:
        root = _xml(body)
    except ApiError:
        return "", "", ""
    ns = _namespace(root)
    fields = (root.findtext(f"{ns}{name}") or "" for name in ("Code", "Message", "Region"))
    code, message, region = (value.strip()[:300] for value in fields)
    return code, message, region


def _xml(body: bytes) -> ElementTree.Element:
    try:
        return ElementTree.fromstring(body)
    except (ElementTree.ParseError, ValueError, RecursionError) as error:
        raise ApiError(200, f"not XML: {error}"[:200], failure="malformed") from None


def _namespace(root: ElementTree.Element) -> str:
    tag: Any = root.tag
    return tag[: tag.index("}") + 1] if isinstance(tag, str) and tag.startswith("{") else ""


def sdk_chain() -> auth.AwsCredentialsProvider:
    """The SDKs' default chain without its last step, the instance role through IMDS, which ``S3._credentials`` takes
    through IMDSv2 alone: awscrt's own falls back to IMDSv1 when IMDS refuses a token, even with
    ``AWS_EC2_METADATA_V1_DISABLED`` set (seen with awscrt 0.38 against a fake IMDS)."""
    disabled = os.environ.get("AWS_EC2_METADATA_DISABLED")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # read once, as the chain is made
    try:
        return auth.AwsCredentialsProvider.new_default_chain()
    finally:
        if disabled is None:
            del os.environ["AWS_EC2_METADATA_DISABLED"]
        else:
            os.environ["AWS_EC2_METADATA_DISABLED"] = disabled


def instance_role() -> auth.AwsCredentials:
    """The instance role's credentials from IMDSv2 (at ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, else 169.254.169.254),
    kept until five minutes before they expire. Blocks, each request for IMDS_TIMEOUT_S at the most; raises one of
    ROLE_ERRORS where there are none."""
    base = (os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or IMDS).rstrip("/")
    known = _instance_roles.get(base)
    if known is not None and known[0] - time.time() > ROLE_REFRESH_S:
        return known[1]
    token = {"X-aws-ec2-metadata-token": _imds(base, "PUT", "/latest/api/token", {TOKEN_TTL: "21600"})}
    role = _imds(base, "GET", ROLE_PATH, token).partition("\n")[0].strip()
    document = json.loads(_imds(base, "GET", f"{ROLE_PATH}{quote(role)}", token))
    expiry = datetime.fromisoformat(document["Expiration"].replace("Z", "+00:00"))
    found = auth.AwsCredentials(document["AccessKeyId"], document["SecretAccessKey"], document.get("Token"), expiry)
    _instance_roles[base] = (expiry.timestamp(), found)
    return found


def _imds(base: str, method: str, path: str, headers: dict[str, str]) -> str:
    request = urllib.request.Request(base + path, method=method, headers=headers)
    with _DIRECT.open(request, timeout=IMDS_TIMEOUT_S) as answer:  # HTTPError for any error status
        text: str = answer.read(64 * 1024).decode()
        return text


def profile_region() -> str | None:
    """The ``region`` of the shared config file's profile (``AWS_CONFIG_FILE``, else ~/.aws/config; ``AWS_PROFILE``,
    else default), as the SDKs find it where no region is set; None where there is none to read."""
    path = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    profile = os.environ.get("AWS_PROFILE") or "default"
    config = configparser.RawConfigParser(strict=False)
    try:
        config.read(path, encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError):
        return None
    section = profile if profile == "default" else f"profile {profile}"
    region = config.get(section, "region", fallback=None)
    return region.strip() or None if region else None
