"""Checking a downloaded file before it is published: its size, what the source says it hashes to, and that a
``.safetensors`` file's header parses (8 bytes little-endian header length, then that much JSON whose tensors'
``data_offsets`` lie inside the file: https://github.com/huggingface/safetensors#format).

A ``Digest`` is fed in order, as far as the file is written from its start, so a fetch hashes while the rest of the
file arrives and only the last stretch remains when its last part lands. A CRC is taken from each part's bytes as
they arrive (``crc_of``) and the parts' CRCs are combined in order, so the file is not read again; the other kinds,
and parts an earlier fetch left on disk, are read back in 1 MiB chunks (from the page cache, just written), never
whole. A composite checksum (S3's of a multipart upload with a CRC32, CRC32C, SHA-1 or SHA-256) is checked by the
upload's parts: each part's own checksum over its bytes, the parts' checksums then checked as S3 combines them. Its
fetch parts' CRCs are used as they arrived where each lies inside one of the upload's parts (an upload part size that
is a multiple of the fetch's), else its bytes are read back.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from awscrt import checksums as crt

from agent.cache.fetch.sources import Checksum, RemoteFile, composite_value

CHUNK = 1024 * 1024
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit
# One file is checked against its first checksum, the cheapest the source gives. This check, file read back from the
# page cache, on one core (bench/cache_fetch.py's checksum rows): CRC64NVME and CRC32C (awscrt) about 7,000 MiB/s,
# CRC32 (zlib) 1,900, SHA-256 1,400, MD5 630.
Crc = Callable[[Any, int], int]  # (bytes, the CRC so far) -> the CRC with them
_CRCS: dict[str, Crc] = {"crc64nvme": crt.crc64nvme, "crc32c": crt.crc32c, "crc32": zlib.crc32}
_CRC_BYTES = {"crc64nvme": 8, "crc32c": 4, "crc32": 4}
_COMBINE: dict[str, Callable[[int, int, int], int]] = {
    "crc64nvme": crt.combine_crc64nvme,
    "crc32c": crt.combine_crc32c,
    "crc32": crt.combine_crc32,
}


def crc_of(file: RemoteFile, part_size: int) -> Crc | None:
    """The CRC of the file's fetch parts (of ``part_size`` bytes) where the check can use them as they arrive: the
    file's checksum is a CRC, and a composite one's parts each hold whole fetch parts."""
    checksum = file.checksums[0] if file.checksums else None
    if checksum is None or checksum.algorithm not in _CRCS or checksum.kind == "s3-multipart":
        return None
    if any(size % part_size for size, _ in checksum.parts[:-1]):
        return None  # fetch parts that span two of the upload's are read back instead
    return _CRCS[checksum.algorithm]


class _Hash:
    """The running hash of one checksum, fed once over the file in order. An ``s3-multipart`` ETag or a composite
    checksum is hashed part by part (the upload's parts), each part's digest kept."""

    def __init__(self, checksum: Checksum, size: int) -> None:
        self.checksum = checksum
        self.algorithm = checksum.algorithm
        self.split = checksum.kind == "s3-multipart" or bool(checksum.parts)
        self.size = size
        self.part_digests: list[bytes] = []
        self.crc = 0  # the CRC kinds' running value, of the part being hashed where the checksum is split
        self.hasher: Any = None
        self.part_left = self.part_fed = 0
        self._start_part()

    def _start_part(self) -> None:
        self.crc, self.part_fed = 0, 0
        if self.checksum.parts:
            index = len(self.part_digests)
            self.part_left = self.checksum.parts[index][0] if index < len(self.checksum.parts) else self.size
        else:
            self.part_left = self.checksum.part_size
        if self.algorithm == "git-sha1":
            self.hasher = hashlib.sha1(f"blob {self.size}\0".encode())
        elif self.algorithm not in _CRCS:
            self.hasher = hashlib.new(self.algorithm)

    def update(self, data: memoryview) -> None:
        if not self.split:
            self._feed(data)
            return
        while data:
            taken, data = data[: self.part_left], data[self.part_left :]
            self._feed(taken)
            self.part_left -= len(taken)
            if self.part_left == 0:
                self._next_part()

    def _feed(self, data: memoryview) -> None:
        if self.algorithm in _CRCS:
            self.crc = _CRCS[self.algorithm](data, self.crc)
        else:
            self.hasher.update(data)
        self.part_fed += len(data)

    def can_combine(self, length: int) -> bool:
        """Whether ``length`` bytes more can be taken by their CRC: a split checksum's must end in one part."""
        return self.algorithm in _CRCS and (not self.split or length <= self.part_left)

    def combine(self, crc: int, length: int) -> None:
        """The CRC of ``length`` bytes more, taken as they arrived."""
        self.crc = _COMBINE[self.algorithm](self.crc, crc, length)
        self.part_fed += length
        if self.split:
            self.part_left -= length
            if self.part_left == 0:
                self._next_part()

    def _digest(self) -> bytes:
        if self.algorithm in _CRCS:
            return self.crc.to_bytes(_CRC_BYTES[self.algorithm], "big")
        return bytes(self.hasher.digest())

    def _next_part(self) -> None:
        self.part_digests.append(self._digest())
        self._start_part()

    def value(self) -> str:
        if not self.split:
            return self._digest().hex()
        if self.part_fed or not self.part_digests:
            self._next_part()
        if self.checksum.kind == "s3-multipart":
            return f"{hashlib.md5(b''.join(self.part_digests)).hexdigest()}-{len(self.part_digests)}"
        return composite_value(self.algorithm, self.part_digests)

    def problem(self) -> str | None:
        """What differs from the checksum, once every byte is fed; None if nothing."""
        got, checksum = self.value(), self.checksum
        if got == checksum.value:
            return None
        said = f"{checksum.kind} {got}, the source says {checksum.value}"
        listed = [value for _, value in checksum.parts]
        found = [digest.hex() for digest in self.part_digests]
        differs = next((i for i, (a, b) in enumerate(zip(found, listed, strict=False)) if a != b), None)
        if differs is not None:
            said += f" (part {differs + 1} of {len(listed)} differs: {found[differs]}, the source's {listed[differs]})"
        return said


class Digest:
    """The hashes of one file's checksums, fed from the file itself in order, as far as it has been written."""

    def __init__(self, file: RemoteFile) -> None:
        self.file = file
        self.offset = 0  # bytes hashed so far, from the start
        self._hash = _Hash(file.checksums[0], file.size) if file.checksums else None
        self._buffer = bytearray(CHUNK) if file.checksums else bytearray()

    def feed(self, fd: int, upto: int, parts: Mapping[int, int] | None = None, part_size: int = 0) -> None:
        """Hash the file's bytes from ``offset`` to ``upto``; raises OSError, or EOFError where the file ends first.

        ``parts``: the CRCs of whole parts (of ``part_size`` bytes) taken as they arrived, by index; those parts are
        not read."""
        if self._hash is None:
            self.offset = max(self.offset, upto)
            return
        while self.offset < upto:
            stop = min(upto, self.offset + CHUNK)
            if parts:
                index, into = divmod(self.offset, part_size)
                end = min((index + 1) * part_size, self.file.size)
                if into == 0 and index in parts and end <= upto and self._hash.can_combine(end - self.offset):
                    self._hash.combine(parts[index], end - self.offset)
                    self.offset = end
                    continue
                stop = min(stop, end)  # a read ends at the part's end: the next may be known
            view = memoryview(self._buffer)[: stop - self.offset]
            count = os.preadv(fd, [view], self.offset)
            if count == 0:
                raise EOFError(f"{self.file.path}: ended at {self.offset} of {upto} bytes")
            self._hash.update(view[:count])
            self.offset += count

    def check(self, fd: int) -> tuple[str | None, Checksum | None]:
        """Hash what is left and check the whole file: (the problem, or None; the checksum it matched, or None
        where the source gave none)."""
        file = self.file
        size = os.fstat(fd).st_size
        if size != file.size:
            return f"{file.path}: {size} bytes, the source lists {file.size}", None
        try:
            self.feed(fd, size)
        except EOFError as error:
            return str(error), None
        if self._hash is not None and (problem := self._hash.problem()) is not None:
            return f"{file.path}: {problem}", None
        if file.path.endswith(".safetensors"):
            problem = safetensors_problem(fd, size)
            if problem is not None:
                return f"{file.path}: {problem}", None
        return None, file.checksums[0] if file.checksums else None


def check_file(fd: int, file: RemoteFile) -> tuple[str | None, Checksum | None]:
    """A whole file's check at once (see ``Digest.check``)."""
    return Digest(file).check(fd)


def safetensors_problem(fd: int, size: int) -> str | None:
    """Why the file is not a safetensors file, or None."""
    if size < 8:
        return f"a safetensors file of {size} bytes has no header"
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > min(MAX_SAFETENSORS_HEADER, size - 8):
        return f"safetensors header length {length} does not fit in {size} bytes"
    try:
        header = json.loads(os.pread(fd, length, 8))
    except (UnicodeDecodeError, ValueError) as error:
        return f"safetensors header is not JSON: {error}"
    if not isinstance(header, dict):
        return "safetensors header is not a JSON object"
    data = size - 8 - length
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= data):
            return f"safetensors tensor {name!r} has data_offsets {offsets!r} outside the {data} bytes of data"
    return None
