"""The model the ``cold-start`` scenario hydrates: a few MiB laid out as a Hugging Face checkpoint is, made from a
seed so that every run serves the same bytes; and what is checked of a copy of it.

Two ``.safetensors`` shards with valid headers (8 bytes little-endian header length, the JSON header padded with
spaces to 8 bytes, then the tensors' data: https://github.com/huggingface/safetensors#format), a ``config.json`` and
a ``tokenizer.json``. Random bytes stand for the weights: only the fake engine reads them.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = ".spotdrain-manifest.json"  # agent.cache.fetch.parts.MANIFEST; simulate/ never imports the agent
SHARDS = (  # (file, [(tensor, rows, columns)]) of F16 tensors
    (
        "model-00001-of-00002.safetensors",
        [("model.embed_tokens.weight", 512, 1024), ("model.layers.0.mlp.w", 512, 512)],
    ),
    ("model-00002-of-00002.safetensors", [("model.layers.1.mlp.w", 512, 1024), ("lm_head.weight", 256, 512)]),
)


@dataclass(frozen=True)
class Expected:
    size: int
    md5: str
    crc64nvme: str = ""  # hex; the source's only: a copy is compared by MD5

    def checksum(self, kind: str) -> str | None:
        """This file's checksum of ``kind`` as the fetch's manifest writes it, if it is one the source has."""
        return {"md5": self.md5, "crc64nvme": self.crc64nvme}.get(kind) or None


def safetensors(tensors: list[tuple[str, int, int]], rng: random.Random) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, rows, columns in tensors:
        size = rows * columns * 2
        header[name] = {"dtype": "F16", "shape": [rows, columns], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + rng.randbytes(offset)


def tiny_checkpoint(seed: int = 7) -> dict[str, bytes]:
    """The model's files by path, the same for the same seed."""
    rng = random.Random(seed)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 2, "vocab_size": 512}
    vocab = {f"<{index:03d}>": index for index in range(512)}
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    files = {
        "config.json": json.dumps(config, indent=2).encode(),
        "tokenizer.json": json.dumps(tokenizer).encode(),
    }
    for path, tensors in SHARDS:
        files[path] = safetensors(tensors, rng)
    return files


def expected(files: Mapping[str, bytes]) -> dict[str, Expected]:
    """Each file's size, MD5 and CRC64NVME, as the fake S3 gives them (ETag, ``x-amz-checksum-crc64nvme``)."""
    from awscrt import checksums as crt  # imported where used: `spotdrain simulate` runs without the node extra

    return {
        path: Expected(len(data), hashlib.md5(data).hexdigest(), crt.crc64nvme(data).to_bytes(8, "big").hex())
        for path, data in files.items()
    }


def copy_problems(source: Mapping[str, Expected], found: Mapping[str, Expected], manifest: Any) -> list[str]:
    """What is wrong with a copy of the model, by the source's sizes and MD5s, what is on disk, and the manifest the
    fetch published with it: every file of the source, its size, and the checksum the fetch checked it against,
    which must be one the source gives ([] for a whole, identical copy)."""
    problems = [f"{path}: missing" for path in sorted(source) if path not in found]
    problems += [f"{path}: not in the source" for path in sorted(found) if path not in source]
    for path in sorted(source.keys() & found.keys()):
        want, got = source[path], found[path]
        if got.size != want.size:
            problems.append(f"{path}: {got.size} bytes, the source has {want.size}")
        elif got.md5 != want.md5:
            problems.append(f"{path}: MD5 {got.md5}, the source's is {want.md5}")
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    entries = entries if isinstance(entries, list) else []
    listed = {str(e.get("path")): e.get("size") for e in entries if isinstance(e, dict)}
    if not listed:
        problems.append(f"{MANIFEST}: missing or without files")
    elif listed != {path: want.size for path, want in source.items()}:
        problems.append(f"{MANIFEST}: lists {sorted(listed)}, not the source's files with their sizes")
    for entry in (e for e in entries if isinstance(e, dict) and e.get("path") in source):
        checked = entry.get("checksum")
        kind, value = (str(checked.get("kind")), checked.get("value")) if isinstance(checked, dict) else ("none", None)
        if value is None or value != source[entry["path"]].checksum(kind):
            problems.append(f"{MANIFEST}: {entry['path']} checked against {kind} {value}, not the source's")
    return problems


def read_copy(directory: Path) -> tuple[dict[str, Expected], Any]:
    """The files under ``directory`` with their sizes and MD5s (but the manifest), and the manifest."""
    found = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if relative != MANIFEST:
            found[relative] = Expected(path.stat().st_size, _md5(path))
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError):
        manifest = None
    return found, manifest


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as data:
        while chunk := data.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def load(directory: Path) -> tuple[int, int]:
    """What the fake engine does with ``--model-dir``: read ``config.json`` and each shard's header, as an engine
    loading the checkpoint would; returns (files, bytes). ValueError says what is missing or unreadable."""
    try:
        json.loads((directory / "config.json").read_bytes())
    except (OSError, ValueError) as error:
        raise ValueError(f"{directory}: no readable config.json ({error})") from None
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{directory}: no .safetensors files")
    for shard in shards:
        with shard.open("rb") as data:
            (length,) = struct.unpack("<Q", data.read(8).ljust(8, b"\0"))
            try:
                json.loads(data.read(length))
            except ValueError as error:
                raise ValueError(f"{shard}: unreadable safetensors header ({error})") from None
    files = [p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST]
    return len(files), sum(p.stat().st_size for p in files)
