"""What a fetch copies: the source named on the command line, and the files its listing gives (pure).

Two sources. ``s3://bucket/prefix/``: every object under the prefix, at its path relative to the prefix.
``hf+https://host/base/ORG/REPO[@REVISION]``: a mirror laid out as the Hugging Face Hub is, files at
``{base}/{repo}/resolve/{revision}/{file}`` and the file list at ``{base}/api/models/{repo}/revision/{revision}``
(the Hub's model-info answer: ``siblings: [{rfilename, size, blobId, lfs: {sha256, size}}]`` with ``?blobs=true``,
which is what huggingface_hub's ``model_info(files_metadata=True)`` reads).
"""

from __future__ import annotations

import base64
import hashlib
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

_SHA256 = re.compile(r"[0-9a-f]{64}")
_MD5 = re.compile(r"[0-9a-f]{32}")
_MULTIPART = re.compile(r"([0-9a-f]{32})-([0-9]+)")
_SHA1 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str  # "" (the whole bucket) or ending in "/"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def revision(self) -> str | None:
        return None


@dataclass(frozen=True)
class MirrorSource:
    base: str  # scheme, host and path before the repository, without a trailing slash
    repo: str  # ORG/REPO
    revision: str  # a branch, tag or commit; "main" when the source names none

    def __str__(self) -> str:
        return f"hf+{self.base}/{self.repo}@{self.revision}"

    def file_url(self, path: str) -> str:
        return f"{self.base}/{self.repo}/resolve/{quote(self.revision, safe='')}/{quote(path)}"

    @property
    def manifest_url(self) -> str:
        return f"{self.base}/api/models/{self.repo}/revision/{quote(self.revision, safe='')}?blobs=true"


Source = S3Source | MirrorSource


@dataclass(frozen=True)
class Checksum:
    """What the source says a file's content hashes to. ``kind``: ``md5`` (a single-part S3 ETag), ``s3-multipart``
    (``md5(md5(part1) + md5(part2) ...)-N`` over parts of ``part_size`` bytes), ``sha256``, ``sha1``, ``git-sha1`` (a
    git blob id: ``sha1(b"blob <size>\\0" + content)``), ``crc64nvme``, ``crc32c``, ``crc32`` (S3's full-object
    checksums, as the hex of their big-endian bytes), or ``composite-`` one of those (S3's COMPOSITE checksum of a
    multipart upload: each part's own checksum, in ``parts`` as (size, hex), and ``value`` the checksum of their
    bytes joined, ``-N``, as S3 shows it). A file's first checksum, the cheapest, is the one it is checked against."""

    kind: str
    value: str
    part_size: int = 0
    parts: tuple[tuple[int, str], ...] = ()

    @property
    def algorithm(self) -> str:
        """What is hashed: the kind, without ``composite-``; an ``s3-multipart`` ETag's parts are MD5s."""
        return "md5" if self.kind == "s3-multipart" else self.kind.removeprefix("composite-")

    def as_json(self) -> dict[str, Any]:
        sizes = {"part_sizes": [size for size, _ in self.parts]} if self.parts else {}
        return {
            "kind": self.kind,
            "value": self.value,
            **({"part_size": self.part_size} if self.part_size else {}),
            **sizes,
        }


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the model directory, "/"-separated
    size: int
    checksums: tuple[Checksum, ...] = ()
    key: str = ""  # the S3 key; "" on a mirror


def parse_source(text: str) -> Source:
    """The source SOURCE names; ValueError says what is wrong with it."""
    if text.startswith("s3://"):
        bucket, _, prefix = text.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"{text!r} names no bucket")
        return S3Source(bucket, prefix if not prefix or prefix.endswith("/") else prefix + "/")
    if text.startswith(("hf+http://", "hf+https://")):
        return _mirror(text.removeprefix("hf+"))
    raise ValueError(f"{text!r} is neither s3://bucket/prefix/ nor hf+https://host/base/ORG/REPO[@REVISION]")


def _mirror(url: str) -> MirrorSource:
    location, _, revision = url.rstrip("/").partition("@")
    parts = urlsplit(location)
    segments = [s for s in parts.path.split("/") if s]
    if not parts.hostname or len(segments) < 2:
        raise ValueError(f"{url!r} names no ORG/REPO after the mirror's host")
    base = f"{parts.scheme}://{parts.netloc}" + "".join(f"/{s}" for s in segments[:-2])
    return MirrorSource(base, "/".join(segments[-2:]), revision or "main")


def relative_path(name: str) -> str:
    """A listed name as a path inside the model directory; ValueError for one that would leave it."""
    segments = name.split("/")
    if not name or name.startswith("/") or any(s in ("", ".", "..") for s in segments) or "\0" in name:
        raise ValueError(f"{name!r} is not a relative path inside the model")
    if segments[0] in (".spotdrain-manifest.json", ".spotdrain-progress.json"):
        raise ValueError(f"{name!r} would overwrite spotdrain's own record")
    return name


# The checksums S3 keeps beside an object (``x-amz-checksum-*``, HeadObject with ChecksumMode=ENABLED), cheapest to
# compute first. Since December 2024 S3 gives every new object a CRC64NVME unless its uploader chose another
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity.html).
S3_CHECKSUMS = ("crc64nvme", "crc32c", "crc32", "sha1", "sha256")
_DIGEST_BYTES = {"crc64nvme": 8, "crc32c": 4, "crc32": 4, "sha1": 20, "sha256": 32}


def s3_checksums(
    *,
    etag: str,
    part_size: int,
    whole_b64: Mapping[str, str],
    parts_b64: Sequence[tuple[int, Mapping[str, str]]] = (),
    encrypted: bool,
) -> tuple[Checksum, ...]:
    """What an S3 object's headers say about its content, cheapest to check first: its full-object checksums
    (``whole_b64``, base64 by kind), the composite checksum its parts' own make (``parts_b64``: each part's size
    and checksums, from HeadObject of ``partNumber`` N), then its ETag. An ETag is an MD5 only for objects without
    SSE-KMS or SSE-C (https://docs.aws.amazon.com/AmazonS3/latest/API/API_Object.html). A value with a ``-N`` is a
    composite one, whatever header carries it, and is not one of the whole content."""
    found: list[Checksum] = []
    for kind in S3_CHECKSUMS:
        digest = _digest(whole_b64.get(kind, ""), kind)
        if digest is not None:
            found.append(Checksum(kind, digest.hex()))
    for kind in S3_CHECKSUMS if parts_b64 else ():
        digests = [_digest(checksums.get(kind, ""), kind) for _, checksums in parts_b64]
        if all(digest is not None for digest in digests):
            joined = [digest for digest in digests if digest is not None]
            parts = tuple((size, digest.hex()) for (size, _), digest in zip(parts_b64, joined, strict=True))
            found.append(Checksum(f"composite-{kind}", composite_value(kind, joined), parts=parts))
    tag = etag.strip('"').lower()
    if not encrypted and _MD5.fullmatch(tag):
        found.append(Checksum("md5", tag))
    elif not encrypted and _MULTIPART.fullmatch(tag) and part_size > 0:
        found.append(Checksum("s3-multipart", tag, part_size))
    return tuple(found)


def _digest(value: str, kind: str) -> bytes | None:
    if not value or "-" in value:
        return None
    try:
        digest = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return digest if len(digest) == _DIGEST_BYTES[kind] else None


def composite_value(kind: str, digests: Sequence[bytes]) -> str:
    """S3's composite checksum of parts whose own are ``digests``: the ``kind`` of their bytes joined, ``-N``
    (https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity-upload.html)."""
    joined = b"".join(digests)
    if kind in ("sha1", "sha256"):
        value = hashlib.new(kind, joined).digest()
    elif kind == "crc32":
        value = zlib.crc32(joined).to_bytes(4, "big")
    else:
        from awscrt import checksums  # the node extra's; a mirror's fetch never gets here

        crc = checksums.crc32c(joined) if kind == "crc32c" else checksums.crc64nvme(joined)
        value = crc.to_bytes(_DIGEST_BYTES[kind], "big")
    return f"{value.hex()}-{len(digests)}"


def http_checksums(headers: dict[str, str]) -> tuple[Checksum, ...]:
    """What a mirror's answer says of the content, read as huggingface_hub reads the Hub's (``X-Linked-Etag``, else
    ``ETag``): 64 hex digits are an LFS file's SHA-256, 40 a git blob id; any other ETag says nothing."""
    for name in ("x-linked-etag", "etag"):
        value = headers.get(name, "").removeprefix("W/").strip('"').lower()
        if _SHA256.fullmatch(value):
            return (Checksum("sha256", value),)
        if _SHA1.fullmatch(value):
            return (Checksum("git-sha1", value),)
    return ()


def mirror_files(answer: Any) -> list[tuple[str, int | None, tuple[Checksum, ...]]]:
    """(path, size or None, checksums) for each sibling of a model-info answer; ValueError for one that is not."""
    siblings = answer.get("siblings") if isinstance(answer, dict) else None
    if not isinstance(siblings, list):
        raise ValueError("the mirror's model info has no siblings list")
    files = []
    for sibling in siblings:
        name = sibling.get("rfilename") if isinstance(sibling, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"a sibling without rfilename: {sibling!r}"[:200])
        lfs = sibling.get("lfs") if isinstance(sibling.get("lfs"), dict) else {}
        size = lfs.get("size", sibling.get("size"))
        checksums: list[Checksum] = []
        if isinstance(lfs.get("sha256"), str) and _SHA256.fullmatch(lfs["sha256"]):
            checksums.append(Checksum("sha256", lfs["sha256"]))
        elif isinstance(sibling.get("blobId"), str) and _SHA1.fullmatch(sibling["blobId"]):
            checksums.append(Checksum("git-sha1", sibling["blobId"]))
        files.append((relative_path(name), size if isinstance(size, int) and size >= 0 else None, tuple(checksums)))
    return files
