"""``spotdrain cache fetch`` of models uploaded to moto's S3 the ways users upload them (boto3's ``upload_file`` and
``put_object``, the AWS CLI's ``aws s3 cp``, ``s5cmd cp``, with each checksum S3 takes): each is fetched whole and
checked by what S3 keeps for it, and a file that fails its check leaves no parts behind to fill the cache."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import moto.s3 as moto_s3
import pytest
from boto3.s3.transfer import TransferConfig

from agent.cache.fetch.parts import MANIFEST
from agent.cache.fetch.run import fetch
from agent.cache.fetch.settings import MIB
from agent.cache.fetch.sources import S3Source
from agent.cache.fetch.transfer import FetchError
from simulate.fakes.aws import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, MotoServer
from simulate.fakes.mirror import FaultyServer
from tests.conftest import serving_app
from tests.integration.test_cache_fetch import _mount, settings_for

SMALL = TransferConfig(multipart_threshold=MIB, multipart_chunksize=5 * MIB)  # s3transfer's least part is 5 MiB
JUST_OVER_DEFAULT = 8 * MIB + 5  # boto3's and the CLI's multipart_threshold is 8 MiB


def weights(size: int) -> bytes:
    """A safetensors file of ``size`` bytes whose parts all differ (one U8 tensor of random bytes)."""
    body = size - 8 - 128
    header = json.dumps({"w": {"dtype": "U8", "shape": [body], "data_offsets": [0, body]}}).encode().ljust(128)
    return struct.pack("<Q", len(header)) + header + os.urandom(body)


def s3_client(moto: MotoServer) -> Any:
    return moto.client("s3")


@pytest.fixture(scope="module")
def uploads(moto: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path]]:
    """A bucket, a client of it, and a folder for files to upload; moto takes parts of 1 MiB (S3's least is 5 MiB,
    which makes no difference to what it keeps) so the tests stay fast."""
    s3, bucket = s3_client(moto), f"uploads-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moto_s3.models, "S3_UPLOAD_PART_MIN_SIZE", MIB)
        yield s3, bucket, tmp_path_factory.mktemp("uploads")


def head(s3: Any, bucket: str, key: str, **part: int) -> dict[str, str]:
    """What S3 answers about the object (or a part): the headers the fetch reads."""
    answer = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED", **part)
    headers: dict[str, str] = answer["ResponseMetadata"]["HTTPHeaders"]
    return {k: v for k, v in headers.items() if k.startswith(("x-amz-checksum", "x-amz-mp", "etag", "content-length"))}


async def fetched(bucket: str, prefix: str, files: dict[str, bytes], cache: Path, endpoint: str) -> dict[str, Any]:
    """Fetch ``s3://bucket/prefix/`` into ``cache``, assert it landed byte for byte, and give what each file was
    checked against, by path."""
    settings = settings_for(S3Source(bucket, prefix), cache, endpoint, name=prefix.strip("/"))
    target = await fetch(settings)
    for path, data in files.items():
        assert (target / path).read_bytes() == data, path
    record = json.loads((target / MANIFEST).read_text())
    return {entry["path"]: entry["checksum"] for entry in record["files"]}


async def uploaded(argv: list[str], environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """An uploader's command, run to its end (in a thread: moto answers it on this process's other threads)."""
    return await asyncio.to_thread(subprocess.run, argv, env=environment, capture_output=True, text=True, timeout=120)


@pytest.fixture
def cache(tmp_path: Path, aws_credentials: None) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    return path


async def test_boto3_upload_file_with_its_defaults_leaves_a_composite_crc32_and_it_is_fetched(
    uploads: tuple[Any, str, Path], moto: MotoServer, cache: Path
) -> None:
    """What users hit: a shard just over 8 MiB goes up in two parts with a CRC32 each, and S3 keeps their composite.
    HEAD of part 1 answers part 1's own CRC32, which is not the file's."""
    s3, bucket, folder = uploads
    data = weights(JUST_OVER_DEFAULT)
    (folder / "default.safetensors").write_bytes(data)
    s3.upload_file(str(folder / "default.safetensors"), bucket, "defaults/model-00001-of-00002.safetensors")
    key = "defaults/model-00001-of-00002.safetensors"
    first = head(s3, bucket, key, PartNumber=1)
    assert (first["x-amz-checksum-type"], first["x-amz-mp-parts-count"]) == ("COMPOSITE", "2")
    assert base64.b64decode(first["x-amz-checksum-crc32"]) == zlib.crc32(data[: 8 * MIB]).to_bytes(4, "big")
    checks = await fetched(bucket, "defaults/", {"model-00001-of-00002.safetensors": data}, cache, moto.endpoint_url)
    assert checks["model-00001-of-00002.safetensors"]["kind"] == "composite-crc32"
    assert checks["model-00001-of-00002.safetensors"]["part_sizes"] == [8 * MIB, 5]


@pytest.mark.parametrize(
    ("algorithm", "kind"),
    [
        ("CRC32", "composite-crc32"),
        ("CRC32C", "composite-crc32c"),
        ("SHA1", "composite-sha1"),
        ("SHA256", "composite-sha256"),
        ("CRC64NVME", "crc64nvme"),  # S3 keeps a CRC64NVME of a multipart upload only as a full-object one
    ],
)
async def test_boto3_upload_file_in_parts_with_each_checksum_algorithm_is_fetched_and_checked_by_it(
    algorithm: str, kind: str, uploads: tuple[Any, str, Path], moto: MotoServer, cache: Path
) -> None:
    if algorithm == "CRC32C":
        pytest.importorskip("crc32c", reason="moto computes a part's CRC32C with it, and a CRC32 in its place without")
    s3, bucket, folder = uploads
    data = weights(10 * MIB + 7)
    (folder / f"{algorithm}.bin").write_bytes(data)
    prefix = f"algorithm-{algorithm.lower()}/"
    s3.upload_file(
        str(folder / f"{algorithm}.bin"),
        bucket,
        f"{prefix}w.safetensors",
        ExtraArgs={"ChecksumAlgorithm": algorithm},
        Config=SMALL,
    )
    assert head(s3, bucket, f"{prefix}w.safetensors", PartNumber=1)["x-amz-mp-parts-count"] == "3"
    checks = await fetched(bucket, prefix, {"w.safetensors": data}, cache, moto.endpoint_url)
    assert checks["w.safetensors"]["kind"] == kind


async def test_put_object_with_its_default_checksum_is_fetched_and_checked_by_it(
    uploads: tuple[Any, str, Path], moto: MotoServer, cache: Path
) -> None:
    s3, bucket, _ = uploads
    data = weights(2 * MIB)
    s3.put_object(Bucket=bucket, Key="put/w.safetensors", Body=data)
    assert head(s3, bucket, "put/w.safetensors")["x-amz-checksum-crc32"]  # boto3 sends a CRC32 unless told not to
    checks = await fetched(bucket, "put/", {"w.safetensors": data}, cache, moto.endpoint_url)
    assert checks["w.safetensors"] == {"kind": "crc32", "value": f"{zlib.crc32(data):08x}"}


async def test_a_full_object_crc32_of_a_multipart_upload_is_read_from_the_whole_objects_head(
    uploads: tuple[Any, str, Path], moto: MotoServer, cache: Path
) -> None:
    """``ChecksumType='FULL_OBJECT'``: S3 keeps the CRC32 of the whole file, answered to a HEAD of the object, not of
    a part (moto answers no checksum to a part's HEAD then, as it says AWS does)."""
    s3, bucket, _ = uploads
    data, key = weights(2 * MIB + 3), "full-object/w.safetensors"
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32", ChecksumType="FULL_OBJECT")[
        "UploadId"
    ]
    parts = [
        {
            "PartNumber": n + 1,
            **s3.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload,
                PartNumber=n + 1,
                Body=data[n * MIB : (n + 1) * MIB],
                ChecksumAlgorithm="CRC32",
            ),
        }
        for n in range(3)
    ]
    whole = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload,
        ChecksumType="FULL_OBJECT",
        ChecksumCRC32=whole,
        MultipartUpload={"Parts": [{k: p[k] for k in ("PartNumber", "ETag", "ChecksumCRC32")} for p in parts]},
    )
    assert head(s3, bucket, key)["x-amz-checksum-crc32"] == whole
    checks = await fetched(bucket, "full-object/", {"w.safetensors": data}, cache, moto.endpoint_url)
    assert checks["w.safetensors"] == {"kind": "crc32", "value": f"{zlib.crc32(data):08x}"}


def _aws_clis() -> list[Any]:
    """The AWS CLI of the test venv (awscli 1.46 carries its own botocore) and, where one is on PATH, a 1.45, the
    version users reported (it needs botocore 1.43, so it cannot share the venv with boto3 1.44)."""
    venv = Path(sys.executable).parent / "aws"
    return [
        pytest.param(str(venv), id="awscli-venv"),
        pytest.param(shutil.which("aws") or "aws", id="awscli-on-path"),
    ]


def _aws_cli(command: str, *, want_version: str | None) -> str:
    try:
        version = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as error:
        pytest.skip(f"the AWS CLI is not installed here ({error}) because the test extra was not installed")
    if want_version is not None and not version.startswith(f"aws-cli/{want_version}"):
        pytest.skip(
            f"{command} is {version.strip() or 'not the CLI'}, not awscli {want_version}, because none is on PATH"
        )
    return version


@pytest.mark.parametrize("command", _aws_clis())
@pytest.mark.parametrize("threshold", ["default", "1MB"])
async def test_aws_s3_cp_recursive_of_a_model_is_fetched_and_checked(
    command: str, threshold: str, uploads: tuple[Any, str, Path], moto: MotoServer, cache: Path, tmp_path: Path
) -> None:
    """The README's upload step, as written: ``aws s3 cp --recursive``. Its defaults split a file over 8 MiB into
    8 MiB parts with a CRC32 each; an ``s3.multipart_threshold`` of 1MB uploads a 3 MiB file as one part of a
    multipart upload (the CLI's least part is 5 MiB), whose composite CRC32 is the CRC32 of that part's CRC32."""
    on_path = command != str(Path(sys.executable).parent / "aws")
    if threshold == "default" and on_path:
        pytest.skip("one upload with the defaults is enough; the CLI on PATH is tried in small parts")
    _aws_cli(command, want_version="1.45" if on_path else None)
    _, bucket, _ = uploads
    model = tmp_path / "model"
    model.mkdir()
    size = JUST_OVER_DEFAULT if threshold == "default" else 3 * MIB + 1
    files = {"model-00001-of-00002.safetensors": weights(size), "config.json": b'{"model_type": "llama"}'}
    for path, data in files.items():
        (model / path).write_bytes(data)
    config = tmp_path / "config"
    config.write_text(
        f"[default]\nregion = {REGION}\n"
        + ("" if threshold == "default" else f"s3 =\n  multipart_threshold = {threshold}\n")
    )
    prefix = f"cli-{uuid.uuid4().hex[:8]}/"
    environment = {
        **os.environ,
        "AWS_CONFIG_FILE": str(config),
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
    }
    argv = [command, "s3", "cp", "--recursive", str(model), f"s3://{bucket}/{prefix}", "--endpoint-url"]
    copied = await uploaded([*argv, moto.endpoint_url], environment)
    assert copied.returncode == 0, copied.stderr
    checks = await fetched(bucket, prefix, files, cache, moto.endpoint_url)
    assert checks["model-00001-of-00002.safetensors"]["kind"] == "composite-crc32"


async def test_s5cmd_cp_in_parts_is_fetched_and_checked_by_its_multipart_etag(
    uploads: tuple[Any, str, Path], moto: MotoServer, cache: Path, tmp_path: Path
) -> None:
    """s5cmd sends no checksum. S3 gives a multipart upload without one a full-object CRC64NVME (API_ObjectPart.html:
    "or if the object was uploaded without a checksum (and Amazon S3 added the default checksum, CRC64NVME)"), which
    the fetch reads from a HEAD of the whole object (test_fake_s3.py fetches one); moto 5.2 keeps none, so here the
    object is checked by its ETag, the MD5 of its parts' MD5s."""
    s5cmd = shutil.which("s5cmd", path=str(Path(sys.executable).parent)) or shutil.which("s5cmd")
    if s5cmd is None:
        pytest.skip("s5cmd is not installed here because the test extra was not installed")
    _, bucket, _ = uploads
    data = weights(11 * MIB)
    (tmp_path / "w.safetensors").write_bytes(data)
    environment = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY}
    argv = [s5cmd, "--endpoint-url", moto.endpoint_url, "cp", "--part-size", "5", str(tmp_path / "w.safetensors")]
    copied = await uploaded([*argv, f"s3://{bucket}/s5cmd/"], environment | {"AWS_REGION": REGION})
    assert copied.returncode == 0, copied.stderr
    etag = head(s3_client(moto), bucket, "s5cmd/w.safetensors")["etag"].strip('"')
    assert etag.endswith("-3")
    checks = await fetched(bucket, "s5cmd/", {"w.safetensors": data}, cache, moto.endpoint_url)
    assert checks["w.safetensors"] == {"kind": "s3-multipart", "value": etag, "part_size": 5 * MIB}


@pytest.fixture
def small_cache(tmp_path: Path, aws_credentials: None) -> Iterator[Path]:
    """4 MiB of tmpfs: room for one of two 2.5 MiB models, not both."""
    small = tmp_path / "small"
    small.mkdir()
    _mount(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], "a small tmpfs")
    try:
        yield small
    finally:
        subprocess.run(["umount", str(small)], check=True)


async def test_a_file_that_fails_its_check_twice_leaves_room_for_the_next_model(
    uploads: tuple[Any, str, Path], moto: MotoServer, small_cache: Path
) -> None:
    s3, bucket, _ = uploads
    first, second = weights(5 * MIB // 2), weights(5 * MIB // 2)
    s3.put_object(Bucket=bucket, Key="first/w.safetensors", Body=first)
    s3.put_object(Bucket=bucket, Key="second/w.safetensors", Body=second)
    front = FaultyServer(upstream=moto.endpoint_url)
    front.fail("wrong", "first/w.safetensors", times=2)  # one part each time: the file is one part of 4 MiB
    async with serving_app(front.app()) as port:
        endpoint = f"http://127.0.0.1:{port}"

        def settings(prefix: str) -> Any:
            return settings_for(
                S3Source(bucket, prefix), small_cache, endpoint, name=prefix[:-1], part_size_bytes=4 * MIB
            )

        with pytest.raises(FetchError, match=r"w\.safetensors: crc32 .* \(fetched twice\)") as raised:
            await fetch(settings("first/"))
        assert raised.value.reason == "checksum"
        assert list((small_cache / "models" / ".staging").rglob("*.safetensors")) == []
        assert await fetch(settings("second/")) == small_cache / "models" / "second"
    assert (small_cache / "models" / "second" / "w.safetensors").read_bytes() == second
