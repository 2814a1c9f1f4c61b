"""Checking a downloaded file before it is published: its size, what the source says it hashes to, and that a
``.safetensors`` file's header parses (8 bytes little-endian header length, then that much JSON whose tensors'
``data_offsets`` lie inside the file: https://github.com/huggingface/safetensors#format).

The file is read back in 1 MiB chunks (from the page cache, just written), never whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any

from agent.cache.fetch.sources import Checksum, RemoteFile

CHUNK = 1024 * 1024
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit


class _Hashes:
    """Every hash the checksums need, fed once over the file in order."""

    def __init__(self, file: RemoteFile) -> None:
        self.whole: dict[str, Any] = {}
        self.multipart: Checksum | None = None
        self.part_digests: list[bytes] = []
        self.part: Any = None
        self.part_left = 0
        for checksum in file.checksums:
            if checksum.kind == "s3-multipart":
                self.multipart = checksum
                self.part, self.part_left = hashlib.md5(), checksum.part_size
            elif checksum.kind == "git-sha1":
                self.whole["git-sha1"] = hashlib.sha1(f"blob {file.size}\0".encode())
            else:
                self.whole[checksum.kind] = hashlib.new(checksum.kind)

    def update(self, data: memoryview) -> None:
        for hasher in self.whole.values():
            hasher.update(data)
        while self.multipart is not None and data:
            taken, data = data[: self.part_left], data[self.part_left :]
            self.part.update(taken)
            self.part_left -= len(taken)
            if self.part_left == 0:
                self._next_part()

    def _next_part(self) -> None:
        assert self.multipart is not None
        self.part_digests.append(self.part.digest())
        self.part, self.part_left = hashlib.md5(), self.multipart.part_size

    def value(self, checksum: Checksum) -> str:
        if checksum.kind != "s3-multipart":
            return str(self.whole[checksum.kind].hexdigest())
        if self.part_left != checksum.part_size or not self.part_digests:
            self._next_part()
        return f"{hashlib.md5(b''.join(self.part_digests)).hexdigest()}-{len(self.part_digests)}"


def check_file(fd: int, file: RemoteFile) -> tuple[str | None, Checksum | None]:
    """(the problem, or None; the strongest checksum that matched, or None where the source gave none)."""
    size = os.fstat(fd).st_size
    if size != file.size:
        return f"{file.path}: {size} bytes, the source lists {file.size}", None
    hashes = _Hashes(file)
    if file.checksums:
        buffer = bytearray(CHUNK)
        offset = 0
        while offset < size:
            count = os.preadv(fd, [buffer], offset)
            if count == 0:
                return f"{file.path}: ended at {offset} of {size} bytes", None
            hashes.update(memoryview(buffer)[:count])
            offset += count
    for checksum in file.checksums:
        got = hashes.value(checksum)
        if got != checksum.value:
            return f"{file.path}: {checksum.kind} {got}, the source says {checksum.value}", None
    if file.path.endswith(".safetensors"):
        problem = safetensors_problem(fd, size)
        if problem is not None:
            return f"{file.path}: {problem}", None
    return None, file.checksums[0] if file.checksums else None


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
