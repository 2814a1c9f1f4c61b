"""The simulation's S3 (``simulate.fakes.s3``) against boto3 itself, and ``spotdrain cache fetch`` against it: what
the fetch relies on must answer as S3 does, or the cold-start scenario proves nothing."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from agent.cache.fetch.parts import MANIFEST
from simulate.fakes.imds import serving
from simulate.fakes.s3 import FakeS3
from simulate.model import copy_problems, expected, read_copy, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["m/a.bin", "m/b c+d.bin", "m/sub/e.json", "m/f.bin", "m/g.bin", "other/h.bin"]


@pytest.fixture
async def s3() -> AsyncIterator[tuple[FakeS3, str]]:
    fake = FakeS3(max_keys=2)
    for index, key in enumerate(KEYS):
        fake.put("bucket", key, bytes([index]) * (1000 + index))
    async with serving(fake) as url:
        yield fake, url


def client(url: str, *, region: str = "us-east-1") -> Any:
    config = Config(s3={"addressing_style": "path"}, signature_version="s3v4", retries={"total_max_attempts": 1})
    return boto3.client(
        "s3",
        region_name=region,
        endpoint_url=url,
        aws_access_key_id="AKIATEST",
        aws_secret_access_key="secret",
        config=config,
    )


def listed(s3: Any, prefix: str) -> list[dict[str, Any]]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="bucket", Prefix=prefix)
    return [item for page in pages for item in page.get("Contents", [])]


async def test_boto3_lists_a_prefix_across_pages_with_keys_that_need_encoding(s3: tuple[FakeS3, str]) -> None:
    fake, url = s3
    objects = await asyncio.to_thread(listed, client(url), "m/")
    assert [o["Key"] for o in objects] == sorted(k for k in KEYS if k.startswith("m/"))
    assert [o["Size"] for o in objects] == [1000 + KEYS.index(o["Key"]) for o in objects]
    assert all(o["ETag"] == fake.buckets["bucket"][o["Key"]].etag for o in objects)
    assert len([seen for seen in fake.requests if seen.method == "GET"]) == 3, "5 keys at 2 a page"
    first = await asyncio.to_thread(client(url).list_objects_v2, Bucket="bucket", Prefix="m/", StartAfter="m/f.bin")
    assert [o["Key"] for o in first["Contents"]] == ["m/g.bin", "m/sub/e.json"]
    assert first["IsTruncated"] is False


async def test_boto3_heads_and_gets_ranges_and_a_missing_key_is_no_such_key(s3: tuple[FakeS3, str]) -> None:
    _, url = s3
    s3_client = client(url)
    data = bytes([1]) * 1001
    head = await asyncio.to_thread(s3_client.head_object, Bucket="bucket", Key="m/b c+d.bin")
    assert head["ContentLength"] == 1001
    assert head["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    assert head["LastModified"].tzinfo is not None
    assert head["ResponseMetadata"]["HTTPHeaders"]["x-amz-bucket-region"] == "us-east-1"
    assert "ChecksumCRC64NVME" not in head, "S3 gives checksums only to who asks for them"
    part = await asyncio.to_thread(
        s3_client.head_object, Bucket="bucket", Key="m/b c+d.bin", PartNumber=1, ChecksumMode="ENABLED"
    )
    assert (part["ContentLength"], part["ResponseMetadata"]["HTTPStatusCode"]) == (1001, 206)
    assert base64.b64decode(part["ChecksumCRC64NVME"]).hex() == expected({"x": data})["x"].crc64nvme
    assert part["ChecksumType"] == "FULL_OBJECT"
    whole = await asyncio.to_thread(s3_client.get_object, Bucket="bucket", Key="m/b c+d.bin", ChecksumMode="ENABLED")
    assert whole["Body"].read() == data, "botocore checked the body against the CRC64NVME it came with"
    ranged = await asyncio.to_thread(s3_client.get_object, Bucket="bucket", Key="m/b c+d.bin", Range="bytes=10-19")
    assert ranged["ContentRange"] == "bytes 10-19/1001"
    assert ranged["Body"].read() == data[10:20]
    tail = await asyncio.to_thread(s3_client.get_object, Bucket="bucket", Key="m/b c+d.bin", Range="bytes=-5")
    assert tail["ContentRange"] == "bytes 996-1000/1001"
    for call in (s3_client.get_object, s3_client.head_object):
        with pytest.raises(ClientError) as missing:
            await asyncio.to_thread(call, Bucket="bucket", Key="m/none")
        assert missing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert missing.value.response["Error"]["Code"] == "404"  # a HEAD's error has no body
    with pytest.raises(s3_client.exceptions.NoSuchKey):
        await asyncio.to_thread(s3_client.get_object, Bucket="bucket", Key="m/none")
    with pytest.raises(ClientError, match="InvalidRange"):
        await asyncio.to_thread(s3_client.get_object, Bucket="bucket", Key="m/a.bin", Range="bytes=5000-")
    with pytest.raises(ClientError, match="NoSuchBucket"):
        await asyncio.to_thread(client(url).list_objects_v2, Bucket="nope")


async def test_a_presigned_url_is_taken_and_a_request_without_its_parameters_or_past_its_expiry_is_refused(
    s3: tuple[FakeS3, str],
) -> None:
    _, url = s3
    presigned = client(url).generate_presigned_url("get_object", Params={"Bucket": "bucket", "Key": "m/a.bin"})
    expired = re.sub(r"X-Amz-Date=\d{8}T\d{6}Z", "X-Amz-Date=20200101T000000Z", presigned)  # an hour's URL, years on
    unsigned = presigned.replace("X-Amz-Signature=", "X-Amz-Nothing=")
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(presigned, headers={"Range": "bytes=0-9"}) as answer:
            assert (answer.status, await answer.read()) == (206, bytes(10))
        for refused, reason in (
            (unsigned, "Access Denied"),
            (expired, "Request has expired"),
            (f"{url}/bucket/m/a.bin", "Access Denied"),
        ):
            async with session.get(refused) as answer:
                assert answer.status == 403
                assert f"<Message>{reason}</Message>" in await answer.text()


async def test_a_client_of_another_region_is_sent_to_the_buckets_own(s3: tuple[FakeS3, str]) -> None:
    fake, url = s3
    objects = await asyncio.to_thread(listed, client(url, region="eu-west-1"), "m/")
    assert len(objects) == 5
    listings = [seen for seen in fake.requests if seen.method == "GET"]
    assert len(listings) == 4, "one refused for its region, then botocore's redirect signs the three pages right"


async def test_bodies_share_the_servers_rate(s3: tuple[FakeS3, str]) -> None:
    fake, url = s3
    fake.put("bucket", "big", os.urandom(400_000))
    fake.set_rate(1_000_000)
    presigned = [
        client(url).generate_presigned_url("get_object", Params={"Bucket": "bucket", "Key": "big"}) for _ in range(2)
    ]
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:

        async def get(link: str) -> int:
            async with session.get(link) as answer:
                return len(await answer.read())

        began = loop.time()
        assert await asyncio.gather(*(get(link) for link in presigned)) == [400_000, 400_000]
    assert loop.time() - began >= 0.75, "800 kB at 1 MB/s in all take 0.8 s, however many connections"


async def test_spotdrain_cache_fetch_copies_the_checkpoint_whole_and_checked_from_a_region_it_was_not_told(
    tmp_path: Path,
) -> None:
    files = tiny_checkpoint()
    fake = FakeS3(region="eu-central-1", max_keys=2)
    for path, data in files.items():
        fake.put("models", f"llama-tiny/{path}", data)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": "AKIATEST", "AWS_SECRET_ACCESS_KEY": "x"}
    env |= {"AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    async with serving(fake) as url:
        argv = [sys.executable, "-m", "spotdrain.cli", "cache", "fetch", "s3://models/llama-tiny/", "--name", "tiny"]
        argv += ["--wait", "--model-cache-path", str(cache), "--aws-endpoint-url", url, "--aws-region", "us-east-1"]
        argv += ["--part-size-mib", "1", "--request-timeout", "5"]
        process = await asyncio.create_subprocess_exec(*argv, env=env, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    target = cache / "models" / "tiny"
    found, manifest = read_copy(target)
    assert copy_problems(expected(files), found, manifest) == []
    checks = {entry["path"]: entry["checksum"] for entry in json.loads((target / MANIFEST).read_text())["files"]}
    crcs = expected(files)
    assert checks == {path: {"kind": "crc64nvme", "value": crcs[path].crc64nvme} for path in files}, "S3's cheapest"
    # Told the wrong region, it followed the bucket's: URLs signed for us-east-1 would have been refused.
    shard = "model-00001-of-00002.safetensors"
    ranges = sorted(seen.range or "" for seen in fake.requests if seen.method == "GET" and seen.path.endswith(shard))
    assert ranges == ["bytes=0-1048575", f"bytes=1048576-{len(files[shard]) - 1}"]
