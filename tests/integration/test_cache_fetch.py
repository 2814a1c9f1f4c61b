"""``spotdrain cache fetch`` against moto's S3 (behind a front that can misbehave) and a Hugging Face-style mirror:
what lands, what is checked, and what faults, kills and full disks leave behind."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import ssl
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import botocore.config
import moto.s3 as moto_s3
import pytest
from awscrt import checksums as crt
from structlog.testing import capture_logs

from agent.cache.fetch.download import _start_writeback
from agent.cache.fetch.parts import MANIFEST, PROGRESS
from agent.cache.fetch.run import fetch, fetch_until_done
from agent.cache.fetch.settings import MIB, FetchSettings
from agent.cache.fetch.sources import MirrorSource, S3Source, Source
from agent.cache.fetch.staging import write_json
from agent.cache.fetch.transfer import FetchError
from simulate.fakes.aws import REGION, MotoServer
from simulate.fakes.mirror import FaultyServer
from simulate.fakes.processes import free_port
from spotdrain import http1
from tests.conftest import serving_app

ROOT = Path(__file__).resolve().parents[2]


def safetensors(size: int, *, seed: int) -> bytes:
    """A real safetensors file: one F32 tensor of ``size`` bytes after its header."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size // 4 * 4]}}).encode()
    return struct.pack("<Q", len(header)) + header + os.urandom(size // 4 * 4)[:0] + bytes([seed]) * (size // 4 * 4)


MODEL = {
    "model-00001-of-00002.safetensors": safetensors(MIB + MIB // 2, seed=1),
    "model-00002-of-00002.safetensors": safetensors(MIB // 2 + 17, seed=2),
    "big.bin": os.urandom(6 * MIB + 5),  # multipart-uploaded in 2 MiB parts: fetched as 7 parts of 1 MiB
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
}
# How each object is uploaded with a checksum S3 keeps beside it (the others: big.bin multipart, with its ETag
# alone; tokenizer.json without a checksum, so its MD5 ETag).
ALGORITHMS = {
    "model-00001-of-00002.safetensors": "CRC64NVME",
    "model-00002-of-00002.safetensors": "CRC32C",
    "config.json": "SHA256",
}


@pytest.fixture(scope="module")
def bucket(moto: MotoServer) -> str:
    """One bucket for the module's tests, which only read it."""
    s3 = moto.client("s3")
    etag_only = moto.client("s3", config=botocore.config.Config(request_checksum_calculation="when_required"))
    name = f"models-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moto_s3.models, "S3_UPLOAD_PART_MIN_SIZE", MIB)  # S3's is 5 MiB: smaller parts, faster tests
        for path, data in MODEL.items():
            if path in ALGORITHMS:
                s3.put_object(Bucket=name, Key=f"llama/{path}", Body=data, ChecksumAlgorithm=ALGORITHMS[path])
                continue
            if path != "big.bin":  # an uploader that sends no checksum: the object has its MD5 ETag alone
                etag_only.put_object(Bucket=name, Key=f"llama/{path}", Body=data)
                continue
            key = f"llama/{path}"
            upload = s3.create_multipart_upload(Bucket=name, Key=key)["UploadId"]
            parts = [
                {
                    "PartNumber": n + 1,
                    "ETag": s3.upload_part(
                        Bucket=name,
                        Key=key,
                        UploadId=upload,
                        PartNumber=n + 1,
                        Body=data[n * 2 * MIB : (n + 1) * 2 * MIB],
                    )["ETag"],
                }
                for n in range(4)
            ]
            s3.complete_multipart_upload(Bucket=name, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
    assert s3.head_object(Bucket=name, Key="llama/big.bin")["ETag"].endswith('-4"')
    return name


@pytest.fixture
async def front(moto: MotoServer, aws_credentials: None) -> AsyncIterator[tuple[FaultyServer, str]]:
    server = FaultyServer(upstream=moto.endpoint_url)
    async with serving_app(server.app()) as port:
        yield server, f"http://127.0.0.1:{port}"


@pytest.fixture
async def mirror() -> AsyncIterator[tuple[FaultyServer, str]]:
    server = FaultyServer(files=dict(MODEL), repo="org/llama", revision="v1", root="/hub")
    async with serving_app(server.app()) as port:
        yield server, f"http://127.0.0.1:{port}/hub"


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    return path


def settings_for(source: Source, cache: Path, endpoint: str | None = None, **changes: Any) -> FetchSettings:
    settings = FetchSettings(
        source=source,
        name="llama",
        cache_path=cache,
        aws_endpoint_url=endpoint,
        aws_region=REGION,
        concurrency=4,
        part_size_bytes=MIB,
        wait=False,
        request_timeout_s=2.0,
        progress_interval_s=5.0,
        backoff_s=(0.01, 0.02, 0.05),
        wait_backoff_s=(0.05,),
    )
    return dataclasses.replace(settings, **changes)


def s3_settings(bucket: str, cache: Path, front: tuple[FaultyServer, str], **changes: Any) -> FetchSettings:
    return settings_for(S3Source(bucket, "llama/"), cache, front[1], **changes)


def mirror_settings(mirror: tuple[FaultyServer, str], cache: Path, **changes: Any) -> FetchSettings:
    return settings_for(MirrorSource(mirror[1], "org/llama", "v1"), cache, **changes)


def assert_published_whole(cache: Path, name: str = "llama") -> dict[str, Any]:
    target = cache / "models" / name
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == {*MODEL, MANIFEST}
    for path, data in MODEL.items():
        assert (target / path).read_bytes() == data, path
    assert list((cache / "models" / ".staging").iterdir()) == []
    record: dict[str, Any] = json.loads((target / MANIFEST).read_text())
    return record


async def test_an_s3_prefix_lands_whole_with_a_manifest_of_what_each_file_was_checked_against(
    bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    with capture_logs() as logs:
        assert await fetch(s3_settings(bucket, cache, front)) == cache / "models" / "llama"
    record = assert_published_whole(cache)
    checks = {entry["path"]: entry["checksum"] for entry in record["files"]}
    assert checks["big.bin"]["kind"] == "s3-multipart"
    assert checks["big.bin"]["part_size"] == 2 * MIB
    assert checks["tokenizer/tokenizer.json"]["kind"] == "md5"
    assert checks["config.json"] == {"kind": "sha256", "value": hashlib.sha256(MODEL["config.json"]).hexdigest()}
    first, second = MODEL["model-00001-of-00002.safetensors"], MODEL["model-00002-of-00002.safetensors"]
    assert checks["model-00001-of-00002.safetensors"] == {
        "kind": "crc64nvme",
        "value": crt.crc64nvme(first).to_bytes(8, "big").hex(),
    }
    assert checks["model-00002-of-00002.safetensors"] == {
        "kind": "crc32c",
        "value": crt.crc32c(second).to_bytes(4, "big").hex(),
    }
    assert {entry["path"]: entry["size"] for entry in record["files"]} == {p: len(d) for p, d in MODEL.items()}
    assert record["source"] == f"s3://{bucket}/llama/"
    assert record["fetched_at"].endswith("Z")
    assert (record["revision"], record["commit"]) == (None, None)
    # Ranged GETs of at most a part each; every byte asked for once.
    assert sorted(r or "" for r in front[0].ranges("big.bin")) == [
        f"bytes={i * MIB}-{min((i + 1) * MIB, 6 * MIB + 5) - 1}" for i in range(7)
    ]
    summary = next(log for log in logs if log["event"] == "cache.fetched")
    assert summary["bytes"] == sum(map(len, MODEL.values()))
    assert summary["files"] == len(MODEL)


async def test_a_model_already_present_is_returned_at_once_and_a_damaged_one_is_fetched_again(
    bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    settings = s3_settings(bucket, cache, front)
    await fetch(settings)
    front[0].requests.clear()
    with capture_logs() as logs:
        await fetch(settings)
    assert front[0].requests == []
    assert [log["event"] for log in logs] == ["cache.model_present"]
    with (cache / "models" / "llama" / "big.bin").open("r+b") as damaged:
        damaged.truncate(MIB)
    await fetch(settings)
    assert_published_whole(cache)


@pytest.mark.parametrize("fault", ["drop", "503", "500", "hang", "stall"])
async def test_a_part_that_fails_is_asked_for_again_and_the_model_is_identical(
    fault: str, bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    front[0].fail(fault, "big.bin", times=2)
    front[0].fail(fault, "config.json")
    await fetch(s3_settings(bucket, cache, front, request_timeout_s=0.5))
    assert_published_whole(cache)
    assert len(front[0].ranges("big.bin")) == 7 + 2
    assert len(front[0].ranges("config.json")) == 2


async def test_a_file_with_wrong_bytes_is_fetched_again_and_twice_wrong_is_an_error_naming_it(
    bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    front[0].fail("wrong", "config.json")
    front[0].fail("wrong", "model-00001-of-00002.safetensors")  # its CRC64NVME taken as the bytes arrive
    # A GET timed out on a loaded machine is asked again and its fault is spent: only wrong bytes may refetch here.
    settings = s3_settings(bucket, cache, front, request_timeout_s=60.0)
    await fetch(settings)
    assert_published_whole(cache)
    assert len(front[0].ranges("model-00001-of-00002.safetensors")) == 2 + 2  # the whole file again

    front[0].fail("wrong", "tokenizer.json", times=2)
    with pytest.raises(FetchError, match=r"tokenizer/tokenizer\.json: md5 .* \(fetched twice\)") as raised:
        await fetch(dataclasses.replace(settings, name="other"))
    assert raised.value.reason == "checksum"
    assert not (cache / "models" / "other").exists()


async def test_a_listed_file_that_is_not_found_is_an_error_naming_it(
    bucket: str, cache: Path, front: tuple[FaultyServer, str], mirror: tuple[FaultyServer, str]
) -> None:
    front[0].fail("404", "big.bin", times=20)
    with pytest.raises(FetchError, match=r"^big\.bin: listed by the source, but not found there") as raised:
        await fetch(s3_settings(bucket, cache, front))
    assert raised.value.reason == "not_found"
    mirror[0].listed_only.add("config.json")
    with pytest.raises(FetchError, match=r"^config\.json: listed by the source, but not found there"):
        await fetch(mirror_settings(mirror, cache))
    assert not (cache / "models" / "llama").exists()


async def test_a_mirror_model_is_checked_by_sha256_and_git_blob_ids(
    cache: Path, mirror: tuple[FaultyServer, str]
) -> None:
    await fetch(mirror_settings(mirror, cache))
    record = assert_published_whole(cache)
    kinds = {entry["path"]: entry["checksum"]["kind"] for entry in record["files"]}
    assert kinds["model-00001-of-00002.safetensors"] == kinds["big.bin"] == "sha256"
    assert kinds["config.json"] == "git-sha1"
    assert (record["revision"], record["commit"]) == ("v1", "0" * 40)
    assert mirror[0].ranges("config.json") == [f"bytes=0-{len(MODEL['config.json']) - 1}"]


async def test_a_mirror_that_drops_and_corrupts_once_still_gives_the_identical_model(
    cache: Path, mirror: tuple[FaultyServer, str]
) -> None:
    mirror[0].fail("drop", "big.bin")
    mirror[0].fail("wrong", "model-00001-of-00002.safetensors")
    await fetch(mirror_settings(mirror, cache))
    assert_published_whole(cache)
    assert len(mirror[0].ranges("big.bin")) == 7 + 1
    assert len(mirror[0].ranges("model-00001-of-00002.safetensors")) == 2 + 2  # the whole file again


async def test_a_mirror_that_sends_its_files_on_to_a_cdn_in_chunks_gives_the_identical_model(
    cache: Path, mirror: tuple[FaultyServer, str]
) -> None:
    """The Hub's LFS files come from its CDN after a 302; a body without a Content-Length is taken chunk by chunk."""
    mirror[0].cdn = mirror[0].chunked = True
    mirror[0].sizeless.add("big.bin")  # its size from the redirect's X-Linked-Size
    mirror[0].fail("drop", "/cdn/big.bin")
    await fetch(mirror_settings(mirror, cache))
    assert_published_whole(cache)
    gets = [seen.path.removeprefix("/hub/") for seen in mirror[0].requests if seen.method == "GET"]
    assert gets.count("cdn/big.bin") == gets.count("org/llama/resolve/v1/big.bin") == 7 + 1
    assert "cdn/config.json" not in gets  # not an LFS file: no redirect


async def test_a_range_answered_with_a_200_naming_it_is_taken_and_one_ignored_is_refused(
    cache: Path, mirror: tuple[FaultyServer, str]
) -> None:
    mirror[0].range_status = 200  # as rclone serve s3 answers a ranged GET
    await fetch(mirror_settings(mirror, cache))
    assert_published_whole(cache)
    assert len(mirror[0].ranges("big.bin")) == 7
    shutil.rmtree(cache / "models" / "llama")
    mirror[0].range_status = None  # the whole file for every part: never written at a part's offset
    with pytest.raises(FetchError, match=r"big\.bin|got HTTP 200"):
        await fetch(mirror_settings(mirror, cache))
    assert not (cache / "models" / "llama").exists()


async def test_a_mirror_file_without_size_in_the_listing_is_asked_for_it(
    cache: Path, mirror: tuple[FaultyServer, str]
) -> None:
    mirror[0].sizeless |= {"big.bin", "config.json"}
    await fetch(mirror_settings(mirror, cache))
    record = assert_published_whole(cache)
    heads = [seen.path.rpartition("/")[2] for seen in mirror[0].requests if seen.method == "HEAD"]
    assert sorted(heads) == ["big.bin", "config.json"]
    kinds = {entry["path"]: entry["checksum"]["kind"] for entry in record["files"]}
    assert kinds["big.bin"] == "sha256"  # from X-Linked-Etag
    assert kinds["config.json"] == "git-sha1"  # from the ETag, as the Hub sends a small file's


async def test_a_safetensors_file_whose_header_does_not_parse_is_never_published(
    cache: Path, mirror: tuple[FaultyServer, str]
) -> None:
    mirror[0].files["model-00002-of-00002.safetensors"] = struct.pack("<Q", 10**9) + b"{}"
    with pytest.raises(FetchError, match=r"model-00002-of-00002\.safetensors: safetensors header length"):
        await fetch(mirror_settings(mirror, cache))
    assert not (cache / "models" / "llama").exists()


async def test_two_fetches_of_one_name_share_one_download(
    bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    front[0].chunk_delay_s = 0.005
    settings = s3_settings(bucket, cache, front)
    seen: list[bool] = []

    async def watch() -> None:
        """What an engine starting at any moment would find: nothing, or the whole model."""
        target = cache / "models" / "llama"
        while True:
            sizes = {str(p.relative_to(target)): p.stat().st_size for p in target.rglob("*") if p.is_file()}
            seen.append(bool(sizes))
            if sizes:
                assert sizes == {**{p: len(d) for p, d in MODEL.items()}, MANIFEST: sizes[MANIFEST]}
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    with capture_logs() as logs:
        first = asyncio.create_task(fetch(settings))
        while not _done_parts(cache):  # the first holds the lock and is downloading
            await asyncio.sleep(0.005)
        second = asyncio.create_task(fetch(settings))
        await asyncio.gather(first, second)
    await asyncio.sleep(0.02)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert seen[0] is False
    assert seen[-1] is True
    assert_published_whole(cache)
    assert len(front[0].ranges("big.bin")) == 7
    events = [log["event"] for log in logs]
    assert events.count("cache.fetch_waiting") == 1
    assert events.count("cache.model_present") == 1
    assert events.index("cache.fetched") < events.index("cache.model_present")


async def test_staging_left_by_a_fetch_from_another_source_is_removed(
    bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    stale = cache / "models" / ".staging" / "llama-0badf00d"
    stale.mkdir(parents=True)
    (stale / "big.bin").write_bytes(b"x" * 1000)
    write_json(stale / PROGRESS, {"version": 1, "name": "llama", "source": "s3://elsewhere/llama/", "files": []})
    other = cache / "models" / ".staging" / "llama-2-12345678"  # another model's: not ours to remove
    other.mkdir()
    await fetch(s3_settings(bucket, cache, front))
    assert not stale.exists()
    assert other.exists()


async def test_wait_tries_again_after_a_source_that_fails_for_longer_than_the_retries(
    bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    front[0].fail("503", "config.json", times=4)  # one more than the three retries of a request
    with pytest.raises(FetchError, match=r"config\.json: HTTP 503") as raised:
        await fetch(s3_settings(bucket, cache, front))
    assert raised.value.transient
    front[0].fail("503", "config.json", times=4)
    with capture_logs() as logs:
        await fetch_until_done(s3_settings(bucket, cache, front, wait=True))
    assert_published_whole(cache)
    assert [log["reason"] for log in logs if log["event"] == "cache.fetch_retry"] == ["source"]


def _mount(argv: list[str], what: str) -> None:
    mounted = subprocess.run(argv, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount {what} here: {mounted.stderr.decode().strip()}")


@pytest.fixture(params=["tmpfs", "ext4 on a loop device"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """3 MiB of tmpfs, or a 6 MiB ext4 filesystem on a loop device (xfs needs 300 MB at least): too small for the
    model either way."""
    small = tmp_path / "small"
    small.mkdir()
    if request.param == "tmpfs":
        _mount(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], "a small tmpfs")
        yield small
        subprocess.run(["umount", str(small)], check=True)
        return
    with ext4_on_a_loop_device(tmp_path / "small.img", 6 * MIB, small):
        yield small


@contextlib.contextmanager
def ext4_on_a_loop_device(image: Path, size: int, mountpoint: Path) -> Iterator[str]:
    """A new ext4 of ``size`` bytes in ``image``, attached and mounted at ``mountpoint``; yields the device. Skips
    the test where that cannot be had here."""
    missing = [tool for tool in ("losetup", "mkfs.ext4") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.skip(f"a loop device needs root, losetup and mkfs.ext4; missing {missing or ['root']}")
    with image.open("wb") as file:
        file.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    attached = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True)
    if attached.returncode != 0:
        pytest.skip(f"cannot attach a loop device here: {attached.stderr.strip()}")
    device = attached.stdout.strip()
    try:
        _mount(["mount", device, str(mountpoint)], device)
        yield device
        subprocess.run(["umount", str(mountpoint)], check=True)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


@pytest.mark.parametrize("found_at", ["preallocation", "write"])
async def test_a_full_disk_ends_with_an_error_naming_the_file_and_leaves_no_staging(
    found_at: str, bucket: str, small_disk: Path, front: tuple[FaultyServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if found_at == "write":  # a filesystem that cannot preallocate fills up under the writes instead
        monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, length: None)
    with pytest.raises(FetchError, match=r"the model cache is full") as raised:
        await fetch(s3_settings(bucket, small_disk, front))
    assert raised.value.reason == "disk_full"
    assert str(raised.value).startswith(("big.bin:", "model-0000"))
    assert list((small_disk / "models" / ".staging").iterdir()) == []
    assert not (small_disk / "models" / "llama").exists()


def _done_parts(cache: Path) -> dict[str, list[int]]:
    for record_path in (cache / "models" / ".staging").glob(f"*/{PROGRESS}"):
        record = json.loads(record_path.read_text())
        return {entry["path"]: entry["done"] for entry in record["files"]}
    return {}


@pytest.fixture
def environment(aws_credentials: None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


async def test_a_killed_fetch_resumes_asking_only_for_the_parts_it_lacks(
    bucket: str, cache: Path, front: tuple[FaultyServer, str], environment: dict[str, str]
) -> None:
    server, endpoint = front
    server.chunk_delay_s = 0.04  # about 1.5 MiB/s a connection: the kill lands mid-download
    argv = [sys.executable, "-m", "spotdrain.cli", "cache", "fetch", f"s3://{bucket}/llama/", "--name", "llama"]
    argv += ["--model-cache-path", str(cache), "--aws-endpoint-url", endpoint, "--aws-region", REGION]
    argv += ["--concurrency", "2", "--part-size-mib", "1"]
    process = await asyncio.create_subprocess_exec(*argv, env=environment, stderr=asyncio.subprocess.DEVNULL)
    try:
        for _ in range(400):
            if len(_done_parts(cache).get("big.bin", [])) >= 2:
                break
            await asyncio.sleep(0.025)
        process.send_signal(signal.SIGKILL)
    finally:
        await process.wait()
    done = _done_parts(cache)["big.bin"]
    assert 2 <= len(done) < 7
    assert not (cache / "models" / "llama").exists()
    server.chunk_delay_s = 0.0
    server.requests.clear()
    await fetch(settings_for(S3Source(bucket, "llama/"), cache, endpoint))
    assert_published_whole(cache)
    asked = {int(r.removeprefix("bytes=").partition("-")[0]) // MIB for r in server.ranges("big.bin") if r}
    assert asked == set(range(7)) - set(done)


async def test_wait_in_an_init_container_waits_for_another_process_fetching_the_same_model(
    bucket: str, cache: Path, front: tuple[FaultyServer, str], environment: dict[str, str]
) -> None:
    server, endpoint = front
    server.chunk_delay_s = 0.03  # half a second or more of download after the record first appears
    argv = [sys.executable, "-m", "spotdrain.cli", "cache", "fetch", f"s3://{bucket}/llama/", "--name", "llama"]
    argv += ["--model-cache-path", str(cache), "--aws-endpoint-url", endpoint, "--aws-region", REGION]
    argv += ["--part-size-mib", "1"]
    process = await asyncio.create_subprocess_exec(*argv, env=environment, stderr=asyncio.subprocess.DEVNULL)
    try:
        for _ in range(400):
            if _done_parts(cache):
                break
            await asyncio.sleep(0.025)
        with capture_logs() as logs:
            await fetch_until_done(settings_for(S3Source(bucket, "llama/"), cache, endpoint, wait=True))
        assert process.returncode is not None or await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
    assert process.returncode == 0
    assert [log["event"] for log in logs] == ["cache.fetch_waiting", "cache.model_present"]
    assert logs[0]["holder_pid"] == str(process.pid)
    assert_published_whole(cache)
    assert len(server.ranges("big.bin")) == 7


async def test_a_listing_that_fails_once_is_retried_and_a_missing_bucket_is_an_error(
    bucket: str, cache: Path, front: tuple[FaultyServer, str]
) -> None:
    front[0].fail("503", f"/{bucket}")  # the ListObjectsV2 GET
    await fetch(s3_settings(bucket, cache, front))
    assert_published_whole(cache)
    assert [seen.path for seen in front[0].requests][:2] == [f"/{bucket}", f"/{bucket}"]
    with pytest.raises(FetchError, match=r"^s3\.list_objects_v2: HTTP 404: .*NoSuchBucket") as raised:
        await fetch(settings_for(S3Source("no-such-bucket", "llama/"), cache, front[1], name="other"))
    assert (raised.value.reason, raised.value.transient) == ("listing", False)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate for 127.0.0.1 (its key beside it), made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed here")
    where = tmp_path_factory.mktemp("tls")
    key, cert = where / "key.pem", where / "cert.pem"
    subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            *subject,
            "-keyout",
            key,
            "-out",
            cert,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert


@asynccontextmanager
async def http_proxy(seen: list[tuple[str, str | None]]) -> AsyncIterator[str]:
    """A forward proxy on 127.0.0.1 that records each request line and its Proxy-Authorization: ``CONNECT``
    tunnels, and requests in absolute form passed on as they are. Yields its URL."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(256 * 1024):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        auth = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("proxy-auth")), None)
        seen.append((lines[0], auth))
        method, target, _ = lines[0].split(" ")
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            upstream = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            parts = urlsplit(target)
            upstream = await asyncio.open_connection(parts.hostname, parts.port)
            upstream[1].write(head)
        await asyncio.gather(pipe(reader, upstream[1]), pipe(upstream[0], writer))

    port = free_port()
    listening = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        listening.close()


async def test_over_tls_through_the_environments_proxy_s3_is_listed_and_fetched_through_its_tunnel(
    bucket: str,
    cache: Path,
    moto: MotoServer,
    aws_credentials: None,
    certificate: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3 is https: the listing and the transfers reach it through HTTPS_PROXY's CONNECT tunnels, with the proxy's
    credentials, and check its certificate against the system's store (here SSL_CERT_FILE's)."""
    for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certificate, certificate.with_name("key.pem"))
    seen: list[tuple[str, str | None]] = []
    server = FaultyServer(upstream=moto.endpoint_url)
    try:
        async with serving_app(server.app(), tls=tls) as port, http_proxy(seen) as proxy:
            monkeypatch.setenv("HTTPS_PROXY", proxy.replace("http://", "http://fetch:p%40ss@"))
            settings = settings_for(S3Source(bucket, "llama/"), cache, f"https://127.0.0.1:{port}")
            http1._tls.cache_clear()
            with pytest.raises(FetchError, match="CERTIFICATE_VERIFY_FAILED") as untrusted:  # no store trusts it
                await fetch(settings)
            assert not untrusted.value.transient  # ended at once, not retried
            monkeypatch.setenv("SSL_CERT_FILE", str(certificate))
            http1._tls.cache_clear()
            await fetch(settings)
    finally:
        http1._tls.cache_clear()
    assert_published_whole(cache)
    gets = [seen for seen in server.requests if seen.method == "GET" and seen.range is not None]
    assert len(gets) >= len(MODEL)
    tunnels = [auth for line, auth in seen if line == f"CONNECT 127.0.0.1:{port} HTTP/1.1"]
    assert server.requests[0].path == f"/{bucket}"  # the listing
    assert len(tunnels) >= len(server.requests)  # a tunnel for each request, the listing's and the heads' too
    assert f"Basic {base64.b64encode(b'fetch:p@ss').decode()}" in tunnels


async def test_a_mirror_over_http_is_fetched_through_the_environments_proxy_in_absolute_form(
    cache: Path, mirror: tuple[FaultyServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    seen: list[tuple[str, str | None]] = []
    async with http_proxy(seen) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy)
        await fetch(mirror_settings(mirror, cache))
    assert_published_whole(cache)
    absolute = [line for line, _ in seen if line.startswith(f"GET {mirror[1]}/org/llama/resolve/v1/")]
    assert len(absolute) == len([s for s in mirror[0].requests if s.method == "GET" and "/resolve/" in s.path])


def test_a_written_part_is_on_its_way_to_the_disk_before_any_fsync(tmp_path: Path) -> None:
    """The writeback each part starts: the loop device's own count of sectors written grows by the part without a
    fsync, where by itself the kernel would hold the dirty pages for 30 s (``vm.dirty_expire_centisecs``)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    with ext4_on_a_loop_device(tmp_path / "disk.img", 64 * MIB, disk) as device:
        stat = Path("/sys/block") / Path(device).name / "stat"

        def sectors_written() -> int:
            return int(stat.read_text().split()[6])

        fd = os.open(disk / "part", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, os.urandom(8 * MIB), 0)
            before = sectors_written()
            time.sleep(0.5)
            assert sectors_written() - before < 8 * MIB // 512  # dirty, and left so
            _start_writeback(fd, 0, 8 * MIB)
            give_up = time.monotonic() + 10
            while sectors_written() - before < 8 * MIB // 512 and time.monotonic() < give_up:
                time.sleep(0.05)
            assert sectors_written() - before >= 8 * MIB // 512
        finally:
            os.close(fd)


async def test_an_s3_fetch_as_a_command_imports_no_aws_sdk(
    bucket: str, cache: Path, front: tuple[FaultyServer, str], environment: dict[str, str]
) -> None:
    """boto3's import and client would be most of a fetch's start (0.3 s, more with a cold page cache)."""
    argv = ["cache", "fetch", f"s3://{bucket}/llama/", "--name", "llama", "--model-cache-path", str(cache)]
    argv += ["--aws-endpoint-url", front[1], "--aws-region", REGION]
    code = f"import sys; from spotdrain.cli import main; code = main({argv!r}); "
    code += "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 's3transfer')), code)"
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=environment, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await done.communicate()
    assert out.decode().split("\n")[-2] == "[] 0"
    assert_published_whole(cache)
