"""The pure parts of ``spotdrain cache fetch``: sources, checksums, the part plan, the records, and the checks."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from awscrt import checksums as crt
from hypothesis import given
from hypothesis import strategies as st

from agent.cache.fetch.parts import manifest_problems, parts_of, progress_record, resumable, same_fetch
from agent.cache.fetch.progress import Progress
from agent.cache.fetch.sources import (
    Checksum,
    MirrorSource,
    RemoteFile,
    S3Source,
    composite_value,
    http_checksums,
    mirror_files,
    parse_source,
    relative_path,
    s3_checksums,
)
from agent.cache.fetch.verify import Digest, check_file, crc_of
from spotdrain.cli import build_parser, main


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("s3://models/llama/", S3Source("models", "llama/")),
        ("s3://models/llama", S3Source("models", "llama/")),
        ("s3://models", S3Source("models", "")),
        ("hf+https://mirror.internal/org/llama", MirrorSource("https://mirror.internal", "org/llama", "main")),
        ("hf+http://h:8080/hub/org/llama@v1.2", MirrorSource("http://h:8080/hub", "org/llama", "v1.2")),
    ],
)
def test_sources_are_read_from_their_urls(text: str, source: object) -> None:
    assert parse_source(text) == source


@pytest.mark.parametrize("text", ["s3:///x", "https://h/org/repo", "hf+https://h/repo", "/data/llama"])
def test_a_source_that_names_nothing_fetchable_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"names no|neither"):
        parse_source(text)


def test_a_mirror_source_builds_the_hubs_urls() -> None:
    source = MirrorSource("http://h/hub", "org/llama", "refs/pr/1")
    assert source.file_url("sub dir/a.json") == "http://h/hub/org/llama/resolve/refs%2Fpr%2F1/sub%20dir/a.json"
    assert source.manifest_url == "http://h/hub/api/models/org/llama/revision/refs%2Fpr%2F1?blobs=true"


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", ".spotdrain-manifest.json"])
def test_a_listed_name_that_would_leave_the_model_directory_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=r"not a relative path|spotdrain's own"):
        relative_path(name)


def test_s3_checksums_trust_an_etag_only_where_it_is_an_md5() -> None:
    md5 = "9e107d9d372bb6826bd81d3542a419d6"
    assert s3_checksums(etag=f'"{md5}"', part_size=10, whole_b64={}, encrypted=False) == (Checksum("md5", md5),)
    multipart = s3_checksums(etag=f'"{md5}-3"', part_size=8, whole_b64={}, encrypted=False)
    assert multipart == (Checksum("s3-multipart", f"{md5}-3", 8),)
    assert s3_checksums(etag=f'"{md5}"', part_size=10, whole_b64={}, encrypted=True) == ()
    digest = hashlib.sha256(b"x").digest()
    whole = s3_checksums(etag="", part_size=0, whole_b64={"sha256": base64.b64encode(digest).decode()}, encrypted=True)
    assert whole == (Checksum("sha256", digest.hex()),)
    assert s3_checksums(etag="", part_size=0, whole_b64={"sha256": "abc=-2"}, encrypted=False) == ()
    assert s3_checksums(etag="", part_size=0, whole_b64={"crc32": "not base64!"}, encrypted=False) == ()


def test_s3_checksums_put_the_cheapest_first() -> None:
    md5 = "9e107d9d372bb6826bd81d3542a419d6"
    whole = {
        "sha256": base64.b64encode(hashlib.sha256(b"x").digest()).decode(),
        "crc32": base64.b64encode(zlib.crc32(b"x").to_bytes(4, "big")).decode(),
        "crc64nvme": base64.b64encode(crt.crc64nvme(b"x").to_bytes(8, "big")).decode(),
    }
    found = s3_checksums(etag=f'"{md5}"', part_size=1, whole_b64=whole, encrypted=False)
    assert [c.kind for c in found] == ["crc64nvme", "crc32", "sha256", "md5"]
    assert found[0].value == crt.crc64nvme(b"x").to_bytes(8, "big").hex()


def test_a_mirror_says_sha256_in_its_etags_and_its_listing() -> None:
    sha = "a" * 64
    assert http_checksums({"x-linked-etag": f'"{sha}"'}) == (Checksum("sha256", sha),)
    assert http_checksums({"etag": f'W/"{sha}"'}) == (Checksum("sha256", sha),)
    assert http_checksums({"etag": f'"{"c" * 40}"'}) == (Checksum("git-sha1", "c" * 40),)
    assert http_checksums({"etag": '"12-abc"'}) == ()
    answer = {
        "siblings": [
            {"rfilename": "m.safetensors", "size": 5, "lfs": {"sha256": sha, "size": 9}},
            {"rfilename": "config.json", "size": 3, "blobId": "b" * 40},
            {"rfilename": "README.md"},
        ]
    }
    assert mirror_files(answer) == [
        ("m.safetensors", 9, (Checksum("sha256", sha),)),
        ("config.json", 3, (Checksum("git-sha1", "b" * 40),)),
        ("README.md", None, ()),
    ]
    with pytest.raises(ValueError, match="siblings"):
        mirror_files({"id": "x"})


def test_parts_cover_a_file_once_and_an_empty_file_is_one_empty_part() -> None:
    file = RemoteFile("a", 10)
    assert [(p.start, p.end) for p in parts_of(file, 4)] == [(0, 4), (4, 8), (8, 10)]
    assert [p.index for p in parts_of(file, 4, skip=frozenset({1}))] == [0, 2]
    assert [(p.start, p.end) for p in parts_of(RemoteFile("e", 0), 4)] == [(0, 0)]


def test_a_record_resumes_only_files_that_are_still_the_same() -> None:
    same, changed = RemoteFile("a", 10, (Checksum("md5", "1" * 32),)), RemoteFile("b", 10)
    record = progress_record(
        name="m",
        source="s3://b/p/",
        files=[same, changed],
        part_size=4,
        done={"a": frozenset({0, 2}), "b": frozenset({1})},
    )
    record = json.loads(json.dumps(record))
    assert same_fetch(record, name="m", source="s3://b/p/")
    assert not same_fetch(record, name="m", source="s3://b/q/")
    now = [same, RemoteFile("b", 11)]
    assert resumable(record, now, 4) == {"a": frozenset({0, 2})}
    assert resumable(record, now, 8) == {}
    record["files"][0]["done"] = [0, 7, "x"]
    assert resumable(record, now, 4) == {"a": frozenset({0})}


def test_a_published_model_is_checked_by_its_manifests_sizes() -> None:
    record = {"files": [{"path": "a", "size": 3}, {"path": "b", "size": 4}]}
    assert manifest_problems(record, {"a": 3, "b": 4}) == []
    assert manifest_problems(record, {"a": 3, "b": None}) == ["b: None bytes on disk, 4 in the manifest"]
    assert manifest_problems(None, {}) == ["no readable manifest"]
    assert manifest_problems({"files": []}, {}) == ["no readable manifest"]


def _checked(tmp_path: Path, data: bytes, file: RemoteFile) -> tuple[str | None, Checksum | None]:
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return check_file(fd, file)
    finally:
        os.close(fd)


def test_a_multipart_etag_is_the_md5_of_the_parts_md5s(tmp_path: Path) -> None:
    data = os.urandom(2 * 1024 * 1024 + 100)
    size = 1024 * 1024
    digests = b"".join(hashlib.md5(data[i : i + size]).digest() for i in range(0, len(data), size))
    etag = f"{hashlib.md5(digests).hexdigest()}-3"
    checksum = Checksum("s3-multipart", etag, size)
    assert _checked(tmp_path, data, RemoteFile("f", len(data), (checksum,))) == (None, checksum)
    exact = data[: 2 * size]  # parts that end exactly at the end of the file
    combined = hashlib.md5(hashlib.md5(exact[:size]).digest() + hashlib.md5(exact[size:]).digest()).hexdigest()
    two = Checksum("s3-multipart", f"{combined}-2", size)
    assert _checked(tmp_path, exact, RemoteFile("f", len(exact), (two,)))[0] is None
    problem, _ = _checked(tmp_path, data[:-1] + b"!", RemoteFile("f", len(data), (checksum,)))
    assert problem is not None
    assert problem.startswith("f: s3-multipart ")


def test_git_blob_ids_and_sizes_are_checked(tmp_path: Path) -> None:
    blob = Checksum("git-sha1", "ce013625030ba8dba906f756967f9e9ca394464a")  # git hash-object of "hello\n"
    assert _checked(tmp_path, b"hello\n", RemoteFile("f", 6, (blob,))) == (None, blob)
    assert _checked(tmp_path, b"hello\n", RemoteFile("f", 7, (blob,)))[0] == "f: 6 bytes, the source lists 7"


def _safetensors(header: object, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (_safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), None),
        (_safetensors({"__metadata__": {"format": "pt"}}, b""), None),
        (_safetensors({"w": {"data_offsets": [0, 9]}}, b"\0" * 8), "outside the 8 bytes"),
        (struct.pack("<Q", 1000) + b"{}", "does not fit"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not JSON"),
        (b"abc", "has no header"),
    ],
)
def test_a_safetensors_header_must_parse_and_point_inside_the_file(
    tmp_path: Path, content: bytes, problem: str | None
) -> None:
    found, _ = _checked(tmp_path, content, RemoteFile("m.safetensors", len(content)))
    assert found is None if problem is None else (found is not None and problem in found)


def test_the_progress_line_shows_bytes_rate_and_eta() -> None:
    now = [0.0]
    progress = Progress(total_bytes=4 * 1024**3, resumed_bytes=1024**3, files=4, clock=lambda: now[0])
    progress.add(1024**3)
    now[0] = 2.0
    line = progress.line(now[0])
    assert " 50% 2.0 GiB / 4.0 GiB  512.0 MiB/s  ETA 4s" in line
    assert progress.fields(now[0])["mb_per_s"] == round(1024**3 / 1e6 / 2, 1)


def test_spotdrain_cache_alone_still_prepares_and_cache_fetch_fetches() -> None:
    parser = build_parser()
    assert parser.parse_args(["cache", "--model-cache-path", "/mnt/c"]).cache_command is None
    args = parser.parse_args(["cache", "fetch", "s3://b/p/", "--name", "llama", "--concurrency", "8"])
    assert (args.cache_command, args.source, args.name, args.concurrency) == ("fetch", "s3://b/p/", "llama", 8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cache", "fetch", "s3://b/p/"], "--name is required"),
        (["cache", "fetch", "ftp://x", "--name", "m"], "SOURCE: 'ftp://x' is neither"),
        (["cache", "fetch", "s3://b/p/", "--name", ".staging"], "--name must be"),
        (["cache", "fetch", "s3://b/p/", "--name", "m", "--model-cache-path", "rel"], "--model-cache-path must"),
    ],
)
def test_a_fetch_with_bad_settings_says_which_and_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("spotdrain.cli.configure_logging", lambda **_: None)  # the suite's logs stay capturable
    assert main(argv) == 2
    assert f"spotdrain cache fetch: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kind", "digest"),
    [
        ("crc64nvme", lambda data: crt.crc64nvme(data).to_bytes(8, "big").hex()),
        ("crc32c", lambda data: crt.crc32c(data).to_bytes(4, "big").hex()),
        ("crc32", lambda data: zlib.crc32(data).to_bytes(4, "big").hex()),
        ("sha256", lambda data: hashlib.sha256(data).hexdigest()),
        ("md5", lambda data: hashlib.md5(data).hexdigest()),
    ],
)
def test_each_checksum_kind_finds_a_changed_byte(tmp_path: Path, kind: str, digest: Any) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)  # more than one read of the file back
    checksum = Checksum(kind, digest(data))
    assert _checked(tmp_path, data, RemoteFile("f", len(data), (checksum,))) == (None, checksum)
    changed = data[:-1] + bytes([data[-1] ^ 1])
    problem, matched = _checked(tmp_path, changed, RemoteFile("f", len(data), (checksum,)))
    assert matched is None
    assert problem == f"f: {kind} {digest(changed)}, the source says {checksum.value}"


def test_a_file_is_checked_against_its_first_checksum_only(tmp_path: Path) -> None:
    """The first is the cheapest; the others are recorded in the progress record, not computed."""
    data = b"weights"
    first = Checksum("crc32", zlib.crc32(data).to_bytes(4, "big").hex())
    assert _checked(tmp_path, data, RemoteFile("f", len(data), (first, Checksum("md5", "0" * 32)))) == (None, first)


@pytest.mark.parametrize("kind", ["crc64nvme", "crc32c", "crc32"])
def test_part_crcs_taken_as_they_arrived_combine_with_parts_read_back_into_the_files_crc(
    tmp_path: Path, kind: str
) -> None:
    """Parts 0 and 2 of 4 hashed as they arrived, parts 1 and 3 (the short last one) read back: the file's CRC. A
    part whose CRC is known but whose bytes on disk differ is not read again: what arrived is what was hashed."""
    part_size, data = 1024 * 1024, os.urandom(3 * 1024 * 1024 + 11)
    crc = crc_of(RemoteFile("f", len(data), (Checksum(kind, "0"),)), part_size)
    assert crc is not None
    width = 8 if kind == "crc64nvme" else 4
    checksum = Checksum(kind, crc(data, 0).to_bytes(width, "big").hex())
    file = RemoteFile("f", len(data), (checksum,))
    arrived = {0: crc(data[:part_size], 0), 2: crc(data[2 * part_size : 3 * part_size], 0)}
    path = tmp_path / "f"
    path.write_bytes(data[:part_size].replace(b"\0", b"\1") + data[part_size:])  # part 0's bytes: not read again
    fd = os.open(path, os.O_RDONLY)
    try:
        digest = Digest(file)
        for upto in (part_size, 3 * part_size, len(data)):  # fed as far as the file is written, part by part
            digest.feed(fd, upto, arrived, part_size)
        assert digest.check(fd) == (None, checksum)
    finally:
        os.close(fd)
    assert (
        crc_of(RemoteFile("f", 1, (Checksum("sha256", "0"), checksum)), part_size) is None
    )  # the first checksum decides


def _composite(kind: str, data: bytes, sizes: list[int]) -> tuple[list[tuple[int, dict[str, str]]], list[bytes]]:
    """The part HEADs S3 answers for ``data`` uploaded in parts of ``sizes`` with a COMPOSITE ``kind``."""
    digest: dict[str, Callable[[bytes], bytes]] = {
        "crc32": lambda b: zlib.crc32(b).to_bytes(4, "big"),
        "crc32c": lambda b: crt.crc32c(b).to_bytes(4, "big"),
        "sha1": lambda b: hashlib.sha1(b).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
    }
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    digests = [digest[kind](data[start : start + size]) for start, size in zip(starts, sizes, strict=True)]
    return [(size, {kind: base64.b64encode(d).decode()}) for size, d in zip(sizes, digests, strict=True)], digests


@pytest.mark.parametrize("kind", ["crc32", "crc32c", "sha1", "sha256"])
def test_a_composite_checksum_is_checked_by_each_parts_own_and_names_the_part_that_differs(
    tmp_path: Path, kind: str
) -> None:
    """As boto3's upload_file and the CLI leave a file over 8 MiB: its parts' own checksums, and S3's value of them
    (the checksum of the parts' checksums, -N). The whole file's checksum would be neither."""
    data, sizes = os.urandom(5000), [2048, 2048, 904]
    parts, digests = _composite(kind, data, sizes)
    (checksum,) = s3_checksums(etag="", part_size=2048, whole_b64={}, parts_b64=parts, encrypted=False)
    assert checksum.kind == f"composite-{kind}"
    assert checksum.parts == tuple((size, d.hex()) for size, d in zip(sizes, digests, strict=True))
    assert checksum.value.endswith("-3")
    assert checksum.as_json() == {"kind": f"composite-{kind}", "value": checksum.value, "part_sizes": sizes}
    file = RemoteFile("m.bin", len(data), (checksum,))
    assert _checked(tmp_path, data, file) == (None, checksum)
    wrong = data[:3000] + bytes([data[3000] ^ 1]) + data[3001:]
    problem, _ = _checked(tmp_path, wrong, file)
    assert problem is not None
    assert problem.startswith(f"m.bin: composite-{kind} ")
    assert "(part 2 of 3 differs" in problem


def test_a_composite_crc32_is_the_crc_of_the_parts_crcs_as_s3_shows_it() -> None:
    """S3's own example of a two-part upload can't be had offline; moto computes it as S3 documents (the CRC of the
    parts' CRCs joined), and so must this."""
    one, two = zlib.crc32(b"a").to_bytes(4, "big"), zlib.crc32(b"b").to_bytes(4, "big")
    assert composite_value("crc32", [one, two]) == f"{zlib.crc32(one + two):08x}-2"
    assert composite_value("crc32c", [one]) == f"{crt.crc32c(one):08x}-1"


def test_a_part_checksum_of_a_wrong_length_or_a_missing_one_gives_no_composite() -> None:
    parts = [(4, {"crc32": base64.b64encode(b"abcd").decode()}), (2, {"crc32": base64.b64encode(b"abc").decode()})]
    assert s3_checksums(etag="", part_size=4, whole_b64={}, parts_b64=parts, encrypted=False) == ()
    assert s3_checksums(etag="", part_size=4, whole_b64={}, parts_b64=[(4, {})], encrypted=False) == ()


@pytest.mark.parametrize(("upload_part", "arrival"), [(2 * 1024 * 1024, True), (1024 * 1024 + 512 * 1024, False)])
def test_a_composite_crc_takes_the_fetch_parts_crcs_where_each_lies_in_one_upload_part(
    tmp_path: Path, upload_part: int, arrival: bool
) -> None:
    """Fetch parts of 1 MiB in upload parts of 2 MiB: their CRCs, taken as they arrived, are combined per upload
    part and nothing is read back. In upload parts of 1.5 MiB a fetch part spans two: all of it is read back."""
    part_size, data = 1024 * 1024, os.urandom(5 * 1024 * 1024 + 11)
    sizes = [upload_part] * (len(data) // upload_part) + [len(data) % upload_part]
    parts, _ = _composite("crc32", data, sizes)
    (checksum,) = s3_checksums(etag="", part_size=upload_part, whole_b64={}, parts_b64=parts, encrypted=False)
    file = RemoteFile("f", len(data), (checksum,))
    crc = crc_of(file, part_size)
    assert (crc is not None) == arrival
    arrived = {i: zlib.crc32(data[i * part_size : (i + 1) * part_size]) for i in range(6)} if arrival else {}
    path = tmp_path / "f"
    path.write_bytes(data if not arrival else bytes(len(data)))  # zeros on disk: only what arrived can pass
    fd = os.open(path, os.O_RDONLY)
    try:
        digest = Digest(file)
        digest.feed(fd, len(data), arrived, part_size)
        assert digest.check(fd) == (None, checksum)
    finally:
        os.close(fd)


_HEADER_TEXT = st.one_of(st.text(max_size=60), st.sampled_from(["AAAAAA==", "AAAAAAAAAAA=", "AAAAAA==-2", ""]))


@given(
    whole=st.dictionaries(st.sampled_from(["crc64nvme", "crc32c", "crc32", "sha1", "sha256", "md5"]), _HEADER_TEXT),
    parts=st.lists(
        st.tuples(st.integers(0, 2**40), st.dictionaries(st.sampled_from(["crc32", "sha256"]), _HEADER_TEXT)),
        max_size=4,
    ),
    etag=st.text(max_size=40),
)
def test_s3_checksums_take_any_headers_without_raising(
    whole: dict[str, str], parts: list[tuple[int, dict[str, str]]], etag: str
) -> None:
    """Headers are the server's to send: whatever they hold, what they say is taken or passed over."""
    for found in s3_checksums(etag=etag, part_size=5, whole_b64=whole, parts_b64=parts, encrypted=False):
        assert found.kind.removeprefix("composite-") in (
            "crc64nvme",
            "crc32c",
            "crc32",
            "sha1",
            "sha256",
            "md5",
            "s3-multipart",
        )
        assert len(found.parts) in (0, len(parts))
