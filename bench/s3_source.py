"""The source side of ``bench.cache_fetch``: a model of safetensors files, and ``rclone serve s3`` serving it.

The model is written once per size and file count and kept (under ``/tmp`` by default), with the SHA-256 of each
file beside it, so that every run of the benchmark copies the same bytes and checks them against the same digests.
Its bytes are one random block stamped with its own offset every MiB, so a part written at another part's offset
changes the file's digest even though the blocks repeat.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
from awscrt import checksums
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

BUCKET = "bench"
PREFIX = "model/"
MIB = 1024**2
BLOCK = 16 * MIB
STAMP_EVERY = MIB
TENSOR_BYTES = 64 * MIB  # one tensor per 64 MiB, as a checkpoint has many
REGION = "us-east-1"


@dataclass(frozen=True)
class Model:
    root: Path  # served by rclone: top-level folders are buckets
    digests: dict[str, str]  # file name under the prefix: SHA-256
    sizes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    @property
    def files(self) -> list[Path]:
        return [self.root / BUCKET / PREFIX / name for name in sorted(self.sizes)]


def tool(name: str) -> str | None:
    """``name`` in the running venv's bin folder (where the ``bench`` extra installs it), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def safetensors_header(data_bytes: int, *, size: int | None = None) -> bytes:
    """The 8-byte length and JSON header of a file holding ``data_bytes`` of U8 tensors, padded with spaces to a
    multiple of 8 (or to ``size``), as the safetensors format allows."""
    tensors: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for index in range(max(1, -(-data_bytes // TENSOR_BYTES))):
        end = min(data_bytes, offset + TENSOR_BYTES)
        tensors[f"layers.{index}.weight"] = {"dtype": "U8", "shape": [end - offset], "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(tensors, separators=(",", ":")).encode()
    padded = size if size is not None else len(text) + (-len(text) % 8)
    if padded < len(text):
        raise ValueError(f"a header of {len(text)} bytes does not fit in {padded}")
    return struct.pack("<Q", padded) + text.ljust(padded, b" ")


def _header_for(file_bytes: int) -> bytes:
    """A header that leaves exactly ``file_bytes`` for header and data: fewer data bytes only shorten the JSON."""
    first = safetensors_header(file_bytes)
    return safetensors_header(file_bytes - len(first), size=len(first) - 8)


def _blocks(count: int, base: bytes, start: int) -> Iterator[bytes]:
    """``count`` bytes of ``base``, each MiB stamped with its offset in the file."""
    offset = start
    while offset < start + count:
        size = min(BLOCK, start + count - offset)
        block = bytearray(base[:size])
        for stamp in range(0, size, STAMP_EVERY):
            block[stamp : stamp + 8] = struct.pack("<Q", offset + stamp)[: size - stamp]
        yield bytes(block)
        offset += size


def _write_file(path: Path, file_bytes: int, base: bytes) -> str:
    header = _header_for(file_bytes)
    digest = hashlib.sha256(header)
    with path.open("wb") as out:
        out.write(header)
        for block in _blocks(file_bytes - len(header), base, len(header)):
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


def model(models_dir: Path, *, total_bytes: int, files: int) -> Model:
    """The model of ``files`` files totalling ``total_bytes``, written under ``models_dir`` unless already there."""
    root = models_dir / f"model-{total_bytes}-{files}"
    done = root / "digests.json"  # written last: its presence means the files are complete
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        (root / "served" / BUCKET / PREFIX).mkdir(parents=True)
        base = os.urandom(BLOCK)
        sizes = {f"model-{i + 1:05d}-of-{files:05d}.safetensors": total_bytes // files for i in range(files)}
        last = max(sizes)
        sizes[last] += total_bytes - sum(sizes.values())
        digests = {
            name: _write_file(root / "served" / BUCKET / PREFIX / name, size, base) for name, size in sizes.items()
        }
        done.write_text(json.dumps({"digests": digests, "sizes": sizes}))
    known = json.loads(done.read_text())
    return Model(root / "served", known["digests"], known["sizes"])


def digest_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(8 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def wrong_bytes(expected: Model, copied: Path) -> str | None:
    """What differs between the model and its copy under ``copied`` (size or digest of each file), or None."""
    for name, size in sorted(expected.sizes.items()):
        path = copied / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not {size}"
        if digest_of(path) != expected.digests[name]:
            return f"{name} has other bytes (SHA-256 differs)"
    return None


@dataclass(frozen=True)
class Server:
    url: str
    access_key: str
    secret_key: str
    pid: int
    version: str

    def env(self) -> dict[str, str]:
        """What every client gets: the server's keys and region, and no instance metadata lookups."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_listening(port: int, process: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if process.poll() is not None:
            raise RuntimeError(f"rclone serve s3 exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"rclone serve s3 did not listen on {port} within {timeout_s} s")


@contextmanager
def rclone_s3(rclone: str, root: Path, *, log_path: Path) -> Iterator[Server]:
    """``rclone serve s3`` over ``root`` on 127.0.0.1, with a key pair of its own and MD5 ETags (its default, and
    what S3 gives an object uploaded in one part); stopped at the end."""
    version = subprocess.run([rclone, "version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    port = _free_port()
    access, secret = f"BENCH{secrets.token_hex(8).upper()}", secrets.token_hex(20)
    argv = [rclone, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", f"{access},{secret}", str(root)]
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        _wait_listening(port, process, timeout_s=15)
        yield Server(f"http://127.0.0.1:{port}", access, secret, process.pid, version)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def keep_crc64nvme(server: Server, source: Model) -> str | None:
    """PUT every file of the model again through the server with its CRC64NVME, as S3 keeps one for every object
    uploaded since December 2024, so that ``HeadObject`` with ``ChecksumMode=ENABLED`` answers it beside the MD5 ETag.
    ``rclone serve s3`` keeps such a checksum in memory for as long as it runs (seen with rclone 1.75: gone after a
    restart), so this comes after every run that is to see MD5 ETags only. Why it could not be done, or None."""
    config = Config(request_checksum_calculation="when_required", retries={"max_attempts": 1})
    client = boto3.client(
        "s3",
        endpoint_url=server.url,
        region_name=REGION,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=config,
    )
    for path in source.files:
        data = path.read_bytes()  # rclone serve s3 writes the object to this same path: the bytes are read first
        value = base64.b64encode(checksums.crc64nvme(data).to_bytes(8, "big")).decode()
        key = f"{PREFIX}{path.name}"
        try:
            client.put_object(Bucket=BUCKET, Key=key, Body=data, ChecksumCRC64NVME=value)
            kept = client.head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED").get("ChecksumCRC64NVME")
        except (BotoCoreError, ClientError) as error:
            return f"{server.version} did not take {key} again with its CRC64NVME: {error}"
        if kept != value:
            return f"{server.version} did not keep the CRC64NVME it was given with the object (HeadObject: {kept!r})"
    return None
