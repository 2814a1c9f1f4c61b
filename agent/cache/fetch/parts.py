"""The part plan of a fetch and its progress record, as plain data (pure).

A file of ``size`` bytes is fetched as ranged requests of ``part_size`` bytes. The progress record lists, per file,
the parts whose bytes are on disk and fsynced; a fetch of the same model from the same source starts from it and
asks only for the other parts. A file whose size, checksums or part size changed since starts again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.cache.fetch.sources import Checksum, RemoteFile

PROGRESS = ".spotdrain-progress.json"
MANIFEST = ".spotdrain-manifest.json"
RECORD_VERSION = 1


@dataclass(frozen=True)
class Part:
    file: RemoteFile
    index: int
    start: int
    end: int  # exclusive

    @property
    def size(self) -> int:
        return self.end - self.start


def part_count(size: int, part_size: int) -> int:
    """An empty file is one empty part, so that it too is done by the same path."""
    return max(1, -(-size // part_size))


def parts_of(file: RemoteFile, part_size: int, *, skip: frozenset[int] = frozenset()) -> list[Part]:
    return [
        Part(file, index, index * part_size, min(file.size, (index + 1) * part_size))
        for index in range(part_count(file.size, part_size))
        if index not in skip
    ]


def _identity(file: RemoteFile, part_size: int) -> dict[str, Any]:
    return {
        "path": file.path,
        "size": file.size,
        "part_size": part_size,
        "checksums": [c.as_json() for c in file.checksums],
    }


def progress_record(
    *, name: str, source: str, files: list[RemoteFile], part_size: int, done: dict[str, frozenset[int]]
) -> dict[str, Any]:
    return {
        "version": RECORD_VERSION,
        "name": name,
        "source": source,
        "files": [{**_identity(f, part_size), "done": sorted(done.get(f.path, ()))} for f in files],
    }


def same_fetch(record: Any, *, name: str, source: str) -> bool:
    """Whether a staging directory's record is of this model from this source (and can be resumed)."""
    return (
        isinstance(record, dict)
        and record.get("version") == RECORD_VERSION
        and record.get("name") == name
        and record.get("source") == source
    )


def resumable(record: Any, files: list[RemoteFile], part_size: int) -> dict[str, frozenset[int]]:
    """The parts done of each file that is still the same file at the source, with the same part size."""
    entries = record.get("files") if isinstance(record, dict) else None
    by_path = {e.get("path"): e for e in entries if isinstance(e, dict)} if isinstance(entries, list) else {}
    done: dict[str, frozenset[int]] = {}
    for file in files:
        entry = by_path.get(file.path)
        if entry is None or {k: entry.get(k) for k in ("path", "size", "part_size", "checksums")} != _identity(
            file, part_size
        ):
            continue
        count = part_count(file.size, part_size)
        indices = entry.get("done")
        if isinstance(indices, list):
            done[file.path] = frozenset(i for i in indices if isinstance(i, int) and 0 <= i < count)
    return done


def manifest(
    *,
    source: str,
    revision: str | None,
    commit: str | None,
    files: list[RemoteFile],
    verified: dict[str, Checksum | None],
    at: str,
) -> dict[str, Any]:
    """The record published with the model: what it is, where from, and what each file was checked against."""
    return {
        "source": source,
        "revision": revision,
        "commit": commit,  # what a mirror's revision stood for when listed (its model info's ``sha``)
        "fetched_at": at,
        "files": [{"path": f.path, "size": f.size, "checksum": _plain(verified.get(f.path))} for f in files],
    }


def _plain(checksum: Checksum | None) -> dict[str, Any] | None:
    return None if checksum is None else checksum.as_json()


def manifest_problems(record: Any, sizes: dict[str, int | None]) -> list[str]:
    """What is wrong with a published model, by its manifest and the sizes on disk (None: missing); [] if nothing."""
    entries = record.get("files") if isinstance(record, dict) else None
    if not isinstance(entries, list) or not entries:
        return ["no readable manifest"]
    problems = []
    for entry in entries:
        path, size = (entry.get("path"), entry.get("size")) if isinstance(entry, dict) else (None, None)
        if not isinstance(path, str) or not isinstance(size, int):
            problems.append(f"a manifest entry without path and size: {entry!r}"[:200])
        elif sizes.get(path) != size:
            problems.append(f"{path}: {sizes.get(path)} bytes on disk, {size} in the manifest")
    return problems
