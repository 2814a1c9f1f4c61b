"""Where a model lands before it is published, the per-model lock, and the one rename that publishes it.

``<cache>/models/.locks/NAME.lock`` (an fcntl lock, held for the whole fetch) makes one fetch per model per node;
``<cache>/models/.staging/NAME-<random>/`` holds the files and the progress record on the cache's own filesystem,
so publishing is ``rename(staging, <cache>/models/NAME)``: an engine sees all of the model or none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import structlog

from agent.cache.fetch.parts import MANIFEST, PROGRESS, manifest_problems, same_fetch

log = structlog.get_logger()
LOCK_POLL_S = 0.2


@contextlib.asynccontextmanager
async def model_lock(models: Path, name: str, *, on_wait: Callable[[str], None]) -> AsyncIterator[None]:
    """Hold ``.locks/NAME.lock`` while the block runs; waits (polling, so a cancel ends the wait) while another
    process holds it, telling ``on_wait`` once what the holder wrote (its pid)."""
    locks = models / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        told = False
        while not _try_lock(fd):
            if not told:
                on_wait(os.pread(fd, 64, 0).decode(errors="replace").strip())
                told = True
            await asyncio.sleep(LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None where there is none that parses."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` durably: a temporary file, fsynced, renamed over it, the directory fsynced."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as out:
        out.write(json.dumps(data, indent=1).encode())
        out.flush()
        os.fsync(out.fileno())
    temporary.replace(path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def published(target: Path) -> tuple[Any, list[str]]:
    """The manifest of the model at ``target`` and what is wrong with it ([] for a complete model; sizes only)."""
    record = read_json(target / MANIFEST)
    sizes: dict[str, int | None] = {}
    entries = record.get("files") if isinstance(record, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        path = entry.get("path") if isinstance(entry, dict) else None
        if isinstance(path, str):
            with contextlib.suppress(OSError):
                sizes[path] = (target / path).stat().st_size
    return record, manifest_problems(record, sizes)


def staging_dir(models: Path, name: str, source: str) -> tuple[Path, Any]:
    """A staging directory for NAME from ``source``: the one a killed fetch of the same left (with its record), else
    a new one. Staging directories of NAME from other sources, or without a record, are removed (the lock is ours)."""
    staging = models / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    found: tuple[Path, Any] | None = None
    for path in sorted(staging.iterdir()):
        if path.name.rpartition("-")[0] != name:
            continue
        record = read_json(path / PROGRESS)
        if found is None and same_fetch(record, name=name, source=source):
            found = (path, record)
            continue
        log.info("cache.fetch_staging_removed", path=str(path), reason="another source or no progress record")
        remove(path)
    if found is not None:
        return found
    path = staging / f"{name}-{secrets.token_hex(4)}"
    path.mkdir()
    return path, None


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def publish(staging: Path, target: Path, manifest: Any) -> None:
    """Write the manifest, fsync every directory of the staging tree, and rename it to ``target`` in one step.

    A model already at ``target`` (one that failed its check) is moved aside first and removed after.
    """
    (staging / PROGRESS).unlink(missing_ok=True)
    write_json(staging / MANIFEST, manifest)
    for directory, _, _ in os.walk(staging):
        fsync_dir(Path(directory))
    aside = None
    if target.exists():
        aside = staging.with_name(staging.name + "-old")
        target.rename(aside)
    staging.rename(target)
    fsync_dir(target.parent)
    fsync_dir(staging.parent)
    if aside is not None:
        remove(aside)
