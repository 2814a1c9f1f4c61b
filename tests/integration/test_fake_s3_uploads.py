"""The simulation's S3 keeps what S3 keeps for each way an object is uploaded (one part or many, each checksum, each
checksum type), held against moto's answers to the same uploads; and ``spotdrain cache fetch`` checks each by it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import subprocess
import sys
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import moto.s3 as moto_s3
import pytest
from botocore.config import Config

from agent.cache.fetch.run import fetch
from agent.cache.fetch.settings import MIB
from agent.cache.fetch.sources import S3Source
from agent.cache.fetch.transfer import FetchError
from simulate.fakes.aws import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, MotoServer
from simulate.fakes.imds import serving
from simulate.fakes.s3 import FakeS3, checksum
from tests.integration.test_cache_fetch import settings_for
from tests.integration.test_cache_fetch_uploads import weights
from tests.integration.test_fake_s3 import client

ROOT = Path(__file__).resolve().parents[2]
DATA = weights(2 * MIB + 5)  # three parts of 1 MiB, the last one 5 bytes
# (how, ChecksumAlgorithm, ChecksumType): PutObject, or a multipart upload of 1 MiB parts.
UPLOADS = [
    *(("put", algorithm, "") for algorithm in ("CRC64NVME", "CRC32", "CRC32C", "SHA1", "SHA256")),
    *(("parts", algorithm, "COMPOSITE") for algorithm in ("CRC32", "CRC32C", "SHA1", "SHA256")),
    *(("parts", algorithm, "FULL_OBJECT") for algorithm in ("CRC64NVME", "CRC32", "CRC32C")),
]
KEPT = ("content-length", "content-range", "etag", "x-amz-mp-parts-count")


@pytest.fixture(scope="module")
def moto_s3_client(moto: MotoServer) -> Iterator[tuple[Any, str]]:
    s3 = moto.client("s3")
    bucket = f"conformance-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moto_s3.models, "S3_UPLOAD_PART_MIN_SIZE", MIB)  # S3's least part is 5 MiB
        yield s3, bucket


def upload(s3: Any, bucket: str, key: str, how: str, algorithm: str, kind: str) -> None:
    """DATA uploaded to ``s3`` as boto3's callers upload it."""
    if how == "put":
        s3.put_object(Bucket=bucket, Key=key, Body=DATA, ChecksumAlgorithm=algorithm)
        return
    field = f"Checksum{algorithm}"
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm=algorithm, ChecksumType=kind)
    parts = []
    for n in range(3):
        body = DATA[n * MIB : (n + 1) * MIB]
        sent = s3.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id["UploadId"],
            PartNumber=n + 1,
            Body=body,
            ChecksumAlgorithm=algorithm,
        )
        parts.append({"PartNumber": n + 1, "ETag": sent["ETag"], field: sent[field]})
    whole = {field: base64.b64encode(checksum(DATA, algorithm)).decode()} if kind == "FULL_OBJECT" else {}
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id["UploadId"],
        MultipartUpload={"Parts": parts},
        **({"ChecksumType": kind} | whole if kind == "FULL_OBJECT" else {}),
    )


def answers(s3: Any, bucket: str, key: str) -> dict[int | None, dict[str, Any]]:
    """HEAD of the object and of each of its parts, with ChecksumMode=ENABLED: status and the headers a fetch reads."""
    found: dict[int | None, dict[str, Any]] = {}
    for part in (None, 1, 2, 3):
        try:
            answer = s3.head_object(
                Bucket=bucket, Key=key, ChecksumMode="ENABLED", **({"PartNumber": part} if part else {})
            )
        except s3.exceptions.ClientError as error:
            found[part] = {"status": error.response["ResponseMetadata"]["HTTPStatusCode"]}
            continue
        headers = answer["ResponseMetadata"]["HTTPHeaders"]
        kept = {k: v for k, v in headers.items() if k in KEPT or k.startswith("x-amz-checksum-")}
        kept.pop("x-amz-checksum-algorithm", None)  # moto's alone: S3 answers no such header
        found[part] = {"status": answer["ResponseMetadata"]["HTTPStatusCode"], **kept}
    return found


def as_s3_answers(moto: dict[int | None, dict[str, Any]], kind: str) -> dict[int | None, dict[str, Any]]:
    """moto's answers where moto 5.2 differs from S3. S3 answers a checksum with its type (API_HeadObject.html,
    ``x-amz-checksum-type``), FULL_OBJECT for an object put in one part, whose part 1 is the whole object; and the
    whole object's COMPOSITE checksum as ``<base64>-N`` (checking-object-integrity-upload.html: the checksum of the
    parts' checksums, followed by the count of parts). moto answers no type but to a part's HEAD, and no ``-N``."""
    fixed = {part: dict(answer) for part, answer in moto.items()}
    for answer in fixed.values():
        if any(k.startswith("x-amz-checksum-") for k in answer):
            answer.setdefault("x-amz-checksum-type", kind or "FULL_OBJECT")
    if kind == "COMPOSITE":
        name = next(k for k in fixed[None] if k.startswith("x-amz-checksum-") and k != "x-amz-checksum-type")
        fixed[None][name] += "-3"
    return fixed


@pytest.mark.parametrize(("how", "algorithm", "kind"), UPLOADS)
async def test_the_fake_answers_heads_of_each_upload_and_its_parts_as_s3_does(
    how: str, algorithm: str, kind: str, moto_s3_client: tuple[Any, str]
) -> None:
    if algorithm == "CRC32C":
        pytest.importorskip("crc32c", reason="moto computes a part's CRC32C with it, and a CRC32 in its place without")
    s3, bucket = moto_s3_client
    key = f"{how}-{algorithm}-{kind}"
    upload(s3, bucket, key, how, algorithm, kind)
    fake = FakeS3()
    if how == "put":
        fake.put("bucket", key, DATA, algorithm=algorithm)
    else:
        fake.put_in_parts("bucket", key, DATA, part_size=MIB, algorithm=algorithm, checksum_type=kind)
    async with serving(fake) as url:
        faked = await asyncio.to_thread(answers, client(url), "bucket", key)
    assert faked == as_s3_answers(answers(s3, bucket, key), kind)


async def test_an_upload_in_parts_without_a_checksum_gets_s3s_full_object_crc64nvme(
    moto_s3_client: tuple[Any, str],
) -> None:
    """S3 gives a multipart upload without a checksum a full-object CRC64NVME (API_ObjectPart.html: "or if the object
    was uploaded without a checksum (and Amazon S3 added the default checksum, CRC64NVME)"); moto 5.2 keeps none, and
    agrees on the rest."""
    s3, bucket = moto_s3_client
    bare = boto3.client(
        "s3",
        region_name=REGION,
        endpoint_url=s3.meta.endpoint_url,
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
        config=Config(request_checksum_calculation="when_required"),
    )
    upload_id = bare.create_multipart_upload(Bucket=bucket, Key="bare")["UploadId"]
    parts = [
        {
            "PartNumber": n + 1,
            "ETag": bare.upload_part(
                Bucket=bucket, Key="bare", UploadId=upload_id, PartNumber=n + 1, Body=DATA[n * MIB : (n + 1) * MIB]
            )["ETag"],
        }
        for n in range(3)
    ]
    bare.complete_multipart_upload(Bucket=bucket, Key="bare", UploadId=upload_id, MultipartUpload={"Parts": parts})
    fake = FakeS3()
    fake.put_in_parts("bucket", "bare", DATA, part_size=MIB)
    async with serving(fake) as url:
        faked = await asyncio.to_thread(answers, client(url), "bucket", "bare")
    moto = answers(s3, bucket, "bare")
    crc = base64.b64encode(checksum(DATA, "CRC64NVME")).decode()
    assert moto[None].get("x-amz-checksum-crc64nvme") is None
    assert faked == {**moto, None: moto[None] | {"x-amz-checksum-crc64nvme": crc, "x-amz-checksum-type": "FULL_OBJECT"}}


@pytest.mark.parametrize(
    ("algorithm", "kind", "checked"),
    [
        ("CRC32", "COMPOSITE", "composite-crc32"),
        ("SHA256", "COMPOSITE", "composite-sha256"),
        ("CRC32", "FULL_OBJECT", "crc32"),
        ("CRC64NVME", "", "crc64nvme"),  # an upload without a checksum: S3's default
    ],
)
async def test_spotdrain_cache_fetch_checks_an_upload_in_parts_by_what_s3_keeps(
    algorithm: str, kind: str, checked: str, tmp_path: Path, aws_credentials: None
) -> None:
    fake = FakeS3()
    fake.put_in_parts("models", "m/w.safetensors", DATA, part_size=MIB, algorithm=algorithm, checksum_type=kind)
    async with serving(fake) as url:
        settings = settings_for(S3Source("models", "m/"), tmp_path, url, name="m")
        target = await fetch(dataclasses.replace(settings, aws_region="us-east-1"))
    assert (target / "w.safetensors").read_bytes() == DATA
    heads = [seen.path for seen in fake.requests if seen.method == "HEAD"]
    assert len(heads) == (3 if kind == "COMPOSITE" else 2), "a HEAD per part, or part 1's and the whole object's"
    record = (target / ".spotdrain-manifest.json").read_text()
    assert f'"kind": "{checked}"' in record
    if checked == "crc32":
        assert f'"value": "{zlib.crc32(DATA):08x}"' in record


async def test_parts_that_do_not_add_up_to_the_listed_size_are_a_listing_to_try_again(
    tmp_path: Path, aws_credentials: None
) -> None:
    """An object replaced between the listing and its parts' HEADs: nothing it says can be checked against."""
    fake = FakeS3()
    stored = fake.put_in_parts("models", "m/w.safetensors", DATA, part_size=MIB, algorithm="CRC32")
    fake.buckets["models"]["m/w.safetensors"] = dataclasses.replace(stored, part_sizes=(MIB, MIB, 4))
    async with serving(fake) as url:
        settings = settings_for(S3Source("models", "m/"), tmp_path, url, name="m", aws_region="us-east-1")
        with pytest.raises(FetchError, match="its parts do not add up to its listed size") as raised:
            await fetch(settings)
    assert (raised.value.reason, raised.value.transient) == ("listing", True)


def test_the_simulations_s3_and_model_import_without_awscrt() -> None:
    """``pip install spotdrain`` without the node extra has no awscrt; ``spotdrain simulate`` imports both."""
    code = "import sys; sys.modules['awscrt'] = None; import simulate.fakes.s3, simulate.model; print('imported')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.stdout, done.stderr) == ("imported\n", "")
